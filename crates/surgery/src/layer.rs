//! The layers surgery reaches, one small trait per kind. Flashover's layers
//! (`flashover-models`: `Conv2d`, `Linear`, `MaxPool2d`, `BatchNorm`, `GroupNorm`,
//! `LayerNorm`, the ResNet's blocks, the GPT's attention and MLPs) implement them; a layer of
//! the user's own implements the trait of its kind to be reached too. Each trait is
//! object-safe: a model shows its layers as `&mut dyn` to [`Layers`](crate::Layers).

use crate::settings::{
    AttentionInfo, AttentionVariant, ConvInfo, ConvVariant, DropoutVariant, GluSettings,
    GroupNormVariant, LayerNormVariant, LinearInfo, MlpInfo, NormInfo, NormVariant, PoolInfo,
    PoolVariant, ResidualVariant,
};

/// A convolution: BlurPool and WeightStandardization set its settings, SqueezeExcite adds a
/// block after it, Factorize replaces its weight by two factors.
pub trait ConvLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> ConvInfo;
    /// Its settings.
    fn variant(&mut self) -> &mut ConvVariant;
    /// Whether a squeeze-and-excitation block already follows it.
    fn has_squeeze_excite(&self) -> bool;
    /// Adds a squeeze-and-excitation block of `hidden` features after it, its weights drawn
    /// from a generator seeded by `seed`.
    fn add_squeeze_excite(&mut self, hidden: usize, seed: u64);
    /// Whether its weight is already two factors (grouped convolutions are never offered).
    fn is_factored(&self) -> bool;
    /// Replaces its weight by two factors of rank `rank`, initialised from the truncated SVD
    /// of the weight (the weight parameter keeps its name and id, empty; the factors are new
    /// parameters).
    fn factorize(&mut self, rank: usize);
}

/// A dense layer: Factorize replaces its weight by two factors.
pub trait LinearLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> LinearInfo;
    /// Whether its weight is already two factors.
    fn is_factored(&self) -> bool;
    /// As [`ConvLayer::factorize`].
    fn factorize(&mut self, rank: usize);
}

/// A max pool (BlurPool).
pub trait MaxPoolLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> PoolInfo;
    /// Its settings.
    fn variant(&mut self) -> &mut PoolVariant;
}

/// A batch norm (GhostBatchNorm).
pub trait BatchNormLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> NormInfo;
    /// Its settings.
    fn variant(&mut self) -> &mut NormVariant;
}

/// A group norm (LowPrecisionGroupNorm).
pub trait GroupNormLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> NormInfo;
    /// Its settings.
    fn variant(&mut self) -> &mut GroupNormVariant;
}

/// A layer norm (LowPrecisionLayerNorm).
pub trait LayerNormLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> NormInfo;
    /// Its settings.
    fn variant(&mut self) -> &mut LayerNormVariant;
}

/// A residual block, whose branch StochasticDepth drops (its position among the model's
/// blocks comes from the order the model shows them in).
pub trait ResidualBlock {
    /// Its settings.
    fn variant(&mut self) -> &mut ResidualVariant;
}

/// A place where dropout can act on a layer's input (GyroDropout): in Flashover's models the
/// classifier head.
pub trait DropoutSite {
    /// Features per sample there.
    fn features(&self) -> usize;
    /// Its settings.
    fn dropout(&mut self) -> &mut DropoutVariant;
}

/// A multi-head attention layer (ALiBi's biases).
pub trait AttentionLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> AttentionInfo;
    /// Its settings.
    fn variant(&mut self) -> &mut AttentionVariant;
}

/// A transformer MLP, which GatedLinearUnits rebuilds as a gated linear unit. The layer
/// rebuilds itself, so that its type stays its own.
pub trait MlpLayer {
    /// What it is, at `path` in the model.
    fn info(&self, path: &str) -> MlpInfo;
    /// Whether it is already gated.
    fn is_gated(&self) -> bool;
    /// Rebuilds it as a gated linear unit: its first layer becomes the value layer and a gate
    /// layer is added, both `width -> hidden`, and its second layer `hidden -> width`, all
    /// freshly initialised from a generator seeded by `seed`. The first and second layers
    /// keep their parameter names and ids; the gate is a new parameter.
    fn make_gated(&mut self, settings: &GluSettings, seed: u64);
}

/// A model's learned position embeddings, which ALiBi removes.
pub trait PositionEmbeddings {
    /// Removes them (if there are any) and lets the model take inputs of up to
    /// `max_sequence_length` tokens. Returns whether there were any.
    fn remove(&mut self, max_sequence_length: usize) -> bool;
}
