//! Flashover callbacks and loggers that make a run pleasant to watch: a progress bar and a
//! console logger built on `tracing`.
//!
//! Callbacks here observe; they never change the model, the batch or the gradients, and they
//! never write checkpoints.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod plot;

use std::io::IsTerminal;

use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;
use flashover_core::callback::Callback;
use flashover_core::error::Result;
use flashover_core::logger::{Logger, LoggerDestination};
use flashover_core::model::TrainModel;
use flashover_core::state::State;
use flashover_core::time::Timestamp;
use indicatif::{ProgressBar as Bar, ProgressDrawTarget, ProgressStyle};

/// A progress bar over the whole run (batches done of batches planned), with the last loss
/// and learning rate. Drawn on stderr only when stderr is a terminal; otherwise it stays
/// silent, so logs and pipes are not filled with redraws.
///
/// ```
/// use flashover_callbacks::ProgressBar;
/// let bar = ProgressBar::new();
/// assert!(!bar.is_visible() || std::io::IsTerminal::is_terminal(&std::io::stderr()));
/// ```
pub struct ProgressBar {
    bar: Option<Bar>,
    visible: bool,
}

impl Default for ProgressBar {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressBar {
    /// A bar that draws when stderr is a terminal.
    pub fn new() -> Self {
        ProgressBar {
            bar: None,
            visible: std::io::stderr().is_terminal(),
        }
    }

    /// Whether the bar will draw anything.
    pub fn is_visible(&self) -> bool {
        self.visible
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> Callback<B, M, O> for ProgressBar {
    fn name(&self) -> &str {
        "progress_bar"
    }

    fn fit_start(&mut self, state: &mut State<B, M, O>, _logger: &mut Logger) -> Result<()> {
        if !self.visible {
            return Ok(());
        }
        let total = state
            .progress()
            .to_batches(state.max_duration)
            .map(|b| b.ceil() as u64);
        let bar = match total {
            Some(t) => Bar::new(t),
            None => Bar::new_spinner(),
        };
        bar.set_draw_target(ProgressDrawTarget::stderr_with_hz(4));
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} batches  {elapsed_precise}<{eta_precise}  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(state.timestamp.batch);
        self.bar = Some(bar);
        Ok(())
    }

    fn batch_end(&mut self, state: &mut State<B, M, O>, _logger: &mut Logger) -> Result<()> {
        if let Some(bar) = &self.bar {
            bar.set_position(state.timestamp.batch);
            if state.timestamp.batch.is_multiple_of(10) {
                let loss = state
                    .loss_value
                    .map(|l| format!("loss {l:.4}"))
                    .unwrap_or_default();
                bar.set_message(format!(
                    "epoch {} {loss} lr {:.2e}",
                    state.timestamp.epoch, state.lr
                ));
            }
        }
        Ok(())
    }

    fn fit_end(&mut self, _state: &mut State<B, M, O>, _logger: &mut Logger) -> Result<()> {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        Ok(())
    }
}

/// Logs metrics through `tracing` at INFO: every evaluation result, and the training loss
/// every `every` batches.
pub struct ConsoleLogger {
    every: u64,
}

impl ConsoleLogger {
    /// Logs training values every `every` batches (at least 1) and every evaluation.
    pub fn new(every: u64) -> Self {
        ConsoleLogger {
            every: every.max(1),
        }
    }
}

impl LoggerDestination for ConsoleLogger {
    fn name(&self) -> &str {
        "console"
    }

    fn log_hyperparameters(
        &mut self,
        params: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        tracing::info!(hyperparameters = %serde_json::Value::Object(params.clone()), "run configuration");
        Ok(())
    }

    fn log_metrics(&mut self, ts: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let is_eval = metrics.iter().any(|(k, _)| k.starts_with("eval/"));
        if is_eval || ts.batch.is_multiple_of(self.every) {
            let text: Vec<String> = metrics.iter().map(|(k, v)| format!("{k}={v:.5}")).collect();
            tracing::info!(epoch = ts.epoch, batch = ts.batch, "{}", text.join(" "));
        }
        Ok(())
    }
}

/// Asks training to stop once the run reaches a given time (in any unit but `dur`, which is
/// what `max_duration` is for). The stop is clean: the batch finishes, its checkpoint event
/// runs, then `FIT_END` (where a checkpoint saver writes the state to resume from).
///
/// ```
/// use flashover_callbacks::StopAt;
/// use flashover_core::time::Time;
/// let stop = StopAt::new(Time::Batch(100));
/// assert_eq!(stop.at(), Time::Batch(100));
/// ```
pub struct StopAt {
    at: flashover_core::time::Time,
}

impl StopAt {
    /// Stops when the timestamp reaches `at`.
    pub fn new(at: flashover_core::time::Time) -> Self {
        StopAt { at }
    }

    /// When training stops.
    pub fn at(&self) -> flashover_core::time::Time {
        self.at
    }

    fn check<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>>(
        &self,
        state: &mut State<B, M, O>,
    ) {
        let reached = match self.at.unit() {
            flashover_core::time::TimeUnit::Duration => {
                state.progress().fraction(&state.timestamp) >= self.at.value()
            }
            unit => state
                .timestamp
                .count(unit)
                .is_some_and(|c| c as f64 >= self.at.value()),
        };
        if reached && state.stop_requested().is_none() {
            state.request_stop(format!("reached {}", self.at));
        }
    }
}

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> Callback<B, M, O> for StopAt {
    fn name(&self) -> &str {
        "stop_at"
    }

    fn batch_end(&mut self, state: &mut State<B, M, O>, _logger: &mut Logger) -> Result<()> {
        self.check(state);
        Ok(())
    }

    fn epoch_end(&mut self, state: &mut State<B, M, O>, _logger: &mut Logger) -> Result<()> {
        self.check(state);
        Ok(())
    }
}
