//! One writer per save folder: an exclusive OS file lock on `<folder>/.lock`, held for as
//! long as a saver (or an autoresume that may move damaged checkpoints aside) uses the folder.
//!
//! The lock is `flock`-style (`std::fs::File::try_lock`), so the operating system releases it
//! when the process ends, however it ends: a SIGKILLed run never leaves its folder locked.
//! The file itself stays (removing it would let two processes lock two different files of
//! one name); it holds the holder's process id, host and start time, for the error a second
//! process gets. Inside one process the lock is shared: every user of a folder gets the same
//! handle, and the lock is released when the last one drops it. Written here rather than
//! taken from a crate because std has had the lock itself since Rust 1.89 and what is ours is
//! the sharing and the message.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use crate::error::CheckpointError;

/// The lock file's name inside a save folder (hidden: never taken for a checkpoint).
pub const LOCK_FILE: &str = ".lock";

/// An exclusive lock on a save folder, released when the last handle is dropped (or the
/// process ends).
#[derive(Debug)]
pub struct FolderLock {
    folder: PathBuf,
    // Held open: closing it releases the lock.
    _file: File,
}

impl FolderLock {
    /// The locked folder (canonical path).
    pub fn folder(&self) -> &Path {
        &self.folder
    }
}

type Held = Mutex<BTreeMap<PathBuf, Weak<FolderLock>>>;

fn held() -> &'static Held {
    static HELD: std::sync::OnceLock<Held> = std::sync::OnceLock::new();
    HELD.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn holder_text() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "an unknown host".into());
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!(
        "process {} on {host} (since {} UTC)",
        std::process::id(),
        utc(since)
    )
}

/// `YYYY-MM-DD hh:mm:ss` for seconds since the Unix epoch (the proleptic Gregorian calendar,
/// by the days-to-civil conversion; std has no calendar and one line is not worth a crate).
fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let t = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        t / 3600,
        t % 3600 / 60,
        t % 60
    )
}

/// Locks `folder` (created if missing) for this process, or fails at once with
/// [`CheckpointError::Locked`] naming the process that holds it. Calling it again in the same
/// process while a handle is alive returns that handle.
pub fn lock_folder(folder: &Path) -> Result<Arc<FolderLock>, CheckpointError> {
    std::fs::create_dir_all(folder).map_err(CheckpointError::io("create folder", folder))?;
    let canonical = folder
        .canonicalize()
        .map_err(CheckpointError::io("resolve folder", folder))?;
    // A poisoned registry only means another thread panicked while holding it; the map
    // itself is always left consistent (single insert or lookup per critical section).
    let mut map = held().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(lock) = map.get(&canonical).and_then(Weak::upgrade) {
        return Ok(lock);
    }
    let path = canonical.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(CheckpointError::io("create lock file", &path))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let holder = text.trim();
            return Err(CheckpointError::Locked {
                folder: folder.to_path_buf(),
                holder: if holder.is_empty() {
                    "another process (it has not written its name yet)".into()
                } else {
                    holder.to_string()
                },
            });
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(CheckpointError::io("lock", &path)(e));
        }
    }
    let text = holder_text();
    file.set_len(0)
        .and_then(|_| file.seek(SeekFrom::Start(0)))
        .and_then(|_| file.write_all(text.as_bytes()))
        .map_err(CheckpointError::io("write", &path))?;
    let lock = Arc::new(FolderLock {
        folder: canonical.clone(),
        _file: file,
    });
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(canonical, Arc::downgrade(&lock));
    Ok(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_by_hand() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_796_124_912), "2026-12-01 11:35:12");
        assert_eq!(utc(4_107_542_399), "2100-02-28 23:59:59");
    }

    #[test]
    fn one_process_shares_its_lock_and_releases_it_with_the_last_handle() {
        let dir = tempfile::tempdir().unwrap();
        let a = lock_folder(dir.path()).unwrap();
        let b = lock_folder(&dir.path().join(".")).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        assert!(text.contains(&std::process::id().to_string()), "{text}");
        // A second open file description conflicts while the lock is held...
        let other = File::open(dir.path().join(LOCK_FILE)).unwrap();
        assert!(matches!(
            other.try_lock(),
            Err(std::fs::TryLockError::WouldBlock)
        ));
        drop((a, b));
        // ...and not once the last handle is gone.
        other.try_lock().unwrap();
    }
}
