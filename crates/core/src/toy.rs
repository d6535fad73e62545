//! A one-weight linear regression (`y = 2x`, fit by `w * x`) with its data and a trainer
//! around it: small enough for the runnable examples in this crate's docs and for unit tests
//! of the trainer, on any backend. Not a model for real use, and nothing else depends on it.

use burn::module::{Module, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Sgd, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};

use crate::data::{BatchIter, BatchSource};
use crate::model::{Batch, EvalModel, TrainModel};
use crate::setup::SetupOf;
use crate::time::Time;
use crate::trainer::{Trainer, TrainerBuilder};

/// The model: one weight `w`, predicting `w * x`.
#[derive(Module, Debug)]
pub struct Line<B: Backend> {
    /// The weight, shape `[1]`.
    pub w: Param<Tensor<B, 1>>,
}

/// A batch of points `(x, y)`.
#[derive(Debug, Clone)]
pub struct Points<B: Backend> {
    /// Inputs, `[n]`.
    pub x: Tensor<B, 1>,
    /// Targets, `[n]`.
    pub y: Tensor<B, 1>,
}

impl<B: Backend> Batch for Points<B> {
    fn len(&self) -> usize {
        self.x.dims()[0]
    }

    fn split(self, size: usize) -> Vec<Self> {
        let n = self.len();
        (0..n)
            .step_by(size.max(1))
            .map(|start| {
                let len = size.min(n - start);
                Points {
                    x: self.x.clone().narrow(0, start, len),
                    y: self.y.clone().narrow(0, start, len),
                }
            })
            .collect()
    }
}

fn squared_error<B: Backend>(w: Tensor<B, 1>, batch: &Points<B>) -> Tensor<B, 1> {
    let n = batch.len();
    let prediction = batch.x.clone() * w.expand([n]);
    (prediction - batch.y.clone()).powi_scalar(2).mean()
}

impl<B: AutodiffBackend> TrainModel<B> for Line<B> {
    type Batch = Points<B>;
    type Output = Tensor<B, 1>;

    fn forward(&self, _batch: &Points<B>) -> Tensor<B, 1> {
        self.w.val()
    }

    fn loss(&self, w: &Tensor<B, 1>, batch: &Points<B>) -> Tensor<B, 1> {
        squared_error(w.clone(), batch)
    }
}

impl<B: Backend> EvalModel<B> for Line<B> {
    type Batch = Points<B>;
    type Output = Tensor<B, 1>;

    fn forward_eval(&self, batch: &Points<B>) -> Tensor<B, 1> {
        squared_error(self.w.val(), batch)
    }
}

/// `n` points `x = i / n`, `y = 2x`, in batches of `batch_size`, the same order every epoch.
#[derive(Debug, Clone)]
pub struct PointSource<B: Backend> {
    n: usize,
    batch_size: usize,
    device: B::Device,
}

/// The points of [`PointSource`] on the default device.
pub fn points<B: Backend>(n: usize, batch_size: usize) -> PointSource<B> {
    PointSource {
        n,
        batch_size: batch_size.max(1),
        device: Default::default(),
    }
}

impl<B: Backend> BatchSource<Points<B>> for PointSource<B> {
    fn name(&self) -> &str {
        "points"
    }
    fn num_batches(&self) -> usize {
        self.n.div_ceil(self.batch_size)
    }
    fn num_samples(&self) -> usize {
        self.n
    }
    fn batch_size(&self) -> usize {
        self.batch_size
    }
    fn iter_from(&self, _epoch: u64, start: usize) -> BatchIter<Points<B>> {
        let (n, size, device) = (self.n, self.batch_size, self.device.clone());
        let batches = (start..self.num_batches()).map(move |b| {
            let x: Vec<f32> = (b * size..((b + 1) * size).min(n))
                .map(|i| i as f32 / n as f32)
                .collect();
            let y: Vec<f32> = x.iter().map(|x| 2.0 * x).collect();
            let len = x.len();
            Ok(Points {
                x: Tensor::from_data(TensorData::new(x, [len]), &device),
                y: Tensor::from_data(TensorData::new(y, [len]), &device),
            })
        });
        BatchIter::from_iter(batches, self.num_batches() - start)
    }
}

/// The model with `w = 0` on the default device.
pub fn initial<B: Backend>() -> Line<B> {
    Line {
        w: Param::from_tensor(Tensor::zeros([1], &Default::default())),
    }
}

/// The model's weight.
pub fn weight<B: Backend>(model: &Line<B>) -> f32 {
    model.w.val().into_scalar().elem()
}

/// The optimizer of [`trainer`]: plain SGD.
pub type ToyOptimizer<B> = OptimizerAdaptor<Sgd<<B as AutodiffBackend>::InnerBackend>, Line<B>, B>;

/// A trainer builder for the regression from `w = 0` with SGD at learning rate 0.5 on
/// `source`, for `max_duration`.
pub fn trainer<B: AutodiffBackend>(
    source: PointSource<B>,
    max_duration: Time,
) -> TrainerBuilder<SetupOf<B, Line<B>, ToyOptimizer<B>>> {
    let device = source.device.clone();
    Trainer::builder(
        initial::<B>(),
        SgdConfig::new().init::<B, Line<B>>(),
        source,
        max_duration,
        device,
    )
    .lr(0.5)
}
