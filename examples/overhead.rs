//! Measures what the Flashover trainer costs over a hand-written Burn loop: the same MNIST
//! CNN, initial weights, optimizer (AdamW, lr 1e-3), batches (same loader, seed and order) and
//! step count. A third variant is Flashover with observability on (the console logger at the
//! example's default interval, formatted by a tracing subscriber, and the progress bar), to
//! show what watching a run costs; with `--mlflow URI`, a fourth adds the MLflow logger to
//! the third (a real tracking server; the bench starts one), to show what MLflow costs a step.
//! Variants run interleaved (A B C A B C ...), reported as
//! medians with min-max and ratios to the hand-written loop. burn-train's `Learner` is
//! compared in `benches/learner` (its build turns on flex's SIMD and threads, which this
//! build keeps off).
//!
//! ```text
//! cargo run --release --example overhead -- --steps 120 --reps 5 [--mlflow http://127.0.0.1:5000]
//! ```

use anyhow::Context;
use clap::Parser;
use flashover::backend::COMPILED;
use flashover::models::TrainBackend;
use flashover_examples::median_min_max;
use flashover_examples::overhead::{flashover, flashover_with_mlflow, handwritten};
use serde_json::json;

// Large per-step buffers stay with the process (see the macro).
flashover_examples::use_mimalloc!();

/// Time N training steps with a hand-written loop and with the Flashover trainer.
#[derive(Debug, Parser)]
struct Args {
    /// Optimizer steps per repetition.
    #[arg(long, default_value_t = 120)]
    steps: u64,
    /// Repetitions of each variant (interleaved).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Batch size.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Backend, among those compiled in.
    #[arg(long, default_value_t = COMPILED[0].to_string())]
    backend: String,
    /// Also time the observed run with an MLflow logger to this tracking server.
    #[arg(long)]
    mlflow: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The console logger's lines are formatted as in a real run, then discarded.
    tracing_subscriber::fmt()
        .with_writer(std::io::sink)
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .init();
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

fn measure<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let device = B::Device::default();
    let (steps, bs) = (args.steps, args.batch_size);
    // One untimed run of each warms caches and allocators.
    let (_, hand_digest) = handwritten::<B>(steps, bs, &device).context("warm-up")?;
    let (_, ours_digest) = flashover::<B>(steps, bs, false, &device)?;
    let (_, observed_digest) = flashover::<B>(steps, bs, true, &device)?;
    let mlflow_run = |uri: &str| flashover_with_mlflow::<B>(steps, bs, uri, &device);
    let mlflow_digest = match &args.mlflow {
        Some(uri) => Some(mlflow_run(uri).context("warm-up with MLflow")?.digest),
        None => None,
    };
    let (mut hand, mut ours, mut observed) = (Vec::new(), Vec::new(), Vec::new());
    let (mut mlflow, mut mlflow_finish) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        hand.push(handwritten::<B>(steps, bs, &device)?.0);
        ours.push(flashover::<B>(steps, bs, false, &device)?.0);
        observed.push(flashover::<B>(steps, bs, true, &device)?.0);
        if let Some(uri) = &args.mlflow {
            let t = mlflow_run(uri)?;
            mlflow.push(t.fit_seconds);
            mlflow_finish.push(t.finish_seconds);
        }
    }
    let (hm, hmin, hmax) = median_min_max(&hand);
    let (om, omin, omax) = median_min_max(&ours);
    let (vm, vmin, vmax) = median_min_max(&observed);
    println!("| loop | median s | min-max s | ratio to hand-written |");
    println!("| --- | --- | --- | --- |");
    println!("| hand-written Burn | {hm:.3} | {hmin:.3}-{hmax:.3} | 1.000 |");
    println!(
        "| Flashover trainer | {om:.3} | {omin:.3}-{omax:.3} | {:.3} |",
        om / hm
    );
    println!(
        "| Flashover + console + JSONL + progress bar | {vm:.3} | {vmin:.3}-{vmax:.3} | {:.3} |",
        vm / hm
    );
    let mut mlflow_summary = json!({
        "flashover_mlflow_median_s": null,
        "mlflow_over_observed": null,
        "mlflow_finish_median_s": null,
    });
    if !mlflow.is_empty() {
        let (mm, mmin, mmax) = median_min_max(&mlflow);
        let (fm, _, _) = median_min_max(&mlflow_finish);
        println!(
            "| Flashover + console + JSONL + progress bar + MLflow | {mm:.3} | {mmin:.3}-{mmax:.3} | {:.3} |",
            mm / hm
        );
        mlflow_summary = json!({
            "flashover_mlflow_median_s": mm,
            "mlflow_over_observed": mm / vm,
            "mlflow_finish_median_s": fm,
        });
    }
    let mut summary = json!({
        "backend": args.backend,
        "steps": args.steps,
        "reps": args.reps,
        "batch_size": args.batch_size,
        "handwritten_median_s": hm,
        "flashover_median_s": om,
        "flashover_observed_median_s": vm,
        "flashover_over_handwritten": om / hm,
        "observability_over_plain": vm / om,
        "observed_loggers": "console (every 50 batches), JSONL (every value), progress bar (hidden)",
        "same_weights": hand_digest == ours_digest
            && ours_digest == observed_digest
            && mlflow_digest.as_ref().is_none_or(|d| *d == observed_digest),
    });
    for (k, v) in mlflow_summary.as_object().into_iter().flatten() {
        summary[k] = v.clone();
    }
    println!("{summary}");
    Ok(())
}
