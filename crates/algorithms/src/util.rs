//! Small pieces the algorithm modules share: the bound for image-classification batches,
//! tensors built from host values, and the per-batch call counter that keeps random draws
//! distinct across microbatches.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use flashover_core::model::{ClassTargets, ImageBatch, Logits, SelectSamples};
use flashover_core::rng::Rng;
use flashover_core::setup::Setup;
use flashover_core::state::State;

/// Batches of images with class targets whose samples can be selected: what the mixing and
/// sample-selection methods need.
pub trait ImageClassBatch<B: Backend>: ImageBatch<B> + ClassTargets<B> + SelectSamples<B> {}
impl<B: Backend, T: ImageBatch<B> + ClassTargets<B> + SelectSamples<B>> ImageClassBatch<B> for T {}

/// An integer tensor from host indices.
pub(crate) fn index_tensor<B: Backend>(indices: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let v: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(v, [indices.len()]), device)
}

/// A float tensor of shape `[n, 1, 1, 1]` from per-sample host values (for broadcasting over
/// images).
pub(crate) fn per_sample<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 4> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [values.len(), 1, 1, 1]),
        device,
    )
}

/// A random permutation of `0..n`.
pub(crate) fn permutation(rng: &mut Rng, n: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut p);
    p
}

/// Checks a latent width given as a fraction in `(0, 1)` or a whole count `>= 1` (the
/// convention of SqueezeExcite's and Factorize's widths).
pub(crate) fn check_latent(
    algorithm: &'static str,
    name: &'static str,
    value: f64,
) -> crate::error::Result<()> {
    let fraction = value > 0.0 && value < 1.0;
    let count = value >= 1.0 && value.is_finite() && value.fract() == 0.0;
    if fraction || count {
        Ok(())
    } else {
        Err(crate::error::AlgorithmError::param(
            algorithm,
            name,
            value,
            "a fraction in (0, 1) or a whole number >= 1",
        ))
    }
}

/// Fraction of the run done at the current batch.
pub(crate) fn fraction<S: Setup>(state: &State<S>) -> f64 {
    state.progress().fraction(state.timestamp())
}

/// Counts an algorithm's calls within one batch, so that each microbatch draws from its own
/// random stream (`name/0`, `name/1`, ...). Reset at every batch, and at every attempt at a
/// batch (automatic microbatching retries a batch that ran out of memory in smaller
/// microbatches, which must draw what a run started at that size draws); nothing to save.
#[derive(Debug, Default, Clone)]
pub(crate) struct CallCounter {
    batch: Option<(u64, u64, u32)>,
    calls: u64,
}

impl CallCounter {
    /// The stream name for the next call in attempt `attempt` at the batch
    /// `(epoch, batch_in_epoch)`.
    pub(crate) fn next(
        &mut self,
        name: &str,
        epoch: u64,
        batch_in_epoch: u64,
        attempt: u32,
    ) -> String {
        let key = (epoch, batch_in_epoch, attempt);
        if self.batch != Some(key) {
            self.batch = Some(key);
            self.calls = 0;
        }
        let s = format!("{name}/{}", self.calls);
        self.calls += 1;
        s
    }
}

/// The inner (gradient-free) images of a batch: data methods work there, then wrap the result
/// back, so that no autodiff graph is built for augmentation.
pub(crate) fn inner_images<B: AutodiffBackend, T: ImageBatch<B>>(
    batch: &T,
) -> Tensor<B::InnerBackend, 4> {
    batch.images().clone().inner()
}

/// Puts gradient-free images back into a batch.
pub(crate) fn set_inner_images<B: AutodiffBackend, T: ImageBatch<B>>(
    batch: &mut T,
    images: Tensor<B::InnerBackend, 4>,
) {
    batch.set_images(Tensor::from_inner(images));
}

/// The batch's targets as distributions over the classes `out` scores (the soft targets an
/// earlier rewriter set, or the checked one-hot classes): what a target rewriter transforms.
pub(crate) fn target_distribution<B: Backend, T: ClassTargets<B>>(
    batch: &T,
    out: &impl Logits<B>,
) -> flashover_core::Result<Tensor<B, 2>> {
    batch.target_distribution(out.logits().dims()[1])
}

/// What a target rewriter (label smoothing, MixUp, CutMix) replaced at `BEFORE_LOSS`, to put
/// back at `AFTER_LOSS`: the one save-and-restore the rewriters share, so that each leaves the
/// batch's targets as it found them.
#[derive(Debug)]
pub(crate) struct SavedTargets<B: Backend>(Option<Option<Tensor<B, 2>>>);

impl<B: Backend> Default for SavedTargets<B> {
    fn default() -> Self {
        SavedTargets(None)
    }
}

impl<B: Backend> SavedTargets<B> {
    /// Sets the batch's soft targets to `targets`, keeping the ones it had.
    pub(crate) fn replace<T: ClassTargets<B>>(&mut self, batch: &mut T, targets: Tensor<B, 2>) {
        self.0 = Some(batch.soft_targets().cloned());
        batch.set_soft_targets(Some(targets));
    }

    /// Puts back what [`SavedTargets::replace`] took, if it took anything; first checks that
    /// the loss read the targets `algorithm` set (where the batch type tracks reads), so
    /// that a loss on the class indices is an error at the first batch, not a run that
    /// silently trains without the algorithm.
    pub(crate) fn restore<T: ClassTargets<B>>(
        &mut self,
        batch: &mut T,
        algorithm: &'static str,
    ) -> crate::error::Result<()> {
        if let Some(previous) = self.0.take() {
            let read = batch.soft_targets_read();
            let had_previous = previous.is_some();
            batch.set_soft_targets(previous);
            if read == Some(false) {
                return Err(crate::error::AlgorithmError::SoftTargetsIgnored { algorithm });
            }
            // The targets put back (an earlier rewriter's) were folded into the ones the loss
            // read: they count as read too, for that rewriter's own check.
            if had_previous {
                let _ = batch.soft_targets();
            }
        }
        Ok(())
    }
}
