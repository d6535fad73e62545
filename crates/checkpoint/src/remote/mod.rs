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

/// The nice value of the background upload threads (the checkpoint uploader and the log
/// mirror) on Linux: at least 10, so that when every core is busy the training threads get the
/// CPU first (a nice-10 thread weighs about a tenth of a nice-0 one in Linux's fair scheduler)
/// and the uploads still progress; on idle cores it changes nothing. A process already nicer
/// than that keeps its value.
#[cfg(feature = "remote")]
pub const BACKGROUND_NICE: i32 = 10;

/// Lowers the calling thread's scheduling priority to [`BACKGROUND_NICE`] if it is higher
/// (Linux only; elsewhere a no-op, since there `setpriority` would lower the whole process).
/// Best effort: a refusal is logged and the upload goes on at its priority.
#[cfg(feature = "remote")]
pub(crate) fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    if thread_nice() < BACKGROUND_NICE {
        // SAFETY: `setpriority` takes no pointers; with PRIO_PROCESS and `who` 0 Linux applies
        // the nice value to the calling thread alone (the nice value is per thread under NPTL,
        // see setpriority(2), BUGS). Raising a nice value needs no privilege.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, BACKGROUND_NICE) };
        if rc != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "could not lower the upload thread's priority; it runs at the training's"
            );
        }
    }
}

/// The calling thread's nice value (Linux only).
#[cfg(all(feature = "remote", target_os = "linux"))]
pub(crate) fn thread_nice() -> i32 {
    // SAFETY: `getpriority` takes no pointers. With PRIO_PROCESS and `who` 0 it cannot fail,
    // so its -1 is the nice value -1, not an error.
    #[allow(unsafe_code)]
    unsafe {
        libc::getpriority(libc::PRIO_PROCESS, 0)
    }
}

#[cfg(all(test, feature = "remote", target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn only_the_calling_thread_is_lowered() {
        let before = thread_nice();
        let thread = std::thread::spawn(|| {
            lower_thread_priority();
            thread_nice()
        });
        // Invariant: the thread's two calls do not panic, so `join` is `Ok`.
        let lowered = thread.join().unwrap();
        assert_eq!(lowered, before.max(BACKGROUND_NICE));
        assert_eq!(
            thread_nice(),
            before,
            "the spawning thread kept its priority"
        );
    }
}

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
