//! The one value the trainer owns and lends to algorithms and callbacks at every event.
//!
//! The state holds data, not behaviour: the trainer decides when fields change, and documents
//! at which events each optional field is set. Nothing here runs events or touches files.

use std::collections::BTreeMap;

use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::collective::{Collective, GlobalStep, LocalStep};
use crate::error::{CoreError, Result};
use crate::model::Batch;
use crate::precision::{LossScaler, Precision};

use crate::rng::{derive_seed, Rng};
use crate::schedule::LrSchedule;
use crate::setup::{BatchOf, DeviceOf, OutputOf, Setup};
use crate::time::{Progress, Time, TimeUnit, Timestamp};

/// Rank and size of the data-parallel world this process belongs to, and so who writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
}

impl Default for World {
    fn default() -> Self {
        World { rank: 0, size: 1 }
    }
}

impl World {
    /// Whether this is the main rank (0): the one whose loggers, progress bar, plots and
    /// checkpoint saver act, unless a component is configured to act on every rank
    /// ([`Ranks`](crate::collective::Ranks)).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// Whether a component that acts on `ranks` acts on this process.
    pub fn runs(&self, ranks: crate::collective::Ranks) -> bool {
        ranks == crate::collective::Ranks::Every || self.is_main()
    }
}

/// Checks that `t` (the setting `name`) can be measured on batches that count tokens
/// (`counts_tokens`) or not: see [`State::check_countable`].
pub fn check_countable(name: &'static str, t: Time, counts_tokens: bool) -> Result<()> {
    if t.unit() == TimeUnit::Token && !counts_tokens {
        return Err(CoreError::config(
            name,
            t,
            "a time in ep, ba or sp (or wall-clock time): this run's batches do not count \
             tokens (`Batch::COUNTS_TOKENS` is false), so a time in tok would never be reached",
        ));
    }
    Ok(())
}

/// Everything a training run knows at a given event.
pub struct State<S: Setup> {
    pub(crate) model: Option<S::Model>,
    /// The optimizer (its moments are part of the state a checkpoint saves).
    pub optimizer: S::Optimizer,
    /// The learning-rate schedule: a pure function of time, multiplied into `base_lr`.
    pub scheduler: Box<dyn LrSchedule>,
    /// Learning rate at scale factor 1.
    pub base_lr: f64,
    /// Learning rate for the current batch (set at `BATCH_START`).
    pub lr: f64,
    /// Where the run stands.
    pub timestamp: Timestamp,
    /// The run's length (after the scale-schedule ratio).
    pub max_duration: Time,
    /// Multiplier applied to `max_duration` and to schedule milestones.
    pub scale_schedule_ratio: f64,
    /// Batches in one training epoch.
    pub batches_per_epoch: u64,
    /// Samples in one training epoch (for this rank).
    pub samples_per_epoch: u64,
    /// Samples in a full training batch over the ranks whose batches the timestamp counts
    /// (the loader's batch size times the world size of a data-parallel run): a checkpoint
    /// taken inside an epoch resumes only at the same global batch.
    pub global_batch_size: u64,
    /// The current batch: the full batch from `AFTER_DATALOADER` to `BATCH_END`, except between
    /// `BEFORE_FORWARD` and `AFTER_BACKWARD`, where it is the current microbatch.
    pub batch: Option<BatchOf<S>>,
    /// Output of the model on the current microbatch (`AFTER_FORWARD` to `AFTER_BACKWARD`).
    pub outputs: Option<OutputOf<S>>,
    /// Loss of the current microbatch (`AFTER_LOSS` to `BEFORE_BACKWARD`), unscaled.
    pub loss: Option<Tensor<S::Backend, 1>>,
    /// Loss of the last full batch, read back to the host (set before `AFTER_TRAIN_BATCH`);
    /// in a data-parallel run, the mean over every rank's batch.
    pub loss_value: Option<f64>,
    /// Gradients: of the current microbatch at `AFTER_BACKWARD`, of the whole batch at
    /// `AFTER_TRAIN_BATCH` (where clipping may rewrite them); consumed by the optimizer step.
    /// In a data-parallel run they are already averaged over every rank at
    /// `AFTER_TRAIN_BATCH` (see [`Collective`](crate::collective::Collective)).
    pub grads: Option<GradientsParams>,
    /// Latest evaluation results: evaluator label, then metric name, then value.
    pub eval_metrics: BTreeMap<String, BTreeMap<String, f64>>,
    /// Value of `timestamp.batch` at the last evaluation, if any ran.
    pub last_eval_batch: Option<u64>,
    /// Labels of the evaluators that ran in the current (or last) round of `EVAL_*` events,
    /// in order: their entries in `eval_metrics` are fresh, the others' are older.
    pub evaluated: Vec<String>,
    /// Saved states of every algorithm and callback, keyed `algorithm/<name>` and
    /// `callback/<name>`; filled by the engine just before `BATCH_CHECKPOINT`,
    /// `EPOCH_CHECKPOINT` and `FIT_END` when a callback asks for them
    /// (`Callback::needs_component_states`), so that a checkpoint saver can store them.
    pub component_states: BTreeMap<String, serde_json::Value>,
    /// Batches whose loss was not finite and were skipped (when skipping is enabled).
    pub skipped_batches: u64,
    /// The run's floating-point setup (see [`crate::precision`]); saved in checkpoints.
    pub precision: Precision,
    /// Dynamic loss scaling (runs in float16 only); its state is saved in checkpoints.
    pub loss_scaler: Option<LossScaler>,
    /// The microbatch size automatic microbatching has settled on after running out of
    /// memory (`None`: not automatic, or not needed yet: the configured size); saved in
    /// checkpoints, so that a resumed run continues at it.
    pub auto_microbatch_size: Option<usize>,
    /// Which attempt at the current batch this is: 0, or more when automatic microbatching
    /// retried the batch in smaller microbatches. Algorithms that count their random draws
    /// within a batch start counting again with each attempt, so that a retried batch draws
    /// what a run started at the smaller size draws.
    pub batch_attempt: u32,
    /// Rank and world size.
    pub world: World,
    /// The run's seed; all randomness derives from it (see [`State::rng`]).
    pub seed: u64,
    /// The device the model trains on.
    pub device: DeviceOf<S>,
    pub(crate) stop_reason: Option<String>,
    /// Gradients an algorithm computed itself at `AFTER_TRAIN_BATCH` overflowed under loss
    /// scaling on some rank (see [`State::replace_gradients`]): the trainer skips the step and
    /// lowers the scale after the event. Reset by the trainer at each batch.
    pub(crate) algorithm_overflow: bool,
    /// How this rank meets the others of a data-parallel run (`None`: a single process).
    pub(crate) collective: Option<Box<dyn Collective<S>>>,
}

impl<S: Setup> State<S> {
    /// The model.
    pub fn model(&self) -> &S::Model {
        // The model is only taken out for the length of the optimizer step, during which no
        // event runs, so it is always present when user code can see the state.
        self.model
            .as_ref()
            .expect("model is present outside the optimizer step")
    }

    /// Replaces the model through a function of the old one; parameter ids should be kept so
    /// that optimizer state stays attached.
    pub fn map_model(&mut self, f: impl FnOnce(S::Model) -> S::Model) {
        // Invariant: as in `model`, no event runs while the model is out.
        let model = self
            .model
            .take()
            .expect("model is present outside the optimizer step");
        self.model = Some(f(model));
    }

    /// Like [`State::map_model`] for a fallible function; on an error the model is gone and
    /// the caller must not use the state again (the trainer only does this while building).
    pub(crate) fn try_map_model(
        &mut self,
        f: impl FnOnce(S::Model) -> Result<S::Model>,
    ) -> Result<()> {
        // Invariant: as in `model`, no event runs while the model is out.
        let model = self
            .model
            .take()
            .expect("model is present outside the optimizer step");
        self.model = Some(f(model)?);
        Ok(())
    }

    /// The model and the collective, borrowed together (the trainer's gradient seam).
    pub(crate) fn model_and_collective(
        &mut self,
    ) -> (&S::Model, Option<&mut Box<dyn Collective<S>>>) {
        // Invariant: as in `model`, no event runs while the model is out.
        let model = self
            .model
            .as_ref()
            .expect("model is present outside the optimizer step");
        (model, self.collective.as_mut())
    }

    /// The factor an algorithm that runs its own backward pass at `AFTER_TRAIN_BATCH` (SAM's
    /// second pass) multiplies its float32 loss by before `backward`, as the trainer does with
    /// the batch's loss: the loss scale under dynamic loss scaling (float16 precisions), 1
    /// otherwise. The gradients then go to [`State::replace_gradients`], which divides by it.
    pub fn loss_scale(&self) -> f64 {
        self.loss_scaler.map_or(1.0, |s| s.scale)
    }

    /// Puts gradients an algorithm computed with its own backward pass at `AFTER_TRAIN_BATCH`
    /// (SAM's second pass, of a loss multiplied by [`State::loss_scale`]) in place of the
    /// batch's, treated as the trainer treats its own: brought to float32 (the half
    /// precisions) and divided by the loss scale, checked for overflow under loss scaling (one
    /// read from the device), and averaged over every rank of a data-parallel run. When they
    /// overflowed on any rank, every rank drops them (`grads` becomes `None`): the optimizer
    /// step is skipped and the scale lowered, as when the batch's own gradients overflow
    /// (PyTorch's `GradScaler` records an overflow in any backward pass of a step the same
    /// way). Every rank must call it at the same point, as for
    /// [`State::average_gradients`].
    pub fn replace_gradients(&mut self, grads: GradientsParams) -> Result<()> {
        let scaler = self.loss_scaler;
        let (grads, flag) = if self.precision == Precision::Fp32 {
            (grads, None)
        } else {
            crate::precision::prepare_gradients::<S::Backend, S::Model>(
                self.model(),
                grads,
                scaler.map(|s| 1.0 / s.scale),
                scaler.is_some(),
            )
        };
        let overflowed = match flag {
            Some(flag) => {
                let v = flag.into_data().iter::<f64>().next();
                !v.is_some_and(f64::is_finite)
            }
            None => false,
        };
        let local = (!overflowed).then_some(grads);
        let synced = if self.is_data_parallel() {
            let global = self.sync_own_gradients(local, !overflowed)?;
            global.grads.filter(|_| global.skipped_ranks == 0)
        } else {
            local
        };
        if synced.is_none() {
            self.algorithm_overflow = true;
        }
        self.grads = synced;
        Ok(())
    }

    /// Averages gradients an algorithm computed itself (SAM's second pass) over every rank of
    /// a data-parallel run, through the same seam and buffer layout as the trainer's own
    /// gradients; in a single process they come back unchanged. Every rank must call it at
    /// the same point, as algorithms do (their schedules are functions of the timestamp).
    pub fn average_gradients(&mut self, grads: GradientsParams) -> Result<GradientsParams> {
        if !self.is_data_parallel() {
            return Ok(grads);
        }
        self.sync_own_gradients(Some(grads), true)?
            .grads
            .ok_or_else(|| CoreError::Component {
                component: "collective".into(),
                event: "average_gradients",
                message: "the ranks did not all bring gradients to average".into(),
            })
    }

    /// Whether this rank trains with others (a world of more than one, with a collective).
    fn is_data_parallel(&self) -> bool {
        self.world.size > 1 && self.collective.is_some()
    }

    /// Gradients an algorithm computed itself, through the collective's gradient seam (with
    /// `finite` false where this rank's overflowed); only in a data-parallel run.
    fn sync_own_gradients(
        &mut self,
        grads: Option<GradientsParams>,
        finite: bool,
    ) -> Result<GlobalStep> {
        let samples = self.batch.as_ref().map_or(1, |b| b.len() as u64);
        let (model, collective) = self.model_and_collective();
        // Invariant: callers check `is_data_parallel` first.
        let c = collective.expect("a collective in a data-parallel run");
        let local = LocalStep {
            grads,
            loss: 0.0,
            finite,
            samples,
        };
        c.sync_gradients(model, local)
    }

    /// Asks the trainer to stop after the current batch; `reason` is logged.
    pub fn request_stop(&mut self, reason: impl Into<String>) {
        self.stop_reason = Some(reason.into());
    }

    /// Why a stop was requested, if it was.
    pub fn stop_requested(&self) -> Option<&str> {
        self.stop_reason.as_deref()
    }

    /// Whether this run's batches count tokens (their [`Batch::COUNTS_TOKENS`]).
    pub fn counts_tokens(&self) -> bool {
        <BatchOf<S> as Batch>::COUNTS_TOKENS
    }

    /// Checks that a component's time `t` (named `name` in the error) can be reached in this
    /// run: a time in `tok` needs batches that count tokens. Components that take a time call
    /// it before the first batch, so such a time is an error, never a run that never ends or
    /// an interval that never fires.
    pub fn check_countable(&self, name: &'static str, t: Time) -> Result<()> {
        check_countable(name, t, self.counts_tokens())
    }

    /// Progress against `max_duration`.
    pub fn progress(&self) -> Progress {
        Progress {
            batches_per_epoch: self.batches_per_epoch,
            samples_per_epoch: self.samples_per_epoch,
            max_duration: self.max_duration,
        }
    }

    /// A random generator for the current batch, private to `stream` (an algorithm's name, for
    /// example). It depends only on `(seed, rank, epoch, batch, stream)`, so a resumed run
    /// draws exactly what the uninterrupted run drew.
    pub fn rng(&self, stream: &str) -> Rng {
        Rng::new(derive_seed(&[
            self.seed,
            self.world.rank as u64,
            self.timestamp.epoch,
            self.timestamp.batch_in_epoch,
            crate::rng::hash_str(stream),
        ]))
    }
}
