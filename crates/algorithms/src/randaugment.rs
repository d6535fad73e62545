//! RandAugment (Cubuk et al., 2020, "RandAugment: Practical automated data augmentation with a
//! reduced search space"): apply `depth` primitives drawn uniformly from a set to each image,
//! each at a random strength up to `severity`. Here as batched tensor operations on the
//! training device, one draw per sample per layer (see [`crate::augment`]).
//!
//! Hyperparameters: `depth` 1, `severity` 9 (Composer's defaults), `augmentation_set` all,
//! and the images' normalisation (so the primitives see `[0, 1]` pixels). A regulariser for
//! longer runs; on short runs it usually costs accuracy.
//!
//! Hook: `AFTER_DATALOADER`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use flashover_core::rng::Rng;

use crate::augment::{apply_layer, AugmentationSet, Normalization, OpDraw};
use crate::error::{check_range, AlgorithmError, Result};
use crate::image::{ImageAlgorithm, ImageTransform};

/// Applies RandAugment to normalised `images` (the functional form).
pub fn randaugment<B: Backend>(
    images: Tensor<B, 4>,
    rng: &mut Rng,
    depth: usize,
    severity: f32,
    set: AugmentationSet,
    norm: &Normalization,
) -> Tensor<B, 4> {
    let n = images.dims()[0];
    let mut x = norm.to_unit(images);
    for _ in 0..depth {
        let draws: Vec<OpDraw> = (0..n)
            .map(|_| OpDraw::draw(rng, set.ops(), severity))
            .collect();
        x = apply_layer(x, &draws);
    }
    norm.from_unit(x)
}

/// RandAugment's settings, the transform behind [`RandAugment`].
#[derive(Debug, Clone)]
pub struct RandAugmentTransform {
    depth: usize,
    severity: f32,
    set: AugmentationSet,
    norm: Normalization,
}

/// The RandAugment algorithm; see the module docs.
pub type RandAugment = ImageAlgorithm<RandAugmentTransform>;

/// The most augmentations RandAugment chains per image (the paper uses 1 to 3): each one
/// costs a pass over the image, and a long chain leaves nothing of it.
pub const MAX_DEPTH: usize = 16;

impl RandAugment {
    /// `depth` (1 to [`MAX_DEPTH`]) layers at `severity` in `[0, 10]`.
    pub fn new(
        depth: usize,
        severity: f64,
        set: AugmentationSet,
        norm: Normalization,
    ) -> Result<Self> {
        if depth == 0 || depth > MAX_DEPTH {
            return Err(AlgorithmError::param(
                "randaugment",
                "depth",
                depth,
                format!("an integer from 1 to {MAX_DEPTH}"),
            ));
        }
        check_range("randaugment", "severity", severity, 0.0, 10.0)?;
        Ok(ImageAlgorithm(RandAugmentTransform {
            depth,
            severity: severity as f32,
            set,
            norm,
        }))
    }
}

impl ImageTransform for RandAugmentTransform {
    const NAME: &'static str = "randaugment";

    fn transform<B: Backend>(&self, images: Tensor<B, 4>, rng: &mut Rng, _: f64) -> Tensor<B, 4> {
        randaugment(images, rng, self.depth, self.severity, self.set, &self.norm)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "randaugment", params: ["depth", "severity", "augmentation_set"]}
crate::spec::by_name! {image |p, norm| RandAugment::new(
    p.usize("depth", 1)?,
    p.f64("severity", 9.0)?,
    crate::augment::AugmentationSet::parse(p.str("augmentation_set", "all"), "randaugment")?,
    norm.clone(),
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[test]
    fn keeps_shape_and_range_and_reproduces_with_the_seed() {
        let d = Default::default();
        let v: Vec<f32> = (0..8 * 28 * 28)
            .map(|i| ((i * 37) % 255) as f32 / 255.0)
            .collect();
        let norm = Normalization::new(0.1307, 0.3081).unwrap();
        let x = norm.from_unit(Tensor::<Flex, 4>::from_data(
            TensorData::new(v, [8, 1, 28, 28]),
            &d,
        ));
        let run = |seed| {
            randaugment(
                x.clone(),
                &mut Rng::new(seed),
                2,
                9.0,
                AugmentationSet::All,
                &norm,
            )
        };
        let a = run(3);
        assert_eq!(a.dims(), [8, 1, 28, 28]);
        let unit = norm.to_unit(a.clone()).into_data().to_vec::<f32>().unwrap();
        assert!(unit.iter().all(|p| (-1e-5..=1.0 + 1e-5).contains(p)));
        assert_eq!(
            a.clone().into_data().as_bytes(),
            run(3).into_data().as_bytes()
        );
        assert_ne!(a.into_data().as_bytes(), run(4).into_data().as_bytes());
    }

    #[test]
    fn draws_cover_the_set_uniformly() {
        let mut rng = Rng::new(0);
        let ops = AugmentationSet::All.ops();
        let mut counts = vec![0usize; ops.len()];
        let n = 60_000;
        for _ in 0..n {
            let d = OpDraw::draw(&mut rng, ops, 9.0);
            assert!((0.1..=9.0).contains(&d.level));
            counts[ops.iter().position(|o| *o == d.op).unwrap()] += 1;
        }
        let expect = n as f64 / ops.len() as f64;
        // Each count is binomial with sd sqrt(n p (1 - p)) ~ 69; allow 5 sd.
        assert!(
            counts.iter().all(|c| (*c as f64 - expect).abs() < 350.0),
            "{counts:?}"
        );
    }

    #[test]
    fn bad_settings_are_refused() {
        let n = Normalization::identity();
        assert!(RandAugment::new(0, 9.0, AugmentationSet::All, n.clone()).is_err());
        let e = RandAugment::new(1, 11.0, AugmentationSet::All, n)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("severity") && e.contains("11"), "{e}");
    }
}
