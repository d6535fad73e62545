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

/// The traits an image classifier of this crate implements the same way: `Autocast` (its
/// `compute` field), `HasMemoryFormat` (its `format` field), and `TrainModel`/`EvalModel` on
/// `ClassificationBatch<B, 4>` through its `logits`, the loss on soft targets when an
/// algorithm set them, and `flops_per_sample` (forward plus backward: about three forward
/// passes) from `$forward_flops`, the model's forward FLOPs per sample. One place for the
/// impls `MnistCnn` and `ResNet` would otherwise repeat.
macro_rules! image_classifier {
    ($model:ident, |$m:ident| $forward_flops:expr) => {
        impl<B: burn::tensor::backend::Backend> flashover_core::precision::Autocast for $model<B> {
            fn compute_dtype(&self) -> Option<burn::tensor::FloatDType> {
                self.compute
            }

            fn with_compute_dtype(mut self, dtype: Option<burn::tensor::FloatDType>) -> Self {
                self.compute = dtype;
                self
            }
        }

        impl<B: burn::tensor::backend::Backend> flashover_core::model::HasMemoryFormat
            for $model<B>
        {
            fn memory_format(&self) -> flashover_core::model::MemoryFormat {
                self.format
            }

            fn with_memory_format(mut self, format: flashover_core::model::MemoryFormat) -> Self {
                self.format = format;
                self
            }
        }

        impl<B: $crate::TrainBackend> flashover_core::model::TrainModel<B> for $model<B> {
            type Batch = flashover_core::model::ClassificationBatch<B, 4>;
            type Output = burn::tensor::Tensor<B, 2>;

            fn forward(&self, batch: &Self::Batch) -> burn::tensor::Tensor<B, 2> {
                self.logits(batch.inputs.clone())
            }

            fn loss(
                &self,
                logits: &burn::tensor::Tensor<B, 2>,
                batch: &Self::Batch,
            ) -> burn::tensor::Tensor<B, 1> {
                // Soft targets (label smoothing, MixUp, CutMix) when an algorithm set them.
                flashover_core::loss::classification_loss(logits.clone(), batch)
            }

            fn flops_per_sample(&self) -> Option<f64> {
                let $m = self;
                Some(3.0 * $forward_flops)
            }
        }

        impl<B: $crate::ChannelsLastBackend> flashover_core::model::EvalModel<B> for $model<B> {
            type Batch = flashover_core::model::ClassificationBatch<B, 4>;
            type Output = flashover_core::model::ClassificationOutput<B>;

            fn forward_eval(
                &self,
                batch: &Self::Batch,
            ) -> flashover_core::model::ClassificationOutput<B> {
                flashover_core::model::ClassificationOutput::scored(
                    self.logits(batch.inputs.clone()),
                    batch.targets.clone(),
                )
            }
        }
    };
}

mod error;
pub mod gemm;
mod gpt;
pub mod kernels;
pub mod layers;
pub mod loss_kernels;
pub mod lowrank;
mod mnist;
pub mod norm;
pub mod norm_kernels;
pub mod ops;
pub mod optim;
pub mod optim_kernels;
mod resnet;
mod surgical;

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
