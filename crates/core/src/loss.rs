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
    check_class_indices, cross_entropy, one_hot_classes, one_hot_sequence,
    per_sample_cross_entropy, per_sample_soft_cross_entropy, sequence_cross_entropy,
    sequence_soft_cross_entropy, soft_cross_entropy,
};
use crate::model::ClassTargets;

/// The classification loss of `logits` on `batch`: soft cross-entropy when an algorithm has
/// set soft targets, plain cross-entropy on the class indices otherwise.
pub fn classification_loss<B: Backend>(
    logits: Tensor<B, 2>,
    batch: &impl ClassTargets<B>,
) -> Tensor<B, 1> {
    match batch.soft_targets() {
        Some(soft) => soft_cross_entropy(logits, soft.clone()),
        None => cross_entropy(logits, batch.classes().clone()),
    }
}

/// Per-sample classification loss, `[batch]`, with the same rule as [`classification_loss`].
pub fn per_sample_classification_loss<B: Backend>(
    logits: Tensor<B, 2>,
    batch: &impl ClassTargets<B>,
) -> Tensor<B, 1> {
    match batch.soft_targets() {
        Some(soft) => per_sample_soft_cross_entropy(logits, soft.clone()),
        None => per_sample_cross_entropy(logits, batch.classes().clone()),
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
}
