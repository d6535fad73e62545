//! The trainer: owns the [`State`] and the [`Engine`], and turns batches into optimizer steps
//! while firing every event in the order `crate::event` states.
//!
//! With no algorithms, callbacks or loggers, a step here is what a hand-written Burn loop
//! does (forward, loss, backward, optimizer step) plus one scalar read of the loss (for the
//! non-finite check and the logs) and the bookkeeping of the timestamp; the engine's events
//! cost one branch each.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;
use serde_json::{json, Value};

use crate::callback::{Algorithm, Callback};
use crate::data::BatchSource;
use crate::engine::Engine;
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::logger::{Logger, LoggerDestination};
use crate::metric::Metric;
use crate::model::{Batch, EvalModel, TrainModel};
use crate::params::seed_backend;
use crate::rng::derive_seed;
use crate::schedule::{LrSchedule, ScheduleContext, Scheduler};
use crate::state::{State, World};
use crate::time::{Progress, Time, TimeUnit, Timestamp};

/// The inner (gradient-free) module of a trainable model.
pub type InnerModel<B, M> = <M as AutodiffModule<B>>::InnerModule;
/// The batch type an evaluator of `M` reads.
pub type EvalBatch<B, M> =
    <InnerModel<B, M> as EvalModel<<B as AutodiffBackend>::InnerBackend>>::Batch;
/// What an evaluator of `M` produces per batch.
pub type EvalOutput<B, M> =
    <InnerModel<B, M> as EvalModel<<B as AutodiffBackend>::InnerBackend>>::Output;

/// A named evaluation dataset with its metrics and how often to run it.
pub struct Evaluator<B: AutodiffBackend, M: TrainModel<B>> {
    label: String,
    source: Box<dyn BatchSource<EvalBatch<B, M>>>,
    metrics: Vec<Box<dyn Metric<EvalOutput<B, M>>>>,
    interval: Option<Time>,
}

impl<B: AutodiffBackend, M: TrainModel<B>> Evaluator<B, M> {
    /// An evaluator labelled `label` (the key of its results in `State::eval_metrics`).
    pub fn new(
        label: impl Into<String>,
        source: impl BatchSource<EvalBatch<B, M>> + 'static,
        metrics: Vec<Box<dyn Metric<EvalOutput<B, M>>>>,
    ) -> Self {
        Evaluator {
            label: label.into(),
            source: Box::new(source),
            metrics,
            interval: None,
        }
    }

    /// How often to evaluate during `fit`, overriding the trainer's `eval_interval`.
    pub fn with_interval(mut self, interval: Time) -> Self {
        self.interval = Some(interval);
        self
    }
}

/// What one call to `fit` did.
#[derive(Debug, Clone, PartialEq)]
pub struct FitReport {
    /// Optimizer steps taken (batches whose loss was skipped are not counted).
    pub steps: u64,
    /// Batches consumed.
    pub batches: u64,
    /// Samples consumed.
    pub samples: u64,
    /// Wall time of the call.
    pub wall: Duration,
    /// Time the training thread waited for the data loader.
    pub data_wait: Duration,
    /// Why training stopped before `max_duration`, if a stop was requested.
    pub stopped: Option<String>,
}

/// Builds a [`Trainer`]; see [`Trainer::builder`].
pub struct TrainerBuilder<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> {
    model: M,
    optimizer: O,
    train: Box<dyn BatchSource<M::Batch>>,
    max_duration: Time,
    device: B::Device,
    lr: f64,
    scheduler: Box<dyn LrSchedule>,
    scale_schedule_ratio: f64,
    microbatch_size: Option<usize>,
    seed: u64,
    world: World,
    eval_interval: Time,
    evaluators: Vec<Evaluator<B, M>>,
    algorithms: Vec<Box<dyn Algorithm<B, M, O>>>,
    callbacks: Vec<Box<dyn Callback<B, M, O>>>,
    loggers: Vec<Box<dyn LoggerDestination>>,
    skip_nonfinite_loss: bool,
    hyperparameters: serde_json::Map<String, Value>,
    restore: Option<Box<dyn Restore<B, M, O>>>,
}

/// Restores a trainer's state (from a checkpoint) between `BEFORE_LOAD` and `AFTER_LOAD`.
/// Implemented by `flashover-checkpoint`; core knows nothing of files.
pub trait Restore<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>>: Send {
    /// Puts the saved model, optimizer, timestamp and the rest into `state`, and returns the
    /// saved states of algorithms and callbacks (keyed as in `State::component_states`).
    fn restore(self: Box<Self>, state: &mut State<B, M, O>) -> Result<BTreeMap<String, Value>>;
}

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> TrainerBuilder<B, M, O> {
    /// Base learning rate (the schedule multiplies it); default 0.01.
    pub fn lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }
    /// Learning-rate schedule; default constant.
    pub fn scheduler(mut self, scheduler: impl LrSchedule + 'static) -> Self {
        self.scheduler = Box::new(scheduler);
        self
    }
    /// Scales `max_duration` and schedule milestones (Composer's `scale_schedule_ratio`).
    pub fn scale_schedule_ratio(mut self, ratio: f64) -> Self {
        self.scale_schedule_ratio = ratio;
        self
    }
    /// Splits each batch into microbatches of this many samples (gradient accumulation).
    pub fn microbatch_size(mut self, size: usize) -> Self {
        self.microbatch_size = Some(size);
        self
    }
    /// The run's seed; default 0.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Rank and world size for data-parallel runs; default a single process.
    pub fn world(mut self, world: World) -> Self {
        self.world = world;
        self
    }
    /// Default interval for evaluators that have none of their own; default `1ep`.
    pub fn eval_interval(mut self, interval: Time) -> Self {
        self.eval_interval = interval;
        self
    }
    /// Adds an evaluator.
    pub fn evaluator(mut self, evaluator: Evaluator<B, M>) -> Self {
        self.evaluators.push(evaluator);
        self
    }
    /// Adds an algorithm; algorithms run in the order added (reversed at `AFTER_*` events).
    pub fn algorithm(mut self, algorithm: impl Algorithm<B, M, O> + 'static) -> Self {
        self.algorithms.push(Box::new(algorithm));
        self
    }
    /// Adds an already boxed algorithm.
    pub fn boxed_algorithm(mut self, algorithm: Box<dyn Algorithm<B, M, O>>) -> Self {
        self.algorithms.push(algorithm);
        self
    }
    /// Adds a callback; callbacks run in the order added.
    pub fn callback(mut self, callback: impl Callback<B, M, O> + 'static) -> Self {
        self.callbacks.push(Box::new(callback));
        self
    }
    /// Adds a logger destination.
    pub fn logger(mut self, logger: impl LoggerDestination + 'static) -> Self {
        self.loggers.push(Box::new(logger));
        self
    }
    /// Skip (and count) batches whose loss is NaN or infinite instead of failing; default off.
    pub fn skip_nonfinite_loss(mut self, skip: bool) -> Self {
        self.skip_nonfinite_loss = skip;
        self
    }
    /// Extra hyperparameters to log once, at the first `FIT_START` (the trainer adds its own).
    pub fn hyperparameter(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.hyperparameters.insert(key.into(), value.into());
        self
    }

    /// Restores state (a checkpoint) while building, between `BEFORE_LOAD` and `AFTER_LOAD`.
    pub fn restore(mut self, restore: impl Restore<B, M, O> + 'static) -> Self {
        self.restore = Some(Box::new(restore));
        self
    }

    /// Checks the configuration, runs `INIT`, `BEFORE_LOAD`, restores (if asked), runs
    /// `AFTER_LOAD`, and returns the trainer.
    pub fn build(self) -> Result<Trainer<B, M, O>> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(CoreError::config("lr", self.lr, "a finite number >= 0"));
        }
        let ssr = self.scale_schedule_ratio;
        if !(ssr.is_finite() && ssr > 0.0) {
            return Err(CoreError::config(
                "scale_schedule_ratio",
                ssr,
                "a finite number > 0",
            ));
        }
        if self.max_duration.unit() == TimeUnit::Duration {
            return Err(CoreError::config(
                "max_duration",
                self.max_duration,
                "a time in ep, ba, sp or tok",
            ));
        }
        let batches_per_epoch = self.train.num_batches();
        if batches_per_epoch == 0 {
            return Err(CoreError::EmptyDataset {
                name: self.train.name().to_string(),
            });
        }
        let batch_size = self.train.batch_size();
        if let Some(mb) = self.microbatch_size {
            if mb == 0 || mb > batch_size {
                return Err(CoreError::config(
                    "microbatch_size",
                    mb,
                    format!("an integer from 1 to the batch size ({batch_size})"),
                ));
            }
        }
        if self.eval_interval.is_zero() {
            return Err(CoreError::config(
                "eval_interval",
                self.eval_interval,
                "a time greater than zero",
            ));
        }
        for ev in &self.evaluators {
            if ev.interval.is_some_and(|t| t.is_zero()) {
                return Err(CoreError::config(
                    "evaluator interval",
                    ev.interval.unwrap_or(Time::Batch(0)),
                    "a time greater than zero",
                ));
            }
            if ev.source.num_batches() == 0 {
                return Err(CoreError::EmptyDataset {
                    name: ev.label.clone(),
                });
            }
        }
        // An algorithm added twice would apply its change twice (two label smoothings, two
        // MixUps) and its two states would share one checkpoint key: refuse it.
        let mut names = std::collections::BTreeSet::new();
        for a in &self.algorithms {
            if !names.insert(a.name().to_string()) {
                return Err(CoreError::config(
                    "algorithms",
                    format!("`{}` added twice", a.name()),
                    "each algorithm at most once (merge their settings into one)",
                ));
            }
        }
        let max_duration = self.max_duration.scaled(ssr);
        let samples_per_epoch = self.train.num_samples() as u64;
        let progress = Progress {
            batches_per_epoch: batches_per_epoch as u64,
            samples_per_epoch,
            max_duration,
        };
        self.scheduler.validate(&progress)?;

        let mut hp = self.hyperparameters;
        hp.insert("max_duration".into(), json!(max_duration.to_string()));
        hp.insert("lr".into(), json!(self.lr));
        hp.insert("scheduler".into(), json!(self.scheduler.describe()));
        hp.insert("scale_schedule_ratio".into(), json!(ssr));
        hp.insert("batch_size".into(), json!(batch_size));
        hp.insert("microbatch_size".into(), json!(self.microbatch_size));
        hp.insert("seed".into(), json!(self.seed));
        hp.insert("world_size".into(), json!(self.world.size));
        hp.insert(
            "algorithms".into(),
            json!(self
                .algorithms
                .iter()
                .map(|a| a.name().to_string())
                .collect::<Vec<_>>()),
        );

        let state = State {
            model: Some(self.model),
            optimizer: self.optimizer,
            scheduler: self.scheduler,
            base_lr: self.lr,
            lr: self.lr,
            timestamp: Timestamp::default(),
            max_duration,
            scale_schedule_ratio: ssr,
            batches_per_epoch: batches_per_epoch as u64,
            samples_per_epoch,
            batch: None,
            outputs: None,
            loss: None,
            loss_value: None,
            grads: None,
            eval_metrics: BTreeMap::new(),
            last_eval_batch: None,
            evaluated: Vec::new(),
            component_states: BTreeMap::new(),
            skipped_batches: 0,
            world: self.world,
            seed: self.seed,
            device: self.device,
            stop_reason: None,
        };
        let engine = Engine::new(self.algorithms, self.callbacks, Logger::new(self.loggers));
        let mut trainer = Trainer {
            state,
            engine,
            train: self.train,
            evaluators: self.evaluators,
            eval_interval: self.eval_interval,
            microbatch_size: self.microbatch_size,
            skip_nonfinite_loss: self.skip_nonfinite_loss,
            hyperparameters: None,
        };
        trainer.hyperparameters = Some(hp);
        trainer.engine.run(Event::Init, &mut trainer.state)?;
        trainer.engine.run(Event::BeforeLoad, &mut trainer.state)?;
        if let Some(restore) = self.restore {
            let components = restore.restore(&mut trainer.state)?;
            trainer.check_restored_position()?;
            trainer.engine.restore_component_states(components)?;
        }
        trainer.engine.run(Event::AfterLoad, &mut trainer.state)?;
        Ok(trainer)
    }
}

/// Trains, evaluates and predicts with a model, firing events for algorithms, callbacks and
/// loggers.
///
/// ```no_run
/// # use flashover_core::prelude::*;
/// # fn run<B: burn::tensor::backend::AutodiffBackend, M: TrainModel<B>, O: burn::optim::Optimizer<M, B>>(
/// #     model: M, optimizer: O, train: impl BatchSource<M::Batch> + 'static, device: B::Device) -> Result<(), CoreError> {
/// let mut trainer = Trainer::builder(model, optimizer, train, "2ep".parse()?, device)
///     .lr(1e-3)
///     .scheduler(Scheduler::cosine(Time::Duration(1.0), 0.0).with_warmup(Time::Batch(50)))
///     .microbatch_size(32)
///     .seed(42)
///     .build()?;
/// trainer.fit()?;            // to max_duration
/// trainer.fit_for(Time::Epoch(1))?; // and one more epoch
/// # Ok(()) }
/// ```
pub struct Trainer<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> {
    state: State<B, M, O>,
    engine: Engine<B, M, O>,
    train: Box<dyn BatchSource<M::Batch>>,
    evaluators: Vec<Evaluator<B, M>>,
    eval_interval: Time,
    microbatch_size: Option<usize>,
    skip_nonfinite_loss: bool,
    /// The run's configuration until it has been logged (at the first `FIT_START`).
    hyperparameters: Option<serde_json::Map<String, Value>>,
}

/// Stream tag for the backend seed set at each batch start.
const BACKEND_STREAM: u64 = 0xB4C4_E4D0;

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> Trainer<B, M, O> {
    /// Starts building a trainer for `model` with `optimizer`, reading `train`, for
    /// `max_duration`, on `device`.
    pub fn builder(
        model: M,
        optimizer: O,
        train: impl BatchSource<M::Batch> + 'static,
        max_duration: Time,
        device: B::Device,
    ) -> TrainerBuilder<B, M, O> {
        TrainerBuilder {
            model,
            optimizer,
            train: Box::new(train),
            max_duration,
            device,
            lr: 0.01,
            scheduler: Box::new(Scheduler::constant()),
            scale_schedule_ratio: 1.0,
            microbatch_size: None,
            seed: 0,
            world: World::default(),
            eval_interval: Time::Epoch(1),
            evaluators: Vec::new(),
            algorithms: Vec::new(),
            callbacks: Vec::new(),
            loggers: Vec::new(),
            skip_nonfinite_loss: false,
            hyperparameters: serde_json::Map::new(),
            restore: None,
        }
    }

    /// Whether `max_duration` is reached (so `fit` has nothing left to do).
    pub fn is_finished(&self) -> bool {
        self.state.progress().is_done(&self.state.timestamp) && !self.epoch_end_pending()
    }

    /// Whether every batch of the current epoch is done but its `EPOCH_END` has not run (a
    /// run restored from a checkpoint taken at the epoch's last `BATCH_CHECKPOINT`).
    fn epoch_end_pending(&self) -> bool {
        self.state.timestamp.batch_in_epoch >= self.train.num_batches() as u64
    }

    fn check_restored_position(&self) -> Result<()> {
        let ts = &self.state.timestamp;
        let n = self.train.num_batches() as u64;
        if ts.batch_in_epoch > n {
            return Err(CoreError::RestoredPosition {
                at: ts.to_string(),
                reason: format!("the training loader has only {n} batches per epoch"),
            });
        }
        if ts.batch < ts.batch_in_epoch
            || ts.sample < ts.sample_in_epoch
            || ts.token < ts.token_in_epoch
        {
            return Err(CoreError::RestoredPosition {
                at: ts.to_string(),
                reason: "in-epoch counts exceed the totals".into(),
            });
        }
        Ok(())
    }

    /// The state.
    pub fn state(&self) -> &State<B, M, O> {
        &self.state
    }

    /// The state, mutably (to restore a checkpoint, for example).
    pub fn state_mut(&mut self) -> &mut State<B, M, O> {
        &mut self.state
    }

    /// The model.
    pub fn model(&self) -> &M {
        self.state.model()
    }

    /// Consumes the trainer and returns the model.
    pub fn into_model(self) -> M {
        let mut state = self.state;
        state
            .model
            .take()
            .expect("model is present outside the optimizer step")
    }

    /// Trains until `max_duration` (or a stop request). Fails if `max_duration` is already
    /// reached.
    pub fn fit(&mut self) -> Result<FitReport> {
        if self.is_finished() {
            return Err(CoreError::DurationReached {
                max_duration: self.state.max_duration.to_string(),
                at: self.state.timestamp.to_string(),
            });
        }
        self.fit_inner()
    }

    /// Trains for `duration` more (in any unit but `dur`), extending `max_duration`: by
    /// `duration` when the units agree, otherwise to "elapsed + duration" in `duration`'s unit.
    pub fn fit_for(&mut self, duration: Time) -> Result<FitReport> {
        if duration.unit() == TimeUnit::Duration || duration.is_zero() {
            return Err(CoreError::config(
                "duration",
                duration,
                "a time greater than zero in ep, ba, sp or tok",
            ));
        }
        let unit = duration.unit();
        let now = if unit == self.state.max_duration.unit() {
            self.state.max_duration.value()
        } else {
            // Counts are exact in their own unit; whole epochs only, so resume mid-epoch adds
            // from the current epoch's start.
            self.state.timestamp.count(unit).unwrap_or(0) as f64
        };
        self.state.max_duration = Time::new(unit, now + duration.value())?;
        self.fit_inner()
    }

    fn fit_inner(&mut self) -> Result<FitReport> {
        let start = Instant::now();
        let before = self.state.timestamp.clone();
        let mut steps = 0;
        let mut data_wait = Duration::ZERO;
        self.state.stop_reason = None;
        if let Some(hp) = self.hyperparameters.take() {
            self.engine.logger().log_hyperparameters(&hp)?;
        }
        self.engine.run(Event::FitStart, &mut self.state)?;
        let num_batches = self.train.num_batches();
        'epochs: loop {
            if !self.epoch_end_pending()
                && (self.state.progress().is_done(&self.state.timestamp)
                    || self.state.stop_reason.is_some())
            {
                break;
            }
            let epoch = self.state.timestamp.epoch;
            let first = self.state.timestamp.batch_in_epoch as usize;
            if first == 0 {
                self.engine.run(Event::EpochStart, &mut self.state)?;
            }
            let mut batches = self.train.iter_from(epoch, first);
            // A run restored right after the last batch of an epoch (before its EPOCH_END)
            // goes straight to the end of that epoch.
            while (self.state.timestamp.batch_in_epoch as usize) < num_batches {
                self.engine.run(Event::BeforeDataloader, &mut self.state)?;
                let waited = Instant::now();
                let batch = match batches.next() {
                    Some(batch) => batch?,
                    None => {
                        return Err(CoreError::Loader {
                            name: self.train.name().to_string(),
                            batch: self.state.timestamp.batch_in_epoch as usize,
                            reason: format!("it promised {num_batches} batches per epoch"),
                        })
                    }
                };
                data_wait += waited.elapsed();
                self.state.batch = Some(batch);
                self.engine.run(Event::AfterDataloader, &mut self.state)?;
                if self.train_batch()? {
                    steps += 1;
                }
                let epoch_done = self.state.timestamp.batch_in_epoch as usize >= num_batches;
                if !epoch_done
                    && (self.state.stop_reason.is_some()
                        || self.state.progress().is_done(&self.state.timestamp))
                {
                    break 'epochs;
                }
            }
            drop(batches);
            self.state.timestamp.advance_epoch();
            self.engine.run(Event::EpochEnd, &mut self.state)?;
            let ep = self.state.timestamp.epoch;
            if self.evaluators.iter().any(|e| self.epoch_eval_due(e, ep)) {
                self.run_evaluators(|t, e| t.epoch_eval_due(e, ep))?;
            }
            self.engine.run(Event::EpochCheckpoint, &mut self.state)?;
        }
        self.engine.run(Event::FitEnd, &mut self.state)?;
        let after = &self.state.timestamp;
        Ok(FitReport {
            steps,
            batches: after.batch - before.batch,
            samples: after.sample - before.sample,
            wall: start.elapsed(),
            data_wait,
            stopped: self.state.stop_reason.clone(),
        })
    }

    fn interval_of(&self, e: &Evaluator<B, M>) -> Time {
        e.interval.unwrap_or(self.eval_interval)
    }

    fn epoch_eval_due(&self, e: &Evaluator<B, M>, epoch: u64) -> bool {
        match self.interval_of(e) {
            Time::Epoch(n) => epoch.is_multiple_of(n),
            _ => false,
        }
    }

    /// Whether an evaluator with a non-epoch interval crossed a multiple of it in the batch
    /// that just ended.
    fn batch_eval_due(&self, e: &Evaluator<B, M>, before: &Timestamp) -> bool {
        let interval = self.interval_of(e);
        let progress = self.state.progress();
        let unit = interval.unit();
        if unit == TimeUnit::Epoch {
            return false;
        }
        let crossings =
            |ts: &Timestamp| (progress.elapsed(ts, unit) / interval.value() + 1e-9).floor();
        crossings(&self.state.timestamp) > crossings(before)
    }

    /// One batch: events, forward/loss/backward per microbatch, the optimizer step.
    /// Returns whether an optimizer step was taken.
    fn train_batch(&mut self) -> Result<bool> {
        let started = Instant::now();
        let state = &mut self.state;
        let engine = &mut self.engine;
        let ts = &state.timestamp;
        seed_backend::<B>(
            &state.device,
            derive_seed(&[
                state.seed,
                state.world.rank as u64,
                ts.epoch,
                ts.batch_in_epoch,
                BACKEND_STREAM,
            ]),
        );
        let ctx = ScheduleContext {
            batch: ts.batch as f64,
            progress: state.progress(),
            scale_schedule_ratio: state.scale_schedule_ratio,
        };
        state.lr = state.base_lr * state.scheduler.factor(&ctx);
        state.loss_value = None;
        engine.run(Event::BatchStart, state)?;
        engine.run(Event::BeforeTrainBatch, state)?;

        let full = take_batch(state, Event::BeforeTrainBatch)?;
        let n = full.len();
        let tokens = full.num_tokens();
        let split = self.microbatch_size.filter(|&s| s < n);
        let micro = match split {
            Some(size) => full.clone().split(size),
            None => vec![full.clone()],
        };
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut loss_sum = 0.0;
        let mut nonfinite = false;
        for mb in micro {
            let weight = mb.len() as f64 / n as f64;
            state.batch = Some(mb);
            engine.run(Event::BeforeForward, state)?;
            let batch = take_batch(state, Event::BeforeForward)?;
            let output = state.model().forward(&batch);
            state.batch = Some(batch);
            state.outputs = Some(output);
            engine.run(Event::AfterForward, state)?;
            engine.run(Event::BeforeLoss, state)?;
            let output = state
                .outputs
                .take()
                .ok_or_else(|| missing("outputs", Event::BeforeLoss))?;
            let batch = take_batch(state, Event::BeforeLoss)?;
            let loss = state.model().loss(&output, &batch);
            state.batch = Some(batch);
            state.outputs = Some(output);
            state.loss = Some(loss);
            engine.run(Event::AfterLoss, state)?;
            engine.run(Event::BeforeBackward, state)?;
            let loss = state
                .loss
                .take()
                .ok_or_else(|| missing("loss", Event::BeforeBackward))?;
            let loss = if split.is_some() {
                loss.mul_scalar(weight)
            } else {
                loss
            };
            let value: f64 = loss.clone().into_scalar().elem();
            if !value.is_finite() {
                let ts = &state.timestamp;
                if !self.skip_nonfinite_loss {
                    return Err(CoreError::NonFiniteLoss {
                        value,
                        epoch: ts.epoch,
                        batch: ts.batch,
                        batch_in_epoch: ts.batch_in_epoch,
                    });
                }
                tracing::warn!(
                    value,
                    epoch = ts.epoch,
                    batch = ts.batch,
                    "skipping batch with non-finite loss"
                );
                nonfinite = true;
                state.outputs = None;
                break;
            }
            loss_sum += value;
            let grads = GradientsParams::from_grads(loss.backward(), state.model());
            state.grads = Some(grads);
            engine.run(Event::AfterBackward, state)?;
            state.outputs = None;
            if split.is_some() {
                if let Some(g) = state.grads.take() {
                    accumulator.accumulate(state.model(), g);
                }
            }
        }
        state.batch = Some(full);
        if nonfinite {
            state.grads = None;
            state.skipped_batches += 1;
        } else {
            if split.is_some() {
                state.grads = Some(accumulator.grads());
            }
            state.loss_value = Some(loss_sum);
        }
        engine.run(Event::AfterTrainBatch, state)?;
        let stepped = match state.grads.take() {
            Some(grads) => {
                let lr = state.lr;
                let model = state
                    .model
                    .take()
                    .expect("model is present outside the optimizer step");
                state.model = Some(state.optimizer.step(lr, model, grads));
                true
            }
            None => false,
        };
        let before = state.timestamp.clone();
        state
            .timestamp
            .advance_batch(n as u64, tokens, started.elapsed());
        engine.run(Event::BatchEnd, state)?;
        if !engine.logger().is_empty() {
            let ts = state.timestamp.clone();
            let mut values = vec![("train/lr", state.lr)];
            if let Some(l) = state.loss_value {
                values.push(("train/loss", l));
            }
            engine.logger().log_metrics(&ts, &values)?;
        }
        if self
            .evaluators
            .iter()
            .any(|e| self.batch_eval_due(e, &before))
        {
            self.run_evaluators(|t, e| t.batch_eval_due(e, &before))?;
        }
        self.engine.run(Event::BatchCheckpoint, &mut self.state)?;
        self.state.batch = None;
        Ok(stepped)
    }

    /// Runs the evaluators that `select` picks, with the `EVAL_*` events, and stores their
    /// results in `State::eval_metrics`.
    fn run_evaluators(&mut self, select: impl Fn(&Self, &Evaluator<B, M>) -> bool) -> Result<()> {
        let chosen: Vec<bool> = self.evaluators.iter().map(|e| select(self, e)).collect();
        self.state.evaluated.clear();
        self.engine.run(Event::EvalBeforeAll, &mut self.state)?;
        let model = self.state.model().valid();
        for (ev, _) in self.evaluators.iter_mut().zip(&chosen).filter(|(_, &c)| c) {
            self.engine.run(Event::EvalStart, &mut self.state)?;
            for m in ev.metrics.iter_mut() {
                m.reset();
            }
            for batch in ev.source.iter_from(0, 0) {
                let batch = batch?;
                self.engine.run(Event::EvalBatchStart, &mut self.state)?;
                self.engine.run(Event::EvalBeforeForward, &mut self.state)?;
                let output = model.forward_eval(&batch);
                self.engine.run(Event::EvalAfterForward, &mut self.state)?;
                for m in ev.metrics.iter_mut() {
                    m.update(&output);
                }
                self.engine.run(Event::EvalBatchEnd, &mut self.state)?;
            }
            let results: BTreeMap<String, f64> =
                ev.metrics.iter().map(|m| (m.name(), m.value())).collect();
            tracing::info!(
                evaluator = %ev.label,
                epoch = self.state.timestamp.epoch,
                batch = self.state.timestamp.batch,
                metrics = ?results,
                "evaluation"
            );
            if !self.engine.logger().is_empty() {
                let keys: Vec<(String, f64)> = results
                    .iter()
                    .map(|(k, v)| (format!("eval/{}/{k}", ev.label), *v))
                    .collect();
                let values: Vec<(&str, f64)> = keys.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                let ts = self.state.timestamp.clone();
                self.engine.logger().log_metrics(&ts, &values)?;
            }
            self.state.eval_metrics.insert(ev.label.clone(), results);
            self.state.evaluated.push(ev.label.clone());
            self.engine.run(Event::EvalEnd, &mut self.state)?;
        }
        self.state.last_eval_batch = Some(self.state.timestamp.batch);
        self.engine.run(Event::EvalAfterAll, &mut self.state)?;
        Ok(())
    }

    /// Runs every evaluator now and returns all results (evaluator label, metric, value).
    pub fn eval(&mut self) -> Result<BTreeMap<String, BTreeMap<String, f64>>> {
        self.engine
            .run(Event::EvalStandaloneStart, &mut self.state)?;
        self.run_evaluators(|_, _| true)?;
        self.engine.run(Event::EvalStandaloneEnd, &mut self.state)?;
        Ok(self.state.eval_metrics.clone())
    }

    /// Runs the model without gradients over every batch of `source` and returns the outputs
    /// in order.
    pub fn predict(
        &mut self,
        source: &dyn BatchSource<EvalBatch<B, M>>,
    ) -> Result<Vec<EvalOutput<B, M>>> {
        self.engine.run(Event::PredictStart, &mut self.state)?;
        let model = self.state.model().valid();
        let mut out = Vec::with_capacity(source.num_batches());
        for batch in source.iter_from(0, 0) {
            let batch = batch?;
            self.engine.run(Event::PredictBatchStart, &mut self.state)?;
            self.engine
                .run(Event::PredictBeforeForward, &mut self.state)?;
            out.push(model.forward_eval(&batch));
            self.engine
                .run(Event::PredictAfterForward, &mut self.state)?;
            self.engine.run(Event::PredictBatchEnd, &mut self.state)?;
        }
        self.engine.run(Event::PredictEnd, &mut self.state)?;
        Ok(out)
    }
}

fn missing(what: &str, event: Event) -> CoreError {
    CoreError::Component {
        component: "trainer".into(),
        event: event.name(),
        message: format!("the state's {what} was removed by an algorithm or callback"),
    }
}

fn take_batch<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>>(
    state: &mut State<B, M, O>,
    event: Event,
) -> Result<M::Batch> {
    state.batch.take().ok_or_else(|| missing("batch", event))
}
