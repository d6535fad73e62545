//! Progressive resizing (fast.ai's DAWNBench entry; Composer's method card): train on
//! downscaled images first and grow them to full size over training, so early epochs cost a
//! fraction of the compute. The schedule is Composer's: the scale stays at `initial_scale`
//! for the first `delay_fraction` of training, grows linearly, and is 1 for the last
//! `finetune_fraction`; sides are rounded to a multiple of `size_increment`.
//!
//! Hyperparameters: `initial_scale` 0.5, `delay_fraction` 0.5, `finetune_fraction` 0.2,
//! `size_increment` 4, `mode` resize (bilinear) or crop (a random crop, one per batch).
//! Helps convolutional models whose head pools over space.
//!
//! Hook: `AFTER_DATALOADER`. The scale is a pure function of time, so resuming needs no state.

use burn::optim::Optimizer;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::interpolate;
use burn::tensor::ops::{InterpolateMode, InterpolateOptions};
use burn::tensor::Tensor;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::{ImageBatch, TrainModel};
use flashover_core::rng::Rng;
use flashover_core::state::State;

use crate::error::{check_range, AlgorithmError, Result};
use crate::util::{fraction, map_images};

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

/// Resizes (or crops) `images` to `[h, w]` (the functional form).
pub fn resize_images<B: Backend>(
    images: Tensor<B, 4>,
    h: usize,
    w: usize,
    mode: ResizeMode,
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
            InterpolateOptions::new(InterpolateMode::Bilinear),
        ),
        ResizeMode::Crop => {
            let y = rng.below((ih - h + 1) as u64) as usize;
            let x = rng.below((iw - w + 1) as u64) as usize;
            images.narrow(2, y, h).narrow(3, x, w)
        }
    }
}

/// The progressive-resizing algorithm; see the module docs.
#[derive(Debug, Clone)]
pub struct ProgressiveResizing {
    initial_scale: f64,
    delay_fraction: f64,
    finetune_fraction: f64,
    size_increment: usize,
    mode: ResizeMode,
}

impl ProgressiveResizing {
    /// Composer's defaults: scale 0.5, delay 0.5, finetune 0.2, increment 4, resize.
    pub fn new() -> Self {
        ProgressiveResizing {
            initial_scale: 0.5,
            delay_fraction: 0.5,
            finetune_fraction: 0.2,
            size_increment: 4,
            mode: ResizeMode::Resize,
        }
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
        self.initial_scale = initial_scale;
        self.delay_fraction = delay_fraction;
        self.finetune_fraction = finetune_fraction;
        self.size_increment = size_increment;
        self.mode = mode;
        Ok(self)
    }

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

impl Default for ProgressiveResizing {
    fn default() -> Self {
        Self::new()
    }
}

impl<B, M, O> Algorithm<B, M, O> for ProgressiveResizing
where
    B: AutodiffBackend,
    M: TrainModel<B, Batch: ImageBatch<B>>,
    O: Optimizer<M, B>,
{
    fn name(&self) -> &str {
        "progressive_resizing"
    }

    fn matches(&self, event: Event, _state: &State<B, M, O>) -> bool {
        event == Event::AfterDataloader
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<B, M, O>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let scale = self.scale(fraction(state));
        if scale >= 1.0 {
            return Ok(());
        }
        let (inc, mode) = (self.size_increment, self.mode);
        map_images(state, "progressive_resizing", |x, rng| {
            let [_, _, h, w] = x.dims();
            let (nh, nw) = (scaled_side(h, scale, inc), scaled_side(w, scale, inc));
            resize_images(x, nh, nw, mode, rng)
        });
        Ok(())
    }
}

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
        let r = resize_images(x, 16, 16, ResizeMode::Resize, &mut Rng::new(0));
        assert_eq!(r.dims(), [2, 1, 16, 16]);
        let v = r.into_data().to_vec::<f32>().unwrap();
        assert!(v.iter().all(|p| (p - 0.3).abs() < 1e-6));
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x = Tensor::<Flex, 4>::from_data(TensorData::new(v, [1, 1, 4, 4]), &d);
        let c = resize_images(x, 2, 2, ResizeMode::Crop, &mut Rng::new(1))
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        // A 2x2 window of a 4x4 ramp: [a, a+1, a+4, a+5].
        assert_eq!(c[1] - c[0], 1.0);
        assert_eq!(c[2] - c[0], 4.0);
        assert_eq!(c[3] - c[0], 5.0);
    }
}
