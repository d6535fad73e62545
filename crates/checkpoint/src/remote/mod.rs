//! Checkpoints and logs in object storage (S3 and S3-compatible stores tested; GCS and Azure
//! compiled through the same crate behind the `gcs` and `azure` features).
//!
//! A save to a remote location is a local save first (the atomic, verified directory of the
//! local format, in a local cache folder), then a background upload ([`sync`] describes the
//! remote layout and the order of writes); autoresume and `--load` download into the local
//! folder, verifying every file, and then restore from it as from any local checkpoint. So the
//! bits a run resumes from are always bits that were verified on this machine.
//!
//! [`uri`] parses and validates locations without any store compiled in; the rest needs the
//! `s3`, `gcs` or `azure` feature.

pub mod uri;

#[cfg(feature = "remote")]
pub mod logs;
#[cfg(feature = "remote")]
pub mod store;
#[cfg(feature = "remote")]
pub mod sync;

pub use uri::{check_segment, Location, RemoteUri, Scheme};

#[cfg(feature = "remote")]
pub use logs::LogSync;
#[cfg(feature = "remote")]
pub use store::{RemoteSettings, RemoteStore};
#[cfg(feature = "remote")]
pub use sync::{
    autoresume_remote, autoresume_remote_read_only, cache_folder, default_cache_base,
    download_checkpoint, list_remote, load_remote, upload_checkpoint, RemoteCheckpoint,
    RemoteListing, UploadRetry, DAMAGED_MANIFEST,
};
