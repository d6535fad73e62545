//! Layer normalisation on `f32` rows: the CPU fast path's fused kernels behind
//! [`ChannelsLastBackend::layer_norm_rows`](crate::ops::ChannelsLastBackend::layer_norm_rows). Written
//! by hand because Burn's composition of the same formula (mean, subtraction, square, mean,
//! square root, division, scale, shift: `norm.rs`) makes eight passes over the activations,
//! eight allocations and eight graph nodes, each on one thread; here the forward pass is one
//! read and one write per row, and the backward pass two reads.
//!
//! The formula is Burn's and PyTorch's (Ba et al., 2016): per row, `mean` and the biased
//! variance `var`, `std = sqrt(var + eps)`, `y = (x - mean) / std * gamma + beta`. The
//! backward pass, with `x̂ = (x - mean) / std` and `ĝ = dy * gamma`:
//! `dx = (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)) / std`, `dgamma = Σ_rows dy x̂`, `dbeta = Σ_rows dy`.
//!
//! **Determinism.** Rows are cut into chunks of [`ROWS`] (a function of nothing), each
//! row's sums run in 16 lanes folded in a fixed order (`kernels::lane_sum`), and the
//! parameter gradients are summed per chunk (in the input gradient's pass, when the input
//! needs one) and then over the chunks in order, so the
//! results are bit-identical for any number of threads.
//!
//! **Vectors.** Each chunk's rows run through `pulp` ([`NormRows`]), compiled for the CPU's
//! widest vector extension (the workspace builds for plain x86-64, whose SSE2 does 4 lanes
//! where AVX-512 does 16).

use crate::kernels::{
    for_each_item, lane_sum, lane_sum_zip, sum_parts, zeroed_chunks, zeroed_chunks2, LayerGrads,
};

/// Rows per chunk: a few hundred kilobytes of a transformer's activations, and enough
/// chunks for the threads.
const ROWS: usize = 64;

/// The shape of a layer norm: `rows` rows of `width` features each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsShape {
    /// Rows (every leading axis folded in).
    pub rows: usize,
    /// Features per row, normalised together.
    pub width: usize,
}

/// One row's mean and `sqrt(var + eps)`, the sums in lanes.
#[inline(always)]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = lane_sum(x) / n;
    let var = lane_sum_zip(x, x, |v, _| (v - mean) * (v - mean)) / n;
    (mean, (var + eps).sqrt())
}

/// One chunk of a layer norm's rows, forward (`y` and the statistics from `x`) or backward
/// (`dx` from `x`, the statistics and `dy`), as `pulp` runs it: a type whose `with_simd` is
/// inlined into each variant `pulp` compiles.
enum NormRows<'a> {
    Forward {
        x: &'a [f32],
        gamma: &'a [f32],
        beta: &'a [f32],
        eps: f32,
        y: &'a mut [f32],
        stats: &'a mut [f32],
    },
    /// With `sums` (`2 * width` values, zero), the chunk's parameter gradients are added
    /// there in the same pass: `Σ dy x̂`, then `Σ dy`, rows in order.
    Backward {
        x: &'a [f32],
        gamma: &'a [f32],
        stats: &'a [f32],
        dy: &'a [f32],
        dx: &'a mut [f32],
        sums: Option<&'a mut [f32]>,
    },
}

impl pulp::WithSimd for NormRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        match self {
            NormRows::Forward {
                x,
                gamma,
                beta,
                eps,
                y,
                stats,
            } => {
                let w = gamma.len();
                for ((y, x), st) in y
                    .chunks_exact_mut(w)
                    .zip(x.chunks_exact(w))
                    .zip(stats.chunks_exact_mut(2))
                {
                    let (mean, std) = row_stats(x, eps);
                    st[0] = mean;
                    st[1] = std;
                    for (((y, x), g), b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                        *y = (x - mean) / std * g + b;
                    }
                }
            }
            NormRows::Backward {
                x,
                gamma,
                stats,
                dy,
                dx,
                mut sums,
            } => {
                let w = gamma.len();
                let n = w as f32;
                let rows = dx
                    .chunks_exact_mut(w)
                    .zip(x.chunks_exact(w))
                    .zip(dy.chunks_exact(w))
                    .zip(stats.chunks_exact(2));
                for (((dx, x), dy), st) in rows {
                    let (mean, std) = (st[0], st[1]);
                    // ĝ = dy * gamma into `dx` first, then its sum and its dot with x̂.
                    for ((d, dy), g) in dx.iter_mut().zip(dy).zip(gamma) {
                        *d = dy * g;
                    }
                    let sum_gx = lane_sum_zip(dx, x, |g, x| g * ((x - mean) / std));
                    let (mean_g, mean_gx) = (lane_sum(dx) / n, sum_gx / n);
                    match sums.as_deref_mut() {
                        None => {
                            for (d, x) in dx.iter_mut().zip(x) {
                                let xh = (x - mean) / std;
                                *d = (*d - mean_g - xh * mean_gx) / std;
                            }
                        }
                        Some(sums) => {
                            let (dg, db) = sums.split_at_mut(w);
                            let terms = dx.iter_mut().zip(x).zip(dy).zip(dg).zip(db);
                            for ((((d, x), dy), g), b) in terms {
                                let xh = (x - mean) / std;
                                *d = (*d - mean_g - xh * mean_gx) / std;
                                *g += dy * xh;
                                *b += dy;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Layer norm of the rows of `x` with scale `gamma` and shift `beta`: the output and, per
/// row, its mean and standard deviation (`[mean, std]` pairs), which the backward pass needs.
pub fn layer_norm_forward(
    s: &RowsShape,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let w = s.width;
    assert_eq!(x.len(), s.rows * w, "input of {s:?}");
    assert_eq!(gamma.len(), w, "scale of {s:?}");
    assert_eq!(beta.len(), w, "shift of {s:?}");
    if w == 0 {
        return (Vec::new(), vec![0.0; 2 * s.rows]);
    }
    zeroed_chunks2(
        (s.rows * w, ROWS * w),
        (2 * s.rows, 2 * ROWS),
        |ci, out, stats| {
            pulp::Arch::new().dispatch(NormRows::Forward {
                x: &x[ci * ROWS * w..][..out.len()],
                gamma,
                beta,
                eps,
                y: out,
                stats,
            });
        },
    )
}

/// Gradients of [`layer_norm_forward`] for the output gradient `grad`, from its input, scale
/// and per-row statistics: `x` of the input, `weight` of the scale and `bias` of the shift,
/// each only when `needs` asks (input, scale, shift).
pub fn layer_norm_backward(
    s: &RowsShape,
    x: &[f32],
    gamma: &[f32],
    stats: &[f32],
    grad: &[f32],
    needs: [bool; 3],
) -> LayerGrads {
    let w = s.width;
    assert_eq!(x.len(), s.rows * w, "input of {s:?}");
    assert_eq!(grad.len(), s.rows * w, "output gradient of {s:?}");
    assert_eq!(gamma.len(), w, "scale of {s:?}");
    assert_eq!(stats.len(), 2 * s.rows, "statistics of {s:?}");
    let backward = |ci: usize, dx: &mut [f32], sums: Option<&mut [f32]>| {
        let (first, rows) = (ci * ROWS, dx.len() / w);
        pulp::Arch::new().dispatch(NormRows::Backward {
            x: &x[first * w..][..rows * w],
            gamma,
            stats: &stats[2 * first..][..2 * rows],
            dy: &grad[first * w..][..rows * w],
            dx,
            sums,
        });
    };
    let params = (needs[1] || needs[2]) && w > 0;
    if needs[0] && params {
        // One pass: each chunk's input gradient and its parameter sums, while its rows are
        // in cache (a second pass over the activations for the sums, on scalar code, cost
        // as much as the input gradient).
        let chunks = s.rows.div_ceil(ROWS);
        let (dx, partial) = zeroed_chunks2(
            (s.rows * w, ROWS * w),
            (chunks * 2 * w, 2 * w),
            |ci, dx, sums| backward(ci, dx, Some(sums)),
        );
        let (dg, db) = add_chunk_sums(&partial, w);
        return LayerGrads {
            x: Some(dx),
            weight: needs[1].then_some(dg),
            bias: needs[2].then_some(db),
        };
    }
    let dx = (needs[0] && w > 0)
        .then(|| zeroed_chunks(s.rows * w, ROWS * w, |ci, dx| backward(ci, dx, None)));
    let (dgamma, dbeta) = if params {
        let (dg, db) = parameter_grads(s, x, stats, grad);
        (needs[1].then_some(dg), needs[2].then_some(db))
    } else {
        (
            needs[1].then(|| vec![0.0; w]),
            needs[2].then(|| vec![0.0; w]),
        )
    };
    LayerGrads {
        x: dx.or_else(|| needs[0].then(Vec::new)),
        weight: dgamma,
        bias: dbeta,
    }
}

/// `Σ_rows dy x̂` and `Σ_rows dy`: each chunk of rows sums its own (rows in order), then the
/// chunks' sums are added in chunk order.
fn parameter_grads(s: &RowsShape, x: &[f32], stats: &[f32], grad: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let w = s.width;
    let chunks = s.rows.div_ceil(ROWS);
    // Per chunk: `w` sums of `dy x̂`, then `w` sums of `dy`.
    let mut partial = vec![0.0f32; chunks * 2 * w];
    for_each_item(partial.chunks_mut(2 * w).enumerate(), |(ci, sums)| {
        let (dg, db) = sums.split_at_mut(w);
        let end = ((ci + 1) * ROWS).min(s.rows);
        for row in ci * ROWS..end {
            let x = &x[row * w..][..w];
            let dy = &grad[row * w..][..w];
            let (mean, std) = (stats[2 * row], stats[2 * row + 1]);
            for (((g, b), x), dy) in dg.iter_mut().zip(db.iter_mut()).zip(x).zip(dy) {
                *g += dy * ((x - mean) / std);
                *b += dy;
            }
        }
    });
    add_chunk_sums(&partial, w)
}

/// The chunks' parameter sums (`2 * w` per chunk: `Σ dy x̂`, then `Σ dy`) added in chunk
/// order; zeros for no rows.
fn add_chunk_sums(partial: &[f32], w: usize) -> (Vec<f32>, Vec<f32>) {
    if partial.is_empty() {
        return (vec![0.0; w], vec![0.0; w]);
    }
    let mut dgamma = sum_parts(partial, 2 * w);
    let dbeta = dgamma.split_off(w);
    (dgamma, dbeta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formula in `f64`, written out, for a reference.
    fn reference(x: &[f64], gamma: &[f64], beta: &[f64], eps: f64) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let std = (var + eps).sqrt();
        x.iter()
            .zip(gamma)
            .zip(beta)
            .map(|((x, g), b)| (x - mean) / std * g + b)
            .collect()
    }

    #[test]
    fn a_row_worked_by_hand() {
        // x = [1, 2, 3, 6]: mean 3, variance (4 + 1 + 0 + 9) / 4 = 3.5; with eps 0.5, std 2:
        // x̂ = [-1, -0.5, 0, 1.5]; scale 2 and shift 1 give [-1, 0, 1, 4].
        let s = RowsShape { rows: 1, width: 4 };
        let (y, stats) = layer_norm_forward(&s, &[1.0, 2.0, 3.0, 6.0], &[2.0; 4], &[1.0; 4], 0.5);
        assert_eq!(y, vec![-1.0, 0.0, 1.0, 4.0]);
        assert_eq!(stats, vec![3.0, 2.0]);
        // With dy = [1, 0, 0, 0] and gamma 2: ĝ = [2, 0, 0, 0], mean(ĝ) = 0.5,
        // mean(ĝ x̂) = -0.5: dx = (ĝ - 0.5 + 0.5 x̂) / 2 = [0.5, -0.375, -0.25, 0.125];
        // dgamma = dy x̂ = [-1, 0, 0, 0], dbeta = dy.
        let g = layer_norm_backward(
            &s,
            &[1.0, 2.0, 3.0, 6.0],
            &[2.0; 4],
            &stats,
            &[1.0, 0.0, 0.0, 0.0],
            [true; 3],
        );
        assert_eq!(g.x.unwrap(), vec![0.5, -0.375, -0.25, 0.125]);
        assert_eq!(g.weight.unwrap(), vec![-1.0, 0.0, 0.0, 0.0]);
        assert_eq!(g.bias.unwrap(), vec![1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn odd_shapes_match_the_formula_and_finite_differences() {
        for (rows, width) in [(1, 1), (3, 5), (70, 7), (129, 33)] {
            let s = RowsShape { rows, width };
            let x: Vec<f32> = (0..rows * width)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                .collect();
            let gamma: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 / 10.0).collect();
            let beta: Vec<f32> = (0..width).map(|i| i as f32 / 7.0 - 0.3).collect();
            let (y, stats) = layer_norm_forward(&s, &x, &gamma, &beta, 1e-5);
            let g64: Vec<f64> = gamma.iter().map(|&v| v as f64).collect();
            let b64: Vec<f64> = beta.iter().map(|&v| v as f64).collect();
            for r in 0..rows {
                let row: Vec<f64> = x[r * width..][..width].iter().map(|&v| v as f64).collect();
                let want = reference(&row, &g64, &b64, 1e-5);
                for (got, want) in y[r * width..][..width].iter().zip(&want) {
                    assert!(
                        (*got as f64 - want).abs() < 1e-5,
                        "{rows}x{width}: {got} vs {want}"
                    );
                }
            }
            // The gradient of L = Σ y · c for a fixed c, against central differences in f64.
            let c: Vec<f32> = (0..rows * width)
                .map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0)
                .collect();
            let g = layer_norm_backward(&s, &x, &gamma, &stats, &c, [true; 3]);
            let (dx, dg, db) = (g.x.unwrap(), g.weight.unwrap(), g.bias.unwrap());
            let loss = |x: &[f64], g: &[f64], b: &[f64]| -> f64 {
                (0..rows)
                    .map(|r| {
                        reference(&x[r * width..][..width], g, b, 1e-5)
                            .iter()
                            .zip(&c[r * width..][..width])
                            .map(|(y, c)| y * *c as f64)
                            .sum::<f64>()
                    })
                    .sum()
            };
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let h = 1e-6;
            for i in (0..rows * width).step_by(7) {
                let (mut up, mut down) = (x64.clone(), x64.clone());
                up[i] += h;
                down[i] -= h;
                let fd = (loss(&up, &g64, &b64) - loss(&down, &g64, &b64)) / (2.0 * h);
                assert!(
                    (dx[i] as f64 - fd).abs() < 2e-3 * (1.0 + fd.abs()),
                    "dx[{i}] {} vs {fd}",
                    dx[i]
                );
            }
            for j in 0..width {
                let (mut up, mut down) = (g64.clone(), g64.clone());
                up[j] += h;
                down[j] -= h;
                let fd = (loss(&x64, &up, &b64) - loss(&x64, &down, &b64)) / (2.0 * h);
                assert!(
                    (dg[j] as f64 - fd).abs() < 1e-3 * (1.0 + fd.abs()),
                    "dgamma[{j}] {} vs {fd}",
                    dg[j]
                );
                let want_db: f64 = (0..rows).map(|r| c[r * width + j] as f64).sum();
                assert!((db[j] as f64 - want_db).abs() < 1e-4 * (1.0 + want_db.abs()));
            }
        }
    }

    /// The parameter gradients summed in the input gradient's pass (when the input needs
    /// one) are the separate pass's to the bit: the same terms, chunks and order.
    #[test]
    fn the_fused_parameter_sums_equal_the_separate_pass() {
        let s = RowsShape {
            rows: 200,
            width: 37,
        };
        let x: Vec<f32> = (0..s.rows * s.width)
            .map(|i| (i as f32 * 0.29).sin())
            .collect();
        let gamma: Vec<f32> = (0..s.width).map(|i| 0.7 + i as f32 / 40.0).collect();
        let grad: Vec<f32> = (0..s.rows * s.width)
            .map(|i| (i as f32 * 0.13).cos())
            .collect();
        let (_, stats) = layer_norm_forward(&s, &x, &gamma, &vec![0.0; s.width], 1e-5);
        let fused = layer_norm_backward(&s, &x, &gamma, &stats, &grad, [true; 3]);
        let params = layer_norm_backward(&s, &x, &gamma, &stats, &grad, [false, true, true]);
        let input = layer_norm_backward(&s, &x, &gamma, &stats, &grad, [true, false, false]);
        assert_eq!(fused.x, input.x);
        assert_eq!(fused.weight, params.weight);
        assert_eq!(fused.bias, params.bias);
        assert_eq!(fused.weight.as_ref().map(Vec::len), Some(s.width));
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let s = RowsShape {
            rows: 300,
            width: 48,
        };
        let x: Vec<f32> = (0..s.rows * s.width)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let gamma: Vec<f32> = (0..s.width).map(|i| 1.0 + i as f32 / 50.0).collect();
        let beta = vec![0.1f32; s.width];
        let grad: Vec<f32> = (0..s.rows * s.width)
            .map(|i| (i as f32 * 0.11).cos())
            .collect();
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| {
                    let (y, stats) = layer_norm_forward(&s, &x, &gamma, &beta, 1e-5);
                    let g = layer_norm_backward(&s, &x, &gamma, &stats, &grad, [true; 3]);
                    (y, stats, g.x, g.weight, g.bias)
                })
        };
        let one = run(1);
        for threads in [2, 4] {
            assert!(run(threads) == one, "{threads} threads");
        }
    }
}
