//! What the trainer needs from a model and its batches, as traits. A model opts in by
//! implementing [`TrainModel`] for its autodiff form and [`EvalModel`] for its inner
//! (gradient-free) form; batches say how they split into microbatches through [`Batch`].
//!
//! This module holds contracts only: no training logic and no concrete backend.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor};
use derive_new::new;

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

    /// Whether batches of this type count tokens ([`num_tokens`](Self::num_tokens)). A run
    /// whose batches do not is refused, before training, any time in `tok` (a run length or
    /// an interval that would never be reached). Set it to `true` with `num_tokens`.
    const COUNTS_TOKENS: bool = false;

    /// Tokens in the batch, for token-counted time (`tok`); 0 for batches without tokens.
    fn num_tokens(&self) -> u64 {
        0
    }

    /// Tokens the loss scores (padding left out), by which the trainer weighs microbatches
    /// and ranks under
    /// [`accumulate_on_tokens`](crate::trainer::TrainerBuilder::accumulate_on_tokens);
    /// [`num_tokens`](Self::num_tokens) unless the batch type knows of padding.
    fn num_loss_tokens(&self) -> u64 {
        self.num_tokens()
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

    /// Floating-point operations one training sample costs (forward and backward, usually
    /// three times the forward count), if the model knows; a speed monitor turns it into
    /// model FLOPs per second and utilisation. Default: unknown.
    fn flops_per_sample(&self) -> Option<f64> {
        None
    }
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

/// A batch of inputs with integer class targets (images, or any other tensor of rank `D`);
/// `ClassificationBatch::new(inputs, targets)` makes one with hard targets only.
#[derive(Debug, Clone, new)]
pub struct ClassificationBatch<B: Backend, const D: usize> {
    /// Inputs, batch first.
    pub inputs: Tensor<B, D>,
    /// Class indices, one per sample.
    pub targets: Tensor<B, 1, Int>,
    /// Class distributions `[batch, classes]` that replace `targets` in the loss when set
    /// (label smoothing, MixUp and CutMix write them through
    /// [`ClassTargets::set_soft_targets`]; loaders leave them empty). Read them through
    /// [`ClassTargets::soft_targets`] (or [`crate::loss::classification_loss`]), which marks
    /// them read: an algorithm whose soft targets no loss read stops the run.
    #[new(default)]
    soft_targets: Option<SoftTargets<B>>,
}

/// Soft targets and whether anything read them since they were set. Clones, splits and
/// selections of a batch share the mark, so a read of any of them counts.
#[derive(Debug, Clone)]
struct SoftTargets<B: Backend> {
    tensor: Tensor<B, 2>,
    read: Arc<AtomicBool>,
}

impl<B: Backend> SoftTargets<B> {
    fn new(tensor: Tensor<B, 2>) -> Self {
        Self {
            tensor,
            read: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The same mark over another tensor (a slice or selection of this one).
    fn map(&self, f: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>) -> Self {
        Self {
            tensor: f(self.tensor.clone()),
            read: self.read.clone(),
        }
    }

    fn get(&self) -> &Tensor<B, 2> {
        self.read.store(true, Ordering::Relaxed);
        &self.tensor
    }

    fn was_read(&self) -> bool {
        self.read.load(Ordering::Relaxed)
    }
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
                    soft_targets: self
                        .soft_targets
                        .as_ref()
                        .map(|t| t.map(|t| t.narrow(0, start, len))),
                }
            })
            .collect()
    }
}

impl<B: Backend> ImageBatch<B> for ClassificationBatch<B, 4> {
    fn images(&self) -> &Tensor<B, 4> {
        &self.inputs
    }

    fn set_images(&mut self, images: Tensor<B, 4>) {
        self.inputs = images;
    }
}

impl<B: Backend, const D: usize> ClassTargets<B> for ClassificationBatch<B, D> {
    fn classes(&self) -> &Tensor<B, 1, Int> {
        &self.targets
    }

    fn soft_targets(&self) -> Option<&Tensor<B, 2>> {
        self.soft_targets.as_ref().map(SoftTargets::get)
    }

    fn set_soft_targets(&mut self, targets: Option<Tensor<B, 2>>) {
        self.soft_targets = targets.map(SoftTargets::new);
    }

    fn soft_targets_read(&self) -> Option<bool> {
        self.soft_targets.as_ref().map(SoftTargets::was_read)
    }
}

impl<B: Backend, const D: usize> SelectSamples<B> for ClassificationBatch<B, D> {
    fn select(self, indices: Tensor<B, 1, Int>) -> Self {
        ClassificationBatch {
            inputs: self.inputs.select(0, indices.clone()),
            targets: self.targets.select(0, indices.clone()),
            soft_targets: self.soft_targets.map(|t| t.map(|t| t.select(0, indices))),
        }
    }
}

/// A batch of images, `[batch, channels, height, width]`, that data algorithms (CutOut,
/// MixUp, progressive resizing, RandAugment...) may rewrite. Requiring this bound is how an
/// image algorithm refuses, at compile time, a model that does not train on images.
pub trait ImageBatch<B: Backend>: Batch {
    /// The images.
    fn images(&self) -> &Tensor<B, 4>;
    /// Replaces the images (the batch size must stay the same; height and width may change).
    fn set_images(&mut self, images: Tensor<B, 4>);
}

/// A batch with one class per sample, whose targets algorithms may replace by class
/// distributions ("soft targets"). A model trained on such batches must read the soft
/// targets in its loss when they are set (see [`crate::loss::classification_loss`]).
pub trait ClassTargets<B: Backend>: Batch {
    /// Class indices, `[batch]`.
    fn classes(&self) -> &Tensor<B, 1, Int>;
    /// Class distributions `[batch, classes]`, when an algorithm has set them.
    fn soft_targets(&self) -> Option<&Tensor<B, 2>>;
    /// Sets (or clears, with `None`) the class distributions.
    fn set_soft_targets(&mut self, targets: Option<Tensor<B, 2>>);

    /// Whether the soft targets now set were read (through [`soft_targets`](Self::soft_targets),
    /// which [`crate::loss::classification_loss`] calls) since they were set: `Some(false)`
    /// after a loss means the loss ignored them, and the algorithm that set them (label
    /// smoothing, MixUp, CutMix) stops the run naming itself and the function to call.
    /// `None` when none are set, or when this batch type does not track reads (the default,
    /// for batch types of your own: then nothing is checked).
    fn soft_targets_read(&self) -> Option<bool> {
        None
    }

    /// The class index that marks the positions the loss skips (padding), when this batch
    /// has any: a [`TokenBatch::padded`] batch returns
    /// [`IGNORE_INDEX`](crate::cross_entropy::IGNORE_INDEX). `None` (the default): every
    /// class index is a real class.
    fn ignore_index(&self) -> Option<i64> {
        None
    }

    /// The targets as distributions over `num_classes`: the soft targets when set, otherwise
    /// the one-hot encoding of the classes, which must lie in `0..num_classes` (a negative or
    /// too large index is an error naming it, see [`crate::loss::one_hot_classes`]). Rows
    /// whose class is the [`ignore_index`](Self::ignore_index) get class 0's one-hot row: the
    /// loss never reads them.
    fn target_distribution(&self, num_classes: usize) -> crate::Result<Tensor<B, 2>> {
        match (self.soft_targets(), self.ignore_index()) {
            (Some(t), _) => Ok(t.clone()),
            (None, None) => {
                crate::cross_entropy::one_hot_classes(self.classes().clone(), num_classes)
            }
            (None, Some(ignore)) => {
                let classes = self.classes().clone();
                let ignored = classes.clone().equal_elem(ignore);
                crate::cross_entropy::one_hot_classes(classes.mask_fill(ignored, 0), num_classes)
            }
        }
    }
}

/// A batch that can keep a subset (or a permutation) of its samples.
pub trait SelectSamples<B: Backend>: Batch {
    /// The samples at `indices`, in that order (every field of the batch is selected alike).
    fn select(self, indices: Tensor<B, 1, Int>) -> Self;
}

/// A model output that holds class scores, so that algorithms can read the number of classes
/// and score samples (selective backprop).
pub trait Logits<B: Backend> {
    /// Unnormalised class scores, `[batch, classes]`.
    fn logits(&self) -> &Tensor<B, 2>;
}

impl<B: Backend> Logits<B> for Tensor<B, 2> {
    fn logits(&self) -> &Tensor<B, 2> {
        self
    }
}

impl<B: Backend> ClassificationOutput<B> {
    /// `logits` scored against class indices `targets` with the mean cross-entropy: what a
    /// classifier's `forward_eval` returns.
    pub fn scored(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Self {
        Self {
            loss: crate::cross_entropy::cross_entropy(logits.clone(), targets.clone()),
            logits,
            targets,
        }
    }

    /// As [`scored`](Self::scored), the loss a mean over the rows whose target is not
    /// `ignore_index` (padding) when one is given: what a language model's `forward_eval`
    /// returns for a [`TokenBatch`] (its [`ClassTargets::ignore_index`]). The targets are kept
    /// as they are, padding included, for metrics that skip it
    /// ([`crate::metric::LanguageCrossEntropy`]).
    pub fn scored_ignoring(
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        ignore_index: Option<i64>,
    ) -> Self {
        let Some(ignore) = ignore_index else {
            return Self::scored(logits, targets);
        };
        Self {
            loss: crate::cross_entropy::cross_entropy_ignoring(
                logits.clone(),
                targets.clone(),
                ignore,
            ),
            logits,
            targets,
        }
    }
}

impl<B: Backend> Logits<B> for ClassificationOutput<B> {
    fn logits(&self) -> &Tensor<B, 2> {
        &self.logits
    }
}

/// A batch of token sequences for language modelling: `tokens[b, t]` predicts
/// `targets[b, t]` (usually the next token).
///
/// As [`ClassTargets`], its classes are the targets flattened to `[batch * seq_len]`, the
/// rows of a language model's `[batch * seq_len, vocab]` logits (sequence by sequence), and
/// its soft targets (label smoothing) are `[batch * seq_len, vocab]`.
///
/// Sequences of different lengths share a batch padded to the longest: built with
/// [`TokenBatch::padded`], its targets hold [`IGNORE_INDEX`](crate::cross_entropy::IGNORE_INDEX)
/// at the padding, which the losses ([`crate::loss::classification_loss`]) and the
/// language-model metrics ([`crate::metric::LanguageCrossEntropy`]) skip, and which
/// [`Batch::num_loss_tokens`] does not count (the trainer's
/// [`accumulate_on_tokens`](crate::trainer::TrainerBuilder::accumulate_on_tokens) weighs
/// microbatches and ranks by that count).
#[derive(Debug, Clone)]
pub struct TokenBatch<B: Backend> {
    /// Input token ids, `[batch, seq_len]`.
    pub tokens: Tensor<B, 2, Int>,
    /// Target token ids, `[batch, seq_len]`.
    pub targets: Tensor<B, 2, Int>,
    /// `targets` as one row, kept in step with it.
    flat: Tensor<B, 1, Int>,
    /// Distributions over the vocabulary per target, when an algorithm has set them.
    soft_targets: Option<SoftTargets<B>>,
    /// The targets may hold `IGNORE_INDEX` (built with `padded`).
    padded: bool,
}

impl<B: Backend> TokenBatch<B> {
    /// A batch of `tokens` and `targets` (`[batch, seq_len]` each). Panics if their shapes
    /// differ.
    pub fn new(tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Self {
        assert_eq!(
            tokens.dims(),
            targets.dims(),
            "a token batch's tokens and targets have the same shape"
        );
        let [b, s] = targets.dims();
        Self {
            tokens,
            flat: targets.clone().reshape([b * s]),
            targets,
            soft_targets: None,
            padded: false,
        }
    }

    /// A batch whose `targets` hold [`IGNORE_INDEX`](crate::cross_entropy::IGNORE_INDEX)
    /// (-100) where a position is padding (sequences shorter than the batch's length, or
    /// positions not to be scored): the losses and the language-model metrics skip those
    /// positions and [`Batch::num_loss_tokens`] does not count them. Every other target must
    /// be a token id. Panics if the shapes differ.
    pub fn padded(tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Self {
        let mut batch = Self::new(tokens, targets);
        batch.padded = true;
        batch
    }

    /// Whether the targets may hold padding (the batch was built with
    /// [`padded`](Self::padded)).
    pub fn is_padded(&self) -> bool {
        self.padded
    }

    /// This batch's form with `tokens` and `targets` (the padding flag kept).
    fn like(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Self {
        let mut out = Self::new(tokens, targets);
        out.padded = self.padded;
        out
    }

    /// The targets as one row of `batch * seq_len` ids, in the order of a language model's
    /// `[batch * seq_len, vocab]` logits (sequence by sequence).
    pub fn flat_targets(&self) -> Tensor<B, 1, Int> {
        self.flat.clone()
    }

    /// The rows of the flattened targets that sequences `indices` cover.
    fn rows_of(&self, indices: &Tensor<B, 1, Int>) -> Tensor<B, 1, Int> {
        let [_, s] = self.targets.dims();
        let [k] = indices.dims();
        let device = indices.device();
        let offsets = Tensor::<B, 1, Int>::arange(0..s as i64, &device).reshape([1, s]);
        (indices.clone().reshape([k, 1]).mul_scalar(s as i64) + offsets).reshape([k * s])
    }
}

impl<B: Backend> ClassTargets<B> for TokenBatch<B> {
    fn classes(&self) -> &Tensor<B, 1, Int> {
        &self.flat
    }

    fn soft_targets(&self) -> Option<&Tensor<B, 2>> {
        self.soft_targets.as_ref().map(SoftTargets::get)
    }

    fn set_soft_targets(&mut self, targets: Option<Tensor<B, 2>>) {
        self.soft_targets = targets.map(SoftTargets::new);
    }

    fn soft_targets_read(&self) -> Option<bool> {
        self.soft_targets.as_ref().map(SoftTargets::was_read)
    }

    fn ignore_index(&self) -> Option<i64> {
        self.padded.then_some(crate::cross_entropy::IGNORE_INDEX)
    }
}

impl<B: Backend> SelectSamples<B> for TokenBatch<B> {
    /// Selects whole sequences.
    fn select(self, indices: Tensor<B, 1, Int>) -> Self {
        let soft = self
            .soft_targets
            .as_ref()
            .map(|t| t.map(|t| t.select(0, self.rows_of(&indices))));
        let mut out = self.like(
            self.tokens.clone().select(0, indices.clone()),
            self.targets.clone().select(0, indices),
        );
        out.soft_targets = soft;
        out
    }
}

impl<B: Backend> Batch for TokenBatch<B> {
    fn len(&self) -> usize {
        self.tokens.dims()[0]
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
                let [_, s] = self.targets.dims();
                let mut part = self.like(
                    self.tokens.clone().narrow(0, start, len),
                    self.targets.clone().narrow(0, start, len),
                );
                part.soft_targets = self
                    .soft_targets
                    .as_ref()
                    .map(|t| t.map(|t| t.narrow(0, start * s, len * s)));
                part
            })
            .collect()
    }

    const COUNTS_TOKENS: bool = true;

    fn num_tokens(&self) -> u64 {
        let [b, t] = self.tokens.dims();
        (b * t) as u64
    }

    /// Every position unless the batch is [`padded`](TokenBatch::padded); then the targets
    /// that are not padding, counted on the device (one read).
    fn num_loss_tokens(&self) -> u64 {
        if !self.padded {
            return self.num_tokens();
        }
        let counted: i64 = self
            .flat
            .clone()
            .not_equal_elem(crate::cross_entropy::IGNORE_INDEX)
            .int()
            .sum()
            .into_scalar()
            .elem();
        counted.max(0) as u64
    }
}

/// A batch of sequences whose length algorithms may change (sequence-length warmup).
pub trait SequenceBatch<B: Backend>: Batch {
    /// Length of every sequence in the batch.
    fn seq_len(&self) -> usize;
    /// Keeps the first `len` positions of every sequence (`1 <= len <= seq_len`).
    fn truncate(self, len: usize) -> Self;
    /// Cuts every sequence into pieces of `len` positions, which become separate sequences
    /// (`batch * (seq_len / len)` of them); a remainder shorter than `len` is dropped.
    fn fold(self, len: usize) -> Self;
}

impl<B: Backend> SequenceBatch<B> for TokenBatch<B> {
    fn seq_len(&self) -> usize {
        self.tokens.dims()[1]
    }

    /// Soft targets, set only between `BEFORE_LOSS` and `AFTER_LOSS`, are dropped: the
    /// sequence algorithms run at `AFTER_DATALOADER`, before any is set.
    fn truncate(self, len: usize) -> Self {
        self.like(
            self.tokens.clone().narrow(1, 0, len),
            self.targets.clone().narrow(1, 0, len),
        )
    }

    /// Soft targets are dropped, as by [`truncate`](Self::truncate).
    fn fold(self, len: usize) -> Self {
        let [b, t] = self.tokens.dims();
        let pieces = t / len;
        let keep = pieces * len;
        self.like(
            self.tokens
                .clone()
                .narrow(1, 0, keep)
                .reshape([b * pieces, len]),
            self.targets
                .clone()
                .narrow(1, 0, keep)
                .reshape([b * pieces, len]),
        )
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

/// How a model lays out its image activations (Composer's "memory format"). Weights are the
/// same in every format; only activations, and which kernels run, differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum MemoryFormat {
    /// The backend's fast format: channels-last where the backend has fast channels-last
    /// kernels (the CPU backend flex), channels-first elsewhere.
    #[default]
    Auto,
    /// `[batch, channels, height, width]`, Burn's layout and Burn's own kernels.
    ChannelsFirst,
    /// `[batch, height, width, channels]`, through `flashover-models`' channels-last kernels.
    ChannelsLast,
}

impl std::str::FromStr for MemoryFormat {
    type Err = crate::CoreError;

    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "channels-first" | "channels_first" => Ok(Self::ChannelsFirst),
            "channels-last" | "channels_last" => Ok(Self::ChannelsLast),
            other => Err(crate::CoreError::config(
                "memory_format",
                format!("{other:?}"),
                "auto, channels-first or channels-last",
            )),
        }
    }
}

/// A model whose convolution and pooling layers can run in either [`MemoryFormat`]; the
/// `ChannelsLast` algorithm needs it.
pub trait HasMemoryFormat {
    /// The format the model was built with or last set to.
    fn memory_format(&self) -> MemoryFormat;
    /// The same model (same parameters) running in `format`.
    fn with_memory_format(self, format: MemoryFormat) -> Self;
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type B = Flex;

    fn ints(v: Vec<i64>, shape: [usize; 2]) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(v, shape), &Default::default())
    }

    fn list(t: Tensor<B, 1, Int>) -> Vec<i64> {
        t.into_data().iter::<i64>().collect()
    }

    /// A token batch's classes follow its targets through selection, splitting and folding,
    /// and soft targets follow their sequences' rows.
    #[test]
    fn token_batches_keep_their_flat_targets_and_soft_targets_in_step() {
        let d = Default::default();
        let tokens = ints((0..9).collect(), [3, 3]);
        let targets = ints((10..19).collect(), [3, 3]);
        let mut batch = TokenBatch::new(tokens, targets);
        assert_eq!(list(batch.classes().clone()), (10..19).collect::<Vec<_>>());
        // Soft targets: row r holds the value r in both columns.
        let soft: Vec<f32> = (0..9).flat_map(|r| [r as f32, r as f32]).collect();
        batch.set_soft_targets(Some(Tensor::from_data(TensorData::new(soft, [9, 2]), &d)));
        let picked = batch
            .clone()
            .select(Tensor::from_data(TensorData::new(vec![2i64, 0], [2]), &d));
        assert_eq!(list(picked.classes().clone()), [16, 17, 18, 10, 11, 12]);
        let rows: Vec<f32> = picked.soft_targets().unwrap().to_data().to_vec().unwrap();
        assert_eq!(rows, [6., 6., 7., 7., 8., 8., 0., 0., 1., 1., 2., 2.]);
        let parts = batch.clone().split(2);
        assert_eq!(list(parts[1].classes().clone()), [16, 17, 18]);
        assert_eq!(parts[1].soft_targets().unwrap().dims(), [3, 2]);
        let folded = TokenBatch::<B>::new(
            ints((0..8).collect(), [2, 4]),
            ints((10..18).collect(), [2, 4]),
        )
        .fold(2);
        assert_eq!(folded.targets.dims(), [4, 2]);
        assert_eq!(list(folded.classes().clone()), (10..18).collect::<Vec<_>>());
    }
}
