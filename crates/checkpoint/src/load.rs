//! Loading: verify first (manifest, sizes, SHA-256), then restore the model, its parameter
//! ids, the optimizer, the timestamp and the rest into a trainer being built. Autoresume finds
//! the newest intact checkpoint in a folder, moving damaged ones aside with a warning.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use derive_new::new;
use flashover_core::error::Result as CoreResult;
use flashover_core::restore::{Restore, Restoring};
use flashover_core::setup::Setup;
use serde_json::Value;

use crate::error::CheckpointError;
use crate::format::{
    self, read_manifest, read_verified, verify, Manifest, MODEL, OPTIMIZER, TRAINER_STATE,
};
use crate::lock::{lock_folder, FolderLock};
use crate::shards::Part;
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
    /// Autoresume's lock on the save folder, held until the saver takes it over.
    #[new(default)]
    lock: Option<Arc<FolderLock>>,
}

impl CheckpointRestore {
    /// The checkpoint directory as given (a `latest` pointer or a save folder means the
    /// checkpoint it names: [`crate::resolve_checkpoint`]).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn restore_into<S: Setup>(
        &self,
        state: &mut Restoring<'_, S>,
    ) -> Result<Option<BTreeMap<String, Value>>, CheckpointError> {
        // `ck/latest` (the pointer) and `ck` (the save folder) mean the checkpoint it names.
        let dir = &crate::format::resolve_checkpoint(&self.dir);
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
            return Ok(None);
        }
        if manifest.weights_only {
            return Err(CheckpointError::WeightsOnly { path: dir.clone() });
        }
        let trainer_path = dir.join(TRAINER_STATE);
        let saved = TrainerStateFile::parse(
            &read_verified(dir, &manifest, TRAINER_STATE)?,
            &trainer_path,
        )?;
        // The manifest (which orders checkpoints for autoresume and rotation) and the trainer
        // state were written together from one timestamp: a disagreement is an edited file.
        if (manifest.epoch, manifest.batch) != (saved.timestamp.epoch, saved.timestamp.batch) {
            return Err(CheckpointError::damaged(
                &trainer_path,
                format!(
                    "its position (epoch {}, batch {}) is not the manifest's (epoch {}, batch {}): the two were written together, so one was changed since",
                    saved.timestamp.epoch, saved.timestamp.batch, manifest.epoch, manifest.batch
                ),
            ));
        }
        // A resumed run keeps its seed: the data order (the loaders' samplers, built before
        // the restore from the configured seed) and every algorithm's draws follow it, so
        // another seed cannot be honoured half-way; refusing is the only exact answer.
        if saved.seed != state.seed() {
            return Err(CheckpointError::Config {
                name: "seed",
                value: state.seed().to_string(),
                expected: format!(
                    "the seed {} that {} was trained with (a resumed run keeps its seed: data order, augmentations and dropout follow it); to train on from these weights with another seed, load them as weights only (`--load <checkpoint> --weights-only`) and start a new run",
                    saved.seed,
                    dir.display()
                ),
            });
        }
        // Inside an epoch the position counts batches: another global batch size (or other
        // data) would start the rest of the epoch at another sample, replaying or skipping
        // samples. At an epoch boundary nothing of the epoch is lost, so it may change there.
        let k = saved.timestamp.batch_in_epoch;
        if let (Some(was), Some(was_batches)) = (saved.global_batch_size, saved.batches_per_epoch) {
            let now = state.global_batch_size();
            let now_batches = state.batches_per_epoch();
            if k > 0 && (was != now || was_batches != now_batches) {
                return Err(CheckpointError::Config {
                    name: "batch_size",
                    value: format!(
                        "{now} (global; {now_batches} batches an epoch, {} per process x {} processes)",
                        now / (state.world().size.max(1) as u64),
                        state.world().size
                    ),
                    expected: format!(
                        "the global batch size {was} ({was_batches} batches an epoch) of {}, which was saved {k} batches into an epoch: resuming inside an epoch at another batch size or on other data would replay or skip samples. Resume with --batch-size {was} (with several processes, a number of them that divides {was}) on the same data, or start a new run from its weights (`--load <checkpoint> --weights-only`)",
                        dir.display()
                    ),
                });
            }
        }
        if saved.world_size != state.world().size {
            // Elastic resumption: the timestamp counts the whole data-parallel batch, and a
            // run that keeps its global batch (each rank reading global / world) reads the
            // same samples at batch k of an epoch at any world size, so the run continues
            // from the same global sample position.
            tracing::info!(
                checkpoint = %dir.display(),
                saved_world_size = saved.world_size,
                world_size = state.world().size,
                "resuming on another number of ranks: the global batch size must be the same as when the checkpoint was saved"
            );
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
        let (bytes, optimizer_path) = optimizer_state(dir, &manifest, &saved, state)?;
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let record = Recorder::<S::Backend>::load::<
            <S::Optimizer as Optimizer<S::Model, S::Backend>>::Record,
        >(&recorder, bytes, state.device())
        .map_err(|e| CheckpointError::Format {
            path: optimizer_path,
            message: e.to_string(),
        })?;
        let optimizer = state.optimizer().clone().load_record(record);
        state.set_optimizer(optimizer);

        let scheduler = state.scheduler().describe();
        if saved.scheduler != scheduler {
            tracing::warn!(saved = %saved.scheduler, configured = %scheduler, "the learning-rate schedule differs from the saved run's");
        }
        // The microbatch size is used only by a run with automatic microbatching.
        state.set_position(
            saved.seed,
            saved.timestamp.clone(),
            saved.skipped_batches,
            saved.auto_microbatch_size,
        );
        // Another precision: the builder converts the weights to this run's type after the
        // restore; a loss scaler carries over between the float16 precisions and starts
        // afresh otherwise.
        if saved.precision != state.precision() {
            tracing::info!(
                saved = %saved.precision,
                configured = %state.precision(),
                "resuming in another precision: the weights are converted (the run is no longer bit-exact against an uninterrupted one)"
            );
        }
        if let (Some(scaler), Some(saved)) = (state.loss_scaler_mut(), saved.loss_scaler) {
            // The run's settings, the saved progress.
            scaler.scale = saved.scale;
            scaler.clean_steps = saved.clean_steps;
            scaler.skipped_steps = saved.skipped_steps;
        }
        let eval_metrics = saved
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
        state.set_eval_history(saved.last_eval_batch, eval_metrics);
        tracing::info!(checkpoint = %dir.display(), at = %state.timestamp(), "resumed");
        Ok(Some(saved.components))
    }
}

/// The optimizer state this rank loads, as a record file, and the file to name in a
/// decoding error: `optimizer.mpk`, or every rank's shard of a sharded checkpoint merged
/// (`crate::shards`); in a sharded run only the parameters this rank owns now, whatever the
/// world size the checkpoint was saved at. A shard that is missing or damaged is an error
/// naming its rank and file.
fn optimizer_state<S: Setup>(
    dir: &Path,
    manifest: &Manifest,
    saved: &TrainerStateFile,
    state: &Restoring<'_, S>,
) -> Result<(Vec<u8>, PathBuf), CheckpointError> {
    let owned: Option<HashSet<String>> = state
        .owned_param_ids()
        .map_err(|e| CheckpointError::Format {
            path: dir.to_path_buf(),
            message: e.to_string(),
        })?
        .map(|ids| ids.into_iter().map(|id| id.serialize()).collect());
    let Some(files) = &saved.optimizer_shards else {
        let bytes = read_verified(dir, manifest, OPTIMIZER)?;
        let bytes = match &owned {
            None => bytes,
            Some(keep) => crate::shards::merge(
                vec![Part {
                    path: dir.join(OPTIMIZER),
                    bytes,
                }],
                Some(keep),
            )?,
        };
        return Ok((bytes, dir.join(OPTIMIZER)));
    };
    let world = files.len();
    let mut parts = Vec::with_capacity(world);
    for (rank, file) in files.iter().enumerate() {
        let bytes = read_verified(dir, manifest, file).map_err(|e| match e {
            CheckpointError::Damaged { path, reason } => CheckpointError::Damaged {
                path,
                reason: format!("the optimizer shard of rank {rank} of {world}: {reason}"),
            },
            other => other,
        })?;
        parts.push(Part {
            path: dir.join(file),
            bytes,
        });
    }
    tracing::info!(
        checkpoint = %dir.display(),
        shards = world,
        sharded_now = owned.is_some(),
        "loading a sharded optimizer state"
    );
    Ok((
        crate::shards::merge(parts, owned.as_ref())?,
        dir.to_path_buf(),
    ))
}

impl<S: Setup> Restore<S> for CheckpointRestore {
    fn restore(
        self: Box<Self>,
        state: &mut Restoring<'_, S>,
    ) -> CoreResult<Option<BTreeMap<String, Value>>> {
        self.restore_into(state)
            .map_err(CheckpointError::in_restore)
    }
}

/// A checkpoint directory that autoresume passed over, and why.
#[derive(Debug)]
pub struct Skipped {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Why it cannot be resumed from (names the file).
    pub error: CheckpointError,
}

impl Skipped {
    /// Whether it failed verification (damaged or incomplete), rather than being intact but
    /// unsuitable (a weights-only checkpoint).
    pub fn is_damaged(&self) -> bool {
        matches!(self.error, CheckpointError::Damaged { .. })
    }
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.error)
    }
}

/// The suffix given to a checkpoint that failed verification when autoresume moves it aside
/// (`ep3-ba375.damaged`, then `.damaged-2`, ...). Such directories are never resumed from,
/// listed for rotation or deleted.
pub const DAMAGED_SUFFIX: &str = ".damaged";

/// Whether a directory name is one autoresume moved aside.
pub fn is_moved_aside(name: &str) -> bool {
    name.ends_with(DAMAGED_SUFFIX)
        || name
            .rsplit_once(&format!("{DAMAGED_SUFFIX}-"))
            .is_some_and(|(_, n)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// Whether a directory without a readable manifest still looks like a checkpoint: empty (a
/// checkpoint whose files were lost), or holding one of the files a save writes. A folder
/// with other content is someone else's, left alone.
fn looks_like_checkpoint(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return true;
    };
    let names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.is_empty()
        || names.iter().any(|n| {
            [format::MANIFEST, MODEL, OPTIMIZER, TRAINER_STATE].contains(&n.as_str())
                || n.starts_with("optimizer-rank")
        })
}

/// The newest intact checkpoint in `folder`, and the ones passed over on the way (each error
/// names its file). A missing or empty folder gives `None`: a fresh start. Newest means the
/// most batches; the one `latest` names wins a tie. Reads only: nothing is moved.
///
/// A checkpoint written by another format version, or a file that cannot be read (an I/O
/// error, not damage), is an error: neither says that the checkpoint is bad, so passing over
/// it to an older one would silently lose work.
pub fn find_resumable(folder: &Path) -> Result<(Option<PathBuf>, Vec<Skipped>), CheckpointError> {
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
    for e in entries {
        let e = e.map_err(CheckpointError::io("list", folder))?;
        if !e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || is_moved_aside(&name) {
            continue;
        }
        // The batch count orders candidates. A directory whose manifest cannot be read may be
        // the newest (its save may have been damaged after it finished), so it is tried
        // first, fails verification, and is reported by name.
        let manifest = std::fs::read(e.path().join(format::MANIFEST))
            .ok()
            .and_then(|t| serde_json::from_slice::<Manifest>(&t).ok());
        if manifest.is_none() && !looks_like_checkpoint(&e.path()) {
            tracing::debug!(dir = %e.path().display(), "not a checkpoint; ignored");
            continue;
        }
        let batch = manifest.map(|m| m.batch).unwrap_or(u64::MAX);
        candidates.push((batch, latest.as_deref() == Some(name.as_str()), name));
    }
    candidates.sort_by(|a, b| b.cmp(a));
    let mut skipped = Vec::new();
    for (_, _, name) in candidates {
        let dir = folder.join(&name);
        match verify(&dir) {
            Ok(m) if !m.weights_only => return Ok((Some(dir), skipped)),
            Ok(_) => skipped.push(Skipped {
                error: CheckpointError::WeightsOnly { path: dir.clone() },
                dir,
            }),
            Err(error @ CheckpointError::Damaged { .. }) => skipped.push(Skipped { dir, error }),
            Err(e) => return Err(e),
        }
    }
    Ok((None, skipped))
}

/// What autoresume does when it meets damage.
#[derive(Debug, Clone, Copy, Default)]
pub struct AutoresumeOptions {
    /// When checkpoints exist but none verifies: move them aside and start a new run (`true`),
    /// or fail and change nothing (`false`, the default), since their contents may be intact
    /// (a disk that was briefly unreadable) and a fresh run would overwrite or rotate them.
    pub fresh_start_if_damaged: bool,
}

/// Autoresume: the restore for the newest intact checkpoint in `folder` (`None` when there is
/// nothing to resume), with the folder locked for this process ([`lock_folder`]).
///
/// Checkpoints newer than the one resumed from that failed verification are renamed
/// `<name>.damaged` (each reported with a warning), so that the resumed run, reaching their
/// batch, saves a good checkpoint under that name instead of stopping on "exists" at every
/// restart; `latest` is pointed at the checkpoint resumed from. When checkpoints exist but
/// none verifies, it is [`CheckpointError::NothingIntact`] unless `options` ask for a fresh
/// start. Call it on the one process that writes the folder.
pub fn autoresume_with(
    folder: &Path,
    options: AutoresumeOptions,
) -> Result<Option<CheckpointRestore>, CheckpointError> {
    let lock = if folder.exists() {
        Some(lock_folder(folder)?)
    } else {
        None
    };
    let (found, skipped) = find_resumable(folder)?;
    let damaged: Vec<&Skipped> = skipped.iter().filter(|s| s.is_damaged()).collect();
    for s in skipped.iter().filter(|s| !s.is_damaged()) {
        tracing::warn!(error = %s.error, "skipping a checkpoint that cannot resume a run");
    }
    if found.is_none() && !damaged.is_empty() && !options.fresh_start_if_damaged {
        return Err(CheckpointError::NothingIntact {
            folder: folder.to_path_buf(),
            damaged: damaged.iter().map(|s| s.error.to_string()).collect(),
        });
    }
    for s in &damaged {
        let aside = move_aside(&s.dir)?;
        tracing::warn!(
            error = %s.error,
            moved_to = %aside.display(),
            "a checkpoint failed verification; moved aside (kept, never resumed from or rotated)"
        );
    }
    if let Some(dir) = &found {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if format::read_latest(folder).as_deref() != Some(name.as_str()) {
            format::write_latest(folder, &name)?;
        }
    }
    Ok(found.map(|dir| {
        let mut r = CheckpointRestore::new(dir, LoadOptions::default());
        r.lock = lock;
        r
    }))
}

/// Autoresume for a process that reads the folder but does not write it: the other ranks of
/// a data-parallel run, after rank 0's [`autoresume_with`] has moved damaged checkpoints
/// aside. The newest intact checkpoint, with nothing locked, renamed or rewritten; a folder
/// that does not exist means a fresh start. Damaged checkpoints left in place (there should
/// be none after rank 0's pass) are skipped with a warning.
pub fn autoresume_read_only(folder: &Path) -> Result<Option<CheckpointRestore>, CheckpointError> {
    if !folder.exists() {
        return Ok(None);
    }
    let (found, skipped) = find_resumable(folder)?;
    for s in &skipped {
        tracing::warn!(error = %s.error, "skipping a checkpoint that cannot resume a run");
    }
    Ok(found.map(|dir| CheckpointRestore::new(dir, LoadOptions::default())))
}

/// [`autoresume_with`] with the default options: damage with nothing intact is an error.
pub fn autoresume(folder: &Path) -> Result<Option<CheckpointRestore>, CheckpointError> {
    autoresume_with(folder, AutoresumeOptions::default())
}

/// Renames a damaged checkpoint to the first free `<name>.damaged[-N]` beside it.
fn move_aside(dir: &Path) -> Result<PathBuf, CheckpointError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let parent = dir.parent().unwrap_or(Path::new("."));
    let mut n = 1;
    loop {
        let aside = if n == 1 {
            parent.join(format!("{name}{DAMAGED_SUFFIX}"))
        } else {
            parent.join(format!("{name}{DAMAGED_SUFFIX}-{n}"))
        };
        if !aside.exists() {
            std::fs::rename(dir, &aside).map_err(CheckpointError::io("move aside", dir))?;
            format::sync_dir(parent);
            return Ok(aside);
        }
        n += 1;
    }
}
