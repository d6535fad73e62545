//! The one error type of `flashover-callbacks`: bad settings, files that cannot be written, and
//! values a watchdog refuses (a NaN loss or gradient). Each names the value and what would be
//! accepted, or the file and the batch.

use std::path::PathBuf;

use flashover_core::CoreError;

/// Everything that can go wrong in `flashover-callbacks`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallbackError {
    /// A setting is out of range or malformed.
    #[error("{component}: invalid value {value} for `{name}`: expected {expected}")]
    InvalidParameter {
        /// The callback or logger.
        component: &'static str,
        /// The setting.
        name: &'static str,
        /// The value as given.
        value: String,
        /// What would be accepted.
        expected: String,
    },

    /// A log, trace or plot file could not be created or written.
    #[error("{component}: cannot write {path}: {source}")]
    Io {
        /// The logger or callback.
        component: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A loss or gradient is NaN or infinite.
    #[error(
        "non-finite {what} ({value}) at epoch {epoch}, batch {batch} (batch {batch_in_epoch} of the epoch){detail}"
    )]
    NonFinite {
        /// What was not finite ("loss", "gradient").
        what: &'static str,
        /// The value seen (NaN, inf or -inf).
        value: f64,
        /// Epoch of the batch.
        epoch: u64,
        /// Batches completed before this one (the failing batch is number `batch` counting from 0).
        batch: u64,
        /// The batch's index in its epoch.
        batch_in_epoch: u64,
        /// More about where (the microbatch, the parameters).
        detail: String,
    },

    /// A metric a stopper watches does not exist in this run.
    #[error("{component}: no metric {metric:?} in this run; available: {available}")]
    UnknownMetric {
        /// The callback.
        component: &'static str,
        /// The metric asked for.
        metric: String,
        /// The metrics the run has, comma-separated.
        available: String,
    },

    /// Drawing a chart failed.
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),

    /// A saved callback state does not fit this callback.
    #[error("{component}: cannot restore saved state: {reason}")]
    BadState {
        /// The callback.
        component: &'static str,
        /// What does not fit.
        reason: String,
    },
}

/// Shorthand for results in this crate.
pub type Result<T, E = CallbackError> = std::result::Result<T, E>;

impl CallbackError {
    /// Builds an [`CallbackError::InvalidParameter`].
    pub fn param(
        component: &'static str,
        name: &'static str,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        CallbackError::InvalidParameter {
            component,
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// Builds an [`CallbackError::Io`].
    pub fn io(component: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CallbackError::Io {
            component,
            path: path.into(),
            source,
        }
    }
}

impl From<CallbackError> for CoreError {
    fn from(e: CallbackError) -> Self {
        let component = match &e {
            CallbackError::InvalidParameter { component, .. }
            | CallbackError::Io { component, .. }
            | CallbackError::UnknownMetric { component, .. }
            | CallbackError::BadState { component, .. } => component.to_string(),
            CallbackError::NonFinite { .. } => "nan_monitor".to_string(),
            CallbackError::Plot(_) => "plot".to_string(),
        };
        CoreError::External {
            component,
            source: Box::new(e),
        }
    }
}
