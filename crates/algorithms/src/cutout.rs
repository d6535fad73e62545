//! CutOut (DeVries and Taylor, 2017, "Improved Regularization of Convolutional Neural Networks
//! with Cutout"): set `num_holes` square regions of each image to zero. Each hole has side
//! `length` (a fraction of the shorter image side when below 1, else pixels), a centre drawn
//! uniformly per image, and is clipped at the edges.
//!
//! Hyperparameters: `num_holes` (default 1), `length` (default 0.5, Composer's default).
//! A regulariser: helps on longer runs, costs almost nothing.
//!
//! Hook: `AFTER_DATALOADER`, on the whole batch (one mask tensor, one multiply on the device).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use flashover_core::rng::Rng;

use crate::error::{AlgorithmError, Result};
use crate::image::{ImageAlgorithm, ImageTransform};

/// Side of a hole in pixels for an `h x w` image.
pub fn hole_side(length: f64, h: usize, w: usize) -> usize {
    if length < 1.0 {
        (length * h.min(w) as f64).round() as usize
    } else {
        length as usize
    }
}

/// A `[n, 1, h, w]` mask, 0 inside each image's holes and 1 elsewhere; hole centres are drawn
/// from `rng`.
pub fn cutout_mask<B: Backend>(
    rng: &mut Rng,
    n: usize,
    h: usize,
    w: usize,
    num_holes: usize,
    side: usize,
    device: &B::Device,
) -> Tensor<B, 4> {
    let mut m = vec![1f32; n * h * w];
    for img in m.chunks_exact_mut(h * w) {
        for _ in 0..num_holes {
            let cy = rng.below(h as u64) as i64;
            let cx = rng.below(w as u64) as i64;
            let half = side as i64 / 2;
            let y0 = (cy - half).clamp(0, h as i64) as usize;
            let y1 = (cy - half + side as i64).clamp(0, h as i64) as usize;
            let x0 = (cx - half).clamp(0, w as i64) as usize;
            let x1 = (cx - half + side as i64).clamp(0, w as i64) as usize;
            for y in y0..y1 {
                img[y * w + x0..y * w + x1].fill(0.0);
            }
        }
    }
    Tensor::from_data(TensorData::new(m, [n, 1, h, w]), device)
}

/// Applies CutOut to `images` `[n, c, h, w]` (the functional form).
pub fn cutout<B: Backend>(
    images: Tensor<B, 4>,
    rng: &mut Rng,
    num_holes: usize,
    length: f64,
) -> Tensor<B, 4> {
    let [n, _, h, w] = images.dims();
    let mask = cutout_mask::<B>(
        rng,
        n,
        h,
        w,
        num_holes,
        hole_side(length, h, w),
        &images.device(),
    );
    images * mask
}

/// CutOut's settings, the transform behind [`CutOut`].
#[derive(Debug, Clone)]
pub struct CutOutTransform {
    num_holes: usize,
    length: f64,
}

/// The CutOut algorithm; see the module docs.
pub type CutOut = ImageAlgorithm<CutOutTransform>;

/// The most holes per image: each hole costs a pass over the batch, and beyond a few dozen
/// holes (the paper uses one) an image is simply erased.
pub const MAX_HOLES: usize = 64;

impl CutOut {
    /// `num_holes` (1 to [`MAX_HOLES`]) holes of side `length` (> 0; below 1 a fraction of the
    /// shorter side).
    pub fn new(num_holes: usize, length: f64) -> Result<Self> {
        if num_holes == 0 || num_holes > MAX_HOLES {
            return Err(AlgorithmError::param(
                "cutout",
                "num_holes",
                num_holes,
                format!("an integer from 1 to {MAX_HOLES}"),
            ));
        }
        if !(length.is_finite() && length > 0.0) {
            return Err(AlgorithmError::param(
                "cutout",
                "length",
                length,
                "a fraction in (0, 1) of the image side, or a side >= 1 in pixels",
            ));
        }
        Ok(ImageAlgorithm(CutOutTransform { num_holes, length }))
    }
}

impl ImageTransform for CutOutTransform {
    const NAME: &'static str = "cutout";

    fn transform<B: Backend>(&self, images: Tensor<B, 4>, rng: &mut Rng, _: f64) -> Tensor<B, 4> {
        cutout(images, rng, self.num_holes, self.length)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "cutout", params: ["num_holes", "length"]}
crate::spec::by_name! {image |p, _norm| CutOut::new(p.usize("num_holes", 1)?, p.f64("length", 0.5)?)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn holes_have_the_right_size_and_clip_at_edges() {
        assert_eq!(hole_side(0.5, 28, 28), 14);
        assert_eq!(hole_side(8.0, 28, 28), 8);
        let mut rng = Rng::new(4);
        let n = 2000;
        let m = cutout_mask::<Flex>(&mut rng, n, 28, 28, 1, 14, &Default::default());
        let v = m.into_data().to_vec::<f32>().unwrap();
        assert!(v.iter().all(|x| *x == 0.0 || *x == 1.0));
        let zeros: Vec<usize> = v
            .chunks_exact(784)
            .map(|c| c.iter().filter(|x| **x == 0.0).count())
            .collect();
        assert!(
            zeros.iter().all(|z| *z <= 196 && *z >= 49),
            "hole areas within [7x7, 14x14]"
        );
        // A centre is uniform over 28 rows; the hole spans rows [c-7, c+7) clipped, so its
        // expected height is mean over c of (min(c+7,28) - max(c-7,0)) = 11.75 (likewise width).
        let mean = zeros.iter().sum::<usize>() as f64 / n as f64;
        let h: f64 = (0..28i64)
            .map(|c| ((c + 7).min(28) - (c - 7).max(0)) as f64)
            .sum::<f64>()
            / 28.0;
        assert!(
            (mean - h * h).abs() < 3.0,
            "mean hole area {mean} vs {}",
            h * h
        );
    }

    #[test]
    fn same_seed_same_holes() {
        let d = Default::default();
        let x = Tensor::<Flex, 4>::ones([3, 1, 10, 10], &d);
        let a = cutout(x.clone(), &mut Rng::new(8), 2, 0.3).into_data();
        let b = cutout(x, &mut Rng::new(8), 2, 0.3).into_data();
        assert_eq!(a.as_bytes(), b.as_bytes());
    }
}
