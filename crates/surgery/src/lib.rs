//! Model surgery: how the architecture algorithms (BlurPool, GhostBatchNorm, ALiBi, ...)
//! change a model that is already built.
//!
//! Burn modules are typed structs, so nothing can be swapped into a built model the way
//! Composer replaces `torch.nn` modules. Instead a *surgery-ready* layer carries the variants
//! it can run as plain settings ([`ConvVariant`], [`PoolVariant`], [`NormVariant`],
//! [`ResidualVariant`], ...): a convolution can be told to blur its input, a batch norm to
//! normalise over ghost batches, a residual block to drop its branch as this batch's draw
//! says. The layers that change parameters rebuild themselves (a convolution adds its
//! squeeze-and-excitation block or factors its weight, an MLP becomes gated), so that their
//! types stay their own.
//!
//! A model opts in by implementing one trait, [`Surgical`]: it shows each of its
//! surgery-ready layers, with its path, to [`Layers`], in module order. Every surgery
//! algorithm walks the layers of the kinds it changes through [`SurgicalExt`], which every
//! `Surgical` model has. Flashover's layers (`flashover-models`) implement the layer traits
//! of [`layer`]; a model built from them lists them in a few lines, and a layer of the user's
//! own implements the trait of its kind. An algorithm given a model that shows no layer of
//! the kinds it changes fails at `INIT`, before any batch, naming the kinds; that a model
//! takes surgery at all is checked by the compiler (the algorithms bound on `Surgical`).
//!
//! Surgery runs at `INIT`, before the optimizer has seen a parameter and before a checkpoint
//! is restored; parameters keep their ids and names (settings carry no parameters), so
//! checkpoints, EMA, SWA and layer freezing see the same parameters. The surgeries that add
//! parameters add them at `INIT` too, under new names next to the layer they follow, drawn
//! from the run's seed alone: a checkpoint of the run has them, and its restore finds them
//! already in place. A layer whose settings are the defaults runs exactly as before: one
//! comparison per layer and forward pass.
//!
//! Every surgery algorithm saves what it did (which layers, with which settings) as its
//! checkpoint state ([`SurgeryRecord`]) and compares it on restore
//! ([`check_surgery_record`]).
//!
//! Core knows nothing of any of this: this crate depends on `flashover-core` for the half
//! types alone, and `flashover-models` (the layers) and `flashover-algorithms` (the
//! surgeries) both depend on it.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod layer;
mod record;
mod settings;
mod walk;

pub use flashover_core::precision::HalfType;
pub use layer::{
    AttentionLayer, BatchNormLayer, ConvLayer, DropoutSite, GroupNormLayer, LayerNormLayer,
    LinearLayer, MaxPoolLayer, MlpLayer, PositionEmbeddings, ResidualBlock,
};
pub use record::{check_surgery_record, SurgeryMismatch, SurgeryRecord};
pub use settings::*;
pub use walk::SurgicalExt;

/// A model that surgery can change: it shows its surgery-ready layers.
///
/// ```
/// use flashover_surgery::{ConvInfo, ConvLayer, ConvVariant, Layers, Surgical, SurgicalExt};
///
/// /// A convolution of the user's own.
/// #[derive(Default)]
/// struct MyConv {
///     variant: ConvVariant,
/// }
///
/// impl ConvLayer for MyConv {
///     fn info(&self, path: &str) -> ConvInfo {
///         ConvInfo { path: path.into(), in_channels: 3, out_channels: 8, kernel: [3, 3], stride: [2, 2], groups: 1 }
///     }
///     fn variant(&mut self) -> &mut ConvVariant {
///         &mut self.variant
///     }
///     fn has_squeeze_excite(&self) -> bool { false }
///     fn add_squeeze_excite(&mut self, _hidden: usize, _seed: u64) {}
///     fn is_factored(&self) -> bool { true }
///     fn factorize(&mut self, _rank: usize) {}
/// }
///
/// struct Net {
///     stem: MyConv,
///     blocks: Vec<MyConv>,
/// }
///
/// impl Surgical for Net {
///     fn visit_layers(&mut self, layers: &mut Layers<'_>) {
///         layers.conv("stem", &mut self.stem);
///         for (i, conv) in self.blocks.iter_mut().enumerate() {
///             layers.conv(&format!("blocks.{i}"), conv);
///         }
///     }
/// }
///
/// let mut net = Net { stem: MyConv::default(), blocks: vec![MyConv::default(), MyConv::default()] };
/// let mut paths = Vec::new();
/// net.for_each_conv(&mut |info, variant| {
///     variant.standardize = true;
///     paths.push(info.path.clone());
/// });
/// assert_eq!(paths, ["stem", "blocks.0", "blocks.1"]);
/// assert!(net.blocks[1].variant.standardize);
/// ```
pub trait Surgical {
    /// Shows every surgery-ready layer to `layers`, with its path in the model's record
    /// (`blocks.3.conv1`), in module order. A layer may be shown as more than one kind (a
    /// dense head is a [`LinearLayer`] and a [`DropoutSite`]); the order that matters is the
    /// order among the layers of one kind, which seeds and checkpoint records follow.
    fn visit_layers(&mut self, layers: &mut Layers<'_>);
}

/// One surgery-ready layer, as [`Layers`] hands it to a walk.
pub enum LayerMut<'a> {
    /// A convolution.
    Conv(&'a mut dyn ConvLayer),
    /// A dense layer.
    Linear(&'a mut dyn LinearLayer),
    /// A max pool.
    MaxPool(&'a mut dyn MaxPoolLayer),
    /// A batch norm.
    BatchNorm(&'a mut dyn BatchNormLayer),
    /// A group norm.
    GroupNorm(&'a mut dyn GroupNormLayer),
    /// A layer norm.
    LayerNorm(&'a mut dyn LayerNormLayer),
    /// A residual block.
    Residual(&'a mut dyn ResidualBlock),
    /// A dropout site.
    DropoutSite(&'a mut dyn DropoutSite),
    /// An attention layer.
    Attention(&'a mut dyn AttentionLayer),
    /// A transformer MLP.
    Mlp(&'a mut dyn MlpLayer),
    /// Learned position embeddings.
    PositionEmbeddings(&'a mut dyn PositionEmbeddings),
}

impl LayerMut<'_> {
    /// Its kind.
    pub fn kind(&self) -> LayerKind {
        match self {
            LayerMut::Conv(_) => LayerKind::Conv,
            LayerMut::Linear(_) => LayerKind::Linear,
            LayerMut::MaxPool(_) => LayerKind::MaxPool,
            LayerMut::BatchNorm(_) => LayerKind::BatchNorm,
            LayerMut::GroupNorm(_) => LayerKind::GroupNorm,
            LayerMut::LayerNorm(_) => LayerKind::LayerNorm,
            LayerMut::Residual(_) => LayerKind::Residual,
            LayerMut::DropoutSite(_) => LayerKind::DropoutSite,
            LayerMut::Attention(_) => LayerKind::Attention,
            LayerMut::Mlp(_) => LayerKind::Mlp,
            LayerMut::PositionEmbeddings(_) => LayerKind::PositionEmbeddings,
        }
    }
}

/// The kinds of layer surgery reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// [`ConvLayer`].
    Conv,
    /// [`LinearLayer`].
    Linear,
    /// [`MaxPoolLayer`].
    MaxPool,
    /// [`BatchNormLayer`].
    BatchNorm,
    /// [`GroupNormLayer`].
    GroupNorm,
    /// [`LayerNormLayer`].
    LayerNorm,
    /// [`ResidualBlock`].
    Residual,
    /// [`DropoutSite`].
    DropoutSite,
    /// [`AttentionLayer`].
    Attention,
    /// [`MlpLayer`].
    Mlp,
    /// [`PositionEmbeddings`].
    PositionEmbeddings,
}

/// Where a [`Surgical`] model shows its layers: one method per kind, each handing the layer
/// and its path to the walk under way.
pub struct Layers<'f> {
    visit: &'f mut dyn FnMut(&str, LayerMut<'_>),
}

impl<'f> Layers<'f> {
    /// Layers handed to `visit`.
    pub fn new(visit: &'f mut dyn FnMut(&str, LayerMut<'_>)) -> Self {
        Self { visit }
    }

    /// Shows a layer of any kind.
    pub fn layer(&mut self, path: &str, layer: LayerMut<'_>) {
        (self.visit)(path, layer);
    }

    /// Shows a convolution.
    pub fn conv(&mut self, path: &str, layer: &mut dyn ConvLayer) {
        self.layer(path, LayerMut::Conv(layer));
    }

    /// Shows a dense layer.
    pub fn linear(&mut self, path: &str, layer: &mut dyn LinearLayer) {
        self.layer(path, LayerMut::Linear(layer));
    }

    /// Shows a max pool.
    pub fn max_pool(&mut self, path: &str, layer: &mut dyn MaxPoolLayer) {
        self.layer(path, LayerMut::MaxPool(layer));
    }

    /// Shows a batch norm.
    pub fn batch_norm(&mut self, path: &str, layer: &mut dyn BatchNormLayer) {
        self.layer(path, LayerMut::BatchNorm(layer));
    }

    /// Shows a group norm.
    pub fn group_norm(&mut self, path: &str, layer: &mut dyn GroupNormLayer) {
        self.layer(path, LayerMut::GroupNorm(layer));
    }

    /// Shows a layer norm.
    pub fn layer_norm(&mut self, path: &str, layer: &mut dyn LayerNormLayer) {
        self.layer(path, LayerMut::LayerNorm(layer));
    }

    /// Shows a residual block.
    pub fn residual(&mut self, path: &str, block: &mut dyn ResidualBlock) {
        self.layer(path, LayerMut::Residual(block));
    }

    /// Shows a dropout site (`path`: the layer whose input is dropped).
    pub fn dropout_site(&mut self, path: &str, site: &mut dyn DropoutSite) {
        self.layer(path, LayerMut::DropoutSite(site));
    }

    /// Shows an attention layer.
    pub fn attention(&mut self, path: &str, layer: &mut dyn AttentionLayer) {
        self.layer(path, LayerMut::Attention(layer));
    }

    /// Shows a transformer MLP.
    pub fn mlp(&mut self, path: &str, layer: &mut dyn MlpLayer) {
        self.layer(path, LayerMut::Mlp(layer));
    }

    /// Shows learned position embeddings.
    pub fn position_embeddings(&mut self, path: &str, embeddings: &mut dyn PositionEmbeddings) {
        self.layer(path, LayerMut::PositionEmbeddings(embeddings));
    }
}
