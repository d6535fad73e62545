//! The timed training loops that the overhead benchmarks compare, shared by the `overhead`
//! example and the burn-train comparison (`benches/learner`): the same MNIST CNN, initial
//! weights, AdamW at a constant 1e-3, batches (same loader, seed and order) and step count.

use std::time::Instant;

use burn::optim::{GradientsParams, Optimizer};
use flashover::callbacks::{ConsoleLogger, JsonlLogger, MlflowLogger, MlflowOptions, ProgressBar};
use flashover::core::data::BatchSource;
use flashover::core::params::params_sha256;
use flashover::core::time::Time;
use flashover::core::trainer::Trainer;
use flashover::core::Result;
use flashover::models::TrainBackend;

use crate::{defaults, mnist_loaders, MnistCnn, MnistData, MnistRun};

/// The training data of the overhead runs: the bundled digits in batches of `batch_size`,
/// order seeded with 1.
pub fn data(batch_size: usize) -> MnistData {
    let mut d = MnistData::bundled(batch_size, 1);
    d.test_limit = Some(10);
    d
}

/// The loop a Burn user writes by hand: forward, loss, backward, step; no loss read-back.
/// Returns the seconds of the loop and the final weights' digest.
pub fn handwritten<B: TrainBackend>(
    steps: u64,
    batch_size: usize,
    device: &B::Device,
) -> Result<(f64, String)> {
    let (train, _) = mnist_loaders::<B>(&data(batch_size), device)?;
    let mut model = MnistCnn::<B>::new(device, 1);
    let mut optim = MnistRun::adamw::<B>();
    let start = Instant::now();
    let mut step = 0;
    let mut epoch = 0;
    while step < steps {
        for batch in train.iter_from(epoch, 0) {
            let batch = batch?;
            let logits = model.logits(batch.inputs.clone());
            let loss = flashover::core::loss::cross_entropy(logits, batch.targets.clone());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
            step += 1;
            if step == steps {
                break;
            }
        }
        epoch += 1;
    }
    Ok((start.elapsed().as_secs_f64(), params_sha256::<B, _>(&model)))
}

/// The same work through Flashover's trainer, with no algorithms or callbacks, or (`observed`)
/// with the console logger at the example's default interval, a JSON Lines file of every
/// logged value (in the system's temporary folder, removed afterwards) and the progress bar
/// (kept up to date but drawn nowhere, so that its cost counts without a terminal). Returns
/// the seconds of `fit` and the final weights' digest.
pub fn flashover<B: TrainBackend>(
    steps: u64,
    batch_size: usize,
    observed: bool,
    device: &B::Device,
) -> Result<(f64, String)> {
    let run = timed::<B>(steps, batch_size, observed, None, device)?;
    Ok((run.fit_seconds, run.digest))
}

/// One timed run of [`flashover_with_mlflow`].
#[derive(Debug, Clone)]
pub struct Timed {
    /// Seconds of `fit`.
    pub fit_seconds: f64,
    /// Seconds from the end of `fit` until the MLflow run is ended (every value sent).
    pub finish_seconds: f64,
    /// The final weights' digest.
    pub digest: String,
}

/// The observed run of [`flashover`] with an MLflow logger too, logging to the tracking server
/// at `uri` (experiment `flashover-overhead`, a run per call). Fails unless the server took
/// every value.
pub fn flashover_with_mlflow<B: TrainBackend>(
    steps: u64,
    batch_size: usize,
    uri: &str,
    device: &B::Device,
) -> Result<Timed> {
    timed::<B>(steps, batch_size, true, Some(uri), device)
}

fn timed<B: TrainBackend>(
    steps: u64,
    batch_size: usize,
    observed: bool,
    mlflow: Option<&str>,
    device: &B::Device,
) -> Result<Timed> {
    let (train, _) = mnist_loaders::<B>(&data(batch_size), device)?;
    let model = MnistCnn::<B>::new(device, 1);
    let mut builder = Trainer::builder(
        model,
        MnistRun::adamw::<B>(),
        train,
        Time::Batch(steps),
        device.clone(),
    )
    .lr(1e-3)
    .seed(1);
    let jsonl =
        std::env::temp_dir().join(format!("flashover-overhead-{}.jsonl", std::process::id()));
    if observed {
        builder = builder
            .logger(ConsoleLogger::new(defaults::LOG_EVERY))
            .logger(JsonlLogger::create(&jsonl)?)
            .logger(ProgressBar::hidden());
    }
    let mut run = None;
    if let Some(uri) = mlflow {
        let mut options = MlflowOptions::new(uri);
        options.experiment = "flashover-overhead".into();
        let logger = MlflowLogger::new(options)?;
        run = Some(logger.handle());
        builder = builder.logger(logger);
    }
    let mut trainer = builder.build()?;
    let start = Instant::now();
    trainer.fit()?;
    let fit_seconds = start.elapsed().as_secs_f64();
    let digest = params_sha256::<B, _>(trainer.model());
    let finish = Instant::now();
    drop(trainer);
    if let Some(run) = run {
        let report = run.finish();
        // One train/loss and one train/lr per batch at least: the server took them all.
        if report.metrics_unsent > 0 || report.metrics_sent < 2 * steps {
            return Err(flashover::core::CoreError::config(
                "overhead MLflow run",
                format!("{report:?}"),
                format!("every value sent (at least {})", 2 * steps),
            ));
        }
    }
    let finish_seconds = finish.elapsed().as_secs_f64();
    if observed {
        let lines = std::fs::read_to_string(&jsonl).map(|t| t.lines().count());
        let _ = std::fs::remove_file(&jsonl);
        // One line of hyperparameters and one per batch: the logger really wrote.
        if lines.ok() != Some(steps as usize + 1) {
            return Err(flashover::core::CoreError::config(
                "overhead JSONL log",
                jsonl.display(),
                format!("{} lines (hyperparameters and one per batch)", steps + 1),
            ));
        }
    }
    Ok(Timed {
        fit_seconds,
        finish_seconds,
        digest,
    })
}
