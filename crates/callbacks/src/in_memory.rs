//! [`InMemoryLogger`]: everything a run logs, kept in memory for the program (or its tests) to
//! read afterwards (Composer's `InMemoryLogger`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use flashover_core::error::Result;
use flashover_core::event::Event;
use flashover_core::logger::{Image, LoggerDestination};
use flashover_core::time::{Progress, Timestamp};
use serde_json::{Map, Value};

/// What an [`InMemoryLogger`] has received, in the order it came.
#[derive(Debug, Clone, Default)]
pub struct Logged {
    /// Every value of every metric: `(timestamp, value)` in logging order, by name.
    pub metrics: BTreeMap<String, Vec<(Timestamp, f64)>>,
    /// The hyperparameters (merged, if logged more than once).
    pub hyperparameters: Map<String, Value>,
    /// Every text: `(timestamp, tag, text)`.
    pub texts: Vec<(Timestamp, String, String)>,
    /// Every image: `(timestamp, tag, image)`.
    pub images: Vec<(Timestamp, String, Image)>,
    /// Every file handed over: `(timestamp, name, path, its bytes at the time)`.
    pub files: Vec<(Timestamp, String, PathBuf, Vec<u8>)>,
    /// Every event, with the timestamp it came at.
    pub events: Vec<(Event, Timestamp)>,
}

impl Logged {
    /// The values of `metric` in logging order (empty if never logged).
    pub fn values(&self, metric: &str) -> Vec<f64> {
        self.metrics
            .get(metric)
            .map(|v| v.iter().map(|(_, x)| *x).collect())
            .unwrap_or_default()
    }

    /// The last value of `metric` and when it was logged (Composer's `most_recent_values`
    /// and `most_recent_timestamps`).
    pub fn most_recent(&self, metric: &str) -> Option<(&Timestamp, f64)> {
        self.metrics
            .get(metric)
            .and_then(|v| v.last())
            .map(|(t, x)| (t, *x))
    }

    /// `metric` as a time series: `(batch, value)` pairs (Composer's `get_timeseries`, by
    /// the batch count; the full timestamps are in [`metrics`](Self::metrics)).
    pub fn timeseries(&self, metric: &str) -> Vec<(u64, f64)> {
        self.metrics
            .get(metric)
            .map(|v| v.iter().map(|(t, x)| (t.batch, *x)).collect())
            .unwrap_or_default()
    }
}

/// A logger that keeps everything in memory. Clones share what they record: keep one, hand
/// another to the trainer, and read it during or after the run.
///
/// ```
/// use flashover_callbacks::InMemoryLogger;
/// use flashover_core::prelude::*;
/// use flashover_core::toy;
/// # type B = burn::backend::Autodiff<burn::backend::Flex>;
/// let logged = InMemoryLogger::new();
/// let mut trainer = toy::trainer::<B>(toy::points(16, 4), Time::Epoch(1))
///     .logger(logged.clone())
///     .build()?;
/// trainer.fit()?;
/// let losses = logged.get().timeseries("train/loss");
/// assert_eq!(losses.iter().map(|(batch, _)| *batch).collect::<Vec<_>>(), [1, 2, 3, 4]);
/// # Ok::<(), CoreError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct InMemoryLogger {
    logged: Arc<Mutex<Logged>>,
}

impl InMemoryLogger {
    /// An empty logger.
    pub fn new() -> Self {
        Self::default()
    }

    /// What has been logged so far (locked while the guard lives: read, then drop it).
    pub fn get(&self) -> MutexGuard<'_, Logged> {
        // A panic while recording leaves plain data behind; what was recorded is still good.
        self.logged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of what has been logged so far.
    pub fn snapshot(&self) -> Logged {
        self.get().clone()
    }
}

impl LoggerDestination for InMemoryLogger {
    fn name(&self) -> &str {
        "in_memory"
    }

    fn log_hyperparameters(&mut self, params: &Map<String, Value>) -> Result<()> {
        let mut logged = self.get();
        for (k, v) in params {
            logged.hyperparameters.insert(k.clone(), v.clone());
        }
        Ok(())
    }

    fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let mut logged = self.get();
        for (k, v) in metrics {
            logged
                .metrics
                .entry(k.to_string())
                .or_default()
                .push((timestamp.clone(), *v));
        }
        Ok(())
    }

    fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        self.get()
            .texts
            .push((timestamp.clone(), tag.to_string(), text.to_string()));
        Ok(())
    }

    fn log_image(&mut self, timestamp: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        self.get()
            .images
            .push((timestamp.clone(), tag.to_string(), image.clone()));
        Ok(())
    }

    fn upload_file(&mut self, timestamp: &Timestamp, name: &str, path: &Path) -> Result<()> {
        let bytes = std::fs::read(path)
            .map_err(|e| crate::error::CallbackError::io("in_memory_logger", path, e))?;
        self.get().files.push((
            timestamp.clone(),
            name.to_string(),
            path.to_path_buf(),
            bytes,
        ));
        Ok(())
    }

    fn run_event(&mut self, event: Event, timestamp: &Timestamp, _p: &Progress) -> Result<()> {
        self.get().events.push((event, timestamp.clone()));
        Ok(())
    }
}
