//! Trains the MNIST CNN (or a ResNet: `--model resnet20`) on the bundled digits through the
//! Flashover trainer and prints a one-line JSON summary as the last line of stdout.
//!
//! ```text
//! cargo run --release --example mnist -- --help
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use burn::optim::Optimizer;
use clap::Parser;
use flashover::core::precision::LossScaling;
use flashover::distributed::Distributed;
use flashover::models::TrainBackend;
use flashover::prelude::*;
use flashover_examples::cli::{self, WithOptimizer};
use flashover_examples::session;
use flashover_examples::{
    bundled_mnist_dir, defaults, MetricCurve, MnistCnn, MnistData, MnistModel, MnistRun,
    MnistShards, ModelKind,
};
use serde_json::json;

// Large per-step buffers stay with the process (see the macro).
flashover_examples::use_mimalloc!();

/// Train a small CNN on MNIST with the Flashover trainer.
///
/// Times are written with a unit: ep (epochs), ba (batches), sp (samples), tok (tokens) or
/// dur (fraction of the run), for example 3ep, 500ba, 0.1dur (any case, `_` between digits:
/// 20_000sp); --max-duration and --stop-after also take wall-clock times such as 1h30m, 45m
/// or 90s (with a wall-clock --max-duration, use --schedule constant or a warmup-only run:
/// a cosine needs a batch count).
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    #[command(flatten)]
    run: cli::RunArgs<MnistDefaults>,
    /// Layout of the CNN's activations: auto (channels-last on the CPU, where Flashover's
    /// kernels are the fast path; channels-first on GPU backends), channels-first (Burn's own
    /// kernels) or channels-last. The weights are the same in every format.
    #[arg(long, default_value = "auto")]
    memory_format: MemoryFormat,
    /// Float16 precisions: the first loss scale (PyTorch's default, 2^16).
    #[arg(long, default_value_t = 65536.0)]
    loss_scale_init: f64,
    /// Float16 precisions: clean steps in a row before the loss scale doubles.
    #[arg(long, default_value_t = 2000)]
    loss_scale_growth_interval: u64,
    /// The model: cnn (the small CNN, the default), resnet8, resnet20 or resnet56 (CIFAR's
    /// ResNets at widths 16-32-64, with batch norm), resnet18 (four stages at 16-32-64-128).
    #[arg(long, default_value = "cnn")]
    model: ModelKind,
    /// Directory with MNIST IDX files (train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz],
    /// t10k-* or test-* for the test split). Default: the bundled 10k digits.
    #[arg(long, conflicts_with = "data")]
    data_dir: Option<PathBuf>,
    #[command(flatten)]
    stream: cli::StreamArgs,
    /// Write model.safetensors, summary.json and training.png (loss, accuracy and learning
    /// rate against batches) here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Every N batches, log a grid of the batch's first 8 digits as trained on (after the
    /// algorithms: MixUp, CutOut...) with the predicted and true classes, to the loggers that
    /// show images (TensorBoard's Images tab, MLflow, the log folder's media/).
    #[arg(long, value_name = "N")]
    visualize_images: Option<u64>,
    /// Train on only the first N training digits.
    #[arg(long, conflicts_with = "data")]
    train_limit: Option<usize>,
    /// Evaluate on only the first N test digits.
    #[arg(long, conflicts_with = "data")]
    test_limit: Option<usize>,
    #[command(flatten)]
    processes: cli::ProcessArgs,
    /// Train on N devices of this process, one thread each (burn-collective's local mode):
    /// the GPUs 0..N of a GPU backend, or N threads on the CPU backends' one device.
    /// `--batch-size` is divided over them as over processes.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Append the index of every training digit this process reads to FILE.<rank> (tests
    /// of sharding and resumption; use with --prefetch 0).
    #[arg(long, hide = true)]
    record_indices: Option<PathBuf>,
}

/// The MNIST job's defaults for the flags it shares with the other main jobs.
#[derive(Debug, Clone)]
struct MnistDefaults;

impl cli::RunDefaults for MnistDefaults {
    const MAX_DURATION: &'static str = defaults::MAX_DURATION;
    const MAX_DURATION_HELP: &'static str =
        "How long to train (ep, ba, sp or tok, or a wall-clock time such as 1h30m)";
    const BATCH_SIZE: usize = defaults::BATCH_SIZE;
    const BATCH_SIZE_HELP: &'static str = "Samples per batch (per optimizer step), over all processes: with N processes each reads batch-size / N (N must divide it), so the run trains like one process would";
    const MICROBATCH_HELP: &'static str = "Split each process's share of a batch into microbatches of this size (gradient accumulation), or `auto`: the whole share, halved whenever the device runs out of memory (the batch is retried with the same random draws; the size is kept)";
    const LR: f64 = defaults::LR;
    const WEIGHT_DECAY: f32 = defaults::WEIGHT_DECAY;
    const WARMUP: &'static str = defaults::WARMUP;
    const SEED: u64 = defaults::SEED;
    const EVAL_INTERVAL: &'static str = "1ep";
    const EVAL_INTERVAL_HELP: &'static str = "Evaluate on the test split this often";
    const LOG_EVERY: u64 = defaults::LOG_EVERY;
    const RECIPE_HELP: &'static str = "A preset stack of speed-up algorithms with its scale-schedule ratio: mild, medium or hot, or for the ResNets resnet-mild, resnet-medium or resnet-hot";
    const IMAGE: bool = true;
}

fn main() {
    // Log lines on stderr, coloured only on a terminal (never ANSI codes in a log file).
    flashover::init_logging();
    let args = Args::parse();
    let dist = match args.processes.join() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {}", flashover::core::error::report(e.as_ref()));
            std::process::exit(1);
        }
    };
    if args.devices != 1 {
        std::process::exit(local_devices(&args));
    }
    match dispatch(&args, &dist, 0) {
        // Waits for every process, then MPI shuts down as `dist` is dropped.
        Ok(()) => dist.finish(None),
        Err(e) => cli::exit_with_error(&dist, &e),
    }
}

/// `--devices N`: N training threads in this process, one device each; returns the exit
/// status (non-zero if any thread failed).
fn local_devices(args: &Args) -> i32 {
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("error: {e}");
        1
    };
    if let Some((w, _)) = flashover::distributed::launched() {
        if w.size > 1 {
            return fail(
                &flashover::distributed::DistributedError::DevicesAndProcesses {
                    devices: args.devices,
                    processes: w.size,
                },
            );
        }
    }
    let Time::Wall(timeout) = args.processes.peer_timeout else {
        return fail(&"--peer-timeout must be a wall-clock time such as 60s");
    };
    let group = match flashover::distributed::LocalGroup::new(args.devices, timeout) {
        Ok(g) => g,
        Err(e) => return fail(&e),
    };
    let failed = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.devices)
            .map(|rank| {
                let dist = Distributed::Local {
                    group: group.clone(),
                    rank,
                };
                scope.spawn(move || match dispatch(args, &dist, rank) {
                    Ok(()) => {
                        dist.finish(None);
                        false
                    }
                    Err(e) => {
                        let line = flashover::core::error::report(e.as_ref());
                        eprintln!("error (device {rank} of {}): {line}", args.devices);
                        dist.finish(Some(&line));
                        true
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(true))
            .fold(false, |a, b| a | b)
    });
    i32::from(failed)
}

fn dispatch(args: &Args, dist: &Distributed, device: usize) -> anyhow::Result<()> {
    flashover_examples::with_backend!(args.run.backend.as_str(), run(args, device, dist))
}

fn run<B: TrainBackend>(
    args: &Args,
    device_index: usize,
    dist: &Distributed,
) -> anyhow::Result<()> {
    let device = flashover_examples::device_at::<B>(device_index);
    match args.model.resnet() {
        None => {
            let model = MnistCnn::<B>::new(&device, args.run.seed);
            with_optimizer(args, device, model, dist)
        }
        Some(shape) => {
            let model = shape.init::<B>(&device, args.run.seed);
            with_optimizer(args, device, model, dist)
        }
    }
}

/// The training run once `--optimizer` is built.
struct Job<'a, B: TrainBackend> {
    args: &'a Args,
    device: B::Device,
    dist: &'a Distributed,
}

impl<B: TrainBackend, M: MnistModel<B>> WithOptimizer<B, M> for Job<'_, B> {
    type Output = anyhow::Result<()>;

    fn run<O: Optimizer<M, B> + 'static>(self, model: M, optimizer: O) -> Self::Output {
        train(self.args, self.device, model, optimizer, self.dist)
    }
}

/// Builds the optimizer `--optimizer` names for `model` and trains.
fn with_optimizer<B: TrainBackend, M: MnistModel<B>>(
    args: &Args,
    device: B::Device,
    model: M,
    dist: &Distributed,
) -> anyhow::Result<()> {
    let job = Job { args, device, dist };
    cli::with_optimizer(
        args.run.optimizer,
        args.run.weight_decay,
        args.run.momentum,
        true,
        model,
        job,
    )
}

fn train<B: TrainBackend, M: MnistModel<B>, O: Optimizer<M, B>>(
    args: &Args,
    device: B::Device,
    model: M,
    optimizer: O,
    dist: &Distributed,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let world = dist.world();
    let main = world.is_main();
    check_outputs(args, main)?;
    let recipe = recipe(args, world)?;
    let curve = MetricCurve::default();
    let builder = recipe
        .builder_with::<B, M, O>(model, optimizer, &device)
        .context("setting up the run")?
        .hyperparameter("model", args.model.name())
        .callback(curve.clone())
        .sharding(args.processes.sharding)
        .boxed_collective(dist.collective(device.clone())?);
    let mut builder = session::attach(&args.run, builder)?;
    if let Some(n) = args.visualize_images {
        builder = builder.callback(
            flashover::callbacks::ImageVisualizer::new(Time::Batch(n))
                .context("--visualize-images")?,
        );
    }
    let (restore, resuming) = args.run.checkpoint.restore_on(dist)?;
    let out = args.out.as_deref();
    let (builder, outputs) =
        session::observe(&args.run, builder, &device, out, restore, resuming, main)?;
    let mut trainer = builder.build()?;
    let wall_before = trainer.state().timestamp().run_wall_time;
    let report = session::fit_unless_done(&mut trainer)?.unwrap_or_else(nothing_trained);
    // The run's clock stops at the last batch end; what `fit` took after it is FIT_END: the
    // wait for the last checkpoint's write (and upload, with a remote save folder) and the
    // callbacks' end of run. (Read before the final evaluation, which moves the clock.)
    let stepping = trainer
        .state()
        .timestamp()
        .run_wall_time
        .saturating_sub(wall_before);
    let fit_end_wait = (report.wall.as_secs_f64() - stepping.as_secs_f64()).max(0.0);
    let metrics = session::final_metrics(&mut trainer, true)?;
    let digest = params_sha256::<B, _>(trainer.model());
    // Every rank's digest: the ranks must hold the same weights.
    let digests = dist.all_gather_text(&digest)?;
    // Every rank's optimizer state, as a checkpoint would serialise it (a sharded run's is
    // each rank's share).
    let optimizer_bytes = flashover_examples::optimizer_state_bytes::<B, M, O>(trainer.state())?;
    let optimizer_bytes = dist.all_gather_text(&optimizer_bytes.to_string())?;
    if !main {
        return Ok(());
    }
    let ended = Ended {
        started,
        fit_end_wait,
        digest,
        digests,
        optimizer_bytes,
        curve,
    };
    let summary = summary(
        args, &recipe, &trainer, &report, &metrics, ended, dist, &device,
    )?;
    if let Some(out) = out {
        std::fs::create_dir_all(out)
            .with_context(|| format!("creating output directory {}", out.display()))?;
        save_weights::<B, _>(trainer.model(), &out.join("model.safetensors"))?;
        let text = serde_json::to_string_pretty(&summary)?;
        flashover::checkpoint::write_atomic(&out.join("summary.json"), text.as_bytes())?;
    }
    outputs.finish(trainer, &summary, out)?;
    session::print(None, &summary)
}

/// Every output location is checked before the first batch, not found unwritable after the
/// run. Only rank 0 (`main`) writes.
fn check_outputs(args: &Args, main: bool) -> anyhow::Result<()> {
    cli::local_folder_flag("--out", args.out.as_deref())?;
    cli::local_folder_flag("--log-dir", args.run.logs.log_dir.as_deref())?;
    if let (Some(out), true) = (&args.out, main) {
        flashover::callbacks::check_writable_dir(out).context("checking --out")?;
    }
    Ok(())
}

/// The run the flags describe, on this rank of `world`.
fn recipe(args: &Args, world: World) -> anyhow::Result<MnistRun> {
    let batch_size = flashover::distributed::per_rank("batch_size", args.run.batch_size, world)?;
    let record_indices = args
        .record_indices
        .as_ref()
        .map(|p| PathBuf::from(format!("{}.{}", p.display(), world.rank)));
    let mut recipe = MnistRun {
        data: MnistData {
            dir: args.data_dir.clone().unwrap_or_else(bundled_mnist_dir),
            batch_size,
            eval_batch_size: 500,
            seed: args.run.seed,
            train_limit: args.train_limit,
            test_limit: args.test_limit,
            prefetch: args.run.prefetch,
            world,
            record_indices,
            shards: args.stream.data.as_ref().map(|location| MnistShards {
                location: location.clone(),
                options: args.stream.options(),
            }),
        },
        max_duration: args.run.max_duration,
        microbatch_size: args
            .run
            .microbatch_size
            .and_then(cli::MicrobatchSize::fixed),
        auto_microbatching: args.run.microbatch_size == Some(cli::MicrobatchSize::Auto),
        lr: args.run.lr,
        scheduler: cli::scheduler(args.run.schedule, args.run.warmup),
        scale_schedule_ratio: 1.0,
        seed: args.run.seed,
        eval_interval: args.run.eval_interval,
        skip_nonfinite_loss: args.run.skip_nonfinite_loss,
        algorithms: flashover::algorithms::spec::parse_list(&args.run.algorithms)?,
        memory_format: args.memory_format,
        precision: args.run.precision,
        loss_scaling: LossScaling {
            init_scale: args.loss_scale_init,
            growth_interval: args.loss_scale_growth_interval,
            ..LossScaling::default()
        },
    };
    if let Some(name) = &args.run.recipe {
        recipe = recipe.with_recipe(name)?;
    }
    if let Some(ssr) = args.run.scale_schedule_ratio {
        recipe.scale_schedule_ratio = ssr;
    }
    Ok(recipe)
}

/// The report of a run resumed from its final checkpoint: nothing trained.
fn nothing_trained() -> FitReport {
    FitReport {
        steps: 0,
        batches: 0,
        samples: 0,
        wall: Default::default(),
        data_wait: Default::default(),
        device_reads: 0,
        stopped: None,
    }
}

/// What the run measured of itself on the way, for its summary.
struct Ended {
    started: Instant,
    fit_end_wait: f64,
    digest: String,
    digests: Vec<String>,
    optimizer_bytes: Vec<String>,
    curve: MetricCurve,
}

/// The summary line (and `summary.json`).
#[allow(clippy::too_many_arguments)]
fn summary<B: TrainBackend, M: MnistModel<B>, O: Optimizer<M, B>>(
    args: &Args,
    recipe: &MnistRun,
    trainer: &Trainer<SetupOf<B, M, O>>,
    report: &FitReport,
    metrics: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, f64>>,
    ended: Ended,
    dist: &Distributed,
    device: &B::Device,
) -> anyhow::Result<serde_json::Value> {
    let test = metrics
        .get("test")
        .context("the test evaluator returned no metrics")?;
    let state = trainer.state();
    let ts = state.timestamp();
    let train_seconds = report.wall.as_secs_f64();
    Ok(json!({
        "test_accuracy": test.get("accuracy"),
        "test_top2_accuracy": test.get("top2_accuracy"),
        "test_loss": test.get("loss"),
        "wall_seconds": ended.started.elapsed().as_secs_f64(),
        "train_seconds": train_seconds,
        "fit_end_wait_seconds": ended.fit_end_wait,
        "samples_per_second": report.samples as f64 / train_seconds.max(f64::MIN_POSITIVE),
        "data_wait_fraction": report.data_wait.as_secs_f64() / train_seconds.max(f64::MIN_POSITIVE),
        // The training step's device-to-host reads per batch (the losses, once per step).
        "device_reads_per_batch": report.device_reads as f64 / (report.batches.max(1)) as f64,
        "params_sha256": ended.digest,
        "params_sha256_by_rank": ended.digests,
        "world_size": state.world().size,
        "devices": args.devices,
        "sharding": if state.is_sharded() { args.processes.sharding.name() } else { "no_shard" },
        "optimizer_state_bytes_by_rank": ended
            .optimizer_bytes
            .iter()
            .map(|b| b.parse::<u64>().unwrap_or(0))
            .collect::<Vec<_>>(),
        "allreduce_seconds": dist.allreduce_time().as_secs_f64(),
        "batch_size": args.run.batch_size,
        "epochs": ts.epoch,
        "batches": ts.batch,
        "samples": ts.sample,
        "train_samples_per_epoch": state.samples_per_epoch(),
        "skipped_batches": state.skipped_batches(),
        "precision": state.precision().name(),
        // Dynamic loss scaling (float16): the scale reached and the steps it skipped.
        "loss_scale": state.loss_scaler().map(|s| s.scale),
        "overflow_skipped_steps": state.loss_scaler().map(|s| s.skipped_steps),
        "backend": args.run.backend,
        "model": args.model.name(),
        "seed": args.run.seed,
        "max_duration": state.max_duration().to_string(),
        "recipe": args.run.recipe,
        "algorithms": recipe.algorithms.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        "scale_schedule_ratio": recipe.scale_schedule_ratio,
        // Whether the convolutions and pools ran channels-last (the CPU fast path).
        "channels_last": flashover::models::channels_last::<B>(trainer.model().memory_format()),
        // Device memory the backend's pools hold now (CubeCL backends; null on the CPU):
        // pools keep what they reserved, so this is about the run's peak.
        "device_reserved_bytes": flashover_examples::device_memory_reader(device)
            .and_then(|read| read())
            .map(|m| m.reserved),
        // Peak resident memory of the process so far (Linux; null elsewhere).
        "peak_rss_bytes": flashover::callbacks::monitors::process_memory().map(|(_, peak)| peak),
        "accuracy_curve": ended.curve.points(),
        "stopped": report.stopped,
    }))
}
