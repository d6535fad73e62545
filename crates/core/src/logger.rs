//! Logging: a [`Logger`] hands metrics and hyperparameters to every [`LoggerDestination`]
//! the user added. Destinations see events too (at `INIT` before anyone else), but only the
//! timestamp, never the model: a logger records, it does not steer.

use derive_new::new;
use serde_json::Value;

use crate::error::Result;
use crate::event::Event;
use crate::time::{Progress, Timestamp};
use crate::world::{OnEveryRank, Ranks, World};

/// Where logged values go: a console, a file, a dashboard.
///
/// Every method defaults to doing nothing. An `Err` from any method stops training with that
/// error (a logger that cannot write is a failure, not something to hide).
pub trait LoggerDestination: Send {
    /// A name for error messages.
    fn name(&self) -> &str;

    /// Called once per run, at the first `FIT_START` (before any callback sees it), with the
    /// run's configuration.
    fn log_hyperparameters(&mut self, params: &serde_json::Map<String, Value>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Called with named values at a point in time.
    fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let _ = (timestamp, metrics);
        Ok(())
    }

    /// Called with a piece of text (a generated sample, a note) under `tag` at a point in
    /// time. Destinations that cannot show text ignore it (the default).
    fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        let _ = (timestamp, tag, text);
        Ok(())
    }

    /// Called at every event, after algorithms and callbacks (at `INIT`, before them), with
    /// where the run stands and how long it is to be (`progress.max_duration`).
    fn run_event(
        &mut self,
        event: Event,
        timestamp: &Timestamp,
        progress: &Progress,
    ) -> Result<()> {
        let _ = (event, timestamp, progress);
        Ok(())
    }

    /// The ranks of a data-parallel run on which this destination receives anything.
    /// Default: rank 0 only, since a logger writes; wrap it in
    /// [`OnEveryRank`] to log on every rank.
    fn ranks(&self) -> Ranks {
        Ranks::Main
    }
}

/// Fans logged values out to every destination (`Logger::new(destinations)`).
#[derive(Default, new)]
pub struct Logger {
    destinations: Vec<Box<dyn LoggerDestination>>,
}

impl Logger {
    /// Keeps only the destinations that act on this rank of `world` (see
    /// [`LoggerDestination::ranks`]); the others never see a value.
    pub fn for_rank(mut self, world: World) -> Self {
        self.destinations.retain(|d| world.runs(d.ranks()));
        self
    }

    /// Whether there is nowhere to log to (the trainer then skips building log records).
    pub fn is_empty(&self) -> bool {
        self.destinations.is_empty()
    }

    /// Logs named values to every destination.
    pub fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        for d in &mut self.destinations {
            d.log_metrics(timestamp, metrics)?;
        }
        Ok(())
    }

    /// Logs text under `tag` to every destination that shows text.
    pub fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        for d in &mut self.destinations {
            d.log_text(timestamp, tag, text)?;
        }
        Ok(())
    }

    /// Logs the run's configuration to every destination.
    pub fn log_hyperparameters(&mut self, params: &serde_json::Map<String, Value>) -> Result<()> {
        for d in &mut self.destinations {
            d.log_hyperparameters(params)?;
        }
        Ok(())
    }

    pub(crate) fn run_event(
        &mut self,
        event: Event,
        timestamp: &Timestamp,
        progress: &Progress,
    ) -> Result<()> {
        for d in &mut self.destinations {
            d.run_event(event, timestamp, progress)?;
        }
        Ok(())
    }
}

impl<T: LoggerDestination> LoggerDestination for OnEveryRank<T> {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn log_hyperparameters(
        &mut self,
        params: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        self.0.log_hyperparameters(params)
    }
    fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        self.0.log_metrics(timestamp, metrics)
    }
    fn run_event(
        &mut self,
        event: Event,
        timestamp: &Timestamp,
        progress: &Progress,
    ) -> Result<()> {
        self.0.run_event(event, timestamp, progress)
    }
    fn ranks(&self) -> Ranks {
        Ranks::Every
    }
}
