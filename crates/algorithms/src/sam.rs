//! Sharpness-aware minimisation (Foret et al., 2021, "Sharpness-Aware Minimization for
//! Efficiently Improving Generalization"): step with the gradient taken at the worst nearby
//! point, `w + rho * g / ||g||`, which seeks flat minima. Each SAM step costs a second forward
//! and backward pass, so it runs every `interval` steps (Composer's `interval`, after
//! "Towards Efficient and Scalable Sharpness-Aware Minimization").
//!
//! At `AFTER_TRAIN_BATCH` (gradients of the whole batch, summed over microbatches), the
//! weights are perturbed by `e = rho * g / (||g|| + epsilon)` (`||g||` over all parameters),
//! the loss of the batch is computed again at `w + e`, and its gradient replaces `g`; the
//! model itself is never changed, so the optimizer steps from `w`. The second pass runs on the
//! batch as the loader and data algorithms left it, in one piece (no microbatching), without
//! the per-forward changes of MixUp, CutMix or label smoothing. In a data-parallel run the
//! perturbation uses the averaged gradient, and the second pass's gradient is averaged over
//! the ranks too (as under PyTorch's DDP), so every rank steps alike.
//!
//! Under float16 loss scaling (`amp_fp16`, `fp16`) the second pass is scaled like the first:
//! its loss is multiplied by the current scale before the backward pass and its gradients
//! divided by it ([`State::replace_gradients`]); if they overflow (on any rank), the step is
//! skipped and the scale lowered, as PyTorch's `GradScaler` does when any backward pass of a
//! step overflowed. (Composer runs SAM under AMP through a closure-aware scaler to the same
//! end.) This costs one more read from the device on SAM's batches under loss scaling.
//!
//! Hyperparameters: `rho` 0.05, `epsilon` 1e-12, `interval` 1 (Composer's defaults). With
//! `interval = k`, the extra pass runs on batches k, 2k, 3k... of the run, counted from 1
//! after the batch (the k-th batch is the first to get it; with k = 2, every second batch).

use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Tensor};
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::TrainModel;
use flashover_core::precision::{cast_like, cast_to};
use flashover_core::setup::Setup;
use flashover_core::state::State;

use crate::error::{AlgorithmError, Result};
use crate::gradient_clipping::global_norm;
use crate::params::{grads_of, GradView, ParamEntry, ParamSet};

/// The perturbed weights `w + rho * g / (||g|| + epsilon)` for every parameter with a
/// gradient, `||g||` being the global norm (the functional form).
pub fn perturbed_weights<B: Backend>(views: &[GradView<B>], rho: f64, epsilon: f64) -> ParamSet<B> {
    let scale = rho / (global_norm(views) + epsilon);
    ParamSet {
        entries: views
            .iter()
            .map(|v| ParamEntry {
                id: v.id,
                path: v.path.clone(),
                shape: v.shape.clone(),
                // In the parameter's type (half in the pure half precisions, where the
                // gradients are float32).
                value: v.param.clone()
                    + cast_like(v.grad.clone().mul_scalar(scale), v.param.dtype()),
            })
            .collect(),
    }
}

/// Whether SAM takes its extra pass on the batch that brings the run to `batches_done`
/// batches (counted after the batch, from 1): batches `interval`, `2 * interval`, ...
pub fn is_sam_batch(batches_done: u64, interval: u64) -> bool {
    interval > 0 && batches_done > 0 && batches_done.is_multiple_of(interval)
}

/// The SAM algorithm; see the module docs.
#[derive(Debug, Clone)]
pub struct Sam {
    rho: f64,
    epsilon: f64,
    interval: u64,
}

impl Sam {
    /// SAM with radius `rho > 0`, every `interval >= 1` steps.
    pub fn new(rho: f64, epsilon: f64, interval: u64) -> Result<Self> {
        if !(rho.is_finite() && rho > 0.0) {
            return Err(AlgorithmError::param(
                "sam",
                "rho",
                rho,
                "a finite number > 0",
            ));
        }
        if !(epsilon.is_finite() && epsilon >= 0.0) {
            return Err(AlgorithmError::param(
                "sam",
                "epsilon",
                epsilon,
                "a finite number >= 0",
            ));
        }
        if interval == 0 {
            return Err(AlgorithmError::param(
                "sam",
                "interval",
                interval,
                "an integer >= 1",
            ));
        }
        Ok(Sam {
            rho,
            epsilon,
            interval,
        })
    }
}

/// The gradient of `model`'s loss on `batch` at the perturbed weights, the loss (brought to
/// float32) multiplied by `loss_scale` first (1 outside loss scaling; see
/// [`State::loss_scale`]), so the gradients are `loss_scale` times the true ones, in the
/// type the backward pass left them.
pub fn sam_gradients<B: AutodiffBackend, M: TrainModel<B>>(
    model: &M,
    batch: &M::Batch,
    grads: &GradientsParams,
    rho: f64,
    epsilon: f64,
    loss_scale: f64,
) -> Result<GradientsParams> {
    let views = grads_of(model, grads);
    let perturbed = perturbed_weights(&views, rho, epsilon).load_some_into(model.clone(), "sam")?;
    let out = perturbed.forward(batch);
    let loss: Tensor<B, 1> = cast_to(perturbed.loss(&out, batch), FloatDType::F32);
    let loss = if loss_scale == 1.0 {
        loss
    } else {
        loss.mul_scalar(loss_scale)
    };
    Ok(GradientsParams::from_grads(loss.backward(), &perturbed))
}

impl<S: Setup> Algorithm<S> for Sam {
    fn name(&self) -> &str {
        "sam"
    }

    fn matches(&self, event: Event, state: &State<S>) -> bool {
        event == Event::AfterTrainBatch
            && state.grads().is_some()
            // `timestamp.batch` counts the batches before this one.
            && is_sam_batch(state.timestamp().batch + 1, self.interval)
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let scale = state.loss_scale();
        let (rho, epsilon) = (self.rho, self.epsilon);
        // The ascent step moves every weight: in a sharded run the other ranks' parts of the
        // gradient are gathered for it (bit for bit the unsharded run's gradient).
        let g = state.with_whole_gradients(|state, grads| {
            state
                .batch()
                .map(|batch| sam_gradients(state.model(), batch, grads, rho, epsilon, scale))
        })?;
        let Some(Some(g)) = g else {
            return Ok(());
        };
        let g = g?;
        // Unscaled and checked for overflow under loss scaling, and in a data-parallel run
        // averaged over the ranks, like the first pass's gradients.
        state.replace_gradients(g)?;
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "sam", params: ["rho", "epsilon", "interval"]}
crate::spec::by_name! {general |p| Sam::new(
    p.f64("rho", 0.05)?,
    p.f64("epsilon", 1e-12)?,
    p.parse("interval", 1u64, "an integer >= 1")?,
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::{Module, Param};
    use burn::tensor::TensorData;
    use flashover_core::model::Batch;

    type AB = Autodiff<Flex>;

    /// The quadratic `L(w) = 0.5 * sum(a_i * w_i^2)`: gradient `a * w`.
    #[derive(Module, Debug)]
    struct Quad<B: burn::tensor::backend::Backend> {
        w: Param<Tensor<B, 1>>,
    }

    #[derive(Clone)]
    struct Coeffs(Tensor<AB, 1>);

    impl Batch for Coeffs {
        fn len(&self) -> usize {
            1
        }
        fn split(self, _size: usize) -> Vec<Self> {
            vec![self]
        }
    }

    impl TrainModel<AB> for Quad<AB> {
        type Batch = Coeffs;
        type Output = Tensor<AB, 1>;
        fn forward(&self, b: &Coeffs) -> Tensor<AB, 1> {
            (self.w.val().powi_scalar(2) * b.0.clone())
                .sum()
                .mul_scalar(0.5)
        }
        fn loss(&self, out: &Tensor<AB, 1>, _b: &Coeffs) -> Tensor<AB, 1> {
            out.clone()
        }
    }

    impl flashover_core::model::EvalModel<Flex> for Quad<Flex> {
        type Batch = Coeffs2;
        type Output = ();
        fn forward_eval(&self, _b: &Coeffs2) {}
    }

    #[derive(Clone)]
    struct Coeffs2;
    impl Batch for Coeffs2 {
        fn len(&self) -> usize {
            1
        }
        fn split(self, _size: usize) -> Vec<Self> {
            vec![self]
        }
    }

    #[test]
    fn perturbed_gradient_of_a_quadratic_matches_the_formula() {
        // w = (3, 4), a = (1, 2): g = (3, 8), ||g|| = sqrt(73). With rho 0.5:
        // w' = w + 0.5 * g / sqrt(73); the SAM gradient is a * w'.
        let d = Default::default();
        let m = Quad {
            w: Param::from_tensor(Tensor::<AB, 1>::from_data(
                TensorData::new(vec![3.0f32, 4.0], [2]),
                &d,
            )),
        };
        let b = Coeffs(Tensor::from_data(
            TensorData::new(vec![1.0f32, 2.0], [2]),
            &d,
        ));
        let out = m.forward(&b);
        let g = GradientsParams::from_grads(m.loss(&out, &b).backward(), &m);
        let views = grads_of(&m, &g);
        let p = perturbed_weights(&views, 0.5, 0.0);
        let n = 73f64.sqrt();
        let w1 = [3.0 + 0.5 * 3.0 / n, 4.0 + 0.5 * 8.0 / n];
        let got = p.entries[0]
            .value
            .clone()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for (a, b) in got.iter().zip(w1) {
            assert!((*a as f64 - b).abs() < 1e-5, "{got:?}");
        }
        let g2 = sam_gradients(&m, &b, &g, 0.5, 0.0, 1.0).unwrap();
        let got: Vec<f32> = grads_of(&m, &g2)[0]
            .grad
            .clone()
            .into_data()
            .to_vec()
            .unwrap();
        for (a, b) in got.iter().zip([w1[0], 2.0 * w1[1]]) {
            assert!((*a as f64 - b).abs() < 1e-5, "{got:?}");
        }
        // The model itself is untouched.
        assert_eq!(
            m.w.val().into_data().to_vec::<f32>().unwrap(),
            vec![3.0, 4.0]
        );
    }

    #[test]
    fn extra_passes_fall_on_multiples_of_the_interval_counted_after_the_batch() {
        let due = |k: u64| (1..=9).filter(|&b| is_sam_batch(b, k)).collect::<Vec<_>>();
        assert_eq!(due(1), (1..=9).collect::<Vec<_>>());
        assert_eq!(due(2), [2, 4, 6, 8]);
        assert_eq!(due(3), [3, 6, 9]);
        assert!(!is_sam_batch(0, 2));
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(Sam::new(0.0, 1e-12, 1).is_err());
        let e = Sam::new(0.05, 1e-12, 0).err().unwrap().to_string();
        assert!(e.contains("interval"), "{e}");
    }
}
