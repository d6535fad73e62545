//! The one value the trainer owns and lends to algorithms and callbacks at every event.
//!
//! The state holds data, not behaviour: the trainer decides when fields change, and documents
//! at which events each optional field is set. Nothing here runs events or touches files.

use std::collections::{BTreeMap, HashSet};

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::collective::{Collective, GlobalStep, LocalStep};
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::model::Batch;
use crate::precision::{LossScaler, Precision};
use crate::rng::{derive_seed, Rng};
use crate::schedule::LrSchedule;
use crate::setup::{BatchOf, DeviceOf, OutputOf, Setup};
use crate::shard::ShardPlan;
use crate::time::{Progress, Time, TimeUnit, Timestamp};
pub use crate::world::World;

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
///
/// Everything can be read, through the methods of the same names. What may be changed, and
/// when, is said by the mutators: an algorithm changes the batch from `AFTER_DATALOADER`
/// to `AFTER_LOSS` ([`State::batch_mut`]), the loss at `AFTER_LOSS` and `BEFORE_BACKWARD`
/// ([`State::loss_mut`]), the gradients at `AFTER_BACKWARD` and `AFTER_TRAIN_BATCH`
/// ([`State::grads_mut`]), the learning rate from `BATCH_START` to `AFTER_TRAIN_BATCH`
/// ([`State::set_lr`]) and the model at any event ([`State::map_model`]); a call outside its
/// window is an error naming the window. Callbacks see the state read-only and act through
/// their [`Control`](crate::callback::Control) (stop, log, ask for a checkpoint); a [`Restore`](crate::restore::Restore)
/// puts a checkpoint's position in through [`Restoring`](crate::restore::Restoring).
pub struct State<S: Setup> {
    pub(crate) model: Option<S::Model>,
    /// The optimizer (its moments are part of the state a checkpoint saves).
    pub(crate) optimizer: S::Optimizer,
    /// The learning-rate schedule: a pure function of time, multiplied into `base_lr`.
    pub(crate) scheduler: Box<dyn LrSchedule>,
    /// Learning rate at scale factor 1.
    pub(crate) base_lr: f64,
    /// Learning rate for the current batch (set at `BATCH_START`).
    pub(crate) lr: f64,
    /// Where the run stands.
    pub(crate) timestamp: Timestamp,
    /// The run's length (after the scale-schedule ratio).
    pub(crate) max_duration: Time,
    /// Multiplier applied to `max_duration` and to schedule milestones.
    pub(crate) scale_schedule_ratio: f64,
    /// Batches in one training epoch.
    pub(crate) batches_per_epoch: u64,
    /// Samples in one training epoch (for this rank).
    pub(crate) samples_per_epoch: u64,
    /// Samples in a full training batch over the ranks whose batches the timestamp counts
    /// (the loader's batch size times the world size of a data-parallel run): a checkpoint
    /// taken inside an epoch resumes only at the same global batch.
    pub(crate) global_batch_size: u64,
    /// The current batch: the full batch from `AFTER_DATALOADER` to `BATCH_END`, except between
    /// `BEFORE_FORWARD` and `AFTER_BACKWARD`, where it is the current microbatch.
    pub(crate) batch: Option<BatchOf<S>>,
    /// Output of the model on the current microbatch (`AFTER_FORWARD` to `AFTER_BACKWARD`).
    pub(crate) outputs: Option<OutputOf<S>>,
    /// Loss of the current microbatch (`AFTER_LOSS` to `BEFORE_BACKWARD`), unscaled.
    pub(crate) loss: Option<Tensor<S::Backend, 1>>,
    /// Loss of the last full batch, read back to the host (set before `AFTER_TRAIN_BATCH`);
    /// in a data-parallel run, the mean over every rank's batch.
    pub(crate) loss_value: Option<f64>,
    /// Gradients: of the current microbatch at `AFTER_BACKWARD`, of the whole batch at
    /// `AFTER_TRAIN_BATCH` (where clipping may rewrite them); consumed by the optimizer step.
    /// In a data-parallel run they are already averaged over every rank at
    /// `AFTER_TRAIN_BATCH` (see [`Collective`](crate::collective::Collective)).
    pub(crate) grads: Option<GradientsParams>,
    /// Latest evaluation results: evaluator label, then metric name, then value.
    pub(crate) eval_metrics: BTreeMap<String, BTreeMap<String, f64>>,
    /// Value of `timestamp.batch` at the last evaluation, if any ran.
    pub(crate) last_eval_batch: Option<u64>,
    /// Labels of the evaluators that ran in the current (or last) round of `EVAL_*` events,
    /// in order: their entries in `eval_metrics` are fresh, the others' are older.
    pub(crate) evaluated: Vec<String>,
    /// Saved states of every algorithm and callback, keyed `algorithm/<name>` and
    /// `callback/<name>`; filled by the engine just before `BATCH_CHECKPOINT`,
    /// `EPOCH_CHECKPOINT` and `FIT_END` when a callback asks for them
    /// (`Callback::needs_component_states`), so that a checkpoint saver can store them.
    pub(crate) component_states: BTreeMap<String, serde_json::Value>,
    /// Batches whose loss was not finite and were skipped (when skipping is enabled).
    pub(crate) skipped_batches: u64,
    /// The run's floating-point setup (see [`crate::precision`]); saved in checkpoints.
    pub(crate) precision: Precision,
    /// Dynamic loss scaling (runs in float16 only); its state is saved in checkpoints.
    pub(crate) loss_scaler: Option<LossScaler>,
    /// The microbatch size automatic microbatching has settled on after running out of
    /// memory (`None`: not automatic, or not needed yet: the configured size); saved in
    /// checkpoints, so that a resumed run continues at it.
    pub(crate) auto_microbatch_size: Option<usize>,
    /// Which attempt at the current batch this is: 0, or more when automatic microbatching
    /// retried the batch in smaller microbatches. Algorithms that count their random draws
    /// within a batch start counting again with each attempt, so that a retried batch draws
    /// what a run started at the smaller size draws.
    pub(crate) batch_attempt: u32,
    /// Rank and world size.
    pub(crate) world: World,
    /// The run's seed; all randomness derives from it (see [`State::rng`]).
    pub(crate) seed: u64,
    /// The device the model trains on.
    pub(crate) device: DeviceOf<S>,
    pub(crate) stop_reason: Option<String>,
    /// Gradients an algorithm computed itself at `AFTER_TRAIN_BATCH` overflowed under loss
    /// scaling on some rank (see [`State::replace_gradients`]): the trainer skips the step and
    /// lowers the scale after the event. Reset by the trainer at each batch.
    pub(crate) algorithm_overflow: bool,
    /// How this rank meets the others of a data-parallel run (`None`: a single process).
    pub(crate) collective: Option<Box<dyn Collective<S>>>,
    /// Which rank owns which parameter, in a run whose optimizer state and gradients are
    /// sharded ([`crate::shard`]); `None` otherwise.
    pub(crate) sharding: Option<ShardPlan>,
    /// In a sharded run, the parameters this rank's batch had gradients for (the ones
    /// [`State::with_whole_gradients`] fills in from their owners).
    pub(crate) shard_keep: HashSet<ParamId>,
    /// The event the engine is running (`None` between events): what the mutators below
    /// check their windows against.
    pub(crate) event: Option<Event>,
    /// A callback asked for a checkpoint at this batch (see [`Control::request_checkpoint`](crate::callback::Control::request_checkpoint));
    /// cleared by the trainer at each batch's start.
    pub(crate) checkpoint_requested: bool,
}

impl<S: Setup> State<S> {
    /// The model.
    pub fn model(&self) -> &S::Model {
        present(&self.model)
    }

    /// Replaces the model through a function of the old one; parameter ids should be kept so
    /// that optimizer state stays attached.
    pub fn map_model(&mut self, f: impl FnOnce(S::Model) -> S::Model) {
        let model = take_present(&mut self.model);
        self.model = Some(f(model));
    }

    /// Like [`State::map_model`] for a fallible function; on an error the model is gone and
    /// the caller must not use the state again (the trainer only does this while building).
    pub(crate) fn try_map_model(
        &mut self,
        f: impl FnOnce(S::Model) -> Result<S::Model>,
    ) -> Result<()> {
        let model = take_present(&mut self.model);
        self.model = Some(f(model)?);
        Ok(())
    }

    /// The model, the collective and the shard plan, borrowed together (the trainer's
    /// gradient seam).
    pub(crate) fn model_and_collective(&mut self) -> GradientSeam<'_, S> {
        let model = present(&self.model);
        (model, self.collective.as_mut(), self.sharding.as_ref())
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
    /// [`State::average_gradients`]; in a sharded run this rank keeps the parameters it owns.
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
    /// In a sharded run the averages of the parameters this rank owns come back, as the
    /// trainer's own do.
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

    /// Every rank's `values` (of any number each), concatenated in rank order: in a sharded
    /// run, how an algorithm combines what each rank computed over its own parameters into
    /// one result over all of them, in the module's order (gradient clipping's norm: each
    /// rank's per-parameter sums of squares, added up in parameter order on every rank, as
    /// a run that is not sharded adds them). Outside a sharded run, `values` as they are.
    /// Collective: every rank calls it at the same point.
    pub fn gather_over_shards(&mut self, values: Vec<f32>) -> Result<Vec<f32>> {
        match (&self.sharding, self.collective.as_mut()) {
            (Some(_), Some(c)) => crate::shard::gather_host(c.as_mut(), values),
            _ => Ok(values),
        }
    }

    /// Calls `f` with the state and the whole averaged gradient of the step, at
    /// `AFTER_TRAIN_BATCH`: in a sharded run, where [`State::grads`] holds only the
    /// parameters this rank owns, the other ranks' parts are gathered from them first (an
    /// algorithm that moves every weight by the gradient, SAM's ascent step, needs it all);
    /// otherwise `f` reads [`State::grads`] itself. `None` (and `f` is not called) where the
    /// step has no gradients. Collective in a sharded run: every rank calls it at the same
    /// point.
    pub fn with_whole_gradients<R>(
        &mut self,
        f: impl FnOnce(&Self, &GradientsParams) -> R,
    ) -> Result<Option<R>> {
        self.check_window("the gradients", GRADS_WINDOW)?;
        if self.grads.is_none() {
            return Ok(None);
        }
        let gathered = match (&self.sharding, self.collective.as_mut(), &self.grads) {
            (Some(plan), Some(c), Some(grads)) => Some(crate::shard::gather_gradients(
                c.as_mut(),
                plan,
                present(&self.model),
                grads,
                &self.shard_keep,
            )?),
            _ => None,
        };
        let state = &*self;
        Ok(match (&gathered, &state.grads) {
            (Some(all), _) => Some(f(state, all)),
            (None, Some(grads)) => Some(f(state, grads)),
            (None, None) => None,
        })
    }

    /// A sharded run's all-gather of the parameters each rank just stepped
    /// ([`crate::shard`]): every rank then holds every parameter, with its owner's bits.
    pub(crate) fn gather_shards(&mut self) -> Result<()> {
        let (Some(plan), Some(c)) = (self.sharding.as_ref(), self.collective.as_mut()) else {
            return Ok(());
        };
        let model = take_present(&mut self.model);
        let (model, result) = crate::shard::gather_params(c.as_mut(), plan, model);
        self.model = Some(model);
        result
    }

    /// Whether this rank holds only its own share of the gradients and optimizer state
    /// ([`crate::shard`]).
    pub fn is_sharded(&self) -> bool {
        self.sharding.is_some()
    }

    /// The shard plan of a sharded run (which rank owns which parameter).
    pub fn sharding(&self) -> Option<&ShardPlan> {
        self.sharding.as_ref()
    }

    /// In a sharded run, the ids of the parameters this rank owns (whose optimizer state it
    /// keeps and saves); `None` when every rank keeps everything.
    pub fn owned_param_ids(&self) -> Result<Option<HashSet<ParamId>>> {
        match &self.sharding {
            Some(plan) => Ok(Some(
                plan.owned_ids::<S::Backend, S::Model>(present(&self.model))?,
            )),
            None => Ok(None),
        }
    }

    /// Gradients an algorithm computed itself, through the collective's gradient seam (with
    /// `finite` false where this rank's overflowed); only in a data-parallel run.
    fn sync_own_gradients(
        &mut self,
        grads: Option<GradientsParams>,
        finite: bool,
    ) -> Result<GlobalStep> {
        let samples = self.batch.as_ref().map_or(1, |b| b.len() as u64);
        let model = present(&self.model);
        // Invariant: callers check `is_data_parallel` first.
        let c = self
            .collective
            .as_mut()
            .expect("a collective in a data-parallel run");
        let local = LocalStep {
            grads,
            loss: 0.0,
            finite,
            samples,
        };
        match &self.sharding {
            Some(plan) => {
                let (step, keep) =
                    crate::shard::sync_gradient_shards(c.as_mut(), plan, model, local)?;
                self.shard_keep = keep;
                Ok(step)
            }
            None => c.sync_gradients(model, local),
        }
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

/// The model: it is taken out only for the length of the optimizer step, during which no
/// event runs, so it is present whenever anything else sees the state.
fn present<M>(model: &Option<M>) -> &M {
    // Invariant: the model is out only during the optimizer step (see above).
    model
        .as_ref()
        .expect("model is present outside the optimizer step")
}

/// The model, taken out to be replaced (see [`present`]).
fn take_present<M>(model: &mut Option<M>) -> M {
    // Invariant: the model is out only during the optimizer step (see `present`).
    model
        .take()
        .expect("model is present outside the optimizer step")
}

/// The batch to change and the outputs to read ([`State::batch_and_outputs_mut`]).
pub type BatchAndOutputs<'a, S> = (Option<&'a mut BatchOf<S>>, Option<&'a OutputOf<S>>);

/// Where each part of the state may be changed: the events of its window, in words.
const BATCH_WINDOW: (&[Event], &str) = (
    &[
        Event::AfterDataloader,
        Event::BatchStart,
        Event::BeforeTrainBatch,
        Event::BeforeForward,
        Event::AfterForward,
        Event::BeforeLoss,
        Event::AfterLoss,
    ],
    "from AFTER_DATALOADER to AFTER_LOSS (the microbatch from BEFORE_FORWARD)",
);
const LOSS_WINDOW: (&[Event], &str) = (
    &[Event::AfterLoss, Event::BeforeBackward],
    "at AFTER_LOSS and BEFORE_BACKWARD",
);
const GRADS_WINDOW: (&[Event], &str) = (
    &[Event::AfterBackward, Event::AfterTrainBatch],
    "at AFTER_BACKWARD (the microbatch's) and AFTER_TRAIN_BATCH (the batch's, before the step)",
);
const LR_WINDOW: (&[Event], &str) = (
    &[
        Event::BatchStart,
        Event::BeforeTrainBatch,
        Event::BeforeForward,
        Event::AfterForward,
        Event::BeforeLoss,
        Event::AfterLoss,
        Event::BeforeBackward,
        Event::AfterBackward,
        Event::AfterTrainBatch,
    ],
    "from BATCH_START to AFTER_TRAIN_BATCH (the step that follows uses it)",
);

/// What may be read of a run, at any event.
impl<S: Setup> State<S> {
    /// The optimizer (its moments are part of the state a checkpoint saves).
    pub fn optimizer(&self) -> &S::Optimizer {
        &self.optimizer
    }

    /// The learning-rate schedule: a pure function of time, multiplied into `base_lr`.
    pub fn scheduler(&self) -> &dyn LrSchedule {
        self.scheduler.as_ref()
    }

    /// Learning rate at scale factor 1.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// Learning rate for the current batch (set at `BATCH_START`; see [`State::set_lr`]).
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Where the run stands.
    pub fn timestamp(&self) -> &Timestamp {
        &self.timestamp
    }

    /// The run's length (after the scale-schedule ratio).
    pub fn max_duration(&self) -> Time {
        self.max_duration
    }

    /// Multiplier applied to `max_duration` and to schedule milestones.
    pub fn scale_schedule_ratio(&self) -> f64 {
        self.scale_schedule_ratio
    }

    /// Batches in one training epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.batches_per_epoch
    }

    /// Samples in one training epoch (for this rank).
    pub fn samples_per_epoch(&self) -> u64 {
        self.samples_per_epoch
    }

    /// Samples in a full training batch over the ranks whose batches the timestamp counts.
    pub fn global_batch_size(&self) -> u64 {
        self.global_batch_size
    }

    /// The current batch: the full batch from `AFTER_DATALOADER` to `BATCH_END`, except
    /// between `BEFORE_FORWARD` and `AFTER_BACKWARD`, where it is the current microbatch.
    pub fn batch(&self) -> Option<&BatchOf<S>> {
        self.batch.as_ref()
    }

    /// Output of the model on the current microbatch (`AFTER_FORWARD` to `AFTER_BACKWARD`).
    pub fn outputs(&self) -> Option<&OutputOf<S>> {
        self.outputs.as_ref()
    }

    /// Loss of the current microbatch (`AFTER_LOSS` to `BEFORE_BACKWARD`), unscaled.
    pub fn loss(&self) -> Option<&Tensor<S::Backend, 1>> {
        self.loss.as_ref()
    }

    /// Loss of the last full batch, read back to the host (set before `AFTER_TRAIN_BATCH`);
    /// in a data-parallel run, the mean over every rank's batch.
    pub fn loss_value(&self) -> Option<f64> {
        self.loss_value
    }

    /// Gradients: of the current microbatch at `AFTER_BACKWARD`, of the whole batch at
    /// `AFTER_TRAIN_BATCH` (averaged over the ranks of a data-parallel run).
    pub fn grads(&self) -> Option<&GradientsParams> {
        self.grads.as_ref()
    }

    /// Latest evaluation results: evaluator label, then metric name, then value.
    pub fn eval_metrics(&self) -> &BTreeMap<String, BTreeMap<String, f64>> {
        &self.eval_metrics
    }

    /// Value of `timestamp.batch` at the last evaluation, if any ran.
    pub fn last_eval_batch(&self) -> Option<u64> {
        self.last_eval_batch
    }

    /// Labels of the evaluators that ran in the current (or last) round of `EVAL_*` events,
    /// in order: their entries in `eval_metrics` are fresh, the others' are older.
    pub fn evaluated(&self) -> &[String] {
        &self.evaluated
    }

    /// Saved states of every algorithm and callback, keyed `algorithm/<name>` and
    /// `callback/<name>`; filled just before `BATCH_CHECKPOINT`, `EPOCH_CHECKPOINT` and
    /// `FIT_END` when a callback asks for them (`Callback::needs_component_states`).
    pub fn component_states(&self) -> &BTreeMap<String, serde_json::Value> {
        &self.component_states
    }

    /// Batches whose loss was not finite and were skipped (when skipping is enabled).
    pub fn skipped_batches(&self) -> u64 {
        self.skipped_batches
    }

    /// The run's floating-point setup (see [`crate::precision`]).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Dynamic loss scaling (float16 runs only).
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.loss_scaler.as_ref()
    }

    /// The microbatch size automatic microbatching has settled on, if it had to.
    pub fn auto_microbatch_size(&self) -> Option<usize> {
        self.auto_microbatch_size
    }

    /// Which attempt at the current batch this is: 0, or more when automatic microbatching
    /// retried the batch in smaller microbatches.
    pub fn batch_attempt(&self) -> u32 {
        self.batch_attempt
    }

    /// Rank and world size.
    pub fn world(&self) -> World {
        self.world
    }

    /// The run's seed; all randomness derives from it (see [`State::rng`]).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The device the model trains on.
    pub fn device(&self) -> &DeviceOf<S> {
        &self.device
    }

    /// The event being run, if any.
    pub fn event(&self) -> Option<Event> {
        self.event
    }

    /// Whether a callback asked for a checkpoint at this batch ([`Control::request_checkpoint`](crate::callback::Control::request_checkpoint)).
    pub fn checkpoint_requested(&self) -> bool {
        self.checkpoint_requested
    }
}

/// The model, the collective and the shard plan (see [`State::model_and_collective`]).
pub(crate) type GradientSeam<'a, S> = (
    &'a <S as Setup>::Model,
    Option<&'a mut Box<dyn Collective<S>>>,
    Option<&'a ShardPlan>,
);

/// What an algorithm may change, each in its window of events (see [`State`]).
impl<S: Setup> State<S> {
    /// An error unless the event being run is in `window`.
    fn check_window(&self, what: &'static str, window: (&[Event], &'static str)) -> Result<()> {
        match self.event {
            Some(e) if window.0.contains(&e) => Ok(()),
            event => Err(CoreError::OutsideWindow {
                what,
                event: event.map_or("no event", Event::name),
                window: window.1,
            }),
        }
    }

    /// The current batch (the microbatch from `BEFORE_FORWARD`), to change: from
    /// `AFTER_DATALOADER` to `AFTER_LOSS`. `None` where there is none at this event.
    pub fn batch_mut(&mut self) -> Result<Option<&mut BatchOf<S>>> {
        self.check_window("the batch", BATCH_WINDOW)?;
        Ok(self.batch.as_mut())
    }

    /// Replaces the current batch by a function of it (selective backprop's subset,
    /// sequence-length warmup's truncation), in the same window as [`State::batch_mut`].
    /// Nothing happens where there is no batch.
    pub fn map_batch(&mut self, f: impl FnOnce(BatchOf<S>) -> Result<BatchOf<S>>) -> Result<()> {
        self.check_window("the batch", BATCH_WINDOW)?;
        if let Some(batch) = self.batch.take() {
            self.batch = Some(f(batch)?);
        }
        Ok(())
    }

    /// The current microbatch's loss, to change: at `AFTER_LOSS` and `BEFORE_BACKWARD`
    /// (MixUp's interpolated loss). `None` where there is none.
    pub fn loss_mut(&mut self) -> Result<Option<&mut Tensor<S::Backend, 1>>> {
        self.check_window("the loss", LOSS_WINDOW)?;
        Ok(self.loss.as_mut())
    }

    /// The gradients, to change: at `AFTER_BACKWARD` (the microbatch's) and
    /// `AFTER_TRAIN_BATCH` (the batch's, before the optimizer step: gradient clipping).
    /// `None` where there are none (a skipped step).
    pub fn grads_mut(&mut self) -> Result<Option<&mut GradientsParams>> {
        self.check_window("the gradients", GRADS_WINDOW)?;
        Ok(self.grads.as_mut())
    }

    /// Sets the learning rate of the current batch's step: from `BATCH_START` (where the
    /// trainer sets the schedule's) to `AFTER_TRAIN_BATCH`.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.check_window("the learning rate", LR_WINDOW)?;
        self.lr = lr;
        Ok(())
    }

    /// The batch to change and the model's outputs on it to read, in the batch's window (the
    /// target rewriters build their distributions from both at `BEFORE_LOSS`).
    pub fn batch_and_outputs_mut(&mut self) -> Result<BatchAndOutputs<'_, S>> {
        self.check_window("the batch", BATCH_WINDOW)?;
        Ok((self.batch.as_mut(), self.outputs.as_ref()))
    }

    /// The model and the gradients together, the model read-only and the gradients to
    /// change, in the gradients' window (gradient clipping reads the parameters' norms).
    pub fn model_and_grads_mut(&mut self) -> Result<(&S::Model, Option<&mut GradientsParams>)> {
        self.check_window("the gradients", GRADS_WINDOW)?;
        let model = present(&self.model);
        Ok((model, self.grads.as_mut()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callback::{Algorithm, Callback, Control};
    use crate::logger::Logger;
    use crate::toy;

    type B = burn::backend::Autodiff<burn::backend::Flex>;

    /// Changes the learning rate (and reads the batch to change) at one event.
    struct Poke(Event);

    impl<S: Setup> Algorithm<S> for Poke {
        fn name(&self) -> &str {
            "poke"
        }
        fn matches(&self, event: Event, _state: &State<S>) -> bool {
            event == self.0
        }
        fn apply(
            &mut self,
            _event: Event,
            state: &mut State<S>,
            _logger: &mut Logger,
        ) -> Result<()> {
            state.set_lr(0.0)?;
            state.batch_mut()?;
            Ok(())
        }
    }

    fn fit_with(poke: Poke) -> Result<u64> {
        let mut t = toy::trainer::<B>(toy::points(8, 4), Time::Batch(2))
            .algorithm(poke)
            .build()?;
        Ok(t.fit()?.steps)
    }

    #[test]
    fn the_mutators_work_in_their_windows_and_name_them_outside() {
        // BATCH_START is in both windows.
        assert_eq!(fit_with(Poke(Event::BatchStart)).unwrap(), 2);
        // The learning rate of a step is set before it, not after.
        let e = fit_with(Poke(Event::BatchEnd)).unwrap_err().to_string();
        assert!(
            e.contains("the learning rate may be changed from BATCH_START to AFTER_TRAIN_BATCH")
                && e.contains("not at BATCH_END"),
            "{e}"
        );
        // The batch after the loss was computed: too late to change what trained.
        let e = fit_with(Poke(Event::AfterTrainBatch))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the batch may be changed from AFTER_DATALOADER to AFTER_LOSS")
                && e.contains("AFTER_TRAIN_BATCH"),
            "{e}"
        );
    }

    /// Asks for a stop and a checkpoint at the end of the second batch.
    struct Ask;

    impl<S: Setup> Callback<S> for Ask {
        fn name(&self) -> &str {
            "ask"
        }
        fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
            // At BATCH_END the timestamp counts the batch just trained.
            if state.timestamp().batch == 2 {
                ctl.request_checkpoint();
                ctl.request_stop("asked");
                ctl.request_stop("asked again");
            }
            Ok(())
        }
    }

    /// What the state said at one BATCH_CHECKPOINT: batch, checkpoint asked, stop asked.
    type Said = (u64, bool, Option<String>);

    /// Records what the state says at BATCH_CHECKPOINT.
    struct Seen(std::sync::Arc<std::sync::Mutex<Vec<Said>>>);

    impl<S: Setup> Callback<S> for Seen {
        fn name(&self) -> &str {
            "seen"
        }
        fn batch_checkpoint(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
            self.0.lock().unwrap().push((
                state.timestamp().batch,
                state.checkpoint_requested(),
                state.stop_requested().map(String::from),
            ));
            Ok(())
        }
    }

    #[test]
    fn a_callbacks_requests_reach_the_state_for_the_callbacks_after_it() {
        let seen = std::sync::Arc::default();
        let mut t = toy::trainer::<B>(toy::points(16, 4), Time::Batch(4))
            .callback(Ask)
            .callback(Seen(std::sync::Arc::clone(&seen)))
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        assert_eq!(
            report.stopped.as_deref(),
            Some("asked"),
            "the first request wins"
        );
        assert_eq!(
            *seen.lock().unwrap(),
            [(1, false, None), (2, true, Some("asked".to_string()))],
            "the request is seen at its batch's checkpoint event, and the run stops after it"
        );
    }
}
