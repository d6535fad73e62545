//! Cross-entropy of `f32` logits against class indices: the CPU fast path's fused kernels
//! behind [`ChannelsLastBackend::cross_entropy`](crate::ops::ChannelsLastBackend::cross_entropy),
//! the language model's loss over its vocabulary. Written by hand because Burn's composition
//! (log-softmax, gather, mean: `flashover_core::loss::cross_entropy`) makes about ten passes
//! over the logits forward and as many backward, each on one thread with a fresh buffer;
//! here the forward pass reads each row once and keeps only its log-sum-exp, and the
//! backward pass writes the gradient in one pass, recomputing the softmax from it.
//!
//! The formula is PyTorch's `cross_entropy` with mean reduction (and Composer's language
//! models' loss): per row `r` with target `t`, `loss_r = lse_r - x[r, t]`, where
//! `lse_r = m + ln Σ_c e^(x[r, c] - m)` and `m` is the row's largest logit; the loss is the
//! mean of `loss_r` over the rows. Its gradient for an output gradient `g` is
//! `(softmax(x_r) - onehot(t)) · g / rows`.
//!
//! **Determinism.** Rows are cut into chunks of [`ROWS`] (a function of nothing); each
//! row's maximum and sum run in 16 lanes folded in a fixed order (`kernels::lane_sum`), and
//! the rows' losses are added in order, in `f64`, so the results are bit-identical for any
//! number of threads.
//!
//! **Vectors.** Each chunk's rows run through `pulp`, compiled for the CPU's widest vector
//! extension (the workspace builds for plain x86-64), as the attention's softmax does.

use crate::kernels::{exp_f32, lane_max, lane_sum_zip, write_each, written_chunks};

/// Rows per chunk: with a vocabulary of a hundred classes, a few tens of kilobytes of logits,
/// in cache between the passes over a row, and enough chunks for the threads.
const ROWS: usize = 64;

/// The shape of a cross-entropy: `rows` rows of logits over `classes` classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassesShape {
    /// Rows (scored positions).
    pub rows: usize,
    /// Classes per row.
    pub classes: usize,
}

/// Panics, naming the row and the value, unless the logits and targets fit `s` and every
/// target is a class (callers with untrusted targets check them first, with a typed error:
/// `flashover_core::loss::check_class_indices`).
fn check(s: &ClassesShape, logits: &[f32], targets: &[i64]) {
    assert_eq!(logits.len(), s.rows * s.classes, "logits of {s:?}");
    assert_eq!(targets.len(), s.rows, "targets of {s:?}");
    if let Some((r, t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as u64 >= s.classes as u64)
    {
        panic!(
            "the target of row {r} is {t}, outside the classes 0..{}",
            s.classes
        );
    }
}

/// The mean cross-entropy of the rows of `logits` against `targets`, and each row's
/// log-sum-exp (which the backward pass needs). No rows: the mean of nothing, NaN, as
/// Burn's and PyTorch's mean.
pub fn cross_entropy_forward(s: &ClassesShape, logits: &[f32], targets: &[i64]) -> (f32, Vec<f32>) {
    check(s, logits, targets);
    if s.rows == 0 {
        return (f32::NAN, Vec::new());
    }
    let c = s.classes;
    let lse = written_chunks(s.rows, ROWS, |ci, dst| {
        let rows = logits[ci * ROWS * c..][..dst.len() * c].chunks_exact(c);
        write_each(dst, rows.map(log_sum_exp))
    });
    let total: f64 = lse
        .iter()
        .zip(logits.chunks_exact(c))
        .zip(targets)
        .map(|((&m, row), &t)| f64::from(m - row[t as usize]))
        .sum();
    ((total / s.rows as f64) as f32, lse)
}

/// `m + ln Σ e^(v - m)` for the largest `m` of `v` (minus infinity for no classes, the log
/// of an empty sum).
#[inline(always)]
fn log_sum_exp(v: &[f32]) -> f32 {
    let m = lane_max(v);
    if m == f32::NEG_INFINITY {
        // No classes, or every logit minus infinity: `v - m` would be NaN.
        return m;
    }
    m + lane_sum_zip(v, v, |x, _| exp_f32(x - m)).ln()
}

/// The gradient of [`cross_entropy_forward`]'s mean for its output gradient `grad`:
/// `(softmax(row) - onehot(target)) · grad / rows`, each row's softmax `e^(x - lse)` from
/// the forward's log-sum-exp `lse`.
pub fn cross_entropy_backward(
    s: &ClassesShape,
    logits: &[f32],
    targets: &[i64],
    lse: &[f32],
    grad: f32,
) -> Vec<f32> {
    check(s, logits, targets);
    assert_eq!(lse.len(), s.rows, "log-sum-exp of {s:?}");
    let c = s.classes;
    if c == 0 {
        return Vec::new();
    }
    let scale = grad / s.rows as f32;
    written_chunks(s.rows * c, ROWS * c, |ci, dst| {
        let first = ci * ROWS;
        // The chunk's logits copied in, then turned into the gradient in place.
        let block = write_each(dst, logits[first * c..][..dst.len()].iter().copied());
        pulp::Arch::new().dispatch(GradRows {
            block: &mut *block,
            lse: &lse[first..],
            targets: &targets[first..],
            classes: c,
            scale,
        });
        block
    })
}

/// [`cross_entropy_backward`] on a block of rows holding their logits, in place. Run through
/// `pulp` (a type whose `with_simd` is inlined into each variant, as the attention's
/// softmax rows).
struct GradRows<'a> {
    block: &'a mut [f32],
    lse: &'a [f32],
    targets: &'a [i64],
    classes: usize,
    scale: f32,
}

impl pulp::WithSimd for GradRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let scale = self.scale;
        let rows = self.block.chunks_exact_mut(self.classes);
        for ((row, &m), &t) in rows.zip(self.lse).zip(self.targets) {
            // `check` found every target in `0..classes`.
            let target = row[t as usize];
            row.iter_mut().for_each(|v| *v = exp_f32(*v - m) * scale);
            row[t as usize] = (exp_f32(target - m) - 1.0) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "the target of row 1 is 3, outside the classes 0..3")]
    fn a_target_outside_the_classes_is_named() {
        let s = ClassesShape {
            rows: 2,
            classes: 3,
        };
        cross_entropy_forward(&s, &[0.0; 6], &[0, 3]);
    }

    #[test]
    fn no_rows_is_the_mean_of_nothing() {
        let s = ClassesShape {
            rows: 0,
            classes: 5,
        };
        let (loss, lse) = cross_entropy_forward(&s, &[], &[]);
        assert!(loss.is_nan() && lse.is_empty());
        assert!(cross_entropy_backward(&s, &[], &[], &[], 1.0).is_empty());
    }

    /// Equal logits: every row's log-sum-exp is `x + ln classes`, its loss `ln classes`,
    /// and the gradient `1/classes - onehot` over the rows.
    #[test]
    fn equal_logits_give_the_log_of_the_classes() {
        let s = ClassesShape {
            rows: 130,
            classes: 7,
        };
        let logits = vec![2.5f32; 130 * 7];
        let targets: Vec<i64> = (0..130).map(|r| r % 7).collect();
        let (loss, lse) = cross_entropy_forward(&s, &logits, &targets);
        assert!((loss - 7f32.ln()).abs() < 1e-6, "{loss}");
        assert!(lse.iter().all(|&m| (m - (2.5 + 7f32.ln())).abs() < 1e-6));
        let g = cross_entropy_backward(&s, &logits, &targets, &lse, 130.0);
        for (r, row) in g.chunks_exact(7).enumerate() {
            for (c, v) in row.iter().enumerate() {
                let want = 1.0 / 7.0 - f32::from(c as i64 == targets[r]);
                assert!(
                    (v - want).abs() < 1e-6,
                    "row {r} class {c}: {v} against {want}"
                );
            }
        }
    }
}
