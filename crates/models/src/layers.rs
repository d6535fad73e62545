//! Layers that run in either memory format: [`Conv2d`], [`MaxPool2d`], [`AvgPool2d`], the
//! dense [`Linear`] that follows them, and the plain functions under them for hand-written
//! models ([`conv2d_nhwc`], [`max_pool2d_nhwc`], [`avg_pool2d_nhwc`], [`dense`]).
//!
//! Channels-first, a layer does exactly what Burn's own layer does (same calls, same
//! results bit for bit). Channels-last (for `Linear`: on the fast path), it goes through
//! [`ChannelsLastBackend`]. Parameters
//! are Burn's (same names, shapes, initialisation and record), so a model built from these
//! layers loads checkpoints of one built from Burn's, and the other way round.

use burn::module::{Module, Param};
use burn::nn::conv::Conv2dConfig;
use burn::nn::{LinearConfig, PaddingConfig2d};
use burn::tensor::backend::Backend;
use burn::tensor::module::{avg_pool2d, conv2d, linear, max_pool2d};
use burn::tensor::ops::{ConvOptions, FloatTensor, PadMode, PaddedConvOptions};
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, TensorPrimitive};

use flashover_core::precision::cast_like;
use flashover_core::rng::Rng;
use flashover_surgery::{
    Blur, ConvInfo, ConvVariant, DropoutVariant, GyroMasks, LinearInfo, PoolInfo, PoolVariant,
};

use crate::lowrank::truncated_svd;
use crate::ops::ChannelsLastBackend;

/// Padding `((top, bottom), (left, right))` of `config` for an `h x w` input (Burn's rule:
/// `Same` pads to keep `ceil(size / stride)` outputs, the odd pixel at the end).
pub fn padding_pairs(
    config: &PaddingConfig2d,
    h: usize,
    w: usize,
    kernel: [usize; 2],
    stride: [usize; 2],
) -> ((usize, usize), (usize, usize)) {
    fn same(kernel: usize, stride: usize, size: usize) -> (usize, usize) {
        let out = size.div_ceil(stride);
        let total = if out > 0 {
            ((out - 1) * stride + kernel).saturating_sub(size)
        } else {
            0
        };
        (total / 2, total - total / 2)
    }
    match config {
        PaddingConfig2d::Valid => ((0, 0), (0, 0)),
        PaddingConfig2d::Same => (same(kernel[0], stride[0], h), same(kernel[1], stride[1], w)),
        PaddingConfig2d::Explicit(top, left, bottom, right) => ((*top, *bottom), (*left, *right)),
    }
}

/// Pads NHWC `x` by `((top, bottom), (left, right))` with `value`.
fn pad_nhwc<B: Backend>(
    x: Tensor<B, 4>,
    ((top, bottom), (left, right)): ((usize, usize), (usize, usize)),
    value: f32,
) -> Tensor<B, 4> {
    x.permute([0, 3, 1, 2])
        .pad((left, right, top, bottom), PadMode::Constant(value))
        .permute([0, 2, 3, 1])
}

/// BlurPool's low-pass filter (Zhang, "Making Convolutional Networks Shift-Invariant
/// Again", 2019): each channel of `x` (NHWC when `channels_last`, else NCHW) convolved with
/// `[1, 2, 1]^T [1, 2, 1] / 16` at `stride`, zero-padded by one pixel on every side, so that
/// at stride 1 the size is unchanged and at stride `s` it is `floor((size - 1) / s) + 1`. The
/// filter is a constant (no gradient). Zero padding as Composer's `blur_2d`; the paper's
/// reference code pads by reflection.
///
/// The filter is separable and `[1, 2, 1] = [1, 1] * [1, 1]`, so the blur is two 2x2 box
/// filters: an average pool at stride 1 with one pixel of zero padding (counted in the
/// divisor), then one at the blur's stride. Both run on the fast path's pooling kernels
/// with their own backward passes (a depthwise convolution, one small matrix product per
/// channel, made a blurred ResNet step 2.4 times as slow; element-wise sums of strided
/// slices were no faster on flex).
pub fn blur2d<B: ChannelsLastBackend>(
    x: Tensor<B, 4>,
    stride: [usize; 2],
    channels_last: bool,
) -> Tensor<B, 4> {
    if channels_last {
        let boxed = avg_pool2d_nhwc(x, [2, 2], [1, 1], [1, 1], true);
        avg_pool2d_nhwc(boxed, [2, 2], stride, [0, 0], true)
    } else {
        let boxed = avg_pool2d(x, [2, 2], [1, 1], [1, 1], true, false);
        avg_pool2d(boxed, [2, 2], stride, [0, 0], true, false)
    }
}

/// Weight standardization (Qiao et al., "Micro-Batch Training with Batch-Channel
/// Normalization and Weight Standardization", 2019): each output channel's weights
/// `[in / groups, kh, kw]` shifted to zero mean and scaled to unit (biased) variance,
/// `(w - mean) / sqrt(var + 1e-10)`, Composer's constant; the paper's code adds `1e-5` to an
/// unbiased standard deviation instead. Gradients flow through the standardization to the
/// raw weights, as with PyTorch's parametrizations.
///
/// Half-precision weights (the `fp16`/`bf16` precisions, and `amp_*` where the forward pass
/// casts them) are standardised in float32 and the result cast back, as PyTorch's autocast
/// runs its reductions: in float16 the `1e-10` rounds to zero and the squares of weights
/// below about `2.4e-4` underflow, so a constant or near-constant channel would divide by
/// zero (NaN or infinity) instead of coming out zero or unit-variance.
pub fn standardize_weight<B: Backend>(w: Tensor<B, 4>) -> Tensor<B, 4> {
    let dtype = w.dtype();
    let w = match dtype {
        DType::F16 | DType::BF16 => w.cast(FloatDType::F32),
        _ => w,
    };
    let dims = w.dims();
    let [o, i, kh, kw] = dims;
    let n = i * kh * kw;
    let flat = w.reshape([o, n]);
    // Per-row statistics repeated into whole rows (flex walks broadcasts element by element).
    let mean = flat.clone().mean_dim(1).repeat_dim(1, n);
    let centered = flat.sub(mean);
    let std = centered
        .clone()
        .square()
        .mean_dim(1)
        .add_scalar(1e-10)
        .sqrt()
        .repeat_dim(1, n);
    cast_like(centered.div(std).reshape(dims), dtype)
}

/// Channels-last convolution of NHWC `x` (see [`ChannelsLastBackend::conv2d_nhwc`]).
pub fn conv2d_nhwc<B: ChannelsLastBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    options: ConvOptions<2>,
    relu: bool,
) -> Tensor<B, 4> {
    let out = B::conv2d_nhwc(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        options,
        relu,
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Channels-last max pooling of NHWC `x` (symmetric padding, never part of a maximum).
pub fn max_pool2d_nhwc<B: ChannelsLastBackend>(
    x: Tensor<B, 4>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
) -> Tensor<B, 4> {
    let out = B::max_pool2d_nhwc(
        x.into_primitive().tensor(),
        kernel,
        stride,
        padding,
        dilation,
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Channels-last average pooling of NHWC `x`.
pub fn avg_pool2d_nhwc<B: ChannelsLastBackend>(
    x: Tensor<B, 4>,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    count_include_pad: bool,
) -> Tensor<B, 4> {
    let out = B::avg_pool2d_nhwc(
        x.into_primitive().tensor(),
        kernel,
        stride,
        padding,
        count_include_pad,
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// NHWC `x` as NCHW (see [`ChannelsLastBackend::nhwc_to_nchw`]): where channels-last
/// features meet a classifier that reads them channels-first.
pub fn nhwc_to_nchw<B: ChannelsLastBackend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::nhwc_to_nchw(
        x.into_primitive().tensor(),
    )))
}

/// A dense layer `x · weight + bias` on `x: [rows, d_in]`, `weight: [d_in, d_out]`, then ReLU
/// when `relu` (see [`ChannelsLastBackend::dense`]).
pub fn dense<B: ChannelsLastBackend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    relu: bool,
) -> Tensor<B, 2> {
    let out = B::dense(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        relu,
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// `x + positions` for `x: [batch, seq, width]` and `positions: [seq, width]` (see
/// [`ChannelsLastBackend::add_positions`]).
pub fn add_positions<B: ChannelsLastBackend>(
    x: Tensor<B, 3>,
    positions: Tensor<B, 2>,
) -> Tensor<B, 3> {
    let out = B::add_positions(
        x.into_primitive().tensor(),
        positions.into_primitive().tensor(),
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Mean cross-entropy of `logits: [rows, classes]` against class indices `targets: [rows]`,
/// a `[1]` tensor (see [`ChannelsLastBackend::cross_entropy`]).
pub fn cross_entropy<B: ChannelsLastBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> Tensor<B, 1> {
    let out = B::cross_entropy(logits.into_primitive().tensor(), targets.into_primitive());
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Gyro dropout's masking (see `flashover_surgery::GyroMasks`) of `x: [n, features]`:
/// sample `i` keeps the features row `i * rows / n` of the masks keeps, scaled by
/// `1 / (1 - p)`; without masks (a forward pass outside the training step), `x` unchanged.
pub fn gyro_dropout<B: Backend>(x: Tensor<B, 2>, masks: &GyroMasks) -> Tensor<B, 2> {
    let Some((rows, keep)) = &masks.keep else {
        return x;
    };
    let [n, features] = x.dims();
    assert_eq!(
        keep.len(),
        rows * features,
        "gyro dropout masks of {} flags for {rows} rows of {features} features",
        keep.len()
    );
    let scale = (1.0 / (1.0 - masks.p)) as f32;
    let mut mask = Vec::with_capacity(n * features);
    for i in 0..n {
        let row = i * rows / n;
        let flags = &keep[row * features..(row + 1) * features];
        mask.extend(flags.iter().map(|&k| if k { scale } else { 0.0 }));
    }
    let mask = Tensor::<B, 2>::from_data(TensorData::new(mask, [n, features]), &x.device());
    let mask = cast_like(mask, x.dtype());
    x.mul(mask)
}

/// A squeeze-and-excitation block (Hu, Shen and Sun, "Squeeze-and-Excitation Networks",
/// CVPR 2018): the feature map's channels averaged over the image (squeeze), a two-layer
/// perceptron without biases `sigmoid(relu(s · reduce) · expand)` (excitation), and every
/// channel scaled by its output. Composer's `SqueezeExcite2d`.
#[derive(Module, Debug)]
pub struct SqueezeExcite<B: Backend> {
    /// `[channels, latent]`, no bias.
    pub reduce: Linear<B>,
    /// `[latent, channels]`, no bias.
    pub expand: Linear<B>,
}

impl<B: Backend> SqueezeExcite<B> {
    /// A block for `channels` channels with a hidden layer of `latent` units, initialised as
    /// PyTorch's `Linear` (uniform in `+-1 / sqrt(fan_in)`) from a generator seeded by
    /// `seed`: the same block on every backend and every rank.
    pub fn new(channels: usize, latent: usize, seed: u64, device: &B::Device) -> Self {
        let mut rng = Rng::new(seed);
        let mut dense = |d_in: usize, d_out: usize| {
            let bound = 1.0 / (d_in as f64).sqrt();
            let w: Vec<f32> = (0..d_in * d_out)
                .map(|_| rng.uniform(-bound, bound) as f32)
                .collect();
            Linear {
                weight: Param::from_tensor(Tensor::from_data(
                    TensorData::new(w, [d_in, d_out]),
                    device,
                )),
                bias: None,
                input_dropout: DropoutVariant::default(),
                factors: None,
            }
        };
        let reduce = dense(channels, latent);
        let expand = dense(latent, channels);
        Self { reduce, expand }
    }
}

impl<B: ChannelsLastBackend> SqueezeExcite<B> {
    /// The block on `x` (NHWC when `channels_last`, else NCHW).
    pub fn forward(&self, x: Tensor<B, 4>, channels_last: bool) -> Tensor<B, 4> {
        let dims = x.dims();
        let (n, c, hw) = if channels_last {
            (dims[0], dims[3], dims[1] * dims[2])
        } else {
            (dims[0], dims[1], dims[2] * dims[3])
        };
        let squeezed = if channels_last {
            x.clone().reshape([n, hw, c]).mean_dim(1).reshape([n, c])
        } else {
            x.clone().reshape([n, c, hw]).mean_dim(2).reshape([n, c])
        };
        let hidden = self.reduce.forward(squeezed, channels_last, true);
        let scale =
            burn::tensor::activation::sigmoid(self.expand.forward(hidden, channels_last, false));
        // The scale repeated to the map's shape (flex walks broadcasts element by element).
        let scale = if channels_last {
            scale.reshape([n, 1, c]).repeat_dim(1, hw)
        } else {
            scale.reshape([n, c, 1]).repeat_dim(2, hw)
        };
        x.mul(scale.reshape(dims))
    }
}

/// A dense layer with Burn's parameters (names, shapes, initialisation, record) that runs
/// through Burn's `linear` or the fast path's [`dense`].
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[d_input, d_output]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_output]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// Dropout on the layer's input that model surgery chose (default: none).
    pub input_dropout: DropoutVariant,
    /// Factorize's two factors, when the layer is factored (its `weight` is then empty).
    pub factors: Option<LinearFactors<B>>,
}

/// A dense layer's low-rank factors: `x · first · second`.
#[derive(Module, Debug)]
pub struct LinearFactors<B: Backend> {
    /// `[d_input, rank]`.
    pub first: Param<Tensor<B, 2>>,
    /// `[rank, d_output]`.
    pub second: Param<Tensor<B, 2>>,
}

/// A convolution's low-rank factors: the layer's convolution into `rank` channels, then a
/// 1x1 convolution to the output channels.
#[derive(Module, Debug)]
pub struct ConvFactors<B: Backend> {
    /// `[rank, in_channels, kernel_h, kernel_w]`.
    pub first: Param<Tensor<B, 4>>,
    /// `[out_channels, rank, 1, 1]`.
    pub second: Param<Tensor<B, 4>>,
}

impl<B: Backend> Linear<B> {
    /// The layer `config` describes, initialised as Burn initialises its own.
    pub fn new(config: &LinearConfig, device: &B::Device) -> Self {
        config.init::<B>(device).into()
    }

    /// `[d_input, d_output]`, factored or not.
    pub fn dims(&self) -> [usize; 2] {
        match &self.factors {
            None => self.weight.dims(),
            Some(f) => [f.first.dims()[0], f.second.dims()[1]],
        }
    }

    /// Multiply-adds per input row.
    pub fn macs(&self) -> usize {
        match &self.factors {
            None => self.weight.dims().iter().product(),
            Some(f) => {
                f.first.dims().iter().product::<usize>() + f.second.dims().iter().product::<usize>()
            }
        }
    }

    /// What the model's surgery sees of this layer, at `path`.
    pub fn info(&self, path: &str) -> LinearInfo {
        let [in_features, out_features] = self.dims();
        LinearInfo {
            path: path.to_string(),
            in_features,
            out_features,
        }
    }

    /// Replaces the weight by two factors of rank `rank` from its truncated SVD (see
    /// [`truncated_svd`]); the weight parameter keeps its id but becomes empty (`[0, 0]`).
    /// Panics on a factored layer or a rank above `min(d_input, d_output)`.
    pub fn factorize(&mut self, rank: usize) {
        assert!(self.factors.is_none(), "the layer is already factored");
        let [i, o] = self.weight.dims();
        let device = self.weight.device();
        let w = self
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>();
        // Invariant: converted to f32 just above.
        let w = w.expect("f32 weights");
        let (p, q) = truncated_svd(&w, i, o, rank);
        let param = |v: Vec<f32>, shape: [usize; 2]| {
            Param::from_tensor(Tensor::from_data(TensorData::new(v, shape), &device))
        };
        self.factors = Some(LinearFactors {
            first: param(p, [i, rank]),
            second: param(q, [rank, o]),
        });
        self.weight = Param::initialized(
            self.weight.id,
            Tensor::zeros([0, 0], &device).require_grad(),
        );
    }
}

/// Burn's layer, parameters (and their ids) included, as this crate's.
impl<B: Backend> From<burn::nn::Linear<B>> for Linear<B> {
    fn from(l: burn::nn::Linear<B>) -> Self {
        Self {
            weight: l.weight,
            bias: l.bias,
            input_dropout: DropoutVariant::default(),
            factors: None,
        }
    }
}

impl<B: ChannelsLastBackend> Linear<B> {
    /// The layer on `x: [rows, d_input]`, followed by a ReLU when `relu`: through the fast
    /// path's [`dense`] (ReLU fused) when `fast`, else exactly as Burn's `Linear` and `relu`.
    /// With gyro dropout on the input, training passes first apply this batch's masks (see
    /// [`gyro_dropout`]).
    pub fn forward(&self, x: Tensor<B, 2>, fast: bool, relu: bool) -> Tensor<B, 2> {
        let x = match &self.input_dropout.gyro {
            Some(g) if B::ad_enabled(&x.device()) => gyro_dropout(x, g),
            _ => x,
        };
        // Weights in the input's type (mixed precision; nothing happens when they are).
        let dt = x.dtype();
        let bias = self.bias.as_ref().map(|b| cast_like(b.val(), dt));
        let (x, weight) = match &self.factors {
            None => (x, cast_like(self.weight.val(), dt)),
            Some(f) if fast => (
                dense(x, cast_like(f.first.val(), dt), None, false),
                cast_like(f.second.val(), dt),
            ),
            Some(f) => (
                linear(x, cast_like(f.first.val(), dt), None),
                cast_like(f.second.val(), dt),
            ),
        };
        if fast {
            return dense(x, weight, bias, relu);
        }
        let y = linear(x, weight, bias);
        if relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        }
    }

    /// `residual + layer(x)` for `x: [rows, d_input]` and `residual: [rows, d_output]` (a
    /// transformer block's residual stream): through the fast path's
    /// [`ChannelsLastBackend::dense_residual`] (bias and residual added to the product while
    /// it is in cache) when `fast` and the layer is a plain one, else as
    /// [`forward`](Self::forward) and Burn's add (the same values either way).
    pub fn forward_residual(
        &self,
        x: Tensor<B, 2>,
        residual: Tensor<B, 2>,
        fast: bool,
    ) -> Tensor<B, 2> {
        let Some((weight, bias)) = self.fused_parts(fast, x.dtype()) else {
            return residual + self.forward(x, fast, false);
        };
        Tensor::from_primitive(TensorPrimitive::Float(B::dense_residual(
            x.into_primitive().tensor(),
            weight,
            bias,
            residual.into_primitive().tensor(),
        )))
    }

    /// The layer on `x: [rows, d_input]` followed by GELU: through the fast path's
    /// [`ChannelsLastBackend::dense_gelu`] (bias and GELU fused into the product) when
    /// `fast` and the layer is a plain one, else as [`forward`](Self::forward) and Burn's
    /// `gelu`.
    pub fn forward_gelu(&self, x: Tensor<B, 2>, fast: bool) -> Tensor<B, 2> {
        let Some((weight, bias)) = self.fused_parts(fast, x.dtype()) else {
            return burn::tensor::activation::gelu(self.forward(x, fast, false));
        };
        Tensor::from_primitive(TensorPrimitive::Float(B::dense_gelu(
            x.into_primitive().tensor(),
            weight,
            bias,
        )))
    }

    /// The weight and the bias in the type `dt`, for one of the fast path's fused layers:
    /// `None` unless `fast` and the layer is a plain one (not factored, no gyro dropout),
    /// which the fused ops do not cover.
    fn fused_parts(
        &self,
        fast: bool,
        dt: DType,
    ) -> Option<(FloatTensor<B>, Option<FloatTensor<B>>)> {
        if !(fast && self.factors.is_none() && self.input_dropout.gyro.is_none()) {
            return None;
        }
        let bias = self
            .bias
            .as_ref()
            .map(|b| cast_like(b.val(), dt).into_primitive().tensor());
        Some((
            cast_like(self.weight.val(), dt).into_primitive().tensor(),
            bias,
        ))
    }
}

/// A 2-D convolution with Burn's parameters and initialisation that runs in either layout.
#[derive(Module, Debug)]
pub struct Conv2d<B: Backend> {
    /// `[out_channels, in_channels / groups, kernel_h, kernel_w]`.
    pub weight: Param<Tensor<B, 4>>,
    /// `[out_channels]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// Stride.
    pub stride: [usize; 2],
    /// Kernel size.
    pub kernel_size: [usize; 2],
    /// Spacing between kernel taps.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
    /// Padding.
    pub padding: PaddingConfig2d,
    /// The variant model surgery chose (default: the plain convolution).
    pub variant: ConvVariant,
    /// The squeeze-and-excitation block SqueezeExcite's surgery put after the convolution.
    pub excite: Option<SqueezeExcite<B>>,
    /// Factorize's two factors, when the layer is factored (its `weight` is then empty).
    pub factors: Option<ConvFactors<B>>,
}

impl<B: Backend> Conv2d<B> {
    /// The layer `config` describes, initialised as Burn initialises its own.
    pub fn new(config: &Conv2dConfig, device: &B::Device) -> Self {
        config.init::<B>(device).into()
    }

    /// `[out_channels, in_channels / groups, kernel_h, kernel_w]`, factored or not.
    pub fn weight_dims(&self) -> [usize; 4] {
        match &self.factors {
            None => self.weight.dims(),
            Some(f) => {
                let [_, i, kh, kw] = f.first.dims();
                [f.second.dims()[0], i, kh, kw]
            }
        }
    }

    /// Multiply-adds per output position.
    pub fn macs_per_position(&self) -> usize {
        match &self.factors {
            None => self.weight.dims().iter().product(),
            Some(f) => {
                f.first.dims().iter().product::<usize>() + f.second.dims().iter().product::<usize>()
            }
        }
    }

    /// Replaces the kernel by two factors of rank `rank` from the truncated SVD of the
    /// weights as an `out x (in * kh * kw)` matrix (see [`truncated_svd`]): a convolution
    /// into `rank` channels with the layer's kernel, stride and padding, then a 1x1
    /// convolution with the layer's bias. The weight parameter keeps its id but becomes
    /// empty (`[0, in, kh, kw]`). Panics on a factored or grouped layer, or a rank above
    /// `min(out, in * kh * kw)`.
    pub fn factorize(&mut self, rank: usize) {
        assert!(self.factors.is_none(), "the layer is already factored");
        assert_eq!(self.groups, 1, "a grouped convolution cannot be factored");
        let [o, i, kh, kw] = self.weight.dims();
        let device = self.weight.device();
        let w = self
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>();
        // Invariant: converted to f32 just above.
        let w = w.expect("f32 weights");
        let (p, q) = truncated_svd(&w, o, i * kh * kw, rank);
        let param = |v: Vec<f32>, shape: [usize; 4]| {
            Param::from_tensor(Tensor::from_data(TensorData::new(v, shape), &device))
        };
        self.factors = Some(ConvFactors {
            first: param(q, [rank, i, kh, kw]),
            second: param(p, [o, rank, 1, 1]),
        });
        self.weight = Param::initialized(
            self.weight.id,
            Tensor::zeros([0, i, kh, kw], &device).require_grad(),
        );
    }

    /// What the model's surgery sees of this layer, at `path`.
    pub fn info(&self, path: &str) -> ConvInfo {
        let [out_channels, in_per_group, kh, kw] = self.weight_dims();
        ConvInfo {
            path: path.to_string(),
            in_channels: in_per_group * self.groups,
            out_channels,
            kernel: [kh, kw],
            stride: self.stride,
            groups: self.groups,
        }
    }
}

/// Burn's layer, parameters (and their ids) included, as this crate's.
impl<B: Backend> From<burn::nn::conv::Conv2d<B>> for Conv2d<B> {
    fn from(c: burn::nn::conv::Conv2d<B>) -> Self {
        Self {
            weight: c.weight,
            bias: c.bias,
            stride: c.stride,
            kernel_size: c.kernel_size,
            dilation: c.dilation,
            groups: c.groups,
            padding: c.padding,
            variant: ConvVariant::default(),
            excite: None,
            factors: None,
        }
    }
}

impl<B: ChannelsLastBackend> Conv2d<B> {
    /// The convolution of `x`, NHWC when `channels_last` (else NCHW), followed by a ReLU when
    /// `relu` (fused into the kernel on the fast path).
    /// With BlurPool's variant the input is blurred first, or the convolution runs at stride
    /// 1 and its output is blurred with the layer's stride (see [`blur2d`]). With a
    /// squeeze-and-excitation block, the block rescales the convolution's output before the
    /// ReLU.
    pub fn forward(&self, x: Tensor<B, 4>, channels_last: bool, relu: bool) -> Tensor<B, 4> {
        let fuse = relu && self.excite.is_none();
        let maybe_relu = |y: Tensor<B, 4>, on: bool| {
            if on {
                burn::tensor::activation::relu(y)
            } else {
                y
            }
        };
        let y = match self.variant.blur {
            None => self.convolve(x, self.stride, channels_last, fuse),
            Some(Blur::First) => {
                let x = blur2d(x, [1, 1], channels_last);
                self.convolve(x, self.stride, channels_last, fuse)
            }
            Some(Blur::Last) => {
                let y = self.convolve(x, [1, 1], channels_last, false);
                maybe_relu(blur2d(y, self.stride, channels_last), fuse)
            }
        };
        match &self.excite {
            None => y,
            Some(se) => maybe_relu(se.forward(y, channels_last), relu),
        }
    }

    /// The weights the convolution uses: the parameter itself, or with weight
    /// standardization its standardised form (see [`standardize_weight`]). For a factored
    /// layer, the product of its factors (standardization applies to the first).
    pub fn effective_weight(&self) -> Tensor<B, 4> {
        let Some(f) = &self.factors else {
            return self.kernel();
        };
        let [r, i, kh, kw] = f.first.dims();
        let o = f.second.dims()[0];
        let first = self.kernel().reshape([r, i * kh * kw]);
        f.second
            .val()
            .reshape([o, r])
            .matmul(first)
            .reshape([o, i, kh, kw])
    }

    /// The first convolution's kernel (the weight, or the first factor), standardised when
    /// the variant says so.
    fn kernel(&self) -> Tensor<B, 4> {
        let w = match &self.factors {
            None => self.weight.val(),
            Some(f) => f.first.val(),
        };
        if self.variant.standardize {
            standardize_weight(w)
        } else {
            w
        }
    }

    /// The plain convolution at `stride`.
    fn convolve(
        &self,
        x: Tensor<B, 4>,
        stride: [usize; 2],
        channels_last: bool,
        relu: bool,
    ) -> Tensor<B, 4> {
        // Weights in the input's type (mixed precision; nothing happens when they are).
        let dt = x.dtype();
        let bias = self.bias.as_ref().map(|b| cast_like(b.val(), dt));
        let kernel = cast_like(self.kernel(), dt);
        let second = self.factors.as_ref().map(|f| cast_like(f.second.val(), dt));
        if !channels_last {
            let [_, _, h, w] = x.dims();
            let ((top, bottom), (left, right)) =
                padding_pairs(&self.padding, h, w, self.kernel_size, stride);
            let options = PaddedConvOptions::asymmetric(
                stride,
                [top, left],
                [bottom, right],
                self.dilation,
                self.groups,
            );
            let y = match second {
                None => conv2d(x, kernel, bias, options),
                Some(second) => {
                    let y = conv2d(x, kernel, None, options);
                    conv2d(y, second, bias, ConvOptions::new([1, 1], [0, 0], [1, 1], 1))
                }
            };
            return if relu {
                burn::tensor::activation::relu(y)
            } else {
                y
            };
        }
        let [_, h, w, _] = x.dims();
        let pairs = padding_pairs(&self.padding, h, w, self.kernel_size, stride);
        let ((top, bottom), (left, right)) = pairs;
        let (x, padding) = if top == bottom && left == right {
            (x, [top, left])
        } else {
            (pad_nhwc(x, pairs, 0.0), [0, 0])
        };
        let options = ConvOptions::new(stride, padding, self.dilation, self.groups);
        match second {
            None => conv2d_nhwc(x, kernel, bias, options, relu),
            Some(second) => {
                let y = conv2d_nhwc(x, kernel, None, options, false);
                let pointwise = ConvOptions::new([1, 1], [0, 0], [1, 1], 1);
                conv2d_nhwc(y, second, bias, pointwise, relu)
            }
        }
    }
}

/// 2-D max pooling (Burn's `MaxPool2d`, without `ceil_mode`) in either layout.
#[derive(Module, Debug, Clone)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel_size: [usize; 2],
    /// Stride.
    pub stride: [usize; 2],
    /// Padding (never part of a maximum).
    pub padding: PaddingConfig2d,
    /// Spacing between window taps.
    pub dilation: [usize; 2],
    /// The variant model surgery chose (default: the plain max pool).
    pub variant: PoolVariant,
}

impl MaxPool2d {
    /// A `kernel` window moving by `stride`, without padding or dilation.
    pub fn new(kernel: [usize; 2], stride: [usize; 2]) -> Self {
        Self {
            kernel_size: kernel,
            stride,
            padding: PaddingConfig2d::Valid,
            dilation: [1, 1],
            variant: PoolVariant::default(),
        }
    }

    /// What the model's surgery sees of this layer, at `path`.
    pub fn info(&self, path: &str) -> PoolInfo {
        PoolInfo {
            path: path.to_string(),
            kernel: self.kernel_size,
            stride: self.stride,
        }
    }

    /// The pooling of `x`, NHWC when `channels_last` (else NCHW). With BlurPool's variant,
    /// the maxima are taken at stride 1 and blurred with the pool's stride (the paper's
    /// MaxBlurPool).
    pub fn forward<B: ChannelsLastBackend>(
        &self,
        x: Tensor<B, 4>,
        channels_last: bool,
    ) -> Tensor<B, 4> {
        if self.variant.blur {
            let maxima = self.pool(x, [1, 1], channels_last);
            return blur2d(maxima, self.stride, channels_last);
        }
        self.pool(x, self.stride, channels_last)
    }

    /// The plain max pool at `stride`.
    fn pool<B: ChannelsLastBackend>(
        &self,
        x: Tensor<B, 4>,
        stride: [usize; 2],
        channels_last: bool,
    ) -> Tensor<B, 4> {
        let (h, w) = if channels_last {
            let [_, h, w, _] = x.dims();
            (h, w)
        } else {
            let [_, _, h, w] = x.dims();
            (h, w)
        };
        let pairs = padding_pairs(&self.padding, h, w, self.kernel_size, stride);
        let ((top, bottom), (left, right)) = pairs;
        let symmetric = top == bottom && left == right;
        if !channels_last {
            // As Burn's layer: asymmetric padding is applied first, with -inf.
            let (x, padding) = if symmetric {
                (x, [top, left])
            } else {
                (
                    x.pad(
                        (left, right, top, bottom),
                        PadMode::Constant(f32::NEG_INFINITY),
                    ),
                    [0, 0],
                )
            };
            return max_pool2d(x, self.kernel_size, stride, padding, self.dilation, false);
        }
        let (x, padding) = if symmetric {
            (x, [top, left])
        } else {
            (pad_nhwc(x, pairs, f32::NEG_INFINITY), [0, 0])
        };
        max_pool2d_nhwc(x, self.kernel_size, stride, padding, self.dilation)
    }
}

/// 2-D average pooling (Burn's `AvgPool2d`, without `ceil_mode`) in either layout.
#[derive(Module, Debug, Clone)]
pub struct AvgPool2d {
    /// Window size.
    pub kernel_size: [usize; 2],
    /// Stride.
    pub stride: [usize; 2],
    /// Symmetric padding (rows, columns).
    pub padding: [usize; 2],
    /// Whether padded positions count in the divisor.
    pub count_include_pad: bool,
}

impl AvgPool2d {
    /// A `kernel` window moving by `stride`, without padding.
    pub fn new(kernel: [usize; 2], stride: [usize; 2]) -> Self {
        Self {
            kernel_size: kernel,
            stride,
            padding: [0, 0],
            count_include_pad: true,
        }
    }

    /// The pooling of `x`, NHWC when `channels_last` (else NCHW).
    pub fn forward<B: ChannelsLastBackend>(
        &self,
        x: Tensor<B, 4>,
        channels_last: bool,
    ) -> Tensor<B, 4> {
        if channels_last {
            avg_pool2d_nhwc(
                x,
                self.kernel_size,
                self.stride,
                self.padding,
                self.count_include_pad,
            )
        } else {
            avg_pool2d(
                x,
                self.kernel_size,
                self.stride,
                self.padding,
                self.count_include_pad,
                false,
            )
        }
    }
}
