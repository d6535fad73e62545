//! The three types a run is made of (autodiff backend, model, optimizer), bundled in one
//! trait so that the state, the engine, the trainer, algorithms and callbacks take one type
//! parameter instead of three, as burn-train bundles its learner's types.
//!
//! Contracts and type aliases only: nothing here runs.
//!
//! An extension that works with any run takes any [`Setup`]:
//!
//! ```
//! use flashover_core::prelude::*;
//!
//! /// Counts the optimizer steps of a run.
//! #[derive(Default)]
//! struct CountSteps(u64);
//!
//! impl<S: Setup> Callback<S> for CountSteps {
//!     fn name(&self) -> &str { "count_steps" }
//!     fn batch_end(&mut self, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<(), CoreError> {
//!         self.0 += 1;
//!         Ok(())
//!     }
//! }
//! # let _ = CountSteps::default();
//! ```
//!
//! and one that needs something of the batch or the model says so with a bound on the
//! aliases below (here: image batches), so adding it to a model without them does not compile:
//!
//! ```
//! use flashover_core::prelude::*;
//! use flashover_core::setup::BatchOf;
//!
//! /// Inverts the images of every batch.
//! struct Invert;
//!
//! impl<S: Setup> Algorithm<S> for Invert
//! where
//!     BatchOf<S>: ImageBatch<S::Backend>,
//! {
//!     fn name(&self) -> &str { "invert" }
//!     fn matches(&self, event: Event, _state: &State<S>) -> bool {
//!         event == Event::AfterDataloader
//!     }
//!     fn apply(&mut self, _event: Event, state: &mut State<S>, _logger: &mut Logger) -> Result<(), CoreError> {
//!         if let Some(batch) = state.batch_mut()? {
//!             let inverted = batch.images().clone().neg();
//!             batch.set_images(inverted);
//!         }
//!         Ok(())
//!     }
//! }
//! # let _ = Invert;
//! ```
//!
//! The trainer is built from values, so its setup is inferred: `Trainer::builder(model,
//! optimizer, ...)` makes a `Trainer<SetupOf<B, M, O>>`, and only code that names a trainer's
//! type writes [`SetupOf`].

use std::marker::PhantomData;

use burn::optim::Optimizer;
use burn::tensor::backend::{AutodiffBackend, BackendTypes};

use crate::model::{EvalModel, TrainModel};

/// The types of one training run.
pub trait Setup {
    /// The autodiff backend the model trains on.
    type Backend: AutodiffBackend;
    /// The model.
    type Model: TrainModel<Self::Backend>;
    /// The optimizer.
    type Optimizer: Optimizer<Self::Model, Self::Backend>;
}

/// The [`Setup`] of a backend `B`, a model `M` and an optimizer `O`: what
/// `Trainer::builder` infers from its arguments. It holds nothing (a function-pointer marker,
/// so that it is `Send`, `Sync` and `'static` whatever the three types are).
pub struct SetupOf<B, M, O>(PhantomData<Marker<B, M, O>>);

type Marker<B, M, O> = fn() -> (B, M, O);

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> Setup for SetupOf<B, M, O> {
    type Backend = B;
    type Model = M;
    type Optimizer = O;
}

/// The training batch of a setup's model.
pub type BatchOf<S> = <<S as Setup>::Model as TrainModel<<S as Setup>::Backend>>::Batch;

/// What a setup's model returns from its training forward pass.
pub type OutputOf<S> = <<S as Setup>::Model as TrainModel<<S as Setup>::Backend>>::Output;

/// The device type of a setup's backend.
pub type DeviceOf<S> = <<S as Setup>::Backend as BackendTypes>::Device;

/// The gradient-free backend under a setup's autodiff backend (where gradients live).
pub type InnerBackendOf<S> = <<S as Setup>::Backend as AutodiffBackend>::InnerBackend;

/// The inner (gradient-free) module of a setup's model, used for evaluation and prediction.
pub type InnerModelOf<S> =
    <<S as Setup>::Model as burn::module::AutodiffModule<<S as Setup>::Backend>>::InnerModule;

/// The batch type an evaluator of a setup's model reads.
pub type EvalBatchOf<S> = <InnerModelOf<S> as EvalModel<InnerBackendOf<S>>>::Batch;

/// What an evaluator of a setup's model produces per batch.
pub type EvalOutputOf<S> = <InnerModelOf<S> as EvalModel<InnerBackendOf<S>>>::Output;
