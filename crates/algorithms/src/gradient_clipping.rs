//! Gradient clipping at `AFTER_TRAIN_BATCH`, after all microbatches are accumulated and
//! before the optimizer step:
//! - **value**: every gradient element clamped to `[-threshold, threshold]`;
//! - **norm**: all gradients scaled together by `min(1, max_norm / (total_norm + 1e-6))`,
//!   where `total_norm` is the L2 norm over every parameter at once (as PyTorch's
//!   `clip_grad_norm_`), not per tensor;
//! - **adaptive** (Brock et al., 2021, "High-Performance Large-Scale Image Recognition Without
//!   Normalization", AGC): each parameter's gradient is scaled so that its unit-wise norm is at
//!   most `threshold` times the unit-wise norm of the weights (at least `1e-3`), where a unit
//!   is one output unit: the paper's norm runs over each output's fan-in. Burn's `nn::Linear`
//!   stores its weight as `[d_input, d_output]` (PyTorch's is `[d_output, d_input]`), so for a
//!   Linear weight the norm runs down each column; weights of rank 2 or more in every other
//!   module are taken as output-first (`[out, in, kh, kw]` convolutions: one norm per output
//!   channel, as in Composer); ranks 0 and 1 (biases, norm scales) are one unit. A user's own
//!   module that stores an input-first matrix outside an `nn::Linear` is treated as
//!   output-first. (Burn's transposed convolutions are `[in, out / groups, k...]`, which
//!   Composer on PyTorch also normalises per first axis; so do we.)
//!
//! Hyperparameters: `clipping_type` (value, norm, adaptive) and `clipping_threshold`.
//! Stabilises training with large learning rates or batch sizes; costs one pass over the
//! gradients.

use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;

use crate::error::{AlgorithmError, Result};
use crate::params::{grads_of, set_grad, GradView};

/// Which clipping to apply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ClippingType {
    /// Clamp each element.
    Value,
    /// Scale by the global L2 norm.
    Norm,
    /// Adaptive gradient clipping (unit-wise ratio to the weights).
    Adaptive,
}

impl ClippingType {
    /// Parses `value`, `norm` or `adaptive`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "value" => Ok(ClippingType::Value),
            "norm" => Ok(ClippingType::Norm),
            "adaptive" => Ok(ClippingType::Adaptive),
            other => Err(AlgorithmError::param(
                "gradient_clipping",
                "clipping_type",
                other,
                "value, norm or adaptive",
            )),
        }
    }
}

/// Sum of squares of a flat tensor, as a one-element tensor, in a fixed order. `sum_dim`
/// rather than `sum`: on the GPU backends Burn 0.21's full `sum` may add with atomics, whose
/// order (and so the last bits) changes from run to run, which would break exact resumption.
pub(crate) fn sum_of_squares<B: Backend>(t: &Tensor<B, 1>) -> Tensor<B, 1> {
    t.clone().powi_scalar(2).sum_dim(0)
}

/// Each gradient's sum of squares, in `views`' order, read from the device at once.
pub fn sums_of_squares<B: Backend>(views: &[GradView<B>]) -> Vec<f32> {
    if views.is_empty() {
        return Vec::new();
    }
    let sums: Vec<Tensor<B, 1>> = views.iter().map(|v| sum_of_squares(&v.grad)).collect();
    Tensor::cat(sums, 0)
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .collect()
}

/// The L2 norm of the gradients whose sums of squares are `sums` (in the module's order):
/// added in that order in `f32`, as one process adds its tensors, so that a sharded run,
/// which gathers each rank's sums first, gets the same bits.
pub fn norm_of_sums(sums: &[f32]) -> f64 {
    let Some((&first, rest)) = sums.split_first() else {
        return 0.0;
    };
    let total = rest.iter().fold(first, |t, &s| t + s);
    f64::from(total).sqrt()
}

/// The global L2 norm over every gradient in `views`.
pub fn global_norm<B: Backend>(views: &[GradView<B>]) -> f64 {
    norm_of_sums(&sums_of_squares(views))
}

/// The factor `min(1, max_norm / (norm + 1e-6))` that norm clipping scales by.
pub fn norm_clip_factor(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// Which axis of a weight holds its output units, for adaptive clipping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitAxis {
    /// The whole tensor is one unit (rank 0 and 1).
    Whole,
    /// Output units along the first axis (`[out, ...]`: convolutions, PyTorch-style weights).
    First,
    /// Output units along the last axis of a matrix (`[in, out]`: Burn's `nn::Linear`).
    Last,
}

impl UnitAxis {
    /// The layout of a parameter of `rank` owned by a module of type `owner`.
    pub fn of(owner: &str, rank: usize) -> Self {
        match (owner, rank) {
            (_, 0 | 1) => UnitAxis::Whole,
            ("Linear", 2) => UnitAxis::Last,
            _ => UnitAxis::First,
        }
    }
}

/// Unit-wise L2 norms of a flat tensor of `shape`, broadcast back over each unit: one norm
/// per output unit (over its fan-in) as `axis` says, or the whole norm.
pub fn unitwise_norm<B: Backend>(
    t: &Tensor<B, 1>,
    shape: &[usize],
    axis: UnitAxis,
) -> Tensor<B, 1> {
    let n: usize = shape.iter().product();
    match axis {
        UnitAxis::Whole => sum_of_squares(t).sqrt().expand([n]),
        UnitAxis::First => {
            let rows = shape[0].max(1);
            let cols = n / rows;
            let m = t.clone().reshape([rows, cols]);
            m.powi_scalar(2)
                .sum_dim(1)
                .sqrt()
                .expand([rows, cols])
                .reshape([n])
        }
        UnitAxis::Last => {
            let cols = shape[shape.len() - 1].max(1);
            let rows = n / cols;
            let m = t.clone().reshape([rows, cols]);
            m.powi_scalar(2)
                .sum_dim(0)
                .sqrt()
                .expand([rows, cols])
                .reshape([n])
        }
    }
}

/// Clips `grads` of `model` in place and returns the global gradient norm before clipping
/// (the functional form).
pub fn clip_gradients<B: AutodiffBackend, M: burn::module::AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    kind: ClippingType,
    threshold: f64,
) -> f64 {
    let views = grads_of(model, grads);
    let norm = global_norm(&views);
    clip_views(grads, &views, kind, threshold, norm);
    norm
}

/// Clips the gradients in `views` (of `grads`), norm clipping against the global `norm`.
fn clip_views<B: Backend>(
    grads: &mut GradientsParams,
    views: &[GradView<B>],
    kind: ClippingType,
    threshold: f64,
    norm: f64,
) {
    match kind {
        ClippingType::Value => {
            for v in views {
                set_grad(grads, v, v.grad.clone().clamp(-threshold, threshold));
            }
        }
        ClippingType::Norm => {
            let f = norm_clip_factor(norm, threshold);
            if f < 1.0 {
                for v in views {
                    set_grad(grads, v, v.grad.clone().mul_scalar(f));
                }
            }
        }
        ClippingType::Adaptive => {
            for v in views {
                let axis = UnitAxis::of(&v.owner, v.shape.len());
                let p_norm = unitwise_norm(&v.param, &v.shape, axis).clamp_min(1e-3);
                let g_norm = unitwise_norm(&v.grad, &v.shape, axis);
                let max_norm = p_norm.mul_scalar(threshold);
                // Scale only where the gradient's norm exceeds the bound.
                let factor = (max_norm.clone() / g_norm.clone().clamp_min(1e-6)).clamp_max(1.0);
                set_grad(grads, v, v.grad.clone() * factor);
            }
        }
    }
}

/// The gradient-clipping algorithm; see the module docs.
#[derive(Debug, Clone)]
pub struct GradientClipping {
    kind: ClippingType,
    threshold: f64,
}

impl GradientClipping {
    /// Clipping of `kind` at `threshold > 0`.
    pub fn new(kind: ClippingType, threshold: f64) -> Result<Self> {
        if !(threshold.is_finite() && threshold > 0.0) {
            return Err(AlgorithmError::param(
                "gradient_clipping",
                "clipping_threshold",
                threshold,
                "a finite number > 0",
            ));
        }
        Ok(GradientClipping { kind, threshold })
    }
}

impl<S: Setup> Algorithm<S> for GradientClipping {
    fn name(&self) -> &str {
        "gradient_clipping"
    }

    fn matches(&self, event: Event, state: &State<S>) -> bool {
        event == Event::AfterTrainBatch && state.grads().is_some()
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        // Norm clipping needs the norm over every parameter: in a sharded run each rank
        // holds its own parameters' gradients, so the per-parameter sums are gathered and
        // added in the module's order on every rank (the bits of an unsharded run). Value
        // and adaptive clipping act on each parameter alone.
        let norm = match (self.kind, state.grads()) {
            (_, None) => return Ok(()),
            (ClippingType::Norm, Some(grads)) => {
                let sums = sums_of_squares(&grads_of(state.model(), grads));
                norm_of_sums(&state.gather_over_shards(sums)?)
            }
            (_, Some(_)) => 0.0,
        };
        if let (model, Some(grads)) = state.model_and_grads_mut()? {
            let views = grads_of(model, grads);
            clip_views(grads, &views, self.kind, self.threshold, norm);
        }
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "gradient_clipping", params: ["clipping_type", "clipping_threshold"]}
crate::spec::by_name! {general |p| GradientClipping::new(
    ClippingType::parse(p.str("clipping_type", "norm"))?,
    p.f64("clipping_threshold", 1.0)?,
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::{Module, Param};
    use burn::tensor::TensorData;

    type AB = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Tiny<B: Backend> {
        w: Param<Tensor<B, 2>>,
        b: Param<Tensor<B, 1>>,
    }

    /// A model whose loss `sum(w * cw) + sum(b * cb)` has gradients exactly `cw` and `cb`.
    fn setup(w: Vec<f32>, cw: Vec<f32>, cb: Vec<f32>) -> (Tiny<AB>, GradientsParams) {
        let d = Default::default();
        let m = Tiny {
            w: Param::from_tensor(Tensor::<AB, 2>::from_data(TensorData::new(w, [2, 2]), &d)),
            b: Param::from_tensor(Tensor::<AB, 1>::from_data(
                TensorData::new(vec![1.0f32, 1.0], [2]),
                &d,
            )),
        };
        let gw = Tensor::<AB, 2>::from_data(TensorData::new(cw, [2, 2]), &d);
        let gb = Tensor::<AB, 1>::from_data(TensorData::new(cb, [2]), &d);
        let loss = (m.w.val() * gw).sum() + (m.b.val() * gb).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        (m, grads)
    }

    fn grad_values(m: &Tiny<AB>, g: &GradientsParams) -> Vec<f32> {
        grads_of(m, g)
            .iter()
            .flat_map(|v| v.grad.clone().into_data().to_vec::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn norm_clipping_uses_the_global_norm() {
        // Gradients (3, 0, 0, 0) and (0, 4): global norm 5 (per-tensor norms would be 3 and 4).
        let (m, mut g) = setup(vec![1.0; 4], vec![3.0, 0.0, 0.0, 0.0], vec![0.0, 4.0]);
        let norm = clip_gradients(&m, &mut g, ClippingType::Norm, 1.0);
        assert!((norm - 5.0).abs() < 1e-6);
        let f = 1.0 / (5.0 + 1e-6);
        let v = grad_values(&m, &g);
        let want = [3.0 * f, 0.0, 0.0, 0.0, 0.0, 4.0 * f];
        for (a, b) in v.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{v:?}");
        }
        // Below the threshold nothing changes.
        let (m, mut g) = setup(vec![1.0; 4], vec![3.0, 0.0, 0.0, 0.0], vec![0.0, 4.0]);
        clip_gradients(&m, &mut g, ClippingType::Norm, 10.0);
        assert_eq!(grad_values(&m, &g), vec![3.0, 0.0, 0.0, 0.0, 0.0, 4.0]);
    }

    #[test]
    fn value_clipping_clamps_each_element() {
        let (m, mut g) = setup(vec![1.0; 4], vec![3.0, -0.2, -7.0, 0.5], vec![0.0, 4.0]);
        clip_gradients(&m, &mut g, ClippingType::Value, 1.0);
        assert_eq!(grad_values(&m, &g), vec![1.0, -0.2, -1.0, 0.5, 0.0, 1.0]);
    }

    #[test]
    fn adaptive_clipping_bounds_each_unit_by_its_weight_norm() {
        // w rows (3, 4) and (0, 0.001): unit norms 5 and 0.001 -> clamped to 1e-3.
        // Gradient rows (6, 8) (norm 10) and (1, 0) (norm 1); threshold 0.1.
        // Row 0: bound 0.5 < 10 -> scaled by 0.05 -> (0.3, 0.4).
        // Row 1: bound 1e-4 < 1 -> scaled by 1e-4 -> (1e-4, 0).
        // b = (1, 1): norm sqrt 2; gradient (0.1, 0) norm 0.1 < 0.1 * sqrt 2 -> unchanged.
        let (m, mut g) = setup(
            vec![3.0, 4.0, 0.0, 0.001],
            vec![6.0, 8.0, 1.0, 0.0],
            vec![0.1, 0.0],
        );
        clip_gradients(&m, &mut g, ClippingType::Adaptive, 0.1);
        let v = grad_values(&m, &g);
        let want = [0.3, 0.4, 1e-4, 0.0, 0.1, 0.0];
        for (a, b) in v.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{v:?}");
        }
    }

    #[derive(Module, Debug)]
    struct WithLinear<B: Backend> {
        fc: burn::nn::Linear<B>,
    }

    #[test]
    fn adaptive_clipping_of_a_linear_layer_normalises_each_output_column() {
        // Burn's Linear weight is [d_input = 2, d_output = 3]:
        //   w = [[3, 0, 1],      output units are columns: (3, 4), (0, 0.001), (1, 0)
        //        [4, 0.001, 0]]  with norms 5, 0.001 -> 1e-3, 1.
        // The loss sum(w * c) + sum(b * cb) has gradient c:
        //   c = [[6, 1, 0.05],   columns (6, 8) norm 10, (1, 0) norm 1, (0.05, 0) norm 0.05.
        //        [8, 0, 0]]
        // Threshold 0.1: column 0 bound 0.5 < 10 -> x0.05 -> (0.3, 0.4); column 1 bound 1e-4
        // < 1 -> x1e-4 -> (1e-4, 0); column 2 bound 0.1 >= 0.05 -> unchanged.
        // Per input row (the old, wrong unit) row 0 = (3, 0, 1) would have scaled column 2's
        // gradient too. The bias (1, 1, 1) is one unit of norm sqrt 3; its gradient (0, 0, 0.2)
        // exceeds 0.1 * sqrt 3 and is scaled onto it: (0, 0, 0.1 * sqrt 3).
        let d = Default::default();
        let mut fc = burn::nn::LinearConfig::new(2, 3).init::<AB>(&d);
        let w = Tensor::<AB, 2>::from_data(
            TensorData::new(vec![3.0f32, 0.0, 1.0, 4.0, 0.001, 0.0], [2, 3]),
            &d,
        );
        fc.weight = Param::from_tensor(w);
        fc.bias = Some(Param::from_tensor(Tensor::<AB, 1>::ones([3], &d)));
        let m = WithLinear { fc };
        let cw = Tensor::<AB, 2>::from_data(
            TensorData::new(vec![6.0f32, 1.0, 0.05, 8.0, 0.0, 0.0], [2, 3]),
            &d,
        );
        let cb = Tensor::<AB, 1>::from_data(TensorData::new(vec![0.0f32, 0.0, 0.2], [3]), &d);
        let bias = m.fc.bias.as_ref().map(|b| b.val()).unwrap();
        let loss = (m.fc.weight.val() * cw).sum() + (bias * cb).sum();
        let mut g = GradientsParams::from_grads(loss.backward(), &m);
        assert_eq!(grads_of(&m, &g)[0].owner, "Linear");
        clip_gradients(&m, &mut g, ClippingType::Adaptive, 0.1);
        let views = grads_of(&m, &g);
        let weight: Vec<f32> = views[0].grad.clone().into_data().to_vec().unwrap();
        let want = [0.3, 1e-4, 0.05, 0.4, 0.0, 0.0];
        for (a, b) in weight.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{weight:?}");
        }
        let bias: Vec<f32> = views[1].grad.clone().into_data().to_vec().unwrap();
        let want = [0.0, 0.0, 0.1 * 3f64.sqrt()];
        for (a, b) in bias.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{bias:?}");
        }
    }

    #[test]
    fn unit_axes_follow_the_owning_module() {
        assert_eq!(UnitAxis::of("Linear", 2), UnitAxis::Last);
        assert_eq!(UnitAxis::of("Linear", 1), UnitAxis::Whole);
        assert_eq!(UnitAxis::of("Conv2d", 4), UnitAxis::First);
        assert_eq!(UnitAxis::of("Tiny", 2), UnitAxis::First);
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(GradientClipping::new(ClippingType::Norm, 0.0).is_err());
        let e = ClippingType::parse("l3").err().unwrap().to_string();
        assert!(e.contains("l3") && e.contains("adaptive"), "{e}");
    }
}
