//! Automatic microbatching's side of the training step, apart from the step itself: the
//! microbatch size an attempt at a batch uses, the checks around an attempt that tell an
//! out-of-memory failure from other device errors, and the set-up of a retry in microbatches
//! of half the size that draws what a run started at that size draws. Without automatic
//! microbatching, only [`Trainer::check_allocations`] runs: a failed allocation is an error.

use burn::tensor::backend::{Backend, DeviceOps};

use crate::error::{CoreError, Result};
use crate::memory::{self, RunningStats};
use crate::setup::Setup;

use super::Trainer;

impl<S: Setup> Trainer<S> {
    /// The microbatch size the next attempt at a batch uses (`None`: the whole batch).
    pub(super) fn current_microbatch_size(&self) -> Option<usize> {
        match self.auto_microbatching {
            true => self.state.auto_microbatch_size.or(self.microbatch_size),
            false => self.microbatch_size,
        }
    }

    /// Automatic microbatching, before a batch's first attempt: the device is synchronised, so
    /// that an error of earlier work (the previous optimizer step, the batch's data and
    /// augmentations) is not taken for one of the attempt (smaller microbatches would not
    /// help there); returns the running statistics to restore after a failed attempt.
    pub(super) fn guard_attempts(&mut self) -> Result<RunningStats<S::Backend>> {
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
    pub(super) fn ran_out_of_memory(&mut self) -> Result<bool> {
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
    pub(super) fn check_allocations(&mut self, size: usize) -> Result<()> {
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
    pub(super) fn prepare_retry(
        &mut self,
        running: &RunningStats<S::Backend>,
        size: usize,
    ) -> Result<()> {
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
}
