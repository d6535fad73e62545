//! The trainer: owns the [`State`], the [`Engine`] and the run's collective, and turns
//! batches into optimizer steps while firing every event in the order `crate::event` states.
//!
//! The module is split by phase: `builder.rs` checks the configuration and builds the trainer,
//! this file holds the epoch loop (`fit`), `step.rs` one batch (begin, microbatch, step, end),
//! `eval.rs` evaluation and prediction, `report.rs` what `fit` returns. Restoring state goes
//! through [`crate::restore::Restore`]; meeting other ranks through
//! [`crate::collective::Collective`].

mod builder;
mod eval;
mod report;
mod retry;
mod scaling;
mod step;
mod sync;

use std::time::{Duration, Instant};

use crate::data::BatchSource;
use crate::engine::Engine;
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::model::TrainModel;
use crate::setup::{BatchOf, DeviceOf, Setup, SetupOf};
use crate::state::State;
use crate::time::{Progress, Time, TimeUnit, Timestamp};

pub use builder::TrainerBuilder;
pub use eval::{EvalBatch, EvalOutput, Evaluator, InnerModel};
pub use report::FitReport;

/// Trains, evaluates and predicts with a model, firing events for algorithms, callbacks and
/// loggers.
///
/// ```
/// use flashover_core::prelude::*;
/// use flashover_core::toy;
/// # type B = burn::backend::Autodiff<burn::backend::Flex>;
///
/// // 16 points in batches of 4: four batches an epoch; two epochs, in microbatches of 2.
/// let mut trainer = toy::trainer::<B>(toy::points(16, 4), "2ep".parse()?)
///     .scheduler(Scheduler::cosine(Time::Duration(1.0), 0.0).with_warmup(Time::Batch(2)))
///     .microbatch_size(2)
///     .seed(42)
///     .build()?;
/// let report = trainer.fit()?;              // to max_duration
/// assert_eq!((report.steps, report.samples), (8, 32));
/// trainer.fit_for(Time::Epoch(1))?;         // and one more epoch
/// assert_eq!(trainer.state().timestamp().epoch, 3);
/// // The regression y = 2x is being learned: the weight moved from 0 towards 2.
/// let w = toy::weight(trainer.model());
/// assert!(w > 0.5 && w < 2.5, "{w}");
/// # Ok::<(), CoreError>(())
/// ```
pub struct Trainer<S: Setup> {
    state: State<S>,
    engine: Engine<S>,
    train: Box<dyn BatchSource<BatchOf<S>>>,
    evaluators: Vec<Evaluator<S::Backend, S::Model>>,
    eval_interval: Time,
    microbatch_size: Option<usize>,
    auto_microbatching: bool,
    /// The allocation failures (`crate::memory`) already accounted for.
    failures_seen: u64,
    skip_nonfinite_loss: bool,
    /// Microbatches and ranks weighed by their scored tokens (`accumulate_on_tokens`).
    accumulate_on_tokens: bool,
    /// The run's configuration until it has been logged (at the first `FIT_START`).
    hyperparameters: Option<serde_json::Map<String, serde_json::Value>>,
    /// When the current `fit` call started, and the run's wall-clock time then.
    clock: Option<(Instant, Duration)>,
    /// Device-to-host reads the training step made (see [`FitReport::device_reads`]).
    device_reads: u64,
    /// Failed device allocations are counted while this lives (`None`: not watched; see
    /// `TrainerBuilder::watch_device_memory`).
    #[allow(dead_code)] // held for its lifetime, never read
    memory_watch: Option<crate::memory::DeviceMemoryWatch>,
}

impl<B, M, O> Trainer<SetupOf<B, M, O>>
where
    B: burn::tensor::backend::AutodiffBackend,
    M: TrainModel<B>,
    O: burn::optim::Optimizer<M, B>,
{
    /// Starts building a trainer for `model` with `optimizer`, reading `train`, for
    /// `max_duration`, on `device`.
    pub fn builder(
        model: M,
        optimizer: O,
        train: impl BatchSource<M::Batch> + 'static,
        max_duration: Time,
        device: DeviceOf<SetupOf<B, M, O>>,
    ) -> TrainerBuilder<SetupOf<B, M, O>> {
        TrainerBuilder::new(model, optimizer, Box::new(train), max_duration, device)
    }
}

/// Why a restored timestamp cannot be a position any run reached, or `None`. A hand-edited
/// (or forged, with its manifest hash redone) `trainer_state.json` is caught here, where the
/// counts contradict each other or this run's data: every finished epoch took at least one
/// batch, every batch held at least one sample, and a finished epoch took at most 2x this
/// run's `global_epoch` batches (a batch holds at least one of the epoch's samples, and an
/// epoch's length changes between runs only by the padding to the number of processes and
/// by a dropped last batch). Samples are not bounded from above: an algorithm may reshape a
/// batch into more samples (ALiBi's shorter training sequences). Arithmetic is in `u128`,
/// so no forged count overflows it.
pub(crate) fn inconsistent_position(ts: &Timestamp, global_epoch: u64) -> Option<String> {
    let w = |x: u64| x as u128;
    if w(ts.batch) < w(ts.epoch) + w(ts.batch_in_epoch) {
        return Some(format!(
            "{} finished epochs and {} batches into the current one, but only {} batches in all (every epoch takes at least one)",
            ts.epoch, ts.batch_in_epoch, ts.batch
        ));
    }
    if ts.sample < ts.batch || ts.sample_in_epoch < ts.batch_in_epoch {
        return Some(format!(
            "{} batches ({} in this epoch) but only {} samples ({} in this epoch): every batch holds at least one",
            ts.batch, ts.batch_in_epoch, ts.sample, ts.sample_in_epoch
        ));
    }
    let finished = ts.batch - ts.batch_in_epoch;
    if w(finished) > w(ts.epoch) * 2 * w(global_epoch) {
        return Some(format!(
            "{finished} batches in {} finished epochs, more than 2x this run's {global_epoch} samples an epoch each (a batch holds at least one sample)",
            ts.epoch
        ));
    }
    None
}

/// Where a restored position lies past the end of the run (`max_duration`), or `None`: more
/// finished epochs, or more batches, than the run has. Sample and token lengths are not
/// checked: a run stops at the first batch that reaches them, and how far that batch goes
/// past depends on its size, which algorithms may change (ALiBi's reshaped batches); wall
/// time is not a position.
pub(crate) fn past_the_end(ts: &Timestamp, max: Time) -> Option<String> {
    match max {
        Time::Epoch(e) if ts.epoch > e || (ts.epoch == e && ts.batch_in_epoch > 0) => {
            Some(format!(
                "at epoch {e}, before the checkpoint's epoch {} (batch {} of it)",
                ts.epoch, ts.batch_in_epoch
            ))
        }
        Time::Batch(b) if ts.batch > b => Some(format!(
            "at batch {b}, before the checkpoint's batch {}",
            ts.batch
        )),
        _ => None,
    }
}

impl<S: Setup> Trainer<S> {
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
        if let Some(reason) = inconsistent_position(
            ts,
            self.state.samples_per_epoch * self.state.world.size.max(1) as u64,
        ) {
            return Err(CoreError::RestoredPosition {
                at: ts.to_string(),
                reason,
            });
        }
        if let Some(past) = past_the_end(ts, self.state.max_duration) {
            return Err(CoreError::RestoredPosition {
                at: ts.to_string(),
                reason: format!(
                    "`max_duration` {} ends {past}, so the run would train nothing; resume with a longer max_duration, or start a new run from its weights",
                    self.state.max_duration
                ),
            });
        }
        Ok(())
    }

    /// The state.
    pub fn state(&self) -> &State<S> {
        &self.state
    }

    /// The state as a [`Restore`](crate::restore::Restore) sees it: to load a checkpoint into
    /// a trainer already built (the checkpoint benchmark does; a run resumes through
    /// `TrainerBuilder::restore`, which also hands the components their states).
    pub fn restoring(&mut self) -> crate::restore::Restoring<'_, S> {
        crate::restore::Restoring::new(&mut self.state)
    }

    /// The model.
    pub fn model(&self) -> &S::Model {
        self.state.model()
    }

    /// Consumes the trainer and returns the model.
    pub fn into_model(self) -> S::Model {
        let mut state = self.state;
        // Invariant: the model is only out of the state during the optimizer step.
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
                "a time greater than zero in ep, ba, sp or tok, or a wall-clock time",
            ));
        }
        self.state.check_countable("duration", duration)?;
        let unit = duration.unit();
        let now = if unit == self.state.max_duration.unit() {
            self.state.max_duration
        } else if unit == TimeUnit::Wall {
            Time::Wall(self.state.timestamp.run_wall_time)
        } else {
            // Counts are exact in their own unit; whole epochs only, so resume mid-epoch adds
            // from the current epoch's start.
            Time::new(unit, self.state.timestamp.count(unit).unwrap_or(0) as f64)?
        };
        let max_duration = (now + duration)?;
        // The schedule must fit the new length as it fitted the old one (a cosine over the
        // run cannot follow a wall-clock length).
        let progress = Progress {
            max_duration,
            ..self.state.progress()
        };
        self.state.scheduler.validate(&progress)?;
        self.state.max_duration = max_duration;
        self.fit_inner()
    }

    /// Brings `Timestamp::run_wall_time` up to now and, in a data-parallel run, makes every
    /// rank agree on it (the slowest rank's) and on the samples and tokens a batch added;
    /// returns the (agreed) samples and tokens.
    fn agree_progress(&mut self, samples: u64, tokens: u64) -> Result<(u64, u64)> {
        let Some((started, base)) = self.clock else {
            return Ok((samples, tokens));
        };
        let wall = base + started.elapsed();
        self.state.timestamp.run_wall_time = wall;
        let size = self.state.world.size;
        match self.state.collective.as_mut() {
            Some(c) if size > 1 => {
                let agreed = c.sync_progress(samples, tokens, wall)?;
                self.state.timestamp.run_wall_time = agreed.wall;
                Ok((agreed.samples, agreed.tokens))
            }
            _ => Ok((samples, tokens)),
        }
    }

    /// Whether the run must stop before its next batch: `max_duration` reached (counted at
    /// the batch end just passed) or a stop requested.
    fn must_stop(&self) -> bool {
        self.state.stop_reason.is_some() || self.state.progress().is_done(&self.state.timestamp)
    }

    fn fit_inner(&mut self) -> Result<FitReport> {
        let start = Instant::now();
        self.clock = Some((start, self.state.timestamp.run_wall_time));
        let before = self.state.timestamp.clone();
        let reads_before = self.device_reads;
        let mut steps = 0;
        let mut data_wait = Duration::ZERO;
        self.state.stop_reason = None;
        if let Some(hp) = self.hyperparameters.take() {
            self.engine.logger().log_hyperparameters(&hp)?;
        }
        self.engine.run(Event::FitStart, &mut self.state)?;
        self.agree_on_stop()?;
        let num_batches = self.train.num_batches();
        'epochs: loop {
            if !self.epoch_end_pending() && self.must_stop() {
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
                if !epoch_done && self.must_stop() {
                    break 'epochs;
                }
            }
            drop(batches);
            self.state.timestamp.advance_epoch();
            self.agree_progress(0, 0)?;
            self.engine.run(Event::EpochEnd, &mut self.state)?;
            let ep = self.state.timestamp.epoch;
            if self.evaluators.iter().any(|e| self.epoch_eval_due(e, ep)) {
                self.run_evaluators(|t, e| t.epoch_eval_due(e, ep))?;
                // The checkpoint that may follow counts the evaluation's time.
                self.agree_progress(0, 0)?;
            }
            self.engine.run(Event::EpochCheckpoint, &mut self.state)?;
            self.state.checkpoint_requested = false;
            self.agree_on_stop()?;
        }
        self.agree_progress(0, 0)?;
        self.engine.run(Event::FitEnd, &mut self.state)?;
        self.clock = None;
        let after = &self.state.timestamp;
        Ok(FitReport {
            steps,
            batches: after.batch - before.batch,
            samples: after.sample - before.sample,
            wall: start.elapsed(),
            data_wait,
            device_reads: self.device_reads - reads_before,
            stopped: self.state.stop_reason.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Where a run with `epochs` full epochs of `per_epoch` batches of `batch` samples (the
    /// last one `last` samples) stands after `done` batches.
    fn reached(per_epoch: u64, batch: u64, last: u64, done: u64) -> Timestamp {
        let mut ts = Timestamp::default();
        for _ in 0..done {
            let size = if ts.batch_in_epoch + 1 == per_epoch {
                last
            } else {
                batch
            };
            ts.advance_batch(size, size * 7, Duration::ZERO);
            if ts.batch_in_epoch == per_epoch {
                ts.advance_epoch();
            }
        }
        ts
    }

    proptest! {
        #[test]
        fn every_position_a_run_reaches_is_consistent(
            per_epoch in 1u64..12, batch in 1u64..64, last_frac in 0.0f64..1.0, done in 0u64..80,
            reshape in 1u64..5,
        ) {
            let last = 1 + ((batch - 1) as f64 * last_frac) as u64;
            let epoch = (per_epoch - 1) * batch + last;
            let ts = reached(per_epoch, batch, last, done);
            prop_assert_eq!(inconsistent_position(&ts, epoch), None);
            // An algorithm that splits every sample into `reshape` shorter ones (ALiBi) counts
            // more samples per batch than the loader's batch size.
            let mut split = ts.clone();
            split.sample *= reshape;
            split.sample_in_epoch *= reshape;
            prop_assert_eq!(inconsistent_position(&split, epoch), None);
            // A run as long as the position is not past its end.
            prop_assert_eq!(past_the_end(&ts, Time::Batch(done)), None);
            prop_assert_eq!(past_the_end(&ts, Time::Epoch(ts.epoch + u64::from(ts.batch_in_epoch > 0))), None);
        }
    }

    #[test]
    fn only_trainers_whose_device_memory_fails_by_panicking_watch_it() {
        type B = burn::backend::Autodiff<burn::backend::Flex>;
        let build = |b: TrainerBuilder<_>| b.build().unwrap();
        let toy = || crate::toy::trainer::<B>(crate::toy::points::<B>(8, 4), Time::Batch(1));
        // Flex aborts on a failed host allocation: nothing to watch, no hook installed for it.
        assert!(build(toy()).memory_watch.is_none());
        assert!(build(toy().watch_device_memory(true))
            .memory_watch
            .is_some());
        assert!(build(toy().auto_microbatching(true)).memory_watch.is_some());
    }

    #[test]
    fn forged_positions_are_named() {
        // 16 batches of 32 an epoch; batch 20 is epoch 1, batch 4.
        let good = reached(16, 32, 32, 20);
        assert_eq!((good.epoch, good.batch_in_epoch, good.sample), (1, 4, 640));
        assert_eq!(inconsistent_position(&good, 512), None);
        // The issue's case: the batch count alone set to 2^64 - 1.
        let forged = Timestamp {
            batch: u64::MAX,
            ..good.clone()
        };
        let why = inconsistent_position(&forged, 512).unwrap();
        assert!(why.contains("only 640 samples"), "{why}");
        // Every count forged together, in proportion: the finished epochs are too long.
        let forged = Timestamp {
            epoch: 1,
            batch: u64::MAX,
            sample: u64::MAX,
            ..good.clone()
        };
        let why = inconsistent_position(&forged, 512).unwrap();
        assert!(
            why.contains("in 1 finished epochs, more than 2x this run's 512"),
            "{why}"
        );
        // One more batch than two epochs' worth of samples in the finished epoch.
        let forged = Timestamp {
            batch: 4 + 1025,
            sample: 100_000,
            ..good.clone()
        };
        assert!(inconsistent_position(&forged, 512).is_some());
        let at_bound = Timestamp {
            batch: 4 + 1024,
            ..forged.clone()
        };
        assert_eq!(inconsistent_position(&at_bound, 512), None);
        // More epochs than batches.
        let forged = Timestamp {
            epoch: 30,
            ..good.clone()
        };
        assert!(inconsistent_position(&forged, 512)
            .unwrap()
            .contains("30 finished epochs"));
        // Past the end in each unit; at the end exactly is not.
        assert!(past_the_end(&good, Time::Batch(19)).is_some());
        assert!(past_the_end(&good, Time::Batch(20)).is_none());
        assert!(past_the_end(&good, Time::Epoch(1)).is_some());
        assert!(past_the_end(&good, Time::Epoch(2)).is_none());
        assert!(past_the_end(&good, Time::Sample(1)).is_none());
        assert!(past_the_end(&good, Time::Token(1)).is_none());
    }
}
