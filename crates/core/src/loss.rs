//! Classification losses that honour soft targets: the one place where the class
//! distributions written by label smoothing, MixUp and CutMix meet a model's loss, and where
//! class indices become distributions ([`one_hot_classes`], [`one_hot_sequence`]), checked.
//!
//! Two layouts, as PyTorch and Composer use them: logits `[N, C]` with targets `[N]`, and
//! logits `[N, C, L]` (class scores for each of `L` positions, token models) with targets
//! `[N, L]`; the class axis is always axis 1. Losses are means over every scored position.
//!
//! Pure tensor functions; nothing here knows the trainer.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

pub use crate::cross_entropy::{
    check_class_indices, cross_entropy, cross_entropy_ignoring, one_hot_classes, one_hot_sequence,
    per_sample_cross_entropy, per_sample_cross_entropy_ignoring, per_sample_soft_cross_entropy,
    sequence_cross_entropy, sequence_soft_cross_entropy, soft_cross_entropy, IGNORE_INDEX,
};
use crate::model::ClassTargets;

/// The classification loss of `logits` on `batch`: soft cross-entropy when an algorithm has
/// set soft targets, plain cross-entropy on the class indices otherwise; when the batch has
/// padding ([`ClassTargets::ignore_index`]), the mean over the rows that are not padding.
pub fn classification_loss<B: Backend>(
    logits: Tensor<B, 2>,
    batch: &impl ClassTargets<B>,
) -> Tensor<B, 1> {
    match (batch.soft_targets(), batch.ignore_index()) {
        (Some(soft), None) => soft_cross_entropy(logits, soft.clone()),
        (None, None) => cross_entropy(logits, batch.classes().clone()),
        (None, Some(ignore)) => cross_entropy_ignoring(logits, batch.classes().clone(), ignore),
        (Some(_), Some(_)) => {
            let (losses, counted) = per_sample_classification_loss_counted(logits, batch);
            losses.sum() / counted.sum().clamp_min(1.0)
        }
    }
}

/// Per-sample classification loss, `[batch]`, with the same rule as [`classification_loss`]
/// (a padding row scores 0).
pub fn per_sample_classification_loss<B: Backend>(
    logits: Tensor<B, 2>,
    batch: &impl ClassTargets<B>,
) -> Tensor<B, 1> {
    per_sample_classification_loss_counted(logits, batch).0
}

/// Per-sample classification loss, `[batch]` (0 on padding rows), and the float mask of the
/// rows that count (all ones without padding).
pub fn per_sample_classification_loss_counted<B: Backend>(
    logits: Tensor<B, 2>,
    batch: &impl ClassTargets<B>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let classes = batch.classes().clone();
    let Some(ignore) = batch.ignore_index() else {
        let ones = Tensor::ones([classes.dims()[0]], &classes.device());
        let losses = match batch.soft_targets() {
            Some(soft) => per_sample_soft_cross_entropy(logits, soft.clone()),
            None => per_sample_cross_entropy(logits, classes),
        };
        return (losses, ones);
    };
    match batch.soft_targets() {
        None => per_sample_cross_entropy_ignoring(logits, classes, ignore),
        Some(soft) => {
            let counted = classes.equal_elem(ignore).bool_not().float();
            let losses = per_sample_soft_cross_entropy(logits, soft.clone()) * counted.clone();
            (losses, counted)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CoreError;
    use crate::model::{Batch, ClassificationBatch};
    use burn::backend::Flex;
    use burn::tensor::Int;
    use burn::tensor::TensorData;

    type B = Flex;

    fn logits() -> Tensor<B, 2> {
        Tensor::from_data(
            TensorData::new(vec![2.0f32, 0.0, -1.0, 0.5, 0.5, 0.5], [2, 3]),
            &Default::default(),
        )
    }

    #[test]
    fn cross_entropy_matches_the_formula() {
        // Sample 0: log-sum-exp(2, 0, -1) = ln(e^2 + 1 + e^-1); loss = lse - 2.
        let lse0 = (2f64.exp() + 1.0 + (-1f64).exp()).ln();
        // Sample 1: uniform logits over 3 classes; loss = ln 3.
        let expected = [lse0 - 2.0, 3f64.ln()];
        let t = Tensor::<B, 1, Int>::from_data(
            TensorData::new(vec![0i64, 2], [2]),
            &Default::default(),
        );
        let per = per_sample_cross_entropy(logits(), t.clone())
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for (a, e) in per.iter().zip(expected) {
            assert!((*a as f64 - e).abs() < 1e-6, "{a} vs {e}");
        }
        let mean: f32 = cross_entropy(logits(), t).into_scalar();
        assert!(((mean as f64) - (expected[0] + expected[1]) / 2.0).abs() < 1e-6);
    }

    #[test]
    fn negative_and_too_large_class_indices_are_errors_not_wrapped() {
        let dev = Default::default();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, -1, 2], [3]), &dev);
        let err = one_hot_classes(t, 3).unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::ClassIndex {
                    value: -1,
                    num_classes: 3
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("-1") && err.to_string().contains("0..3"),
            "{err}"
        );
        let t = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![0i64, 1, 3, 2], [2, 2]), &dev);
        let err = one_hot_sequence(t, 3).unwrap_err();
        assert!(
            matches!(err, CoreError::ClassIndex { value: 3, .. }),
            "{err}"
        );
        let batch = ClassificationBatch::new(
            Tensor::<B, 2>::zeros([2, 1], &dev),
            Tensor::<B, 1, Int>::from_data(TensorData::new(vec![1i64, -2], [2]), &dev),
        );
        assert!(matches!(
            batch.target_distribution(4),
            Err(CoreError::ClassIndex { value: -2, .. })
        ));
    }

    #[test]
    fn sequence_losses_match_the_formula_position_by_position() {
        let dev = Default::default();
        // N = 1, C = 3, L = 2: position 0 has the scores of sample 0 of `logits()`, position
        // 1 uniform scores; targets 0 and 2.
        let logits = Tensor::<B, 3>::from_data(
            TensorData::new(vec![2.0f32, 0.5, 0.0, 0.5, -1.0, 0.5], [1, 3, 2]),
            &dev,
        );
        let t = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![0i64, 2], [1, 2]), &dev);
        let lse0 = (2f64.exp() + 1.0 + (-1f64).exp()).ln();
        let want = ((lse0 - 2.0) + 3f64.ln()) / 2.0;
        let got: f32 = sequence_cross_entropy(logits.clone(), t.clone()).into_scalar();
        assert!((got as f64 - want).abs() < 1e-6, "{got} vs {want}");
        let one_hot = one_hot_sequence(t, 3).unwrap();
        assert_eq!(one_hot.dims(), [1, 3, 2]);
        assert_eq!(
            one_hot.clone().into_data().to_vec::<f32>().unwrap(),
            vec![1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        );
        let soft: f32 = sequence_soft_cross_entropy(logits, one_hot).into_scalar();
        assert!((soft as f64 - want).abs() < 1e-6, "{soft} vs {want}");
    }

    #[test]
    fn the_loss_marks_soft_targets_read_and_clones_and_slices_share_the_mark() {
        let dev = Default::default();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, 2], [2]), &dev);
        let mut batch = ClassificationBatch::new(Tensor::<B, 2>::zeros([2, 1], &dev), t);
        assert_eq!(batch.soft_targets_read(), None);
        let soft = batch.target_distribution(3).unwrap();
        batch.set_soft_targets(Some(soft.clone()));
        assert_eq!(batch.soft_targets_read(), Some(false));
        // A loss on the class indices alone does not read them.
        let _ = cross_entropy(logits(), batch.classes().clone());
        assert_eq!(batch.soft_targets_read(), Some(false));
        // A loss on a microbatch of a clone reads them for the batch too.
        let part = batch.clone().split(1).remove(1);
        let _ = classification_loss(logits().narrow(0, 1, 1), &part);
        assert_eq!(batch.soft_targets_read(), Some(true));
        // Setting new ones starts unread again.
        batch.set_soft_targets(Some(soft));
        assert_eq!(batch.soft_targets_read(), Some(false));
        let _ = per_sample_classification_loss(logits(), &batch);
        assert_eq!(batch.soft_targets_read(), Some(true));
    }

    #[test]
    fn soft_targets_replace_hard_ones_and_one_hot_agrees() {
        let dev = Default::default();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, 2], [2]), &dev);
        let mut batch = ClassificationBatch::new(Tensor::<B, 2>::zeros([2, 1], &dev), t);
        let hard: f32 = classification_loss(logits(), &batch).into_scalar();
        let one_hot = batch.target_distribution(3).unwrap();
        batch.set_soft_targets(Some(one_hot));
        let one_hot: f32 = classification_loss(logits(), &batch).into_scalar();
        assert!((hard - one_hot).abs() < 1e-6);
        // A half/half target on sample 0 between classes 0 and 1: loss = lse0 - (2 + 0) / 2.
        batch.set_soft_targets(Some(Tensor::from_data(
            TensorData::new(vec![0.5f32, 0.5, 0.0, 0.0, 0.0, 1.0], [2, 3]),
            &dev,
        )));
        let per = per_sample_classification_loss(logits(), &batch)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let lse0 = (2f64.exp() + 1.0 + (-1f64).exp()).ln();
        assert!((per[0] as f64 - (lse0 - 1.0)).abs() < 1e-6);
        assert!((per[1] as f64 - 3f64.ln()).abs() < 1e-6);
    }

    /// A padded token batch of two sequences of two positions: sequence 0 scores both
    /// positions, sequence 1 only its first (its second target is padding).
    fn padded_tokens() -> crate::model::TokenBatch<B> {
        let dev = Default::default();
        let tokens = Tensor::<B, 2, Int>::from_ints([[1, 2], [0, 0]], &dev);
        let targets = Tensor::<B, 2, Int>::from_ints([[0, 2], [1, IGNORE_INDEX]], &dev);
        crate::model::TokenBatch::padded(tokens, targets)
    }

    /// Four rows of three-class logits, one per position: rows 0-2 scored, row 3 padding.
    fn token_logits() -> Tensor<B, 2> {
        Tensor::from_data(
            TensorData::new(
                vec![
                    2.0f32, 0.0, -1.0, // target 0
                    0.5, 0.5, 0.5, // target 2
                    0.0, 1.0, 0.0, // target 1
                    9.0, -9.0, 3.0, // padding
                ],
                [4, 3],
            ),
            &Default::default(),
        )
    }

    #[test]
    fn padding_is_skipped_by_the_loss_and_not_counted() {
        let batch = padded_tokens();
        assert!(batch.is_padded());
        assert_eq!(batch.num_tokens(), 4);
        assert_eq!(batch.num_loss_tokens(), 3);
        assert_eq!(batch.ignore_index(), Some(IGNORE_INDEX));
        // By hand: lse(2, 0, -1) - 2, ln 3, and lse(0, 1, 0) - 1 = ln(2 + e) - 1.
        let rows = [
            (2f64.exp() + 1.0 + (-1f64).exp()).ln() - 2.0,
            3f64.ln(),
            (2.0 + 1f64.exp()).ln() - 1.0,
        ];
        let want = rows.iter().sum::<f64>() / 3.0;
        let got: f32 = classification_loss(token_logits(), &batch).into_scalar();
        assert!((f64::from(got) - want).abs() < 1e-6, "{got} against {want}");
        let per: Vec<f32> = per_sample_classification_loss(token_logits(), &batch)
            .into_data()
            .to_vec()
            .unwrap();
        for (a, e) in per.iter().zip(rows.iter().chain([&0.0])) {
            assert!((f64::from(*a) - e).abs() < 1e-6, "{per:?}");
        }
        // Soft targets (label smoothing 0.3 over three classes) on the padded batch: the
        // distribution's padding row is class 0's, and the loss skips it.
        let smooth = batch
            .target_distribution(3)
            .unwrap()
            .mul_scalar(0.7)
            .add_scalar(0.1);
        let mut soft = batch.clone();
        soft.set_soft_targets(Some(smooth.clone()));
        let logp: Vec<f64> = burn::tensor::activation::log_softmax(token_logits(), 1)
            .into_data()
            .iter::<f32>()
            .map(f64::from)
            .collect();
        let dist: Vec<f64> = smooth.into_data().iter::<f32>().map(f64::from).collect();
        let want = (0..3)
            .map(|r| {
                -(0..3)
                    .map(|c| dist[r * 3 + c] * logp[r * 3 + c])
                    .sum::<f64>()
            })
            .sum::<f64>()
            / 3.0;
        let got: f32 = classification_loss(token_logits(), &soft).into_scalar();
        assert!((f64::from(got) - want).abs() < 1e-6, "{got} against {want}");
        // The padding flag survives splitting, selecting and cutting.
        let parts = batch.clone().split(1);
        assert!(parts.iter().all(|p| p.is_padded()));
        assert_eq!(parts[0].num_loss_tokens(), 2);
        assert_eq!(parts[1].num_loss_tokens(), 1);
        use crate::model::{SelectSamples, SequenceBatch};
        let picked = batch
            .clone()
            .select(Tensor::<B, 1, Int>::from_ints([1], &Default::default()));
        assert_eq!((picked.is_padded(), picked.num_loss_tokens()), (true, 1));
        assert_eq!(batch.clone().truncate(1).num_loss_tokens(), 2);
        assert!(batch.fold(1).is_padded());
    }

    #[test]
    fn a_batch_of_padding_alone_scores_zero_with_zero_gradients() {
        type A = burn::backend::Autodiff<Flex>;
        let dev = Default::default();
        let logits = Tensor::<A, 2>::from_floats([[1.0, 2.0], [3.0, -1.0]], &dev).require_grad();
        let targets = Tensor::<A, 1, Int>::from_ints([IGNORE_INDEX, IGNORE_INDEX], &dev);
        let loss = cross_entropy_ignoring(logits.clone(), targets, IGNORE_INDEX);
        let value: f32 = loss.clone().into_scalar();
        assert_eq!(value, 0.0);
        let grads = loss.backward();
        let g: Vec<f32> = logits.grad(&grads).unwrap().into_data().to_vec().unwrap();
        assert!(g.iter().all(|v| *v == 0.0), "{g:?}");
    }
}
