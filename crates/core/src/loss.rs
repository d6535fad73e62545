//! Classification losses that honour soft targets: the one place where the class
//! distributions written by label smoothing, MixUp and CutMix meet a model's loss.
//!
//! Pure tensor functions; nothing here knows the trainer.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::model::ClassTargets;

/// Mean cross-entropy of `logits` `[batch, classes]` against class indices `[batch]`.
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    per_sample_cross_entropy(logits, targets).mean()
}

/// Cross-entropy of each sample, `[batch]`.
pub fn per_sample_cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let n = targets.dims()[0];
    log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1]))
        .reshape([n])
        .neg()
}

/// Mean cross-entropy of `logits` against class distributions `[batch, classes]`:
/// `-mean_b sum_c p[b, c] * log_softmax(logits)[b, c]`.
pub fn soft_cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 2>) -> Tensor<B, 1> {
    per_sample_soft_cross_entropy(logits, targets).mean()
}

/// Soft cross-entropy of each sample, `[batch]`.
pub fn per_sample_soft_cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 2>,
) -> Tensor<B, 1> {
    let n = targets.dims()[0];
    (log_softmax(logits, 1) * targets)
        .sum_dim(1)
        .reshape([n])
        .neg()
}

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
    use crate::model::ClassificationBatch;
    use burn::backend::Flex;
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
    fn soft_targets_replace_hard_ones_and_one_hot_agrees() {
        let dev = Default::default();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, 2], [2]), &dev);
        let mut batch = ClassificationBatch::new(Tensor::<B, 2>::zeros([2, 1], &dev), t);
        let hard: f32 = classification_loss(logits(), &batch).into_scalar();
        batch.soft_targets = Some(batch.target_distribution(3));
        let one_hot: f32 = classification_loss(logits(), &batch).into_scalar();
        assert!((hard - one_hot).abs() < 1e-6);
        // A half/half target on sample 0 between classes 0 and 1: loss = lse0 - (2 + 0) / 2.
        batch.soft_targets = Some(Tensor::from_data(
            TensorData::new(vec![0.5f32, 0.5, 0.0, 0.0, 0.0, 1.0], [2, 3]),
            &dev,
        ));
        let per = per_sample_classification_loss(logits(), &batch)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let lse0 = (2f64.exp() + 1.0 + (-1f64).exp()).ln();
        assert!((per[0] as f64 - (lse0 - 1.0)).abs() < 1e-6);
        assert!((per[1] as f64 - 3f64.ln()).abs() < 1e-6);
    }
}
