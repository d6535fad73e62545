//! The checkpoint saver: a callback that decides when to save (an interval in time units or
//! a function of time), serialises the state on the training thread, and writes it (on the
//! training thread, or on a background writer that the next save or `FIT_END` waits for).
//!
//! Retention is a pure policy ([`retention`], in `retention.rs`, shared with the remote
//! uploader) that returns which checkpoints to delete; the writer carries it out after the new
//! checkpoint and the `latest` pointer are in place.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use flashover_core::callback::{Callback, Control};
use flashover_core::collective::{Peers, Ranks};
use flashover_core::error::{CoreError, Result as CoreResult};
use flashover_core::event::Event;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::{Time, TimeUnit, Timestamp};

use crate::error::CheckpointError;
use crate::format::{
    self, is_scratch, optimizer_shard, sha256_hex, shard_staging, write_atomic, write_checkpoint,
    write_latest, Staged, MODEL, OPTIMIZER, TRAINER_STATE,
};
use crate::lock::{lock_folder, FolderLock};
pub use crate::retention::retention;
use crate::state_file::TrainerStateFile;
use crate::weights::weights_to_bytes;

/// Fields a name template may use.
pub const TEMPLATE_FIELDS: &[&str] = &[
    "epoch",
    "batch",
    "sample",
    "token",
    "batch_in_epoch",
    "rank",
];

/// Renders a checkpoint name from a template such as `"ep{epoch}-ba{batch}"`.
pub fn render_name(template: &str, ts: &Timestamp, rank: usize) -> Result<String, CheckpointError> {
    let bad = |reason: String| CheckpointError::Config {
        name: "name_template",
        value: template.to_string(),
        expected: reason,
    };
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..]
            .find('}')
            .ok_or_else(|| bad("a closing `}` for every `{`".into()))?
            + open;
        let field = &rest[open + 1..close];
        let value = match field {
            "epoch" => ts.epoch,
            "batch" => ts.batch,
            "sample" => ts.sample,
            "token" => ts.token,
            "batch_in_epoch" => ts.batch_in_epoch,
            "rank" => rank as u64,
            other => {
                return Err(bad(format!(
                    "fields among {{{}}}, not {{{other}}}",
                    TEMPLATE_FIELDS.join("}, {")
                )))
            }
        };
        out.push_str(&value.to_string());
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    let plain = !out.is_empty()
        && !out.starts_with('.')
        && out != format::LATEST
        && !out.contains(['/', '\\'])
        && out.chars().all(|c| !c.is_control());
    if !plain {
        return Err(bad(format!(
            "a plain folder name (got {out:?}): no '/', not starting with '.', not \"latest\""
        )));
    }
    Ok(out)
}

/// Checkpoints in `folder` whose manifest can be read, with their batch counts. Damaged ones,
/// and those autoresume moved aside, are not listed (so rotation never deletes what it cannot
/// identify).
pub fn list_checkpoints(folder: &Path) -> Vec<(String, u64)> {
    let Ok(entries) = fs::read_dir(folder) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || crate::load::is_moved_aside(&name) {
                return None;
            }
            let text = fs::read(e.path().join(format::MANIFEST)).ok()?;
            let m: format::Manifest = serde_json::from_slice(&text).ok()?;
            (m.format == format::FORMAT_NAME).then_some((name, m.batch))
        })
        .collect()
}

/// The checkpoints among `existing` (name and batch) that a run starting at batch `start`
/// would not continue, oldest first: every one for a new run (`start` 0: they belong to
/// another run), and those past `start` for a resumed one (Composer's rule: a later
/// checkpoint in the folder means another run, or a later point of this one, would be
/// mixed with this run's saves and overwritten or rotated by them). Autoresume resumes from
/// the newest intact checkpoint and moves damaged ones aside, so it never meets one.
pub fn conflicting_checkpoints(existing: &[(String, u64)], start: u64) -> Vec<(String, u64)> {
    let mut found: Vec<(String, u64)> = existing
        .iter()
        .filter(|(_, b)| start == 0 || *b > start)
        .cloned()
        .collect();
    found.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
    found
}

/// A function deciding, from the timestamp and the checkpoint event, whether to save.
pub type SavePredicate = Box<dyn FnMut(&Timestamp, Event) -> bool + Send>;

/// When to save.
pub enum SaveInterval {
    /// Every so often: at `EPOCH_CHECKPOINT` for epochs, at `BATCH_CHECKPOINT` when a multiple
    /// of the interval is crossed for other units.
    Every(Time),
    /// A function of the timestamp and the event (`BATCH_CHECKPOINT` or `EPOCH_CHECKPOINT`).
    Custom(SavePredicate),
}

/// Saver settings. `Default` saves every epoch as `ep{epoch}-ba{batch}`, keeps everything,
/// writes full state synchronously and refuses to overwrite.
#[derive(Debug, Clone)]
pub struct SaverConfig {
    /// Where checkpoints go (created if missing).
    pub folder: PathBuf,
    /// Name template; see [`TEMPLATE_FIELDS`].
    pub name_template: String,
    /// Keep only the newest N checkpoints in the folder; 0 keeps all.
    pub keep: usize,
    /// Save model weights only (such a checkpoint starts new runs; it cannot resume one).
    pub weights_only: bool,
    /// Replace a checkpoint of the same name instead of failing.
    pub overwrite: bool,
    /// Write files on a background thread; the training thread only serialises.
    pub async_write: bool,
    /// Also upload every checkpoint to this object-store prefix, in the background, after it
    /// is written and verified in `folder` (see [`crate::remote`]); keep-N applies there too.
    #[cfg(feature = "remote")]
    pub remote: Option<std::sync::Arc<crate::remote::RemoteStore>>,
    /// How the uploader retries (with `remote`).
    #[cfg(feature = "remote")]
    pub upload_retry: crate::remote::UploadRetry,
}

impl SaverConfig {
    /// Defaults for `folder`.
    pub fn new(folder: impl Into<PathBuf>) -> Self {
        SaverConfig {
            folder: folder.into(),
            name_template: "ep{epoch}-ba{batch}".into(),
            keep: 0,
            weights_only: false,
            overwrite: false,
            async_write: false,
            #[cfg(feature = "remote")]
            remote: None,
            #[cfg(feature = "remote")]
            upload_retry: crate::remote::UploadRetry::default(),
        }
    }
}

struct Job {
    folder: PathBuf,
    name: String,
    epoch: u64,
    batch: u64,
    weights_only: bool,
    overwrite: bool,
    keep: usize,
    files: Vec<(&'static str, Vec<u8>)>,
    /// Files the ranks of a sharded save wrote into `staging`, moved in by the write.
    staged: Vec<Staged>,
    staging: Option<PathBuf>,
    #[cfg(feature = "remote")]
    upload: Option<crate::remote::sync::UploadQueue>,
}

impl Job {
    fn run(self) -> Result<PathBuf, CheckpointError> {
        let path = self.write()?;
        // Said here, once the checkpoint, `latest` and rotation are done: with a background
        // writer the training thread has only handed the files over.
        tracing::info!(checkpoint = %path.display(), batch = self.batch, "checkpoint saved");
        Ok(path)
    }

    fn write(&self) -> Result<PathBuf, CheckpointError> {
        // Scratch left by a save that was killed midway is removed first (one writer per
        // folder is the contract, so nothing else can be using it).
        let staging = self
            .staging
            .as_ref()
            .and_then(|p| p.file_name())
            .map(|n| n.to_owned());
        if let Ok(entries) = fs::read_dir(&self.folder) {
            for e in entries.flatten() {
                // This save's own staged shards are not a killed save's.
                if Some(e.file_name()) == staging {
                    continue;
                }
                if is_scratch(&e.file_name().to_string_lossy()) {
                    // A killed `write_atomic` leaves a file, a killed save a directory.
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        let _ = fs::remove_dir_all(e.path());
                    } else {
                        let _ = fs::remove_file(e.path());
                    }
                }
            }
        }
        let files: Vec<(&str, &[u8])> =
            self.files.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        let path = write_checkpoint(
            &self.folder,
            &self.name,
            self.epoch,
            self.batch,
            self.weights_only,
            &files,
            &self.staged,
            self.overwrite,
        )?;
        if let Some(staging) = &self.staging {
            let _ = fs::remove_dir_all(staging);
        }
        write_latest(&self.folder, &self.name)?;
        for old in retention(&list_checkpoints(&self.folder), self.keep) {
            if old != self.name {
                // Renamed aside first, so a crash mid-delete leaves scratch for the next save
                // to clear, never a half-deleted checkpoint that looks like a real one.
                let p = self.folder.join(&old);
                let trash = self
                    .folder
                    .join(format!(".trash-{old}-{}", std::process::id()));
                fs::rename(&p, &trash)
                    .map_err(CheckpointError::io("move aside old checkpoint", &p))?;
                fs::remove_dir_all(&trash)
                    .map_err(CheckpointError::io("remove old checkpoint", &trash))?;
            }
        }
        #[cfg(feature = "remote")]
        if let Some(q) = &self.upload {
            q.push(&self.name);
        }
        Ok(path)
    }
}

struct Writer {
    jobs: SyncSender<Job>,
    done: Receiver<Result<PathBuf, CheckpointError>>,
    pending: Option<PathBuf>,
    handle: Option<JoinHandle<()>>,
}

impl Writer {
    fn start() -> Result<Self, CheckpointError> {
        let (jobs, rx) = mpsc::sync_channel::<Job>(1);
        let (tx, done) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("flashover-checkpoint-writer".into())
            .spawn(move || {
                for job in rx {
                    if tx.send(job.run()).is_err() {
                        return;
                    }
                }
            })
            .map_err(CheckpointError::io(
                "start writer thread for",
                "checkpoint folder",
            ))?;
        Ok(Writer {
            jobs,
            done,
            pending: None,
            handle: Some(handle),
        })
    }

    /// Waits for the write in flight, if any, and reports its failure.
    fn wait(&mut self) -> Result<(), CheckpointError> {
        let Some(path) = self.pending.take() else {
            return Ok(());
        };
        match self.done.recv() {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(CheckpointError::Background {
                path,
                source: Box::new(e),
            }),
            Err(_) => Err(CheckpointError::Background {
                path: path.clone(),
                source: Box::new(CheckpointError::io("write", path)(std::io::Error::other(
                    "writer thread stopped",
                ))),
            }),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.wait();
        // Closing the job channel ends the thread.
        let (dummy, _) = mpsc::sync_channel(1);
        drop(std::mem::replace(&mut self.jobs, dummy));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Saves checkpoints during training. Only rank 0 writes.
///
/// ```no_run
/// use flashover_checkpoint::{Saver, SaverConfig, SaveInterval};
/// use flashover_core::time::Time;
/// let mut config = SaverConfig::new("checkpoints");
/// config.keep = 3;
/// let saver = Saver::new(config, SaveInterval::Every(Time::Batch(500))).unwrap();
/// # let _ = saver;
/// ```
pub struct Saver {
    config: SaverConfig,
    interval: SaveInterval,
    before: Option<Timestamp>,
    last_saved_batch: Option<u64>,
    writer: Option<Writer>,
    saved: Vec<PathBuf>,
    #[cfg(feature = "remote")]
    uploader: Option<crate::remote::sync::Uploader>,
    // After `writer`, so that a write in flight finishes before the folder is unlocked.
    lock: Option<Arc<FolderLock>>,
}

impl Saver {
    /// A saver; checks the name template and the interval.
    pub fn new(config: SaverConfig, interval: SaveInterval) -> Result<Self, CheckpointError> {
        render_name(&config.name_template, &Timestamp::default(), 0)?;
        if let SaveInterval::Every(t) = &interval {
            if t.is_zero() {
                return Err(CheckpointError::Config {
                    name: "save_interval",
                    value: t.to_string(),
                    expected: "a time greater than zero".into(),
                });
            }
        }
        // A remote that cannot be listed (no bucket, refused credentials, no server) fails
        // here, before anything trains.
        #[cfg(feature = "remote")]
        let uploader = match &config.remote {
            None => None,
            Some(store) => {
                // A name that can be a folder but not a key would save locally and never
                // upload: refused now. (Templates render digits into their fields, so the
                // rendering at time zero shows every literal character.)
                let name = render_name(&config.name_template, &Timestamp::default(), 0)?;
                crate::remote::check_segment(&name).map_err(|e| CheckpointError::Config {
                    name: "name_template",
                    value: config.name_template.clone(),
                    expected: format!(
                        "a name that can be an object key with a remote store, not {e}"
                    ),
                })?;
                store.check()?;
                Some(crate::remote::sync::Uploader::start(
                    store.clone(),
                    config.folder.clone(),
                    config.keep,
                    config.overwrite,
                    config.upload_retry.clone(),
                )?)
            }
        };
        let writer = if config.async_write {
            Some(Writer::start()?)
        } else {
            None
        };
        Ok(Saver {
            config,
            interval,
            before: None,
            last_saved_batch: None,
            writer,
            saved: Vec::new(),
            #[cfg(feature = "remote")]
            uploader,
            lock: None,
        })
    }

    /// Checkpoints this saver wrote (or handed to its writer), oldest first.
    pub fn saved(&self) -> &[PathBuf] {
        &self.saved
    }

    fn due<S: Setup>(&mut self, event: Event, state: &State<S>) -> bool {
        match &mut self.interval {
            SaveInterval::Custom(f) => f(state.timestamp(), event),
            SaveInterval::Every(t) => match (t.unit(), event) {
                (TimeUnit::Epoch, Event::EpochCheckpoint) => {
                    state.timestamp().epoch.is_multiple_of(t.value() as u64)
                }
                (TimeUnit::Epoch, _) | (_, Event::EpochCheckpoint) => false,
                (unit, _) => {
                    let Some(before) = &self.before else {
                        return false;
                    };
                    let p = state.progress();
                    let crossings =
                        |ts: &Timestamp| (p.elapsed(ts, unit) / t.value() + 1e-9).floor();
                    crossings(state.timestamp()) > crossings(before)
                }
            },
        }
    }

    /// Whether this save takes the sharded path: every rank holds a part of the optimizer
    /// state (a weights-only checkpoint needs none of it, and rank 0 writes it alone).
    fn sharded<S: Setup>(&self, state: &State<S>) -> bool {
        state.is_sharded() && !self.config.weights_only
    }

    /// Whether to save now: in a sharded run the ranks agree (any rank's wish, a callback's
    /// request on rank 0 included, saves on all), since every rank writes its shard.
    fn agree<S: Setup>(
        &self,
        state: &State<S>,
        ctl: &mut Control<'_>,
        want: bool,
    ) -> CoreResult<bool> {
        if !self.sharded(state) {
            return Ok(want);
        }
        let mut v = [f64::from(u8::from(want))];
        peers(ctl)?.sum(&mut v)?;
        Ok(v[0] > 0.0)
    }

    /// A sharded save (every rank): each rank writes its optimizer shard into the staging
    /// folder, synced, and reports its size and SHA-256 (or its error) to the others; if
    /// every rank succeeded, rank 0 writes the weights and trainer state and moves the
    /// shards in under one manifest, atomically as any checkpoint. A rank that failed fails
    /// the save on every rank, naming the rank and file: no checkpoint is put in place.
    fn save_sharded<S: Setup>(
        &mut self,
        state: &State<S>,
        ctl: &mut Control<'_>,
    ) -> CoreResult<()> {
        let ts = state.timestamp();
        let world = state.world();
        // Every rank saves under rank 0's name.
        let name =
            render_name(&self.config.name_template, ts, 0).map_err(CheckpointError::in_saver)?;
        if let Some(w) = &mut self.writer {
            w.wait().map_err(CheckpointError::in_saver)?;
        }
        let staging = shard_staging(&self.config.folder, &name);
        let file = optimizer_shard(world.rank, world.size);
        let path = staging.join(&file);
        let written = (|| {
            fs::create_dir_all(&staging).map_err(CheckpointError::io("create", &staging))?;
            let bytes = optimizer_bytes(state, &path)?;
            write_atomic(&path, &bytes)?;
            Ok::<_, CheckpointError>((bytes.len() as u64, sha256_hex(&bytes)))
        })();
        let report = match &written {
            Ok((bytes, sha)) => format!("ok {bytes} {sha}"),
            Err(e) => format!("error {e}"),
        };
        let reports = peers(ctl)?.gather_text(&report)?;
        let mut staged = Vec::with_capacity(reports.len());
        for (rank, report) in reports.iter().enumerate() {
            let file = optimizer_shard(rank, world.size);
            let path = staging.join(&file);
            let mut parts = report.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("ok"), Some(bytes), Some(sha)) if bytes.parse::<u64>().is_ok() => staged
                    .push(Staged {
                        name: file,
                        path,
                        bytes: bytes.parse().unwrap_or(0),
                        sha256: sha.to_string(),
                    }),
                _ => {
                    return Err(CheckpointError::Shard {
                        rank,
                        path,
                        message: report.strip_prefix("error ").unwrap_or(report).to_string(),
                    }
                    .in_saver())
                }
            }
        }
        if world.is_main() {
            let mut job = self.job(state, &name).map_err(CheckpointError::in_saver)?;
            job.staged = staged;
            job.staging = Some(staging);
            job.run().map_err(CheckpointError::in_saver)?;
            self.saved.push(self.config.folder.join(&name));
        }
        self.last_saved_batch = Some(ts.batch);
        Ok(())
    }

    /// The files of a checkpoint of `state` named `name`, ready to write (a sharded run's
    /// without its optimizer state, which the ranks' shards hold).
    fn job<S: Setup>(&self, state: &State<S>, name: &str) -> Result<Job, CheckpointError> {
        let ts = state.timestamp();
        let mut files: Vec<(&'static str, Vec<u8>)> = vec![(
            MODEL,
            weights_to_bytes::<S::Backend, S::Model>(state.model())?,
        )];
        if !self.config.weights_only {
            let mut trainer = TrainerStateFile::from_state(state);
            if self.sharded(state) {
                let w = state.world().size;
                trainer.optimizer_shards = Some((0..w).map(|r| optimizer_shard(r, w)).collect());
            } else {
                let path = self.config.folder.join(name).join(OPTIMIZER);
                files.push((OPTIMIZER, optimizer_bytes(state, &path)?));
            }
            let trainer =
                serde_json::to_vec_pretty(&trainer).map_err(|e| CheckpointError::Format {
                    path: self.config.folder.join(name).join(TRAINER_STATE),
                    message: e.to_string(),
                })?;
            files.push((TRAINER_STATE, trainer));
        }
        Ok(Job {
            folder: self.config.folder.clone(),
            name: name.to_string(),
            epoch: ts.epoch,
            batch: ts.batch,
            weights_only: self.config.weights_only,
            overwrite: self.config.overwrite,
            keep: self.config.keep,
            files,
            staged: Vec::new(),
            staging: None,
            #[cfg(feature = "remote")]
            upload: self.uploader.as_ref().and_then(|u| u.queue()),
        })
    }

    fn save<S: Setup>(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> CoreResult<()> {
        if self.sharded(state) {
            return self.save_sharded(state, ctl);
        }
        if state.is_sharded() && !state.world().is_main() {
            // A sharded run saving weights only: rank 0 writes them (the weights are whole
            // on every rank). Otherwise a saver runs on another rank only when the program
            // wrapped it in `OnEveryRank`, and saves there.
            self.last_saved_batch = Some(state.timestamp().batch);
            return Ok(());
        }
        self.save_whole(state).map_err(CheckpointError::in_saver)
    }

    fn save_whole<S: Setup>(&mut self, state: &State<S>) -> Result<(), CheckpointError> {
        let ts = state.timestamp();
        let name = render_name(&self.config.name_template, ts, state.world().rank)?;
        let job = self.job(state, &name)?;
        let path = self.config.folder.join(&name);
        match &mut self.writer {
            None => {
                job.run()?;
            }
            Some(w) => {
                w.wait()?;
                w.jobs.send(job).map_err(|_| CheckpointError::Background {
                    path: path.clone(),
                    source: Box::new(CheckpointError::io("write", &path)(std::io::Error::other(
                        "writer thread stopped",
                    ))),
                })?;
                w.pending = Some(path.clone());
                tracing::debug!(checkpoint = %path.display(), batch = ts.batch, "checkpoint handed to the background writer");
            }
        }
        self.last_saved_batch = Some(ts.batch);
        self.saved.push(path);
        Ok(())
    }
}

impl<S: Setup> Callback<S> for Saver {
    /// Only rank 0 of a data-parallel run saves, unless the optimizer state is sharded: then
    /// every rank writes its own shard into rank 0's folder and rank 0 the rest (the folder
    /// is shared: one machine, or a file system all ranks mount). Wrapped in `OnEveryRank`,
    /// every rank of an unsharded run saves: give each rank its own folder (a folder has one
    /// writing process).
    fn ranks(&self) -> Ranks {
        Ranks::Shards
    }

    fn name(&self) -> &str {
        "checkpoint_saver"
    }

    fn needs_component_states(&self) -> bool {
        true
    }

    /// Before anything trains: the interval must be reachable, and the folder is created and
    /// locked for this process (one writer per folder; a folder that cannot be written fails
    /// here, not at the first save).
    fn init(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> CoreResult<()> {
        if let SaveInterval::Every(t) = &self.interval {
            state.check_countable("save_interval", *t)?;
        }
        // The other ranks of a sharded run only put their shards in rank 0's folder.
        if self.lock.is_none() && state.world().is_main() {
            self.lock = Some(lock_folder(&self.config.folder).map_err(CheckpointError::in_saver)?);
        }
        Ok(())
    }

    /// Before the first batch, once a checkpoint (if any) is restored: the folder may hold
    /// only checkpoints this run continues (see [`conflicting_checkpoints`]), unless
    /// overwriting is on.
    fn after_load(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> CoreResult<()> {
        if self.config.overwrite || !state.world().is_main() {
            return Ok(());
        }
        let start = state.timestamp().batch;
        let found = conflicting_checkpoints(&list_checkpoints(&self.config.folder), start);
        if found.is_empty() {
            return Ok(());
        }
        Err(CheckpointError::OtherRun {
            folder: self.config.folder.clone(),
            found: found
                .iter()
                .map(|(n, b)| format!("{n} (batch {b})"))
                .collect(),
            start,
        }
        .in_saver())
    }

    fn batch_start(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> CoreResult<()> {
        self.before = Some(state.timestamp().clone());
        Ok(())
    }

    fn batch_checkpoint(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> CoreResult<()> {
        // A callback may ask for a checkpoint at this batch (`Control::request_checkpoint`).
        let want = self.due(Event::BatchCheckpoint, state) || state.checkpoint_requested();
        if self.agree(state, ctl, want)? {
            self.save(state, ctl)?;
        }
        Ok(())
    }

    fn epoch_checkpoint(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> CoreResult<()> {
        let want = self.due(Event::EpochCheckpoint, state) || state.checkpoint_requested();
        if self.agree(state, ctl, want)? && self.last_saved_batch != Some(state.timestamp().batch) {
            self.save(state, ctl)?;
        }
        Ok(())
    }

    /// The state at the end of every fit is saved (unless it already was), so a run that was
    /// stopped early resumes from where it stopped; then background writes are awaited.
    fn fit_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> CoreResult<()> {
        if self.last_saved_batch != Some(state.timestamp().batch) {
            self.save(state, ctl)?;
        }
        if let Some(w) = &mut self.writer {
            w.wait().map_err(CheckpointError::in_saver)?;
        }
        // Every checkpoint of the run is in the store, or the run ends with an error naming
        // the ones that are not (they are in the local folder).
        #[cfg(feature = "remote")]
        if let Some(u) = &mut self.uploader {
            u.flush().map_err(CheckpointError::in_saver)?;
        }
        Ok(())
    }
}

/// The optimizer state of `state` (this rank's share in a sharded run), serialised as a
/// checkpoint holds it; `path` names the file in an error.
fn optimizer_bytes<S: Setup>(state: &State<S>, path: &Path) -> Result<Vec<u8>, CheckpointError> {
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    Recorder::<S::Backend>::record(&recorder, state.optimizer().to_record(), ()).map_err(|e| {
        CheckpointError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    })
}

/// The other ranks, which a sharded run always has.
fn peers<'c>(ctl: &'c mut Control<'_>) -> CoreResult<&'c mut (dyn Peers + 'c)> {
    match ctl.peers() {
        Some(p) => Ok(p),
        None => Err(CoreError::Component {
            component: "checkpoint_saver".into(),
            event: "save",
            message: "a sharded run without its other ranks (the trainer lends them to every callback of a data-parallel run)".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_render_from_the_timestamp() {
        let ts = Timestamp {
            epoch: 2,
            batch: 250,
            sample: 16000,
            batch_in_epoch: 0,
            ..Default::default()
        };
        assert_eq!(
            render_name("ep{epoch}-ba{batch}", &ts, 0).unwrap(),
            "ep2-ba250"
        );
        assert_eq!(
            render_name("r{rank}-sp{sample}", &ts, 3).unwrap(),
            "r3-sp16000"
        );
        for bad in [
            "ep{epochs}",
            "ep{epoch",
            "../x{batch}",
            "",
            ".hidden",
            "latest",
        ] {
            let err = render_name(bad, &ts, 0).unwrap_err().to_string();
            assert!(err.contains("name_template"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_new_run_conflicts_with_every_checkpoint_a_resumed_one_with_the_later_ones() {
        let existing: Vec<(String, u64)> = [("ep1-ba200", 200), ("ep0-ba80", 80), ("x", 100)]
            .iter()
            .map(|(n, b)| (n.to_string(), *b))
            .collect();
        let names = |start| -> Vec<String> {
            conflicting_checkpoints(&existing, start)
                .into_iter()
                .map(|(n, _)| n)
                .collect()
        };
        assert_eq!(names(0), ["ep0-ba80", "x", "ep1-ba200"]);
        assert_eq!(names(80), ["x", "ep1-ba200"]);
        assert_eq!(names(100), ["ep1-ba200"]);
        assert!(names(200).is_empty());
        assert!(conflicting_checkpoints(&[], 0).is_empty());
    }
}
