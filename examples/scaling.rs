//! Throughput as work grows: the MNIST CNN trained by the Flashover trainer at batch sizes 32,
//! 64, 128 and 256 (and, on GPU backends, a model with 8x the channels and hidden units), a
//! fixed number of timed steps after two untimed ones, repeated with the sizes interleaved.
//!
//! ```text
//! cargo run --release --example scaling -- --steps 40 --reps 5
//! ```

use std::time::Instant;

use clap::Parser;
use flashover::backend::COMPILED;
use flashover::models::TrainBackend;
use flashover::prelude::*;
use flashover_examples::{median_min_max, mnist_loaders, MnistCnn, MnistData, MnistRun};
use serde_json::json;

// Large per-step buffers stay with the process (see the macro).
flashover_examples::use_mimalloc!();

/// Samples per second of the trainer at growing batch sizes.
#[derive(Debug, Parser)]
struct Args {
    /// Timed optimizer steps per measurement.
    #[arg(long, default_value_t = 40)]
    steps: u64,
    /// Repetitions (batch sizes interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Backend, among those compiled in.
    #[arg(long, default_value_t = COMPILED[0].to_string())]
    backend: String,
}

const SIZES: [usize; 4] = [32, 64, 128, 256];
/// Width multiplier of the larger model (GPU backends only).
const WIDE: usize = 8;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.steps == 0 || args.reps == 0 {
        anyhow::bail!(
            "--steps ({}) and --reps ({}) must be at least 1",
            args.steps,
            args.reps
        );
    }
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

/// Seconds for `steps` steps at `batch` on a model `width` times the CNN's.
fn time_steps<B: TrainBackend>(args: &Args, batch: usize, width: usize) -> anyhow::Result<f64> {
    let device = B::Device::default();
    let mut data = MnistData::bundled(batch, 1);
    data.test_limit = Some(10);
    let (train, _) = mnist_loaders::<B>(&data, &device)?;
    let model = MnistCnn::<B>::with_widths(&device, 1, 16 * width, 32 * width, 128 * width);
    let mut trainer =
        Trainer::builder(model, MnistRun::adamw::<B>(), train, Time::Batch(2), device)
            .lr(1e-3)
            .seed(1)
            .build()?;
    trainer.fit()?;
    let start = Instant::now();
    trainer.fit_for(Time::Batch(args.steps))?;
    Ok(start.elapsed().as_secs_f64())
}

fn measure<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let gpu = !matches!(args.backend.as_str(), "flex" | "ndarray");
    let mut models = vec![("cnn", 1)];
    if gpu {
        models.push(("cnn x8", WIDE));
    }
    let mut rows = Vec::new();
    let mut out = serde_json::Map::new();
    for (name, width) in &models {
        let mut times = vec![Vec::new(); SIZES.len()];
        for _ in 0..args.reps {
            for (i, &b) in SIZES.iter().enumerate() {
                times[i].push(time_steps::<B>(args, b, *width)?);
            }
        }
        let mut per_model = serde_json::Map::new();
        for (i, &b) in SIZES.iter().enumerate() {
            let sps: Vec<f64> = times[i]
                .iter()
                .map(|t| (args.steps as usize * b) as f64 / t)
                .collect();
            let (m, lo, hi) = median_min_max(&sps);
            let ms = median_min_max(&times[i]).0 / args.steps as f64 * 1e3;
            rows.push(format!(
                "| {name} | {b} | {m:.0} | {lo:.0}-{hi:.0} | {ms:.1} |"
            ));
            per_model.insert(
                b.to_string(),
                json!({ "samples_per_second": m, "ms_per_step": ms }),
            );
        }
        out.insert(name.to_string(), serde_json::Value::Object(per_model));
    }
    println!("| model | batch | samples/s (median) | min-max | ms per step |");
    println!("| --- | --- | --- | --- | --- |");
    for r in &rows {
        println!("{r}");
    }
    println!(
        "{}",
        json!({ "backend": args.backend, "steps": args.steps, "reps": args.reps, "models": out })
    );
    Ok(())
}
