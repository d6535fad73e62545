//! The transformer's fast-path ops against Burn's own, on odd shapes: the dense layer with
//! fused GELU, the dense layer with a residual added, the fused layer norm and the fused
//! cross-entropy, forward values and every gradient through Burn's autodiff; GELU and its
//! derivative against Burn's; the cross-entropy against values worked by hand; bit-identical
//! results for 1, 2 and 4 threads. (The whole GPT, fast against Burn's ops, is tested in
//! `src/gpt.rs`.)
//!
//! Tolerance: both sides compute the same f32 sums in other orders (the products' and the
//! rows' statistics); with inputs in [-1, 1] and at most a few hundred terms per value, the
//! differences stay below 1e-4 (a wrong index or a missing term is of order 0.1 to 1). A layer
//! norm's input gradient is the exception: a difference of terms of size `|dy γ| / std`, which
//! reach about 600 in a row of nearly equal values (`std` near `sqrt(eps)`) and cancel there,
//! so its bound is 1e-4 of that size, row by row (proptest found width-2 rows whose gradients,
//! 316 and 1.4, differed by 4.8e-4 and 1.4e-4 between the two float32 orders). The fused GELU's
//! `erf` is within 1.5e-7 of the exact one, which adds nothing visible here.

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::module::linear;
use burn::tensor::ops::ActivationOps;
use burn::tensor::{Tensor, TensorPrimitive};
use flashover_models::ops::{self, ChannelsLastBackend};
use proptest::prelude::*;

mod common;
use common::random;

type B = Flex;
type AB = Autodiff<Flex>;

const TOL: f32 = 1e-4;

fn values<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= TOL, "{what}: largest difference {worst} > {TOL}");
}

fn float<Bk: Backend, const D: usize>(p: burn::tensor::ops::FloatTensor<Bk>) -> Tensor<Bk, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// Output and gradients of a dense layer `layer(x, w, b, r)` of random inputs, weights and
/// (with `bias`) biases, and (with `residual`) a residual `[rows, d_out]`: output, input,
/// weight, then the residual's and the bias's gradients where they are.
fn dense_layer_through(
    [rows, d_in, d_out]: [usize; 3],
    bias: bool,
    residual: bool,
    seed: u64,
    layer: impl FnOnce(
        Tensor<AB, 2>,
        Tensor<AB, 2>,
        Option<Tensor<AB, 1>>,
        Option<Tensor<AB, 2>>,
    ) -> Tensor<AB, 2>,
) -> Vec<Vec<f32>> {
    let x = random::<AB, 2>([rows, d_in], seed).require_grad();
    let w = random::<AB, 2>([d_in, d_out], seed + 1).require_grad();
    let b = bias.then(|| random::<AB, 1>([d_out], seed + 2).require_grad());
    let r = residual.then(|| random::<AB, 2>([rows, d_out], seed + 4).require_grad());
    let y = layer(x.clone(), w.clone(), b.clone(), r.clone());
    let probe = random::<AB, 2>(y.dims(), seed + 3);
    let grads = (y.clone() * probe).sum().backward();
    let mut out = vec![
        values(y.inner()),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
    ];
    out.extend(r.map(|r| values(r.grad(&grads).unwrap())));
    out.extend(b.map(|b| values(b.grad(&grads).unwrap())));
    out
}

/// Output and gradients (input, weight, bias) of `gelu(x · w + b)`, through the fast op or
/// Burn's `linear` and `gelu`.
fn dense_gelu_through(shape: [usize; 3], bias: bool, seed: u64, fast: bool) -> Vec<Vec<f32>> {
    dense_layer_through(shape, bias, false, seed, |x, w, b, _| match fast {
        true => float(AB::dense_gelu(
            x.into_primitive().tensor(),
            w.into_primitive().tensor(),
            b.map(|b| b.into_primitive().tensor()),
        )),
        false => gelu(linear(x, w, b)),
    })
}

/// Output and gradients (input, weight, residual, bias) of `r + (x · w + b)`, through the
/// fast op or Burn's `linear` and add.
fn dense_residual_through(shape: [usize; 3], bias: bool, seed: u64, fast: bool) -> Vec<Vec<f32>> {
    dense_layer_through(shape, bias, true, seed, |x, w, b, r| {
        // Invariant: asked for with a residual.
        let r = r.expect("a residual");
        match fast {
            true => float(AB::dense_residual(
                x.into_primitive().tensor(),
                w.into_primitive().tensor(),
                b.map(|b| b.into_primitive().tensor()),
                r.into_primitive().tensor(),
            )),
            false => r + linear(x, w, b),
        }
    })
}

/// Logits `[rows, classes]` in [-4, 4] and targets for the cross-entropy tests: target `r`
/// is a function of the seed and the row.
fn classes_input(
    [rows, classes]: [usize; 2],
    seed: u64,
) -> (Tensor<AB, 2>, Tensor<AB, 1, burn::tensor::Int>) {
    let logits = random::<AB, 2>([rows, classes], seed).mul_scalar(4.0);
    let targets: Vec<i64> = (0..rows as u64)
        .map(|r| ((r * 7 + seed * 13) % classes as u64) as i64)
        .collect();
    let targets = Tensor::from_data(
        burn::tensor::TensorData::new(targets, [rows]),
        &Default::default(),
    );
    (logits, targets)
}

/// The loss and the logits' gradient (for an output gradient of 1.7) of the mean
/// cross-entropy, through the fast op or Burn's composition (`flashover_core`'s, which the
/// GPT ran before the fused one).
fn cross_entropy_through(shape: [usize; 2], seed: u64, fast: bool) -> Vec<Vec<f32>> {
    let (logits, targets) = classes_input(shape, seed);
    let logits = logits.require_grad();
    let loss: Tensor<AB, 1> = if fast {
        flashover_models::layers::cross_entropy(logits.clone(), targets)
    } else {
        flashover_core::loss::cross_entropy(logits.clone(), targets)
    };
    let grads = loss.clone().mul_scalar(1.7).sum().backward();
    vec![values(loss.inner()), values(logits.grad(&grads).unwrap())]
}

/// Output and gradients (input, scale, shift) of a layer norm over the rows of `x`, through
/// the fast op or Burn's tensor ops (`ops::burn_layer_norm`, the composition the model ran
/// before the fused kernel).
/// The layer norm tests' input, `[rows, width]` values in [-2.5, 3.5].
fn layer_norm_x<Bk: Backend>([rows, width]: [usize; 2], seed: u64) -> Tensor<Bk, 2> {
    random::<Bk, 2>([rows, width], seed)
        .mul_scalar(3.0)
        .add_scalar(0.5)
}

/// [`layer_norm_x`]'s values in `f64`.
fn layer_norm_input(shape: [usize; 2], seed: u64) -> Vec<f64> {
    values(layer_norm_x::<B>(shape, seed))
        .into_iter()
        .map(f64::from)
        .collect()
}

fn layer_norm_through([rows, width]: [usize; 2], seed: u64, fast: bool) -> Vec<Vec<f32>> {
    let x = layer_norm_x::<AB>([rows, width], seed).require_grad();
    let gamma = random::<AB, 1>([width], seed + 1)
        .add_scalar(1.0)
        .require_grad();
    let beta = random::<AB, 1>([width], seed + 2).require_grad();
    let (xp, gp, bp) = (
        x.clone().into_primitive().tensor(),
        gamma.clone().into_primitive().tensor(),
        beta.clone().into_primitive().tensor(),
    );
    let y: Tensor<AB, 2> = if fast {
        float(AB::layer_norm_rows(xp, gp, bp, 1e-5))
    } else {
        float(ops::burn_layer_norm::<AB>(xp, gp, bp, 1e-5).0)
    };
    let probe = random::<AB, 2>(y.dims(), seed + 3);
    let grads = (y.clone() * probe).sum().backward();
    vec![
        values(y.inner()),
        values(x.grad(&grads).unwrap()),
        values(gamma.grad(&grads).unwrap()),
        values(beta.grad(&grads).unwrap()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Shapes around the chunk sizes (16 rows; 128 input features and columns in blocks of
    /// 32 or more for the weight gradient) and odd ones.
    #[test]
    fn the_dense_layer_with_gelu_and_its_gradients_match_burns(
        rows in prop_oneof![1usize..=5, 14usize..=35],
        d_in in prop_oneof![1usize..=9, 120usize..=200],
        d_out in prop_oneof![1usize..=13, 30usize..=100],
        bias in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let want = dense_gelu_through([rows, d_in, d_out], bias, seed, false);
        let got = dense_gelu_through([rows, d_in, d_out], bias, seed, true);
        let names = ["output", "input gradient", "weight gradient", "bias gradient"];
        for ((g, w), name) in got.iter().zip(&want).zip(names) {
            assert_close(g, w, &format!("{name} of [{rows}, {d_in}] x [{d_in}, {d_out}]"));
        }
    }

    /// The same shapes as the dense layer with GELU: the residual's gradient is the output
    /// gradient itself, the others the plain layer's.
    #[test]
    fn the_dense_layer_with_a_residual_and_its_gradients_match_burns(
        rows in prop_oneof![1usize..=5, 14usize..=35],
        d_in in prop_oneof![1usize..=9, 120usize..=200],
        d_out in prop_oneof![1usize..=13, 30usize..=100],
        bias in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let want = dense_residual_through([rows, d_in, d_out], bias, seed, false);
        let got = dense_residual_through([rows, d_in, d_out], bias, seed, true);
        let names = ["output", "input gradient", "weight gradient", "residual gradient", "bias gradient"];
        prop_assert_eq!(got.len(), want.len());
        for ((g, w), name) in got.iter().zip(&want).zip(names) {
            assert_close(g, w, &format!("{name} of [{rows}, {d_in}] x [{d_in}, {d_out}]"));
        }
        // Bias and residual are added in the order of a separate add: the same bits.
        prop_assert_eq!(&got[0], &want[0]);
    }

    /// Rows around the chunk size (64) and vocabularies from 1 class up.
    #[test]
    fn the_cross_entropy_and_its_gradient_match_burns(
        rows in prop_oneof![1usize..=4, 60usize..=140],
        classes in prop_oneof![1usize..=9, 60usize..=130],
        seed in 0u64..1000,
    ) {
        let want = cross_entropy_through([rows, classes], seed, false);
        let got = cross_entropy_through([rows, classes], seed, true);
        for ((g, w), name) in got.iter().zip(&want).zip(["loss", "logits' gradient"]) {
            assert_close(g, w, &format!("{name} of [{rows}, {classes}]"));
        }
    }

    /// Rows around the chunk size (64) and widths from 1 up.
    #[test]
    fn the_layer_norm_and_its_gradients_match_burns(
        rows in prop_oneof![1usize..=4, 60usize..=140],
        width in prop_oneof![1usize..=9, 60usize..=130],
        seed in 0u64..1000,
    ) {
        let want = layer_norm_through([rows, width], seed, false);
        let got = layer_norm_through([rows, width], seed, true);
        let names = ["output", "input gradient", "scale gradient", "shift gradient"];
        for (i, ((g, w), name)) in got.iter().zip(&want).zip(names).enumerate() {
            if i != 1 {
                assert_close(g, w, &format!("{name} of [{rows}, {width}]"));
                continue;
            }
            // The input gradient is a difference of terms of size |dy γ| / std (at most 2 /
            // std here), which cancel where a row's values are nearly equal (std near
            // sqrt(eps)): each row's bound is 1e-4 of that size.
            let x = layer_norm_input([rows, width], seed);
            for r in 0..rows {
                let row = &x[r * width..][..width];
                let mean = row.iter().sum::<f64>() / width as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
                let terms = (2.0 / (var + 1e-5).sqrt()).max(1.0) as f32;
                for j in r * width..(r + 1) * width {
                    prop_assert!(
                        (g[j] - w[j]).abs() <= TOL * terms,
                        "input gradient of [{rows}, {width}], row {r}: {} vs {} (bound {})",
                        g[j], w[j], TOL * terms
                    );
                }
            }
        }
    }
}

/// A batch of a language model's size takes the large chunks of rows: the same values as
/// Burn's ops there too.
///
/// 1100 rows cut the weight gradient into two pieces of 550 rows; 4100 rows into eight of
/// 513, the last of 509.
#[test]
fn a_large_batch_of_rows_matches_burns_ops() {
    for shape in [[1100, 24, 40], [4100, 20, 36]] {
        let want = dense_gelu_through(shape, true, 5, false);
        let got = dense_gelu_through(shape, true, 5, true);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(g, w, &format!("dense with GELU {shape:?}, part {i}"));
        }
        let want = dense_residual_through(shape, true, 6, false);
        let got = dense_residual_through(shape, true, 6, true);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(g, w, &format!("dense with residual {shape:?}, part {i}"));
        }
    }
}

/// The fused GELU and its derivative against Burn's (`libm`'s `erff`, within a few ulp of
/// the exact function) over a dense grid of pre-activations, the saturated tails, zero and
/// NaN: Abramowitz and Stegun's `erf` is within 1.5e-7 absolute (3e-7 with its float32
/// rounding), so GELU is within `1.5e-7 |z|` plus rounding, and the derivative (at most
/// 1.13) within about 3e-7.
#[test]
fn the_fused_gelu_and_its_derivative_match_the_exact_function() {
    use flashover_models::kernels::{exp_f32, gelu as fused, gelu_grad};
    let mut zs: Vec<f32> = (-4000..=4000).map(|i| i as f32 / 400.0).collect();
    zs.extend([-40.0, -12.0, -0.0, 1e-8, -1e-8, 12.0, 40.0, 88.0, -88.0]);
    let d = Default::default();
    let z = Tensor::<B, 1>::from_floats(zs.as_slice(), &d);
    let want = values(gelu(z.clone()));
    let ones = Tensor::<B, 1>::ones([zs.len()], &d);
    let want_grad = values(float::<B, 1>(B::gelu_backward(
        z.into_primitive().tensor(),
        ones.into_primitive().tensor(),
    )));
    for ((&z, w), wg) in zs.iter().zip(&want).zip(&want_grad) {
        let got = fused(z);
        // erf's error (the formula's 1.5e-7, plus its float32 rounding near ±1: a few
        // 6e-8) times 0.5 |z|, and each side's rounding of the result (a few ulp).
        let bound = 1.5e-7 * z.abs() + 4.0 * f32::EPSILON * w.abs();
        assert!((got - w).abs() <= bound, "gelu({z}) = {got}, Burn's {w}");
        let g = gelu_grad(z, 1.0);
        assert!((g - wg).abs() <= 3e-7, "gelu'({z}) = {g}, Burn's {wg}");
    }
    assert!(fused(f32::NAN).is_nan() && gelu_grad(f32::NAN, 1.0).is_nan());
    // The exponential under both, against f64's, relative.
    for i in -8700..=8800 {
        let x = i as f32 / 100.0;
        let want = (x as f64).exp();
        let got = exp_f32(x) as f64;
        assert!(
            (got - want).abs() <= 3e-7 * want,
            "exp({x}) = {got}, want {want}"
        );
    }
}

/// Two rows of three classes worked by hand: `(0, ln 3, 0)` with target 1 (`e^x` sums to 5:
/// loss `ln 5 - ln 3`) and `(ln 2, 0, ln 2)` with target 0 (loss `ln 5 - ln 2`); the mean is
/// `ln 5 - ln 6 / 2`. The gradient of the mean is `(softmax - onehot) / 2`:
/// `(1/5, 3/5 - 1, 1/5) / 2` and `(2/5 - 1, 1/5, 2/5) / 2`.
#[test]
fn the_cross_entropy_equals_values_worked_by_hand() {
    let (l2, l3) = (2f32.ln(), 3f32.ln());
    let logits = Tensor::<AB, 2>::from_data(
        burn::tensor::TensorData::new(vec![0.0, l3, 0.0, l2, 0.0, l2], [2, 3]),
        &Default::default(),
    )
    .require_grad();
    let targets = Tensor::<AB, 1, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(vec![1i64, 0], [2]),
        &Default::default(),
    );
    let loss = flashover_models::layers::cross_entropy(logits.clone(), targets);
    let grads = loss.clone().backward();
    let want = 5f64.ln() - 6f64.ln() / 2.0;
    let got = values(loss.inner());
    assert!(
        (f64::from(got[0]) - want).abs() < 1e-6,
        "loss {got:?}, want {want}"
    );
    let want = [0.1, -0.2, 0.1, -0.3, 0.1, 0.2];
    let got = values(logits.grad(&grads).unwrap());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "gradient {got:?}, want {want:?}");
    }
}

/// Every output and gradient of the ops, as bits.
fn transformer_ops_bits(seed: u64) -> Vec<Vec<u32>> {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let mut out: Vec<Vec<u32>> = dense_gelu_through([1030, 33, 70], true, seed, true)
        .into_iter()
        .map(bits)
        .collect();
    out.extend(
        dense_gelu_through([45, 130, 17], true, seed, true)
            .into_iter()
            .map(bits),
    );
    out.extend(
        layer_norm_through([333, 48], seed, true)
            .into_iter()
            .map(bits),
    );
    out.extend(
        dense_residual_through([1030, 33, 70], true, seed, true)
            .into_iter()
            .map(bits),
    );
    out.extend(
        dense_residual_through([4100, 20, 36], true, seed, true)
            .into_iter()
            .map(bits),
    );
    out.extend(
        cross_entropy_through([1030, 84], seed, true)
            .into_iter()
            .map(bits),
    );
    out
}

#[test]
fn the_transformer_ops_are_bit_identical_for_one_two_and_four_threads() {
    let on = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| transformer_ops_bits(7))
    };
    let one = on(1);
    assert_eq!(one, transformer_ops_bits(7), "run to run");
    assert_eq!(on(2), one, "2 threads");
    assert_eq!(on(4), one, "4 threads");
}
