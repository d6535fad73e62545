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
//!
//! Class indices must lie in `0..K`: a negative index is an error naming it (never wrapped to
//! the last class), and there is no ignore index. The functional forms take classification
//! logits `[N, K]` with targets `[N]` and token logits `[N, K, L]` with targets `[N, L]`.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::loss::{one_hot_classes, one_hot_sequence};
use flashover_core::model::{ClassTargets, Logits};
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::state::State;

use crate::error::{check_range, Result};
use crate::util::{target_distribution, SavedTargets};

/// `(1 - smoothing) * targets + smoothing / K` for distributions `targets` with their `K`
/// classes on axis 1: `[N, K]`, or `[N, K, L]` for sequences.
pub fn smooth_labels<B: Backend, const D: usize>(
    targets: Tensor<B, D>,
    smoothing: f64,
) -> Tensor<B, D> {
    let k = targets.dims()[1];
    targets
        .mul_scalar(1.0 - smoothing)
        .add_scalar(smoothing / k as f64)
}

/// Smoothed distributions `[N, C]` for class indices `targets` `[N]` scored by `logits`
/// `[N, C]` (Composer's `smooth_labels`); an index outside `0..C` is an error naming it.
pub fn smooth_class_labels<B: Backend>(
    logits: &Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    smoothing: f64,
) -> flashover_core::Result<Tensor<B, 2>> {
    Ok(smooth_labels(
        one_hot_classes(targets, logits.dims()[1])?,
        smoothing,
    ))
}

/// Smoothed distributions `[N, C, L]` for token targets `[N, L]` scored by logits
/// `[N, C, L]`; an index outside `0..C` is an error naming it.
pub fn smooth_sequence_labels<B: Backend>(
    logits: &Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    smoothing: f64,
) -> flashover_core::Result<Tensor<B, 3>> {
    Ok(smooth_labels(
        one_hot_sequence(targets, logits.dims()[1])?,
        smoothing,
    ))
}

/// The label-smoothing algorithm; see the module docs.
pub struct LabelSmoothing<B: Backend> {
    smoothing: f64,
    saved: SavedTargets<B>,
}

impl<B: Backend> LabelSmoothing<B> {
    /// Smoothing `alpha` in `[0, 1)`.
    pub fn new(smoothing: f64) -> Result<Self> {
        check_range("label_smoothing", "smoothing", smoothing, 0.0, 0.999_999)?;
        Ok(LabelSmoothing {
            smoothing,
            saved: SavedTargets::default(),
        })
    }

    /// The smoothing factor.
    pub fn smoothing(&self) -> f64 {
        self.smoothing
    }
}

impl<S: Setup> Algorithm<S> for LabelSmoothing<S::Backend>
where
    BatchOf<S>: ClassTargets<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
{
    fn name(&self) -> &str {
        "label_smoothing"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        matches!(event, Event::BeforeLoss | Event::AfterLoss)
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let (Some(batch), Some(out)) = state.batch_and_outputs_mut()? else {
            return Ok(());
        };
        if event == Event::BeforeLoss {
            let dist = target_distribution(batch, out)?;
            self.saved
                .replace(batch, smooth_labels(dist, self.smoothing));
        } else {
            self.saved.restore(batch, "label_smoothing")?;
        }
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "label_smoothing", params: ["smoothing"]}
crate::spec::by_name! {general |p| LabelSmoothing::new(p.f64("smoothing", 0.1)?)?}

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

    #[test]
    fn sequence_targets_are_smoothed_along_the_class_axis() {
        let d = Default::default();
        // N = 1, K = 4, L = 2: targets 1 and 3, alpha 0.2 -> 0.85 on target, 0.05 elsewhere.
        let logits = Tensor::<Flex, 3>::zeros([1, 4, 2], &d);
        let t = Tensor::<Flex, 2, Int>::from_data(TensorData::new(vec![1i64, 3], [1, 2]), &d);
        let s = smooth_sequence_labels(&logits, t, 0.2).unwrap();
        assert_eq!(s.dims(), [1, 4, 2]);
        let v = s.into_data().to_vec::<f32>().unwrap();
        // Layout [k][l]: position 0 has class 1, position 1 class 3.
        let want = [0.05, 0.05, 0.85, 0.05, 0.05, 0.05, 0.05, 0.85];
        for (a, e) in v.iter().zip(want) {
            assert!((a - e).abs() < 1e-6, "{v:?}");
        }
        let logits = Tensor::<Flex, 2>::zeros([2, 3], &d);
        let t = Tensor::<Flex, 1, Int>::from_data(TensorData::new(vec![0i64, -1], [2]), &d);
        let e = smooth_class_labels(&logits, t, 0.1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("-1") && e.contains("0..3"), "{e}");
    }
}
