//! Trainer overhead against burn-train's `Learner` (0.21.0): the MNIST CNN trained for the
//! same number of steps, with the same initial weights, optimizer (AdamW, lr 1e-3) and batch
//! size, by (a) a hand-written Burn loop, (b) Flashover's trainer with nothing registered and
//! (c) burn-train's `SupervisedTraining` with a `Learner`, interleaved A B C A B C; medians,
//! min-max, and ratios to (a).
//!
//! The Learner reads the same digits (the first `steps * batch_size` of the bundled training
//! set, one epoch) through burn's own data loader with one worker thread, shuffled by its own
//! generator, as a burn-train user would; it validates on one batch of 10 digits at the end.
//! Its renderer is a no-op one: off a terminal burn-train's default prints every step to
//! stdout, which would time the terminal. Its timing covers `launch` (setup, training,
//! validation); the other two time their training loops.
//!
//! This is a separate workspace because burn-train depends on flex with its SIMD and rayon
//! features on; all three variants here run on that build (pin `RAYON_NUM_THREADS`).
//!
//! ```text
//! cargo run --release --manifest-path benches/learner/Cargo.toml -- --steps 120 --reps 5
//! ```

use std::time::Instant;

use anyhow::Context;
use burn::module::Module;
use burn::tensor::backend::Backend;
use flashover::models::{ChannelsLastBackend, TrainBackend};
use burn_train::metric::MetricDefinition;
use burn_train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use clap::Parser;
use flashover::backend::COMPILED;
use flashover::core::data::{Dataset, MnistBatcher, MnistDataset, MnistSplit};
use flashover::core::loss::cross_entropy;
use flashover::core::model::ClassificationBatch;
use flashover_examples::overhead::{data, flashover, handwritten};
use flashover_examples::{defaults, median_min_max, MnistCnn};
use serde_json::json;

/// Time N training steps with a hand-written loop, Flashover and burn-train's Learner.
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
    if args.steps == 0 || args.reps == 0 {
        anyhow::bail!(
            "--steps ({}) and --reps ({}) must be at least 1",
            args.steps,
            args.reps
        );
    }
    flashover_examples::with_backend!(args.backend.as_str(), measure(&args))
}

/// The CNN as burn-train wants it: a module that implements its step traits (which cannot be
/// implemented for `MnistCnn` here, both being foreign to this crate).
#[derive(Module, Debug)]
struct LearnerCnn<B: Backend> {
    cnn: MnistCnn<B>,
}

fn output<B: ChannelsLastBackend>(
    cnn: &MnistCnn<B>,
    batch: ClassificationBatch<B, 4>,
) -> ClassificationOutput<B> {
    let logits = cnn.logits(batch.inputs);
    ClassificationOutput {
        loss: cross_entropy(logits.clone(), batch.targets.clone()),
        output: logits,
        targets: batch.targets,
    }
}

impl<B: TrainBackend> TrainStep for LearnerCnn<B> {
    type Input = ClassificationBatch<B, 4>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: ClassificationBatch<B, 4>) -> TrainOutput<ClassificationOutput<B>> {
        let out = output(&self.cnn, batch);
        let grads = out.loss.backward();
        TrainOutput::new(self, grads, out)
    }
}

impl<B: ChannelsLastBackend> InferenceStep for LearnerCnn<B> {
    type Input = ClassificationBatch<B, 4>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: ClassificationBatch<B, 4>) -> ClassificationOutput<B> {
        output(&self.cnn, batch)
    }
}

/// A renderer that draws nothing.
struct Quiet;

impl MetricsRendererTraining for Quiet {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _p: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _p: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for Quiet {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _p: Vec<ProgressType>) {}
}

impl MetricsRenderer for Quiet {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// burn-train's Learner for one epoch of exactly `steps` batches; returns its seconds.
fn learner<B: TrainBackend>(args: &Args, device: &B::Device) -> anyhow::Result<f64> {
    let d = data(args.batch_size);
    let mut train = MnistDataset::from_dir(&d.dir, MnistSplit::Train)?;
    let n = args.steps as usize * args.batch_size;
    if train.len() < n {
        anyhow::bail!(
            "--steps {} x --batch-size {} needs {n} training digits; the bundled set has {}",
            args.steps,
            args.batch_size,
            train.len()
        );
    }
    train.truncate(n);
    let mut valid = MnistDataset::from_dir(&d.dir, MnistSplit::Test)?;
    valid.truncate(10);
    let train = burn::data::dataloader::DataLoaderBuilder::<B, _, _>::new(MnistBatcher)
        .batch_size(args.batch_size)
        .shuffle(1)
        .num_workers(1)
        .set_device(device.clone())
        .build(train);
    let valid =
        burn::data::dataloader::DataLoaderBuilder::<B::InnerBackend, _, _>::new(MnistBatcher)
            .batch_size(10)
            .set_device(device.clone())
            .build(valid);
    let dir = tempfile::tempdir()?;
    let model = LearnerCnn {
        cnn: MnistCnn::<B>::new(device, 1),
    };
    let optim = burn::optim::AdamWConfig::new()
        .with_weight_decay(defaults::WEIGHT_DECAY)
        .init::<B, LearnerCnn<B>>();
    let start = Instant::now();
    let training = SupervisedTraining::new(dir.path(), train, valid)
        .num_epochs(1)
        .renderer(Quiet);
    let _trained = training.launch(Learner::new(model, optim, 1e-3));
    Ok(start.elapsed().as_secs_f64())
}

fn measure<B: TrainBackend>(args: &Args) -> anyhow::Result<()> {
    let device = B::Device::default();
    let (steps, bs) = (args.steps, args.batch_size);
    handwritten::<B>(steps, bs, &device).context("warm-up")?;
    flashover::<B>(steps, bs, false, &device)?;
    learner::<B>(args, &device)?;
    let (mut hand, mut ours, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.reps {
        hand.push(handwritten::<B>(steps, bs, &device)?.0);
        ours.push(flashover::<B>(steps, bs, false, &device)?.0);
        theirs.push(learner::<B>(args, &device)?);
    }
    let (hm, hmin, hmax) = median_min_max(&hand);
    let (om, omin, omax) = median_min_max(&ours);
    let (lm, lmin, lmax) = median_min_max(&theirs);
    println!("| loop (flex with SIMD and rayon, as burn-train builds it) | median s | min-max s | ratio to hand-written |");
    println!("| --- | --- | --- | --- |");
    println!("| hand-written Burn | {hm:.3} | {hmin:.3}-{hmax:.3} | 1.000 |");
    println!(
        "| Flashover trainer | {om:.3} | {omin:.3}-{omax:.3} | {:.3} |",
        om / hm
    );
    println!(
        "| burn-train Learner | {lm:.3} | {lmin:.3}-{lmax:.3} | {:.3} |",
        lm / hm
    );
    println!(
        "{}",
        json!({
            "backend": args.backend,
            "steps": args.steps,
            "reps": args.reps,
            "batch_size": args.batch_size,
            "handwritten_median_s": hm,
            "flashover_median_s": om,
            "burn_train_median_s": lm,
            "flashover_over_handwritten": om / hm,
            "burn_train_over_handwritten": lm / hm,
            "burn_train_over_flashover": lm / om,
        })
    );
    Ok(())
}
