//! What the trainer needs from a model and its batches, as traits. A model opts in by
//! implementing [`TrainModel`] for its autodiff form and [`EvalModel`] for its inner
//! (gradient-free) form; batches say how they split into microbatches through [`Batch`].
//!
//! This module holds contracts only: no training logic and no concrete backend.

use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};

/// A batch the trainer can count and split into microbatches. Cloning must be cheap (tensors
/// are reference-counted), since the trainer keeps the full batch while it runs microbatches.
pub trait Batch: Clone + Send + 'static {
    /// Number of samples in the batch.
    fn len(&self) -> usize;

    /// Whether the batch holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits the batch into consecutive microbatches of `size` samples; the last one holds
    /// the remainder when `size` does not divide the batch. `size` is at least 1 (the trainer
    /// checks it).
    fn split(self, size: usize) -> Vec<Self>;

    /// Tokens in the batch, for token-counted time (`tok`); 0 for batches without tokens.
    fn num_tokens(&self) -> u64 {
        0
    }
}

/// A model the trainer can train: forward on a batch, then a scalar loss.
///
/// The loss must be the *mean* over the batch's samples: the trainer weights each microbatch's
/// loss by its share of the batch, so that the summed gradient equals the full-batch gradient.
/// The inner (gradient-free) module is used for evaluation and prediction, so it must be an
/// [`EvalModel`].
pub trait TrainModel<B: AutodiffBackend>:
    AutodiffModule<B, InnerModule: EvalModel<B::InnerBackend>> + Send + 'static
{
    /// The batch type produced by the training data loader.
    type Batch: Batch;
    /// What `forward` returns.
    type Output: Send;

    /// Runs the model on a batch.
    fn forward(&self, batch: &Self::Batch) -> Self::Output;

    /// The mean loss of `output` against `batch`, as a one-element tensor.
    fn loss(&self, output: &Self::Output, batch: &Self::Batch) -> Tensor<B, 1>;
}

/// A model that can be evaluated: forward without gradients, producing what its metrics read.
pub trait EvalModel<B: Backend>: Module<B> + Send + 'static {
    /// The batch type produced by evaluation and prediction loaders.
    type Batch: Batch;
    /// What evaluation returns per batch (read by metrics, returned by predict).
    type Output: Send;

    /// Runs the model on a batch without tracking gradients.
    fn forward_eval(&self, batch: &Self::Batch) -> Self::Output;
}

/// A batch of inputs with integer class targets (images, or any other tensor of rank `D`).
#[derive(Debug, Clone)]
pub struct ClassificationBatch<B: Backend, const D: usize> {
    /// Inputs, batch first.
    pub inputs: Tensor<B, D>,
    /// Class indices, one per sample.
    pub targets: Tensor<B, 1, Int>,
}

impl<B: Backend, const D: usize> Batch for ClassificationBatch<B, D> {
    fn len(&self) -> usize {
        self.targets.dims()[0]
    }

    fn split(self, size: usize) -> Vec<Self> {
        let n = self.len();
        if size >= n {
            return vec![self];
        }
        (0..n)
            .step_by(size)
            .map(|start| {
                let len = size.min(n - start);
                ClassificationBatch {
                    inputs: self.inputs.clone().narrow(0, start, len),
                    targets: self.targets.clone().narrow(0, start, len),
                }
            })
            .collect()
    }
}

/// The output of a classifier on a batch: logits, the targets they are scored against, and
/// the mean loss. Built-in metrics ([`crate::metric`]) read this.
#[derive(Debug, Clone)]
pub struct ClassificationOutput<B: Backend> {
    /// Mean loss over the batch.
    pub loss: Tensor<B, 1>,
    /// Unnormalised scores, `[batch, classes]`.
    pub logits: Tensor<B, 2>,
    /// Class indices, `[batch]`.
    pub targets: Tensor<B, 1, Int>,
}
