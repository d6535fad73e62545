//! Flashover checkpoints. This first part stores model weights as safetensors through
//! burn-store, at the tensors' own precision (never rounded to f16), written atomically: to a
//! temporary file that is synced and then renamed into place, so a reader sees the old file
//! or the new one, never half of one.
//!
//! Only this crate knows how weights sit on disk.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::backend::Backend;

/// Everything that can go wrong saving or loading weights.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be written, synced, renamed or read.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("write", "read", "rename to").
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The weights could not be encoded or decoded as safetensors.
    #[error("safetensors error in {path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// burn-store's message.
        message: String,
    },
    /// The file's tensors do not match the model's parameters.
    #[error("weights in {path} do not match the model: missing {missing:?}, unexpected {unexpected:?}, errors {errors:?}")]
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
}

fn io<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` atomically: a sibling temporary file, fsync, rename, then fsync of
/// the directory so the rename itself survives a crash.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("sync", &tmp))?;
        fs::rename(&tmp, path).map_err(io("rename into", path))?;
        // Syncing the directory makes the rename durable; some filesystems do not support
        // opening a directory for this, which is not an error for the caller.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The model's weights encoded as safetensors bytes (every tensor at its own dtype).
pub fn weights_to_bytes<B: Backend, M: Module<B>>(model: &M) -> Result<Vec<u8>, CheckpointError> {
    let mut store = SafetensorsStore::from_bytes(None);
    let format = |e: burn::store::SafetensorsStoreError| CheckpointError::Format {
        path: PathBuf::from("<memory>"),
        message: e.to_string(),
    };
    model.save_into(&mut store).map_err(format)?;
    store.get_bytes().map_err(format)
}

/// Saves the model's weights to `path` as safetensors, atomically.
pub fn save_weights<B: Backend, M: Module<B>>(
    model: &M,
    path: &Path,
) -> Result<(), CheckpointError> {
    let bytes = weights_to_bytes(model)?;
    write_atomic(path, &bytes)
}

/// Loads weights from a safetensors file into `model`. Strict: every parameter must be in the
/// file with its shape, and the file must hold nothing else.
pub fn load_weights<B: Backend, M: Module<B>>(
    mut model: M,
    path: &Path,
) -> Result<M, CheckpointError> {
    let bytes = fs::read(path).map_err(io("read", path))?;
    let mut store = SafetensorsStore::from_bytes(Some(bytes))
        .allow_partial(true)
        .validate(true);
    let result = model
        .load_from(&mut store)
        .map_err(|e| CheckpointError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    if !result.missing.is_empty() || !result.unused.is_empty() || !result.errors.is_empty() {
        return Err(CheckpointError::Mismatch {
            path: path.to_path_buf(),
            missing: result.missing.into_iter().map(|(p, _)| p).collect(),
            unexpected: result.unused,
            errors: result.errors.iter().map(|e| format!("{e:?}")).collect(),
        });
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};
    use flashover_core::params::{init_model, params_sha256};

    type B = Flex;

    #[derive(burn::module::Module, Debug)]
    struct Two<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    fn two(seed: u64, out: usize) -> Two<B> {
        init_model::<B, _>(&Default::default(), seed, |d| Two {
            a: LinearConfig::new(3, 4).init(d),
            b: LinearConfig::new(4, out).init(d),
        })
    }

    #[test]
    fn weights_round_trip_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let m = two(1, 2);
        save_weights(&m, &path).unwrap();
        let back = load_weights(two(2, 2), &path).unwrap();
        assert_eq!(params_sha256::<B, _>(&back), params_sha256::<B, _>(&m));
        assert_ne!(params_sha256::<B, _>(&two(2, 2)), params_sha256::<B, _>(&m));
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("model.safetensors")]);
    }

    #[test]
    fn a_mismatched_or_damaged_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save_weights(&two(1, 2), &path).unwrap();
        let err = load_weights(two(1, 5), &path).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        fs::write(&path, b"not safetensors").unwrap();
        let err = load_weights(two(1, 2), &path).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        let err = load_weights(two(1, 2), &dir.path().join("absent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent"), "{err}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.bin");
        write_atomic(&path, b"old").unwrap();
        // Writing into a directory that does not exist fails before touching `path`.
        let bad = dir.path().join("missing").join("w.bin");
        assert!(write_atomic(&bad, b"new").is_err());
        assert_eq!(fs::read(&path).unwrap(), b"old");
    }
}
