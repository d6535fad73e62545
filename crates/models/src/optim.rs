//! AdamW in one pass per parameter: [`FusedAdamW`], a Burn `SimpleOptimizer` that computes
//! exactly what Burn's `AdamW` computes (Loshchilov and Hutter, "Decoupled Weight Decay
//! Regularization", 2019, with Burn's defaults), through
//! [`ChannelsLastBackend::adamw_step`](crate::ops::ChannelsLastBackend::adamw_step) (the
//! kernel and Burn's composition: [`crate::optim_kernels`]).
//!
//! Written by hand because Burn's `AdamW` is a composition of about fourteen tensor ops per
//! parameter (moments, bias corrections, square root, division, decay, update), each a pass
//! over the parameter with a fresh buffer on one thread: a few percent of the GPT's step
//! while the other threads waited. Here the fast path reads the parameter, its gradient and
//! both moments once and writes the three results, in chunks on the threads.
//!
//! **The same bits as Burn's.** The kernel performs Burn's operations in Burn's order, each
//! rounded to `f32` as Burn's element-wise ops round it (scalars converted to `f32` first;
//! no fused multiply-adds), so the parameters and moments equal Burn's `AdamW`'s to the bit
//! (tested), and its state is Burn's `AdamWState`: checkpoints written with either optimizer
//! resume with the other. Other backends and other float types take the default method,
//! Burn's composition itself.
//!
//! Per step `t` (from 1), for gradient `g`, with `β₁`, `β₂`, `ε`, weight decay `λ` and
//! learning rate `η`: `m ← β₁ m + (1 - β₁) g` (`m = (1 - β₁) g` at `t = 1`), `v ← β₂ v +
//! (1 - β₂) g²`, `m̂ = m / (1 - β₁ᵗ)`, `v̂ = v / (1 - β₂ᵗ)`, `θ ← θ (1 - η λ) - η m̂ / (√v̂ + ε)`.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::ops::ChannelsLastBackend;
use crate::optim_kernels::AdamWStep;

/// AdamW as Burn's `AdamW` computes it (see the module docs), one pass per parameter on the
/// fast path. Burn's defaults: `β₁ = 0.9`, `β₂ = 0.999`, `ε = 1e-5`, weight decay `1e-4`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
}

impl Default for FusedAdamW {
    fn default() -> Self {
        Self {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 1e-4,
        }
    }
}

impl FusedAdamW {
    /// Burn's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// With weight decay `weight_decay` (Burn's `AdamWConfig::with_weight_decay`).
    pub fn with_weight_decay(self, weight_decay: f32) -> Self {
        Self {
            weight_decay,
            ..self
        }
    }

    /// With the moments' decay rates `β₁` and `β₂`.
    pub fn with_betas(self, beta_1: f32, beta_2: f32) -> Self {
        Self {
            beta_1,
            beta_2,
            ..self
        }
    }

    /// With `ε`, added to the second moment's square root.
    pub fn with_epsilon(self, epsilon: f32) -> Self {
        Self { epsilon, ..self }
    }

    /// The optimizer for `M`'s parameters, as `AdamWConfig::init` builds Burn's.
    pub fn init<B, M>(self) -> OptimizerAdaptor<FusedAdamW, M, B>
    where
        B: AutodiffBackend,
        B::InnerBackend: ChannelsLastBackend,
        M: burn::module::AutodiffModule<B>,
    {
        OptimizerAdaptor::from(self)
    }

    /// The scalars of step `time` at learning rate `lr`.
    fn step_at(&self, lr: f64, time: usize) -> AdamWStep {
        AdamWStep {
            lr,
            time,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
        }
    }
}

impl<B: ChannelsLastBackend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let shape = tensor.shape();
        let n = shape.num_elements();
        let flat = |t: Tensor<B, D>| t.reshape([n]).into_primitive().tensor();
        let back =
            |p| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(p)).reshape(shape.clone());
        let (time, moments) = match state {
            None => (1, None),
            Some(s) => (
                s.momentum.time + 1,
                Some((flat(s.momentum.moment_1), flat(s.momentum.moment_2))),
            ),
        };
        let (param, m1, m2) =
            B::adamw_step(flat(tensor), flat(grad), moments, &self.step_at(lr, time));
        let momentum = AdaptiveMomentumState::new(time, back(m1), back(m2));
        (back(param), Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

// The tests run on flex, the fast path they compare against Burn's `AdamW`.
#[cfg(feature = "flex")]
#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::Param;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use burn::tensor::TensorData;

    type B = Flex;
    type AB = Autodiff<Flex>;

    /// A layer of 140 x 130 weights (more than one chunk of the kernel) and 130 biases,
    /// initialised now (Burn draws a parameter's values when it is first read, so clones
    /// made before would each draw their own).
    fn layer() -> Linear<AB> {
        let layer = LinearConfig::new(140, 130).init(&Default::default());
        layer_bits(&layer);
        layer
    }

    /// `n` values in [-1, 1] from a formula of `i`.
    fn wave(n: usize, i: u64) -> Vec<f32> {
        (0..n)
            .map(|k| (k as f32 * 0.37 + i as f32 * 1.3).sin())
            .collect()
    }

    /// The layer's gradients for an input and probe that depend on the step `i` alone.
    fn grads(model: &Linear<AB>, i: u64) -> GradientsParams {
        let d = Default::default();
        let x = Tensor::<AB, 2>::from_data(TensorData::new(wave(9 * 140, i), [9, 140]), &d);
        let probe =
            Tensor::<AB, 2>::from_data(TensorData::new(wave(9 * 130, i + 50), [9, 130]), &d);
        let loss = (model.forward(x) * probe).sum();
        GradientsParams::from_grads(loss.backward(), model)
    }

    /// Steps `first..first + steps` of `optim` from `model`, at learning rates that change.
    fn train<O: Optimizer<Linear<AB>, AB>>(
        mut model: Linear<AB>,
        optim: &mut O,
        first: u64,
        steps: u64,
    ) -> Linear<AB> {
        for i in first..first + steps {
            let g = grads(&model, i);
            model = optim.step(1e-2 * (1.0 + i as f64 / 7.0), model, g);
        }
        model
    }

    fn bits<const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
        t.into_data().iter::<f32>().map(f32::to_bits).collect()
    }

    /// Every value of the layer, as bits.
    fn layer_bits(model: &Linear<AB>) -> Vec<u32> {
        let mut v = bits(model.weight.val().inner());
        v.extend(bits(model.bias.as_ref().unwrap().val().inner()));
        v
    }

    /// A parameter's step count and moments in `optim`'s record, as bits.
    fn moments<O, const D: usize>(
        optim: &OptimizerAdaptor<O, Linear<AB>, AB>,
        param: &Param<Tensor<AB, D>>,
    ) -> (usize, Vec<u32>, Vec<u32>)
    where
        O: SimpleOptimizer<B, State<D> = AdamWState<B, D>>,
    {
        let record = optim.to_record();
        let state = record[&param.id].clone().into_state::<D>();
        let m = state.momentum;
        (m.time, bits(m.moment_1), bits(m.moment_2))
    }

    /// Six steps of Burn's `AdamW` and of the fused step, with and without weight decay and
    /// with other betas and epsilon: the same parameters and moments, bit for bit.
    #[test]
    fn the_fused_step_equals_burns_adamw_to_the_bit() {
        let start = layer();
        for (decay, (beta_1, beta_2), eps) in [
            (1e-4, (0.9, 0.999), 1e-5),
            (0.0, (0.9, 0.999), 1e-5),
            (0.05, (0.8, 0.95), 1e-8),
        ] {
            let mut burn = AdamWConfig::new()
                .with_weight_decay(decay)
                .with_beta_1(beta_1)
                .with_beta_2(beta_2)
                .with_epsilon(eps)
                .init::<AB, Linear<AB>>();
            let mut fused = FusedAdamW::new()
                .with_weight_decay(decay)
                .with_betas(beta_1, beta_2)
                .with_epsilon(eps)
                .init::<AB, Linear<AB>>();
            let a = train(start.clone(), &mut burn, 0, 6);
            let b = train(start.clone(), &mut fused, 0, 6);
            assert!(
                layer_bits(&a) == layer_bits(&b),
                "decay {decay}: parameters"
            );
            assert!(
                layer_bits(&a) != layer_bits(&start),
                "the steps changed the layer"
            );
            let bias = a.bias.as_ref().unwrap();
            assert!(
                moments(&burn, &a.weight) == moments(&fused, &a.weight),
                "decay {decay}"
            );
            assert!(
                moments(&burn, bias) == moments(&fused, bias),
                "decay {decay}"
            );
            assert_eq!(moments(&fused, bias).0, 6);
        }
    }

    /// A checkpoint of Burn's `AdamW` after three steps resumes in the fused optimizer (the
    /// same state type, written and read through a recorder), and three more steps end where
    /// six of Burn's do.
    #[test]
    fn burns_adamw_state_resumes_in_the_fused_step() {
        let start = layer();
        let mut burn = AdamWConfig::new().init::<AB, Linear<AB>>();
        let straight = train(start.clone(), &mut burn, 0, 6);
        let mut burn = AdamWConfig::new().init::<AB, Linear<AB>>();
        let half = train(start, &mut burn, 0, 3);
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let saved = recorder.record(burn.to_record(), ()).unwrap();
        let record = recorder.load(saved, &Default::default()).unwrap();
        let mut fused = FusedAdamW::new()
            .init::<AB, Linear<AB>>()
            .load_record(record);
        let resumed = train(half, &mut fused, 3, 3);
        assert!(layer_bits(&straight) == layer_bits(&resumed));
    }
}
