//! Checkpoints between a local save folder and an object-store prefix.
//!
//! # Remote layout
//!
//! The prefix mirrors the local folder: one "directory" per checkpoint holding the same
//! files, and a `latest` object naming the newest uploaded checkpoint:
//!
//! ```text
//! s3://bucket/prefix/
//!   latest                       "ep3-ba375", written after that checkpoint's manifest
//!   ep3-ba375/manifest.json      uploaded last: without it a checkpoint is incomplete
//!   ep3-ba375/model.safetensors
//!   ep3-ba375/optimizer.mpk
//!   ep3-ba375/trainer_state.json
//! ```
//!
//! An upload takes a checkpoint that was written and verified locally, deletes the remote
//! manifest of that name first (so a replaced checkpoint is never half old, half new with a
//! manifest), uploads the other files, then the manifest, then `latest` (only if no newer
//! checkpoint was uploaded before it). Rotation deletes a remote checkpoint's manifest first,
//! then its files. Reading picks only checkpoints whose manifest parses, downloads every file
//! into the local folder through a scratch directory, checks each size and SHA-256 against
//! the manifest, and renames the directory into place: the local copy is then an ordinary,
//! verified checkpoint.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::store::RemoteStore;
use crate::error::CheckpointError;
use crate::format::{
    parse_manifest, read_manifest, read_verified, sha256_hex, sync_dir, Manifest, LATEST, MANIFEST,
};
use crate::load::{
    autoresume_with, find_resumable, AutoresumeOptions, CheckpointRestore, LoadOptions,
};
use crate::lock::lock_folder;
use crate::retention::retention;

/// A checkpoint in the store whose manifest could be read.
#[derive(Debug, Clone)]
pub struct RemoteCheckpoint {
    /// Its name (the directory under the prefix).
    pub name: String,
    /// Its manifest.
    pub manifest: Manifest,
}

/// [`list_remote`]'s answer: the checkpoints, and the names passed over with the reason.
pub type RemoteListing = (Vec<RemoteCheckpoint>, Vec<(String, CheckpointError)>);

/// A local checkpoint read for upload: its manifest, the manifest's bytes, and each file.
type LocalCopy = (Manifest, Vec<u8>, Vec<(String, Vec<u8>)>);

/// The remote directory `name` as a checkpoint: `None` for a name that cannot be a key or is
/// hidden (not a checkpoint), its manifest, or why it is passed over (no manifest: an upload
/// that did not finish; an unreadable one). Errors are the store's.
fn read_entry(
    store: &RemoteStore,
    name: &str,
) -> Result<Option<Result<Manifest, CheckpointError>>, CheckpointError> {
    if super::uri::check_segment(name).is_err() || name.starts_with('.') {
        return Ok(None);
    }
    let manifest_uri = PathBuf::from(store.describe(&[name, MANIFEST]));
    match store.get(&[name, MANIFEST])? {
        None => Ok(Some(Err(CheckpointError::damaged(
            &manifest_uri,
            "no manifest: its upload did not finish (or it is not a checkpoint)",
        )))),
        Some(bytes) => match parse_manifest(&bytes, &manifest_uri) {
            Ok(manifest) => Ok(Some(Ok(manifest))),
            Err(e @ CheckpointError::Damaged { .. }) => Ok(Some(Err(e))),
            Err(e) => Err(e),
        },
    }
}

/// What the prefix holds: checkpoints with a readable manifest (newest first: most batches,
/// then the one `latest` names, then the later name), and the names passed over (no
/// manifest, an unreadable one, or a name that cannot be a key) with the reason.
pub fn list_remote(store: &RemoteStore) -> Result<RemoteListing, CheckpointError> {
    let latest = store
        .get(&[LATEST])?
        .and_then(|b| String::from_utf8(b).ok())
        .map(|s| s.trim().to_string());
    let mut found = Vec::new();
    let mut skipped = Vec::new();
    for name in store.list_dirs(&[])? {
        match read_entry(store, &name)? {
            None => tracing::debug!(name, "not a checkpoint name; ignored"),
            Some(Ok(manifest)) => found.push(RemoteCheckpoint { name, manifest }),
            Some(Err(e)) => skipped.push((name, e)),
        }
    }
    found.sort_by(|a, b| {
        let is_latest = |c: &RemoteCheckpoint| latest.as_deref() == Some(c.name.as_str());
        b.manifest
            .batch
            .cmp(&a.manifest.batch)
            .then(is_latest(b).cmp(&is_latest(a)))
            .then(b.name.cmp(&a.name))
    });
    Ok((found, skipped))
}

/// Downloads checkpoint `name` into `local/name`: every file the manifest lists, each checked
/// for size and SHA-256 as it arrives, through a scratch directory renamed into place (an
/// existing local directory of that name is replaced). A missing or wrong file is
/// [`CheckpointError::Damaged`] naming the remote object; nothing is left behind.
pub fn download_checkpoint(
    store: &RemoteStore,
    name: &str,
    local: &Path,
) -> Result<PathBuf, CheckpointError> {
    let manifest_uri = PathBuf::from(store.describe(&[name, MANIFEST]));
    let manifest_bytes = store.get(&[name, MANIFEST])?.ok_or_else(|| {
        CheckpointError::damaged(
            &manifest_uri,
            "no manifest: its upload did not finish (or there is no such checkpoint)",
        )
    })?;
    let manifest = parse_manifest(&manifest_bytes, &manifest_uri)?;
    for entry in &manifest.files {
        if let Err(e) = super::uri::check_segment(&entry.name) {
            return Err(CheckpointError::damaged(
                &manifest_uri,
                format!("lists a file name that cannot be a key: {e}"),
            ));
        }
    }
    fs::create_dir_all(local).map_err(CheckpointError::io("create folder", local))?;
    let scratch = local.join(format!(".tmp-dl-{name}-{}", std::process::id()));
    if scratch.exists() {
        fs::remove_dir_all(&scratch).map_err(CheckpointError::io("remove stale", &scratch))?;
    }
    let result = (|| {
        fs::create_dir(&scratch).map_err(CheckpointError::io("create", &scratch))?;
        for entry in &manifest.files {
            let uri = PathBuf::from(store.describe(&[name, &entry.name]));
            let bytes = store.get(&[name, &entry.name])?.ok_or_else(|| {
                CheckpointError::damaged(&uri, "listed in the manifest but missing")
            })?;
            if bytes.len() as u64 != entry.bytes {
                return Err(CheckpointError::damaged(
                    &uri,
                    format!("{} bytes, the manifest says {}", bytes.len(), entry.bytes),
                ));
            }
            if sha256_hex(&bytes) != entry.sha256 {
                return Err(CheckpointError::damaged(
                    &uri,
                    "content does not match the manifest's SHA-256",
                ));
            }
            write_synced(&scratch.join(&entry.name), &bytes)?;
        }
        write_synced(&scratch.join(MANIFEST), &manifest_bytes)?;
        sync_dir(&scratch);
        crate::format::rename_into_place(local, &scratch, name)
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&scratch);
    }
    result
}

/// The name a damaged remote checkpoint's manifest is kept under once autoresume has passed
/// over it: the checkpoint is then incomplete (never chosen, replaceable by the resumed run),
/// and the evidence stays for inspection. The remote counterpart of `<name>.damaged`.
pub const DAMAGED_MANIFEST: &str = "manifest.json.damaged";

fn mark_incomplete(store: &RemoteStore, name: &str) -> Result<(), CheckpointError> {
    if let Some(bytes) = store.get(&[name, MANIFEST])? {
        store.put(&[name, DAMAGED_MANIFEST], bytes)?;
        store.delete(&[name, MANIFEST])?;
    }
    Ok(())
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(CheckpointError::io("create", path))?;
    f.write_all(bytes)
        .map_err(CheckpointError::io("write", path))?;
    f.sync_all().map_err(CheckpointError::io("sync", path))
}

/// The batch count of the newest intact local checkpoint that can resume a run.
fn local_newest(local: &Path) -> Result<Option<u64>, CheckpointError> {
    let (found, _) = find_resumable(local)?;
    Ok(match found {
        Some(dir) => Some(read_manifest(&dir)?.batch),
        None => None,
    })
}

/// Brings the newest remote checkpoint that verifies into `local` when it is newer than the
/// newest intact local one, passing over damaged and incomplete remote ones with a warning
/// naming them. Returns the damaged ones (a manifest that does not parse or does not match
/// the files: names and errors; incomplete uploads, without a manifest, are not damage, like
/// a local save's scratch) and whether a resumable checkpoint is now local.
fn pull_newest(
    store: &RemoteStore,
    local: &Path,
) -> Result<(Vec<(String, String)>, bool), CheckpointError> {
    let have = local_newest(local)?;
    let (found, skipped) = list_remote(store)?;
    let mut damaged = Vec::new();
    for (name, e) in skipped {
        tracing::warn!(checkpoint = %store.describe(&[&name]), error = %e, "skipping an incomplete or unreadable remote checkpoint");
        if store.get(&[&name, MANIFEST])?.is_some() {
            damaged.push((name, e.to_string()));
        }
    }
    for c in found {
        if c.manifest.weights_only {
            tracing::warn!(checkpoint = %store.describe(&[&c.name]), "skipping a weights-only remote checkpoint: it cannot resume a run");
            continue;
        }
        if have.is_some_and(|b| b >= c.manifest.batch) {
            // The local folder already has this or something newer.
            return Ok((damaged, true));
        }
        match download_checkpoint(store, &c.name, local) {
            Ok(dir) => {
                tracing::info!(checkpoint = %store.describe(&[&c.name]), local = %dir.display(), "downloaded and verified");
                return Ok((damaged, true));
            }
            Err(e @ CheckpointError::Damaged { .. }) => {
                tracing::warn!(checkpoint = %store.describe(&[&c.name]), error = %e, "skipping a damaged remote checkpoint");
                damaged.push((c.name.clone(), e.to_string()));
            }
            Err(e) => return Err(e),
        }
    }
    Ok((damaged, have.is_some()))
}

/// Autoresume from an object store: with `local` as the local save folder (empty on a new
/// machine), the newest remote checkpoint that verifies is downloaded into it when it is
/// newer than what `local` holds, then [`autoresume_with`] resumes from `local` as usual
/// (and holds its lock). Damaged and incomplete remote checkpoints are skipped with a
/// warning naming them; the damaged ones' manifests are then kept as [`DAMAGED_MANIFEST`]
/// (never deleted), so that the resumed run can save those names again. If the store holds
/// damaged checkpoints and nothing verifies, remote or local, it is
/// [`CheckpointError::NothingIntact`] and nothing is changed, unless `options` ask for a
/// fresh start. A store that cannot be reached is an error, never taken for an empty one.
pub fn autoresume_remote(
    store: &RemoteStore,
    local: &Path,
    options: AutoresumeOptions,
) -> Result<Option<CheckpointRestore>, CheckpointError> {
    fs::create_dir_all(local).map_err(CheckpointError::io("create folder", local))?;
    let lock = lock_folder(local)?;
    let (damaged, usable) = pull_newest(store, local)?;
    if !usable && !damaged.is_empty() && !options.fresh_start_if_damaged {
        return Err(CheckpointError::NothingIntact {
            folder: PathBuf::from(store.uri().to_string()),
            damaged: damaged.into_iter().map(|(_, e)| e).collect(),
        });
    }
    for (name, _) in &damaged {
        mark_incomplete(store, name)?;
        tracing::warn!(
            checkpoint = %store.describe(&[name]),
            "damaged remote checkpoint marked incomplete: its manifest is kept as {DAMAGED_MANIFEST}"
        );
    }
    let restore = autoresume_with(local, options);
    drop(lock);
    restore
}

/// Autoresume for the other ranks of a data-parallel run, after rank 0's
/// [`autoresume_remote`]: the same checkpoint, downloaded into `local` if this machine does
/// not have it yet, with nothing locked, moved or deleted.
pub fn autoresume_remote_read_only(
    store: &RemoteStore,
    local: &Path,
) -> Result<Option<CheckpointRestore>, CheckpointError> {
    pull_newest(store, local)?;
    crate::load::autoresume_read_only(local)
}

/// `--load` from an object store: `uri` names one checkpoint (its last segment, or `latest`
/// for the one the prefix's `latest` object names), which is downloaded into `cache`,
/// verified, and restored with `options`. Damage is an error here, not a reason to look
/// elsewhere.
pub fn load_remote(
    store: &RemoteStore,
    name: &str,
    cache: &Path,
    options: LoadOptions,
) -> Result<CheckpointRestore, CheckpointError> {
    // A missing bucket or refused credentials are said as such, not as a missing object.
    store.check()?;
    let name = if name == LATEST {
        let bytes = store
            .get(&[LATEST])?
            .ok_or_else(|| CheckpointError::Remote {
                action: "read",
                uri: store.describe(&[LATEST]),
                reason: "no such object: nothing was uploaded to this prefix yet".into(),
            })?;
        let text = String::from_utf8_lossy(&bytes).trim().to_string();
        super::uri::check_segment(&text).map_err(|e| {
            CheckpointError::damaged(store.describe(&[LATEST]), format!("names {e}"))
        })?;
        text
    } else {
        name.to_string()
    };
    let dir = download_checkpoint(store, &name, cache)?;
    Ok(CheckpointRestore::new(dir, options))
}

/// Uploads the local checkpoint `local/name` (read and verified first, so what goes up is
/// what was saved): the remote manifest of that name is deleted, the files are put, then the
/// manifest. `latest` is not touched. `None` if the local directory is gone (rotated away).
/// A complete remote checkpoint of that name with another manifest is
/// [`CheckpointError::Exists`] unless `overwrite`.
fn upload_files(
    store: &RemoteStore,
    local: &Path,
    name: &str,
    overwrite: bool,
) -> Result<Option<Manifest>, CheckpointError> {
    let dir = local.join(name);
    if !dir.exists() {
        return Ok(None);
    }
    let read = || -> Result<LocalCopy, CheckpointError> {
        let manifest = read_manifest(&dir)?;
        let manifest_bytes = fs::read(dir.join(MANIFEST))
            .map_err(CheckpointError::io("read", dir.join(MANIFEST)))?;
        let mut files = Vec::new();
        for e in &manifest.files {
            files.push((e.name.clone(), read_verified(&dir, &manifest, &e.name)?));
        }
        Ok((manifest, manifest_bytes, files))
    };
    let (manifest, manifest_bytes, files) = match read() {
        Ok(x) => x,
        Err(_) if !dir.exists() => return Ok(None),
        Err(e) => return Err(e),
    };
    // A complete remote checkpoint of this name with another manifest is another run's
    // (autoresume marks the damaged ones it passes over as incomplete): replaced only when
    // asked, as locally.
    // A HEAD first: a new name (the usual case) costs no download.
    let existing = if store.exists(&[name, MANIFEST])? {
        store.get(&[name, MANIFEST])?
    } else {
        None
    };
    let replacing = existing.is_some();
    match existing {
        // Already complete in the store (an earlier attempt got this far).
        Some(existing) if existing == manifest_bytes => return Ok(Some(manifest)),
        Some(_) if !overwrite => {
            return Err(CheckpointError::Exists {
                path: PathBuf::from(store.describe(&[name])),
            })
        }
        _ => {}
    }
    // The old manifest goes first, so that a replacement cut short is incomplete, never a
    // mix that looks whole (a new name has none to delete: one request fewer).
    if replacing {
        store.delete(&[name, MANIFEST])?;
    }
    for (file, bytes) in files {
        store.put(&[name, &file], bytes)?;
    }
    store.put(&[name, MANIFEST], manifest_bytes)?;
    Ok(Some(manifest))
}

/// Uploads the local checkpoint `local/name` to the store and points the store's `latest`
/// at it, as the saver's background uploader does (without its retries and rotation): for
/// pushing an existing checkpoint by hand, and for measuring uploads.
pub fn upload_checkpoint(
    store: &RemoteStore,
    local: &Path,
    name: &str,
    overwrite: bool,
) -> Result<(), CheckpointError> {
    if upload_files(store, local, name, overwrite)?.is_none() {
        return Err(CheckpointError::Io {
            action: "upload",
            path: local.join(name),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such local checkpoint"),
        });
    }
    store.put(&[LATEST], name.as_bytes().to_vec())
}

/// How the uploader retries a checkpoint whose upload failed.
#[derive(Debug, Clone)]
pub struct UploadRetry {
    /// Attempts per round (each after the store's own retries of each request).
    pub attempts: u32,
    /// The wait after the first failed attempt, doubled after each.
    pub backoff: Duration,
    /// While a checkpoint is waiting, another round starts this often (and whenever a new
    /// checkpoint arrives, and at the end of `fit`).
    pub round_every: Duration,
}

impl Default for UploadRetry {
    fn default() -> Self {
        UploadRetry {
            attempts: 3,
            backoff: Duration::from_millis(500),
            round_every: Duration::from_secs(10),
        }
    }
}

enum Msg {
    Upload(String),
    Flush(Sender<Vec<String>>),
}

/// The background uploader a saver with a remote runs: checkpoints it is told about are
/// uploaded in order on its own thread, so training never waits for the network; the thread
/// runs at a lower priority ([`super::BACKGROUND_NICE`]), so it takes no CPU time from
/// training when every core is busy.
pub(crate) struct Uploader {
    tx: Option<Sender<Msg>>,
    handle: Option<JoinHandle<()>>,
    store: Arc<RemoteStore>,
    local: PathBuf,
}

/// The sending side, given to the writer so that a checkpoint is queued as soon as it is on
/// disk.
#[derive(Clone)]
pub(crate) struct UploadQueue(Sender<Msg>);

impl UploadQueue {
    pub(crate) fn push(&self, name: &str) {
        // A stopped uploader is reported by `flush`.
        let _ = self.0.send(Msg::Upload(name.to_string()));
    }
}

enum Outcome {
    Done,
    /// Rotated away locally before it could be uploaded: a newer one supersedes it.
    Gone,
}

struct Worker {
    store: Arc<RemoteStore>,
    local: PathBuf,
    keep: usize,
    overwrite: bool,
    retry: UploadRetry,
    newest_uploaded: Option<u64>,
    /// Checkpoints that no retry can upload (a name taken by another run's checkpoint).
    permanent: Vec<String>,
    /// What this run knows of the prefix, so that rotation lists it once per upload instead
    /// of downloading every manifest and `latest` again: the batch of each complete remote
    /// checkpoint it uploaded or read, ...
    complete: HashMap<String, u64>,
    /// ... the names it found without a readable manifest (left alone, as by
    /// [`list_remote`]), ...
    passed_over: HashSet<String>,
    /// ... and what `latest` names (`None` until read or written). The uploader is the
    /// prefix's one writer while the run lasts (as the local folder's lock makes the saver
    /// the local folder's), so what it wrote stays true.
    latest: Option<Option<String>>,
}

impl Worker {
    fn upload(&mut self, name: &str) -> Result<Outcome, CheckpointError> {
        let Some(manifest) = upload_files(&self.store, &self.local, name, self.overwrite)? else {
            return Ok(Outcome::Gone);
        };
        self.passed_over.remove(name);
        self.complete.insert(name.to_string(), manifest.batch);
        // `latest` moves forward only: a retried older checkpoint does not take it back.
        if self.newest_uploaded.is_none_or(|b| manifest.batch >= b) {
            // Unknown while the request is out: a failed put may or may not have landed.
            self.latest = None;
            self.store.put(&[LATEST], name.as_bytes().to_vec())?;
            self.latest = Some(Some(name.to_string()));
            self.newest_uploaded = Some(manifest.batch);
        }
        tracing::info!(checkpoint = %self.store.describe(&[name]), "checkpoint uploaded");
        // The checkpoint is in the store: a failed rotation is retried after the next upload,
        // not a reason to upload this one again.
        if let Err(e) = self.rotate(name) {
            tracing::warn!(error = %e, "rotating the remote checkpoints failed; retried after the next upload");
        }
        Ok(Outcome::Done)
    }

    /// Keep-N on the remote copies: the same policy as the local folder; the checkpoint just
    /// uploaded, and the one `latest` names, are never deleted.
    fn rotate(&mut self, uploaded: &str) -> Result<(), CheckpointError> {
        if self.keep == 0 {
            return Ok(());
        }
        let latest = match &self.latest {
            Some(known) => known.clone(),
            None => {
                let read = self
                    .store
                    .get(&[LATEST])?
                    .map(|b| String::from_utf8_lossy(&b).trim().to_string());
                self.latest = Some(read.clone());
                read
            }
        };
        // One listing; only the names this run has not seen yet have their manifest read
        // (`read_entry`, as `list_remote`: a name that cannot be a key, a hidden one, or one
        // without a readable manifest is left alone).
        let names = self.store.list_dirs(&[])?;
        self.complete.retain(|n, _| names.contains(n));
        self.passed_over.retain(|n| names.contains(n));
        for name in names {
            if self.complete.contains_key(&name) || self.passed_over.contains(&name) {
                continue;
            }
            match read_entry(&self.store, &name)? {
                Some(Ok(m)) => {
                    self.complete.insert(name, m.batch);
                }
                None | Some(Err(_)) => {
                    self.passed_over.insert(name);
                }
            }
        }
        let existing: Vec<(String, u64)> =
            self.complete.iter().map(|(n, b)| (n.clone(), *b)).collect();
        for old in retention(&existing, self.keep) {
            if old == uploaded || latest.as_deref() == Some(old.as_str()) {
                continue;
            }
            // The manifest first: a deletion cut short leaves an incomplete checkpoint, never
            // one that looks whole (and left alone from then on, as any incomplete one).
            self.store.delete(&[&old, MANIFEST])?;
            self.complete.remove(&old);
            self.passed_over.insert(old.clone());
            for (file, _) in self.store.list_files(&[&old])? {
                let parts: Vec<&str> = std::iter::once(old.as_str())
                    .chain(file.split('/'))
                    .collect();
                self.store.delete(&parts)?;
            }
            tracing::info!(checkpoint = %self.store.describe(&[&old]), "old remote checkpoint deleted");
        }
        Ok(())
    }

    /// One round over the waiting checkpoints, oldest first, each with bounded retries; the
    /// round ends at the first checkpoint that still fails, unless it is the round that
    /// `flush` asks for (`every`): there each later checkpoint is tried once more (one attempt:
    /// the store is failing), so that the end of fit reports each one's own error, not the
    /// first one's.
    fn round(&mut self, waiting: &mut Vec<(String, Option<String>)>, every: bool) {
        // Rotated away locally: superseded by a newer checkpoint, nothing to upload.
        waiting.retain(|(name, _)| {
            let here = self.local.join(name).exists();
            if !here {
                tracing::debug!(checkpoint = %name, "rotated away locally before its upload; a newer checkpoint supersedes it");
            }
            here
        });
        let mut i = 0;
        let mut failing = false;
        while let Some(name) = waiting.get(i).map(|w| w.0.clone()) {
            let mut wait = self.retry.backoff;
            let mut last = None;
            let attempts = if failing {
                1
            } else {
                self.retry.attempts.max(1)
            };
            for attempt in 1..=attempts {
                match self.upload(&name) {
                    Ok(Outcome::Done) => {
                        last = None;
                        break;
                    }
                    Ok(Outcome::Gone) => {
                        tracing::info!(checkpoint = %name, "rotated away locally before its upload; a newer checkpoint supersedes it");
                        last = None;
                        break;
                    }
                    Err(e @ (CheckpointError::Exists { .. } | CheckpointError::Config { .. })) => {
                        // No retry can fix these: reported at the end, and the checkpoints
                        // after it go on uploading.
                        tracing::warn!(
                            checkpoint = %self.store.describe(&[&name]),
                            error = %e,
                            "checkpoint cannot be uploaded"
                        );
                        self.permanent.push(format!("{name} ({e})"));
                        last = None;
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(
                            checkpoint = %self.store.describe(&[&name]),
                            attempt,
                            of = self.retry.attempts,
                            error = %e,
                            "checkpoint upload failed"
                        );
                        last = Some(e.to_string());
                        if attempt < attempts {
                            std::thread::sleep(wait);
                            wait *= 2;
                        }
                    }
                }
            }
            match last {
                None => {
                    waiting.remove(i);
                }
                Some(e) => {
                    // Each checkpoint keeps its own last error (warned about once).
                    let queued = |w: &(String, Option<String>)| {
                        tracing::warn!(
                            checkpoint = %self.store.describe(&[&w.0]),
                            local = %self.local.join(&w.0).display(),
                            "checkpoint not uploaded yet; it stays queued and is retried (training goes on; the end of fit fails if it never uploads)"
                        );
                    };
                    if waiting[i].1.is_none() {
                        queued(&waiting[i]);
                    }
                    waiting[i].1 = Some(e);
                    i += 1;
                    failing = true;
                    if every {
                        continue;
                    }
                    // The store is failing: the rest of the round waits for the next one
                    // (a new checkpoint, `round_every`, or the end of fit) instead of
                    // spending the same attempts on each.
                    for w in waiting.iter_mut().skip(i) {
                        if w.1.is_none() {
                            queued(w);
                            w.1 = Some(format!(
                                "not attempted yet: uploads paused after {name} failed"
                            ));
                        }
                    }
                    return;
                }
            }
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        // Training first when the cores are all busy.
        super::lower_thread_priority();
        let mut waiting: Vec<(String, Option<String>)> = Vec::new();
        loop {
            let msg = if waiting.is_empty() {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(self.retry.round_every)
            };
            match msg {
                Ok(Msg::Upload(name)) => {
                    waiting.retain(|(n, _)| *n != name);
                    waiting.push((name, None));
                    // Whatever else arrived meanwhile joins this round.
                    let mut flush = Vec::new();
                    while let Ok(m) = rx.try_recv() {
                        match m {
                            Msg::Upload(n) => {
                                waiting.retain(|(w, _)| *w != n);
                                waiting.push((n, None));
                            }
                            Msg::Flush(reply) => flush.push(reply),
                        }
                    }
                    self.round(&mut waiting, false);
                    for reply in flush {
                        self.round(&mut waiting, true);
                        let _ = reply.send(self.failures(&waiting));
                    }
                }
                Ok(Msg::Flush(reply)) => {
                    self.round(&mut waiting, true);
                    let _ = reply.send(self.failures(&waiting));
                }
                Err(RecvTimeoutError::Timeout) => self.round(&mut waiting, false),
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

impl Worker {
    fn failures(&self, waiting: &[(String, Option<String>)]) -> Vec<String> {
        self.permanent
            .iter()
            .cloned()
            .chain(
                waiting
                    .iter()
                    .map(|(n, e)| format!("{n} ({})", e.as_deref().unwrap_or("not attempted"))),
            )
            .collect()
    }
}

impl Uploader {
    pub(crate) fn start(
        store: Arc<RemoteStore>,
        local: PathBuf,
        keep: usize,
        overwrite: bool,
        retry: UploadRetry,
    ) -> Result<Self, CheckpointError> {
        let (tx, rx) = mpsc::channel();
        let worker = Worker {
            store: store.clone(),
            local: local.clone(),
            keep,
            overwrite,
            retry,
            newest_uploaded: None,
            permanent: Vec::new(),
            complete: HashMap::new(),
            passed_over: HashSet::new(),
            latest: None,
        };
        let handle = std::thread::Builder::new()
            .name("flashover-checkpoint-uploader".into())
            .spawn(move || worker.run(rx))
            .map_err(CheckpointError::io("start the uploader thread for", &local))?;
        Ok(Uploader {
            tx: Some(tx),
            handle: Some(handle),
            store,
            local,
        })
    }

    pub(crate) fn queue(&self) -> Option<UploadQueue> {
        self.tx.clone().map(UploadQueue)
    }

    /// Waits until every queued checkpoint is uploaded or has failed one more round of
    /// attempts; the ones that did not make it are the error.
    pub(crate) fn flush(&mut self) -> Result<(), CheckpointError> {
        let (reply, answer) = mpsc::channel();
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(Msg::Flush(reply)).is_ok());
        let failed = match sent.then(|| answer.recv().ok()).flatten() {
            Some(f) => f,
            None => vec!["(the uploader thread stopped)".to_string()],
        };
        if failed.is_empty() {
            Ok(())
        } else {
            Err(CheckpointError::NotUploaded {
                uri: self.store.uri().to_string(),
                local: self.local.clone(),
                failed,
            })
        }
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the upload in flight; it is not joined,
        // so an error path never waits on the network.
        self.tx.take();
        self.handle.take();
    }
}

/// The local folder a remote location is cached in: `base/<scheme>/<bucket>/<prefix...>`.
pub fn cache_folder(base: &Path, uri: &super::uri::RemoteUri) -> PathBuf {
    base.join(uri.cache_path())
}

/// Where remote checkpoints and logs are kept locally when no folder is given:
/// `$FLASHOVER_CACHE`, else `$XDG_CACHE_HOME/flashover`, else `~/.cache/flashover`, else
/// `flashover-cache` in the working directory.
pub fn default_cache_base() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("FLASHOVER_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|p| p.join("flashover")))
        .or_else(|| var("HOME").map(|p| p.join(".cache").join("flashover")))
        .unwrap_or_else(|| PathBuf::from("flashover-cache"))
}
