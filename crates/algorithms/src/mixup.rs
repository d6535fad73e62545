//! MixUp (Zhang et al., 2018, "mixup: Beyond Empirical Risk Minimization"): train on convex
//! combinations of pairs of samples and of their targets. Composer's form: the mixing
//! coefficient is `min(z, 1 - z)` with `z ~ Beta(alpha, alpha)`, so the original sample
//! always has the larger share, and the partner is the sample at a random permutation.
//!
//! Hyperparameters: `alpha` (default 0.2), `interpolate_loss` (default false: mix the targets;
//! true: mix the two losses instead, which is equivalent for cross-entropy but works for any
//! loss). Helps accuracy on long runs; usually hurts on very short ones.
//!
//! Hooks: `BEFORE_FORWARD` mixes the (micro)batch's images; `BEFORE_LOSS` replaces the targets
//! by the mixed distributions (or, with `interpolate_loss`, `AFTER_LOSS` mixes the losses);
//! `AFTER_LOSS` restores the previous targets.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::{ClassTargets, Logits, TrainModel};
use flashover_core::rng::Rng;
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::state::State;

use crate::error::{AlgorithmError, Result};
use crate::util::{
    index_tensor, inner_images, permutation, set_inner_images, target_distribution, CallCounter,
    ImageClassBatch, SavedTargets,
};

/// Composer's MixUp coefficient: `min(z, 1 - z)`, `z ~ Beta(alpha, alpha)`, in `[0, 0.5]`.
pub fn mixing_coefficient(rng: &mut Rng, alpha: f64) -> f64 {
    let z = rng.beta(alpha, alpha);
    z.min(1.0 - z)
}

/// `(1 - lambda) * x + lambda * x[perm]` along the batch dimension (works for images,
/// target distributions, any rank).
pub fn mix<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    perm: Tensor<B, 1, Int>,
    lambda: f64,
) -> Tensor<B, D> {
    let partner = x.clone().select(0, perm);
    x.mul_scalar(1.0 - lambda) + partner.mul_scalar(lambda)
}

/// Mixes a batch's images and targets with coefficient `lambda` and partner permutation
/// `perm` (the functional form of the whole method); `num_classes` sizes the targets, and a
/// class index outside `0..num_classes` is an error naming it.
pub fn mixup_batch<B: Backend, T: ImageClassBatch<B>>(
    mut batch: T,
    num_classes: usize,
    lambda: f64,
    perm: &[usize],
) -> flashover_core::Result<T> {
    let device = batch.images().device();
    let p = index_tensor::<B>(perm, &device);
    let images = mix(batch.images().clone(), p.clone(), lambda);
    let targets = mix(batch.target_distribution(num_classes)?, p, lambda);
    batch.set_images(images);
    batch.set_soft_targets(Some(targets));
    Ok(batch)
}

/// The MixUp algorithm; see the module docs.
pub struct MixUp<B: Backend> {
    alpha: f64,
    targets: PartnerTargets<B>,
}

impl<B: Backend> MixUp<B> {
    /// MixUp with `alpha > 0`.
    pub fn new(alpha: f64) -> Result<Self> {
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(AlgorithmError::param(
                "mixup",
                "alpha",
                alpha,
                "a finite number > 0",
            ));
        }
        Ok(MixUp {
            alpha,
            targets: PartnerTargets::new("mixup"),
        })
    }

    /// Mix the losses instead of the targets.
    pub fn with_interpolate_loss(mut self, on: bool) -> Self {
        self.targets.interpolate_loss = on;
        self
    }
}

/// What MixUp and CutMix share: the events they act at, the per-call random stream, and the
/// target side. At `BEFORE_FORWARD` the algorithm's own mixing (`mix_images`) draws from the
/// microbatch's stream and mixes the images with partner weight `w` and permutation `perm`;
/// then either the targets become `(1 - w) * y + w * y[perm]` at `BEFORE_LOSS` (restored at
/// `AFTER_LOSS`), or, with `interpolate_loss`, the loss becomes
/// `(1 - w) * loss + w * loss(y[perm])` at `AFTER_LOSS`.
pub(crate) struct PartnerTargets<B: Backend> {
    /// The algorithm's name, for errors and its random stream.
    algorithm: &'static str,
    pub(crate) interpolate_loss: bool,
    current: Option<(f64, Vec<usize>)>,
    saved: SavedTargets<B>,
    calls: CallCounter,
}

impl<B: Backend> PartnerTargets<B> {
    pub(crate) fn new(algorithm: &'static str) -> Self {
        PartnerTargets {
            algorithm,
            interpolate_loss: false,
            current: None,
            saved: SavedTargets::default(),
            calls: CallCounter::default(),
        }
    }

    /// The events a pair-mixing algorithm acts at.
    pub(crate) fn matches(event: Event) -> bool {
        matches!(
            event,
            Event::BeforeForward | Event::BeforeLoss | Event::AfterLoss
        )
    }
}

impl<B: AutodiffBackend> PartnerTargets<B> {
    /// Runs the algorithm at `event`: at `BEFORE_FORWARD`, `mix_images` gets the microbatch's
    /// random stream and its gradient-free images, and returns the mixed images, the partner
    /// weight and the permutation; the target side at `BEFORE_LOSS` and `AFTER_LOSS`.
    pub(crate) fn apply<S>(
        &mut self,
        event: Event,
        state: &mut State<S>,
        mix_images: impl FnOnce(
            &mut Rng,
            Tensor<B::InnerBackend, 4>,
        ) -> Result<(Tensor<B::InnerBackend, 4>, f64, Vec<usize>)>,
    ) -> flashover_core::Result<()>
    where
        S: Setup<Backend = B>,
        BatchOf<S>: ImageClassBatch<B>,
        OutputOf<S>: Logits<B>,
    {
        match event {
            Event::BeforeForward => {
                let ts = state.timestamp();
                let stream = self.calls.next(
                    self.algorithm,
                    ts.epoch,
                    ts.batch_in_epoch,
                    state.batch_attempt(),
                );
                let mut rng = state.rng(&stream);
                let Some(batch) = state.batch_mut()? else {
                    return Ok(());
                };
                let (mixed, weight, perm) = mix_images(&mut rng, inner_images(batch))?;
                set_inner_images(batch, mixed);
                self.current = Some((weight, perm));
            }
            Event::BeforeLoss if !self.interpolate_loss => {
                let (Some(batch), Some(out)) = state.batch_and_outputs_mut()? else {
                    return Ok(());
                };
                let Some((w, perm)) = self.current.as_ref() else {
                    return Ok(());
                };
                let dist = target_distribution(batch, out)?;
                let p = index_tensor(perm, &dist.device());
                self.saved.replace(batch, mix(dist, p, *w));
            }
            Event::AfterLoss => {
                if self.interpolate_loss {
                    let (Some((w, perm)), Some(batch), Some(out), Some(loss)) = (
                        self.current.as_ref(),
                        state.batch(),
                        state.outputs(),
                        state.loss().cloned(),
                    ) else {
                        return Ok(());
                    };
                    let dist = target_distribution(batch, out)?;
                    let p = index_tensor(perm, &dist.device());
                    let mut partner = batch.clone();
                    partner.set_soft_targets(Some(dist.select(0, p)));
                    let other = state.model().loss(out, &partner);
                    if partner.soft_targets_read() == Some(false) {
                        return Err(AlgorithmError::SoftTargetsIgnored {
                            algorithm: self.algorithm,
                        }
                        .into());
                    }
                    let mixed = loss.mul_scalar(1.0 - w) + other.mul_scalar(*w);
                    if let Some(loss) = state.loss_mut()? {
                        *loss = mixed;
                    }
                } else if let Some(batch) = state.batch_mut()? {
                    self.saved.restore(batch, self.algorithm)?;
                }
                self.current = None;
            }
            _ => {}
        }
        Ok(())
    }
}

impl<S: Setup> Algorithm<S> for MixUp<S::Backend>
where
    BatchOf<S>: ImageClassBatch<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
{
    fn name(&self) -> &str {
        "mixup"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        PartnerTargets::<S::Backend>::matches(event)
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let alpha = self.alpha;
        self.targets.apply(event, state, |rng, x| {
            let lambda = mixing_coefficient(rng, alpha);
            let perm = permutation(rng, x.dims()[0]);
            let p = index_tensor(&perm, &x.device());
            Ok((mix(x, p, lambda), lambda, perm))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "mixup", params: ["alpha", "interpolate_loss"]}
crate::spec::by_name! {image |p, _norm| MixUp::new(p.f64("alpha", 0.2)?)?
.with_interpolate_loss(p.bool("interpolate_loss", false)?)}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use flashover_core::model::{ClassTargets, ClassificationBatch, ImageBatch};

    type B = Flex;

    #[test]
    fn mixing_a_known_batch_matches_the_formula() {
        let d = Default::default();
        // Two 1x1x2 images [1, 2] and [3, 5], classes 0 and 1 of 2; partner = swap; lambda 0.25.
        let x = Tensor::<B, 4>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 5.0], [2, 1, 1, 2]),
            &d,
        );
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, 1], [2]), &d);
        let b = mixup_batch(ClassificationBatch::new(x, t), 2, 0.25, &[1, 0]).unwrap();
        let img = b.images().clone().into_data().to_vec::<f32>().unwrap();
        // 0.75 * [1, 2] + 0.25 * [3, 5] = [1.5, 2.75]; 0.75 * [3, 5] + 0.25 * [1, 2] = [2.5, 4.25].
        assert_eq!(img, vec![1.5, 2.75, 2.5, 4.25]);
        let y = b
            .soft_targets()
            .unwrap()
            .clone()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(y, vec![0.75, 0.25, 0.25, 0.75]);
    }

    #[test]
    fn coefficients_stay_below_one_half_with_the_published_mean() {
        // For alpha = 1, z is uniform, so min(z, 1 - z) is uniform on [0, 0.5]: mean 0.25.
        let mut rng = Rng::new(5);
        let n = 100_000;
        let draws: Vec<f64> = (0..n).map(|_| mixing_coefficient(&mut rng, 1.0)).collect();
        assert!(draws.iter().all(|l| (0.0..=0.5).contains(l)));
        let mean = draws.iter().sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.003, "mean {mean}");
        // Same seed, same draws.
        let mut a = Rng::new(9);
        let mut b = Rng::new(9);
        assert_eq!(
            mixing_coefficient(&mut a, 0.2),
            mixing_coefficient(&mut b, 0.2)
        );
    }

    #[test]
    fn alpha_must_be_positive() {
        let e = MixUp::<B>::new(0.0).err().unwrap().to_string();
        assert!(e.contains("alpha") && e.contains("> 0"), "{e}");
    }
}
