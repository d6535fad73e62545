//! CutMix (Yun et al., 2019, "CutMix: Regularization Strategy to Train Strong Classifiers with
//! Localizable Features"): paste a box from a partner image (a random permutation of the batch)
//! into each image, and weight the targets by the areas: `lambda_adj * y + (1 - lambda_adj) *
//! y_partner`, where `lambda_adj = 1 - box_area / image_area` after clipping the box.
//!
//! The box follows the paper: `lambda ~ Beta(alpha, alpha)`, side ratio `sqrt(1 - lambda)`,
//! centre uniform over the image, clipped at the edges; one box per (micro)batch.
//! Hyperparameters: `alpha` (default 1.0), `interpolate_loss` (default false). Helps accuracy
//! on longer runs (it is in Composer's "hot" recipe).
//!
//! Hooks: as MixUp's (`BEFORE_FORWARD` images, `BEFORE_LOSS`/`AFTER_LOSS` targets or loss).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::Logits;
use flashover_core::rng::Rng;
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::state::State;

use crate::error::{AlgorithmError, Result};
use crate::mixup::PartnerTargets;
use crate::util::{index_tensor, permutation, ImageClassBatch};

/// A box `[y0, y1) x [x0, x1)` in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutBox {
    /// First row.
    pub y0: usize,
    /// One past the last row.
    pub y1: usize,
    /// First column.
    pub x0: usize,
    /// One past the last column.
    pub x1: usize,
}

impl CutBox {
    /// Pixels in the box.
    pub fn area(&self) -> usize {
        (self.y1 - self.y0) * (self.x1 - self.x0)
    }
}

/// The paper's box for coefficient `lambda` centred at `(cy, cx)` in an `h x w` image: sides
/// `h * sqrt(1 - lambda)` and `w * sqrt(1 - lambda)` (rounded down), clipped to the image.
pub fn cutmix_box(h: usize, w: usize, lambda: f64, cy: usize, cx: usize) -> CutBox {
    let ratio = (1.0 - lambda).clamp(0.0, 1.0).sqrt();
    let ch = (h as f64 * ratio) as i64;
    let cw = (w as f64 * ratio) as i64;
    let clip = |v: i64, hi: usize| v.clamp(0, hi as i64) as usize;
    CutBox {
        y0: clip(cy as i64 - ch / 2, h),
        y1: clip(cy as i64 + ch / 2, h),
        x0: clip(cx as i64 - cw / 2, w),
        x1: clip(cx as i64 + cw / 2, w),
    }
}

/// The target weight of the original image after pasting `b`: `1 - area / (h * w)`.
pub fn box_label_weight(b: &CutBox, h: usize, w: usize) -> f64 {
    1.0 - b.area() as f64 / (h * w) as f64
}

/// A `[1, 1, h, w]` mask that is 1 inside `b` and 0 elsewhere.
pub fn box_mask<B: Backend>(b: &CutBox, h: usize, w: usize, device: &B::Device) -> Tensor<B, 4> {
    let mut m = vec![0f32; h * w];
    for y in b.y0..b.y1 {
        m[y * w + b.x0..y * w + b.x1].fill(1.0);
    }
    Tensor::from_data(TensorData::new(m, [1, 1, h, w]), device)
}

/// Pastes box `b` of each partner image `images[perm]` into `images`.
pub fn paste_box<B: Backend>(
    images: Tensor<B, 4>,
    perm: Tensor<B, 1, Int>,
    b: &CutBox,
) -> Tensor<B, 4> {
    let [_, _, h, w] = images.dims();
    let mask = box_mask::<B>(b, h, w, &images.device());
    let partner = images.clone().select(0, perm);
    images.clone() + (partner - images) * mask
}

/// Draws a box for an `h x w` image: `lambda ~ Beta(alpha, alpha)`, centre uniform.
pub fn draw_box(rng: &mut Rng, alpha: f64, h: usize, w: usize) -> CutBox {
    let lambda = rng.beta(alpha, alpha);
    let cy = rng.below(h as u64) as usize;
    let cx = rng.below(w as u64) as usize;
    cutmix_box(h, w, lambda, cy, cx)
}

/// The CutMix algorithm; see the module docs.
pub struct CutMix<B: Backend> {
    alpha: f64,
    targets: PartnerTargets<B>,
}

impl<B: Backend> CutMix<B> {
    /// CutMix with `alpha > 0`.
    pub fn new(alpha: f64) -> Result<Self> {
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(AlgorithmError::param(
                "cutmix",
                "alpha",
                alpha,
                "a finite number > 0",
            ));
        }
        Ok(CutMix {
            alpha,
            targets: PartnerTargets::new("cutmix"),
        })
    }

    /// Mix the losses instead of the targets.
    pub fn with_interpolate_loss(mut self, on: bool) -> Self {
        self.targets.interpolate_loss = on;
        self
    }
}

impl<S: Setup> Algorithm<S> for CutMix<S::Backend>
where
    BatchOf<S>: ImageClassBatch<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
{
    fn name(&self) -> &str {
        "cutmix"
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
            let [n, _, h, w] = x.dims();
            let b = draw_box(rng, alpha, h, w);
            let perm = permutation(rng, n);
            let p = index_tensor(&perm, &x.device());
            Ok((paste_box(x, p, &b), 1.0 - box_label_weight(&b, h, w), perm))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "cutmix", params: ["alpha", "interpolate_loss"]}
crate::spec::by_name! {image |p, _norm| CutMix::new(p.f64("alpha", 1.0)?)?
.with_interpolate_loss(p.bool("interpolate_loss", false)?)}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn box_area_sets_the_label_weight() {
        // lambda 0.75 in a 28x28 image: ratio 0.5, a 14x14 box; centred at (14, 14) it fits,
        // so the original keeps 1 - 196/784 = 0.75 of the label.
        let b = cutmix_box(28, 28, 0.75, 14, 14);
        assert_eq!(
            b,
            CutBox {
                y0: 7,
                y1: 21,
                x0: 7,
                x1: 21
            }
        );
        assert!((box_label_weight(&b, 28, 28) - 0.75).abs() < 1e-12);
        // Centred at the corner, the box is clipped to 7x7: weight 1 - 49/784 = 0.9375.
        let c = cutmix_box(28, 28, 0.75, 0, 0);
        assert_eq!(c.area(), 49);
        assert!((box_label_weight(&c, 28, 28) - 0.9375).abs() < 1e-12);
    }

    #[test]
    fn pasting_copies_exactly_the_box_from_the_partner() {
        let d = Default::default();
        let a = Tensor::<Flex, 4>::zeros([1, 1, 4, 4], &d);
        let b = Tensor::<Flex, 4>::ones([1, 1, 4, 4], &d);
        let x = Tensor::cat(vec![a, b], 0);
        let bx = CutBox {
            y0: 1,
            y1: 3,
            x0: 0,
            x1: 2,
        };
        let out = paste_box(x, index_tensor::<Flex>(&[1, 0], &d), &bx);
        let v = out.into_data().to_vec::<f32>().unwrap();
        let first: f32 = v[..16].iter().sum();
        let second: f32 = v[16..].iter().sum();
        assert_eq!(first, 4.0, "four pixels of ones pasted into zeros");
        assert_eq!(second, 12.0, "four pixels of zeros pasted into ones");
        assert_eq!(v[4], 1.0); // row 1, column 0 comes from the partner
        assert_eq!(v[2], 0.0); // row 0 is outside the box
    }

    #[test]
    fn drawn_boxes_have_the_expected_mean_area() {
        // A box centred in the image is never clipped, so the original's label weight equals
        // lambda up to rounding of the sides; for alpha = 1, lambda is uniform: mean 0.5.
        let mut rng = Rng::new(1);
        let n = 20_000;
        let mean_w: f64 = (0..n)
            .map(|_| {
                let lambda = rng.beta(1.0, 1.0);
                box_label_weight(&cutmix_box(1000, 1000, lambda, 500, 500), 1000, 1000)
            })
            .sum::<f64>()
            / n as f64;
        assert!((mean_w - 0.5).abs() < 0.006, "mean weight {mean_w}");
        // Random centres clip boxes at the edges, which only shrinks them.
        let clipped: f64 = (0..n)
            .map(|_| box_label_weight(&draw_box(&mut rng, 1.0, 32, 32), 32, 32))
            .sum::<f64>()
            / n as f64;
        assert!(clipped > mean_w, "clipped {clipped} vs centred {mean_w}");
        let mut a = Rng::new(3);
        let mut b = Rng::new(3);
        assert_eq!(draw_box(&mut a, 1.0, 28, 28), draw_box(&mut b, 1.0, 28, 28));
    }
}
