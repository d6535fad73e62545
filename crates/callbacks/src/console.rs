//! Loggers for people watching a terminal: [`ConsoleLogger`] (through `tracing`) and
//! [`ProgressBar`] (indicatif).

use std::io::IsTerminal;

use flashover_core::error::Result;
use flashover_core::event::Event;
use flashover_core::logger::LoggerDestination;
use flashover_core::time::{Progress, Timestamp};
use indicatif::{ProgressBar as Bar, ProgressDrawTarget, ProgressStyle};

/// Logs through `tracing` at INFO: the run's hyperparameters once, every evaluation result,
/// and every `every` batches one line with all the values logged for that batch (the
/// trainer's loss and learning rate, and whatever monitors logged).
///
/// `tracing` discards every line until the program installs a subscriber: call
/// `flashover::init_logging()` at the start of `main` (stderr, `RUST_LOG` or `info`, colours
/// only on a terminal), or install one of your own.
///
/// ```
/// use flashover_callbacks::ConsoleLogger;
/// let console = ConsoleLogger::new(50); // trainer builder: .logger(ConsoleLogger::new(50))
/// # let _ = console;
/// ```
pub struct ConsoleLogger {
    every: u64,
    pending: Vec<String>,
    pending_at: Option<(u64, u64)>,
}

impl ConsoleLogger {
    /// Logs training values every `every` batches (at least 1) and every evaluation.
    pub fn new(every: u64) -> Self {
        ConsoleLogger {
            every: every.max(1),
            pending: Vec::new(),
            pending_at: None,
        }
    }

    fn flush(&mut self) {
        if let Some((epoch, batch)) = self.pending_at.take() {
            tracing::info!(epoch, batch, "{}", self.pending.join(" "));
            self.pending.clear();
        }
    }
}

fn format_value(v: f64) -> String {
    if v != 0.0 && (v.abs() >= 1e6 || v.abs() < 1e-3) {
        format!("{v:.4e}")
    } else {
        format!("{v:.5}")
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
        let text = metrics
            .iter()
            .map(|(k, v)| format!("{k}={}", format_value(*v)));
        if metrics.iter().any(|(k, _)| k.starts_with("eval/")) {
            self.flush();
            let text: Vec<String> = text.collect();
            tracing::info!(epoch = ts.epoch, batch = ts.batch, "{}", text.join(" "));
        } else if ts.batch.is_multiple_of(self.every) {
            if self.pending_at.is_some_and(|(_, b)| b != ts.batch) {
                self.flush();
            }
            self.pending_at = Some((ts.epoch, ts.batch));
            self.pending.extend(text);
        }
        Ok(())
    }

    fn log_text(&mut self, ts: &Timestamp, tag: &str, text: &str) -> Result<()> {
        self.flush();
        tracing::info!(epoch = ts.epoch, batch = ts.batch, "{tag}:\n{text}");
        Ok(())
    }

    fn run_event(&mut self, event: Event, _ts: &Timestamp, _progress: &Progress) -> Result<()> {
        if matches!(
            event,
            Event::BatchCheckpoint | Event::EvalBeforeAll | Event::FitEnd
        ) {
            self.flush();
        }
        Ok(())
    }
}

/// A progress bar over the whole run (batches done of batches planned, elapsed and estimated
/// time left) with the last loss and learning rate. Drawn on stderr only when stderr is a
/// terminal; otherwise it stays silent, so logs and pipes are not filled with redraws.
///
/// ```
/// use flashover_callbacks::ProgressBar;
/// let bar = ProgressBar::new(); // trainer builder: .logger(ProgressBar::new())
/// assert!(!bar.is_visible() || std::io::IsTerminal::is_terminal(&std::io::stderr()));
/// ```
pub struct ProgressBar {
    bar: Option<Bar>,
    target: Target,
    loss: Option<f64>,
    lr: Option<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Stderr,
    Hidden,
    Off,
}

impl Default for ProgressBar {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressBar {
    /// A bar that draws when stderr is a terminal.
    pub fn new() -> Self {
        let target = if std::io::stderr().is_terminal() {
            Target::Stderr
        } else {
            Target::Off
        };
        ProgressBar {
            bar: None,
            target,
            loss: None,
            lr: None,
        }
    }

    /// A bar that keeps all its state up to date but draws nowhere (what the overhead
    /// benchmark measures, so the cost of the bar counts even without a terminal).
    pub fn hidden() -> Self {
        ProgressBar {
            target: Target::Hidden,
            ..Self::new()
        }
    }

    /// Whether the bar will draw anything.
    pub fn is_visible(&self) -> bool {
        self.target == Target::Stderr
    }
}

impl LoggerDestination for ProgressBar {
    fn name(&self) -> &str {
        "progress_bar"
    }

    fn log_metrics(&mut self, _ts: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        if self.bar.is_some() {
            for (k, v) in metrics {
                match *k {
                    "train/loss" => self.loss = Some(*v),
                    "train/lr" => self.lr = Some(*v),
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn run_event(&mut self, event: Event, ts: &Timestamp, progress: &Progress) -> Result<()> {
        match event {
            Event::FitStart if self.target != Target::Off => {
                let total = progress
                    .to_batches(progress.max_duration)
                    .map(|b| b.ceil() as u64);
                let bar = match total {
                    Some(t) => Bar::new(t),
                    None => Bar::new_spinner(),
                };
                bar.set_draw_target(match self.target {
                    Target::Stderr => ProgressDrawTarget::stderr_with_hz(4),
                    _ => ProgressDrawTarget::hidden(),
                });
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:30} {pos}/{len} batches  {elapsed_precise}<{eta_precise}  {msg}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                bar.set_position(ts.batch);
                self.bar = Some(bar);
            }
            Event::BatchCheckpoint => {
                if let Some(bar) = &self.bar {
                    bar.set_position(ts.batch);
                    if ts.batch.is_multiple_of(10) {
                        let loss = self
                            .loss
                            .map(|l| format!("loss {l:.4} "))
                            .unwrap_or_default();
                        let lr = self.lr.map(|l| format!("lr {l:.2e}")).unwrap_or_default();
                        bar.set_message(format!("epoch {} {loss}{lr}", ts.epoch));
                    }
                }
            }
            Event::FitEnd => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
            }
            _ => {}
        }
        Ok(())
    }
}
