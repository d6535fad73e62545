//! Flashover models and their layers.
//!
//! - [`ops`]: [`ChannelsLastBackend`], the backend extension for convolution and pooling on
//!   channels-last activations, with fast CPU kernels on flex ([`kernels`], over the `gemm`
//!   crate) and Burn's own kernels on the other backends.
//! - [`layers`]: `Conv2d`, `MaxPool2d`, `AvgPool2d` that run in either memory format with
//!   Burn's parameters, and the plain functions under them for hand-written models.
//! - [`norm`]: [`BatchNorm`](norm::BatchNorm) in either memory format, with Burn's record.
//! - [`MnistCnn`]: the main job's CNN, built from those layers; [`ResNet`]: the residual
//!   networks for small images ([`ResNetConfig`]: CIFAR's ResNet-20/56 family and a
//!   ResNet-18), built from the same layers; [`Gpt`]: a decoder-only transformer language
//!   model ([`GptConfig`]), its dense layers the same `Linear`.
//! - [`ModelError`]: every shape and setting is checked where it is given (the configs'
//!   fields are private behind validating constructors), so no configuration reaches a panic.
//!
//! A model's [`MemoryFormat`] picks the path: `Auto` (the default) is channels-last where the
//! backend's channels-last kernels are its fast ones (flex) and channels-first elsewhere;
//! the `ChannelsLast` algorithm (`--algorithms channels_last`) asks for channels-last
//! explicitly. Results of the fast path are bit-identical run to run and for any number of
//! threads.
#![warn(missing_docs)]

mod error;
pub mod gemm;
mod gpt;
pub mod kernels;
pub mod layers;
pub mod lowrank;
mod mnist;
pub mod norm;
pub mod ops;
mod resnet;

pub use error::ModelError;
pub use flashover_core::model::{HasMemoryFormat, MemoryFormat};
pub use gpt::{Attention, Block, Gpt, GptConfig, Mlp, Sampling};
pub use mnist::MnistCnn;
pub use ops::ChannelsLastBackend;
pub use resnet::{BasicBlock, Projection, ResNet, ResNetConfig};

use burn::tensor::backend::AutodiffBackend;

/// Whether a model in `format` runs channels-last on backend `B`.
pub fn channels_last<B: ChannelsLastBackend>(format: MemoryFormat) -> bool {
    match format {
        MemoryFormat::Auto => B::CHANNELS_LAST_IS_FAST,
        MemoryFormat::ChannelsFirst => false,
        MemoryFormat::ChannelsLast => true,
    }
}

/// A backend to train this crate's models on: an autodiff backend whose inner (evaluation)
/// backend has the channels-last extension too. Implemented for every such backend.
pub trait TrainBackend:
    AutodiffBackend<InnerBackend: ChannelsLastBackend> + ChannelsLastBackend
{
}

impl<B> TrainBackend for B
where
    B: AutodiffBackend + ChannelsLastBackend,
    B::InnerBackend: ChannelsLastBackend,
{
}
