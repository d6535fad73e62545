//! [`TrainerBuilder`]: collects a run's configuration, checks it (every bad value is an error
//! naming it), and builds the trainer: `INIT`, `BEFORE_LOAD`, the restore, the broadcast of
//! rank 0's weights in a data-parallel run, then `AFTER_LOAD`. Nothing here trains.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

use crate::callback::{Algorithm, Callback};
use crate::collective::Collective;
use crate::data::BatchSource;
use crate::engine::Engine;
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::logger::{Logger, LoggerDestination};
use crate::model::Batch;
use crate::precision::{
    cast_params, check_precision, Autocast, LossScaler, LossScaling, Precision,
};
use crate::restore::Restore;
use crate::schedule::{LrSchedule, Scheduler};
use crate::setup::{BatchOf, DeviceOf, Setup};
use crate::shard::{ShardPlan, Sharding};
use crate::state::{check_countable, State, World};
use crate::time::{Progress, Time, TimeUnit, Timestamp};

use super::eval::Evaluator;
use super::Trainer;

/// Builds a [`Trainer`]; see [`Trainer::builder`].
pub struct TrainerBuilder<S: Setup> {
    model: S::Model,
    optimizer: S::Optimizer,
    train: Box<dyn BatchSource<BatchOf<S>>>,
    max_duration: Time,
    device: DeviceOf<S>,
    lr: f64,
    scheduler: Box<dyn LrSchedule>,
    scale_schedule_ratio: f64,
    microbatch_size: Option<usize>,
    auto_microbatching: bool,
    watch_device_memory: Option<bool>,
    sharding: Sharding,
    seed: u64,
    world: Option<World>,
    eval_interval: Time,
    evaluators: Vec<Evaluator<S::Backend, S::Model>>,
    algorithms: Vec<Box<dyn Algorithm<S>>>,
    callbacks: Vec<Box<dyn Callback<S>>>,
    loggers: Vec<Box<dyn LoggerDestination>>,
    skip_nonfinite_loss: bool,
    accumulate_on_tokens: bool,
    hyperparameters: serde_json::Map<String, Value>,
    restore: Option<Box<dyn Restore<S>>>,
    collective: Option<Box<dyn Collective<S>>>,
    precision: Precision,
    loss_scaling: LossScaling,
}

impl<S: Setup> TrainerBuilder<S> {
    pub(super) fn new(
        model: S::Model,
        optimizer: S::Optimizer,
        train: Box<dyn BatchSource<BatchOf<S>>>,
        max_duration: Time,
        device: DeviceOf<S>,
    ) -> Self {
        TrainerBuilder {
            model,
            optimizer,
            train,
            max_duration,
            device,
            lr: 0.01,
            scheduler: Box::new(Scheduler::constant()),
            scale_schedule_ratio: 1.0,
            microbatch_size: None,
            auto_microbatching: false,
            watch_device_memory: None,
            sharding: Sharding::NoShard,
            seed: 0,
            world: None,
            eval_interval: Time::Epoch(1),
            evaluators: Vec::new(),
            algorithms: Vec::new(),
            callbacks: Vec::new(),
            loggers: Vec::new(),
            skip_nonfinite_loss: false,
            accumulate_on_tokens: false,
            hyperparameters: serde_json::Map::new(),
            restore: None,
            collective: None,
            precision: Precision::Fp32,
            loss_scaling: LossScaling::default(),
        }
    }

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
    /// Automatic microbatching (Composer's `device_train_microbatch_size="auto"`): when the
    /// device runs out of memory in a batch's forward or backward pass, the batch is retried
    /// in microbatches of half the size (from the whole batch, or the
    /// [`microbatch_size`](Self::microbatch_size) given), with the same random draws, so
    /// that the step equals one of a run started at that size; the size is kept for the rest
    /// of the run (and in checkpoints), never grown back, and each change is logged. Costs one
    /// synchronisation of the device before each batch's forward pass and one after its loss
    /// read. See [`crate::memory`] for how running out of memory is detected on the CubeCL
    /// backends; the CPU backends never retry (a failed host allocation aborts the process).
    pub fn auto_microbatching(mut self, enabled: bool) -> Self {
        self.auto_microbatching = enabled;
        self
    }
    /// Whether the trainer watches for failed device allocations while it lives (see
    /// [`crate::memory::DeviceMemoryWatch`]): then a batch that runs out of device memory is
    /// an error naming it (or, with automatic microbatching, a retry), where Burn would read
    /// silently wrong numbers. Default: on for the backends whose memory fails that way (the
    /// CubeCL ones: wgpu, CUDA), off for the CPU backends, whose failed allocations abort the
    /// process. Watching chains a panic hook in front of the program's once per process; it
    /// acts only while a watching trainer lives. Automatic microbatching always watches.
    pub fn watch_device_memory(mut self, watch: bool) -> Self {
        self.watch_device_memory = Some(watch);
        self
    }

    /// How a data-parallel run divides its optimizer step over the ranks (Composer's
    /// `sharding_strategy`; default [`Sharding::NoShard`]): with
    /// [`Sharding::ShardGradOp`] each rank keeps the averaged gradients and the optimizer
    /// state of the parameters it owns only, and the weights are bit for bit those of the
    /// unsharded run (see [`crate::shard`]). A single process shards nothing.
    pub fn sharding(mut self, sharding: Sharding) -> Self {
        self.sharding = sharding;
        self
    }

    /// The run's seed; default 0.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Rank and world size for data-parallel runs; default a single process, or the
    /// collective's world when one is given (they must agree).
    pub fn world(mut self, world: World) -> Self {
        self.world = Some(world);
        self
    }
    /// The collective through which this rank meets the others of a data-parallel run
    /// (see [`crate::collective`]); without one the run is a single process.
    pub fn collective(mut self, collective: impl Collective<S> + 'static) -> Self {
        self.collective = Some(Box::new(collective));
        self
    }

    /// [`TrainerBuilder::collective`] for a collective already boxed (as
    /// `flashover_distributed::Distributed::collective` returns it); `None` leaves the run a
    /// single process.
    pub fn boxed_collective(mut self, collective: Option<Box<dyn Collective<S>>>) -> Self {
        if collective.is_some() {
            self.collective = collective;
        }
        self
    }
    /// Default interval for evaluators that have none of their own; default `1ep`.
    pub fn eval_interval(mut self, interval: Time) -> Self {
        self.eval_interval = interval;
        self
    }
    /// Adds an evaluator.
    pub fn evaluator(mut self, evaluator: Evaluator<S::Backend, S::Model>) -> Self {
        self.evaluators.push(evaluator);
        self
    }
    /// Adds an algorithm; algorithms run in the order added (reversed at `AFTER_*` events).
    pub fn algorithm(mut self, algorithm: impl Algorithm<S> + 'static) -> Self {
        self.algorithms.push(Box::new(algorithm));
        self
    }
    /// Adds an already boxed algorithm.
    pub fn boxed_algorithm(mut self, algorithm: Box<dyn Algorithm<S>>) -> Self {
        self.algorithms.push(algorithm);
        self
    }
    /// Adds a callback; callbacks run in the order added.
    pub fn callback(mut self, callback: impl Callback<S> + 'static) -> Self {
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
    /// Weigh each microbatch, and each rank of a data-parallel run, by the tokens its loss
    /// scores ([`Batch::num_loss_tokens`]: padding left out) instead of by its samples
    /// (Composer's `accumulate_train_batch_on_tokens`); default off. With batches of
    /// sequences padded to different lengths ([`TokenBatch::padded`](crate::model::TokenBatch::padded)),
    /// the step's gradient and loss are then the mean over every scored token of the global
    /// batch, as one unsplit batch on one process would give, however it is cut into
    /// microbatches and ranks; by samples, a microbatch of short sequences would weigh as
    /// much as one of long ones. Without padding both weightings agree. The model's loss must
    /// be its mean over the scored tokens (as [`crate::loss::classification_loss`] is). Only
    /// for batches that count tokens (`Batch::COUNTS_TOKENS`); otherwise `build` refuses it.
    /// A padded batch's count costs one read from the device per microbatch.
    pub fn accumulate_on_tokens(mut self, on: bool) -> Self {
        self.accumulate_on_tokens = on;
        self
    }
    /// Extra hyperparameters to log once, at the first `FIT_START` (the trainer adds its own).
    pub fn hyperparameter(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.hyperparameters.insert(key.into(), value.into());
        self
    }

    /// Dynamic loss scaling's settings for the float16 precisions (default: PyTorch's
    /// `GradScaler`'s: 2^16, doubled after 2000 clean steps, halved on overflow).
    pub fn loss_scaling(mut self, scaling: LossScaling) -> Self {
        self.loss_scaling = scaling;
        self
    }

    /// Restores state (a checkpoint) while building, between `BEFORE_LOAD` and `AFTER_LOAD`.
    pub fn restore(mut self, restore: impl Restore<S> + 'static) -> Self {
        self.restore = Some(Box::new(restore));
        self
    }

    /// The world this rank belongs to: the collective's, which an explicit `world` must match.
    fn resolve_world(&self) -> Result<World> {
        let world = match (&self.collective, self.world) {
            (Some(c), Some(w)) if c.world() != w => {
                return Err(CoreError::config(
                    "world",
                    format!("rank {} of {}", w.rank, w.size),
                    format!(
                        "the collective's world (rank {} of {}), or no explicit world",
                        c.world().rank,
                        c.world().size
                    ),
                ))
            }
            (Some(c), _) => c.world(),
            (None, w) => w.unwrap_or_default(),
        };
        if world.size == 0 || world.rank >= world.size {
            return Err(CoreError::config(
                "world",
                format!("rank {} of {}", world.rank, world.size),
                "a world size >= 1 and a rank in 0..size",
            ));
        }
        Ok(world)
    }

    /// Checks every setting that does not need the built state; each bad value is an error
    /// that names it and what would be accepted.
    fn validate(&self) -> Result<()> {
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
                "a time in ep, ba, sp or tok, or a wall-clock time",
            ));
        }
        if self.train.num_batches() == 0 {
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
        // A time in tokens on batches that do not count them would never be reached.
        let tokens = <BatchOf<S> as Batch>::COUNTS_TOKENS;
        if self.accumulate_on_tokens && !tokens {
            return Err(CoreError::config(
                "accumulate_on_tokens",
                true,
                "false for batches that do not count tokens (`Batch::COUNTS_TOKENS` is false): \
                 they have no tokens to weigh microbatches by",
            ));
        }
        check_countable("max_duration", self.max_duration, tokens)?;
        check_countable("eval_interval", self.eval_interval, tokens)?;
        for ev in &self.evaluators {
            if let Some(t) = ev.interval {
                check_countable("evaluator interval", t, tokens)?;
            }
        }
        // A ratio that scales a run to nothing would report success for no work.
        let scaled = self.max_duration.scaled(ssr);
        if scaled.is_zero() && !self.max_duration.is_zero() {
            return Err(CoreError::config(
                "scale_schedule_ratio",
                ssr,
                format!(
                    "a ratio that leaves something of max_duration {} to train (it scales to {scaled})",
                    self.max_duration
                ),
            ));
        }
        if self.eval_interval.is_zero() {
            return Err(CoreError::config(
                "eval_interval",
                self.eval_interval,
                "a time greater than zero",
            ));
        }
        for ev in &self.evaluators {
            if let Some(t) = ev.interval.filter(|t| t.is_zero()) {
                return Err(CoreError::config(
                    "evaluator interval",
                    t,
                    "a time greater than zero",
                ));
            }
            if ev.source.num_batches() == 0 {
                return Err(CoreError::EmptyDataset {
                    name: ev.label.clone(),
                });
            }
        }
        self.loss_scaling.validate()?;
        // An algorithm added twice would apply its change twice (two label smoothings, two
        // MixUps) and its two states would share one checkpoint key: refuse it.
        let mut names = BTreeSet::new();
        for a in &self.algorithms {
            if !names.insert(a.name().to_string()) {
                return Err(CoreError::config(
                    "algorithms",
                    format!("`{}` added twice", a.name()),
                    "each algorithm at most once (merge their settings into one)",
                ));
            }
        }
        Ok(())
    }

    /// Checks the configuration, runs `INIT`, `BEFORE_LOAD`, restores (if asked), gives every
    /// rank rank 0's weights (in a data-parallel run), runs `AFTER_LOAD`, and returns the
    /// trainer.
    pub fn build(self) -> Result<Trainer<S>> {
        self.validate()?;
        check_precision::<S::Backend>(self.precision, &self.device)?;
        let world = self.resolve_world()?;
        let ssr = self.scale_schedule_ratio;
        let batches_per_epoch = self.train.num_batches() as u64;
        let max_duration = self.max_duration.scaled(ssr);
        // In a data-parallel run the timestamp counts the samples of every rank's batch
        // (`Collective::sync_progress`), so an epoch is every rank's share.
        let ranks = if self.collective.is_some() {
            world.size as u64
        } else {
            1
        };
        let samples_per_epoch = self.train.num_samples() as u64 * ranks;
        let global_batch_size = self.train.batch_size() as u64 * ranks;
        let progress = Progress {
            batches_per_epoch,
            samples_per_epoch,
            max_duration,
        };
        self.scheduler.validate(&progress)?;
        if max_duration.is_zero() {
            tracing::warn!(
                max_duration = %max_duration,
                "max_duration is zero: this run trains nothing (the initial weights are kept)"
            );
        }

        let mut hp = self.hyperparameters;
        hp.insert("max_duration".into(), json!(max_duration.to_string()));
        hp.insert("lr".into(), json!(self.lr));
        hp.insert("scheduler".into(), json!(self.scheduler.describe()));
        hp.insert("scale_schedule_ratio".into(), json!(ssr));
        hp.insert("batch_size".into(), json!(self.train.batch_size()));
        hp.insert(
            "global_batch_size".into(),
            json!(self.train.batch_size() * ranks as usize),
        );
        hp.insert("microbatch_size".into(), json!(self.microbatch_size));
        hp.insert("auto_microbatching".into(), json!(self.auto_microbatching));
        hp.insert(
            "accumulate_on_tokens".into(),
            json!(self.accumulate_on_tokens),
        );
        hp.insert("seed".into(), json!(self.seed));
        hp.insert("precision".into(), json!(self.precision.name()));
        hp.insert(
            "backend".into(),
            json!(<S::Backend as burn::tensor::backend::Backend>::name(
                &self.device
            )),
        );
        hp.insert("world_size".into(), json!(world.size));
        let sharded = self.sharding.shards(world.size) && self.collective.is_some();
        hp.insert(
            "sharding".into(),
            json!(if sharded {
                self.sharding
            } else {
                Sharding::NoShard
            }
            .name()),
        );
        hp.insert(
            "algorithms".into(),
            json!(self
                .algorithms
                .iter()
                .map(|a| a.name().to_string())
                .collect::<Vec<_>>()),
        );

        // Allocations that failed before this trainer (on its device) are not its batches'.
        let failures_seen =
            crate::memory::allocation_failures(burn::tensor::backend::DeviceOps::id(&self.device));
        // A trainer on a backend whose device allocations fail by panicking notices them (see
        // `crate::memory`): with automatic microbatching it retries the batch, otherwise it
        // stops with an error.
        let watch = self.auto_microbatching
            || self.watch_device_memory.unwrap_or_else(|| {
                crate::memory::fails_by_panicking(
                    &<S::Backend as burn::tensor::backend::Backend>::name(&self.device),
                )
            });
        let state = State {
            model: Some(self.model),
            optimizer: self.optimizer,
            scheduler: self.scheduler,
            base_lr: self.lr,
            lr: self.lr,
            timestamp: Timestamp::default(),
            max_duration,
            scale_schedule_ratio: ssr,
            batches_per_epoch,
            samples_per_epoch,
            global_batch_size,
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
            auto_microbatch_size: None,
            batch_attempt: 0,
            precision: self.precision,
            loss_scaler: self
                .precision
                .scales_loss()
                .then(|| LossScaler::new(self.loss_scaling)),
            world,
            seed: self.seed,
            device: self.device,
            stop_reason: None,
            algorithm_overflow: false,
            collective: self.collective,
            sharding: None,
            shard_keep: Default::default(),
            event: None,
            checkpoint_requested: false,
        };
        let engine = Engine::new(
            self.algorithms,
            self.callbacks,
            Logger::new(self.loggers),
            world,
        );
        let mut trainer = Trainer {
            memory_watch: watch.then(crate::memory::DeviceMemoryWatch::start),
            state,
            engine,
            train: self.train,
            evaluators: self.evaluators,
            eval_interval: self.eval_interval,
            microbatch_size: self.microbatch_size,
            auto_microbatching: self.auto_microbatching,
            failures_seen,
            skip_nonfinite_loss: self.skip_nonfinite_loss,
            accumulate_on_tokens: self.accumulate_on_tokens,
            hyperparameters: Some(hp),
            clock: None,
            device_reads: 0,
        };
        trainer.engine.run(Event::Init, &mut trainer.state)?;
        // The shard plan follows the model as `INIT`'s surgeries left it (a restore changes
        // parameter ids, never shapes), and is in place before a restore, which loads only
        // this rank's share of the optimizer state.
        if sharded {
            let plan = ShardPlan::for_model::<S::Backend, S::Model>(trainer.state.model(), world);
            trainer.state.sharding = Some(plan);
            trainer.engine.set_sharded(true);
        }
        trainer.engine.run(Event::BeforeLoad, &mut trainer.state)?;
        if let Some(restore) = self.restore {
            let components =
                restore.restore(&mut crate::restore::Restoring::new(&mut trainer.state))?;
            trainer.check_restored_position()?;
            if let Some(components) = components {
                trainer.engine.restore_component_states(components)?;
            }
        }
        // Parameters in the precision's type: a cast for the pure half precisions, and for a
        // checkpoint saved in another precision (nothing happens when they already are).
        let dtype = trainer.state.precision.parameter_dtype();
        trainer
            .state
            .map_model(|m| cast_params::<S::Backend, S::Model>(m, dtype));
        if world.size > 1 {
            if let Some(mut c) = trainer.state.collective.take() {
                let agreed = agree_on_position(c.as_mut(), &trainer.state.timestamp, world);
                if let Err(e) = agreed {
                    trainer.state.collective = Some(c);
                    return Err(e);
                }
                let sharded = trainer.state.sharding.is_some();
                let broadcast = trainer.state.try_map_model(|m| {
                    let m = c.broadcast_model(m)?;
                    match sharded {
                        true => crate::shard::take_rank0_ids(c.as_mut(), m),
                        false => Ok(m),
                    }
                });
                trainer.state.collective = Some(c);
                broadcast?;
            }
        }
        trainer.engine.run(Event::AfterLoad, &mut trainer.state)?;
        Ok(trainer)
    }
}

impl<S: Setup> TrainerBuilder<S>
where
    S::Model: Autocast,
{
    /// The run's floating-point setup (Composer's `precision`; default `fp32`): see
    /// [`crate::precision`]. The model computes in the precision's type from here on; the
    /// backend's support for it is checked by `build`.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self.model = self.model.with_compute_dtype(precision.compute_dtype());
        self
    }
}

/// Checks that every rank starts from the same position (the same checkpoint, or none): a
/// rank that could not read the checkpoint folder would otherwise train from batch 0 beside
/// ranks that resumed, with weights broadcast from rank 0 and optimizer states that differ.
fn agree_on_position<S: Setup>(
    c: &mut dyn Collective<S>,
    ts: &crate::time::Timestamp,
    world: World,
) -> Result<()> {
    const FIELDS: usize = 4;
    let mine = [ts.epoch, ts.batch, ts.sample, ts.token];
    let mut all = vec![0.0; FIELDS * world.size];
    for (slot, v) in all[FIELDS * world.rank..].iter_mut().zip(mine) {
        *slot = v as f64;
    }
    c.all_reduce_sum_host(&mut all)?;
    let at = |r: usize| &all[FIELDS * r..FIELDS * (r + 1)];
    if let Some(r) = (1..world.size).find(|&r| at(r) != at(0)) {
        let describe = |v: &[f64]| format!("epoch {}, batch {}, sample {}", v[0], v[1], v[2]);
        return Err(CoreError::RestoredPosition {
            at: ts.to_string(),
            reason: format!(
                "rank {r} starts at {} but rank 0 at {}; every rank must resume from the same \
                 checkpoint (a save folder every rank can read, or --load of the same path)",
                describe(at(r)),
                describe(at(0))
            ),
        });
    }
    Ok(())
}
