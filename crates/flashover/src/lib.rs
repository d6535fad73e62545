//! Flashover: faster, resumable training for Burn, in the spirit of MosaicML Composer.
//!
//! This facade re-exports the workspace's crates and picks backends by Cargo feature:
//! `flex` (default) and `ndarray` on the CPU, `wgpu` and `cuda` on GPUs. Library code stays
//! generic over Burn's `Backend`; only programs pick one, through [`backend`].
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub use burn;
pub use flashover_algorithms as algorithms;
pub use flashover_callbacks as callbacks;
pub use flashover_checkpoint as checkpoint;
pub use flashover_core as core;
pub use flashover_distributed as distributed;
pub use flashover_models as models;

/// Backends compiled into this build, each with its autodiff form.
pub mod backend {
    pub use burn::backend::Autodiff;

    #[cfg(feature = "cuda")]
    pub use burn::backend::Cuda;
    #[cfg(feature = "flex")]
    pub use burn::backend::Flex;
    #[cfg(feature = "ndarray")]
    pub use burn::backend::NdArray;
    #[cfg(feature = "wgpu")]
    pub use burn::backend::Wgpu;

    /// Names of the backends compiled into this build, in order of preference for a
    /// default (CPU backends first: they need no device).
    pub const COMPILED: &[&str] = &[
        #[cfg(feature = "flex")]
        "flex",
        #[cfg(feature = "ndarray")]
        "ndarray",
        #[cfg(feature = "wgpu")]
        "wgpu",
        #[cfg(feature = "cuda")]
        "cuda",
    ];
}

/// Everything most training programs use.
pub mod prelude {
    pub use flashover_callbacks::monitors::{
        LrMonitor, MemoryMonitor, NanMonitor, NormMonitor, RuntimeEstimator, SpeedMonitor,
    };
    pub use flashover_callbacks::profiler::{Profiler, ProfilerSchedule};
    pub use flashover_callbacks::{
        ConsoleLogger, CsvLogger, JsonlLogger, MetricStopper, ProgressBar, StopAt,
        TensorBoardLogger, TrainingPlot,
    };
    pub use flashover_checkpoint::{
        autoresume, autoresume_with, load_weights, save_weights, AutoresumeOptions,
        CheckpointError, CheckpointRestore, LoadOptions, SaveInterval, Saver, SaverConfig,
    };
    pub use flashover_core::prelude::*;
}
