//! Flashover's speed-up algorithms. Each module holds one method: its plain function (the
//! functional form, for hand-written loops) and an [`Algorithm`](flashover_core::callback::Algorithm)
//! that hooks the trainer's events as Composer's version does.
//!
//! What a method needs from the batch or the model is a trait bound from
//! `flashover_core::model` ([`ImageBatch`](flashover_core::model::ImageBatch),
//! [`ClassTargets`](flashover_core::model::ClassTargets), ...), so adding an image algorithm
//! to a language model does not compile. All randomness comes from the trainer's
//! `(seed, rank, epoch, batch)` generator, so runs reproduce and resume exactly.
//!
//! | name | module | hooks |
//! |---|---|---|
//! | `label_smoothing` | [`label_smoothing`] | BEFORE_LOSS, AFTER_LOSS |
//! | `mixup`, `cutmix` | [`mixup`], [`cutmix`] | BEFORE_FORWARD, BEFORE_LOSS, AFTER_LOSS |
//! | `cutout`, `colout`, `progressive_resizing`, `randaugment`, `augmix` | [`image`] | AFTER_DATALOADER |
//! | `selective_backprop`, `seq_length_warmup` | ... | AFTER_DATALOADER |
//! | `gradient_clipping`, `sam` | ... | AFTER_TRAIN_BATCH |
//! | `ema` | [`ema`] | FIT_START, BATCH_END, EVAL_BEFORE_ALL/AFTER_ALL, PREDICT_START/END |
//! | `swa` | [`swa`] | BATCH_START, BATCH_END |
//! | `layer_freezing` | [`layer_freezing`] | FIT_START, EPOCH_START |
//! | `channels_last` | [`channels_last`] | INIT |
//! | `blurpool`, `ghost_batchnorm`, `weight_standardization` (model surgery) | [`blurpool`], [`ghost_batchnorm`], [`weight_standardization`], [`surgery`] | INIT |
//! | `squeeze_excite` (model surgery, adds parameters) | [`squeeze_excite`] | INIT |
//! | `stochastic_depth` (model surgery) | [`stochastic_depth`] | INIT, AFTER_LOAD, BEFORE_FORWARD, BATCH_END |
//! | `factorize` (model surgery, replaces parameters) | [`factorize`] | INIT |
//! | `low_precision_groupnorm` (model surgery) | [`low_precision_groupnorm`] | INIT |
//! | `gyro_dropout` (model surgery) | [`gyro_dropout`] | INIT, AFTER_LOAD, BEFORE_FORWARD, BATCH_END |
//! | `alibi` (model surgery, removes the position embeddings) | [`alibi`] | INIT, AFTER_DATALOADER |
//! | `gated_linear_units` (model surgery, replaces parameters) | [`gated_linear_units`] | INIT |
//! | `low_precision_layernorm` (model surgery) | [`low_precision_layernorm`] | INIT |
//!
//! Several methods rewrite the targets (label smoothing, MixUp, CutMix). Each transforms the
//! distribution already in the batch, in the order the algorithms were added, and undoes its
//! change at `AFTER_LOSS`; the transforms are affine, so the order does not change the
//! result. The same algorithm cannot be added twice (the trainer refuses it).
//!
//! Requirements are bounds, so a method that needs images does not compile for a model trained
//! on token batches:
//!
//! ```compile_fail
//! use burn::backend::{Autodiff, Flex};
//! use flashover_core::model::{ImageBatch, TokenBatch};
//! fn needs_images<T: ImageBatch<Autodiff<Flex>>>() {}
//! needs_images::<TokenBatch<Autodiff<Flex>>>();
//! ```
//!
//! while the same bound on an image batch compiles and reads its images:
//!
//! ```
//! use burn::backend::{Autodiff, Flex};
//! use burn::tensor::{Int, Tensor};
//! use flashover_core::model::{ClassificationBatch, ImageBatch};
//! type B = Autodiff<Flex>;
//! fn pixels<T: ImageBatch<B>>(batch: &T) -> usize {
//!     batch.images().shape().num_elements()
//! }
//! let d = Default::default();
//! let batch = ClassificationBatch::new(
//!     Tensor::<B, 4>::zeros([2, 1, 28, 28], &d),
//!     Tensor::<B, 1, Int>::zeros([2], &d),
//! );
//! assert_eq!(pixels(&batch), 2 * 28 * 28);
//! ```
//!
//! The surgery algorithms change the model's architecture at `INIT` through the one trait of
//! `flashover_surgery`, [`Surgical`](flashover_surgery::Surgical), with which a model shows
//! its surgery-ready layers; a model that does not implement it cannot take them:
//!
//! ```compile_fail
//! use burn::backend::{Autodiff, Flex};
//! use flashover_core::callback::Algorithm;
//! use flashover_core::setup::SetupOf;
//! use flashover_core::toy::{Line, ToyOptimizer};
//! use flashover_algorithms::ghost_batchnorm::GhostBatchNorm;
//! type B = Autodiff<Flex>;
//! type S = SetupOf<B, Line<B>, ToyOptimizer<B>>;
//! let _: Box<dyn Algorithm<S>> = Box::new(GhostBatchNorm::default());
//! ```
//!
//! while an algorithm with no such need compiles for the same model:
//!
//! ```
//! use burn::backend::{Autodiff, Flex};
//! use flashover_core::callback::Algorithm;
//! use flashover_core::setup::SetupOf;
//! use flashover_core::toy::{Line, ToyOptimizer};
//! use flashover_algorithms::gradient_clipping::{ClippingType, GradientClipping};
//! type B = Autodiff<Flex>;
//! type S = SetupOf<B, Line<B>, ToyOptimizer<B>>;
//! let _: Box<dyn Algorithm<S>> = Box::new(GradientClipping::new(ClippingType::Norm, 1.0).unwrap());
//! ```
//!
//! A `Surgical` model without the kind of layer a surgery changes (GhostBatchNorm on the
//! MNIST CNN, which has no batch norm) fails at `INIT`, before any batch, with
//! [`AlgorithmError::ModelLacks`](crate::error::AlgorithmError::ModelLacks) naming the layers.
//!
//! This crate never touches the filesystem and depends on no other Flashover crate but core
//! and surgery.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod alibi;
pub mod augment;
pub mod augmix;
pub mod blurpool;
pub mod channels_last;
pub mod colout;
pub mod cutmix;
pub mod cutout;
pub mod ema;
pub mod error;
pub mod factorize;
pub mod gated_linear_units;
pub mod ghost_batchnorm;
pub mod gradient_clipping;
pub mod gyro_dropout;
pub mod image;
pub mod label_smoothing;
pub mod layer_freezing;
pub mod low_precision_groupnorm;
pub mod low_precision_layernorm;
pub mod low_precision_norm;
pub mod mixup;
pub mod params;
pub mod progressive_resizing;
pub mod randaugment;
pub mod recipes;
pub mod sam;
pub mod selective_backprop;
pub mod seq_length_warmup;
pub mod spec;
pub mod squeeze_excite;
pub mod stochastic_depth;
pub mod surgery;
pub mod swa;
mod util;
pub mod weight_standardization;

pub use error::{AlgorithmError, Result};
pub use util::ImageClassBatch;
