//! Quickstart: Flashover as a library, in one file. An MLP of our own learns four Gaussian
//! blobs with an evaluator, two speed-up algorithms (label smoothing, EMA), a callback of our
//! own and checkpoints: `cargo run --release --example quickstart`; stopped (`-- --stop-after
//! 40`), the same command resumes it. The last stdout line is a JSON summary.

use std::sync::Arc;

use flashover::algorithms::{ema::Ema, label_smoothing::LabelSmoothing};
use flashover::backend::{Default as Inner, DefaultAutodiff as B};
use flashover::burn; // Burn's `Module` derive needs `burn` in scope.
use flashover::core::loss::classification_loss;
use flashover::prelude::*;

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

/// The model: 2 inputs -> 32 hidden units -> 4 classes. Burn's derive wants the backend
/// parameter named `B`.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Mlp {
            hidden: LinearConfig::new(2, 32).init(device),
            out: LinearConfig::new(32, 4).init(device),
            relu: Relu::new(),
        }
    }
    fn logits(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out.forward(self.relu.forward(self.hidden.forward(x)))
    }
}

/// Training: forward and a mean loss. `classification_loss` reads the soft targets label
/// smoothing sets (a plain `cross_entropy` on `batch.targets` would stop the run with an error
/// naming the algorithm).
impl<B: AutodiffBackend> TrainModel<B> for Mlp<B> {
    type Batch = ClassificationBatch<B, 2>;
    type Output = Tensor<B, 2>;
    fn forward(&self, batch: &Self::Batch) -> Tensor<B, 2> {
        self.logits(batch.inputs.clone())
    }
    fn loss(&self, logits: &Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
        classification_loss(logits.clone(), batch)
    }
}

/// Evaluation runs the inner (gradient-free) model on the inner backend.
impl<B: Backend> EvalModel<B> for Mlp<B> {
    type Batch = ClassificationBatch<B, 2>;
    type Output = ClassificationOutput<B>;
    fn forward_eval(&self, batch: &Self::Batch) -> ClassificationOutput<B> {
        ClassificationOutput::scored(self.logits(batch.inputs.clone()), batch.targets.clone())
    }
}

/// The data: `n` points (x, y and a class) around four centres, from a seeded generator.
type Point = ([f32; 2], i64);

fn blobs(n: usize, seed: u64) -> InMemoryDataset<Point> {
    let mut rng = flashover::core::rng::Rng::new(seed);
    let centres = [(-2.0, -2.0), (-2.0, 2.0), (2.0, -2.0), (2.0, 2.0)];
    let mut points = Vec::with_capacity(n);
    for i in 0..n {
        let (x, y) = (
            centres[i % 4].0 + rng.normal(),
            centres[i % 4].1 + rng.normal(),
        );
        points.push(([x as f32, y as f32], (i % 4) as i64));
    }
    InMemoryDataset::new(points)
}

struct PointBatcher;

impl<D: Backend> Batcher<D, Point, ClassificationBatch<D, 2>> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &D::Device) -> ClassificationBatch<D, 2> {
        let n = items.len();
        let xy: Vec<f32> = items.iter().flat_map(|p| p.0).collect();
        let classes: Vec<i64> = items.iter().map(|p| p.1).collect();
        ClassificationBatch::new(
            Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            Tensor::<D, 1, Int>::from_data(TensorData::new(classes, [n]), device),
        )
    }
}

/// A callback of our own: prints the mean training loss of every epoch.
#[derive(Default)]
struct EpochLoss {
    sum: f64,
    batches: u64,
}

impl<S: Setup> Callback<S> for EpochLoss {
    fn name(&self) -> &str {
        "epoch_loss"
    }
    fn batch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<(), CoreError> {
        self.sum += state.loss_value().unwrap_or(f64::NAN);
        self.batches += 1;
        Ok(())
    }
    fn epoch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<(), CoreError> {
        let (epoch, mean) = (
            state.timestamp().epoch,
            self.sum / self.batches.max(1) as f64,
        );
        eprintln!("epoch {epoch}: mean training loss {mean:.4}");
        (self.sum, self.batches) = (0.0, 0);
        Ok(())
    }
}

#[allow(clippy::clone_on_copy)] // The device is `Copy` on the CPU backends only.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    flashover::init_logging(); // the trainer's log lines on stderr
    let args: Vec<String> = std::env::args().collect();
    let flag = |n: &str| {
        args.iter()
            .position(|a| a == n)
            .and_then(|i| args.get(i + 1))
    };
    let folder = flag("--save-folder").map_or("target/quickstart-checkpoints", |s| s.as_str());
    // Cloned where it is passed on: a CPU device is `Copy`, a GPU backend's is not.
    let device = <B as burn::tensor::backend::BackendTypes>::Device::default();

    let train = Arc::new(blobs(2048, 1));
    let test = Arc::new(blobs(512, 2));
    let train_sampler = Sampler::for_dataset(&*train, 64, true, 42)?;
    let batcher = Arc::new(PointBatcher);
    let train = DataLoader::<B, _, _>::new(
        "train",
        train,
        batcher.clone(),
        train_sampler,
        device.clone(),
    )?;
    // Evaluation data lives on the inner backend (no gradients).
    let test_sampler = Sampler::for_dataset(&*test, 256, false, 0)?;
    let test = DataLoader::<Inner, _, _>::new("test", test, batcher, test_sampler, device.clone())?;

    // Seeded initialisation (Burn's own draws differ from run to run).
    let model = init_model(&device, 42, Mlp::<B>::new);
    let optimizer = burn::optim::AdamWConfig::new().init::<B, Mlp<B>>();
    let metrics: Vec<Box<dyn Metric<_>>> = vec![Box::new(Accuracy::default())];
    let saver = Saver::new(
        SaverConfig::new(folder),
        SaveInterval::Every(Time::Batch(32)),
    )?;
    let mut builder = Trainer::builder(model, optimizer, train, "4ep".parse()?, device)
        .lr(1e-2)
        .seed(42)
        .evaluator(Evaluator::new("test", test, metrics))
        .algorithm(LabelSmoothing::new(0.1)?)
        .algorithm(Ema::new("20ba".parse()?)?)
        .callback(EpochLoss::default())
        .callback(saver);
    if let Some(n) = flag("--stop-after") {
        builder = builder.callback(StopAt::new(Time::Batch(n.parse()?)));
    }
    // Resume from the newest good checkpoint in the folder, if there is one.
    if let Some(restore) = autoresume(folder.as_ref())? {
        builder = builder.restore(restore);
    }
    let mut trainer = builder.build()?;
    trainer.fit()?;
    // After fit the model holds EMA's averaged weights: the ones evaluated and saved here.
    let accuracy = trainer.eval()?["test"]["accuracy"];
    let weights = std::path::Path::new(folder).with_extension("safetensors");
    save_weights(trainer.model(), &weights)?;
    let summary = serde_json::json!({
        "test_accuracy": accuracy,
        "batches": trainer.state().timestamp().batch,
        "params_sha256": params_sha256::<B, _>(trainer.model()),
    });
    println!("{summary}");
    Ok(())
}
