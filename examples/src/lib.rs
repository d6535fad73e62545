//! Models and data plumbing shared by the examples, the cross-crate tests and benchmarks:
//! the MNIST CNN and its loaders. Programs live next to this file (`mnist.rs`); this library
//! holds nothing that only one program uses.
#![warn(missing_docs)]
// `unsafe` only in `allocator` (the `GlobalAlloc` wrapper), allowed there alone.
#![deny(unsafe_code)]

/// Makes mimalloc the program's allocator, watched for failure ([`allocator`]: a process
/// that reaches its memory limit says so in plain words); every example program calls it
/// once at the top level. A training step allocates and frees buffers of megabytes (activations,
/// gradients); glibc's malloc hands such buffers back to the kernel and faults them in again
/// the next step, which cost the main job about a sixth of its time in the kernel at two
/// threads (page faults, zeroing, TLB shootdowns between the threads) and most of the
/// second thread's gain. mimalloc keeps them for reuse. A macro rather than a static here,
/// because a library that installs an allocator forces it on every program that links it
/// (the fuzz runner installs its own).
#[macro_export]
macro_rules! use_mimalloc {
    () => {
        #[global_allocator]
        static ALLOCATOR: $crate::allocator::Allocator = $crate::allocator::Allocator;
    };
}

pub use mimalloc::MiMalloc;

pub mod allocator;
pub mod cli;
pub mod fits;
pub mod overhead;
pub mod session;
pub mod shakespeare;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::optim::Optimizer;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use flashover::algorithms::augment::Normalization;
use flashover::algorithms::recipes::recipe;
use flashover::algorithms::spec::{build_image_classification, AlgorithmSpec};
use flashover::core::callback::Callback;
use flashover::core::callback::Control;
use flashover::core::data::{
    DataLoader, Dataset, MnistBatcher, MnistDataset, MnistItem, MnistSplit, Sampler, MNIST_MEAN,
    MNIST_STD,
};
use flashover::core::metric::{Accuracy, LossMetric, TopKAccuracy};
use flashover::core::model::{
    ClassificationBatch, ClassificationOutput, EvalModel, HasMemoryFormat, MemoryFormat, TrainModel,
};
use flashover::core::precision::{Autocast, LossScaling, Precision};
use flashover::core::schedule::Scheduler;
use flashover::core::setup::{Setup, SetupOf};
use flashover::core::state::{State, World};
use flashover::core::time::Time;
use flashover::core::trainer::{Evaluator, Trainer, TrainerBuilder};
use flashover::core::Result;
use flashover::models::TrainBackend;
use flashover::surgery::Surgical;

/// Calls `f::<Autodiff<B>>(args...)` for the backend named by `name` (a `&str`), among those
/// compiled into this build; any other name is an error listing the available ones. Shared by
/// the example programs so that each backend is wired in one place.
#[macro_export]
macro_rules! with_backend {
    // With activation checkpointing (Burn's `BalancedCheckpointing`) when `$ck` is set.
    ($name:expr, checkpointing = $ck:expr, $f:ident($($arg:expr),* $(,)?)) => {{
        use flashover::backend::{Autodiff, BalancedCheckpointing};
        if !$ck {
            $crate::with_backend!($name, $f($($arg),*))
        } else {
            match $name {
                #[cfg(feature = "flex")]
                "flex" => $f::<Autodiff<flashover::backend::Flex, BalancedCheckpointing>>($($arg),*),
                #[cfg(feature = "ndarray")]
                "ndarray" => $f::<Autodiff<flashover::backend::NdArray, BalancedCheckpointing>>($($arg),*),
                #[cfg(feature = "wgpu")]
                "wgpu" => $f::<Autodiff<flashover::backend::Wgpu, BalancedCheckpointing>>($($arg),*),
                #[cfg(feature = "cuda")]
                "cuda" => $f::<Autodiff<flashover::backend::Cuda, BalancedCheckpointing>>($($arg),*),
                other => Err(anyhow::anyhow!(
                    "backend {other:?} is not compiled into this build; available: {} (enable others with --features wgpu, cuda, ndarray)",
                    flashover::backend::COMPILED.join(", ")
                )),
            }
        }
    }};
    ($name:expr, $f:ident($($arg:expr),* $(,)?)) => {{
        use flashover::backend::Autodiff;
        match $name {
            #[cfg(feature = "flex")]
            "flex" => $f::<Autodiff<flashover::backend::Flex>>($($arg),*),
            #[cfg(feature = "ndarray")]
            "ndarray" => $f::<Autodiff<flashover::backend::NdArray>>($($arg),*),
            #[cfg(feature = "wgpu")]
            "wgpu" => $f::<Autodiff<flashover::backend::Wgpu>>($($arg),*),
            #[cfg(feature = "cuda")]
            "cuda" => $f::<Autodiff<flashover::backend::Cuda>>($($arg),*),
            other => Err(anyhow::anyhow!(
                "backend {other:?} is not compiled into this build; available: {} (enable others with --features wgpu, cuda, ndarray)",
                flashover::backend::COMPILED.join(", ")
            )),
        }
    }};
}

/// Device `index` of backend `B`: the index-th GPU of a GPU backend; the CPU backends have
/// one device, which every index names.
pub fn device_at<B: Backend>(index: usize) -> B::Device {
    use burn::tensor::backend::DeviceOps;
    let default = B::Device::default();
    let id = default.id();
    <B::Device as burn::tensor::backend::Device>::from_id(burn::tensor::backend::DeviceId {
        type_id: id.type_id,
        index_id: index as u16,
    })
}

/// The bytes of `state`'s optimizer state as a checkpoint serialises it (Burn's named
/// MessagePack at full precision): in a sharded run, this rank's share.
pub fn optimizer_state_bytes<B, M, O>(
    state: &flashover::core::state::State<SetupOf<B, M, O>>,
) -> anyhow::Result<usize>
where
    B: burn::tensor::backend::AutodiffBackend,
    M: burn::module::AutodiffModule<B> + flashover::core::model::TrainModel<B>,
    O: Optimizer<M, B>,
{
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    let bytes = Recorder::<B>::record(&recorder, state.optimizer().to_record(), ())
        .map_err(|e| anyhow::anyhow!("serialising the optimizer state: {e}"))?;
    Ok(bytes.len())
}

/// A reader of device memory for the memory monitor, for the device of whichever backend
/// `device` belongs to: the CubeCL backends (wgpu, CUDA) report the bytes their memory pools
/// hold for live tensors and have reserved; the CPU backends have no such pool (`None`; the
/// monitor logs the process's resident memory there).
pub fn device_memory_reader<D: std::any::Any + Clone + Send + Sync>(
    device: &D,
) -> Option<Box<dyn Fn() -> Option<flashover::callbacks::monitors::DeviceMemory> + Send>> {
    let any = device as &dyn std::any::Any;
    // The CubeCL runtime of a device type answers for the memory of that device.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    macro_rules! cubecl_reader {
        ($runtime:ty, $device:ty) => {
            if let Some(d) = any.downcast_ref::<$device>() {
                let d = d.clone();
                return Some(Box::new(move || {
                    use cubecl::Runtime;
                    let usage = <$runtime>::client(&d).memory_usage().ok()?;
                    Some(flashover::callbacks::monitors::DeviceMemory {
                        in_use: usage.bytes_in_use,
                        reserved: usage.bytes_reserved,
                    })
                }));
            }
        };
    }
    #[cfg(feature = "wgpu")]
    cubecl_reader!(cubecl::wgpu::WgpuRuntime, cubecl::wgpu::WgpuDevice);
    #[cfg(feature = "cuda")]
    cubecl_reader!(cubecl::cuda::CudaRuntime, cubecl::cuda::CudaDevice);
    let _ = any;
    None
}

/// The wgpu device of the first CPU adapter (Mesa's software Vulkan driver, lavapipe, where
/// the tests run; `WgpuDevice::Cpu`, a device id the rest of Flashover never uses) with memory
/// pools that accept no single allocation larger than `max_allocation` bytes: a larger
/// reservation fails for real in CubeCL's memory management (`can't allocate buffer`), as on
/// a device that is out of memory. For testing automatic microbatching on a driver whose
/// memory is the host's. One such device per process (CubeCL keeps one client per device
/// id, and the first use of the id fixes its memory configuration); a second call with
/// another limit is an error naming both. A machine without a CPU adapter has no such device
/// (CubeCL panics: `No CPU device found`).
#[cfg(feature = "wgpu")]
pub fn wgpu_device_with_allocation_limit(
    max_allocation: u64,
) -> anyhow::Result<cubecl::wgpu::WgpuDevice> {
    use cubecl::wgpu::{init_setup, AutoGraphicsApi, RuntimeOptions, WgpuDevice};
    use cubecl_runtime::memory_management::{MemoryConfiguration, MemoryPoolOptions, PoolType};
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let device = WgpuDevice::Cpu;
    let limit = *LIMIT.get_or_init(|| {
        let options = RuntimeOptions {
            memory_config: MemoryConfiguration::Custom {
                pool_options: vec![MemoryPoolOptions {
                    pool_type: PoolType::ExclusivePages {
                        max_alloc_size: max_allocation,
                    },
                    dealloc_period: None,
                }],
            },
            ..Default::default()
        };
        init_setup::<AutoGraphicsApi>(&device, options);
        max_allocation
    });
    anyhow::ensure!(
        limit == max_allocation,
        "the limited wgpu device of this process allows {limit} bytes per allocation; it cannot be made again with {max_allocation}"
    );
    Ok(device)
}

/// Median, minimum and maximum of repeated measurements (the median of an even count is the
/// upper middle value). `v` must not be empty.
pub fn median_min_max(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

/// The bundled MNIST data (8,000 training and 2,000 test digits), relative to the workspace.
pub fn bundled_mnist_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("data")
        .join("mnist-10k")
}

pub use flashover::models::{MnistCnn, ResNet, ResNetConfig};

/// An image classifier the MNIST example can train: `[N, 1, 28, 28]` digits in, `[N, 10]`
/// logits out, evaluated by the inner module, with a memory format to choose and its surgery
/// capabilities ([`Surgical`], for `--algorithms blurpool` and the like). Implemented for
/// every model with those types (the CNN and the ResNets).
pub trait MnistModel<B: TrainBackend>:
    TrainModel<
        B,
        Batch = ClassificationBatch<B, 4>,
        Output = Tensor<B, 2>,
        InnerModule: EvalModel<
            B::InnerBackend,
            Batch = ClassificationBatch<B::InnerBackend, 4>,
            Output = ClassificationOutput<B::InnerBackend>,
        >,
    > + HasMemoryFormat
    + Surgical
    + Autocast
{
}

impl<B: TrainBackend, M> MnistModel<B> for M where
    M: TrainModel<
            B,
            Batch = ClassificationBatch<B, 4>,
            Output = Tensor<B, 2>,
            InnerModule: EvalModel<
                B::InnerBackend,
                Batch = ClassificationBatch<B::InnerBackend, 4>,
                Output = ClassificationOutput<B::InnerBackend>,
            >,
        > + HasMemoryFormat
        + Surgical
        + Autocast
{
}

/// The models of the MNIST example (`--model`): the CNN (the default) and the ResNets for
/// small images (`resnet8`, `resnet20`, `resnet56`: CIFAR's family at widths 16-32-64, one,
/// three and nine blocks per stage; `resnet18`: four stages at 16-32-64-128, a quarter of the
/// original's width, so that it trains on a CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelKind {
    /// [`MnistCnn`].
    #[default]
    Cnn,
    /// ResNet-8 (the family's smallest; the tests' ResNet).
    ResNet8,
    /// ResNet-20.
    ResNet20,
    /// ResNet-56.
    ResNet56,
    /// ResNet-18 at a quarter width.
    ResNet18,
}

impl ModelKind {
    /// Every model, with its name on the command line.
    pub const ALL: [(&'static str, ModelKind); 5] = [
        ("cnn", ModelKind::Cnn),
        ("resnet8", ModelKind::ResNet8),
        ("resnet20", ModelKind::ResNet20),
        ("resnet56", ModelKind::ResNet56),
        ("resnet18", ModelKind::ResNet18),
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("cnn", |(n, _)| n)
    }

    /// The ResNet's shape, for the ResNet kinds.
    pub fn resnet(self) -> Option<ResNetConfig> {
        // Invariant: the depths and widths below are valid (6n + 2, non-zero).
        let shape = match self {
            ModelKind::Cnn => return None,
            ModelKind::ResNet8 => ResNetConfig::cifar(8, 16),
            ModelKind::ResNet20 => ResNetConfig::cifar(20, 16),
            ModelKind::ResNet56 => ResNetConfig::cifar(56, 16),
            ModelKind::ResNet18 => ResNetConfig::resnet18(16),
        };
        Some(shape.expect("the example's ResNet shapes are valid"))
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ModelKind {
    type Err = flashover::core::CoreError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s.trim()))
            .map(|(_, k)| *k)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                flashover::core::CoreError::config("model", s, names.join(", "))
            })
    }
}

/// Training loader type for MNIST on backend `B`.
pub type MnistLoader<B> = DataLoader<B, MnistItem, ClassificationBatch<B, 4>>;

/// Options for [`mnist_loaders`].
#[derive(Debug, Clone)]
pub struct MnistData {
    /// Directory with the IDX files.
    pub dir: PathBuf,
    /// Training batch size.
    pub batch_size: usize,
    /// Evaluation batch size.
    pub eval_batch_size: usize,
    /// Seed of the training order.
    pub seed: u64,
    /// Use only the first N training items (for quick runs).
    pub train_limit: Option<usize>,
    /// Use only the first N test items.
    pub test_limit: Option<usize>,
    /// Batches to prepare ahead (0: load on the training thread).
    pub prefetch: usize,
    /// This process's rank and the world size: each rank reads its shard, `batch_size` per
    /// rank (the caller divides a global batch).
    pub world: World,
    /// Append every training item index this rank reads to this file, one per line (for
    /// the tests that check which samples a run saw; load with `prefetch: 0`).
    pub record_indices: Option<PathBuf>,
    /// Read the digits from shards instead of `dir`'s IDX files (`--data`).
    pub shards: Option<MnistShards>,
}

/// MNIST in shards (`--data`): a folder or object-store prefix with `train/` and `test/`
/// datasets (MDS or Parquet; `cargo xtask shards mnist` writes them), each sample an image
/// column `x` (`ndarray:uint8:28,28`, a `pil` image of mode L, or 784 bytes) and a label `y`.
#[derive(Debug, Clone)]
pub struct MnistShards {
    /// The dataset's location.
    pub location: String,
    /// How the shards are read (cache, shuffle block); the seed is the run's.
    pub options: flashover::streaming::StreamingOptions,
}

impl MnistData {
    /// The bundled data with the given batch size and seed.
    pub fn bundled(batch_size: usize, seed: u64) -> Self {
        MnistData {
            dir: bundled_mnist_dir(),
            batch_size,
            eval_batch_size: 500,
            seed,
            train_limit: None,
            test_limit: None,
            prefetch: 2,
            world: World::default(),
            record_indices: None,
            shards: None,
        }
    }
}

/// One MNIST sample from shards: `x` 28x28 bytes (an array, a raw image or bytes) and `y` a
/// digit.
pub fn mnist_item_from_sample(
    sample: flashover::streaming::Sample,
) -> std::result::Result<MnistItem, String> {
    let label = sample.int("y")?;
    let label = u8::try_from(label)
        .ok()
        .filter(|l| *l < 10)
        .ok_or_else(|| format!("column \"y\" is {label}, not a digit 0-9"))?;
    let pixels = sample.bytes("x")?.to_vec();
    if pixels.len() != 28 * 28 {
        return Err(format!(
            "column \"x\" has {} bytes, not the 784 of a 28x28 digit",
            pixels.len()
        ));
    }
    if let Some(flashover::streaming::Value::Array(a)) = sample.get("x") {
        if a.dtype != flashover::streaming::DType::U8 {
            return Err(format!("column \"x\" is {}, not uint8", a.dtype.name()));
        }
    }
    Ok(MnistItem {
        pixels,
        rows: 28,
        cols: 28,
        label,
    })
}

fn streamed_mnist_loaders<B: TrainBackend>(
    opts: &MnistData,
    shards: &MnistShards,
    device: &B::Device,
) -> Result<(MnistLoader<B>, MnistLoader<B::InnerBackend>)> {
    let open = |split: &str, shuffle: bool| {
        let location = format!("{}/{split}", shards.location.trim_end_matches('/'));
        let mut options = shards.options.clone();
        options.seed = opts.seed;
        options.shuffle = shuffle;
        // One cache folder per split and per rank (a cache belongs to one process).
        let base = options
            .cache_dir
            .clone()
            .unwrap_or_else(|| flashover::streaming::default_cache_dir(&shards.location));
        options.cache_dir = Some(base.join(split).join(format!("rank-{}", opts.world.rank)));
        flashover::streaming::StreamingDataset::open(&location, options)
            .map(Arc::new)
            .map_err(|e| flashover::core::CoreError::config("data", &location, e.to_string()))
    };
    let (rank, world) = (opts.world.rank, opts.world.size);
    let stream = |e: flashover::streaming::StreamingError| {
        flashover::core::CoreError::config("data", &shards.location, e.to_string())
    };
    let train = open("train", true)?;
    let test = open("test", false)?;
    let train_order = train
        .order(opts.batch_size)
        .and_then(|o| o.sharded(rank, world))
        .map_err(stream)?;
    let test_order = test
        .eval_order(opts.eval_batch_size)
        .and_then(|o| o.sharded_exact(rank, world))
        .map_err(stream)?;
    let record = match &opts.record_indices {
        Some(path) => Some(Arc::new(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| {
                    flashover::core::CoreError::config(
                        "record_indices",
                        path.display(),
                        e.to_string(),
                    )
                })?,
        ))),
        None => None,
    };
    let decode = move |sample: flashover::streaming::Sample| {
        if let Some(file) = &record {
            // The sample's `id` column when the converter wrote one, for the tests that check
            // which samples a run saw.
            if let Ok(id) = sample.int("id") {
                use std::io::Write;
                let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
                writeln!(f, "{id}").map_err(|e| e.to_string())?;
            }
        }
        mnist_item_from_sample(sample)
    };
    let train = train
        .loader(
            "train",
            decode,
            Arc::new(MnistBatcher),
            train_order,
            device.clone(),
        )?
        .with_prefetch(opts.prefetch)?;
    let test = test
        .loader(
            "test",
            mnist_item_from_sample,
            Arc::new(MnistBatcher),
            test_order,
            device.clone(),
        )?
        .with_prefetch(opts.prefetch)?;
    Ok((train, test))
}

/// A shuffled training loader on `B` and a sequential test loader on `B::InnerBackend`.
pub fn mnist_loaders<B: TrainBackend>(
    opts: &MnistData,
    device: &B::Device,
) -> Result<(MnistLoader<B>, MnistLoader<B::InnerBackend>)> {
    if let Some(shards) = &opts.shards {
        return streamed_mnist_loaders::<B>(opts, shards, device);
    }
    let mut train = MnistDataset::from_dir(&opts.dir, MnistSplit::Train)?;
    let mut test = MnistDataset::from_dir(&opts.dir, MnistSplit::Test)?;
    // The CNN takes 28x28 digits; other sizes would train (its pooling adapts) to chance.
    for (split, data) in [("training", &train), ("test", &test)] {
        if data.image_size() != MnistCnn::<B>::INPUT_SIZE {
            let (r, c) = data.image_size();
            let (er, ec) = MnistCnn::<B>::INPUT_SIZE;
            return Err(flashover::core::CoreError::config(
                "data_dir",
                format!("{} ({split} images of {r}x{c} pixels)", opts.dir.display()),
                format!("{er}x{ec} images, the input of the MNIST CNN"),
            ));
        }
    }
    if let Some(n) = opts.train_limit {
        train.truncate(n);
    }
    if let Some(n) = opts.test_limit {
        test.truncate(n);
    }
    // Training pads the last shard so every rank takes the same steps; evaluation does
    // not, so no test digit counts twice (see `Sampler::sharded_exact`).
    let (rank, world) = (opts.world.rank, opts.world.size);
    let train_sampler =
        Sampler::new(train.len(), opts.batch_size, true, opts.seed)?.sharded(rank, world)?;
    let test_sampler =
        Sampler::new(test.len(), opts.eval_batch_size, false, 0)?.sharded_exact(rank, world)?;
    let train: Arc<dyn Dataset<MnistItem>> = match &opts.record_indices {
        Some(path) => Arc::new(RecordingDataset::create(train, path)?),
        None => Arc::new(train),
    };
    let train = DataLoader::new(
        "train",
        train,
        Arc::new(MnistBatcher),
        train_sampler,
        device.clone(),
    )?
    .with_prefetch(opts.prefetch)?;
    let test = DataLoader::new(
        "test",
        Arc::new(test),
        Arc::new(MnistBatcher),
        test_sampler,
        device.clone(),
    )?
    .with_prefetch(opts.prefetch)?;
    Ok((train, test))
}

/// A dataset that appends the index of every item read to a file, one per line, then
/// passes the read on: which samples a run trained on, for the tests of sharding and elastic
/// resumption.
pub struct RecordingDataset<D> {
    inner: D,
    file: std::sync::Mutex<std::fs::File>,
}

impl<D> RecordingDataset<D> {
    /// Wraps `inner`, appending to `path` (created if missing).
    pub fn create(inner: D, path: &std::path::Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| flashover::core::CoreError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(RecordingDataset {
            inner,
            file: std::sync::Mutex::new(file),
        })
    }
}

impl<I, D: Dataset<I>> Dataset<I> for RecordingDataset<D> {
    fn get(&self, index: usize) -> Option<I> {
        use std::io::Write;
        if let Ok(mut f) = self.file.lock() {
            // A test tool: a failed write shows as missing indices in the test that reads it.
            let _ = writeln!(f, "{index}");
        }
        self.inner.get(index)
    }

    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// The MNIST example's training recipe; its `Default` is what `cargo run --example mnist`
/// runs (and what the tests hold to 97% test accuracy).
#[derive(Debug, Clone)]
pub struct MnistRun {
    /// Data options.
    pub data: MnistData,
    /// Run length.
    pub max_duration: Time,
    /// Microbatch size, if batches are split.
    pub microbatch_size: Option<usize>,
    /// Automatic microbatching (starting from `microbatch_size`, or the whole batch).
    pub auto_microbatching: bool,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning-rate schedule.
    pub scheduler: Scheduler,
    /// Scale-schedule ratio.
    pub scale_schedule_ratio: f64,
    /// Seed of weights, order and random draws.
    pub seed: u64,
    /// Evaluation interval.
    pub eval_interval: Time,
    /// Skip batches with a non-finite loss.
    pub skip_nonfinite_loss: bool,
    /// Speed-up algorithms, in the order they are added to the trainer.
    pub algorithms: Vec<AlgorithmSpec>,
    /// The CNN's memory format (`Auto`: channels-last on the fast CPU path, channels-first on
    /// GPU backends).
    pub memory_format: MemoryFormat,
    /// Floating-point setup (default fp32).
    pub precision: Precision,
    /// Dynamic loss scaling's settings (float16 precisions).
    pub loss_scaling: LossScaling,
}

/// Defaults of the MNIST example, as strings where the CLI parses them.
pub mod defaults {
    /// Run length.
    pub const MAX_DURATION: &str = "6ep";
    /// Batch size.
    pub const BATCH_SIZE: usize = 64;
    /// Peak learning rate (AdamW).
    pub const LR: f64 = 3e-3;
    /// Decoupled weight decay.
    pub const WEIGHT_DECAY: f32 = 1e-4;
    /// Warmup before the cosine decay.
    pub const WARMUP: &str = "30ba";
    /// Seed.
    pub const SEED: u64 = 42;
    /// Batches between console log lines.
    pub const LOG_EVERY: u64 = 50;
}

impl Default for MnistRun {
    fn default() -> Self {
        let warmup: Time = defaults::WARMUP
            .parse()
            .expect("the default warmup is a valid time");
        MnistRun {
            data: MnistData::bundled(defaults::BATCH_SIZE, defaults::SEED),
            max_duration: defaults::MAX_DURATION
                .parse()
                .expect("the default duration is a valid time"),
            microbatch_size: None,
            auto_microbatching: false,
            lr: defaults::LR,
            scheduler: Scheduler::cosine(Time::Duration(1.0), 0.0).with_warmup(warmup),
            scale_schedule_ratio: 1.0,
            seed: defaults::SEED,
            eval_interval: Time::Epoch(1),
            skip_nonfinite_loss: false,
            algorithms: Vec::new(),
            memory_format: MemoryFormat::Auto,
            precision: Precision::Fp32,
            loss_scaling: LossScaling::default(),
        }
    }
}

/// How the MNIST batcher normalises pixels, for the augmentations that work on raw pixels.
pub fn mnist_normalization() -> Normalization {
    Normalization {
        mean: vec![MNIST_MEAN],
        std: vec![MNIST_STD],
    }
}

impl MnistRun {
    /// Applies the named recipe (`mild`, `medium`, `hot`): its algorithms go first, and its
    /// scale-schedule ratio replaces this run's.
    pub fn with_recipe(mut self, name: &str) -> Result<Self> {
        let r = recipe(name)?;
        let mut specs = r.specs();
        specs.append(&mut self.algorithms);
        self.algorithms = specs;
        self.scale_schedule_ratio = r.scale_schedule_ratio;
        Ok(self)
    }

    /// The default AdamW optimizer of the example.
    pub fn adamw<B: TrainBackend>(
    ) -> burn::optim::adaptor::OptimizerAdaptor<burn::optim::AdamW, MnistCnn<B>, B> {
        burn::optim::AdamWConfig::new()
            .with_weight_decay(defaults::WEIGHT_DECAY)
            .init::<B, MnistCnn<B>>()
    }

    /// A trainer builder for this recipe with a test evaluator (loss, accuracy, top-2
    /// accuracy); add callbacks and loggers, then `build`.
    pub fn builder<B: TrainBackend, O: Optimizer<MnistCnn<B>, B>>(
        &self,
        optimizer: O,
        device: &B::Device,
    ) -> Result<TrainerBuilder<SetupOf<B, MnistCnn<B>, O>>> {
        let model = MnistCnn::<B>::new(device, self.seed);
        self.builder_with(model, optimizer, device)
    }

    /// Like [`MnistRun::builder`] for another model (built by the caller from this run's
    /// seed; its memory format is set to this run's).
    pub fn builder_with<B: TrainBackend, M: MnistModel<B>, O: Optimizer<M, B>>(
        &self,
        model: M,
        optimizer: O,
        device: &B::Device,
    ) -> Result<TrainerBuilder<SetupOf<B, M, O>>> {
        let model = model.with_memory_format(self.memory_format);
        let mut data = self.data.clone();
        data.seed = self.seed;
        let (train, test) = mnist_loaders::<B>(&data, device)?;
        let evaluator = Evaluator::new(
            "test",
            test,
            vec![
                Box::new(LossMetric::default()),
                Box::new(Accuracy::default()),
                Box::new(TopKAccuracy::new(2)),
            ],
        );
        let mut b = Trainer::builder(model, optimizer, train, self.max_duration, device.clone())
            .lr(self.lr)
            .scheduler(self.scheduler.clone())
            .scale_schedule_ratio(self.scale_schedule_ratio)
            .seed(self.seed)
            .eval_interval(self.eval_interval)
            .evaluator(evaluator)
            .skip_nonfinite_loss(self.skip_nonfinite_loss)
            .precision(self.precision)
            .loss_scaling(self.loss_scaling)
            .auto_microbatching(self.auto_microbatching);
        if let Some(mb) = self.microbatch_size {
            b = b.microbatch_size(mb);
        }
        let norm = mnist_normalization();
        for spec in &self.algorithms {
            b = b.boxed_algorithm(build_image_classification(spec, &norm)?);
        }
        if !self.algorithms.is_empty() {
            let names: Vec<String> = self.algorithms.iter().map(|a| a.to_string()).collect();
            b = b.hyperparameter("algorithm_specs", names);
        }
        Ok(b)
    }
}

/// One point of a run's curve of an evaluation metric.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CurvePoint {
    /// Seconds spent in training batches so far (the trainer's `total_wall_time`: evaluation
    /// excluded).
    pub train_seconds: f64,
    /// Batches done.
    pub batch: u64,
    /// The metric's value.
    pub value: f64,
}

/// Records one evaluator's metric after every evaluation against the time spent, for
/// time-to-accuracy (or time-to-loss) measurements; by default the accuracy of the evaluator
/// labelled `test`. Clone the handle to read the curve after training.
#[derive(Debug, Clone)]
pub struct MetricCurve {
    evaluator: &'static str,
    metric: &'static str,
    points: Arc<std::sync::Mutex<Vec<CurvePoint>>>,
}

impl Default for MetricCurve {
    fn default() -> Self {
        Self::of("test", "accuracy")
    }
}

impl MetricCurve {
    /// The curve of `metric` of the evaluator labelled `evaluator`.
    pub fn of(evaluator: &'static str, metric: &'static str) -> Self {
        Self {
            evaluator,
            metric,
            points: Arc::default(),
        }
    }

    /// The points recorded so far.
    pub fn points(&self) -> Vec<CurvePoint> {
        self.points.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Seconds at the first evaluation whose value reached at least `target`, if any.
    pub fn seconds_to(&self, target: f64) -> Option<f64> {
        self.points()
            .iter()
            .find(|p| p.value >= target)
            .map(|p| p.train_seconds)
    }
}

impl<S: Setup> Callback<S> for MetricCurve {
    fn name(&self) -> &str {
        "metric_curve"
    }

    fn eval_after_all(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        if let Some(value) = state
            .eval_metrics()
            .get(self.evaluator)
            .and_then(|m| m.get(self.metric))
        {
            let p = CurvePoint {
                train_seconds: state.timestamp().total_wall_time.as_secs_f64(),
                batch: state.timestamp().batch,
                value: *value,
            };
            if let Ok(mut v) = self.points.lock() {
                v.push(p);
            }
        }
        Ok(())
    }
}
