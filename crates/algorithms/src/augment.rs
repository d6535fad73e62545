//! Image augmentation primitives as batched tensor operations, shared by RandAugment and
//! AugMix. Each primitive acts on a whole batch with per-sample strengths; a layer applies a
//! different primitive to each sample by computing each chosen primitive once for the batch
//! and blending it in with a per-sample mask. Geometric primitives (rotate, shear, translate)
//! of all samples share one `grid_sample` call with a per-sample affine matrix.
//!
//! Images are worked on in `[0, 1]` pixel space (see [`Normalization`]); strengths follow
//! Composer's mapping of a level in `[0, 10]` to each primitive's range. PIL's `equalize` has no
//! cheap batched form and is not among the primitives.

use burn::tensor::backend::Backend;
use burn::tensor::module::conv2d;
use burn::tensor::ops::{ConvOptions, GridSampleOptions, GridSamplePaddingMode, InterpolateMode};
use burn::tensor::{Tensor, TensorData};
use flashover_core::rng::Rng;

use crate::error::{AlgorithmError, Result};
use crate::util::per_sample;

/// One augmentation primitive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AugOp {
    /// Leaves the image as it is.
    Identity,
    /// Stretches each channel to the full range.
    AutoContrast,
    /// Keeps `4 - level * 4 / 10` bits per pixel (at least 1).
    Posterize,
    /// Inverts pixels above a threshold that falls with the level.
    Solarize,
    /// Rotates by up to 30 degrees.
    Rotate,
    /// Shears horizontally by up to 0.3.
    ShearX,
    /// Shears vertically by up to 0.3.
    ShearY,
    /// Shifts horizontally by up to a third of the width.
    TranslateX,
    /// Shifts vertically by up to a third of the height.
    TranslateY,
    /// Scales brightness by a factor in `[0.1, 1.9]`.
    Brightness,
    /// Scales contrast around the image mean by a factor in `[0.1, 1.9]`.
    Contrast,
    /// Scales saturation around the grey image by a factor in `[0.1, 1.9]`.
    Color,
    /// Blends with a smoothed image by a factor in `[0.1, 1.9]`.
    Sharpness,
}

impl AugOp {
    fn is_geometric(self) -> bool {
        matches!(
            self,
            AugOp::Rotate | AugOp::ShearX | AugOp::ShearY | AugOp::TranslateX | AugOp::TranslateY
        )
    }
}

/// Which primitives to draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AugmentationSet {
    /// Every primitive (Composer's "all", less equalize).
    All,
    /// Without brightness, contrast, color and sharpness, which overlap the corruptions of
    /// robustness benchmarks (Composer's "safe", less equalize).
    Safe,
}

impl AugmentationSet {
    /// The primitives in the set.
    pub fn ops(self) -> &'static [AugOp] {
        use AugOp::*;
        match self {
            AugmentationSet::All => &[
                AutoContrast,
                Posterize,
                Solarize,
                Rotate,
                ShearX,
                ShearY,
                TranslateX,
                TranslateY,
                Brightness,
                Contrast,
                Color,
                Sharpness,
            ],
            AugmentationSet::Safe => &[
                AutoContrast,
                Posterize,
                Solarize,
                Rotate,
                ShearX,
                ShearY,
                TranslateX,
                TranslateY,
            ],
        }
    }

    /// Parses `all` or `safe`.
    pub fn parse(s: &str, algorithm: &'static str) -> Result<Self> {
        match s {
            "all" => Ok(AugmentationSet::All),
            "safe" => Ok(AugmentationSet::Safe),
            other => Err(AlgorithmError::param(
                algorithm,
                "augmentation_set",
                other,
                "all or safe",
            )),
        }
    }
}

/// Per-channel normalisation of the images in a batch: pixels are `(p - mean) / std` with `p`
/// in `[0, 1]`. Augmentations undo it, work in `[0, 1]`, and apply it again.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalization {
    /// Mean per channel (one value applies to every channel).
    pub mean: Vec<f32>,
    /// Standard deviation per channel.
    pub std: Vec<f32>,
}

impl Normalization {
    /// Images already in `[0, 1]`.
    pub fn identity() -> Self {
        Normalization {
            mean: vec![0.0],
            std: vec![1.0],
        }
    }

    /// One mean and standard deviation for every channel.
    pub fn new(mean: f32, std: f32) -> Result<Self> {
        if !(std.is_finite() && std > 0.0 && mean.is_finite()) {
            return Err(AlgorithmError::param(
                "augmentation",
                "normalization std",
                std,
                "a finite number > 0",
            ));
        }
        Ok(Normalization {
            mean: vec![mean],
            std: vec![std],
        })
    }

    fn channel<B: Backend>(v: &[f32], c: usize, device: &B::Device) -> Tensor<B, 4> {
        let vals: Vec<f32> = (0..c).map(|i| v[i.min(v.len() - 1)]).collect();
        Tensor::from_data(TensorData::new(vals, [1, c, 1, 1]), device)
    }

    /// Normalised images to `[0, 1]` pixels.
    pub fn to_unit<B: Backend>(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let c = x.dims()[1];
        let d = x.device();
        x * Self::channel::<B>(&self.std, c, &d) + Self::channel::<B>(&self.mean, c, &d)
    }

    /// `[0, 1]` pixels back to normalised images.
    pub fn from_unit<B: Backend>(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let c = x.dims()[1];
        let d = x.device();
        (x - Self::channel::<B>(&self.mean, c, &d)) / Self::channel::<B>(&self.std, c, &d)
    }
}

/// What one sample gets in one layer: a primitive, its level in `[0, 10]` and a sign (for the
/// symmetric geometric primitives).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpDraw {
    /// The primitive.
    pub op: AugOp,
    /// Strength, 0 to 10.
    pub level: f32,
    /// +1 or -1.
    pub sign: f32,
}

impl OpDraw {
    /// Draws a primitive from `ops`, a level uniform in `[0.1, severity]` (Composer's
    /// `_sample_level`) and a random sign.
    pub fn draw(rng: &mut Rng, ops: &[AugOp], severity: f32) -> Self {
        let op = ops[rng.below(ops.len() as u64) as usize];
        let level = rng.uniform(0.1, severity.max(0.1) as f64) as f32;
        let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        OpDraw { op, level, sign }
    }
}

/// Enhancement factor of the colour primitives: `level * 1.8 / 10 + 0.1`.
pub fn enhance_factor(level: f32) -> f32 {
    level * 1.8 / 10.0 + 0.1
}

/// The 2x3 matrix that maps an output pixel's normalised coordinates `(u, v, 1)` to the
/// source coordinates for a geometric draw on an `h x w` image (identity for the others).
pub fn affine(d: &OpDraw, h: usize, w: usize) -> [f32; 6] {
    let (hw, wh) = (h as f32 / w as f32, w as f32 / h as f32);
    let s = d.sign;
    match d.op {
        AugOp::Rotate => {
            let t = (s * d.level * 30.0 / 10.0).to_radians();
            let (sin, cos) = t.sin_cos();
            [cos, sin * hw, 0.0, -sin * wh, cos, 0.0]
        }
        AugOp::ShearX => [1.0, s * d.level * 0.3 / 10.0 * hw, 0.0, 0.0, 1.0, 0.0],
        AugOp::ShearY => [1.0, 0.0, 0.0, s * d.level * 0.3 / 10.0 * wh, 1.0, 0.0],
        AugOp::TranslateX => {
            let px = s * d.level * (w as f32 / 3.0) / 10.0;
            [1.0, 0.0, -2.0 * px / w as f32, 0.0, 1.0, 0.0]
        }
        AugOp::TranslateY => {
            let px = s * d.level * (h as f32 / 3.0) / 10.0;
            [1.0, 0.0, 0.0, 0.0, 1.0, -2.0 * px / h as f32]
        }
        _ => [1.0, 0.0, 0.0, 0.0, 1.0, 0.0],
    }
}

/// Warps each image by its own affine matrix (bilinear, zeros outside).
pub fn warp<B: Backend>(x: Tensor<B, 4>, matrices: &[[f32; 6]]) -> Tensor<B, 4> {
    let [n, _, h, w] = x.dims();
    let device = x.device();
    let mut base = Vec::with_capacity(h * w * 3);
    for i in 0..h {
        for j in 0..w {
            base.push((2 * j + 1) as f32 / w as f32 - 1.0);
            base.push((2 * i + 1) as f32 / h as f32 - 1.0);
            base.push(1.0);
        }
    }
    let base =
        Tensor::<B, 3>::from_data(TensorData::new(base, [1, h * w, 3]), &device).repeat_dim(0, n);
    // Each matrix transposed to [3, 2], so that base [n, hw, 3] x m [n, 3, 2] = [n, hw, 2].
    let mt: Vec<f32> = matrices
        .iter()
        .flat_map(|m| [m[0], m[3], m[1], m[4], m[2], m[5]])
        .collect();
    let m = Tensor::<B, 3>::from_data(TensorData::new(mt, [n, 3, 2]), &device);
    let grid = base.matmul(m).reshape([n, h, w, 2]);
    x.grid_sample_2d(
        grid,
        GridSampleOptions::new(InterpolateMode::Bilinear)
            .with_padding_mode(GridSamplePaddingMode::Zeros),
    )
}

/// Applies a pointwise primitive to the whole batch with per-sample levels.
fn pointwise<B: Backend>(op: AugOp, x: Tensor<B, 4>, levels: &[f32]) -> Tensor<B, 4> {
    let device = x.device();
    let [n, c, h, w] = x.dims();
    match op {
        AugOp::AutoContrast => {
            let lo = x.clone().min_dim(3).min_dim(2);
            let hi = x.clone().max_dim(3).max_dim(2);
            let range = hi - lo.clone();
            // Constant channels are left as they are (PIL does the same).
            let flat = range.clone().lower_elem(1e-6).float();
            let stretched = (x.clone() - lo) / range.clamp_min(1e-6);
            stretched * (flat.clone().neg() + 1.0) + x * flat
        }
        AugOp::Posterize => {
            let shifts: Vec<f32> = levels
                .iter()
                .map(|l| {
                    let bits = (4 - (l * 4.0 / 10.0) as i32).max(1);
                    2f32.powi(8 - bits)
                })
                .collect();
            let s = per_sample::<B>(&shifts, &device);
            (x * 255.0 / s.clone()).floor() * s / 255.0
        }
        AugOp::Solarize => {
            let t: Vec<f32> = levels
                .iter()
                .map(|l| (256 - (l * 256.0 / 10.0) as i32) as f32 / 255.0)
                .collect();
            let t = per_sample::<B>(&t, &device).expand([n, c, h, w]);
            let above = x.clone().greater_equal(t).float();
            // Above the threshold x becomes 1 - x, that is x + (1 - 2x).
            x.clone() + (x.mul_scalar(-2.0) + 1.0) * above
        }
        AugOp::Brightness => {
            let f: Vec<f32> = levels.iter().map(|l| enhance_factor(*l)).collect();
            x * per_sample::<B>(&f, &device)
        }
        AugOp::Contrast => {
            let f: Vec<f32> = levels.iter().map(|l| enhance_factor(*l)).collect();
            let mean = x.clone().mean_dim(1).mean_dim(2).mean_dim(3);
            mean.clone() + (x - mean) * per_sample::<B>(&f, &device)
        }
        AugOp::Color => {
            let f: Vec<f32> = levels.iter().map(|l| enhance_factor(*l)).collect();
            let grey = x.clone().mean_dim(1);
            grey.clone() + (x - grey) * per_sample::<B>(&f, &device)
        }
        AugOp::Sharpness => {
            let f: Vec<f32> = levels.iter().map(|l| enhance_factor(*l)).collect();
            // PIL's SMOOTH kernel, one per channel (depthwise).
            let k: Vec<f32> = (0..c)
                .flat_map(|_| [1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 1.0].map(|v| v / 13.0))
                .collect();
            let weight = Tensor::<B, 4>::from_data(TensorData::new(k, [c, 1, 3, 3]), &device);
            let smooth = conv2d(
                x.clone(),
                weight,
                None,
                ConvOptions::new([1, 1], [1, 1], [1, 1], c),
            );
            smooth.clone() + (x - smooth) * per_sample::<B>(&f, &device)
        }
        _ => x,
    }
}

/// One augmentation layer: sample `i` gets `draws[i]` (the functional form behind RandAugment
/// and AugMix). `x` is in `[0, 1]`; the result is clamped to `[0, 1]`.
pub fn apply_layer<B: Backend>(x: Tensor<B, 4>, draws: &[OpDraw]) -> Tensor<B, 4> {
    let [n, _, h, w] = x.dims();
    let device = x.device();
    assert_eq!(draws.len(), n, "one draw per sample");
    let mut out = x.clone();
    if draws.iter().any(|d| d.op.is_geometric()) {
        let matrices: Vec<[f32; 6]> = draws.iter().map(|d| affine(d, h, w)).collect();
        let mask: Vec<f32> = draws
            .iter()
            .map(|d| f32::from(u8::from(d.op.is_geometric())))
            .collect();
        let warped = warp(x.clone(), &matrices);
        out = out.clone() + (warped - out) * per_sample::<B>(&mask, &device);
    }
    let mut seen: Vec<AugOp> = Vec::new();
    for d in draws {
        if d.op.is_geometric() || d.op == AugOp::Identity || seen.contains(&d.op) {
            continue;
        }
        seen.push(d.op);
        let levels: Vec<f32> = draws.iter().map(|e| e.level).collect();
        let mask: Vec<f32> = draws
            .iter()
            .map(|e| f32::from(u8::from(e.op == d.op)))
            .collect();
        let changed = pointwise(d.op, x.clone(), &levels);
        out = out.clone() + (changed - x.clone()) * per_sample::<B>(&mask, &device);
    }
    out.clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    fn ramp(n: usize, h: usize, w: usize) -> Tensor<B, 4> {
        let v: Vec<f32> = (0..n * h * w)
            .map(|i| ((i % (h * w)) as f32) / (h * w) as f32)
            .collect();
        Tensor::from_data(TensorData::new(v, [n, 1, h, w]), &Default::default())
    }

    fn draw(op: AugOp, level: f32, sign: f32) -> OpDraw {
        OpDraw { op, level, sign }
    }

    fn vals(t: Tensor<B, 4>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    #[test]
    fn identity_matrices_leave_images_unchanged() {
        let x = ramp(2, 6, 5);
        let id = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0];
        let y = warp(x.clone(), &[id, id]);
        for (a, b) in vals(x).iter().zip(vals(y)) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn translation_by_whole_pixels_shifts_the_image() {
        // Level 10 on a width-3 image shifts by w/3 = 1 pixel: column j takes column j - 1.
        let v: Vec<f32> = vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9];
        let x = Tensor::<B, 4>::from_data(TensorData::new(v, [1, 1, 3, 3]), &Default::default());
        let y = vals(apply_layer(x, &[draw(AugOp::TranslateX, 10.0, 1.0)]));
        let want = [0.0, 0.1, 0.2, 0.0, 0.4, 0.5, 0.0, 0.7, 0.8];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{y:?}");
        }
    }

    #[test]
    fn rotation_matrices_rotate_pixels_about_the_centre() {
        // Level 10 is 30 degrees: the matrix holds cos 30 and sin 30 (square image).
        let m = affine(&draw(AugOp::Rotate, 10.0, 1.0), 8, 8);
        let (s30, c30) = (0.5f32, 3f32.sqrt() / 2.0);
        for (a, b) in m.iter().zip([c30, s30, 0.0, -s30, c30, 0.0]) {
            assert!((a - b).abs() < 1e-6, "{m:?}");
        }
        // The same formula at 90 degrees permutes the pixels of a square exactly: output (i, j)
        // reads source (u_s, v_s) = (v, -u), i.e. row j, column w-1-i.
        let x = ramp(1, 4, 4);
        let y = vals(warp(x.clone(), &[[0.0, 1.0, 0.0, -1.0, 0.0, 0.0]]));
        let x = vals(x);
        for i in 0..4 {
            for j in 0..4 {
                let src = x[(3 - j) * 4 + i];
                assert!(
                    (y[i * 4 + j] - src).abs() < 1e-5,
                    "({i},{j}): {} vs {src}",
                    y[i * 4 + j]
                );
            }
        }
    }

    #[test]
    fn pointwise_primitives_match_their_formulas() {
        let v = vec![0.2f32, 0.4, 0.6, 0.8];
        let x = || {
            Tensor::<B, 4>::from_data(
                TensorData::new(v.clone(), [1, 1, 2, 2]),
                &Default::default(),
            )
        };
        // Autocontrast stretches [0.2, 0.8] to [0, 1].
        let y = vals(apply_layer(x(), &[draw(AugOp::AutoContrast, 5.0, 1.0)]));
        for (a, b) in y.iter().zip([0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0]) {
            assert!((a - b).abs() < 1e-5, "{y:?}");
        }
        // Solarize at level 5: threshold (256 - 128) / 255 = 0.50196; above it x -> 1 - x.
        let y = vals(apply_layer(x(), &[draw(AugOp::Solarize, 5.0, 1.0)]));
        for (a, b) in y.iter().zip([0.2, 0.4, 0.4, 0.2]) {
            assert!((a - b).abs() < 1e-5, "{y:?}");
        }
        // Posterize at level 10 keeps 1 bit: values >= 128/255 become 128/255, others 0.
        let y = vals(apply_layer(x(), &[draw(AugOp::Posterize, 10.0, 1.0)]));
        let half = 128.0 / 255.0;
        for (a, b) in y.iter().zip([0.0, 0.0, half, half]) {
            assert!((a - b).abs() < 1e-5, "{y:?}");
        }
        // Brightness at level 5: factor 1.0; contrast at level 0: factor 0.1 around the mean 0.5.
        let y = vals(apply_layer(x(), &[draw(AugOp::Brightness, 5.0, 1.0)]));
        for (a, b) in y.iter().zip(&v) {
            assert!((a - b).abs() < 1e-6);
        }
        let y = vals(apply_layer(x(), &[draw(AugOp::Contrast, 0.0, 1.0)]));
        for (a, b) in y.iter().zip(&v) {
            assert!((a - (0.5 + 0.1 * (b - 0.5))).abs() < 1e-6, "{y:?}");
        }
    }

    #[test]
    fn each_sample_gets_only_its_own_primitive() {
        let x = ramp(3, 4, 4);
        let draws = [
            draw(AugOp::Identity, 5.0, 1.0),
            draw(AugOp::Solarize, 10.0, 1.0),
            draw(AugOp::TranslateY, 5.0, -1.0),
        ];
        let y = vals(apply_layer(x.clone(), &draws));
        let x = vals(x);
        assert_eq!(&y[..16], &x[..16], "identity sample untouched");
        // Solarize at level 10: threshold 0, so every pixel becomes 1 - x.
        for (a, b) in y[16..32].iter().zip(&x[16..32]) {
            assert!((a - (1.0 - b)).abs() < 1e-6);
        }
        assert_ne!(&y[32..], &x[32..], "translated sample changed");
    }

    #[test]
    fn normalization_round_trips() {
        let n = Normalization::new(0.1307, 0.3081).unwrap();
        let x = ramp(1, 3, 3);
        let back = vals(n.from_unit(n.to_unit(x.clone())));
        for (a, b) in back.iter().zip(vals(x)) {
            assert!((a - b).abs() < 1e-6);
        }
        assert!(Normalization::new(0.0, 0.0).is_err());
    }
}
