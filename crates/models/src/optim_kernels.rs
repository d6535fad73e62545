//! One AdamW step over flat `f32` buffers: the kernel behind
//! [`ChannelsLastBackend::adamw_step`](crate::ops::ChannelsLastBackend::adamw_step) (which
//! [`crate::optim::FusedAdamW`] calls), and the same step through Burn's tensor ops
//! ([`burn_adamw_step`]), the default method and the reference.
//!
//! Written by hand because Burn's `AdamW` makes about fourteen passes per parameter, each on
//! one thread with a fresh buffer; here two passes in chunks on the threads (the moments,
//! then the parameter). Each value goes through Burn's operations in Burn's order, rounded to
//! `f32` as Burn's element-wise ops round them (scalars converted to `f32` first, no fused
//! multiply-adds), so the results are Burn's bits, for any number of threads.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::kernels::{write_each, written_chunks, written_chunks2};

/// One AdamW step's scalars: learning rate, step number (from 1) and the optimizer's
/// settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate `η`.
    pub lr: f64,
    /// Step number `t`, from 1 (the bias corrections' exponent).
    pub time: usize,
    /// `β₁`.
    pub beta_1: f32,
    /// `β₂`.
    pub beta_2: f32,
    /// `ε`.
    pub epsilon: f32,
    /// Weight decay `λ`.
    pub weight_decay: f32,
}

impl AdamWStep {
    /// The `f32` scalars Burn's ops multiply and divide by, computed as Burn's `AdamW`
    /// computes them (in `f32`, or in `f64` and then rounded, as its scalar ops take them).
    fn scalars(&self) -> Scalars {
        // Burn's `AdaptiveMomentumW` converts the step to `i32` for `powi`.
        let t = self.time as i32;
        let decay_rate = self.lr * f64::from(self.weight_decay);
        Scalars {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            factor_1: 1.0 - self.beta_1,
            factor_2: 1.0 - self.beta_2,
            correction_1: 1f32 - self.beta_1.powi(t),
            correction_2: 1f32 - self.beta_2.powi(t),
            epsilon: self.epsilon,
            keep: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
            lr: self.lr as f32,
        }
    }
}

/// [`AdamWStep`]'s scalars as the element-wise ops use them.
#[derive(Debug, Clone, Copy)]
struct Scalars {
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    /// `1 - η λ`, or none without decay (Burn leaves the parameter as it is then).
    keep: Option<f32>,
    lr: f32,
}

/// [`ChannelsLastBackend::adamw_step`] through Burn's tensor ops, in the order of Burn's
/// `AdamW` (its `AdaptiveMomentumW::transform` and `step`).
pub fn burn_adamw_step<B: Backend>(
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    moments: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    step: &AdamWStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let s = step.scalars();
    let (m1, m2) = match moments {
        Some((m1, m2)) => (
            m1.mul_scalar(s.beta_1)
                .add(grad.clone().mul_scalar(s.factor_1)),
            m2.mul_scalar(s.beta_2)
                .add(grad.square().mul_scalar(s.factor_2)),
        ),
        None => (
            grad.clone().mul_scalar(s.factor_1),
            grad.square().mul_scalar(s.factor_2),
        ),
    };
    let m1_hat = m1.clone().div_scalar(s.correction_1);
    let m2_hat = m2.clone().div_scalar(s.correction_2);
    let delta = m1_hat.div(m2_hat.sqrt().add_scalar(s.epsilon));
    let decayed = match s.keep {
        Some(keep) => param.mul_scalar(keep),
        None => param,
    };
    (decayed - delta.mul_scalar(s.lr), m1, m2)
}

/// Values per chunk: whole parameters up to 16k values run on one thread, larger ones on
/// several.
const CHUNK: usize = 1 << 14;

/// One AdamW step over flat `f32` buffers: the new parameter and moments (see
/// [`burn_adamw_step`] for the order of operations, which this follows value by value).
pub fn adamw_step(
    param: &[f32],
    grad: &[f32],
    moments: Option<(&[f32], &[f32])>,
    step: &AdamWStep,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = param.len();
    assert_eq!(grad.len(), n, "gradient of {n} values");
    if let Some((m1, m2)) = moments {
        assert_eq!((m1.len(), m2.len()), (n, n), "moments of {n} values");
    }
    let s = step.scalars();
    let (moment_1, moment_2) = written_chunks2((n, CHUNK), (n, CHUNK), |ci, m1_out, m2_out| {
        let at = ci * CHUNK;
        let g = &grad[at..][..m1_out.len()];
        match moments {
            Some((m1, m2)) => {
                let (m1, m2) = (&m1[at..][..g.len()], &m2[at..][..g.len()]);
                (
                    write_each(
                        m1_out,
                        m1.iter().zip(g).map(|(m, g)| m * s.beta_1 + g * s.factor_1),
                    ),
                    write_each(
                        m2_out,
                        m2.iter()
                            .zip(g)
                            .map(|(v, g)| v * s.beta_2 + (g * g) * s.factor_2),
                    ),
                )
            }
            None => (
                write_each(m1_out, g.iter().map(|g| g * s.factor_1)),
                write_each(m2_out, g.iter().map(|g| (g * g) * s.factor_2)),
            ),
        }
    });
    let (m1, m2) = (&moment_1, &moment_2);
    let new_param = written_chunks(n, CHUNK, |ci, out| {
        let at = ci * CHUNK;
        let len = out.len();
        let values = param[at..][..len]
            .iter()
            .zip(&m1[at..][..len])
            .zip(&m2[at..][..len])
            .map(|((&p, &m), &v)| {
                let delta = (m / s.correction_1) / ((v / s.correction_2).sqrt() + s.epsilon);
                let decayed = match s.keep {
                    Some(keep) => p * keep,
                    None => p,
                };
                decayed - delta * s.lr
            });
        write_each(out, values)
    });
    (new_param, moment_1, moment_2)
}

// The tests run on flex, whose element-wise ops the kernel must equal to the bit.
#[cfg(feature = "flex")]
#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type B = Flex;

    /// `n` values in [-1, 1] from a formula of `i`.
    fn wave(n: usize, i: u64) -> Vec<f32> {
        (0..n)
            .map(|k| (k as f32 * 0.37 + i as f32 * 1.3).sin())
            .collect()
    }

    fn bits<const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
        t.into_data().iter::<f32>().map(f32::to_bits).collect()
    }

    /// The kernel against Burn's composition on flat buffers of odd lengths around the chunk
    /// size, first step and later ones, on 1, 2 and 4 threads: the same bits.
    #[test]
    fn the_kernel_equals_burns_composition_for_any_thread_count() {
        let d = Default::default();
        let tensor =
            |v: &[f32]| Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &d);
        for n in [1, 17, CHUNK - 1, CHUNK, 3 * CHUNK + 5] {
            let (p, g, m1) = (wave(n, 1), wave(n, 2), wave(n, 3));
            let m2: Vec<f32> = wave(n, 4).iter().map(|v| v * v).collect();
            for (time, moments) in [(1, None), (7, Some((&m1[..], &m2[..])))] {
                let step = AdamWStep {
                    lr: 3e-3,
                    time,
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-5,
                    weight_decay: 0.1,
                };
                let (bp, bm1, bm2) = burn_adamw_step::<B>(
                    tensor(&p),
                    tensor(&g),
                    moments.map(|(a, b)| (tensor(a), tensor(b))),
                    &step,
                );
                let want = [bits(bp), bits(bm1), bits(bm2)];
                for threads in [1, 2, 4] {
                    let got = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap()
                        .install(|| adamw_step(&p, &g, moments, &step));
                    for (part, (a, b)) in [got.0, got.1, got.2].iter().zip(&want).enumerate() {
                        let a: Vec<u32> = a.iter().map(|v| v.to_bits()).collect();
                        assert!(
                            &a == b,
                            "n {n}, step {time}, {threads} threads: part {part}"
                        );
                    }
                }
            }
        }
    }
}
