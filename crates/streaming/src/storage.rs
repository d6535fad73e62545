//! Where a dataset's files live: a local folder, or an object-store prefix reached through
//! flashover-checkpoint's [`RemoteStore`](flashover_checkpoint::remote::RemoteStore) (the
//! `object_store` crate, retried with backoff by it; the `s3` feature).

use std::path::{Path, PathBuf};

use flashover_checkpoint::remote::{Location, RemoteUri};

use crate::error::{Result, StreamingError};

/// A dataset's location, opened.
pub enum Storage {
    /// A folder on this machine.
    Local(PathBuf),
    /// An object-store prefix.
    #[cfg(feature = "remote")]
    Remote(Box<flashover_checkpoint::remote::RemoteStore>),
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Storage({})", self.describe(""))
    }
}

impl Storage {
    /// Opens `text`: a folder, or a URI such as `s3://bucket/prefix` (credentials and endpoint
    /// from the environment, as for remote checkpoints).
    pub fn open(text: &str, config: Vec<(String, String)>) -> Result<Storage> {
        let location = Location::parse(text)
            .map_err(|e| StreamingError::config("data", text, e.to_string()))?;
        match location {
            Location::Local(p) => {
                if !p.is_dir() {
                    return Err(StreamingError::config(
                        "data",
                        text,
                        "an existing folder with an index.json or .parquet files, or an s3:// URI",
                    ));
                }
                Ok(Storage::Local(p))
            }
            Location::Remote(uri) => Self::remote(text, &uri, config),
        }
    }

    #[cfg(feature = "remote")]
    fn remote(text: &str, uri: &RemoteUri, config: Vec<(String, String)>) -> Result<Storage> {
        use flashover_checkpoint::remote::{RemoteSettings, RemoteStore};
        let store = RemoteStore::connect_with_config(uri, &RemoteSettings::default(), config)
            .map_err(|e| StreamingError::config("data", text, e.to_string()))?;
        Ok(Storage::Remote(Box::new(store)))
    }

    #[cfg(not(feature = "remote"))]
    fn remote(text: &str, uri: &RemoteUri, _config: Vec<(String, String)>) -> Result<Storage> {
        Err(StreamingError::config(
            "data",
            text,
            format!(
                "a local folder: this build reads no object store (enable the `s3` feature of flashover-streaming for {})",
                uri.scheme().as_str()
            ),
        ))
    }

    /// The file `name` (a relative path) for messages: a path or a URI.
    pub fn describe(&self, name: &str) -> String {
        match self {
            Storage::Local(p) => {
                if name.is_empty() {
                    p.display().to_string()
                } else {
                    p.join(name).display().to_string()
                }
            }
            #[cfg(feature = "remote")]
            Storage::Remote(s) => {
                let parts: Vec<&str> = name.split('/').filter(|p| !p.is_empty()).collect();
                s.describe(&parts)
            }
        }
    }

    /// The local folder, if the dataset is local.
    pub fn local(&self) -> Option<&Path> {
        match self {
            Storage::Local(p) => Some(p),
            #[cfg(feature = "remote")]
            Storage::Remote(_) => None,
        }
    }

    /// The whole file `name`, `Ok(None)` if there is none. Errors are the store's (after its
    /// own retries), as text.
    pub fn get(&self, name: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        match self {
            Storage::Local(p) => match std::fs::read(p.join(name)) {
                Ok(d) => Ok(Some(d)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e.to_string()),
            },
            #[cfg(feature = "remote")]
            Storage::Remote(s) => {
                let parts: Vec<&str> = name.split('/').collect();
                s.get(&parts).map_err(|e| e.to_string())
            }
        }
    }

    /// Every file under the location (relative path, size), sorted.
    pub fn list(&self) -> std::result::Result<Vec<(String, u64)>, String> {
        match self {
            Storage::Local(p) => {
                let mut out = Vec::new();
                let entries = std::fs::read_dir(p).map_err(|e| e.to_string())?;
                for e in entries {
                    let e = e.map_err(|e| e.to_string())?;
                    let meta = e.metadata().map_err(|e| e.to_string())?;
                    if meta.is_file() {
                        out.push((e.file_name().to_string_lossy().into_owned(), meta.len()));
                    }
                }
                out.sort();
                Ok(out)
            }
            #[cfg(feature = "remote")]
            Storage::Remote(s) => s.list_files(&[]).map_err(|e| e.to_string()),
        }
    }
}
