//! One [`Algorithm`] for every per-batch image method (CutOut, ColOut, progressive resizing,
//! RandAugment, AugMix): each is an [`ImageTransform`] (a function of the gradient-free images,
//! the batch's random stream and the fraction of training done), and [`ImageAlgorithm`] runs
//! it at `AFTER_DATALOADER` for any model trained on image batches. The algorithms' public
//! names (`CutOut`, `ColOut`, ...) are this wrapper around their transform.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::ImageBatch;
use flashover_core::rng::Rng;
use flashover_core::setup::{BatchOf, Setup};
use flashover_core::state::State;

use crate::util::{fraction, inner_images, set_inner_images};

/// A transform of a batch of images `[n, c, h, w]`, applied once per batch.
pub trait ImageTransform: Send {
    /// The algorithm's name, also the name of its random stream.
    const NAME: &'static str;

    /// Whether the transform changes anything at `fraction` of training (default: always).
    fn active(&self, fraction: f64) -> bool {
        let _ = fraction;
        true
    }

    /// The transformed images; `rng` is the batch's stream for [`Self::NAME`].
    fn transform<B: Backend>(
        &self,
        images: Tensor<B, 4>,
        rng: &mut Rng,
        fraction: f64,
    ) -> Tensor<B, 4>;
}

/// Runs an [`ImageTransform`] on every training batch at `AFTER_DATALOADER`, on the
/// gradient-free images (no autodiff graph is recorded for augmentation).
#[derive(Debug, Clone)]
pub struct ImageAlgorithm<T>(pub(crate) T);

impl<T: ImageTransform> ImageAlgorithm<T> {
    /// The transform this algorithm runs.
    pub fn transform(&self) -> &T {
        &self.0
    }
}

impl<S: Setup, T: ImageTransform> Algorithm<S> for ImageAlgorithm<T>
where
    BatchOf<S>: ImageBatch<S::Backend>,
{
    fn name(&self) -> &str {
        T::NAME
    }

    fn matches(&self, event: Event, state: &State<S>) -> bool {
        event == Event::AfterDataloader && self.0.active(fraction(state))
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let f = fraction(state);
        let mut rng = state.rng(T::NAME);
        if let Some(batch) = state.batch_mut()? {
            let x = inner_images(batch);
            set_inner_images(batch, self.0.transform(x, &mut rng, f));
        }
        Ok(())
    }
}
