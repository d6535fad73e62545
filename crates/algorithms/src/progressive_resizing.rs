//! Progressive resizing (fast.ai's DAWNBench entry; Composer's method card): train on
//! downscaled images first and grow them to full size over training, so early epochs cost a
//! fraction of the compute. The schedule is Composer's: the scale stays at `initial_scale`
//! for the first `delay_fraction` of training, grows linearly, and is 1 for the last
//! `finetune_fraction`; sides are rounded to a multiple of `size_increment`.
//!
//! Hyperparameters: `initial_scale` 0.5, `delay_fraction` 0.5, `finetune_fraction` 0.2,
//! `size_increment` 4, `mode` resize (bilinear) or crop (a random crop, one per batch), and
//! for `resize` the sampling `grid`: `corner` (the default, kept from the first release:
//! output pixel `i` samples input position `i * (in - 1) / (out - 1)`, so the corner pixels
//! of both images coincide; PyTorch's `align_corners=True`) or `half_pixel` (output pixel `i`
//! samples `(i + 0.5) * in / out - 0.5`, clamped to the image: PyTorch's default
//! `align_corners=False` for bilinear resizing). Neither antialiases (as in PyTorch without
//! `antialias=True`).
//!
//! A deliberate difference from Composer: Composer 0.32's `resize` mode calls
//! `F.interpolate(X, scale_factor=s, mode="nearest")` (nearest neighbour, output pixel `i`
//! copies input pixel `floor(i / s)`), although its class docs say bilinear. Flashover
//! resizes bilinearly, as fast.ai's progressive resizing and those docs do; so a `resize` run
//! here is not pixel-identical to a Composer one with the same schedule (the schedule, the
//! sizes and the crop mode are the same).
//! Helps convolutional models whose head pools over space.
//!
//! Hook: `AFTER_DATALOADER`. The scale is a pure function of time, so resuming needs no state.

use burn::tensor::backend::Backend;
use burn::tensor::module::interpolate;
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use burn::tensor::Tensor;
use flashover_core::rng::Rng;

use crate::error::{check_range, AlgorithmError, Result};
use crate::image::{ImageAlgorithm, ImageTransform};

/// The sampling grid of bilinear resizing; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeGrid {
    /// Corner pixels coincide: `src = dst * (in - 1) / (out - 1)` (`align_corners=True`).
    CornerAligned,
    /// Pixel centres scale: `src = (dst + 0.5) * in / out - 0.5` (`align_corners=False`).
    HalfPixel,
}

impl ResizeGrid {
    /// Parses `corner` or `half_pixel`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "corner" => Ok(ResizeGrid::CornerAligned),
            "half_pixel" => Ok(ResizeGrid::HalfPixel),
            other => Err(AlgorithmError::param(
                "progressive_resizing",
                "grid",
                other,
                "corner or half_pixel",
            )),
        }
    }
}

/// How images are made smaller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeMode {
    /// Bilinear downscaling of the whole image.
    Resize,
    /// A random crop of the smaller size (the same window for the whole batch).
    Crop,
}

/// The scale at `fraction` of training (Composer's schedule; see the module docs).
pub fn scale_at(
    fraction: f64,
    initial_scale: f64,
    delay_fraction: f64,
    finetune_fraction: f64,
) -> f64 {
    let grow_end = 1.0 - finetune_fraction;
    if fraction < delay_fraction {
        initial_scale
    } else if fraction >= grow_end {
        1.0
    } else {
        let t = (fraction - delay_fraction) / (grow_end - delay_fraction);
        initial_scale + (1.0 - initial_scale) * t
    }
}

/// A side of `side` pixels at `scale`, rounded to a multiple of `increment` (at least one
/// increment, at most `side`).
pub fn scaled_side(side: usize, scale: f64, increment: usize) -> usize {
    let inc = increment.max(1);
    let s = ((side as f64 * scale / inc as f64).round() as usize) * inc;
    s.clamp(inc.min(side), side)
}

/// Resizes (bilinear, on `grid`) or crops `images` to `[h, w]` (the functional form).
pub fn resize_images<B: Backend>(
    images: Tensor<B, 4>,
    h: usize,
    w: usize,
    mode: ResizeMode,
    grid: ResizeGrid,
    rng: &mut Rng,
) -> Tensor<B, 4> {
    let [_, _, ih, iw] = images.dims();
    if (h, w) == (ih, iw) {
        return images;
    }
    match mode {
        ResizeMode::Resize => interpolate(
            images,
            [h, w],
            InterpolateOptions::new(InterpolateMode::Bilinear)
                .with_align_corners(grid == ResizeGrid::CornerAligned),
        ),
        ResizeMode::Crop => {
            let y = rng.below((ih - h + 1) as u64) as usize;
            let x = rng.below((iw - w + 1) as u64) as usize;
            images.narrow(2, y, h).narrow(3, x, w)
        }
    }
}

/// Progressive resizing's settings, the transform behind [`ProgressiveResizing`].
#[derive(Debug, Clone)]
pub struct ProgressiveResizingTransform {
    initial_scale: f64,
    delay_fraction: f64,
    finetune_fraction: f64,
    size_increment: usize,
    mode: ResizeMode,
    grid: ResizeGrid,
}

impl ProgressiveResizingTransform {
    /// The scale at `fraction` of training.
    pub fn scale(&self, fraction: f64) -> f64 {
        scale_at(
            fraction,
            self.initial_scale,
            self.delay_fraction,
            self.finetune_fraction,
        )
    }
}

/// The progressive-resizing algorithm; see the module docs.
pub type ProgressiveResizing = ImageAlgorithm<ProgressiveResizingTransform>;

impl ProgressiveResizing {
    /// Composer's defaults: scale 0.5, delay 0.5, finetune 0.2, increment 4, resize, on the
    /// corner-aligned grid.
    pub fn new() -> Self {
        ImageAlgorithm(ProgressiveResizingTransform {
            initial_scale: 0.5,
            delay_fraction: 0.5,
            finetune_fraction: 0.2,
            size_increment: 4,
            mode: ResizeMode::Resize,
            grid: ResizeGrid::CornerAligned,
        })
    }

    /// Uses `grid` for bilinear resizing.
    pub fn with_grid(mut self, grid: ResizeGrid) -> Self {
        self.0.grid = grid;
        self
    }

    /// Sets every hyperparameter, checking them together.
    pub fn with(
        mut self,
        initial_scale: f64,
        delay_fraction: f64,
        finetune_fraction: f64,
        size_increment: usize,
        mode: ResizeMode,
    ) -> Result<Self> {
        check_range(
            "progressive_resizing",
            "initial_scale",
            initial_scale,
            0.01,
            1.0,
        )?;
        check_range(
            "progressive_resizing",
            "delay_fraction",
            delay_fraction,
            0.0,
            1.0,
        )?;
        check_range(
            "progressive_resizing",
            "finetune_fraction",
            finetune_fraction,
            0.0,
            1.0,
        )?;
        if delay_fraction + finetune_fraction > 1.0 {
            return Err(AlgorithmError::param(
                "progressive_resizing",
                "delay_fraction + finetune_fraction",
                delay_fraction + finetune_fraction,
                "at most 1",
            ));
        }
        if size_increment == 0 {
            return Err(AlgorithmError::param(
                "progressive_resizing",
                "size_increment",
                0,
                "an integer >= 1",
            ));
        }
        let t = &mut self.0;
        t.initial_scale = initial_scale;
        t.delay_fraction = delay_fraction;
        t.finetune_fraction = finetune_fraction;
        t.size_increment = size_increment;
        t.mode = mode;
        Ok(self)
    }

    /// The scale at `fraction` of training.
    pub fn scale(&self, fraction: f64) -> f64 {
        self.0.scale(fraction)
    }
}

impl Default for ProgressiveResizing {
    fn default() -> Self {
        Self::new()
    }
}

impl ImageTransform for ProgressiveResizingTransform {
    const NAME: &'static str = "progressive_resizing";

    fn active(&self, fraction: f64) -> bool {
        self.scale(fraction) < 1.0
    }

    fn transform<B: Backend>(
        &self,
        images: Tensor<B, 4>,
        rng: &mut Rng,
        fraction: f64,
    ) -> Tensor<B, 4> {
        let scale = self.scale(fraction);
        let [_, _, h, w] = images.dims();
        let inc = self.size_increment;
        let (nh, nw) = (scaled_side(h, scale, inc), scaled_side(w, scale, inc));
        resize_images(images, nh, nw, self.mode, self.grid, rng)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "progressive_resizing",
    params: [
        "initial_scale",
        "delay_fraction",
        "finetune_fraction",
        "size_increment",
        "mode",
        "grid",
    ],
}
crate::spec::by_name! {image |p, _norm| {
    let mode = match p.str("mode", "resize") {
        "resize" => ResizeMode::Resize,
        "crop" => ResizeMode::Crop,
        other => {
            return Err(crate::error::AlgorithmError::param(
                "progressive_resizing",
                "mode",
                other,
                "resize or crop",
            ))
        }
    };
    let grid = ResizeGrid::parse(p.str("grid", "corner"))?;
    ProgressiveResizing::new()
        .with(
            p.f64("initial_scale", 0.5)?,
            p.f64("delay_fraction", 0.5)?,
            p.f64("finetune_fraction", 0.2)?,
            p.usize("size_increment", 4)?,
            mode,
        )?
        .with_grid(grid)
}}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest};

    #[test]
    fn schedule_matches_composer_at_its_landmarks() {
        let s = |f| scale_at(f, 0.5, 0.5, 0.2);
        assert_eq!(s(0.0), 0.5);
        assert_eq!(s(0.49), 0.5);
        // Halfway through the growth window [0.5, 0.8): 0.5 + 0.5 * 0.5.
        assert!((s(0.65) - 0.75).abs() < 1e-12);
        assert_eq!(s(0.8), 1.0);
        assert_eq!(s(1.0), 1.0);
        // 28 * 0.5 = 14 -> nearest multiple of 4 is 16 (14/4 = 3.5 rounds to 4).
        assert_eq!(scaled_side(28, 0.5, 4), 16);
        assert_eq!(scaled_side(28, 0.75, 4), 20);
        assert_eq!(scaled_side(28, 1.0, 4), 28);
        assert_eq!(scaled_side(28, 0.01, 4), 4);
    }

    proptest! {
        #[test]
        fn scale_never_shrinks_and_ends_at_one(a in 0.0f64..1.0, b in 0.0f64..1.0, init in 0.05f64..1.0, d in 0.0f64..0.6, f in 0.0f64..0.4) {
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(scale_at(lo, init, d, f) <= scale_at(hi, init, d, f) + 1e-12);
            prop_assert!(scale_at(lo, init, d, f) >= init - 1e-12);
            prop_assert_eq!(scale_at(1.0, init, d, f), 1.0);
        }
    }

    #[test]
    fn resize_keeps_constant_images_constant_and_crop_copies_a_window() {
        let d = Default::default();
        let x = Tensor::<Flex, 4>::ones([2, 1, 28, 28], &d).mul_scalar(0.3);
        let r = resize_images(
            x,
            16,
            16,
            ResizeMode::Resize,
            ResizeGrid::CornerAligned,
            &mut Rng::new(0),
        );
        assert_eq!(r.dims(), [2, 1, 16, 16]);
        let v = r.into_data().to_vec::<f32>().unwrap();
        assert!(v.iter().all(|p| (p - 0.3).abs() < 1e-6));
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x = Tensor::<Flex, 4>::from_data(TensorData::new(v, [1, 1, 4, 4]), &d);
        let c = resize_images(
            x,
            2,
            2,
            ResizeMode::Crop,
            ResizeGrid::HalfPixel,
            &mut Rng::new(1),
        )
        .into_data()
        .to_vec::<f32>()
        .unwrap();
        // A 2x2 window of a 4x4 ramp: [a, a+1, a+4, a+5].
        assert_eq!(c[1] - c[0], 1.0);
        assert_eq!(c[2] - c[0], 4.0);
        assert_eq!(c[3] - c[0], 5.0);
    }

    #[test]
    fn both_sampling_grids_match_their_formulas() {
        // A 4x4 ramp v[y][x] = 4y + x, downscaled to 2x2.
        let d = Default::default();
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x = Tensor::<Flex, 4>::from_data(TensorData::new(v, [1, 1, 4, 4]), &d);
        let resize = |grid| {
            resize_images(x.clone(), 2, 2, ResizeMode::Resize, grid, &mut Rng::new(0))
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        // Corner-aligned: output i samples i * 3 / 1, the corners 0 and 3 of each axis.
        let corner = resize(ResizeGrid::CornerAligned);
        for (a, e) in corner.iter().zip([0.0, 3.0, 12.0, 15.0]) {
            assert!((a - e).abs() < 1e-5, "{corner:?}");
        }
        // Half-pixel: output i samples (i + 0.5) * 2 - 0.5 = 0.5 and 2.5, halfway between two
        // pixels of each axis: the mean of each 2x2 block.
        let half = resize(ResizeGrid::HalfPixel);
        for (a, e) in half.iter().zip([2.5, 4.5, 10.5, 12.5]) {
            assert!((a - e).abs() < 1e-5, "{half:?}");
        }
        // Upscaling 2 -> 3 on the half-pixel grid: positions (i + 0.5) * 2/3 - 0.5 =
        // -1/6 (clamped to 0), 0.5 and 7/6 (weights 5/6 and 1/6 towards the last pixel).
        let y = Tensor::<Flex, 4>::from_data(TensorData::new(vec![0.0f32, 6.0], [1, 1, 1, 2]), &d);
        let up = resize_images(
            y,
            1,
            3,
            ResizeMode::Resize,
            ResizeGrid::HalfPixel,
            &mut Rng::new(0),
        )
        .into_data()
        .to_vec::<f32>()
        .unwrap();
        for (a, e) in up.iter().zip([0.0, 3.0, 6.0]) {
            assert!((a - e).abs() < 1e-5, "{up:?}");
        }
        assert!(ResizeGrid::parse("edges")
            .unwrap_err()
            .to_string()
            .contains("half_pixel"));
    }
}
