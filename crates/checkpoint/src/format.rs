//! The on-disk format: a directory per checkpoint, a manifest naming every file with its size
//! and SHA-256, and atomic writes (temporary name, fsync, rename, directory fsync).
//!
//! This module is the only place that knows file names and the manifest's layout.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::CheckpointError;

/// Identifies a Flashover checkpoint manifest.
pub const FORMAT_NAME: &str = "flashover-checkpoint";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Model weights (safetensors).
pub const MODEL: &str = "model.safetensors";
/// Optimizer state (Burn record, named MessagePack, full precision).
pub const OPTIMIZER: &str = "optimizer.mpk";
/// Trainer state (JSON).
pub const TRAINER_STATE: &str = "trainer_state.json";
/// The file in a save folder that names the newest complete checkpoint.
pub const LATEST: &str = "latest";
/// A manifest larger than this is not a manifest this build wrote.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// One file listed in a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory (a single path component).
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the content, lowercase hex.
    pub sha256: String,
}

/// The manifest: what a checkpoint holds and where in training it was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// The format version.
    pub version: u32,
    /// Completed epochs when saved.
    pub epoch: u64,
    /// Completed batches when saved.
    pub batch: u64,
    /// Whether only model weights were saved.
    pub weights_only: bool,
    /// Every file of the checkpoint.
    pub files: Vec<FileEntry>,
}

/// Hex SHA-256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub(crate) fn sync_dir(dir: &Path) {
    // Making a rename durable needs an fsync of the directory; a filesystem that cannot open
    // directories for this gives no stronger guarantee to fall back on, so it is skipped.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

fn parent_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Writes `bytes` to `path` atomically: a sibling temporary file, fsync, rename, then fsync of
/// the directory so the rename itself survives a crash.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = parent_of(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(CheckpointError::io("create", &tmp))?;
        f.write_all(bytes)
            .map_err(CheckpointError::io("write", &tmp))?;
        f.sync_all().map_err(CheckpointError::io("sync", &tmp))?;
        fs::rename(&tmp, path).map_err(CheckpointError::io("rename into", path))?;
        sync_dir(dir);
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The name of rank `rank`'s optimizer shard in a sharded checkpoint of `world` ranks.
pub fn optimizer_shard(rank: usize, world: usize) -> String {
    format!("optimizer-rank{rank}-of{world}.mpk")
}

/// The folder where the ranks of a sharded save put their shards before rank 0 moves them
/// into the checkpoint (`<folder>/.shards-<name>`): scratch for any later save.
pub fn shard_staging(folder: &Path, name: &str) -> PathBuf {
    folder.join(format!(".shards-{name}"))
}

/// A file another process already wrote (and synced) for a checkpoint, with the size and
/// SHA-256 it reported: [`write_checkpoint`] moves it in and lists it in the manifest.
#[derive(Debug, Clone)]
pub struct Staged {
    /// Its name inside the checkpoint.
    pub name: String,
    /// Where it was written.
    pub path: PathBuf,
    /// Its size in bytes, as its writer reported.
    pub bytes: u64,
    /// Its SHA-256, as its writer reported.
    pub sha256: String,
}

/// Whether a directory entry name is one of the saver's temporary or discarded directories,
/// or the temporary sibling of a file being replaced by [`write_atomic`] (`.latest.tmp-<pid>`).
pub(crate) fn is_scratch(name: &str) -> bool {
    name.starts_with(".tmp-")
        || name.starts_with(".trash-")
        || name.starts_with(".shards-")
        || name.starts_with('.')
            && name
                .rsplit_once(".tmp-")
                .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// Writes a checkpoint directory `folder/name` holding `files`, atomically: everything goes
/// into `folder/.tmp-<name>-<pid>`, each file is synced, the manifest is written last, and
/// the directory is renamed into place. With `overwrite`, an existing checkpoint of the same
/// name is replaced; otherwise it is an error and nothing is written. `staged` files (other
/// ranks' shards) are moved in before the manifest, each checked against the size its
/// writer reported; one that is missing or of another size is an error naming it, and
/// nothing is put in place.
#[allow(clippy::too_many_arguments)]
pub fn write_checkpoint(
    folder: &Path,
    name: &str,
    epoch: u64,
    batch: u64,
    weights_only: bool,
    files: &[(&str, &[u8])],
    staged: &[Staged],
    overwrite: bool,
) -> Result<PathBuf, CheckpointError> {
    let target = folder.join(name);
    if target.exists() && !overwrite {
        return Err(CheckpointError::Exists { path: target });
    }
    fs::create_dir_all(folder).map_err(CheckpointError::io("create folder", folder))?;
    let tmp = folder.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(CheckpointError::io("remove stale", &tmp))?;
    }
    let result = (|| {
        fs::create_dir(&tmp).map_err(CheckpointError::io("create", &tmp))?;
        let mut entries = Vec::with_capacity(files.len());
        for (file, bytes) in files {
            let path = tmp.join(file);
            let mut f = File::create(&path).map_err(CheckpointError::io("create", &path))?;
            f.write_all(bytes)
                .map_err(CheckpointError::io("write", &path))?;
            f.sync_all().map_err(CheckpointError::io("sync", &path))?;
            entries.push(FileEntry {
                name: file.to_string(),
                bytes: bytes.len() as u64,
                sha256: sha256_hex(bytes),
            });
        }
        for file in staged {
            let size = fs::metadata(&file.path)
                .map_err(CheckpointError::io("find staged", &file.path))?
                .len();
            if size != file.bytes {
                return Err(CheckpointError::damaged(
                    &file.path,
                    format!(
                        "{size} bytes where its writer reported {}: changed after it was written",
                        file.bytes
                    ),
                ));
            }
            let path = tmp.join(&file.name);
            fs::rename(&file.path, &path).map_err(CheckpointError::io("move in", &file.path))?;
            entries.push(FileEntry {
                name: file.name.clone(),
                bytes: file.bytes,
                sha256: file.sha256.clone(),
            });
        }
        let manifest = Manifest {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            epoch,
            batch,
            weights_only,
            files: entries,
        };
        let text = serde_json::to_vec_pretty(&manifest).map_err(|e| CheckpointError::Format {
            path: tmp.join(MANIFEST),
            message: e.to_string(),
        })?;
        let path = tmp.join(MANIFEST);
        let mut f = File::create(&path).map_err(CheckpointError::io("create", &path))?;
        f.write_all(&text)
            .map_err(CheckpointError::io("write", &path))?;
        f.sync_all().map_err(CheckpointError::io("sync", &path))?;
        sync_dir(&tmp);
        rename_into_place(folder, &tmp, name)
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    result
}

/// Renames the finished scratch directory `tmp` to `folder/name`, replacing a directory of
/// that name (moved aside first, then deleted), and syncs the folder.
pub(crate) fn rename_into_place(
    folder: &Path,
    tmp: &Path,
    name: &str,
) -> Result<PathBuf, CheckpointError> {
    let target = folder.join(name);
    if target.exists() {
        let trash = folder.join(format!(".trash-{name}-{}", std::process::id()));
        fs::rename(&target, &trash).map_err(CheckpointError::io("move aside", &target))?;
        fs::rename(tmp, &target).map_err(CheckpointError::io("rename into", &target))?;
        let _ = fs::remove_dir_all(&trash);
    } else {
        fs::rename(tmp, &target).map_err(CheckpointError::io("rename into", &target))?;
    }
    sync_dir(folder);
    Ok(target)
}

fn safe_entry(name: &str) -> bool {
    let p = Path::new(name);
    // No separator anywhere: `Path` would read "model/" as the one component "model".
    !name.is_empty()
        && !name.contains(['/', '\\'])
        && name != MANIFEST
        && p.components().count() == 1
        && matches!(p.components().next(), Some(Component::Normal(_)))
}

/// Reads and checks a checkpoint directory's manifest: format, version, and that every
/// listed file is a plain name inside the directory, present, a regular file, of the listed
/// size. Contents are not hashed here (see [`verify`] and [`read_verified`]).
pub fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let manifest_path = dir.join(MANIFEST);
    let meta = fs::metadata(&manifest_path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            CheckpointError::damaged(
                &manifest_path,
                "no manifest: not a checkpoint, or its save did not finish",
            )
        } else {
            CheckpointError::Io {
                action: "read",
                path: manifest_path.clone(),
                source: e,
            }
        }
    })?;
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(CheckpointError::damaged(
            &manifest_path,
            format!("{} bytes, larger than any manifest", meta.len()),
        ));
    }
    let text = fs::read(&manifest_path).map_err(CheckpointError::io("read", &manifest_path))?;
    let manifest = parse_manifest(&text, &manifest_path)?;
    for entry in &manifest.files {
        let path = dir.join(&entry.name);
        let meta = fs::symlink_metadata(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CheckpointError::damaged(&path, "listed in the manifest but missing")
            }
            _ => CheckpointError::Io {
                action: "read",
                path: path.clone(),
                source: e,
            },
        })?;
        if !meta.is_file() {
            return Err(CheckpointError::damaged(&path, "not a regular file"));
        }
        if meta.len() != entry.bytes {
            return Err(CheckpointError::damaged(
                &path,
                format!("{} bytes, the manifest says {}", meta.len(), entry.bytes),
            ));
        }
    }
    Ok(manifest)
}

/// Parses and checks a manifest's bytes (`path` names it in errors): JSON, the format name,
/// the version, the layout, and that every listed file is a plain name inside the checkpoint
/// (no `/`, no `..`, not the manifest itself). Files are not looked at.
pub fn parse_manifest(text: &[u8], manifest_path: &Path) -> Result<Manifest, CheckpointError> {
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(CheckpointError::damaged(
            manifest_path,
            format!("{} bytes, larger than any manifest", text.len()),
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(text)
        .map_err(|e| CheckpointError::damaged(manifest_path, format!("not JSON: {e}")))?;
    if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT_NAME) {
        return Err(CheckpointError::damaged(
            manifest_path,
            format!("not a {FORMAT_NAME} manifest"),
        ));
    }
    let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
    if version != FORMAT_VERSION as u64 {
        return Err(CheckpointError::Version {
            path: manifest_path.to_path_buf(),
            found: u32::try_from(version).unwrap_or(u32::MAX),
            supported: FORMAT_VERSION,
        });
    }
    let manifest: Manifest = serde_json::from_value(value)
        .map_err(|e| CheckpointError::damaged(manifest_path, format!("unexpected layout: {e}")))?;
    for entry in &manifest.files {
        if !safe_entry(&entry.name) {
            return Err(CheckpointError::damaged(
                manifest_path,
                format!(
                    "lists {:?}, which is not a plain file name inside the checkpoint",
                    entry.name
                ),
            ));
        }
    }
    Ok(manifest)
}

/// [`read_manifest`], then every listed file's SHA-256 (streamed, so no file is held in
/// memory here). Fails on the first problem, naming the file.
pub fn verify(dir: &Path) -> Result<Manifest, CheckpointError> {
    let manifest = read_manifest(dir)?;
    for entry in &manifest.files {
        let path = dir.join(&entry.name);
        let mut f = File::open(&path).map_err(CheckpointError::io("read", &path))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = f
                .read(&mut buf)
                .map_err(CheckpointError::io("read", &path))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if got != entry.sha256 {
            return Err(CheckpointError::damaged(
                &path,
                "content does not match the manifest's SHA-256",
            ));
        }
    }
    Ok(manifest)
}

/// Reads one file the manifest lists, checking its size and SHA-256: each file a load uses is
/// read and hashed exactly once.
pub fn read_verified(
    dir: &Path,
    manifest: &Manifest,
    name: &str,
) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(name);
    let entry = manifest
        .files
        .iter()
        .find(|e| e.name == name)
        .ok_or_else(|| {
            CheckpointError::damaged(dir.join(MANIFEST), format!("does not list {name}"))
        })?;
    let bytes = fs::read(&path).map_err(CheckpointError::io("read", &path))?;
    if bytes.len() as u64 != entry.bytes || sha256_hex(&bytes) != entry.sha256 {
        return Err(CheckpointError::damaged(
            &path,
            format!(
                "its content ({} bytes) does not match the manifest's size ({} bytes) and SHA-256: the file was damaged or changed after it was saved",
                bytes.len(),
                entry.bytes
            ),
        ));
    }
    Ok(bytes)
}

/// Points `folder/latest` at checkpoint `name`, atomically.
pub fn write_latest(folder: &Path, name: &str) -> Result<(), CheckpointError> {
    write_atomic(&folder.join(LATEST), name.as_bytes())
}

/// The checkpoint `folder/latest` names, if the pointer exists and names a plain entry.
pub fn read_latest(folder: &Path) -> Option<String> {
    let text = fs::read_to_string(folder.join(LATEST)).ok()?;
    let name = text.trim().to_string();
    safe_entry(&name).then_some(name)
}

/// The checkpoint directory `path` means: `path` itself when it holds a manifest; the
/// checkpoint its `latest` pointer names when `path` is that pointer (`ck/latest`) or a save
/// folder that holds one (`ck`); otherwise `path` unchanged (loading it then names what is
/// missing). What the saver writes can be loaded as it is written.
pub fn resolve_checkpoint(path: &Path) -> PathBuf {
    let named_by = |folder: &Path| read_latest(folder).map(|name| folder.join(name));
    if path.is_file() && path.file_name() == Some(std::ffi::OsStr::new(LATEST)) {
        if let Some(dir) = path.parent().and_then(named_by) {
            return dir;
        }
    } else if path.is_dir() && !path.join(MANIFEST).exists() {
        if let Some(dir) = named_by(path) {
            return dir;
        }
    }
    path.to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_pointer_and_its_folder_resolve_to_the_checkpoint_it_names() {
        let dir = tempfile::tempdir().unwrap();
        let ck = dir.path().join("ep0-ba8");
        fs::create_dir(&ck).unwrap();
        fs::write(ck.join(MANIFEST), "{}").unwrap();
        write_latest(dir.path(), "ep0-ba8").unwrap();
        assert_eq!(resolve_checkpoint(&dir.path().join(LATEST)), ck);
        assert_eq!(resolve_checkpoint(dir.path()), ck);
        assert_eq!(resolve_checkpoint(&ck), ck);
        // A pointer out of the folder is not followed.
        fs::write(dir.path().join(LATEST), "../elsewhere").unwrap();
        assert_eq!(resolve_checkpoint(dir.path()), dir.path());
    }

    #[test]
    fn scratch_names_include_a_killed_atomic_write_and_nothing_a_user_would_name() {
        for name in [".tmp-ep1-ba2-77", ".trash-ep1-ba2-77", ".latest.tmp-10190"] {
            assert!(is_scratch(name), "{name}");
        }
        for name in [
            "latest",
            "ep1-ba2",
            ".lock",
            "ep1-ba2.damaged",
            ".latest.tmp-",
            "x.tmp-1",
        ] {
            assert!(!is_scratch(name), "{name}");
        }
    }

    fn sample(dir: &Path) -> PathBuf {
        write_checkpoint(
            dir,
            "ck",
            1,
            10,
            false,
            &[("a.bin", b"hello"), ("b.json", b"{}")],
            &[],
            false,
        )
        .unwrap()
    }

    #[test]
    fn staged_files_move_in_and_a_changed_one_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let staging = shard_staging(dir.path(), "ck");
        fs::create_dir_all(&staging).unwrap();
        let shard = |name: &str, bytes: &[u8]| {
            let path = staging.join(name);
            fs::write(&path, bytes).unwrap();
            Staged {
                name: name.into(),
                path,
                bytes: bytes.len() as u64,
                sha256: sha256_hex(bytes),
            }
        };
        let one = shard(&optimizer_shard(1, 2), b"rank one");
        let ck = write_checkpoint(
            dir.path(),
            "ck",
            1,
            10,
            false,
            &[("a.bin", b"x")],
            &[one],
            false,
        )
        .unwrap();
        let m = verify(&ck).unwrap();
        assert_eq!(
            read_verified(&ck, &m, "optimizer-rank1-of2.mpk").unwrap(),
            b"rank one"
        );
        // A shard that is not the size its writer reported: an error naming it, no checkpoint.
        let mut bad = shard(&optimizer_shard(1, 2), b"rank one");
        bad.bytes += 1;
        let e = write_checkpoint(
            dir.path(),
            "ck2",
            1,
            11,
            false,
            &[("a.bin", b"x")],
            &[bad],
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("optimizer-rank1-of2.mpk"), "{e}");
        assert!(!dir.path().join("ck2").exists());
        assert!(is_scratch(".shards-ck2"));
    }

    #[test]
    fn a_written_checkpoint_verifies_and_leaves_no_scratch() {
        let dir = tempfile::tempdir().unwrap();
        let ck = sample(dir.path());
        let m = verify(&ck).unwrap();
        assert_eq!((m.epoch, m.batch, m.files.len()), (1, 10, 2));
        assert_eq!(read_verified(&ck, &m, "a.bin").unwrap(), b"hello");
        let names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["ck"]);
        // Without overwrite a second save of the same name is refused and changes nothing.
        let err = write_checkpoint(
            dir.path(),
            "ck",
            2,
            20,
            false,
            &[("a.bin", b"x")],
            &[],
            false,
        )
        .unwrap_err();
        assert!(matches!(err, CheckpointError::Exists { .. }), "{err}");
        assert_eq!(verify(&ck).unwrap().batch, 10);
        write_checkpoint(
            dir.path(),
            "ck",
            2,
            20,
            false,
            &[("a.bin", b"x")],
            &[],
            true,
        )
        .unwrap();
        assert_eq!(verify(&ck).unwrap().batch, 20);
    }

    #[test]
    fn unsafe_manifest_entries_are_refused() {
        for bad in [
            "../outside",
            "/etc/passwd",
            "sub/dir",
            "",
            ".",
            "manifest.json",
            // Found by the manifest fuzzer: one path component, but not a plain file name.
            "model.safetensors/",
            "a\\b",
        ] {
            assert!(!safe_entry(bad), "{bad}");
        }
        assert!(safe_entry("model.safetensors"));
    }

    #[test]
    fn latest_points_at_a_plain_name() {
        let dir = tempfile::tempdir().unwrap();
        write_latest(dir.path(), "ep1-ba10").unwrap();
        assert_eq!(read_latest(dir.path()).as_deref(), Some("ep1-ba10"));
        fs::write(dir.path().join(LATEST), "../elsewhere").unwrap();
        assert_eq!(read_latest(dir.path()), None);
    }
}
