//! The cross-entropy functions on tensors and the checked one-hot encodings, which know
//! nothing of batches: [`crate::loss`] re-exports them beside the losses that read a batch's
//! targets, and the model's target types use them directly (so that `model` and `loss` do not
//! import each other).

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor};

use crate::error::{CoreError, Result};

/// The target that marks a padding position in a token batch (PyTorch's, Hugging Face's and
/// Composer's `ignore_index`): not scored by the loss and not counted by the language-model
/// metrics (see [`cross_entropy_ignoring`] and `TokenBatch::padded`).
pub const IGNORE_INDEX: i64 = -100;

/// Checks that every class index in `targets` lies in `0..num_classes`, with one read-back of
/// the smallest and largest index. A negative index is an error, never wrapped to the last
/// classes (these functions take no ignore index; the `_ignoring` ones below do).
pub fn check_class_indices<B: Backend, const D: usize>(
    targets: &Tensor<B, D, Int>,
    num_classes: usize,
) -> Result<()> {
    let n = targets.shape().num_elements();
    if n == 0 {
        return Ok(());
    }
    let flat = targets.clone().reshape([n]);
    let ends = Tensor::cat(vec![flat.clone().min(), flat.max()], 0);
    let ends: Vec<i64> = ends.into_data().iter::<i64>().map(|v| v.elem()).collect();
    let bad = ends
        .iter()
        .copied()
        .find(|&v| v < 0 || v as u64 >= num_classes as u64);
    match bad {
        None => Ok(()),
        Some(value) => Err(CoreError::ClassIndex { value, num_classes }),
    }
}

/// Class indices `[N]` as one-hot distributions `[N, C]`; an index outside `0..C` is an
/// error naming it.
pub fn one_hot_classes<B: Backend>(
    targets: Tensor<B, 1, Int>,
    num_classes: usize,
) -> Result<Tensor<B, 2>> {
    check_class_indices(&targets, num_classes)?;
    Ok(targets.one_hot::<2>(num_classes).float())
}

/// Class indices `[N, L]` as one-hot distributions `[N, C, L]` (classes on axis 1, as token
/// logits `[N, C, L]` have them); an index outside `0..C` is an error naming it.
pub fn one_hot_sequence<B: Backend>(
    targets: Tensor<B, 2, Int>,
    num_classes: usize,
) -> Result<Tensor<B, 3>> {
    check_class_indices(&targets, num_classes)?;
    Ok(targets.one_hot_fill::<3>(num_classes, 1.0, 0.0, 1).float())
}

/// Mean cross-entropy of token logits `[N, C, L]` against class indices `[N, L]`, over all
/// `N * L` positions.
pub fn sequence_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [n, l] = targets.dims();
    log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1, l]))
        .mean()
        .neg()
}

/// Mean cross-entropy of token logits `[N, C, L]` against distributions `[N, C, L]`:
/// `-mean_{n,l} sum_c p[n, c, l] * log_softmax(logits)[n, c, l]`.
pub fn sequence_soft_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 3>,
) -> Tensor<B, 1> {
    (log_softmax(logits, 1) * targets).sum_dim(1).mean().neg()
}

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

/// Cross-entropy of each row of `logits` `[N, C]` against class indices `[N]`, where a row
/// whose target is `ignore_index` scores 0; and, beside it, the float mask of the rows that
/// count (1 where the target is not `ignore_index`). The ignored rows are gathered at class 0
/// and then zeroed, so `ignore_index` may lie outside `0..C` (it usually is -100).
pub fn per_sample_cross_entropy_ignoring<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore_index: i64,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let ignored = targets.clone().equal_elem(ignore_index);
    let counted = ignored.clone().bool_not().float();
    let safe = targets.mask_fill(ignored, 0);
    let losses = per_sample_cross_entropy(logits, safe) * counted.clone();
    (losses, counted)
}

/// Mean cross-entropy of `logits` `[N, C]` against class indices `[N]` over the rows whose
/// target is not `ignore_index` (PyTorch's `cross_entropy(..., ignore_index=-100)`): their
/// summed loss over their count. A batch with no counted row scores 0 with zero gradients
/// (PyTorch gives NaN there; a microbatch of padding alone must not poison the step).
pub fn cross_entropy_ignoring<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore_index: i64,
) -> Tensor<B, 1> {
    let (losses, counted) = per_sample_cross_entropy_ignoring(logits, targets, ignore_index);
    losses.sum() / counted.sum().clamp_min(1.0)
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
