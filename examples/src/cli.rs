//! The command-line options the example programs share (optimizer, schedule, checkpoints,
//! logs and stopping rules), so that `mnist` and `shakespeare` take the same flags with the
//! same meaning, and the code that turns them into trainer callbacks is written once.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use clap::ValueEnum;
use flashover::callbacks::TrainingPlot;
use flashover::checkpoint::remote::{self, Location, LogSync, RemoteStore, RemoteUri};
use flashover::checkpoint::{
    AutoresumeOptions, CheckpointRestore, LoadOptions, SaveInterval, Saver, SaverConfig,
};
use flashover::core::model::TrainModel;
use flashover::core::schedule::Scheduler;
use flashover::core::setup::Setup;
use flashover::core::time::Time;
use flashover::core::trainer::TrainerBuilder;
use flashover::models::optim::FusedAdamW;
use flashover::models::TrainBackend;
use std::sync::Arc;

/// What differs between the programs in the run flags they share: defaults and the words of
/// a few helps ([`RunArgs`] is generic over it, so each program flattens the same flags with
/// its own defaults).
pub trait RunDefaults: Send + Sync + 'static {
    /// `--max-duration`'s default and help.
    const MAX_DURATION: &'static str;
    /// Help of `--max-duration`.
    const MAX_DURATION_HELP: &'static str;
    /// `--batch-size`'s default.
    const BATCH_SIZE: usize;
    /// Help of `--batch-size`.
    const BATCH_SIZE_HELP: &'static str;
    /// Help of `--microbatch-size`.
    const MICROBATCH_HELP: &'static str;
    /// `--lr`'s default.
    const LR: f64;
    /// `--weight-decay`'s default.
    const WEIGHT_DECAY: f32;
    /// `--warmup`'s default.
    const WARMUP: &'static str;
    /// `--seed`'s default.
    const SEED: u64;
    /// `--eval-interval`'s default.
    const EVAL_INTERVAL: &'static str;
    /// Help of `--eval-interval`.
    const EVAL_INTERVAL_HELP: &'static str;
    /// `--log-every`'s default.
    const LOG_EVERY: u64;
    /// Help of `--recipe` (the recipes the program's models take).
    const RECIPE_HELP: &'static str;
    /// Whether the program trains an image classifier (else a language model): which
    /// algorithms its `--algorithms` help lists.
    const IMAGE: bool;
}

/// The flags every main job takes with the same meaning: length and batch, optimizer and
/// schedule, algorithms and recipe, precision, seed, evaluation and logging, checkpoints,
/// stopping and the backend. Each program flattens it (`#[command(flatten)] run:
/// RunArgs<Defaults>`) with its own [`RunDefaults`].
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs<D: RunDefaults> {
    /// How long to train (the program's help says more).
    #[arg(long, default_value = D::MAX_DURATION, help = D::MAX_DURATION_HELP)]
    pub max_duration: Time,
    /// Samples per batch (per optimizer step).
    #[arg(long, default_value_t = D::BATCH_SIZE, help = D::BATCH_SIZE_HELP)]
    pub batch_size: usize,
    /// Microbatch size (gradient accumulation), or `auto`.
    #[arg(long, help = D::MICROBATCH_HELP)]
    pub microbatch_size: Option<MicrobatchSize>,
    /// Peak learning rate.
    #[arg(long, default_value_t = D::LR)]
    pub lr: f64,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// Momentum for SGD.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (decoupled for AdamW, L2 for Adam and SGD).
    #[arg(long, default_value_t = D::WEIGHT_DECAY)]
    pub weight_decay: f32,
    /// Learning-rate schedule over the run.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Cosine)]
    pub schedule: ScheduleKind,
    /// Linear warmup at the start of the schedule.
    #[arg(long, default_value = D::WARMUP)]
    pub warmup: Time,
    /// Multiply the run's length and schedule milestones by this ratio (default 1, or the
    /// recipe's ratio with --recipe).
    #[arg(long)]
    pub scale_schedule_ratio: Option<f64>,
    /// A preset stack of speed-up algorithms with its scale-schedule ratio.
    #[arg(long, help = D::RECIPE_HELP)]
    pub recipe: Option<String>,
    /// Speed-up algorithms by name. (The help lists the names from the algorithms' registry,
    /// `spec::help`, so it cannot drift from what the parser accepts.)
    #[arg(long, default_value = "", help = flashover::algorithms::spec::help(D::IMAGE))]
    pub algorithms: String,
    /// Floating-point setup: fp32; fp16 or bf16 (the whole model in the half type); amp_fp16
    /// or amp_bf16 (float32 weights and optimizer, forward and backward in the half type;
    /// float16 with dynamic loss scaling). Half types need a backend that computes them (flex,
    /// wgpu with shader-f16, cuda); the run stops with an error naming the supported ones
    /// otherwise.
    #[arg(long, default_value = "fp32")]
    pub precision: flashover::core::precision::Precision,
    /// Seed for weights, data order and every random draw.
    #[arg(long, default_value_t = D::SEED)]
    pub seed: u64,
    /// How often to evaluate.
    #[arg(long, default_value = D::EVAL_INTERVAL, help = D::EVAL_INTERVAL_HELP)]
    pub eval_interval: Time,
    /// Backend to run on, among those compiled in.
    #[arg(long, default_value_t = flashover::backend::COMPILED[0].to_string())]
    pub backend: String,
    /// Batches the loader prepares ahead on its own thread (0: none).
    #[arg(long, default_value_t = 2)]
    pub prefetch: usize,
    /// Skip batches whose loss is NaN or infinite instead of stopping with an error.
    #[arg(long)]
    pub skip_nonfinite_loss: bool,
    /// Log the training loss every N batches.
    #[arg(long, default_value_t = D::LOG_EVERY)]
    pub log_every: u64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Checkpoints.
    #[command(flatten)]
    pub checkpoint: CheckpointArgs,
    /// Logs, profiling and stopping rules.
    #[command(flatten)]
    pub logs: LogArgs,
    /// Stop cleanly once training reaches this time (the state is saved if --save-folder is
    /// set), for example to resume later.
    #[arg(long)]
    pub stop_after: Option<Time>,
    #[arg(skip)]
    _defaults: std::marker::PhantomData<D>,
}

/// The device type of a setup's backend.
type DeviceOf<S> = <<S as Setup>::Backend as burn::tensor::backend::BackendTypes>::Device;

/// `--microbatch-size`: a number of samples, or `auto` (start with the whole batch and halve
/// it whenever the device runs out of memory; see `TrainerBuilder::auto_microbatching`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicrobatchSize {
    /// This many samples per microbatch.
    Fixed(usize),
    /// Automatic microbatching.
    Auto,
}

impl std::str::FromStr for MicrobatchSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Self::Fixed(n)),
            _ => Err(format!(
                "invalid microbatch size {s:?}: expected a positive number of samples or `auto`"
            )),
        }
    }
}

impl MicrobatchSize {
    /// The fixed size (`None` for `auto`).
    pub fn fixed(self) -> Option<usize> {
        match self {
            Self::Fixed(n) => Some(n),
            Self::Auto => None,
        }
    }
}

/// The optimizers the examples offer.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OptimizerKind {
    /// AdamW (decoupled weight decay).
    Adamw,
    /// Adam (L2 weight decay).
    Adam,
    /// SGD with momentum (L2 weight decay).
    Sgd,
}

impl OptimizerKind {
    /// The name as the command line writes it.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Adam => "adam",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

/// The learning-rate schedules the examples offer, over the whole run.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ScheduleKind {
    /// The peak rate throughout.
    Constant,
    /// x0.1 every 30% of the run.
    Step,
    /// x0.1 at 50% and 75% of the run.
    Multistep,
    /// Linear decay to 0.
    Linear,
    /// x0.7 every epoch.
    Exponential,
    /// Cosine decay to 0.
    Cosine,
    /// Cosine restarts, the first after one epoch, each twice as long as the one before.
    CosineWarmRestarts,
    /// Quadratic decay to 0.
    Polynomial,
}

/// The schedule `kind` with a linear `warmup` (none when zero).
pub fn scheduler(kind: ScheduleKind, warmup: Time) -> Scheduler {
    let s = match kind {
        ScheduleKind::Constant => Scheduler::constant(),
        ScheduleKind::Step => Scheduler::step(Time::Duration(0.3), 0.1),
        ScheduleKind::Multistep => {
            Scheduler::multistep(vec![Time::Duration(0.5), Time::Duration(0.75)], 0.1)
        }
        ScheduleKind::Linear => Scheduler::linear(1.0, 0.0, Time::Duration(1.0)),
        ScheduleKind::Exponential => Scheduler::exponential(0.7, Time::Epoch(1)),
        ScheduleKind::Cosine => Scheduler::cosine(Time::Duration(1.0), 0.0),
        ScheduleKind::CosineWarmRestarts => {
            Scheduler::cosine_warm_restarts(Time::Epoch(1), 2.0, 0.0)
        }
        ScheduleKind::Polynomial => Scheduler::polynomial(2.0, Time::Duration(1.0), 0.0),
    };
    if warmup.is_zero() {
        s
    } else {
        s.with_warmup(warmup)
    }
}

/// What a program does once its optimizer is built: generic over the optimizer's type,
/// which [`with_optimizer`] picks at run time.
pub trait WithOptimizer<B: AutodiffBackend, M: TrainModel<B>> {
    /// What the program returns.
    type Output;
    /// Runs with `optimizer` for `model`.
    fn run<O: Optimizer<M, B> + 'static>(self, model: M, optimizer: O) -> Self::Output;
}

/// Builds the optimizer `kind` names (with `weight_decay`, and `momentum` for SGD) for
/// `model` and hands both to `job`. With `fused`, AdamW is the fast path's one-pass step
/// (`FusedAdamW`: the same bits as Burn's `AdamW`, and the same state in checkpoints);
/// without, Burn's own (the `--kernels burn` comparison).
pub fn with_optimizer<B: TrainBackend, M: TrainModel<B>, J: WithOptimizer<B, M>>(
    kind: OptimizerKind,
    weight_decay: f32,
    momentum: f64,
    fused: bool,
    model: M,
    job: J,
) -> J::Output {
    let decay = || Some(burn::optim::decay::WeightDecayConfig::new(weight_decay));
    match kind {
        OptimizerKind::Adamw if fused => job.run(
            model,
            FusedAdamW::new()
                .with_weight_decay(weight_decay)
                .init::<B, M>(),
        ),
        OptimizerKind::Adamw => job.run(
            model,
            AdamWConfig::new()
                .with_weight_decay(weight_decay)
                .init::<B, M>(),
        ),
        OptimizerKind::Adam => job.run(
            model,
            AdamConfig::new().with_weight_decay(decay()).init::<B, M>(),
        ),
        OptimizerKind::Sgd => job.run(
            model,
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(momentum)))
                .with_weight_decay(decay())
                .init::<B, M>(),
        ),
    }
}

/// Checkpoint options: where and how often to save, and what to resume or load.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckpointArgs {
    /// Save checkpoints into this folder, or to an object store: s3://bucket/prefix (also gs://,
    /// az://). A remote checkpoint is written and verified in a local folder first
    /// (--checkpoint-cache), then uploaded in the background; credentials come from the
    /// environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION).
    ///
    /// (Parsed after the command line, so that an error never repeats a URI's text, which
    /// may hold credentials pasted by mistake.)
    #[arg(long)]
    pub save_folder: Option<String>,
    /// How often to save (ep, ba, sp, tok or dur); the state at the end of training is
    /// always saved too.
    #[arg(long, default_value = "1ep")]
    pub save_interval: Time,
    /// Checkpoint folder name template (fields: {epoch} {batch} {sample} {token}
    /// {batch_in_epoch} {rank}).
    #[arg(long, default_value = "ep{epoch}-ba{batch}")]
    pub save_name: String,
    /// Keep only the newest N checkpoints (0: keep all); in the object store too.
    #[arg(long, default_value_t = 0)]
    pub keep: usize,
    /// Write checkpoint files on a background thread.
    #[arg(long)]
    pub save_async: bool,
    /// Save model weights only (such checkpoints start new runs, they cannot resume one).
    #[arg(long)]
    pub save_weights_only: bool,
    /// Replace an existing checkpoint of the same name.
    #[arg(long)]
    pub overwrite: bool,
    /// Resume from the newest intact checkpoint in --save-folder (start fresh if there is
    /// none). Newer checkpoints that fail verification are renamed <name>.damaged and
    /// reported; if checkpoints exist but none verifies, it is an error (see --fresh-start).
    /// With an object store, the newest remote checkpoint that verifies is downloaded first
    /// (damaged or incomplete ones are skipped with a warning).
    #[arg(long, requires = "save_folder")]
    pub autoresume: bool,
    /// With --autoresume: if no checkpoint in --save-folder verifies, move them all aside
    /// (as <name>.damaged) and start a new run instead of failing.
    #[arg(long, requires = "autoresume")]
    pub fresh_start: bool,
    /// Load this checkpoint directory before training (autoresume wins when it finds one),
    /// or s3://bucket/prefix/<name> (or .../latest): downloaded and verified first, an error if
    /// damaged.
    #[arg(long)]
    pub load: Option<String>,
    /// With --load: take the model weights only and start a new run from them.
    #[arg(long)]
    pub weights_only: bool,
    /// With --load: accept missing and unexpected weights (reported, not loaded).
    #[arg(long)]
    pub non_strict: bool,
    /// With --load: parameter paths to keep as initialised (glob, `*` wildcard; repeatable).
    #[arg(long)]
    pub ignore_keys: Vec<String>,
    /// The local folder for object-store checkpoints (default: $FLASHOVER_CACHE, else
    /// ~/.cache/flashover), under which each prefix has its own folder
    /// (<cache>/s3/<bucket>/<prefix>).
    #[arg(long)]
    pub checkpoint_cache: Option<PathBuf>,
}

/// Refuses a URI (`scheme://...`) given to a flag that takes a local folder: it would become
/// a folder named `s3:` and, with credentials in it, be printed in log lines. The value is
/// not repeated (it may hold a secret); only its scheme is named.
pub fn local_folder_flag(flag: &str, path: Option<&std::path::Path>) -> anyhow::Result<()> {
    let Some(text) = path.map(|p| p.to_string_lossy().into_owned()) else {
        return Ok(());
    };
    if let Some((scheme, _)) = text.split_once("://") {
        let is_scheme = !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        if is_scheme {
            anyhow::bail!(
                "{flag} takes a local folder, and was given a {scheme}:// URI (not repeated here: it may hold credentials); object stores are for --save-folder, --load and --upload-logs"
            );
        }
    }
    Ok(())
}

/// The store for a remote location.
fn connect(uri: &RemoteUri) -> anyhow::Result<Arc<RemoteStore>> {
    Ok(Arc::new(RemoteStore::connect(uri)?))
}

impl CheckpointArgs {
    fn cache_base(&self) -> PathBuf {
        self.checkpoint_cache
            .clone()
            .unwrap_or_else(remote::default_cache_base)
    }

    /// --save-folder, parsed (and --checkpoint-cache checked to be a local folder).
    pub fn save_location(&self) -> anyhow::Result<Option<Location>> {
        local_folder_flag("--checkpoint-cache", self.checkpoint_cache.as_deref())?;
        let location = self
            .save_folder
            .as_deref()
            .map(Location::parse)
            .transpose()?;
        if let Some(Location::Remote(uri)) = &location {
            // Keep-N lists and deletes under the prefix: a bare bucket would be shared with
            // anything else in it.
            anyhow::ensure!(
                !uri.prefix().is_empty(),
                "--save-folder {uri}: give a prefix under the bucket for this run's checkpoints (such as {uri}/my-run)"
            );
        }
        Ok(location)
    }

    /// --load, parsed.
    pub fn load_location(&self) -> anyhow::Result<Option<Location>> {
        local_folder_flag("--checkpoint-cache", self.checkpoint_cache.as_deref())?;
        Ok(self.load.as_deref().map(Location::parse).transpose()?)
    }

    /// The local folder checkpoints are written to and resumed from: --save-folder itself,
    /// or its cache folder when it is an object store.
    pub fn local_folder(&self) -> anyhow::Result<Option<PathBuf>> {
        Ok(self.save_location()?.map(|l| match l {
            Location::Local(p) => p,
            Location::Remote(uri) => remote::cache_folder(&self.cache_base(), &uri),
        }))
    }

    /// The saver these options ask for, if any.
    pub fn saver(&self) -> anyhow::Result<Option<Saver>> {
        let (Some(location), Some(folder)) = (self.save_location()?, self.local_folder()?) else {
            return Ok(None);
        };
        let mut config = SaverConfig::new(folder);
        config.name_template = self.save_name.clone();
        config.keep = self.keep;
        config.async_write = self.save_async;
        config.weights_only = self.save_weights_only;
        config.overwrite = self.overwrite;
        if let Location::Remote(uri) = &location {
            config.remote = Some(connect(uri)?);
        }
        Ok(Some(Saver::new(
            config,
            SaveInterval::Every(self.save_interval),
        )?))
    }

    /// The options of `--autoresume`.
    pub fn autoresume_options(&self) -> AutoresumeOptions {
        AutoresumeOptions {
            fresh_start_if_damaged: self.fresh_start,
        }
    }

    fn load_options(&self) -> LoadOptions {
        LoadOptions {
            weights_only: self.weights_only,
            weights: flashover::checkpoint::WeightsLoad {
                non_strict: self.non_strict,
                ignore_keys: self.ignore_keys.clone(),
            },
        }
    }

    /// The restore `--load` asks for, if any (an object-store checkpoint is downloaded and
    /// verified here).
    pub fn load_restore(&self) -> anyhow::Result<Option<CheckpointRestore>> {
        Ok(match &self.load_location()? {
            None => None,
            Some(Location::Local(path)) => Some(CheckpointRestore::new(path, self.load_options())),
            Some(Location::Remote(uri)) => {
                let (folder, name) = uri.split_last().with_context(|| {
                    format!("--load {uri}: name a checkpoint under the bucket (s3://bucket/prefix/<name> or .../latest)")
                })?;
                let store = connect(&folder)?;
                let cache = remote::cache_folder(&self.cache_base(), &folder);
                Some(remote::load_remote(
                    &store,
                    name,
                    &cache,
                    self.load_options(),
                )?)
            }
        })
    }

    /// `--autoresume` on one process of a run: the newest intact checkpoint of the save
    /// folder (downloaded first from an object store). `main` is the process that writes
    /// the folder (it may move damaged checkpoints aside); the others read what it left.
    pub fn autoresume(&self, main: bool) -> anyhow::Result<Option<CheckpointRestore>> {
        let (Some(location), Some(folder), true) =
            (self.save_location()?, self.local_folder()?, self.autoresume)
        else {
            return Ok(None);
        };
        Ok(match (&location, main) {
            (Location::Local(_), true) => {
                flashover::checkpoint::autoresume_with(&folder, self.autoresume_options())?
            }
            (Location::Local(_), false) => flashover::checkpoint::autoresume_read_only(&folder)?,
            (Location::Remote(uri), true) => {
                remote::autoresume_remote(&*connect(uri)?, &folder, self.autoresume_options())?
            }
            (Location::Remote(uri), false) => {
                remote::autoresume_remote_read_only(&*connect(uri)?, &folder)?
            }
        })
    }

    /// The checkpoint to start from on this rank of `dist`: the newest intact checkpoint of
    /// `--save-folder` with `--autoresume` (which wins when it finds one), else `--load`; and
    /// whether the run continues an earlier one (its logs are appended to). Rank 0 looks
    /// first (it may move damaged checkpoints aside, or download from an object store), then
    /// the others find the folder as rank 0 left it; the trainer checks that every rank
    /// resumed alike.
    pub fn restore_on(
        &self,
        dist: &flashover::distributed::Distributed,
    ) -> anyhow::Result<(Option<CheckpointRestore>, bool)> {
        let found = if dist.world().is_main() {
            let r = self.autoresume(true)?;
            dist.barrier()?;
            r
        } else {
            dist.barrier()?;
            self.autoresume(false)?
        };
        let resuming = found.is_some() || (self.load.is_some() && !self.weights_only);
        let restore = match found {
            Some(r) => Some(r),
            None => self.load_restore()?,
        };
        Ok((restore, resuming))
    }
}

/// Logging, profiling and stopping options.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Write the run's logs here: metrics.jsonl, metrics.csv (with
    /// metrics.hyperparameters.json), and the monitors' values in them (learning rate, speed,
    /// time left, memory, gradient and weight norms every --log-every batches). Also checks
    /// every loss and gradient for NaN/Inf.
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Also write TensorBoard event files into <log-dir>/tensorboard.
    #[arg(long, requires = "log_dir")]
    pub tensorboard: bool,
    /// Record a Chrome trace of training steps into <log-dir>/trace.json (open it in
    /// ui.perfetto.dev), on --profile-schedule.
    #[arg(long, requires = "log_dir")]
    pub profile: bool,
    /// Steps the profiler records: skip_first,wait,warmup,active,repeat (repeat 0: to the end).
    #[arg(long, default_value = "10,1,1,5,1")]
    pub profile_schedule: String,
    /// Peak FLOP/s of the device, for model FLOPs utilisation (throughput/mfu) in the logs.
    #[arg(long)]
    pub peak_flops: Option<f64>,
    /// Early stopping: METRIC[:patience=TIME][:min_delta=X][:mode=max|min], for example
    /// `test/accuracy:patience=2ep:min_delta=0.001` (metrics: train/loss and the
    /// evaluators', such as test/accuracy for MNIST or val/loss for Shakespeare).
    #[arg(long)]
    pub early_stop: Option<String>,
    /// Stop when a metric reaches a value: METRIC=VALUE[:mode=max|min], for example
    /// `test/accuracy=0.98`.
    #[arg(long)]
    pub stop_threshold: Option<String>,
    /// Mirror --log-dir to this object-store prefix (s3://bucket/prefix): files the local
    /// folder lacks are downloaded first (a resumed run continues the same logs), then
    /// changed files are uploaded every --upload-logs-every and at the end of the run.
    #[arg(long, requires = "log_dir")]
    pub upload_logs: Option<String>,
    /// How often --upload-logs uploads (a time with a unit: 30s, 2m).
    #[arg(long, default_value = "30s", value_parser = parse_seconds)]
    pub upload_logs_every: std::time::Duration,
    /// Log the run to this MLflow tracking server (http://host:port): params, every metric,
    /// tags, the training plot, the final weights and summary; the monitors are on as with
    /// --log-dir. Credentials from MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and
    /// MLFLOW_TRACKING_PASSWORD. A resumed run continues the same MLflow run.
    #[arg(long, env = "MLFLOW_TRACKING_URI", value_name = "URI")]
    pub mlflow: Option<String>,
    /// The MLflow experiment (created if missing).
    #[arg(
        long,
        env = "MLFLOW_EXPERIMENT_NAME",
        default_value = "flashover",
        requires = "mlflow"
    )]
    pub mlflow_experiment: String,
    /// The MLflow run's name (default: the program's name and the start time).
    #[arg(long, requires = "mlflow")]
    pub mlflow_run_name: Option<String>,
    /// Also upload every checkpoint to MLflow as it is saved (checkpoints/<name>/...).
    #[arg(long, requires = "mlflow")]
    pub mlflow_checkpoints: bool,
    /// How long the end of the run waits for MLflow to take what is queued before it warns
    /// and goes on (a time with a unit: 30s, 2m).
    #[arg(long, default_value = "60s", value_parser = parse_seconds, requires = "mlflow")]
    pub mlflow_finish_timeout: std::time::Duration,
}

/// A wall-clock interval such as `30s`, `2m` or `1h`.
fn parse_seconds(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let (num, unit) = t.split_at(
        t.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(t.len()),
    );
    let scale = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "expected a number with s, m or h (such as 30s), not {text:?}"
            ))
        }
    };
    match num.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(std::time::Duration::from_secs_f64(v * scale)),
        _ => Err(format!(
            "expected a positive number with s, m or h (such as 30s), not {text:?}"
        )),
    }
}

impl LogArgs {
    /// The MLflow logger --mlflow asks for (on the process that writes logs), uploading the
    /// checkpoints of `checkpoints` (the local save folder) with --mlflow-checkpoints.
    pub fn mlflow(
        &self,
        main: bool,
        checkpoints: Option<PathBuf>,
    ) -> anyhow::Result<Option<flashover::callbacks::MlflowLogger>> {
        use flashover::callbacks::{MlflowLogger, MlflowOptions};
        let (Some(uri), true) = (&self.mlflow, main) else {
            return Ok(None);
        };
        let mut options = MlflowOptions::new(uri);
        options.experiment = self.mlflow_experiment.clone();
        options.run_name = self.mlflow_run_name.clone();
        options.finish_timeout = self.mlflow_finish_timeout;
        if self.mlflow_checkpoints {
            anyhow::ensure!(
                checkpoints.is_some(),
                "--mlflow-checkpoints uploads the checkpoints this run saves: give --save-folder too"
            );
            options.upload_checkpoints = checkpoints;
        }
        Ok(Some(MlflowLogger::new(options).context("--mlflow")?))
    }

    /// Adds what these options ask for to `builder`: loggers, monitors and the profiler
    /// when `main` (the process that writes files; a resumed run, `resuming`, appends to
    /// its logs), stopping rules on every process. Returns the training plot (into
    /// `plot_dir`, else the log folder), which the caller draws last.
    #[allow(clippy::too_many_arguments)]
    pub fn observe<S: Setup>(
        &self,
        mut builder: TrainerBuilder<S>,
        log_every: u64,
        device: &DeviceOf<S>,
        plot_dir: Option<&Path>,
        resuming: bool,
        main: bool,
        mlflow: Option<flashover::callbacks::MlflowLogger>,
    ) -> anyhow::Result<(TrainerBuilder<S>, Option<TrainingPlot>)>
    where
        DeviceOf<S>: 'static,
    {
        use flashover::callbacks::monitors::*;
        use flashover::callbacks::profiler::{Profiler, ProfilerSchedule};
        use flashover::callbacks::{CsvLogger, JsonlLogger, MetricStopper, TensorBoardLogger};
        let monitored = main && (self.log_dir.is_some() || mlflow.is_some());
        if let Some(mlflow) = mlflow {
            builder = builder.logger(mlflow);
        }
        if monitored {
            let every = Time::Batch(log_every.max(1));
            let mut speed = SpeedMonitor::new(100)?;
            if let Some(peak) = self.peak_flops {
                speed = speed.with_peak_flops(peak)?;
            }
            let mut memory = MemoryMonitor::new(every)?;
            if let Some(read) = crate::device_memory_reader(device) {
                memory = memory.with_device_reader(read);
            }
            builder = builder
                .callback(NanMonitor::new())
                .callback(LrMonitor::new())
                .callback(speed)
                .callback(RuntimeEstimator::new(50)?)
                .callback(memory)
                .callback(NormMonitor::new(every)?);
        }
        if let (Some(dir), true) = (&self.log_dir, main) {
            let (jsonl, csv) = (dir.join("metrics.jsonl"), dir.join("metrics.csv"));
            let (jsonl, csv) = if resuming {
                (JsonlLogger::append(jsonl)?, CsvLogger::append(csv)?)
            } else {
                (JsonlLogger::create(jsonl)?, CsvLogger::create(csv)?)
            };
            builder = builder.logger(jsonl).logger(csv);
            if self.tensorboard {
                builder = builder.logger(TensorBoardLogger::create(dir.join("tensorboard"))?);
            }
            if self.profile {
                let schedule = ProfilerSchedule::parse(&self.profile_schedule)?;
                builder = builder.callback(Profiler::new(dir.join("trace.json"), schedule)?);
            }
        }
        if let Some(spec) = &self.early_stop {
            builder = builder.callback(MetricStopper::parse_early(spec)?);
        }
        if let Some(spec) = &self.stop_threshold {
            builder = builder.callback(MetricStopper::parse_threshold(spec)?);
        }
        // Drawn by the caller after everything else is written.
        let plot = plot_dir
            .or(self.log_dir.as_deref())
            .filter(|_| main)
            .map(|dir| TrainingPlot::new(dir.join("training.png")).drawn_by_caller());
        if let Some(plot) = &plot {
            builder = builder.callback(plot.clone());
        }
        Ok((builder, plot))
    }

    /// With --upload-logs on the process that writes the logs: downloads what the log folder
    /// lacks and starts the background uploads. Call before `observe` (the loggers append to
    /// the downloaded files); call `finish` on the result after the last log line is written.
    ///
    /// `checkpoints` is the run's --save-folder: the two prefixes may not contain each other
    /// (the logs would be listed as checkpoints, and the checkpoints downloaded as logs).
    pub fn start_log_sync(
        &self,
        main: bool,
        checkpoints: Option<&Location>,
    ) -> anyhow::Result<Option<LogSync>> {
        let (Some(text), Some(dir), true) = (&self.upload_logs, &self.log_dir, main) else {
            return Ok(None);
        };
        let uri = RemoteUri::parse(text)?;
        anyhow::ensure!(
            !uri.prefix().is_empty(),
            "--upload-logs {uri}: give a prefix under the bucket for this run's logs (such as {uri}/my-run-logs)"
        );
        if let Some(Location::Remote(ck)) = checkpoints {
            let within = |a: &RemoteUri, b: &RemoteUri| {
                a.scheme() == b.scheme()
                    && a.bucket() == b.bucket()
                    && a.prefix().starts_with(b.prefix())
            };
            anyhow::ensure!(
                !within(&uri, ck) && !within(ck, &uri),
                "--upload-logs {uri} and --save-folder {ck} overlap: give the logs and the checkpoints separate prefixes"
            );
        }
        let store = connect(&uri)?;
        Ok(Some(
            LogSync::start(store, dir, self.upload_logs_every)
                .with_context(|| format!("--upload-logs {uri}"))?,
        ))
    }

    /// Checks before training that the log folder can be written.
    pub fn check(&self) -> anyhow::Result<()> {
        local_folder_flag("--log-dir", self.log_dir.as_deref())?;
        if let Some(dir) = &self.log_dir {
            flashover::callbacks::check_writable_dir(dir).context("checking --log-dir")?;
        }
        Ok(())
    }
}

/// The flags of a main job that may run as one rank of several processes (under `mpirun`
/// or `cargo xtask launch`).
#[derive(clap::Args, Debug, Clone)]
pub struct ProcessArgs {
    /// The number of processes this run expects (started by `cargo xtask launch -n N` or
    /// `mpirun -n N`); an error if the launcher started another number, or none.
    #[arg(long)]
    pub processes: Option<usize>,
    /// In a multi-process run: how long a process waits for the others in one exchange
    /// before it names the one that is lost and ends the job (a wall-clock time).
    #[arg(long, default_value = "60s")]
    pub peer_timeout: Time,
    /// With several processes or devices: how the optimizer step is divided over them.
    /// no_shard: every rank holds the whole gradient and optimizer state; shard_grad_op: each
    /// rank keeps the averaged gradients and optimizer state of the parameters it owns only
    /// (ZeRO stages 1 and 2, Composer's SHARD_GRAD_OP), with the same weights bit for bit,
    /// and checkpoints hold one optimizer file per rank. One process shards nothing.
    #[arg(long, default_value = "no_shard")]
    pub sharding: flashover::core::shard::Sharding,
}

impl ProcessArgs {
    /// Joins the multi-process job this process was started in, if any.
    pub fn join(&self) -> anyhow::Result<flashover::distributed::Distributed> {
        let Time::Wall(timeout) = self.peer_timeout else {
            anyhow::bail!(
                "invalid value {} for `peer_timeout`: expected a wall-clock time such as 60s or 2m",
                self.peer_timeout
            );
        };
        Ok(flashover::distributed::init(
            flashover::distributed::Options {
                timeout,
                expected: self.processes,
            },
        )?)
    }
}

/// Ends a rank of a run that failed with `e`: the error on stderr (with the rank in a
/// multi-process run, in one write: the ranks share stderr), the other processes told (each
/// prints it), and the job ended with status 1.
pub fn exit_with_error(dist: &flashover::distributed::Distributed, e: &anyhow::Error) -> ! {
    let line = flashover::core::error::report(e.as_ref());
    let world = dist.world();
    if world.size > 1 {
        let text = format!("error (rank {} of {}): {line}\n", world.rank, world.size);
        let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
    } else {
        eprintln!("error: {line}");
    }
    dist.finish(Some(&line));
    std::process::exit(1);
}

/// Reading a dataset from shards (`--data`): MDS or Parquet, in a folder or an object store
/// (see `flashover-streaming`).
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// Train from shards instead of the bundled files: a folder or `s3://bucket/prefix` with
    /// `train/` and `test/` datasets in MDS (mosaicml-streaming) or Parquet;
    /// `cargo xtask shards mnist <folder>` writes the bundled digits so.
    #[arg(long)]
    pub data: Option<String>,
    /// The local cache of downloaded or decompressed shards. Default: a folder named after
    /// the location under the system's temporary folder.
    #[arg(long, requires = "data")]
    pub cache_dir: Option<std::path::PathBuf>,
    /// The cache's size limit, such as 512MB or 2GiB (least-recently-used shards are
    /// evicted; never those being read). Default: no limit.
    #[arg(long, requires = "data", value_parser = parse_bytes)]
    pub cache_limit: Option<u64>,
    /// Samples per block of the shuffle (Streaming's py1b): a block's shards are read
    /// together, so the cache must hold them.
    #[arg(long, requires = "data", default_value_t = flashover::streaming::DEFAULT_BLOCK_SIZE)]
    pub shuffle_block_size: usize,
}

impl StreamArgs {
    /// The streaming options these flags give (the seed and shuffle are the caller's).
    pub fn options(&self) -> flashover::streaming::StreamingOptions {
        flashover::streaming::StreamingOptions {
            cache_dir: self.cache_dir.clone(),
            cache_limit: self.cache_limit,
            shuffle_block_size: self.shuffle_block_size,
            ..Default::default()
        }
    }
}

/// A size in bytes: a whole number with an optional unit (B, KB, MB, GB: powers of 1000;
/// KiB, MiB, GiB: powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => {
            return Err(format!(
                "expected a whole number of bytes with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), such as 512MB, not {text:?}"
            ))
        }
    };
    match num.parse::<u64>().ok().and_then(|n| n.checked_mul(scale)) {
        Some(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "expected a positive whole number of bytes (such as 512MB), not {text:?}"
        )),
    }
}
