//! Flashover callbacks and loggers: watch and steer a run with the tools people already use.
//!
//! Each is one line to add to a [`Trainer`](flashover_core::trainer::Trainer) builder:
//!
//! ```no_run
//! # use flashover_callbacks::*;
//! # use flashover_core::time::Time;
//! # fn f() -> Result<(), CallbackError> {
//! // Callbacks (`.callback(...)`): they read the state at events.
//! let lr = monitors::LrMonitor::new();
//! let speed = monitors::SpeedMonitor::new(100)?;
//! let eta = monitors::RuntimeEstimator::new(50)?;
//! let memory = monitors::MemoryMonitor::new(Time::Batch(50))?;
//! let norms = monitors::NormMonitor::new(Time::Batch(50))?;
//! let nan = monitors::NanMonitor::new();
//! let early = stop::MetricStopper::parse_early("test/accuracy:patience=2ep:min_delta=0.001")?;
//! let threshold = stop::MetricStopper::parse_threshold("test/accuracy=0.99")?;
//! let trace = profiler::Profiler::new("runs/trace.json", profiler::ProfilerSchedule::default())?;
//! let plot = TrainingPlot::new("runs/training.png");
//! // Loggers (`.logger(...)`): they receive every logged value.
//! let console = ConsoleLogger::new(50);
//! let bar = ProgressBar::new();
//! let jsonl = JsonlLogger::create("runs/metrics.jsonl")?;
//! let csv = CsvLogger::create("runs/metrics.csv")?;
//! let tb = TensorBoardLogger::create("runs/tensorboard")?;
//! let memory = InMemoryLogger::new(); // keep a clone to read what was logged
//! let images = ImageVisualizer::new(Time::Batch(100))?; // a grid of inputs and labels
//! # Ok(()) }
//! ```
//!
//! Monitors log through the run's loggers, so every logger sees the same values; a user's own
//! logger implements [`LoggerDestination`](flashover_core::logger::LoggerDestination).
//! Callbacks here observe: they never change the model, the batch or the gradients, and they
//! never write checkpoints. Stoppers only ask the trainer to stop.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod clock;
mod console;
mod curves;
pub mod error;
mod files;
mod generate;
mod in_memory;
pub mod media;
#[cfg(feature = "mlflow")]
pub mod mlflow;
pub mod monitors;
pub mod plot;
pub mod profiler;
pub mod stop;
pub mod tensorboard;
pub mod visualize;

pub use console::{ConsoleLogger, ProgressBar};
pub use curves::TrainingPlot;
pub use error::CallbackError;
pub use files::{check_writable_dir, CsvLogger, JsonlLogger, CSV_HEADER, MEDIA_DIR};
pub use generate::{Generate, GenerateFn};
pub use in_memory::{InMemoryLogger, Logged};
#[cfg(feature = "mlflow")]
pub use mlflow::{MlflowLogger, MlflowOptions, MlflowRun};
pub use stop::{MetricStopper, StopAt};
pub use tensorboard::TensorBoardLogger;
pub use visualize::ImageVisualizer;
