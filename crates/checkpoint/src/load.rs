//! Loading: verify first (manifest, sizes, SHA-256), then restore the model, its parameter
//! ids, the optimizer, the timestamp and the rest into a trainer being built. Autoresume finds
//! the newest intact checkpoint in a folder, passing over damaged ones with a warning.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use derive_new::new;
use flashover_core::error::Result as CoreResult;
use flashover_core::restore::Restore;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use serde_json::Value;

use crate::error::CheckpointError;
use crate::format::{
    self, read_manifest, read_verified, verify, Manifest, MODEL, OPTIMIZER, TRAINER_STATE,
};
use crate::state_file::TrainerStateFile;
use crate::weights::{load_weights_bytes, set_param_ids, WeightsLoad, WeightsReport};

/// How to load a checkpoint.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Load model weights only; the run starts fresh from them (new optimizer, time zero).
    pub weights_only: bool,
    /// Strictness and ignored keys for the weights.
    pub weights: WeightsLoad,
}

/// Restores a trainer from a checkpoint directory with load options
/// (`CheckpointRestore::new(dir, options)`); pass it to `TrainerBuilder::restore`.
#[derive(Debug, Clone, new)]
pub struct CheckpointRestore {
    #[new(into)]
    dir: PathBuf,
    options: LoadOptions,
}

impl CheckpointRestore {
    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn restore_into<S: Setup>(
        &self,
        state: &mut State<S>,
    ) -> Result<BTreeMap<String, Value>, CheckpointError> {
        let dir = &self.dir;
        // The manifest is checked first; each file is hashed as it is read, before decoding.
        let manifest: Manifest = read_manifest(dir)?;
        let weights = read_verified(dir, &manifest, MODEL)?;
        let mut failure = None;
        let mut report = WeightsReport::default();
        let path = dir.join(MODEL);
        state.map_model(|model| {
            match load_weights_bytes(model.clone(), weights, &path, &self.options.weights) {
                Ok((loaded, r)) => {
                    report = r;
                    loaded
                }
                Err(e) => {
                    failure = Some(e);
                    model
                }
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        if !report.missing.is_empty() || !report.unexpected.is_empty() || !report.ignored.is_empty()
        {
            tracing::warn!(
                checkpoint = %dir.display(),
                missing = ?report.missing,
                unexpected = ?report.unexpected,
                ignored = ?report.ignored,
                "weights loaded non-strictly"
            );
        }
        if self.options.weights_only {
            tracing::info!(checkpoint = %dir.display(), loaded = report.loaded, "loaded weights only");
            return Ok(BTreeMap::new());
        }
        if manifest.weights_only {
            return Err(CheckpointError::WeightsOnly { path: dir.clone() });
        }
        let trainer_path = dir.join(TRAINER_STATE);
        let saved: TrainerStateFile =
            serde_json::from_slice(&read_verified(dir, &manifest, TRAINER_STATE)?).map_err(
                |e| CheckpointError::damaged(&trainer_path, format!("unexpected layout: {e}")),
            )?;
        let ts = &saved.timestamp;
        if saved.sampler.epoch != ts.epoch || saved.sampler.batch_in_epoch != ts.batch_in_epoch {
            return Err(CheckpointError::damaged(
                &trainer_path,
                format!(
                    "sampler position {:?} disagrees with the timestamp ({ts})",
                    saved.sampler
                ),
            ));
        }
        if saved.world_size != state.world.size {
            return Err(CheckpointError::Config {
                name: "world size",
                value: state.world.size.to_string(),
                expected: format!(
                    "the world size the checkpoint was saved with ({})",
                    saved.world_size
                ),
            });
        }
        // Optimizer state is keyed by parameter id: the model takes the saved ids first.
        let mut missing_ids = Vec::new();
        state.map_model(|model| {
            let (model, missing) = set_param_ids::<S::Backend, S::Model>(model, &saved.param_ids);
            missing_ids = missing;
            model
        });
        if !missing_ids.is_empty() && !self.options.weights.non_strict {
            return Err(CheckpointError::damaged(
                &trainer_path,
                format!("no parameter ids for {missing_ids:?}"),
            ));
        }
        let optimizer_path = dir.join(OPTIMIZER);
        let bytes = read_verified(dir, &manifest, OPTIMIZER)?;
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let record = Recorder::<S::Backend>::load::<
            <S::Optimizer as Optimizer<S::Model, S::Backend>>::Record,
        >(&recorder, bytes, &state.device)
        .map_err(|e| CheckpointError::Format {
            path: optimizer_path,
            message: e.to_string(),
        })?;
        state.optimizer = state.optimizer.clone().load_record(record);

        if saved.seed != state.seed {
            tracing::warn!(
                saved = saved.seed,
                configured = state.seed,
                "resuming with the checkpoint's seed"
            );
        }
        let scheduler = state.scheduler.describe();
        if saved.scheduler != scheduler {
            tracing::warn!(saved = %saved.scheduler, configured = %scheduler, "the learning-rate schedule differs from the saved run's");
        }
        state.seed = saved.seed;
        state.timestamp = saved.timestamp.clone();
        state.skipped_batches = saved.skipped_batches;
        state.last_eval_batch = saved.last_eval_batch;
        state.eval_metrics = saved
            .eval_metrics
            .iter()
            .map(|(k, m)| {
                (
                    k.clone(),
                    m.iter()
                        .map(|(n, v)| (n.clone(), v.unwrap_or(f64::NAN)))
                        .collect(),
                )
            })
            .collect();
        tracing::info!(checkpoint = %dir.display(), at = %state.timestamp, "resumed");
        Ok(saved.components)
    }
}

impl<S: Setup> Restore<S> for CheckpointRestore {
    fn restore(self: Box<Self>, state: &mut State<S>) -> CoreResult<BTreeMap<String, Value>> {
        self.restore_into(state)
            .map_err(CheckpointError::in_restore)
    }
}

/// The newest intact checkpoint in `folder`, and the damaged ones passed over on the way
/// (each error names its file). A missing or empty folder gives `None`: a fresh start.
/// Newest means the most batches; the one `latest` names wins a tie.
pub fn find_resumable(
    folder: &Path,
) -> Result<(Option<PathBuf>, Vec<CheckpointError>), CheckpointError> {
    let entries = match std::fs::read_dir(folder) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((None, Vec::new())),
        Err(e) => {
            return Err(CheckpointError::Io {
                action: "list",
                path: folder.to_path_buf(),
                source: e,
            })
        }
    };
    let latest = format::read_latest(folder);
    let mut candidates: Vec<(u64, bool, String)> = Vec::new();
    for e in entries.flatten() {
        if !e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        // The batch count orders candidates. A directory whose manifest cannot be read may be
        // the newest (its save may have been damaged after it finished), so it is tried
        // first, fails verification, and is reported by name.
        let batch = std::fs::read(e.path().join(format::MANIFEST))
            .ok()
            .and_then(|t| serde_json::from_slice::<Manifest>(&t).ok())
            .map(|m| m.batch)
            .unwrap_or(u64::MAX);
        candidates.push((batch, latest.as_deref() == Some(name.as_str()), name));
    }
    candidates.sort_by(|a, b| b.cmp(a));
    let mut damaged = Vec::new();
    for (_, _, name) in candidates {
        let dir = folder.join(&name);
        match verify(&dir) {
            Ok(m) if !m.weights_only => return Ok((Some(dir), damaged)),
            Ok(_) => damaged.push(CheckpointError::WeightsOnly { path: dir }),
            Err(e) => damaged.push(e),
        }
    }
    Ok((None, damaged))
}

/// Autoresume: the restore for the newest intact checkpoint in `folder`, logging a warning
/// for each damaged one passed over; `None` when there is nothing to resume.
pub fn autoresume(folder: &Path) -> Result<Option<CheckpointRestore>, CheckpointError> {
    let (found, damaged) = find_resumable(folder)?;
    for d in &damaged {
        tracing::warn!(error = %d, "skipping a checkpoint that cannot be resumed from");
    }
    Ok(found.map(|dir| CheckpointRestore::new(dir, LoadOptions::default())))
}
