//! The one error type of `flashover-checkpoint`. Every variant names the file (or folder)
//! involved, so a damaged or hostile checkpoint is reported, never obeyed.

use std::path::PathBuf;

/// Everything that can go wrong saving, verifying or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file or folder could not be created, written, synced, renamed or read.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was being done ("write", "read", "rename into").
        action: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Tensors could not be encoded or decoded.
    #[error("cannot decode or encode {path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The encoder's or decoder's message.
        message: String,
    },
    /// A checkpoint's content does not match its manifest, or the manifest is unusable.
    #[error("damaged checkpoint: {path}: {reason}")]
    Damaged {
        /// The file that is wrong (or missing).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint was written by an unknown format version.
    #[error("{path}: checkpoint format version {found}, this build reads version {supported}")]
    Version {
        /// The manifest.
        path: PathBuf,
        /// The version found.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The weights do not fit the model.
    #[error("weights in {path} do not match the model: missing {missing:?}, unexpected {unexpected:?}, errors {errors:?} (load non-strictly to skip missing and unexpected keys)")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// Model parameters absent from the file.
        missing: Vec<String>,
        /// Tensors in the file that the model does not have.
        unexpected: Vec<String>,
        /// Shape or dtype problems, as burn-store reports them.
        errors: Vec<String>,
    },
    /// A checkpoint of that name exists and overwriting is off.
    #[error("checkpoint {path} exists; pick another name template or enable overwrite")]
    Exists {
        /// The existing checkpoint.
        path: PathBuf,
    },
    /// A run that would not continue the checkpoints already in its save folder (a new run,
    /// or one resumed from an earlier point): its saves would mix with them, and `latest`
    /// and rotation would treat two runs as one. Checked before the first batch.
    #[error("save folder {folder} already holds checkpoints of another run ({}), and this run starts at batch {start}: its checkpoints would mix with them; resume that run instead (autoresume, `--autoresume`), replace them (overwrite, `--overwrite`), or save into a new folder", .found.join(", "))]
    OtherRun {
        /// The save folder.
        folder: PathBuf,
        /// The checkpoints in the way, each with its batch (`ep1-ba200 (batch 200)`).
        found: Vec<String>,
        /// The batch this run starts at (0 for a new run).
        start: u64,
    },
    /// A rank of a sharded save could not write its optimizer shard: no checkpoint was put
    /// in place.
    #[error("rank {rank} could not write its optimizer shard {path}: {message}")]
    Shard {
        /// The rank that failed.
        rank: usize,
        /// The shard it was writing.
        path: PathBuf,
        /// Its error.
        message: String,
    },
    /// A setting of the saver or loader is invalid.
    #[error("invalid value {value:?} for `{name}`: expected {expected}")]
    Config {
        /// The setting.
        name: &'static str,
        /// The value as given.
        value: String,
        /// What would be accepted.
        expected: String,
    },
    /// A weights-only checkpoint cannot resume training.
    #[error("{path} holds weights only; load it with weights_only to start a new run from it")]
    WeightsOnly {
        /// The checkpoint.
        path: PathBuf,
    },
    /// Another process holds the save folder's lock: one writer per folder.
    #[error("save folder {folder} is in use by {holder}; one run writes to a folder at a time (wait for it to end, or pick another folder)")]
    Locked {
        /// The folder.
        folder: PathBuf,
        /// Who holds it, as the holder wrote it.
        holder: String,
    },
    /// Autoresume found checkpoints but none that verifies; nothing was changed.
    #[error("no checkpoint in {folder} can be resumed from, and {} failed verification ({}); nothing was moved or deleted: check the disk or restore a copy, or ask for a fresh start (autoresume's `fresh_start_if_damaged`, `--fresh-start` in the examples) to move them aside as *.damaged and train from the beginning", .damaged.len(), .damaged.join("; "))]
    NothingIntact {
        /// The save folder.
        folder: PathBuf,
        /// Each damaged checkpoint's error.
        damaged: Vec<String>,
    },
    /// An object store refused or failed a request (after its retries), or is unusable as
    /// configured. Never holds a credential: the stores' errors carry the request's URL and
    /// the server's answer, not the signing secret.
    #[error("cannot {action} {uri}: {reason}")]
    Remote {
        /// What was being done ("upload", "download", "list", "connect to").
        action: &'static str,
        /// The object or prefix (`s3://bucket/prefix/...`).
        uri: String,
        /// The store's answer, with what to check.
        reason: String,
    },
    /// Checkpoints saved locally that never reached the object store (reported at the end of
    /// `fit`; each was also warned about when its upload first failed).
    #[error("{} checkpoint(s) were saved in {local} but not uploaded to {uri}: {}", .failed.len(), .failed.join("; "))]
    NotUploaded {
        /// The remote prefix.
        uri: String,
        /// The local save folder, where the checkpoints are.
        local: PathBuf,
        /// Each checkpoint with its last error.
        failed: Vec<String>,
    },
    /// An asynchronous save failed in the background; reported at the next save or at the end.
    #[error("background save of {path} failed: {source}")]
    Background {
        /// The checkpoint that was being written.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<CheckpointError>,
    },
}

impl CheckpointError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> CheckpointError {
        let path = path.into();
        move |source| CheckpointError::Io {
            action,
            path,
            source,
        }
    }

    pub(crate) fn damaged(path: impl Into<PathBuf>, reason: impl Into<String>) -> CheckpointError {
        CheckpointError::Damaged {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl CheckpointError {
    /// As a core error raised by the checkpoint saver.
    pub fn in_saver(self) -> flashover_core::CoreError {
        flashover_core::CoreError::External {
            component: "checkpoint saver".into(),
            source: Box::new(self),
        }
    }

    /// As a core error raised while restoring.
    pub fn in_restore(self) -> flashover_core::CoreError {
        flashover_core::CoreError::Restore(Box::new(self))
    }
}
