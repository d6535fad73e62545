//! Normalisation layers: [`BatchNorm`] and [`GroupNorm`] (below), which run in either memory
//! format, and [`LayerNorm`] over the last axis (with a low-precision variant, as group
//! norm's). [`BatchNorm`] has Burn's
//! parameters, running statistics and record (`gamma`, `beta`, `running_mean`, `running_var`),
//! so a model built with it loads the weights of one built with `burn::nn::BatchNorm`.
//!
//! Channels-first it makes Burn's own calls (bit for bit). Channels-last the channel is the
//! last axis, so the statistics are means over the rows of the `[batch * height * width,
//! channels]` matrix the activation already is, with no transposition.
//!
//! As in Burn (and unlike PyTorch), the running variance is updated with the biased batch
//! variance, and training or evaluation is decided by the backend: an autodiff backend
//! normalises with the batch's statistics and updates the running ones, its inner backend
//! (evaluation, prediction) uses the running ones.
//!
//! **Ghost batch normalisation** (Hoffer, Hubara and Soudry, "Train longer, generalize
//! better", 2017), the variant GhostBatchNorm's surgery selects: in training, the batch is cut
//! into consecutive ghost batches of at most `ghost_batch_size` samples (as `torch.chunk`
//! cuts: `k = ceil(n / size)` pieces of `ceil(n / k)`, the last one shorter), each
//! normalised with its own statistics, and the running statistics move towards the mean of
//! the ghost batches' means and variances, with the layer's momentum. Evaluation is
//! unchanged. Composer instead runs its batch norm once per ghost batch with the momentum
//! divided by their number (nearly the same average), and refuses a batch smaller than the
//! ghost size; here such a batch is one ghost batch, the plain layer.

use burn::module::{Module, Param, RunningState};
use burn::nn::BatchNormConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use flashover_core::precision::{cast_like, cast_to};

use crate::ModelError;
use flashover_surgery::{GroupNormVariant, HalfType, LayerNormVariant, NormInfo, NormVariant};

/// Batch normalisation over the channels of 4-D activations, NCHW or NHWC.
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Running mean of the batch means, `[channels]`.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// Running mean of the (biased) batch variances, `[channels]`.
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Weight of the newest batch in the running statistics.
    pub momentum: f64,
    /// Added to the variance before the square root.
    pub epsilon: f64,
    /// The variant model surgery chose (default: plain batch norm).
    pub variant: NormVariant,
}

impl<B: Backend> BatchNorm<B> {
    /// The layer `config` describes, initialised as Burn initialises its own (scale 1,
    /// shift 0, running mean 0, running variance 1).
    pub fn new(config: &BatchNormConfig, device: &B::Device) -> Self {
        config.init::<B>(device).into()
    }

    /// Channels.
    pub fn channels(&self) -> usize {
        self.gamma.dims()[0]
    }

    /// What the model's surgery sees of this layer, at `path`.
    pub fn info(&self, path: &str) -> NormInfo {
        NormInfo {
            path: path.to_string(),
            channels: self.channels(),
        }
    }

    /// `x` normalised over its channels: axis 1 of NCHW, or axis 3 of NHWC when
    /// `channels_last`.
    ///
    /// Statistics and the normalisation are computed in float32 whatever the activations'
    /// type (half and mixed precision); the result is in the activations' type.
    pub fn forward(&self, x: Tensor<B, 4>, channels_last: bool) -> Tensor<B, 4> {
        let dtype = x.dtype();
        let y = self.forward_f32(cast_to(x, FloatDType::F32), channels_last);
        cast_like(y, dtype)
    }

    fn forward_f32(&self, x: Tensor<B, 4>, channels_last: bool) -> Tensor<B, 4> {
        let training = B::ad_enabled(&x.device());
        let c = self.channels();
        let dims = x.dims();
        let axis = if channels_last { 3 } else { 1 };
        assert_eq!(
            dims[axis], c,
            "BatchNorm over {c} channels given activations {dims:?} (channels_last: {channels_last})"
        );
        let stats = |x: Tensor<B, 4>| {
            if channels_last {
                batch_stats_nhwc(x)
            } else {
                batch_stats_nchw(x)
            }
        };
        let n = dims[0];
        if let (true, Some(ghost)) = (training, self.variant.ghost_batch_size) {
            if n > ghost {
                return self.forward_ghost(x, ghost, channels_last, stats);
            }
        }
        let (mean, var) = if training {
            let (mean, var) = stats(x.clone());
            self.update_running(mean.clone(), var.clone());
            (mean, var)
        } else {
            let device = x.device();
            (
                cast_to(
                    self.running_mean.value().to_device(&device),
                    FloatDType::F32,
                ),
                cast_to(self.running_var.value().to_device(&device), FloatDType::F32),
            )
        };
        self.normalise(x, mean, var, channels_last)
    }

    /// Ghost batch normalisation in training (see the module docs).
    fn forward_ghost(
        &self,
        x: Tensor<B, 4>,
        ghost: usize,
        channels_last: bool,
        stats: impl Fn(Tensor<B, 4>) -> (Tensor<B, 1>, Tensor<B, 1>),
    ) -> Tensor<B, 4> {
        let n = x.dims()[0];
        let size = n.div_ceil(n.div_ceil(ghost.max(1)));
        let mut outputs = Vec::new();
        let (mut means, mut vars) = (Vec::new(), Vec::new());
        for start in (0..n).step_by(size) {
            let part = x.clone().narrow(0, start, size.min(n - start));
            let (mean, var) = stats(part.clone());
            means.push(mean.clone());
            vars.push(var.clone());
            outputs.push(self.normalise(part, mean, var, channels_last));
        }
        let k = means.len() as f64;
        let average = |v: Vec<Tensor<B, 1>>| {
            v.into_iter()
                .reduce(|a, b| a.add(b))
                .map(|s| s.div_scalar(k))
        };
        // Invariant: `n > ghost >= 1`, so there is at least one ghost batch.
        let mean = average(means).expect("at least one ghost batch");
        // Invariant: as many variances as means.
        let var = average(vars).expect("at least one ghost batch");
        self.update_running(mean, var);
        Tensor::cat(outputs, 0)
    }

    /// Folds one batch's statistics (`[channels]` each) into the running ones.
    fn update_running(&self, mean: Tensor<B, 1>, var: Tensor<B, 1>) {
        let device = mean.device();
        let m = self.momentum;
        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);
        // In float32, stored back in the statistics' own type (half in a pure half run).
        let stored = running_mean.dtype();
        let running_mean = cast_to(running_mean, FloatDType::F32)
            .mul_scalar(1.0 - m)
            .add(mean.detach().mul_scalar(m));
        let running_var = cast_to(running_var, FloatDType::F32)
            .mul_scalar(1.0 - m)
            .add(var.detach().mul_scalar(m));
        let (running_mean, running_var) = (
            cast_like(running_mean, stored),
            cast_like(running_var, stored),
        );
        self.running_mean.update(running_mean.detach());
        self.running_var.update(running_var.detach());
        // Fold the update in now. Burn's `RunningState` keeps it pending until the next
        // `value_sync`, and a module visitor (the checkpoint writer, the parameter digest,
        // EMA) reads the value without the pending update: a checkpoint would hold the
        // statistics of one batch before, and a resumed run would differ. Each model copy
        // has its own running state (one per rank), so nothing waits to be averaged here.
        let _ = self.running_mean.value_sync();
        let _ = self.running_var.value_sync();
    }

    /// `(x - mean) / sqrt(var + epsilon) * gamma + beta` with `[channels]` statistics.
    /// Channels-first in Burn's order of operations (bit for bit with its layer);
    /// channels-last as `x * scale + shift` per channel over the `[n * h * w, channels]`
    /// matrix, with `scale` and `shift` repeated into whole matrices first: flex (built
    /// without its SIMD feature, for fixed numerics) runs a broadcast element by element
    /// through a strided iterator, which made batch norm most of a ResNet step, and a
    /// repeated row is a memcpy after which the product is a plain loop.
    fn normalise(
        &self,
        x: Tensor<B, 4>,
        mean: Tensor<B, 1>,
        var: Tensor<B, 1>,
        channels_last: bool,
    ) -> Tensor<B, 4> {
        let c = self.channels();
        let gamma = cast_to(self.gamma.val(), FloatDType::F32);
        let beta = cast_to(self.beta.val(), FloatDType::F32);
        if channels_last {
            let [n, h, w, _] = x.dims();
            let scale = gamma.div(var.add_scalar(self.epsilon).sqrt());
            let shift = beta.sub(mean.mul(scale.clone()));
            x.reshape([n * h * w, c])
                .mul(rows(scale, n * h * w))
                .add(rows(shift, n * h * w))
                .reshape([n, h, w, c])
        } else {
            let shape = [1, c, 1, 1];
            let std = var.reshape(shape).add_scalar(self.epsilon).sqrt();
            x.sub(mean.reshape(shape))
                .div(std)
                .mul(gamma.reshape(shape))
                .add(beta.reshape(shape))
        }
    }
}

/// Burn's layer, parameters (and their ids) and running statistics included, as this crate's.
impl<B: Backend> From<burn::nn::BatchNorm<B>> for BatchNorm<B> {
    fn from(n: burn::nn::BatchNorm<B>) -> Self {
        Self {
            gamma: n.gamma,
            beta: n.beta,
            running_mean: n.running_mean,
            running_var: n.running_var,
            momentum: n.momentum,
            epsilon: n.epsilon,
            variant: NormVariant::default(),
        }
    }
}

/// Per-channel mean and biased variance of NCHW `x`, `[channels]` each, computed as Burn's
/// `BatchNorm` computes them (channels moved first, then a mean over each row).
pub fn batch_stats_nchw<B: Backend>(x: Tensor<B, 4>) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [n, c, h, w] = x.dims();
    let rows = |t: Tensor<B, 4>| t.swap_dims(0, 1).reshape([c, n * h * w]).mean_dim(1);
    let mean = rows(x.clone()).reshape([1, c, 1, 1]);
    let var = rows(x.sub(mean.clone()).square());
    (mean.reshape([c]), var.reshape([c]))
}

/// Per-channel mean and biased variance of NHWC `x`, `[channels]` each: column means of the
/// `[n * h * w, c]` matrix, no transposition, and no broadcast (the mean is repeated into rows).
pub fn batch_stats_nhwc<B: Backend>(x: Tensor<B, 4>) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [n, h, w, c] = x.dims();
    let m = n * h * w;
    let flat = x.reshape([m, c]);
    let mean = flat.clone().mean_dim(0).reshape([c]);
    let var = flat.sub(rows(mean.clone(), m)).square().mean_dim(0);
    (mean, var.reshape([c]))
}

/// `v` (`[channels]`) repeated into `m` rows, contiguous (see [`BatchNorm`]'s `normalise`).
/// Each row of `x` minus its mean, over the square root of its biased variance plus
/// `epsilon`: the part group and layer normalisation share. (Means are repeated across the
/// row rather than broadcast: flex walks broadcasts element by element.)
fn standardize_rows<B: Backend>(x: Tensor<B, 2>, epsilon: f64) -> Tensor<B, 2> {
    let len = x.dims()[1];
    let mean = x.clone().mean_dim(1).repeat_dim(1, len);
    let centered = x.sub(mean);
    let std = centered
        .clone()
        .square()
        .mean_dim(1)
        .add_scalar(epsilon)
        .sqrt()
        .repeat_dim(1, len);
    centered.div(std)
}

fn rows<B: Backend>(v: Tensor<B, 1>, m: usize) -> Tensor<B, 2> {
    let [c] = v.dims();
    v.reshape([1, c]).repeat_dim(0, m)
}

/// Group normalisation (Wu and He, "Group Normalization", ECCV 2018) over 4-D activations,
/// NCHW or NHWC, with Burn's parameters (`gamma`, `beta`; `burn::nn::GroupNorm`'s record
/// names): the channels are cut into `groups` consecutive groups, and each sample's group is
/// normalised with its own mean and biased variance over the group's channels and the whole
/// image; then each channel is scaled and shifted. The same in training and evaluation.
///
/// With LowPrecisionGroupNorm's variant the activations and parameters are cast to a half
/// type, normalised and scaled there, and the result cast back (Composer's `LPGroupNorm`
/// under autocast); gradients flow through the casts.
#[derive(Module, Debug)]
pub struct GroupNorm<B: Backend> {
    /// Scale, `[channels]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[channels]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Channel groups (dividing the channels).
    pub groups: usize,
    /// Added to the variance before the square root.
    pub epsilon: f64,
    /// The variant model surgery chose (default: computed in float32).
    pub variant: GroupNormVariant,
}

impl<B: Backend> GroupNorm<B> {
    /// Group norm over `channels` channels in `groups` groups (scale 1, shift 0, epsilon
    /// 1e-5, as PyTorch's and Burn's); `groups` must divide `channels`.
    pub fn new(groups: usize, channels: usize, device: &B::Device) -> Result<Self, ModelError> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(ModelError::config(
                "a group norm",
                "groups",
                groups,
                format!("a number of groups >= 1 that divides its {channels} channels"),
            ));
        }
        Ok(Self {
            gamma: Param::from_tensor(Tensor::ones([channels], device)),
            beta: Param::from_tensor(Tensor::zeros([channels], device)),
            groups,
            epsilon: 1e-5,
            variant: GroupNormVariant::default(),
        })
    }

    /// Channels.
    pub fn channels(&self) -> usize {
        self.gamma.dims()[0]
    }

    /// What the model's surgery sees of this layer, at `path`.
    pub fn info(&self, path: &str) -> NormInfo {
        NormInfo {
            path: path.to_string(),
            channels: self.channels(),
        }
    }

    /// `x` normalised per sample and group: channels on axis 1 of NCHW, or axis 3 of NHWC
    /// when `channels_last`.
    pub fn forward(&self, x: Tensor<B, 4>, channels_last: bool) -> Tensor<B, 4> {
        // Float32 statistics (whatever the activations' type), or the low-precision
        // variant's half type; the result in the activations' type.
        let dtype = x.dtype();
        let compute = self
            .variant
            .low_precision
            .map_or(FloatDType::F32, half_dtype);
        let y = self.normalise(
            cast_to(x, compute),
            cast_to(self.gamma.val(), compute),
            cast_to(self.beta.val(), compute),
            channels_last,
        );
        cast_like(y, dtype)
    }

    fn normalise(
        &self,
        x: Tensor<B, 4>,
        gamma: Tensor<B, 1>,
        beta: Tensor<B, 1>,
        channels_last: bool,
    ) -> Tensor<B, 4> {
        let dims = x.dims();
        let c = self.channels();
        let axis = if channels_last { 3 } else { 1 };
        assert_eq!(
            dims[axis], c,
            "GroupNorm over {c} channels given activations {dims:?} (channels_last: {channels_last})"
        );
        let (n, g) = (dims[0], self.groups);
        let per = c / g;
        // Each sample's group as one row of `[n * g, group size]`.
        let grouped = if channels_last {
            let hw = dims[1] * dims[2];
            x.reshape([n, hw, g, per])
                .swap_dims(1, 2)
                .reshape([n * g, hw * per])
        } else {
            x.reshape([n * g, per * dims[2] * dims[3]])
        };
        let normed = standardize_rows(grouped, self.epsilon);
        debug_assert_eq!(normed.dims()[0], n * g);
        if channels_last {
            let [_, h, w, _] = dims;
            let y = normed
                .reshape([n, g, h * w, per])
                .swap_dims(1, 2)
                .reshape([n * h * w, c]);
            y.mul(rows(gamma, n * h * w))
                .add(rows(beta, n * h * w))
                .reshape(dims)
        } else {
            let shape = [1, c, 1, 1];
            normed
                .reshape(dims)
                .mul(gamma.reshape(shape))
                .add(beta.reshape(shape))
        }
    }
}

/// Layer normalisation (Ba, Kiros and Hinton, "Layer Normalization", 2016) over the last axis,
/// with Burn's parameters (`gamma`, `beta`; `burn::nn::LayerNorm`'s record names): each row
/// normalised with its own mean and biased variance, then scaled and shifted per feature:
/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta`.
///
/// With LowPrecisionLayerNorm's variant the activations and parameters are cast to a half
/// type, normalised and scaled there, and the result cast back (as [`GroupNorm`]'s).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// Scale, `[width]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[width]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Added to the variance before the square root.
    pub epsilon: f64,
    /// The variant model surgery chose (default: computed in float32).
    pub variant: LayerNormVariant,
}

impl<B: Backend> LayerNorm<B> {
    /// Layer norm over `width` features (scale 1, shift 0, epsilon 1e-5, as PyTorch's and
    /// Burn's).
    pub fn new(width: usize, device: &B::Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([width], device)),
            beta: Param::from_tensor(Tensor::zeros([width], device)),
            epsilon: 1e-5,
            variant: LayerNormVariant::default(),
        }
    }

    /// Features normalised.
    pub fn width(&self) -> usize {
        self.gamma.dims()[0]
    }

    /// What the model's surgery sees of this layer, at `path`.
    pub fn info(&self, path: &str) -> NormInfo {
        NormInfo {
            path: path.to_string(),
            channels: self.width(),
        }
    }
}

impl<B: crate::ChannelsLastBackend> LayerNorm<B> {
    /// `x` normalised over its last axis: on the CPU fast path through the fused kernel
    /// ([`ChannelsLastBackend::layer_norm_rows`](crate::ChannelsLastBackend::layer_norm_rows)), else
    /// through Burn's tensor ops.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_with(x, B::CHANNELS_LAST_IS_FAST)
    }

    /// [`forward`](Self::forward) through the fused kernel when `fast`, else through Burn's
    /// tensor ops.
    pub fn forward_with<const D: usize>(&self, x: Tensor<B, D>, fast: bool) -> Tensor<B, D> {
        let dims = x.dims();
        let w = self.width();
        assert_eq!(
            dims[D - 1],
            w,
            "LayerNorm over {w} features given activations {dims:?}"
        );
        let n = dims[..D - 1].iter().product::<usize>();
        let x = x.reshape([n, w]);
        // Float32 statistics (whatever the activations' type), or the low-precision
        // variant's half type; the result in the activations' type.
        let dtype = x.dtype();
        let compute = self
            .variant
            .low_precision
            .map_or(FloatDType::F32, half_dtype);
        let (x, gamma, beta) = (
            cast_to(x, compute),
            cast_to(self.gamma.val(), compute),
            cast_to(self.beta.val(), compute),
        );
        let y = if fast && self.variant.low_precision.is_none() {
            Tensor::from_primitive(TensorPrimitive::Float(B::layer_norm_rows(
                x.into_primitive().tensor(),
                gamma.into_primitive().tensor(),
                beta.into_primitive().tensor(),
                self.epsilon,
            )))
        } else {
            self.normalise(x, gamma, beta)
        };
        cast_like(y, dtype).reshape(dims)
    }

    fn normalise(&self, x: Tensor<B, 2>, gamma: Tensor<B, 1>, beta: Tensor<B, 1>) -> Tensor<B, 2> {
        let n = x.dims()[0];
        standardize_rows(x, self.epsilon)
            .mul(rows(gamma, n))
            .add(rows(beta, n))
    }
}

/// Burn's float type for a half type.
fn half_dtype(half: HalfType) -> FloatDType {
    match half {
        HalfType::F16 => FloatDType::F16,
        HalfType::BF16 => FloatDType::BF16,
    }
}
