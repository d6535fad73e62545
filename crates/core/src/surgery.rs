//! Model surgery: how the architecture algorithms (BlurPool, GhostBatchNorm, ...) change a
//! model that is already built.
//!
//! Burn modules are typed structs, so nothing can be swapped into a built model the way
//! Composer replaces `torch.nn` modules. Instead a *surgery-ready* layer carries the variants
//! it can run as plain settings ([`ConvVariant`], [`PoolVariant`], [`NormVariant`],
//! [`ResidualVariant`]): a convolution can be told to blur its input, a batch norm to
//! normalise over ghost batches, a residual block to drop its branch as this batch's draw
//! says. A model opts in by implementing the capability traits below, each of which walks the
//! model's layers of one kind in module order ([`ConvSurgery`], [`PoolSurgery`],
//! [`NormSurgery`], [`ResidualSurgery`], [`DropoutSurgery`]); an algorithm that needs a kind of layer bounds on its trait, so adding
//! it to a model without such layers does not compile. Flashover's layers implement
//! everything (`flashover-models`); a model built from them forwards each trait to its
//! layers in a few lines, and a model of the user's own implements the traits itself.
//!
//! Surgery runs at `INIT`, before the optimizer has seen a parameter and before a checkpoint
//! is restored; parameters keep their ids and names (settings carry no parameters), so
//! checkpoints, EMA, SWA and layer freezing see the same parameters. The surgeries that add
//! parameters (SqueezeExcite's blocks, [`ExciteSurgery`]) add them at `INIT` too, under new
//! names next to the layer they follow, drawn from the run's seed alone: a checkpoint of
//! the run has them, and its restore finds them already in place. Factorize
//! ([`FactorSurgery`]) replaces a layer's weight by two factors computed from it: the weight
//! keeps its name and id, emptied, and the factors are new parameters. A layer whose settings
//! are the defaults runs exactly as before: one comparison per layer and forward pass.
//!
//! Every surgery algorithm saves what it did (which layers, with which settings) as its
//! checkpoint state and compares it on restore: a checkpoint shaped by other surgeries, or
//! the same ones with other settings, is refused with both descriptions in the error
//! ([`check_surgery_record`]), and a run without a surgery the checkpoint had is refused by
//! the trainer as for any algorithm state it does not use.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{CoreError, Result};

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

/// A half-precision floating-point type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HalfType {
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (float32's exponent, 8 bits of mantissa).
    BF16,
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

/// A model whose attention layers and position encoding surgery can change (ALiBi).
pub trait AttentionSurgery {
    /// Calls `f` on every attention layer, in module order.
    fn for_each_attention(&mut self, f: &mut dyn FnMut(&AttentionInfo, &mut AttentionVariant));
    /// Removes the model's learned position embeddings (the ALiBi model has none) and lets
    /// it take inputs of up to `max_sequence_length` tokens. Returns the path of the
    /// parameter removed, or `None` if the model had none.
    fn remove_position_embeddings(&mut self, max_sequence_length: usize) -> Option<String>;
}

/// A model whose transformer MLPs can become gated linear units (GatedLinearUnits). The
/// model rebuilds the layers itself, so that their type stays its own.
pub trait GluSurgery {
    /// Rebuilds every MLP (in module order) for which `settings` returns settings as a gated
    /// linear unit: its first layer becomes the value layer and a gate layer is added, both
    /// `width -> hidden`, and its second layer `hidden -> width`, all freshly initialised from
    /// a generator seeded by `derive_seed(&[seed, index])` (`index` counting the MLPs from
    /// 0). The first and second layers keep their parameter names and ids; the gate is a new
    /// parameter. An MLP already gated keeps its layers. Returns the paths of the MLPs
    /// rebuilt.
    fn gated_linear_units(
        &mut self,
        settings: &mut dyn FnMut(&MlpInfo) -> Option<GluSettings>,
        seed: u64,
    ) -> Vec<String>;
}

/// A model whose layer norms surgery can change (LowPrecisionLayerNorm).
pub trait LayerNormSurgery {
    /// Calls `f` on every layer norm, in module order.
    fn for_each_layer_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut LayerNormVariant));
}

/// The variants a surgery-ready layer norm can run. The default computes in the
/// activations' type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LayerNormVariant {
    /// LowPrecisionLayerNorm: normalise in this half type.
    pub low_precision: Option<HalfType>,
}

/// A model whose convolutions surgery can change.
pub trait ConvSurgery {
    /// Calls `f` on every convolution, in module order.
    fn for_each_conv(&mut self, f: &mut dyn FnMut(&ConvInfo, &mut ConvVariant));
}

/// A model whose max pools surgery can change.
pub trait PoolSurgery {
    /// Calls `f` on every max pool, in module order.
    fn for_each_max_pool(&mut self, f: &mut dyn FnMut(&PoolInfo, &mut PoolVariant));
}

/// A model whose residual blocks surgery can change (StochasticDepth).
pub trait ResidualSurgery {
    /// Calls `f` on every residual block, in module order.
    fn for_each_residual(&mut self, f: &mut dyn FnMut(&ResidualInfo, &mut ResidualVariant));
}

/// A model whose dropout sites surgery can change (GyroDropout).
pub trait DropoutSurgery {
    /// Calls `f` on every dropout site, in module order.
    fn for_each_dropout(&mut self, f: &mut dyn FnMut(&DropoutInfo, &mut DropoutVariant));
}

/// A model that can take squeeze-and-excitation blocks after its convolutions
/// (SqueezeExcite). Unlike the settings above, the blocks carry parameters: the model builds
/// them, so that their type stays the model's own.
pub trait ExciteSurgery {
    /// Adds a block after every convolution, in module order, for which `latent` returns a
    /// hidden width, with weights drawn from a generator seeded by
    /// `derive_seed(&[seed, index])` (`index` counting the convolutions from 0), so that
    /// every rank of a data-parallel run builds the same blocks. A convolution that already
    /// has a block keeps it. Returns the paths of the convolutions given a block.
    fn add_squeeze_excite(
        &mut self,
        latent: &mut dyn FnMut(&ConvInfo) -> Option<usize>,
        seed: u64,
    ) -> Vec<String>;
}

/// A model whose convolutions and dense layers can be factored (Factorize). Like
/// [`ExciteSurgery`], it changes parameters: the model replaces them itself.
pub trait FactorSurgery {
    /// Replaces every convolution for which `conv_rank` returns a rank, then every dense layer
    /// for which `linear_rank` does, each in module order, by two factors of that rank
    /// initialised from the truncated SVD of its weights (the weight parameter keeps its name
    /// and id, empty; the factors are new parameters). Layers already factored, and grouped
    /// convolutions, are not offered. Returns the paths of the layers factored.
    fn factorize(
        &mut self,
        conv_rank: &mut dyn FnMut(&ConvInfo) -> Option<usize>,
        linear_rank: &mut dyn FnMut(&LinearInfo) -> Option<usize>,
    ) -> Vec<String>;
}

/// A model whose group norms surgery can change (LowPrecisionGroupNorm).
pub trait GroupNormSurgery {
    /// Calls `f` on every group norm, in module order.
    fn for_each_group_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut GroupNormVariant));
}

/// A model whose batch norms surgery can change.
pub trait NormSurgery {
    /// Calls `f` on every batch norm, in module order.
    fn for_each_batch_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut NormVariant));
}

/// A model's surgery capabilities, asked at run time: what an algorithm chosen by name (the
/// `--algorithms` list, when the program picks the model at run time too) uses, with a clear
/// error at `INIT` where a capability is missing. Typed code bounds on the capability traits
/// instead and gets the check from the compiler. Each method returns the model itself where
/// it has that kind of layer.
pub trait SurgeryModel {
    /// The model's convolutions, if it has surgery-ready ones.
    fn conv_surgery(&mut self) -> Option<&mut dyn ConvSurgery> {
        None
    }
    /// The model's max pools, if it has surgery-ready ones.
    fn pool_surgery(&mut self) -> Option<&mut dyn PoolSurgery> {
        None
    }
    /// The model's batch norms, if it has surgery-ready ones.
    fn norm_surgery(&mut self) -> Option<&mut dyn NormSurgery> {
        None
    }
    /// The model's residual blocks, if it has surgery-ready ones.
    fn residual_surgery(&mut self) -> Option<&mut dyn ResidualSurgery> {
        None
    }
    /// The model's dropout sites, if it has surgery-ready ones.
    fn dropout_surgery(&mut self) -> Option<&mut dyn DropoutSurgery> {
        None
    }
    /// The model's squeeze-and-excitation capability, if it has one.
    fn excite_surgery(&mut self) -> Option<&mut dyn ExciteSurgery> {
        None
    }
    /// The model's factorization capability, if it has one.
    fn factor_surgery(&mut self) -> Option<&mut dyn FactorSurgery> {
        None
    }
    /// The model's group norms, if it has surgery-ready ones.
    fn group_norm_surgery(&mut self) -> Option<&mut dyn GroupNormSurgery> {
        None
    }
    /// The model's attention layers, if it has surgery-ready ones.
    fn attention_surgery(&mut self) -> Option<&mut dyn AttentionSurgery> {
        None
    }
    /// The model's transformer MLPs, if they can become gated linear units.
    fn glu_surgery(&mut self) -> Option<&mut dyn GluSurgery> {
        None
    }
    /// The model's layer norms, if it has surgery-ready ones.
    fn layer_norm_surgery(&mut self) -> Option<&mut dyn LayerNormSurgery> {
        None
    }
}

/// What one surgery algorithm did to a model: its settings and the layers it changed, in
/// module order. Saved as the algorithm's checkpoint state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SurgeryRecord {
    /// The algorithm's settings as it describes them (its CLI form, for example
    /// `blurpool:replace_convs=true:replace_maxpools=true:blur_first=true:min_channels=16`).
    pub settings: String,
    /// Paths of the layers changed.
    pub layers: Vec<String>,
}

impl SurgeryRecord {
    /// The record as checkpoint state.
    pub fn to_value(&self) -> Value {
        // Invariant: a struct of strings always serialises.
        serde_json::to_value(self).expect("a surgery record serialises")
    }
}

/// Compares the surgery record a checkpoint saved (`saved`, the algorithm's state) with what
/// the algorithm did to this run's model (`applied`): an error naming both when they differ
/// (other settings, or other layers changed: another model), or when the saved state is not
/// a record at all.
pub fn check_surgery_record(name: &str, saved: Value, applied: &SurgeryRecord) -> Result<()> {
    let describe = |r: &SurgeryRecord| format!("{} on [{}]", r.settings, r.layers.join(", "));
    let mismatch = |saved: String| CoreError::SurgeryMismatch {
        algorithm: name.to_string(),
        saved,
        applied: describe(applied),
    };
    let saved: SurgeryRecord = serde_json::from_value(saved.clone())
        .map_err(|e| mismatch(format!("{saved} (not a surgery record: {e})")))?;
    if &saved == applied {
        Ok(())
    } else {
        Err(mismatch(describe(&saved)))
    }
}
