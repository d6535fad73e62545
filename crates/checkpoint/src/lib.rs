//! Flashover checkpoints: atomic, verified, and exact enough that a resumed run ends with the
//! same bits as one that was never interrupted.
//!
//! # On-disk format (version 1)
//!
//! A save folder holds one directory per checkpoint, named by a template (default
//! `ep{epoch}-ba{batch}`), and a `latest` file naming the newest complete one:
//!
//! ```text
//! checkpoints/
//!   latest                     "ep3-ba375" (replaced atomically after each save)
//!   ep3-ba375/
//!     manifest.json            format, version, epoch, batch, weights_only, and for every
//!                              other file its name, size in bytes and SHA-256
//!     model.safetensors        model weights at their own dtype (burn-store; readable by
//!                              any safetensors tool)
//!     optimizer.mpk            optimizer state: Burn record, named MessagePack, full precision
//!     trainer_state.json       timestamp, sampler position, seed, world size, eval metrics,
//!                              parameter ids by path, every algorithm's and callback's state
//! ```
//!
//! A checkpoint is written into `.tmp-<name>-<pid>`, every file fsynced, the manifest last,
//! then the directory is renamed into place and the folder fsynced; only then is `latest`
//! replaced (itself via a temporary file and rename). A crash at any point leaves the previous
//! checkpoint and `latest` intact; scratch directories are removed by the next save.
//!
//! Loading verifies the manifest and every file's size and hash before decoding anything;
//! manifest entries must be plain file names inside the checkpoint. Nothing in a checkpoint
//! decides which code runs: algorithms and callbacks come from the user's configuration and
//! only receive their saved state.
//!
//! A checkpoint that fails verification when autoresume looks for one to resume from is
//! renamed `<name>.damaged` (kept for inspection, never resumed from, rotated or deleted), so
//! the resumed run can save that name again. If no checkpoint verifies, autoresume fails and
//! changes nothing unless asked for a fresh start. An I/O error while verifying is an error,
//! not damage.
//!
//! With the `s3` feature (or `gcs`, `azure`), a save folder may be an object-store prefix: see
//! [`remote`] for the remote layout, the upload order and remote autoresume.
//!
//! Only this crate knows the format. One writer per save folder, enforced: the saver (and
//! autoresume) hold an OS lock on `<folder>/.lock`, released when the process ends however it
//! ends, and a second process fails at once with an error naming the holder.
#![warn(missing_docs)]
// `deny`, not `forbid`: `remote::lower_thread_priority` allows one `setpriority` call.
#![deny(unsafe_code)]

mod error;
pub mod format;
mod load;
mod lock;
pub mod remote;
mod retention;
mod saver;
mod shards;
mod state_file;
mod weights;

pub use error::CheckpointError;
pub use format::{resolve_checkpoint, write_atomic};
pub use load::{
    autoresume, autoresume_read_only, autoresume_with, find_resumable, is_moved_aside,
    AutoresumeOptions, CheckpointRestore, LoadOptions, Skipped, DAMAGED_SUFFIX,
};
pub use lock::{lock_folder, FolderLock, LOCK_FILE};
pub use saver::{
    list_checkpoints, render_name, retention, SaveInterval, SavePredicate, Saver, SaverConfig,
    TEMPLATE_FIELDS,
};
pub use state_file::{SamplerPosition, TrainerStateFile};
pub use weights::{
    load_weights, load_weights_bytes, param_ids, save_weights, set_param_ids, weights_to_bytes,
    WeightsLoad, WeightsReport,
};
