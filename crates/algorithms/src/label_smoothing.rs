//! Label smoothing (Szegedy et al., 2016, "Rethinking the Inception Architecture", §7):
//! train against `(1 - alpha) * y + alpha / K` instead of the one-hot `y`, which keeps the
//! logits from growing without bound and usually improves accuracy a little.
//!
//! Hyperparameter: `smoothing` (alpha), default 0.1 (Composer's recipes use 0.08-0.1). Helps
//! most on longer runs and large class counts; on its own it does not speed training up, it
//! lets a shorter schedule reach the same accuracy.
//!
//! Hooks: `BEFORE_LOSS` replaces the targets by smoothed distributions (smoothing whatever
//! distribution is there, so after MixUp it smooths the mixed targets: the two commute),
//! `AFTER_LOSS` puts the previous targets back.

use std::marker::PhantomData;

use burn::optim::Optimizer;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::{ClassTargets, Logits, TrainModel};
use flashover_core::state::State;

use crate::error::{check_range, Result};

/// `(1 - smoothing) * targets + smoothing / K` for distributions `targets` `[batch, K]`.
pub fn smooth_labels<B: Backend>(targets: Tensor<B, 2>, smoothing: f64) -> Tensor<B, 2> {
    let k = targets.dims()[1];
    targets
        .mul_scalar(1.0 - smoothing)
        .add_scalar(smoothing / k as f64)
}

/// The label-smoothing algorithm; see the module docs.
pub struct LabelSmoothing<B: Backend> {
    smoothing: f64,
    saved: Option<Option<Tensor<B, 2>>>,
    _b: PhantomData<B>,
}

impl<B: Backend> LabelSmoothing<B> {
    /// Smoothing `alpha` in `[0, 1)`.
    pub fn new(smoothing: f64) -> Result<Self> {
        check_range("label_smoothing", "smoothing", smoothing, 0.0, 0.999_999)?;
        Ok(LabelSmoothing {
            smoothing,
            saved: None,
            _b: PhantomData,
        })
    }

    /// The smoothing factor.
    pub fn smoothing(&self) -> f64 {
        self.smoothing
    }
}

impl<B, M, O> Algorithm<B, M, O> for LabelSmoothing<B>
where
    B: AutodiffBackend,
    M: TrainModel<B, Batch: ClassTargets<B>, Output: Logits<B>>,
    O: Optimizer<M, B>,
{
    fn name(&self) -> &str {
        "label_smoothing"
    }

    fn matches(&self, event: Event, _state: &State<B, M, O>) -> bool {
        matches!(event, Event::BeforeLoss | Event::AfterLoss)
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<B, M, O>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let (Some(batch), Some(out)) = (state.batch.as_mut(), state.outputs.as_ref()) else {
            return Ok(());
        };
        if event == Event::BeforeLoss {
            let k = out.logits().dims()[1];
            let dist = batch.target_distribution(k);
            self.saved = Some(batch.soft_targets().cloned());
            batch.set_soft_targets(Some(smooth_labels(dist, self.smoothing)));
        } else if let Some(prev) = self.saved.take() {
            batch.set_soft_targets(prev);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[test]
    fn smoothed_targets_match_the_formula() {
        // One-hot class 1 of 4 with alpha 0.1: 0.1/4 = 0.025 off target, 0.9 + 0.025 on it.
        let y = Tensor::<Flex, 2>::from_data(
            TensorData::new(vec![0.0f32, 1.0, 0.0, 0.0], [1, 4]),
            &Default::default(),
        );
        let s = smooth_labels(y, 0.1).into_data().to_vec::<f32>().unwrap();
        let expected = [0.025, 0.925, 0.025, 0.025];
        for (a, e) in s.iter().zip(expected) {
            assert!((a - e).abs() < 1e-7, "{s:?}");
        }
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn out_of_range_smoothing_is_refused_with_its_value() {
        let e = LabelSmoothing::<Flex>::new(1.5).err().unwrap().to_string();
        assert!(e.contains("1.5") && e.contains("smoothing"), "{e}");
        assert!(LabelSmoothing::<Flex>::new(f64::NAN).is_err());
    }
}
