//! Errors of streamed datasets: each names the dataset's location and, where there is one,
//! the shard, the sample or the column, and says what would be accepted.

use thiserror::Error;

/// A failure to open, download, verify or decode a streamed dataset.
#[derive(Debug, Error)]
pub enum StreamingError {
    /// A setting outside what is accepted.
    #[error("invalid {name} {value:?}: expected {expected}")]
    Config {
        /// The setting (a flag or builder method).
        name: &'static str,
        /// The value given.
        value: String,
        /// What would be accepted.
        expected: String,
    },
    /// The dataset's index (`index.json`, or the Parquet files' footers) cannot be used.
    #[error("dataset index {location}: {reason}")]
    Index {
        /// Where the index was read.
        location: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A shard could not be fetched after every retry.
    #[error("shard {shard}: download failed after {attempts} attempts: {reason}")]
    Download {
        /// The shard's file (basename) and where it lives.
        shard: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        reason: String,
    },
    /// A shard's bytes do not match the index (size or hash), or cannot be decompressed.
    #[error("shard {shard} is damaged: {reason}")]
    Damaged {
        /// The shard's file.
        shard: String,
        /// What did not match.
        reason: String,
    },
    /// A sample cannot be decoded.
    #[error("shard {shard}, sample {sample}: {reason}")]
    Decode {
        /// The shard's file.
        shard: String,
        /// The sample's index within the shard.
        sample: usize,
        /// What failed (the column and the encoding).
        reason: String,
    },
    /// The local cache cannot hold what must be held.
    #[error("cache {folder}: {reason}")]
    Cache {
        /// The cache folder.
        folder: String,
        /// Why.
        reason: String,
    },
    /// A local file operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("read", "write", ...).
        action: &'static str,
        /// The file.
        path: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
}

impl StreamingError {
    /// A [`StreamingError::Config`].
    pub fn config(name: &'static str, value: impl ToString, expected: impl Into<String>) -> Self {
        StreamingError::Config {
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    pub(crate) fn io(action: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        StreamingError::Io {
            action,
            path: path.display().to_string(),
            source,
        }
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, StreamingError>;
