//! One training batch, in four named phases, each firing its events in the order
//! `crate::event` states. The step's concerns other than events are each in a file of their
//! own, called here at fixed points: precision and loss scaling (`scaling.rs`: the loss
//! before `backward`, the gradients before the optimizer, the scale after the step, the
//! optimizer step in float32), gradient synchronisation (`sync.rs`: what every rank steps
//! with) and automatic microbatching's retry (`retry.rs`: the out-of-memory checks around an
//! attempt and the set-up of the next one).
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

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;

use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::model::{Batch, TrainModel};
use crate::params::seed_backend;
use crate::rng::derive_seed;
use crate::schedule::ScheduleContext;
use crate::setup::{BatchOf, Setup};
use crate::state::State;

use super::scaling;
use super::sync::{self, Accumulated, Synced};
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

/// One attempt at a batch: its gradients, its microbatch losses as read (with the overflow
/// flag last when `checked`).
struct Attempted {
    grads: Option<GradientsParams>,
    values: Vec<f64>,
    checked: bool,
    /// The batch's scored tokens, when microbatches and ranks are weighed by them (and the
    /// count was needed: a split batch, or a data-parallel run).
    loss_tokens: Option<u64>,
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
            loss_tokens,
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
                loss_tokens,
            },
            finite,
        )?;
        self.end_batch(n as u64, tokens, started.elapsed())?;
        Ok(stepped)
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
        // By tokens: each microbatch's count of scored tokens (padding left out), read
        // before any runs; needed to weigh the microbatches of a split batch, and the rank in
        // a data-parallel run.
        let ranks = self.state.world().size > 1;
        let counts: Option<Vec<u64>> = (self.accumulate_on_tokens && (split.is_some() || ranks))
            .then(|| microbatches.iter().map(Batch::num_loss_tokens).collect());
        let loss_tokens = counts.as_ref().map(|c| c.iter().sum::<u64>());
        let mut accumulator = GradientsAccumulator::<S::Model>::new();
        let mut losses = Vec::with_capacity(microbatches.len());
        for (i, mb) in microbatches.into_iter().enumerate() {
            // Each microbatch's loss is weighted by its share of the batch (of its samples,
            // or of its scored tokens), so that the summed gradient equals the full batch's.
            let weight = split.map(|_| match (&counts, loss_tokens) {
                (Some(c), Some(total)) if total > 0 => c[i] as f64 / total as f64,
                // A batch of padding alone: nothing is scored, nothing weighs.
                (Some(_), _) => 0.0,
                (None, _) => mb.len() as f64 / n as f64,
            });
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
        // half precisions; a float32 run gets them as they are).
        let (grads, overflow) = match grads {
            Some(g) => {
                let state = &self.state;
                let (g, flag) = scaling::optimizer_gradients(
                    state.precision,
                    state.model(),
                    g,
                    state.loss_scaler.as_ref(),
                );
                (Some(g), flag)
            }
            None => (None, None),
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
            loss_tokens,
        })
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
    pub(super) fn seed_batch(&self) {
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
        let (loss, value) = scaling::backward_loss(loss, weight, state.loss_scaler.as_ref());
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
        // Ranks weigh by their samples, or by their scored tokens (`accumulate_on_tokens`).
        let samples = match local.loss_tokens {
            Some(tokens) => tokens,
            None => self.state.batch.as_ref().map_or(0, |b| b.len() as u64),
        };
        let (model, collective, plan) = self.state.model_and_collective();
        let Synced {
            grads,
            loss,
            skipped,
            keep,
        } = sync::synchronise(collective, plan, model, local, finite, samples, batch)?;
        let state = &mut self.state;
        state.grads = grads;
        state.shard_keep = keep;
        state.loss_value = loss;
        state.algorithm_overflow = false;
        self.engine.run(Event::AfterTrainBatch, state)?;
        // Gradients an algorithm computed itself at the event (SAM's second pass) may have
        // overflowed too (`State::replace_gradients`); the scaler learns of it here, once per
        // step, as PyTorch's `GradScaler.update` does after every backward pass of a step.
        let overflowed_later = std::mem::take(&mut state.algorithm_overflow);
        let settled = scaling::after_step(
            state.loss_scaler.as_mut(),
            skipped,
            finite,
            overflowed_later,
            batch,
        );
        state.skipped_batches += u64::from(settled.skipped_for_loss);
        if let Some(line) = settled.log {
            let ts = state.timestamp.clone();
            self.engine.logger().log_text(&ts, "loss_scaling", &line)?;
        }
        // Sharded: the ranks agreed on skipping, so each takes part in the all-gather of the
        // updated parameters exactly when every other does (a rank that owns nothing still
        // steps, with no gradients, and gathers).
        let gather = state.sharding.is_some() && !skipped;
        let Some(grads) = state.grads.take() else {
            if gather {
                self.state.gather_shards()?;
            }
            return Ok(false);
        };
        let lr = state.lr;
        // Invariant: the model is only taken out here, between events.
        let model = state
            .model
            .take()
            .expect("model is present outside the optimizer step");
        let model =
            scaling::step_in_precision(&mut state.optimizer, state.precision, lr, model, grads);
        state.model = Some(model);
        if gather {
            self.state.gather_shards()?;
        }
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
