//! Measures what the Flashover trainer costs over a hand-written Burn loop: the same MNIST
//! CNN, optimizer, batches (same loader, seed and order) and step count, run interleaved
//! (A B A B ...) and reported as medians with min-max, and their ratio.
//!
//! ```text
//! cargo run --release --example overhead -- --steps 120 --reps 5
//! ```

use std::time::Instant;

use anyhow::Context;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use clap::Parser;
use flashover::backend::COMPILED;
use flashover::prelude::*;
use flashover_examples::{median_min_max, mnist_loaders, MnistCnn, MnistData, MnistRun};
use serde_json::json;

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
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

fn data(args: &Args) -> MnistData {
    let mut d = MnistData::bundled(args.batch_size, 1);
    d.test_limit = Some(10);
    d
}

/// The loop a Burn user writes by hand: forward, loss, backward, step. No loss read-back.
fn handwritten<B: AutodiffBackend>(
    args: &Args,
    device: &B::Device,
) -> anyhow::Result<(f64, String)> {
    let (train, _) = mnist_loaders::<B>(&data(args), device)?;
    let mut model = MnistCnn::<B>::new(device, 1);
    let mut optim = MnistRun::adamw::<B>();
    let start = Instant::now();
    let mut step = 0;
    let mut epoch = 0;
    while step < args.steps {
        for batch in train.iter_from(epoch, 0) {
            let batch = batch?;
            let logits = model.logits(batch.inputs.clone());
            let loss = flashover::core::loss::cross_entropy(logits, batch.targets.clone());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
            step += 1;
            if step == args.steps {
                break;
            }
        }
        epoch += 1;
    }
    Ok((start.elapsed().as_secs_f64(), params_sha256::<B, _>(&model)))
}

fn flashover_trainer<B: AutodiffBackend>(
    args: &Args,
    device: &B::Device,
) -> anyhow::Result<(f64, String)> {
    let (train, _) = mnist_loaders::<B>(&data(args), device)?;
    let model = MnistCnn::<B>::new(device, 1);
    let mut trainer = Trainer::builder(
        model,
        MnistRun::adamw::<B>(),
        train,
        Time::Batch(args.steps),
        device.clone(),
    )
    .lr(1e-3)
    .seed(1)
    .build()?;
    let start = Instant::now();
    trainer.fit()?;
    Ok((
        start.elapsed().as_secs_f64(),
        params_sha256::<B, _>(trainer.model()),
    ))
}

fn measure<B: AutodiffBackend>(args: &Args) -> anyhow::Result<()> {
    let device = B::Device::default();
    // One untimed run of each warms caches and allocators.
    let (_, hand_digest) = handwritten::<B>(args, &device).context("warm-up")?;
    let (_, ours_digest) = flashover_trainer::<B>(args, &device)?;
    let (mut hand, mut ours) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        hand.push(handwritten::<B>(args, &device)?.0);
        ours.push(flashover_trainer::<B>(args, &device)?.0);
    }
    let (hm, hmin, hmax) = median_min_max(&hand);
    let (om, omin, omax) = median_min_max(&ours);
    println!("| loop | median s | min-max s | ratio to hand-written |");
    println!("| --- | --- | --- | --- |");
    println!("| hand-written Burn | {hm:.3} | {hmin:.3}-{hmax:.3} | 1.000 |");
    println!(
        "| Flashover trainer | {om:.3} | {omin:.3}-{omax:.3} | {:.3} |",
        om / hm
    );
    let summary = json!({
        "backend": args.backend,
        "steps": args.steps,
        "reps": args.reps,
        "batch_size": args.batch_size,
        "handwritten_median_s": hm,
        "flashover_median_s": om,
        "flashover_over_handwritten": om / hm,
        "same_weights": hand_digest == ours_digest,
    });
    println!("{summary}");
    Ok(())
}
