//! A run's log folder mirrored to an object store (Composer's `RemoteUploaderDownloader` for
//! logs): every file under the folder (JSONL, CSV, TensorBoard event files, the trace, plots)
//! is uploaded when it changed, every `interval` on a background thread and once more at the
//! end. A run that starts on an empty disk first downloads the files it lacks, so a resumed
//! run appends to the same JSONL and CSV files and the remote logs continue.
//!
//! Files are uploaded whole (a changed file replaces its object), which suits logs of a few
//! megabytes; file names must be valid key segments (see `uri::check_segment`), others are
//! reported and skipped, so nothing is written outside the prefix.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use super::store::RemoteStore;
use crate::error::CheckpointError;

type Seen = BTreeMap<String, (u64, SystemTime)>;

/// Files under `dir` (recursively) as `/`-joined relative paths, sorted.
fn local_files(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((path, rel)) = stack.pop() {
        let Ok(entries) = fs::read_dir(&path) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let r = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push((e.path(), r)),
                Ok(t) if t.is_file() => out.push((r, e.path())),
                _ => {}
            }
        }
    }
    out.sort();
    out
}

/// Uploads the files of `dir` that changed since `seen` (size or modification time).
fn sync_once(store: &RemoteStore, dir: &Path, seen: &mut Seen) -> Result<usize, CheckpointError> {
    let mut uploaded = 0;
    for (rel, path) in local_files(dir) {
        let Ok(meta) = fs::metadata(&path) else {
            continue;
        };
        let stamp = (
            meta.len(),
            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        );
        if seen.get(&rel) == Some(&stamp) {
            continue;
        }
        let parts: Vec<&str> = rel.split('/').collect();
        if let Some(bad) = parts.iter().find(|p| super::uri::check_segment(p).is_err()) {
            if !seen.contains_key(&rel) {
                tracing::warn!(file = %path.display(), segment = bad, "log file name cannot be an object key; not uploaded");
            }
            seen.insert(rel, stamp);
            continue;
        }
        let bytes = fs::read(&path).map_err(CheckpointError::io("read", &path))?;
        store.put(&parts, bytes)?;
        seen.insert(rel, stamp);
        uploaded += 1;
    }
    Ok(uploaded)
}

/// Mirrors a log folder to an object-store prefix; see the module documentation.
pub struct LogSync {
    store: Arc<RemoteStore>,
    dir: PathBuf,
    stop: Option<Sender<()>>,
    handle: Option<JoinHandle<Seen>>,
}

impl LogSync {
    /// Downloads the remote files that `dir` lacks (a run continuing on a new machine), then
    /// starts uploading changes every `interval`. Call before the loggers open their files.
    pub fn start(
        store: Arc<RemoteStore>,
        dir: &Path,
        interval: Duration,
    ) -> Result<Self, CheckpointError> {
        store.check()?;
        fs::create_dir_all(dir).map_err(CheckpointError::io("create folder", dir))?;
        let mut seen = Seen::new();
        for (rel, _) in store.list_files(&[])? {
            let parts: Vec<&str> = rel.split('/').collect();
            let local = parts.iter().fold(dir.to_path_buf(), |p, s| p.join(s));
            if local.exists() {
                continue;
            }
            if let Some(bytes) = store.get(&parts)? {
                if let Some(parent) = local.parent() {
                    fs::create_dir_all(parent)
                        .map_err(CheckpointError::io("create folder", parent))?;
                }
                crate::format::write_atomic(&local, &bytes)?;
                if let Ok(meta) = fs::metadata(&local) {
                    seen.insert(
                        rel.clone(),
                        (
                            meta.len(),
                            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                        ),
                    );
                }
                tracing::info!(file = %local.display(), "log file downloaded from the store");
            }
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let (s, d) = (store.clone(), dir.to_path_buf());
        let handle = std::thread::Builder::new()
            .name("flashover-log-uploader".into())
            .spawn(move || {
                super::lower_thread_priority();
                loop {
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => {
                            if let Err(e) = sync_once(&s, &d, &mut seen) {
                                tracing::warn!(error = %e, "log upload failed; retried at the next interval and at the end");
                            }
                        }
                        _ => return seen,
                    }
                }
            })
            .map_err(CheckpointError::io("start the log uploader for", dir))?;
        Ok(LogSync {
            store,
            dir: dir.to_path_buf(),
            stop: Some(stop),
            handle: Some(handle),
        })
    }

    /// Stops the background uploads and uploads what changed since, with a few attempts;
    /// call after the loggers have written their last lines (after `fit` and after the
    /// trainer is dropped). An upload that still fails is the error.
    pub fn finish(mut self) -> Result<(), CheckpointError> {
        // Marks the sync finished for `Drop`.
        self.stop.take();
        let mut seen = self
            .handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let mut wait = Duration::from_millis(500);
        let mut attempt = 1;
        loop {
            match sync_once(&self.store, &self.dir, &mut seen) {
                Ok(_) => return Ok(()),
                Err(e) if attempt >= 3 => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, attempt, "final log upload failed; retrying");
                    std::thread::sleep(wait);
                    wait *= 2;
                    attempt += 1;
                }
            }
        }
    }
}

impl Drop for LogSync {
    fn drop(&mut self) {
        // Without `finish` (an error path, when the logs matter most): one last upload
        // attempt, after the background thread (bounded by the store's timeouts) stops.
        if let Some(stop) = self.stop.take() {
            drop(stop);
            let mut seen = self
                .handle
                .take()
                .and_then(|h| h.join().ok())
                .unwrap_or_default();
            if let Err(e) = sync_once(&self.store, &self.dir, &mut seen) {
                tracing::warn!(error = %e, "the last log upload failed");
            }
        }
    }
}
