//! What surgery can learn of a layer (its `*Info`) and the settings a surgery-ready layer
//! runs with (its `*Variant`): plain data, no parameters. A layer whose settings are the
//! defaults runs exactly as the plain layer.

use flashover_core::precision::HalfType;
use serde::{Deserialize, Serialize};

/// Where BlurPool's low-pass filter (`[1, 2, 1] x [1, 2, 1] / 16`, per channel, zero padding
/// of one pixel) runs relative to a layer that downsamples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Blur {
    /// Blur the input at stride 1, then run the layer at its stride (Composer's
    /// `blur_first`, the default: the filter costs a depthwise pass over the input).
    First,
    /// Run the layer at stride 1, then blur with the layer's stride (the paper's order for
    /// convolutions: at stride 2 the convolution costs four times as much).
    Last,
}

/// What a convolution is, for surgery to decide whether to change it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvInfo {
    /// The layer's path in the model (`blocks.3.conv1`), for logs and checkpoint records.
    pub path: String,
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel rows and columns.
    pub kernel: [usize; 2],
    /// Stride along rows and columns.
    pub stride: [usize; 2],
    /// Channel groups.
    pub groups: usize,
}

/// What a dense layer is, for surgery (Factorize).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearInfo {
    /// The layer's path in the model.
    pub path: String,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

/// The variants a surgery-ready convolution can run. The default is the plain layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ConvVariant {
    /// BlurPool's anti-aliasing, if applied.
    pub blur: Option<Blur>,
    /// Weight standardization: the convolution uses its weights standardised per output
    /// channel (zero mean, unit variance over the input channels and the kernel).
    pub standardize: bool,
}

/// What a max pool is, for surgery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolInfo {
    /// The layer's path in the model.
    pub path: String,
    /// Window rows and columns.
    pub kernel: [usize; 2],
    /// Stride along rows and columns.
    pub stride: [usize; 2],
}

/// The variants a surgery-ready max pool can run. The default is the plain layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PoolVariant {
    /// BlurPool's anti-aliasing (the max at stride 1, then the blur with the pool's stride).
    pub blur: bool,
}

/// What a batch norm is, for surgery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormInfo {
    /// The layer's path in the model.
    pub path: String,
    /// Channels normalised.
    pub channels: usize,
}

/// The variants a surgery-ready batch norm can run. The default is the plain layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NormVariant {
    /// Ghost batch normalisation: training statistics over consecutive groups of this many
    /// samples instead of the whole batch.
    pub ghost_batch_size: Option<usize>,
}

/// The variants a surgery-ready group norm can run. The default computes in the
/// activations' type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GroupNormVariant {
    /// LowPrecisionGroupNorm: normalise in this half type.
    pub low_precision: Option<HalfType>,
}

/// What a residual block is, for surgery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidualInfo {
    /// The block's path in the model (`blocks.4`).
    pub path: String,
    /// Its position among the model's residual blocks, from 0 at the input.
    pub index: usize,
    /// How many residual blocks the model has.
    pub count: usize,
}

/// How stochastic depth drops a residual branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DropMode {
    /// The whole branch for the whole batch (Huang et al.'s block-wise method).
    Block,
    /// The branch of each sample independently (the sample-wise method).
    Sample,
}

/// This batch's draw for one residual block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keep {
    /// Block-wise: whether the branch runs.
    Block(bool),
    /// Sample-wise: whether each sample's branch counts, in batch order.
    Samples(Vec<bool>),
}

/// Stochastic depth on a residual block: in training the branch is dropped as `keep` says;
/// in evaluation it is scaled by its survival probability `1 - rate`.
#[derive(Debug, Clone, PartialEq)]
pub struct DepthDrop {
    /// How the branch is dropped.
    pub mode: DropMode,
    /// This block's drop probability now.
    pub rate: f64,
    /// The current batch's draw (set before each forward pass in training; a training pass
    /// without one keeps the branch).
    pub keep: Option<Keep>,
}

/// The variants a surgery-ready residual block can run. The default is the plain block.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResidualVariant {
    /// Stochastic depth, if applied.
    pub drop: Option<DepthDrop>,
}

/// Where a model accepts dropout, for surgery (GyroDropout): in Flashover's models the
/// input of the classifier head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropoutInfo {
    /// The path of the layer whose input is dropped (`head`, `fc2`).
    pub path: String,
    /// Features per sample at that point.
    pub features: usize,
}

/// Gyro dropout at one dropout site: in training the features of the batch's samples are
/// kept as `masks` says, and the kept ones scaled by `1 / (1 - p)`; in evaluation nothing is
/// dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct GyroMasks {
    /// The drop probability the masks were drawn with.
    pub p: f64,
    /// The current batch's masks, `rows` of `features` keep flags each, row after row:
    /// sample `i` of `n` uses row `i * rows / n` (the batch cut into `rows` nearly equal
    /// consecutive parts). Set before each training forward pass; a training pass without
    /// masks drops nothing.
    pub keep: Option<(usize, Vec<bool>)>,
}

/// The variants a surgery-ready dropout site can run. The default drops nothing.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DropoutVariant {
    /// Gyro dropout, if applied.
    pub gyro: Option<GyroMasks>,
}

/// What a multi-head attention layer is, for surgery (ALiBi).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionInfo {
    /// The layer's path in the model (`blocks.2.attention`).
    pub path: String,
    /// Attention heads.
    pub heads: usize,
}

/// The variants a surgery-ready attention layer can run. The default is plain causal
/// attention.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AttentionVariant {
    /// ALiBi: head `h`'s score of query `i` for key `j <= i` gets `-slopes[h] * (i - j)`
    /// added before the softmax.
    pub alibi_slopes: Option<Vec<f32>>,
}

/// What a transformer MLP is, for surgery (GatedLinearUnits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpInfo {
    /// The MLP's path in the model (`blocks.2.mlp`).
    pub path: String,
    /// Input and output features (the residual stream's width).
    pub width: usize,
    /// Hidden features.
    pub hidden: usize,
}

/// The activation of a gated linear unit: `act(x W) * (x V)` (Dauphin et al., 2017;
/// Shazeer, 2020, who names the variants after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GluActivation {
    /// GEGLU.
    Gelu,
    /// ReGLU.
    Relu,
    /// SwiGLU (SiLU, `x * sigmoid(x)`).
    Silu,
    /// The original GLU.
    Sigmoid,
    /// Bilinear: no activation.
    Identity,
}

impl GluActivation {
    /// The name used in the `--algorithms` syntax.
    pub fn name(self) -> &'static str {
        match self {
            GluActivation::Gelu => "gelu",
            GluActivation::Relu => "relu",
            GluActivation::Silu => "silu",
            GluActivation::Sigmoid => "sigmoid",
            GluActivation::Identity => "identity",
        }
    }

    /// Every activation, for error messages.
    pub const ALL: [GluActivation; 5] = [
        GluActivation::Gelu,
        GluActivation::Relu,
        GluActivation::Silu,
        GluActivation::Sigmoid,
        GluActivation::Identity,
    ];
}

/// How GatedLinearUnits rebuilds an MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GluSettings {
    /// The gate's activation.
    pub activation: GluActivation,
    /// Hidden features of the gated MLP.
    pub hidden: usize,
    /// Whether the gated layer has a bias.
    pub gated_bias: bool,
    /// Whether the non-gated (value) layer has a bias.
    pub non_gated_bias: bool,
}

/// The variants a surgery-ready layer norm can run. The default computes in the
/// activations' type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LayerNormVariant {
    /// LowPrecisionLayerNorm: normalise in this half type.
    pub low_precision: Option<HalfType>,
}
