//! Monitors: callbacks that measure a run and log what they measure through the run's loggers
//! (so every logger, console to TensorBoard, sees the same numbers). None changes training.
//!
//! | monitor | logs | when |
//! | --- | --- | --- |
//! | [`LrMonitor`] | `lr/group0` | every batch |
//! | [`SpeedMonitor`] | `throughput/{batches,samples,tokens}_per_sec`, `time/batch_seconds`, `throughput/flops_per_sec`, `throughput/mfu` | every batch, over a window |
//! | [`RuntimeEstimator`] | `time/elapsed_seconds`, `time/remaining_estimate_seconds` | every batch |
//! | [`MemoryMonitor`] | `memory/rss_bytes`, `memory/peak_rss_bytes`, `memory/device_*` | every `interval` |
//! | [`NormMonitor`] | `l2_norm/{grad,param}/global`, `l2_norm/{grad,param}/<layer>` | every `interval` |
//! | [`NanMonitor`] | nothing; stops the run with an error naming the batch | every microbatch / batch |
//!
//! Values are logged at `BATCH_END`, with the timestamp of the batch just finished (the same
//! step as the trainer's own `train/loss`).

mod lr;
mod memory;
mod nan;
mod norms;
mod speed;

pub use lr::LrMonitor;
pub use memory::{process_memory, DeviceMemory, MemoryMonitor};
pub use nan::NanMonitor;
pub use norms::{norms_by_layer, NormMonitor};
pub use speed::{RuntimeEstimator, SpeedMonitor};

use flashover_core::time::{Time, TimeUnit};

use crate::error::{CallbackError, Result};

/// Checks an interval for a monitor: a time greater than zero, in batches or epochs.
pub(crate) fn batch_interval(component: &'static str, every: Time) -> Result<Time> {
    match every.unit() {
        TimeUnit::Batch | TimeUnit::Epoch if !every.is_zero() => Ok(every),
        _ => Err(CallbackError::param(
            component,
            "interval",
            every,
            "a time greater than zero in batches or epochs (`10ba`, `1ep`)",
        )),
    }
}

/// Whether the batch that just ended falls on `every`: `batch` batches done in all,
/// `batch_in_epoch` of them in epoch `epoch` (counted from 0, not yet advanced).
pub(crate) fn due(
    every: Time,
    batch: u64,
    epoch: u64,
    batch_in_epoch: u64,
    batches_per_epoch: u64,
) -> bool {
    match every {
        Time::Batch(n) => batch.is_multiple_of(n),
        // The last batch of every n-th epoch.
        Time::Epoch(n) => batch_in_epoch == batches_per_epoch && (epoch + 1).is_multiple_of(n),
        _ => false,
    }
}
