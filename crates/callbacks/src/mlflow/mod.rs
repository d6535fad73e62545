//! [`MlflowLogger`]: a run in an MLflow tracking server (Composer's `MLFlowLogger`), through
//! MLflow's REST API (`/api/2.0/mlflow/...`, and the artifact proxy
//! `/api/2.0/mlflow-artifacts/...` that `mlflow server` runs by default).
//!
//! - **Where**: the experiment is found by name or created; the run is created with the run's
//!   name and a tag `flashover_run_uid`. A resumed training run restores that uid from its
//!   checkpoint (the logger's state is saved with the checkpoint, under `logger/mlflow`) and
//!   finds the same MLflow run by it, so one training run is one MLflow run however often it
//!   is interrupted. The run is set back to `RUNNING` and ends `FINISHED` after a `FIT_END`,
//!   `FAILED` otherwise.
//! - **What**: the hyperparameters as params (and whole as the artifact `hyperparameters.json`;
//!   a param longer than MLflow takes, or changed on a resume, which MLflow refuses, is named
//!   in a warning and kept as a tag `flashover.param.<key>`), every metric with its step (the
//!   batch count) and its wall-clock time, tags (`flashover.backend`, `flashover.world_size`,
//!   `flashover.algorithms`, `flashover.precision`, `flashover.sharding`, `mlflow.source.*`,
//!   `mlflow.user`, `mlflow.source.git.commit` when `git` knows it, and the user's), texts as
//!   artifacts `text/<tag>/<batch>.txt`, images as `images/<tag>/<batch>.png`, files handed to
//!   [`upload_file`](LoggerDestination::upload_file) under their names, and, when asked, every
//!   checkpoint that appears in the save folder (`checkpoints/<name>/<file>`).
//! - **Never stalling a step**: the training thread only timestamps the values and hands them
//!   to a thread of the logger's own, which sends them in batches (up to MLflow's 1,000 values
//!   a request) every `flush_interval`. Files are linked (or copied) into a staging folder when
//!   handed over, so a checkpoint rotated away before its upload is still uploaded whole.
//! - **A server that is down or refuses**: a request that fails for the connection, a timeout,
//!   a 5xx or a 429 is retried with exponential backoff (capped at `max_backoff`), keeping
//!   everything queued; after `warn_after` failed attempts in a row a warning says so, and
//!   another when the server answers again. A request the server refuses (another 4xx) is
//!   dropped with a warning naming the server's message. Nothing here ever stops training:
//!   the local logs hold every value whatever MLflow does. At the end the thread keeps trying
//!   for `finish_timeout` (every request then ends by it), then warns how many values and
//!   files were not sent.
//! - **Credentials** come from the environment as MLflow's own client reads them
//!   (`MLFLOW_TRACKING_TOKEN` as a bearer token, `MLFLOW_TRACKING_USERNAME` and
//!   `MLFLOW_TRACKING_PASSWORD` as basic auth) or from a `user:password@` in the URI, and are
//!   never printed: the URI is shown without them and `Debug` hides them.
//!
//! Written against the REST API by hand (no Rust MLflow client is maintained); the HTTP client
//! is `reqwest`'s blocking one.

mod client;
mod worker;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flashover_core::error::Result;
use flashover_core::event::Event;
use flashover_core::logger::{Image, LoggerDestination};
use flashover_core::time::{Progress, Timestamp};
use serde_json::{Map, Value};

use crate::error::CallbackError;
pub use client::Credentials;
use worker::{Artifact, Msg, Source};

/// The tag that identifies a training run's MLflow run across resumptions.
pub const RUN_UID_TAG: &str = "flashover_run_uid";

/// Where and how an [`MlflowLogger`] logs.
#[derive(Clone)]
pub struct MlflowOptions {
    /// The tracking server: `http://host:port` or `https://...` (a path prefix allowed).
    pub tracking_uri: String,
    /// The experiment's name (created if missing). Default: `MLFLOW_EXPERIMENT_NAME`, else
    /// `flashover`.
    pub experiment: String,
    /// The run's name. Default: the program's name and the start time in seconds.
    pub run_name: Option<String>,
    /// Extra tags for the run.
    pub tags: Vec<(String, String)>,
    /// How often queued values are sent (default 2 s).
    pub flush_interval: Duration,
    /// A local checkpoint save folder whose checkpoints are uploaded as they complete (a
    /// checkpoint is complete once its `manifest.json` is written, which the saver does last).
    pub upload_checkpoints: Option<PathBuf>,
    /// Failed attempts in a row before a warning (default 4).
    pub warn_after: u32,
    /// The longest wait between two attempts (default 30 s).
    pub max_backoff: Duration,
    /// How long the end of the run waits for queued values to go out (default 60 s).
    pub finish_timeout: Duration,
    /// One request's time limit (default 60 s).
    pub request_timeout: Duration,
    /// Credentials (default: from the environment; see the module docs).
    pub credentials: Credentials,
}

impl std::fmt::Debug for MlflowOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlflowOptions")
            .field("tracking_uri", &client::redact_uri(&self.tracking_uri))
            .field("experiment", &self.experiment)
            .field("run_name", &self.run_name)
            .field("tags", &self.tags)
            .field("flush_interval", &self.flush_interval)
            .field("upload_checkpoints", &self.upload_checkpoints)
            .field("credentials", &self.credentials)
            .finish_non_exhaustive()
    }
}

impl MlflowOptions {
    /// Options for the server at `tracking_uri`, the rest default (credentials and
    /// experiment name from the environment).
    pub fn new(tracking_uri: impl Into<String>) -> Self {
        MlflowOptions {
            tracking_uri: tracking_uri.into(),
            experiment: std::env::var("MLFLOW_EXPERIMENT_NAME")
                .ok()
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "flashover".into()),
            run_name: None,
            tags: Vec::new(),
            flush_interval: Duration::from_secs(2),
            upload_checkpoints: None,
            warn_after: 4,
            max_backoff: Duration::from_secs(30),
            finish_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            credentials: Credentials::from_env(),
        }
    }

    /// Options from `MLFLOW_TRACKING_URI`, if it is set.
    pub fn from_env() -> Option<Self> {
        std::env::var("MLFLOW_TRACKING_URI")
            .ok()
            .filter(|u| !u.is_empty())
            .map(Self::new)
    }
}

/// What the logger's thread did, returned by [`MlflowRun::finish`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MlflowReport {
    /// The MLflow run, if one was opened.
    pub run_id: Option<String>,
    /// The experiment, if one was found or created.
    pub experiment_id: Option<String>,
    /// Metric values the server took.
    pub metrics_sent: u64,
    /// Metric values never sent (the server stayed down, or refused them).
    pub metrics_unsent: u64,
    /// Artifacts uploaded.
    pub artifacts_sent: u64,
    /// Artifacts never uploaded.
    pub artifacts_unsent: u64,
    /// Requests that failed (and were retried or dropped).
    pub failed_requests: u64,
    /// The status the run was ended with (`FINISHED`, `FAILED`), if it was.
    pub ended_as: Option<String>,
}

/// The thread and what the logger and its handles share.
struct Shared {
    tx: Mutex<Option<Sender<Msg>>>,
    thread: Mutex<Option<std::thread::JoinHandle<MlflowReport>>>,
    report: Mutex<Option<MlflowReport>>,
    staging: PathBuf,
    staged: AtomicU64,
    uri: String,
}

impl Shared {
    fn send(&self, msg: Msg) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            // The thread ends only through `finish`, after which nothing more is sent.
            let _ = tx.send(msg);
        }
    }

    /// Links `path` into the staging folder, so the upload reads it even if the original is
    /// replaced or removed meanwhile (a rotated checkpoint); where it cannot be linked (another
    /// file system), the upload reads the original, and nothing is copied on the training
    /// thread.
    fn stage(&self, path: &Path) -> std::io::Result<Source> {
        if !path.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "not a file",
            ));
        }
        std::fs::create_dir_all(&self.staging)?;
        let n = self.staged.fetch_add(1, Ordering::Relaxed);
        let to = self.staging.join(format!("{n:08}"));
        Ok(match std::fs::hard_link(path, &to) {
            Ok(()) => Source::Staged(to),
            Err(_) => Source::Original(path.to_path_buf()),
        })
    }

    fn finish(&self) -> MlflowReport {
        // Held throughout: a second caller waits for the first and gets the same report.
        let mut done = self.report.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(report) = done.clone() {
            return report;
        }
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Msg::Finish);
        }
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        let report = match handle.map(|h| h.join()) {
            Some(Ok(report)) => report,
            Some(Err(_)) => {
                tracing::warn!(uri = %self.uri, "the MLflow logger's thread panicked; the local logs hold every value");
                MlflowReport::default()
            }
            None => MlflowReport::default(),
        };
        let _ = std::fs::remove_dir_all(&self.staging);
        *done = Some(report.clone());
        report
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Logs a run to an MLflow tracking server; see the module docs.
///
/// ```no_run
/// use flashover_callbacks::{MlflowLogger, MlflowOptions};
/// let mlflow = MlflowLogger::new(MlflowOptions::new("http://127.0.0.1:5000"))?;
/// let run = mlflow.handle(); // for files after training, and `finish`
/// // .logger(mlflow) ... fit ... drop the trainer, then:
/// run.upload_file("model.safetensors", std::path::Path::new("out/model.safetensors"));
/// let report = run.finish();
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct MlflowLogger {
    shared: Arc<Shared>,
    uid: String,
    run_name: String,
    experiment: String,
    resumed: bool,
    opened: bool,
    checkpoints: Option<(PathBuf, BTreeSet<String>)>,
}

/// A handle on an [`MlflowLogger`]'s run, usable after the trainer (and the logger in it) is
/// gone: upload the files written after training, then end the run.
#[derive(Clone)]
pub struct MlflowRun {
    shared: Arc<Shared>,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// 128 random bits as hex, from the standard library's randomly keyed hasher.
fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::new();
    for _ in 0..2 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.write_u32(std::process::id());
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

fn program_name() -> String {
    std::env::args()
        .next()
        .and_then(|a| {
            Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "flashover".into())
}

impl MlflowLogger {
    /// A logger for the server and run `options` describe. Checks the URI; contacts the
    /// server only from its own thread, from the first logged value on.
    pub fn new(options: MlflowOptions) -> crate::error::Result<Self> {
        let (base, credentials) = client::parse_uri(&options.tracking_uri, &options.credentials)?;
        for (name, value) in [
            ("flush_interval", options.flush_interval),
            ("max_backoff", options.max_backoff),
            ("request_timeout", options.request_timeout),
        ] {
            if value.is_zero() {
                return Err(CallbackError::param(
                    "mlflow_logger",
                    name,
                    format!("{value:?}"),
                    "a duration greater than zero",
                ));
            }
        }
        if options.experiment.trim().is_empty() {
            return Err(CallbackError::param(
                "mlflow_logger",
                "experiment",
                format!("{:?}", options.experiment),
                "a non-empty experiment name",
            ));
        }
        let run_name = options.run_name.clone().unwrap_or_else(|| {
            let secs = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            format!("{}-{secs}", program_name())
        });
        let staging = std::env::temp_dir().join(format!(
            "flashover-mlflow-{}-{}",
            std::process::id(),
            &random_hex()[..8]
        ));
        let (tx, rx) = std::sync::mpsc::channel();
        let client = client::Client::new(base.clone(), credentials, options.request_timeout)?;
        let config = worker::Config {
            client,
            experiment: options.experiment.clone(),
            flush_interval: options.flush_interval,
            warn_after: options.warn_after.max(1),
            max_backoff: options.max_backoff,
            finish_timeout: options.finish_timeout,
            base_tags: base_tags(&options.tags),
        };
        let thread = std::thread::Builder::new()
            .name("flashover-mlflow".into())
            .spawn(move || worker::run(config, rx))
            .map_err(|e| CallbackError::io("mlflow_logger", "a thread", e))?;
        let shared = Arc::new(Shared {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            report: Mutex::new(None),
            staging,
            staged: AtomicU64::new(0),
            uri: base,
        });
        Ok(MlflowLogger {
            shared,
            uid: random_hex(),
            run_name,
            experiment: options.experiment,
            resumed: false,
            opened: false,
            checkpoints: options.upload_checkpoints.map(|p| (p, BTreeSet::new())),
        })
    }

    /// A handle for files after training and for ending the run.
    pub fn handle(&self) -> MlflowRun {
        MlflowRun {
            shared: self.shared.clone(),
        }
    }

    /// The run's name.
    pub fn run_name(&self) -> &str {
        &self.run_name
    }

    /// The uid tagged on the MLflow run (`flashover_run_uid`).
    pub fn run_uid(&self) -> &str {
        &self.uid
    }

    fn open(&mut self) {
        if !self.opened {
            self.opened = true;
            self.shared.send(Msg::Open {
                uid: self.uid.clone(),
                run_name: self.run_name.clone(),
                resumed: self.resumed,
                start_ms: now_ms(),
            });
        }
    }

    fn stage_and_send(&self, name: String, path: &Path) -> Result<()> {
        let source = self
            .shared
            .stage(path)
            .map_err(|e| CallbackError::io("mlflow_logger", path, e))?;
        self.shared.send(Msg::Artifact(Artifact { name, source }));
        Ok(())
    }

    /// Queues the checkpoints in the save folder that are complete and not yet uploaded.
    fn upload_new_checkpoints(&mut self) -> Result<()> {
        let Some((folder, done)) = &self.checkpoints else {
            return Ok(());
        };
        let Ok(entries) = std::fs::read_dir(folder) else {
            return Ok(());
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().join("manifest.json").is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !done.contains(n) && !n.starts_with('.'))
            .collect();
        names.sort();
        let folder = folder.clone();
        for name in names {
            let dir = folder.join(&name);
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map_err(|e| CallbackError::io("mlflow_logger", &dir, e))?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            // The manifest last, as the saver writes it: a checkpoint with its manifest in
            // the store is whole.
            files.sort_by_key(|p| p.file_name().is_some_and(|n| n == "manifest.json"));
            for file in files {
                let file_name = file
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                self.stage_and_send(format!("checkpoints/{name}/{file_name}"), &file)?;
            }
            if let Some((_, done)) = &mut self.checkpoints {
                done.insert(name);
            }
        }
        Ok(())
    }
}

fn base_tags(extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut tags = vec![
        ("mlflow.source.name".to_string(), program_name()),
        ("mlflow.source.type".to_string(), "LOCAL".to_string()),
    ];
    if let Ok(user) = std::env::var("USER") {
        tags.push(("mlflow.user".into(), user));
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|c| c.len() == 40 && c.chars().all(|c| c.is_ascii_hexdigit()));
    if let Some(commit) = commit {
        tags.push(("mlflow.source.git.commit".into(), commit));
    }
    tags.extend(extra.iter().cloned());
    tags
}

/// Whether `name` is a file name the loggers take; warns if not.
fn name_ok(name: &str) -> bool {
    match flashover_core::logger::check_file_name(name) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "MLflow: file not uploaded");
            false
        }
    }
}

impl MlflowRun {
    /// Uploads the file at `path` as the artifact `name` (linked or copied first, so the file
    /// may change afterwards). Errors (a missing file, a bad name) are warned about, not
    /// returned: a file that cannot reach MLflow is still where it was.
    pub fn upload_file(&self, name: &str, path: &Path) {
        if !name_ok(name) {
            return;
        }
        match self.shared.stage(path) {
            Ok(source) => self.shared.send(Msg::Artifact(Artifact {
                name: name.to_string(),
                source,
            })),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "MLflow: file not uploaded")
            }
        }
    }

    /// Uploads `value` as the JSON artifact `name` (the run's summary, say).
    pub fn upload_json(&self, name: &str, value: &Value) {
        if !name_ok(name) {
            return;
        }
        let text = serde_json::to_vec_pretty(value).unwrap_or_default();
        self.shared.send(Msg::Artifact(Artifact {
            name: name.to_string(),
            source: Source::Bytes(text),
        }));
    }

    /// Sends what is queued, ends the run (`FINISHED` if training reached its `FIT_END`,
    /// `FAILED` if not), and stops the thread: at most `finish_timeout` after the server
    /// stops answering. Call it after the trainer is gone (values logged after it are not
    /// sent); dropping the last logger and handle does the same.
    pub fn finish(&self) -> MlflowReport {
        self.shared.finish()
    }
}

impl LoggerDestination for MlflowLogger {
    fn name(&self) -> &str {
        "mlflow"
    }

    fn log_hyperparameters(&mut self, params: &Map<String, Value>) -> Result<()> {
        self.open();
        self.shared.send(Msg::Params(params.clone()));
        Ok(())
    }

    fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        self.open();
        self.shared.send(Msg::Metrics {
            time_ms: now_ms(),
            step: timestamp.batch as i64,
            values: metrics.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        });
        Ok(())
    }

    fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        self.open();
        self.shared.send(Msg::Artifact(Artifact {
            name: crate::media::text_name(tag, timestamp.batch),
            source: Source::Bytes(text.as_bytes().to_vec()),
        }));
        Ok(())
    }

    fn log_image(&mut self, timestamp: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        self.open();
        self.shared.send(Msg::Artifact(Artifact {
            name: crate::media::image_name(tag, timestamp.batch),
            source: Source::Bytes(crate::media::encode_png(image)),
        }));
        Ok(())
    }

    fn upload_file(&mut self, _timestamp: &Timestamp, name: &str, path: &Path) -> Result<()> {
        self.open();
        self.stage_and_send(name.to_string(), path)
    }

    /// The run's uid (to find its MLflow run again), name and experiment, and the
    /// checkpoints already uploaded (not uploaded again after a resume).
    fn state_dict(&self) -> Value {
        let uploaded: Vec<&String> = self
            .checkpoints
            .as_ref()
            .map(|(_, done)| done.iter().collect())
            .unwrap_or_default();
        serde_json::json!({
            "run_uid": self.uid,
            "run_name": self.run_name,
            "experiment": self.experiment,
            "uploaded_checkpoints": uploaded,
        })
    }

    fn load_state_dict(&mut self, state: Value) -> Result<()> {
        let uid = state
            .get("run_uid")
            .and_then(Value::as_str)
            .filter(|u| !u.is_empty() && u.chars().all(|c| c.is_ascii_alphanumeric()))
            .ok_or_else(|| CallbackError::BadState {
                component: "mlflow_logger",
                reason: format!("expected {{\"run_uid\": <letters and digits>, ...}}, got {state}"),
            })?;
        self.uid = uid.to_string();
        if let Some(name) = state.get("run_name").and_then(Value::as_str) {
            self.run_name = name.to_string();
        }
        if let (Some((_, done)), Some(names)) = (
            &mut self.checkpoints,
            state.get("uploaded_checkpoints").and_then(Value::as_array),
        ) {
            done.extend(names.iter().filter_map(Value::as_str).map(str::to_string));
        }
        self.resumed = true;
        Ok(())
    }

    fn run_event(&mut self, event: Event, _ts: &Timestamp, _progress: &Progress) -> Result<()> {
        match event {
            Event::FitStart => {
                self.open();
                self.shared.send(Msg::FitStarted);
            }
            Event::BatchCheckpoint | Event::EpochCheckpoint => self.upload_new_checkpoints()?,
            Event::FitEnd => {
                self.upload_new_checkpoints()?;
                self.shared.send(Msg::FitEnded);
            }
            _ => {}
        }
        Ok(())
    }
}
