//! AugMix (Hendrycks et al., 2020, "AugMix: A Simple Data Processing Method to Improve
//! Robustness and Uncertainty"): mix `width` augmentation chains of random depth with
//! Dirichlet weights, then mix the result with the original image: `m * x + (1 - m) *
//! sum_k w_k chain_k(x)`, with `w ~ Dirichlet(alpha)` and `m ~ Beta(alpha, alpha)` per image.
//! Here batched on the device (see [`crate::augment`]); the paper's Jensen-Shannon consistency
//! loss is not included (Composer leaves it out too).
//!
//! Hyperparameters: `severity` 3, `depth` -1 (random 1 to 3 per chain and image), `width` 3,
//! `alpha` 1.0, `augmentation_set` all (Composer's defaults). Improves robustness to
//! corruptions; for clean accuracy on short runs it is roughly neutral at a small cost.
//!
//! Hook: `AFTER_DATALOADER`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use flashover_core::rng::Rng;

use crate::augment::{apply_layer, AugOp, AugmentationSet, Normalization, OpDraw};
use crate::error::{check_range, AlgorithmError, Result};
use crate::image::{ImageAlgorithm, ImageTransform};
use crate::util::per_sample;

/// AugMix's settings.
#[derive(Debug, Clone)]
pub struct AugMixConfig {
    /// Strength of each primitive, 0 to 10.
    pub severity: f32,
    /// Primitives per chain; -1 draws 1 to 3 per chain and image.
    pub depth: i64,
    /// Number of chains mixed.
    pub width: usize,
    /// Concentration of the Dirichlet and Beta draws.
    pub alpha: f64,
    /// Which primitives to draw from.
    pub set: AugmentationSet,
}

impl Default for AugMixConfig {
    fn default() -> Self {
        AugMixConfig {
            severity: 3.0,
            depth: -1,
            width: 3,
            alpha: 1.0,
            set: AugmentationSet::All,
        }
    }
}

/// Applies AugMix to normalised `images` (the functional form).
pub fn augmix<B: Backend>(
    images: Tensor<B, 4>,
    rng: &mut Rng,
    cfg: &AugMixConfig,
    norm: &Normalization,
) -> Tensor<B, 4> {
    let n = images.dims()[0];
    let device = images.device();
    let x = norm.to_unit(images);
    let weights: Vec<Vec<f64>> = (0..n)
        .map(|_| rng.dirichlet(cfg.alpha, cfg.width))
        .collect();
    let m: Vec<f32> = (0..n)
        .map(|_| rng.beta(cfg.alpha, cfg.alpha) as f32)
        .collect();
    let mut mixed = x.zeros_like();
    for k in 0..cfg.width {
        let depths: Vec<usize> = (0..n)
            .map(|_| {
                if cfg.depth > 0 {
                    cfg.depth as usize
                } else {
                    1 + rng.below(3) as usize
                }
            })
            .collect();
        let max_depth = depths.iter().copied().max().unwrap_or(0);
        let mut chain = x.clone();
        for layer in 0..max_depth {
            let draws: Vec<OpDraw> = depths
                .iter()
                .map(|&d| {
                    let draw = OpDraw::draw(rng, cfg.set.ops(), cfg.severity);
                    if layer < d {
                        draw
                    } else {
                        OpDraw {
                            op: AugOp::Identity,
                            ..draw
                        }
                    }
                })
                .collect();
            chain = apply_layer(chain, &draws);
        }
        let w: Vec<f32> = weights.iter().map(|w| w[k] as f32).collect();
        mixed = mixed + chain * per_sample::<B>(&w, &device);
    }
    let m = per_sample::<B>(&m, &device);
    let out = x * m.clone() + mixed * (m.neg() + 1.0);
    norm.from_unit(out)
}

/// AugMix's settings, the transform behind [`AugMix`].
#[derive(Debug, Clone)]
pub struct AugMixTransform {
    cfg: AugMixConfig,
    norm: Normalization,
}

/// The AugMix algorithm; see the module docs.
pub type AugMix = ImageAlgorithm<AugMixTransform>;

/// The most chains (`width`) and augmentations per chain (`depth`) AugMix accepts (the paper
/// uses 3 chains of 1 to 3): each costs a pass over the image.
pub const MAX_CHAIN: usize = 16;

impl AugMix {
    /// AugMix with `cfg`, for images normalised by `norm`.
    pub fn new(cfg: AugMixConfig, norm: Normalization) -> Result<Self> {
        check_range("augmix", "severity", cfg.severity as f64, 0.0, 10.0)?;
        if cfg.depth == 0 || cfg.depth < -1 || cfg.depth > MAX_CHAIN as i64 {
            return Err(AlgorithmError::param(
                "augmix",
                "depth",
                cfg.depth,
                format!("-1 (random 1 to 3) or an integer from 1 to {MAX_CHAIN}"),
            ));
        }
        if cfg.width == 0 || cfg.width > MAX_CHAIN {
            return Err(AlgorithmError::param(
                "augmix",
                "width",
                cfg.width,
                format!("an integer from 1 to {MAX_CHAIN}"),
            ));
        }
        if !(cfg.alpha.is_finite() && cfg.alpha > 0.0) {
            return Err(AlgorithmError::param(
                "augmix",
                "alpha",
                cfg.alpha,
                "a finite number > 0",
            ));
        }
        Ok(ImageAlgorithm(AugMixTransform { cfg, norm }))
    }
}

impl ImageTransform for AugMixTransform {
    const NAME: &'static str = "augmix";

    fn transform<B: Backend>(&self, images: Tensor<B, 4>, rng: &mut Rng, _: f64) -> Tensor<B, 4> {
        augmix(images, rng, &self.cfg, &self.norm)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "augmix",
    params: ["severity", "depth", "width", "alpha", "augmentation_set"],
}
crate::spec::by_name! {image |p, norm| AugMix::new(
    AugMixConfig {
        severity: p.f64("severity", 3.0)? as f32,
        depth: p.parse("depth", -1i64, "-1 or an integer >= 1")?,
        width: p.usize("width", 3)?,
        alpha: p.f64("alpha", 1.0)?,
        set: crate::augment::AugmentationSet::parse(p.str("augmentation_set", "all"), "augmix")?,
    },
    norm.clone(),
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    fn images() -> Tensor<Flex, 4> {
        let v: Vec<f32> = (0..6 * 16 * 16)
            .map(|i| ((i * 13) % 97) as f32 / 97.0)
            .collect();
        Tensor::from_data(TensorData::new(v, [6, 1, 16, 16]), &Default::default())
    }

    #[test]
    fn output_is_a_convex_mix_in_range_and_seeded() {
        let norm = Normalization::identity();
        let cfg = AugMixConfig::default();
        let a = augmix(images(), &mut Rng::new(1), &cfg, &norm);
        assert_eq!(a.dims(), [6, 1, 16, 16]);
        let v = a.clone().into_data().to_vec::<f32>().unwrap();
        // A convex combination of images in [0, 1] stays in [0, 1].
        assert!(v.iter().all(|p| (-1e-5..=1.0 + 1e-5).contains(p)));
        assert_eq!(
            a.into_data().as_bytes(),
            augmix(images(), &mut Rng::new(1), &cfg, &norm)
                .into_data()
                .as_bytes()
        );
    }

    #[test]
    fn bad_settings_name_the_value() {
        let n = Normalization::identity();
        let e = AugMix::new(
            AugMixConfig {
                depth: -3,
                ..Default::default()
            },
            n.clone(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("depth") && e.contains("-3"), "{e}");
        assert!(AugMix::new(
            AugMixConfig {
                width: 0,
                ..Default::default()
            },
            n
        )
        .is_err());
    }
}
