//! Flashover core: training time, the ordered events and the engine that runs them, the
//! trainer and its state, the traits that algorithms, callbacks, loggers and models
//! implement, data loading, metrics and learning-rate schedules.
//!
//! Everything is generic over Burn's `Backend` / `AutodiffBackend`; no concrete backend is
//! named outside tests. This crate never writes files and knows nothing of checkpoints'
//! on-disk format.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod callback;
pub mod collective;
mod cross_entropy;
pub mod data;
pub mod engine;
pub mod error;
pub mod event;
pub mod logger;
pub mod loss;
pub mod memory;
pub mod metric;
pub mod model;
pub mod params;
pub mod precision;
pub mod restore;
pub mod rng;
pub mod schedule;
pub mod setup;
pub mod shard;
pub mod state;
pub mod time;
#[doc(hidden)]
pub mod toy;
pub mod trainer;
pub mod world;

pub use error::{CoreError, Result};

/// The names most programs need.
pub mod prelude {
    pub use crate::callback::{Algorithm, Callback, Control};
    pub use crate::collective::{Collective, OnEveryRank, Ranks};
    pub use crate::data::{BatchSource, DataLoader, Dataset, InMemoryDataset, Sampler};
    pub use crate::error::CoreError;
    pub use crate::event::Event;
    pub use crate::logger::{Logger, LoggerDestination};
    pub use crate::metric::{Accuracy, LossMetric, Metric, TopKAccuracy};
    pub use crate::model::{
        Batch, ClassTargets, ClassificationBatch, ClassificationOutput, EvalModel, HasMemoryFormat,
        ImageBatch, Logits, MemoryFormat, SelectSamples, SequenceBatch, TokenBatch, TrainModel,
    };
    pub use crate::params::{init_model, params_sha256};
    pub use crate::restore::Restore;
    pub use crate::schedule::{LrSchedule, Scheduler};
    pub use crate::setup::{BatchOf, OutputOf, Setup, SetupOf};
    pub use crate::state::{State, World};
    pub use crate::time::{Time, TimeUnit, Timestamp};
    pub use crate::trainer::{Evaluator, FitReport, Trainer};
}
