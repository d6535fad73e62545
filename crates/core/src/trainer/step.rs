//! One training batch, in four named phases, each firing its events in the order
//! `crate::event` states:
//! - [`begin`](Trainer::begin_batch): the backend seed and learning rate of the batch,
//!   `BATCH_START`, `BEFORE_TRAIN_BATCH`;
//! - [`microbatch`](Trainer::microbatch): forward, loss and backward of one microbatch with
//!   their six events; then one read of every microbatch's loss and the non-finite-loss
//!   policy ([`loss_policy`](Trainer::loss_policy));
//! - [`step`](Trainer::step): the gradient-synchronisation point of a data-parallel run,
//!   `AFTER_TRAIN_BATCH` (clipping, SAM), the optimizer step;
//! - [`end`](Trainer::end_batch): the timestamp, `BATCH_END`, the batch's log line, due
//!   evaluations, `BATCH_CHECKPOINT`, and the agreement of every rank on a stop request.
//!
//! With no algorithms, callbacks, loggers or collective, a batch here is what a hand-written
//! Burn loop does (forward, loss, backward, optimizer step) plus one read of the loss per
//! optimizer step (for the non-finite check and the logs), after the backward pass is queued,
//! and the bookkeeping of the timestamp.

use std::time::{Duration, Instant};

use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{Backend, DeviceOps};
use burn::tensor::{FloatDType, Tensor};

use crate::collective::LocalStep;
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::memory::{self, RunningStats};
use crate::model::{Batch, TrainModel};
use crate::params::seed_backend;
use crate::precision::Precision;
use crate::precision::{cast_params, cast_to, prepare_gradients, ScaleChange};
use crate::rng::derive_seed;
use crate::schedule::ScheduleContext;
use crate::setup::{BatchOf, Setup};
use crate::state::State;

use super::Trainer;

/// The microbatch losses (each a one-element tensor) as numbers, in one read from the
/// device: several are concatenated there first; one (an unsplit batch, the usual case) is
/// read as it is, without a copy on the training step's path. (The overflow check of loss
/// scaling rides along as one more element.)
fn read_losses<B: burn::tensor::backend::Backend>(mut losses: Vec<Tensor<B, 1>>) -> Vec<f64> {
    let data = match losses.len() {
        0 => return Vec::new(),
        1 => losses.swap_remove(0).into_data(),
        _ => Tensor::cat(losses, 0).into_data(),
    };
    data.iter::<f64>().collect()
}

/// Stream tag for the backend seed set at each batch start.
const BACKEND_STREAM: u64 = 0xB4C4_E4D0;

/// What the microbatches of one batch left for the optimizer step.
struct Accumulated {
    /// The batch's gradients (summed over microbatches); `None` when a loss was not finite.
    grads: Option<GradientsParams>,
    /// The batch's loss (the sum of the weighted microbatch losses).
    loss: f64,
    /// The gradients overflowed under loss scaling (the step is skipped, the scale lowered).
    overflowed: bool,
}

/// One attempt at a batch: its gradients, its microbatch losses as read (with the overflow
/// flag last when `checked`).
struct Attempted {
    grads: Option<GradientsParams>,
    values: Vec<f64>,
    checked: bool,
}

impl<S: Setup> Trainer<S> {
    /// One batch (already in `State::batch`, after `AFTER_DATALOADER`): returns whether an
    /// optimizer step was taken.
    pub(super) fn train_batch(&mut self) -> Result<bool> {
        let started = Instant::now();
        self.begin_batch()?;
        // The full batch leaves the state while its microbatches are there (an algorithm may
        // replace a microbatch); it comes back unchanged for `AFTER_TRAIN_BATCH`.
        let full = take_batch(&mut self.state, Event::BeforeTrainBatch)?;
        let n = full.len();
        let tokens = full.num_tokens();
        // With automatic microbatching, the running statistics a failed attempt must put back.
        let running = match self.auto_microbatching {
            true => Some(self.guard_attempts()?),
            false => None,
        };
        let attempted = loop {
            let size = self.current_microbatch_size();
            let attempted = self.attempt(&full, n, size)?;
            let Some(running) = &running else {
                self.check_allocations(size.unwrap_or(n).min(n))?;
                break attempted;
            };
            if !self.ran_out_of_memory()? {
                break attempted;
            }
            // Everything the failed attempt held goes before the memory is cleaned up.
            drop(attempted);
            self.prepare_retry(running, size.unwrap_or(n).min(n))?;
        };
        let Attempted {
            grads,
            mut values,
            checked,
        } = attempted;
        let overflowed = checked && values.pop().is_some_and(|v| !v.is_finite());
        let (loss, finite) = self.loss_policy(&values)?;
        self.state.batch = Some(full);
        let grads = grads.filter(|_| finite && !overflowed);
        let stepped = self.step(
            Accumulated {
                grads,
                loss,
                overflowed,
            },
            finite,
        )?;
        self.end_batch(n as u64, tokens, started.elapsed())?;
        Ok(stepped)
    }

    /// The microbatch size the next attempt at a batch uses (`None`: the whole batch).
    fn current_microbatch_size(&self) -> Option<usize> {
        match self.auto_microbatching {
            true => self.state.auto_microbatch_size.or(self.microbatch_size),
            false => self.microbatch_size,
        }
    }

    /// Forward, loss and backward of every microbatch of `full` (`n` samples) in microbatches
    /// of `size` (`None` or at least `n`: unsplit), the gradients prepared for the optimizer,
    /// and the batch's one read from the device.
    fn attempt(&mut self, full: &BatchOf<S>, n: usize, size: Option<usize>) -> Result<Attempted> {
        let split = size.filter(|&s| s < n);
        let microbatches = match split {
            Some(size) => full.clone().split(size),
            None => vec![full.clone()],
        };
        let mut accumulator = GradientsAccumulator::<S::Model>::new();
        let mut losses = Vec::with_capacity(microbatches.len());
        for mb in microbatches {
            // Each microbatch's loss is weighted by its share of the batch, so that the
            // summed gradient equals the full batch's.
            let weight = split.map(|_| mb.len() as f64 / n as f64);
            losses.push(self.microbatch(mb, weight)?);
            if split.is_some() {
                if let Some(g) = self.state.grads.take() {
                    accumulator.accumulate(self.state.model(), g);
                }
            }
        }
        let grads = match split {
            Some(_) => Some(accumulator.grads()),
            None => self.state.grads.take(),
        };
        // Float32 gradients for the optimizer, unscaled, with their overflow check (the
        // half precisions; a float32 run skips this).
        let scaler = self.state.loss_scaler;
        let (grads, overflow) = match grads {
            Some(g) if self.state.precision != Precision::Fp32 => {
                let (g, flag) = prepare_gradients::<S::Backend, S::Model>(
                    self.state.model(),
                    g,
                    scaler.map(|s| 1.0 / s.scale),
                    scaler.is_some(),
                );
                (Some(g), flag)
            }
            g => (g, None),
        };
        let checked = overflow.is_some();
        if let Some(flag) = overflow {
            losses.push(Tensor::from_inner(flag));
        }
        // The batch's one read from the device: every microbatch's loss at once (and the
        // overflow check), after the last backward pass was queued (a read per microbatch,
        // between its forward and backward, stalled a GPU's pipeline there).
        let values = read_losses(losses);
        self.device_reads += 1;
        Ok(Attempted {
            grads,
            values,
            checked,
        })
    }

    /// Automatic microbatching, before a batch's first attempt: the device is synchronised, so
    /// that an error of earlier work (the previous optimizer step, the batch's data and
    /// augmentations) is not taken for one of the attempt (smaller microbatches would not
    /// help there); returns the running statistics to restore after a failed attempt.
    fn guard_attempts(&mut self) -> Result<RunningStats<S::Backend>> {
        let synced = S::Backend::sync(&self.state.device);
        let failures = memory::allocation_failures(self.state.device.id());
        let ts = &self.state.timestamp;
        let before = std::mem::replace(&mut self.failures_seen, failures);
        if failures > before {
            return Err(CoreError::OutOfMemory {
                epoch: ts.epoch,
                batch: ts.batch,
                during: "before the batch's forward pass".into(),
                reason: "the previous optimizer step, or the batch's data or augmentations, did not fit, and smaller microbatches do not help there: use a smaller batch, model or precision".into(),
            });
        }
        if let Err(e) = synced {
            return Err(CoreError::Device {
                epoch: ts.epoch,
                batch: ts.batch,
                message: e.to_string(),
            });
        }
        Ok(RunningStats::take(self.state.model()))
    }

    /// Automatic microbatching, after an attempt's read: whether the device ran out of memory
    /// during the attempt (on any rank of a data-parallel run, so that every rank retries
    /// together); any other device error is an error of the run.
    ///
    /// The allocation-failure count decides, not the sync's result: a kernel that meets the
    /// unbound handle of a failed allocation records an error only when the handle's memory
    /// slot is vacant; when another tensor occupies it, CubeCL panics on the device thread
    /// (an assertion) and the sync succeeds. The sync makes sure every queued task (and so
    /// every allocation) has run.
    fn ran_out_of_memory(&mut self) -> Result<bool> {
        let synced = S::Backend::sync(&self.state.device);
        let failures = memory::allocation_failures(self.state.device.id());
        let mut oom = failures > self.failures_seen;
        self.failures_seen = failures;
        if let (Err(e), false) = (synced, oom) {
            let ts = &self.state.timestamp;
            return Err(CoreError::Device {
                epoch: ts.epoch,
                batch: ts.batch,
                message: e.to_string(),
            });
        }
        if let Some(c) = self.state.collective.as_mut() {
            let mut flag = [f64::from(u8::from(oom))];
            c.all_reduce_sum_host(&mut flag)?;
            oom = flag[0] > 0.0;
        }
        Ok(oom)
    }

    /// Without automatic microbatching: an error when device allocations failed since the
    /// last check (see [`crate::memory`]; the batch's tensors would be unbound buffers, and
    /// reads of them return whatever the memory held). Costs no synchronisation, so a failure
    /// in work still queued after the read (the last backward pass) is caught at the next
    /// batch.
    fn check_allocations(&mut self, size: usize) -> Result<()> {
        let failures = memory::allocation_failures(self.state.device.id());
        if failures <= self.failures_seen {
            return Ok(());
        }
        self.failures_seen = failures;
        let ts = &self.state.timestamp;
        Err(CoreError::OutOfMemory {
            epoch: ts.epoch,
            batch: ts.batch,
            during: format!("in microbatches of {size} samples"),
            reason: "device allocations failed; use automatic microbatching (`--microbatch-size auto`, `TrainerBuilder::auto_microbatching`) or a smaller microbatch size".into(),
        })
    }

    /// After an attempt at microbatches of `size` ran out of memory: halves the size (an
    /// error below 1), puts back the running statistics the attempt changed, frees its memory
    /// and sets up the same random draws for the next attempt.
    fn prepare_retry(&mut self, running: &RunningStats<S::Backend>, size: usize) -> Result<()> {
        let ts = self.state.timestamp.clone();
        if size <= 1 {
            return Err(CoreError::OutOfMemory {
                epoch: ts.epoch,
                batch: ts.batch,
                during: "in microbatches of 1 sample".into(),
                reason: "automatic microbatching cannot split further: use a smaller model, sequence or image size, or a half precision".into(),
            });
        }
        let next = size / 2;
        let state = &mut self.state;
        state.batch = None;
        state.outputs = None;
        state.loss = None;
        state.grads = None;
        state.loss_value = None;
        // Invariant: the model is only taken out here, between events.
        let model = state
            .model
            .take()
            .expect("model is present between attempts at a batch");
        state.model = Some(running.restore(model));
        S::Backend::memory_cleanup(&state.device);
        if let Err(e) = S::Backend::sync(&state.device) {
            return Err(CoreError::Device {
                epoch: ts.epoch,
                batch: ts.batch,
                message: format!("after freeing a batch that ran out of memory: {e}"),
            });
        }
        state.batch_attempt += 1;
        state.auto_microbatch_size = Some(next);
        self.seed_batch();
        tracing::warn!(
            epoch = ts.epoch,
            batch = ts.batch,
            from = size,
            to = next,
            "out of memory: retrying the batch in smaller microbatches"
        );
        self.engine.logger().log_text(
            &ts,
            "auto_microbatching",
            &format!(
                "batch {}: out of device memory in microbatches of {size}; retried in microbatches of {next}",
                ts.batch
            ),
        )?;
        Ok(())
    }

    /// Seeds the backend for the batch, sets its learning rate, runs `BATCH_START` and
    /// `BEFORE_TRAIN_BATCH`.
    fn begin_batch(&mut self) -> Result<()> {
        self.state.batch_attempt = 0;
        self.seed_batch();
        let state = &mut self.state;
        let ts = &state.timestamp;
        let ctx = ScheduleContext {
            batch: ts.batch as f64,
            progress: state.progress(),
            scale_schedule_ratio: state.scale_schedule_ratio,
        };
        state.lr = state.base_lr * state.scheduler.factor(&ctx);
        state.loss_value = None;
        self.engine.run(Event::BatchStart, state)?;
        self.engine.run(Event::BeforeTrainBatch, state)
    }

    /// Seeds the backend with the batch's seed (at its start, and again for each retry).
    fn seed_batch(&self) {
        let state = &self.state;
        let ts = &state.timestamp;
        seed_backend::<S::Backend>(
            &state.device,
            derive_seed(&[
                state.seed,
                state.world.rank as u64,
                ts.epoch,
                ts.batch_in_epoch,
                BACKEND_STREAM,
            ]),
        );
    }

    /// The non-finite-loss policy on the batch's microbatch losses (weighted, in order):
    /// their sum and `true` when all are finite; with a NaN or an infinity, the error
    /// [`CoreError::NonFiniteLoss`] naming the first such value, or (`skip_nonfinite_loss`) a
    /// warning and `false`: the batch is skipped, no optimizer step.
    fn loss_policy(&self, values: &[f64]) -> Result<(f64, bool)> {
        let Some(&value) = values.iter().find(|v| !v.is_finite()) else {
            return Ok((values.iter().sum(), true));
        };
        let ts = &self.state.timestamp;
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
        Ok((value, false))
    }

    /// Forward, loss and backward of one microbatch, weighted by `weight` (its share of the
    /// batch, when the batch is split); leaves its gradients in `State::grads` and returns its
    /// weighted loss, still on the device (the batch reads every microbatch's at once; a
    /// non-finite one discards the batch's gradients then).
    fn microbatch(&mut self, mb: BatchOf<S>, weight: Option<f64>) -> Result<Tensor<S::Backend, 1>> {
        let state = &mut self.state;
        let engine = &mut self.engine;
        state.batch = Some(mb);
        engine.run(Event::BeforeForward, state)?;
        let batch = state
            .batch
            .as_ref()
            .ok_or_else(|| missing("batch", Event::BeforeForward))?;
        let output = state.model().forward(batch);
        state.outputs = Some(output);
        engine.run(Event::AfterForward, state)?;
        engine.run(Event::BeforeLoss, state)?;
        let batch = state
            .batch
            .as_ref()
            .ok_or_else(|| missing("batch", Event::BeforeLoss))?;
        let output = state
            .outputs
            .as_ref()
            .ok_or_else(|| missing("outputs", Event::BeforeLoss))?;
        let loss = state.model().loss(output, batch);
        state.loss = Some(loss);
        engine.run(Event::AfterLoss, state)?;
        engine.run(Event::BeforeBackward, state)?;
        let loss = state
            .loss
            .take()
            .ok_or_else(|| missing("loss", Event::BeforeBackward))?;
        // A model in a half precision may return its loss in the half type: the loss (and
        // its scaling) is float32 from here.
        let loss = cast_to(loss, FloatDType::F32);
        let loss = match weight {
            Some(w) => loss.mul_scalar(w),
            None => loss,
        };
        let value = loss.clone().detach();
        let loss = match state.loss_scaler {
            Some(s) => loss.mul_scalar(s.scale),
            None => loss,
        };
        let grads = GradientsParams::from_grads(loss.backward(), state.model());
        state.grads = Some(grads);
        engine.run(Event::AfterBackward, state)?;
        state.outputs = None;
        Ok(value)
    }

    /// The gradient-synchronisation point (a data-parallel run averages gradients and loss
    /// over every rank here), `AFTER_TRAIN_BATCH`, then the optimizer step. Returns whether
    /// the optimizer stepped.
    fn step(&mut self, local: Accumulated, finite: bool) -> Result<bool> {
        let batch = self.state.timestamp.batch;
        let samples = self.state.batch.as_ref().map_or(0, |b| b.len() as u64);
        let (model, collective) = self.state.model_and_collective();
        let overflowed = local.overflowed;
        let (grads, loss, skipped) = match collective {
            None => (
                local.grads,
                finite.then_some(local.loss),
                !finite || overflowed,
            ),
            Some(c) => {
                // An overflowed rank skips like a rank with a non-finite loss, so that every
                // rank skips the step (and lowers its scale) together.
                let local = LocalStep {
                    grads: local.grads,
                    loss: local.loss,
                    finite: finite && !overflowed,
                    samples,
                };
                let global = c.sync_gradients(model, local)?;
                if finite && global.skipped_ranks > 0 {
                    tracing::warn!(
                        ranks = global.skipped_ranks,
                        batch,
                        "skipping batch: another rank's loss was not finite"
                    );
                }
                (global.grads, global.loss, global.skipped_ranks > 0)
            }
        };
        let state = &mut self.state;
        state.grads = grads;
        state.loss_value = loss;
        state.algorithm_overflow = false;
        self.engine.run(Event::AfterTrainBatch, state)?;
        // Gradients an algorithm computed itself at the event (SAM's second pass) may have
        // overflowed too (`State::replace_gradients`); the scaler learns of it here, once per
        // step, as PyTorch's `GradScaler.update` does after every backward pass of a step.
        let overflowed_later = std::mem::take(&mut state.algorithm_overflow);
        // Under loss scaling a skipped step lowers the scale on every rank (a non-finite loss
        // anywhere would also have overflowed the gradients); otherwise it counts as a batch
        // skipped for its loss.
        match state.loss_scaler.as_mut() {
            Some(scaler) => {
                let scale = scaler.scale;
                if let ScaleChange::BackedOff(to) = scaler.update(skipped || overflowed_later) {
                    tracing::warn!(
                        batch,
                        from = scale,
                        to,
                        "loss scaling: gradients overflowed in float16, step skipped, scale lowered"
                    );
                    let ts = state.timestamp.clone();
                    self.engine.logger().log_text(
                        &ts,
                        "loss_scaling",
                        &format!(
                            "batch {batch}: gradients overflowed, step skipped; loss scale {scale} -> {to}"
                        ),
                    )?;
                }
                if skipped && !finite {
                    state.skipped_batches += 1;
                }
            }
            None if skipped => state.skipped_batches += 1,
            None => {}
        }
        let Some(grads) = state.grads.take() else {
            return Ok(false);
        };
        let lr = state.lr;
        // Invariant: the model is only taken out here, between events.
        let model = state
            .model
            .take()
            .expect("model is present outside the optimizer step");
        // The pure half precisions step in float32 (the optimizer's moments are float32, see
        // `crate::precision`) and round the new weights to the half type.
        let stored = state.precision.parameter_dtype();
        let model = if stored == FloatDType::F32 {
            state.optimizer.step(lr, model, grads)
        } else {
            // Float32 gradients also where an algorithm put its own at `AFTER_TRAIN_BATCH`
            // in the model's half type without `State::replace_gradients`.
            let (grads, _) = prepare_gradients::<S::Backend, S::Model>(&model, grads, None, false);
            let model = cast_params::<S::Backend, S::Model>(model, FloatDType::F32);
            let model = state.optimizer.step(lr, model, grads);
            cast_params::<S::Backend, S::Model>(model, stored)
        };
        state.model = Some(model);
        Ok(true)
    }

    /// Records the batch in the timestamp, runs `BATCH_END`, logs the batch, runs the
    /// evaluations that are due and `BATCH_CHECKPOINT`, then makes every rank agree on
    /// whether to stop.
    fn end_batch(&mut self, samples: u64, tokens: u64, wall: Duration) -> Result<()> {
        let before = self.state.timestamp.clone();
        let (samples, tokens) = self.agree_progress(samples, tokens)?;
        self.state.timestamp.advance_batch(samples, tokens, wall);
        self.engine.run(Event::BatchEnd, &mut self.state)?;
        if !self.engine.logger().is_empty() {
            let ts = self.state.timestamp.clone();
            let mut values = vec![("train/lr", self.state.lr)];
            if let Some(l) = self.state.loss_value {
                values.push(("train/loss", l));
            }
            if self.auto_microbatching {
                let n = self.state.batch.as_ref().map_or(0, |b| b.len());
                let size = self.current_microbatch_size().map_or(n, |s| s.min(n));
                values.push(("train/microbatch_size", size as f64));
            }
            if let Some(s) = &self.state.loss_scaler {
                values.push(("train/loss_scale", s.scale));
                values.push(("train/skipped_steps", s.skipped_steps as f64));
            }
            self.engine.logger().log_metrics(&ts, &values)?;
        }
        if self
            .evaluators
            .iter()
            .any(|e| self.batch_eval_due(e, &before))
        {
            self.run_evaluators(|t, e| t.batch_eval_due(e, &before))?;
            // The checkpoint that may follow counts the evaluation's time.
            self.agree_progress(0, 0)?;
        }
        self.engine.run(Event::BatchCheckpoint, &mut self.state)?;
        // A checkpoint asked for at this batch was taken (or the run has no saver).
        self.state.checkpoint_requested = false;
        self.state.batch = None;
        self.agree_on_stop()
    }

    /// In a data-parallel run, stops every rank when any rank asked to stop.
    pub(super) fn agree_on_stop(&mut self) -> Result<()> {
        let Some(c) = self.state.collective.as_mut() else {
            return Ok(());
        };
        if let Some(rank) = c.any_stop(self.state.stop_reason.is_some())? {
            if self.state.stop_reason.is_none() {
                self.state.stop_reason = Some(format!("rank {rank} asked to stop"));
            }
        }
        Ok(())
    }
}

fn missing(what: &str, event: Event) -> CoreError {
    CoreError::Component {
        component: "trainer".into(),
        event: event.name(),
        message: format!("the state's {what} was removed by an algorithm or callback"),
    }
}

fn take_batch<S: Setup>(state: &mut State<S>, event: Event) -> Result<BatchOf<S>> {
    state.batch.take().ok_or_else(|| missing("batch", event))
}
