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
pub use flashover_streaming as streaming;
pub use flashover_surgery as surgery;

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

    /// The first backend compiled into this build, in the order of [`COMPILED`]: flex with
    /// the default features. Programs that do not care which backend runs name this one, so
    /// that switching backends is a Cargo feature, not a code change.
    #[cfg(feature = "flex")]
    pub type Default = burn::backend::Flex;
    /// The first backend compiled into this build (see the `flex` case).
    #[cfg(all(feature = "ndarray", not(feature = "flex")))]
    pub type Default = burn::backend::NdArray;
    /// The first backend compiled into this build (see the `flex` case).
    #[cfg(all(feature = "wgpu", not(any(feature = "flex", feature = "ndarray"))))]
    pub type Default = burn::backend::Wgpu;
    /// The first backend compiled into this build (see the `flex` case).
    #[cfg(all(
        feature = "cuda",
        not(any(feature = "flex", feature = "ndarray", feature = "wgpu"))
    ))]
    pub type Default = burn::backend::Cuda;

    /// [`Default`] with automatic differentiation: the backend a model trains on. Its inner
    /// backend ([`Default`]) is the one evaluation data lives on.
    #[cfg(any(
        feature = "flex",
        feature = "ndarray",
        feature = "wgpu",
        feature = "cuda"
    ))]
    pub type DefaultAutodiff = Autodiff<Default>;

    /// Work to run on a backend chosen at run time (see [`with_backend`]): `run` is generic
    /// over the autodiff backend, so one body serves every backend compiled in.
    pub trait OnBackend {
        /// What the work returns.
        type Output;
        /// Runs the work on autodiff backend `B` (its inner backend evaluates).
        fn run<B: flashover_models::TrainBackend>(self) -> Self::Output;
    }

    /// A backend name that is not compiled into this build.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct UnknownBackend {
        /// The name as given.
        pub name: String,
    }

    impl std::fmt::Display for UnknownBackend {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "backend {:?} is not compiled into this build; available: {} (enable others with the flashover features wgpu, cuda, ndarray)",
                self.name,
                COMPILED.join(", ")
            )
        }
    }

    impl std::error::Error for UnknownBackend {}

    /// Runs `work` on the backend named `name` (`"flex"`, `"ndarray"`, `"wgpu"` or `"cuda"`,
    /// among those compiled in: [`COMPILED`]), with automatic differentiation: a `--backend`
    /// flag in one line. Any other name is an [`UnknownBackend`] error listing the available
    /// ones.
    ///
    /// ```
    /// use flashover::backend::{with_backend, OnBackend};
    /// struct Name;
    /// impl OnBackend for Name {
    ///     type Output = String;
    ///     fn run<B: flashover::models::TrainBackend>(self) -> String {
    ///         std::any::type_name::<B>().to_string()
    ///     }
    /// }
    /// assert!(with_backend("flex", Name).unwrap().contains("Flex"));
    /// let err = with_backend("tpu", Name).unwrap_err().to_string();
    /// assert!(err.contains("\"tpu\"") && err.contains("flex"), "{err}");
    /// ```
    pub fn with_backend<W: OnBackend>(name: &str, work: W) -> Result<W::Output, UnknownBackend> {
        let _ = &work;
        match name {
            #[cfg(feature = "flex")]
            "flex" => Ok(work.run::<Autodiff<burn::backend::Flex>>()),
            #[cfg(feature = "ndarray")]
            "ndarray" => Ok(work.run::<Autodiff<burn::backend::NdArray>>()),
            #[cfg(feature = "wgpu")]
            "wgpu" => Ok(work.run::<Autodiff<burn::backend::Wgpu>>()),
            #[cfg(feature = "cuda")]
            "cuda" => Ok(work.run::<Autodiff<burn::backend::Cuda>>()),
            other => Err(UnknownBackend {
                name: other.to_string(),
            }),
        }
    }

    /// Burn's activation-checkpointing strategy: as a second type parameter of [`Autodiff`]
    /// (`Autodiff<Flex, BalancedCheckpointing>`), the backward pass computes again what is
    /// cheap to compute (element-wise operations, and Flashover's attention probabilities)
    /// instead of keeping it from the forward pass. The gradients are the same bits.
    pub use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;

    /// [`with_backend`], with activation checkpointing when `activation_checkpointing` is
    /// set: `work` runs on `Autodiff<B, BalancedCheckpointing>`, which keeps fewer
    /// activations for the backward pass and computes them again there (less memory, more
    /// time; the same gradients, bit for bit).
    ///
    /// ```
    /// use flashover::backend::{with_backend_checkpointing, OnBackend};
    /// struct Name;
    /// impl OnBackend for Name {
    ///     type Output = String;
    ///     fn run<B: flashover::models::TrainBackend>(self) -> String {
    ///         std::any::type_name::<B>().to_string()
    ///     }
    /// }
    /// let name = with_backend_checkpointing("flex", true, Name).unwrap();
    /// assert!(name.contains("BalancedCheckpointing"), "{name}");
    /// ```
    pub fn with_backend_checkpointing<W: OnBackend>(
        name: &str,
        activation_checkpointing: bool,
        work: W,
    ) -> Result<W::Output, UnknownBackend> {
        if !activation_checkpointing {
            return with_backend(name, work);
        }
        let _ = &work;
        match name {
            #[cfg(feature = "flex")]
            "flex" => Ok(work.run::<Autodiff<burn::backend::Flex, BalancedCheckpointing>>()),
            #[cfg(feature = "ndarray")]
            "ndarray" => Ok(work.run::<Autodiff<burn::backend::NdArray, BalancedCheckpointing>>()),
            #[cfg(feature = "wgpu")]
            "wgpu" => Ok(work.run::<Autodiff<burn::backend::Wgpu, BalancedCheckpointing>>()),
            #[cfg(feature = "cuda")]
            "cuda" => Ok(work.run::<Autodiff<burn::backend::Cuda, BalancedCheckpointing>>()),
            other => Err(UnknownBackend {
                name: other.to_string(),
            }),
        }
    }

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

/// Shows Flashover's log lines on stderr: `ConsoleLogger`'s lines (hyperparameters,
/// evaluation results), checkpoint and warning messages. They go through `tracing`, which
/// discards everything until a program installs a subscriber; this installs one at level
/// `info` (or what `RUST_LOG` says), with colours only when stderr is a terminal (never ANSI
/// codes in a log file). Call it once at the start of `main`; it returns `false`, changing
/// nothing, if the program already installed a subscriber of its own.
///
/// ```
/// flashover::init_logging();
/// assert!(!flashover::init_logging()); // a second call changes nothing
/// ```
pub fn init_logging() -> bool {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .try_init()
        .is_ok()
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

/// The README's Rust examples, compiled by `cargo test` as doctests of this crate (a trainer
/// example that stops compiling fails the tests instead of misleading a reader).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
