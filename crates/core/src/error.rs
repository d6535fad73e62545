//! The one error type of `flashover-core`. Every bad input that reaches the core (a duration
//! string, a configuration value, a data file, a non-finite loss) becomes a variant here that
//! names the offending value and says what would be accepted. Nothing in core panics on input.

use std::path::PathBuf;

/// Everything that can go wrong in `flashover-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A time string such as `"2ep"` could not be parsed.
    #[error("invalid time {input:?}: {reason}; expected a number followed by one of the units ep, ba, sp, tok, dur (for example \"2ep\", \"500ba\", \"1e6tok\", \"0.3dur\"; units in any case, `_` between digits), or a wall-clock time in h, m and s (\"1h30m\", \"45m\", \"90s\"; a part after a larger one below 60) or in Composer's sec (\"3600sec\")")]
    InvalidTime {
        /// The string as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Two times of different units were added, subtracted or divided.
    #[error("cannot compute {left} {op} {right}: the units differ; convert one time first (both must be in ep, ba, sp, tok, dur or wall-clock time)")]
    TimeUnitMismatch {
        /// The operation (`+`, `-`, `/`).
        op: &'static str,
        /// The left operand, formatted.
        left: String,
        /// The right operand, formatted.
        right: String,
    },

    /// A configuration value is outside the range the trainer accepts.
    #[error("invalid value {value} for `{name}`: expected {expected}")]
    InvalidConfig {
        /// The name of the setting (builder method or CLI flag).
        name: &'static str,
        /// The value as given, formatted.
        value: String,
        /// What would be accepted.
        expected: String,
    },

    /// The backend cannot store or compute the half type a precision needs on this device.
    #[error("precision {precision} needs {dtype} arithmetic, which backend {backend} does not support on this device; precisions it supports here: {supported}")]
    UnsupportedPrecision {
        /// The precision asked for.
        precision: &'static str,
        /// The float type it needs.
        dtype: String,
        /// The backend (and device), as Burn names it.
        backend: String,
        /// The precisions the backend supports on the device.
        supported: String,
    },

    /// The training (or evaluation) dataset has no items.
    #[error("dataset `{name}` is empty: at least one item is needed")]
    EmptyDataset {
        /// Which dataset (for example "train" or an evaluator's label).
        name: String,
    },

    /// `fit` was called but `max_duration` is already reached and no extra duration was given.
    #[error("max_duration {max_duration} is already reached at {at}; pass a duration to `fit_for` to train further")]
    DurationReached {
        /// The configured maximum duration.
        max_duration: String,
        /// Where the run stands now.
        at: String,
    },

    /// The loss of a batch was NaN or infinite.
    #[error("non-finite loss {value} at epoch {epoch}, batch {batch} (batch {batch_in_epoch} of the epoch); lower the learning rate, or enable `skip_nonfinite_loss` to skip such batches")]
    NonFiniteLoss {
        /// The loss value that was read.
        value: f64,
        /// Epoch (0-based) of the batch.
        epoch: u64,
        /// Global batch index (0-based).
        batch: u64,
        /// Index of the batch inside its epoch (0-based).
        batch_in_epoch: u64,
    },

    /// A class index is outside the model's classes.
    #[error("class index {value} is outside 0..{num_classes}: targets must be class indices from 0 to {num_classes} - 1 (negative indices are not wrapped and there is no ignore index; relabel or drop such samples)")]
    ClassIndex {
        /// The offending index.
        value: i64,
        /// The number of classes.
        num_classes: usize,
    },

    /// A data file could not be read.
    #[error("cannot read data file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A data file was read but its content is not what its format requires.
    #[error("malformed data file {path}: {reason}")]
    MalformedData {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A data directory lacks a file the loader needs.
    #[error("no {what} file in {dir}: looked for {candidates}")]
    MissingDataFile {
        /// Which role the file plays (for example "training images").
        what: &'static str,
        /// The directory searched.
        dir: PathBuf,
        /// The names tried, comma-separated.
        candidates: String,
    },

    /// An algorithm or callback failed; the message is its own.
    #[error("{component} failed at {event}: {message}")]
    Component {
        /// Name of the algorithm, callback or logger.
        component: String,
        /// The event during which it failed.
        event: &'static str,
        /// What went wrong.
        message: String,
    },

    /// A component (algorithm, callback, logger) failed with an error of its own crate.
    #[error("{}", prefixed(component, source.as_ref()))]
    External {
        /// The component's name.
        component: String,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// Restoring the trainer from a checkpoint failed (the source says which file and why).
    #[error("cannot restore from checkpoint: {0}")]
    Restore(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// A checkpoint lacks the state of an algorithm that must find its own state there (a
    /// surgery algorithm: the checkpoint's model was built without its change).
    #[error("the checkpoint has no state for {component}, which changes the model's architecture: the checkpoint's model was built without it; resume with the checkpoint's algorithms, or load its weights only")]
    MissingComponentState {
        /// The component's key (`algorithm/<name>`).
        component: String,
    },

    /// An algorithm changed a part of the state outside the events at which it may change.
    #[error("{what} may be changed {window}, not at {event}")]
    OutsideWindow {
        /// What was to be changed (`the batch`).
        what: &'static str,
        /// The event being run (`no event` outside one).
        event: &'static str,
        /// The events at which it may, in words.
        window: &'static str,
    },

    /// A restored position does not fit the training data.
    #[error("restored position {at} does not fit this run: {reason}")]
    RestoredPosition {
        /// The restored timestamp, formatted.
        at: String,
        /// What is wrong.
        reason: String,
    },

    /// The device ran out of memory on a batch even in microbatches of one sample (automatic
    /// microbatching halves them down to 1), or outside the batch's forward and backward
    /// passes, where smaller microbatches do not help.
    #[error("the device ran out of memory at epoch {epoch}, batch {batch} {during}: {reason}")]
    OutOfMemory {
        /// Epoch of the batch.
        epoch: u64,
        /// Batch index (since the start of training).
        batch: u64,
        /// Where: `in microbatches of N samples`, or `before the batch's forward pass`.
        during: String,
        /// What would help.
        reason: String,
    },

    /// The device reported an error that is not running out of memory.
    #[error("device error at epoch {epoch}, batch {batch}: {message}")]
    Device {
        /// Epoch of the batch.
        epoch: u64,
        /// Batch index (since the start of training).
        batch: u64,
        /// The backend's message.
        message: String,
    },

    /// The background data loader stopped without delivering a batch it promised.
    #[error("data loader for `{name}` stopped early at batch {batch}: {reason}")]
    Loader {
        /// Which loader.
        name: String,
        /// Batch index inside the epoch.
        batch: usize,
        /// Why.
        reason: String,
    },
}

/// `component: message`, unless the message already starts with the component's name.
fn prefixed(component: &str, source: &(dyn std::error::Error + Send + Sync)) -> String {
    let text = source.to_string();
    if text.starts_with(&format!("{component}: ")) {
        text
    } else {
        format!("{component}: {text}")
    }
}

/// An error and its chain of sources as one line, `outer: cause: root cause`, leaving out a
/// source whose text the line already holds (many errors quote their source in their own
/// message, and printing the chain naively would repeat it). This is how the examples print
/// a failure.
///
/// ```
/// use flashover_core::error::{report, CoreError};
/// let io = std::io::Error::other("disk full");
/// let e = CoreError::Io { path: "x.idx".into(), source: io };
/// assert_eq!(report(&e), "cannot read data file x.idx: disk full");
/// ```
pub fn report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = s.source();
    }
    line
}

/// Shorthand for results in this crate.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;

impl CoreError {
    /// Builds an [`CoreError::InvalidConfig`].
    pub fn config(
        name: &'static str,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        Self::InvalidConfig {
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}
