//! What each model surgery costs per training step before it pays back: the plain ResNet and
//! the ResNet with one surgery at a time train the same `--steps` batches (after two batches
//! of warm-up, not timed), interleaved (plain, blurpool, ..., plain, ...); the figure is each
//! surgery's step time over the plain model's in the same repetition, median and range over
//! `--reps`. Evaluation is off. The settings are those that act on the model (for example
//! SqueezeExcite from 32 channels, where Composer's default of 128 would reach nothing here).
//!
//! ```text
//! cargo run --release --example surgery_cost -- --model resnet8 --steps 30 --reps 5
//! ```

use std::time::Instant;

use clap::Parser;
use flashover::algorithms::spec::parse_list;
use flashover::backend::COMPILED;
use flashover::core::callback::Callback;
use flashover::core::callback::Control;
use flashover::core::setup::Setup;
use flashover::core::state::State;
use flashover::core::time::Time;
use flashover::models::TrainBackend;
use flashover_examples::{median_min_max, MnistModel, MnistRun, ModelKind};
use serde_json::json;

flashover_examples::use_mimalloc!();

/// Each surgery alone, with settings that change the ResNet.
const SURGERIES: &[&str] = &[
    "blurpool",
    "weight_standardization",
    "squeeze_excite:min_channels=32:latent_channels=0.25",
    "gyro_dropout",
    "factorize:min_channels=32:latent_channels=0.25",
    "ghost_batchnorm",
    "stochastic_depth",
];

/// Step cost of each surgery against the plain ResNet.
#[derive(Debug, Parser)]
struct Args {
    /// Timed training batches per run.
    #[arg(long, default_value_t = 30)]
    steps: u64,
    /// Repetitions (interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// The ResNet.
    #[arg(long, default_value = "resnet8")]
    model: ModelKind,
    /// Backend, among those compiled in.
    #[arg(long, default_value_t = COMPILED[0].to_string())]
    backend: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.steps == 0 || args.reps == 0 {
        anyhow::bail!(
            "--steps ({}) and --reps ({}) must be at least 1",
            args.steps,
            args.reps
        );
    }
    if args.model.resnet().is_none() {
        anyhow::bail!(
            "--model {}: the surgeries need a ResNet (resnet8, resnet20, ...)",
            args.model
        );
    }
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

/// Starts the clock at the third batch.
#[derive(Clone, Default)]
struct Clock(std::sync::Arc<std::sync::Mutex<Option<Instant>>>);

impl<S: Setup> Callback<S> for Clock {
    fn name(&self) -> &str {
        "surgery_cost_clock"
    }

    fn batch_start(
        &mut self,
        state: &State<S>,
        _ctl: &mut Control<'_>,
    ) -> flashover::core::Result<()> {
        if state.timestamp().batch == 2 {
            *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
        Ok(())
    }
}

/// Seconds of `steps` timed batches with `algorithms` on the model.
fn one<B: TrainBackend>(args: &Args, algorithms: &str) -> anyhow::Result<f64> {
    let mut run = MnistRun {
        max_duration: Time::Batch(args.steps + 2),
        eval_interval: Time::Batch(u64::MAX / 2),
        algorithms: parse_list(algorithms)?,
        ..MnistRun::default()
    };
    // The main job's schedule without its warm-up (longer than these runs).
    run.scheduler.warmup = None;
    let device = Default::default();
    // Invariant: checked in `main`.
    let shape = args.model.resnet().expect("a ResNet");
    let model = shape.init::<B>(&device, run.seed);
    time(&run, model, &device)
}

fn time<B: TrainBackend, M: MnistModel<B>>(
    run: &MnistRun,
    model: M,
    device: &B::Device,
) -> anyhow::Result<f64> {
    let optimizer = burn::optim::AdamWConfig::new()
        .with_weight_decay(flashover_examples::defaults::WEIGHT_DECAY)
        .init::<B, M>();
    let clock = Clock::default();
    let mut t = run
        .builder_with::<B, M, _>(model, optimizer, device)?
        .callback(clock.clone())
        .build()?;
    t.fit()?;
    let start = clock.0.lock().unwrap_or_else(|e| e.into_inner()).take();
    let start = start.ok_or_else(|| anyhow::anyhow!("the run ended before its third batch"))?;
    Ok(start.elapsed().as_secs_f64())
}

fn measure<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let configs: Vec<&str> = std::iter::once("")
        .chain(SURGERIES.iter().copied())
        .collect();
    let mut seconds = vec![Vec::new(); configs.len()];
    for rep in 0..args.reps {
        for (i, c) in configs.iter().enumerate() {
            eprintln!(
                "rep {}/{}: {}",
                rep + 1,
                args.reps,
                if c.is_empty() { "plain" } else { c }
            );
            seconds[i].push(one::<B>(args, c)?);
        }
    }
    let mut rows = Vec::new();
    let mut cost = serde_json::Map::new();
    let (plain, plain_lo, plain_hi) = median_min_max(&seconds[0]);
    let per_step = |s: f64| s / args.steps as f64 * 1000.0;
    for (i, c) in configs.iter().enumerate().skip(1) {
        let ratios: Vec<f64> = seconds[i]
            .iter()
            .zip(&seconds[0])
            .map(|(s, p)| s / p)
            .collect();
        let (r, lo, hi) = median_min_max(&ratios);
        let (s, _, _) = median_min_max(&seconds[i]);
        let name = c.split(':').next().unwrap_or(c);
        rows.push(format!(
            "| {c} | {:.1} | {r:.2}x ({lo:.2}-{hi:.2}) |",
            per_step(s)
        ));
        cost.insert(
            name.to_string(),
            json!({"settings": c, "step_cost_ratio": r, "step_cost_ratio_range": [lo, hi], "ms_per_step": per_step(s)}),
        );
    }
    println!(
        "{}: plain step {:.1} ms ({:.1}-{:.1}), {} steps, {} rep(s)\n",
        args.model,
        per_step(plain),
        per_step(plain_lo),
        per_step(plain_hi),
        args.steps,
        args.reps
    );
    println!("| surgery | ms per step | ratio to the plain step |");
    println!("|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    println!(
        "{}",
        json!({
            "model": args.model.name(),
            "steps": args.steps,
            "reps": args.reps,
            "plain_ms_per_step": per_step(plain),
            "surgeries": cost,
        })
    );
    Ok(())
}
