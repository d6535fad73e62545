//! The trainer state a checkpoint stores as JSON, and how it is taken from and put back into
//! a live [`State`]. Model weights and optimizer moments are separate files (binary, full
//! precision); this file holds everything else that makes a resumed run exact.

use std::collections::BTreeMap;
use std::path::Path;

use flashover_core::precision::{LossScaler, Precision};
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::CheckpointError;

/// Where the sampler stands: the next batch to read is batch `batch_in_epoch` of `epoch`.
/// Redundant with the timestamp on purpose: a loader checks the two agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerPosition {
    /// Epoch of the next batch.
    pub epoch: u64,
    /// Index of the next batch inside that epoch.
    pub batch_in_epoch: u64,
}

/// Contents of `trainer_state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerStateFile {
    /// The timestamp when saved.
    pub timestamp: Timestamp,
    /// The sampler's position.
    pub sampler: SamplerPosition,
    /// The run's seed.
    pub seed: u64,
    /// Rank that saved.
    pub rank: usize,
    /// World size when saved.
    pub world_size: usize,
    /// Base learning rate (informational: the configuration decides).
    pub base_lr: f64,
    /// Learning rate of the last batch (informational: schedules are functions of time).
    pub lr: f64,
    /// `max_duration` when saved (informational).
    pub max_duration: String,
    /// The schedule's description (informational; a different one is logged on resume).
    pub scheduler: String,
    /// Batches skipped for a non-finite loss.
    pub skipped_batches: u64,
    /// The precision the run trained in (`fp32` for checkpoints older than the field). A run
    /// may resume in another precision: its weights are converted to that one's type.
    #[serde(default)]
    pub precision: Precision,
    /// Dynamic loss scaling's state (float16 runs).
    #[serde(default)]
    pub loss_scaler: Option<LossScaler>,
    /// The microbatch size automatic microbatching settled on (`None`: not automatic, not
    /// needed, or a checkpoint older than the field); a resumed automatic run continues at it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_microbatch_size: Option<usize>,
    /// The run's global batch size and batches per epoch when saved (`None` in checkpoints
    /// older than the fields, which are not checked): a run that resumes inside an epoch
    /// must have both, or it would replay or skip samples of the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch_size: Option<u64>,
    /// See [`TrainerStateFile::global_batch_size`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches_per_epoch: Option<u64>,
    /// Batch count at the last evaluation.
    pub last_eval_batch: Option<u64>,
    /// Latest evaluation results (`null` for a metric with no value).
    pub eval_metrics: BTreeMap<String, BTreeMap<String, Option<f64>>>,
    /// Parameter ids by path (optimizer state is keyed by id).
    pub param_ids: BTreeMap<String, u64>,
    /// A sharded run's optimizer state: one file per rank, in rank order (each holds the
    /// state of the parameters that rank owned); `None` when `optimizer.mpk` holds it all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_shards: Option<Vec<String>>,
    /// Saved states of algorithms and callbacks.
    pub components: BTreeMap<String, Value>,
}

impl TrainerStateFile {
    /// Parses `trainer_state.json`'s bytes (`path` names it in errors) and checks what can be
    /// checked without the run: the layout, and that the sampler's position agrees with the
    /// timestamp. Whether the position fits the run's data is the trainer's check.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, CheckpointError> {
        let saved: TrainerStateFile = serde_json::from_slice(bytes)
            .map_err(|e| CheckpointError::damaged(path, format!("unexpected layout: {e}")))?;
        let ts = &saved.timestamp;
        if saved.sampler.epoch != ts.epoch || saved.sampler.batch_in_epoch != ts.batch_in_epoch {
            return Err(CheckpointError::damaged(
                path,
                format!(
                    "sampler position {:?} disagrees with the timestamp ({ts})",
                    saved.sampler
                ),
            ));
        }
        Ok(saved)
    }

    /// Takes everything but weights and optimizer moments from a live state.
    pub fn from_state<S: Setup>(state: &State<S>) -> Self {
        let ts = state.timestamp().clone();
        TrainerStateFile {
            sampler: SamplerPosition {
                epoch: ts.epoch,
                batch_in_epoch: ts.batch_in_epoch,
            },
            timestamp: ts,
            seed: state.seed(),
            rank: state.world().rank,
            world_size: state.world().size,
            base_lr: state.base_lr(),
            lr: state.lr(),
            max_duration: state.max_duration().to_string(),
            scheduler: state.scheduler().describe(),
            skipped_batches: state.skipped_batches(),
            precision: state.precision(),
            loss_scaler: state.loss_scaler().copied(),
            auto_microbatch_size: state.auto_microbatch_size(),
            global_batch_size: Some(state.global_batch_size()),
            batches_per_epoch: Some(state.batches_per_epoch()),
            last_eval_batch: state.last_eval_batch(),
            eval_metrics: state
                .eval_metrics()
                .iter()
                .map(|(k, m)| {
                    (
                        k.clone(),
                        m.iter()
                            .map(|(n, v)| (n.clone(), v.is_finite().then_some(*v)))
                            .collect(),
                    )
                })
                .collect(),
            param_ids: crate::weights::param_ids::<S::Backend, S::Model>(state.model()),
            optimizer_shards: None,
            components: state.component_states().clone(),
        }
    }
}
