//! [`FitReport`]: what one call to `fit` did, returned to the caller. Data only.

use std::time::Duration;

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
    /// Reads of device data to the host the trainer's batches made (one per batch: the
    /// losses, with the overflow check of loss scaling), not counting those of a collective,
    /// algorithms, callbacks or evaluation: the synchronisations the training step itself
    /// costs a GPU's pipeline.
    pub device_reads: u64,
    /// Why training stopped before `max_duration`, if a stop was requested.
    pub stopped: Option<String>,
}
