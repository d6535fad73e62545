//! Training precision (Composer's `precision`): which floating-point type holds the weights
//! and which one the forward and backward passes compute in, and the dynamic loss scaling
//! that float16 needs.
//!
//! - `fp32`: everything in float32 (the default).
//! - `fp16`, `bf16`: the whole model in the half type: parameters, running statistics,
//!   activations and the backward pass, with the same loss scaling as `amp_fp16` when the
//!   type is float16. A deliberate difference from a model simply cast to half: the
//!   optimizer steps in float32, on the gradients brought to float32, with float32 moments
//!   (Burn's optimizer records load as float32, and Adam's epsilon of 1e-8 is below
//!   float16's smallest number), and the updated weights are rounded to the half type
//!   after each step. So the weights get half precision's memory and rounding, the moments
//!   do not.
//! - `amp_fp16`, `amp_bf16` (automatic mixed precision): parameters ("master weights") and
//!   optimizer state stay float32; the forward pass casts each weight to the half type where
//!   a layer uses it, so activations and the backward pass run in the half type, and the
//!   cast's backward brings each gradient back to float32 for the optimizer. With float16 the
//!   loss is multiplied by a [`LossScaler`]'s scale before the backward pass (small gradients
//!   would flush to zero in float16's range), the gradients are divided by it before anything
//!   reads them, and a step whose gradients overflowed is skipped and the scale halved
//!   (Micikevicius et al., "Mixed Precision Training", 2018; the defaults are PyTorch's
//!   `GradScaler`'s). bfloat16 has float32's exponent range and needs no scaling.
//!
//! In every mode the models of `flashover-models` compute normalisation statistics in
//! float32 (PyTorch's autocast does the same for layer and group norm; we also do it for batch
//! norm and in the pure half modes, where half-precision variances lose too much) and return
//! their logits in float32, so losses and metrics are float32. The low-precision norm
//! algorithms run the norms in the run's half type instead.
//!
//! How a model takes part: [`Autocast`] (set the type its forward pass computes in). The
//! trainer checks at build that the backend supports the type on the device
//! ([`check_precision`]): Burn's flex CPU backend does (float16 through `gemm`'s float16
//! kernels, bfloat16 through float32), ndarray does not.

use std::fmt;
use std::str::FromStr;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

/// A half-precision floating-point type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HalfType {
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (float32's exponent, 8 bits of mantissa).
    BF16,
}

/// The floating-point setup of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Everything in float32.
    #[default]
    Fp32,
    /// The whole model in float16.
    Fp16,
    /// The whole model in bfloat16.
    Bf16,
    /// Float32 weights and optimizer, float16 compute, dynamic loss scaling.
    AmpFp16,
    /// Float32 weights and optimizer, bfloat16 compute.
    AmpBf16,
}

impl Precision {
    /// Every precision, in the order the CLI lists them.
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::AmpFp16,
        Precision::AmpBf16,
    ];

    /// The name used on the command line, in logs and in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::AmpFp16 => "amp_fp16",
            Precision::AmpBf16 => "amp_bf16",
        }
    }

    /// The half type the run computes in, `None` for `fp32`.
    pub fn half(self) -> Option<HalfType> {
        match self {
            Precision::Fp32 => None,
            Precision::Fp16 | Precision::AmpFp16 => Some(HalfType::F16),
            Precision::Bf16 | Precision::AmpBf16 => Some(HalfType::BF16),
        }
    }

    /// The type forward and backward passes compute in (`None`: the parameters' own).
    pub fn compute_dtype(self) -> Option<FloatDType> {
        self.half().map(half_dtype)
    }

    /// The type parameters, gradients and optimizer state are kept in.
    pub fn parameter_dtype(self) -> FloatDType {
        match self {
            Precision::Fp16 | Precision::Bf16 => self.compute_dtype().unwrap_or(FloatDType::F32),
            _ => FloatDType::F32,
        }
    }

    /// Whether parameters stay float32 while the passes compute in a half type.
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::AmpFp16 | Precision::AmpBf16)
    }

    /// Whether the run scales its loss: the float16 precisions (bfloat16 has float32's
    /// range).
    pub fn scales_loss(self) -> bool {
        self.half() == Some(HalfType::F16)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = CoreError;

    /// One of `fp32`, `fp16`, `bf16`, `amp_fp16`, `amp_bf16` (any case; `-` for `_`).
    fn from_str(s: &str) -> Result<Self> {
        let wanted = s.trim().to_ascii_lowercase().replace('-', "_");
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == wanted)
            .ok_or_else(|| {
                CoreError::config(
                    "precision",
                    format!("{s:?}"),
                    "one of fp32, fp16, bf16, amp_fp16, amp_bf16",
                )
            })
    }
}

/// Burn's float type for a half type.
pub fn half_dtype(half: HalfType) -> FloatDType {
    match half {
        HalfType::F16 => FloatDType::F16,
        HalfType::BF16 => FloatDType::BF16,
    }
}

/// Checks that backend `B` stores and computes `precision`'s half type on `device` (Burn's
/// `supports_dtype`: storage and arithmetic); the error names the precision, the backend,
/// and the precisions it does support there.
pub fn check_precision<B: Backend>(precision: Precision, device: &B::Device) -> Result<()> {
    check_precision_with(precision, &B::name(device), |d| {
        B::supports_dtype(device, d)
    })
}

/// [`check_precision`] against a backend named `backend` that supports the types
/// `supports` accepts.
pub fn check_precision_with(
    precision: Precision,
    backend: &str,
    supports: impl Fn(DType) -> bool,
) -> Result<()> {
    let runs = |p: Precision| p.compute_dtype().is_none_or(|d| supports(DType::from(d)));
    if runs(precision) {
        return Ok(());
    }
    let supported: Vec<&str> = Precision::ALL
        .into_iter()
        .filter(|&p| runs(p))
        .map(Precision::name)
        .collect();
    Err(CoreError::UnsupportedPrecision {
        precision: precision.name(),
        dtype: format!("{:?}", precision.compute_dtype().unwrap_or(FloatDType::F32)),
        backend: backend.to_string(),
        supported: supported.join(", "),
    })
}

/// A model whose forward pass can compute in a type other than its parameters' (mixed and
/// half precision): it casts its input (or its embeddings' output) to that type, each layer
/// casts its weights to its input's type where it uses them, normalisation statistics are
/// float32, and its outputs are float32 again. `flashover-models`' models implement it;
/// [`TrainerBuilder::precision`](crate::trainer::TrainerBuilder::precision) needs it.
pub trait Autocast: Sized {
    /// The type the forward pass computes in (`None`: the parameters' own).
    fn compute_dtype(&self) -> Option<FloatDType>;
    /// The same model (same parameters) computing in `dtype`.
    fn with_compute_dtype(self, dtype: Option<FloatDType>) -> Self;
}

/// `t` in `dtype`, or `t` itself when it already is (a cast op recorded on every use of an
/// float32 weight in a float32 run would cost a graph node for nothing).
pub fn cast_to<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: FloatDType) -> Tensor<B, D> {
    if t.dtype() == DType::from(dtype) {
        t
    } else {
        t.cast(dtype)
    }
}

/// `t` in the type of `like` (see [`cast_to`]); `t` unchanged when `like` is not a float type.
pub fn cast_like<B: Backend, const D: usize>(t: Tensor<B, D>, like: DType) -> Tensor<B, D> {
    match float_dtype(like) {
        Some(dtype) => cast_to(t, dtype),
        None => t,
    }
}

/// The float type a `DType` is, if it is one.
pub fn float_dtype(dtype: DType) -> Option<FloatDType> {
    match dtype {
        DType::F64 => Some(FloatDType::F64),
        DType::F32 => Some(FloatDType::F32),
        DType::Flex32 => Some(FloatDType::Flex32),
        DType::F16 => Some(FloatDType::F16),
        DType::BF16 => Some(FloatDType::BF16),
        _ => None,
    }
}

/// Casts every float parameter and running statistic of `model` to `dtype`, in place of the
/// old tensors: ids and whether each parameter trains are kept, and no graph is recorded
/// (the result is a set of leaves, as a freshly built model's are).
struct CastParams {
    dtype: FloatDType,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let dtype = self.dtype;
        param.map(|t| {
            if t.dtype() == DType::from(dtype) {
                return t;
            }
            let trains = t.is_require_grad();
            let cast = Tensor::<AB, D>::from_inner(t.inner().cast(dtype));
            if trains {
                cast.require_grad()
            } else {
                cast
            }
        })
    }
}

/// `model` with every float parameter (and running statistic) in `dtype`; parameter ids and
/// trainability are kept (see the module doc: the pure half precisions, and a resume in
/// another precision, which converts the loaded weights this way).
pub fn cast_params<AB: AutodiffBackend, M: Module<AB>>(model: M, dtype: FloatDType) -> M {
    model.map(&mut CastParams { dtype })
}

/// The float type of `model`'s first float parameter (`None` for a model without one).
pub fn params_dtype<B: Backend, M: Module<B>>(model: &M) -> Option<DType> {
    struct First(Option<DType>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().dtype());
            }
        }
    }
    let mut v = First(None);
    model.visit(&mut v);
    v.0
}

/// Brings a batch's gradients to float32 and divides them by the loss scale (when there is
/// one), and, when `check` is set, returns a one-element tensor that is finite exactly when
/// every gradient is: the sum over every gradient of its elements times zero (0 for a finite
/// element, NaN for an infinite or NaN one), so the order of the additions cannot change the
/// outcome (unlike a sum of values, see ARCHITECTURE.md). In float32 runs without scaling
/// nothing happens.
pub(crate) fn prepare_gradients<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    grads: GradientsParams,
    inv_scale: Option<f64>,
    check: bool,
) -> (GradientsParams, Option<Tensor<AB::InnerBackend, 1>>) {
    struct Prepare<AB: AutodiffBackend> {
        grads: GradientsParams,
        inv_scale: Option<f64>,
        check: bool,
        flags: Vec<Tensor<AB::InnerBackend, 1>>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Prepare<AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let Some(g) = self.grads.remove::<AB::InnerBackend, D>(param.id) else {
                return;
            };
            let g = cast_to(g, FloatDType::F32);
            let g = match self.inv_scale {
                Some(inv) => g.mul_scalar(inv),
                None => g,
            };
            if self.check {
                let n = g.shape().num_elements();
                self.flags
                    .push(g.clone().reshape([n]).mul_scalar(0.0).sum());
            }
            self.grads.register::<AB::InnerBackend, D>(param.id, g);
        }
    }
    let mut v = Prepare::<AB> {
        grads,
        inv_scale,
        check,
        flags: Vec::new(),
    };
    model.visit(&mut v);
    let flag = (check && !v.flags.is_empty()).then(|| Tensor::cat(v.flags, 0).sum());
    (v.grads, flag)
}

/// Dynamic loss scaling's settings; the defaults are PyTorch's `GradScaler`'s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaling {
    /// The first scale (default 2^16).
    pub init_scale: f64,
    /// Factor on the scale after `growth_interval` steps in a row without overflow (default 2).
    pub growth_factor: f64,
    /// Factor on the scale after an overflow (default 0.5).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (default 2000).
    pub growth_interval: u64,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    /// Checks the settings: a finite scale > 0, a growth factor > 1, a backoff factor in
    /// (0, 1), a growth interval >= 1.
    pub fn validate(&self) -> Result<()> {
        let s = self.init_scale;
        if !(s.is_finite() && s > 0.0) {
            return Err(CoreError::config(
                "loss_scaling.init_scale",
                s,
                "a finite number > 0",
            ));
        }
        let g = self.growth_factor;
        if !(g.is_finite() && g > 1.0) {
            return Err(CoreError::config(
                "loss_scaling.growth_factor",
                g,
                "a finite number > 1",
            ));
        }
        let b = self.backoff_factor;
        if !(b > 0.0 && b < 1.0) {
            return Err(CoreError::config(
                "loss_scaling.backoff_factor",
                b,
                "a number strictly between 0 and 1",
            ));
        }
        if self.growth_interval == 0 {
            return Err(CoreError::config(
                "loss_scaling.growth_interval",
                0,
                "an integer >= 1",
            ));
        }
        Ok(())
    }
}

/// What one step did to the scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleChange {
    /// No change.
    Kept,
    /// Grew after enough clean steps (to this value).
    Grew(f64),
    /// Backed off after an overflow (to this value); the step was skipped.
    BackedOff(f64),
}

/// Dynamic loss scaling's state: saved in checkpoints, so a resumed run scales as the
/// uninterrupted one did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The settings.
    pub settings: LossScaling,
    /// The current scale.
    pub scale: f64,
    /// Steps without overflow since the scale last changed (PyTorch's growth tracker).
    pub clean_steps: u64,
    /// Steps skipped for overflowed gradients over the whole run.
    pub skipped_steps: u64,
}

impl LossScaler {
    /// A scaler at `settings.init_scale`.
    pub fn new(settings: LossScaling) -> Self {
        LossScaler {
            settings,
            scale: settings.init_scale,
            clean_steps: 0,
            skipped_steps: 0,
        }
    }

    /// Records one optimizer step: with `overflowed` gradients the step is skipped and the
    /// scale multiplied by the backoff factor; otherwise, at the `growth_interval`-th clean
    /// step in a row, the scale is multiplied by the growth factor (kept finite in float32,
    /// where the loss is multiplied by it).
    pub fn update(&mut self, overflowed: bool) -> ScaleChange {
        if overflowed {
            self.scale *= self.settings.backoff_factor;
            self.clean_steps = 0;
            self.skipped_steps += 1;
            return ScaleChange::BackedOff(self.scale);
        }
        self.clean_steps += 1;
        if self.clean_steps < self.settings.growth_interval {
            return ScaleChange::Kept;
        }
        self.clean_steps = 0;
        let grown = self.scale * self.settings.growth_factor;
        if grown > f64::from(f32::MAX) {
            return ScaleChange::Kept;
        }
        self.scale = grown;
        ScaleChange::Grew(grown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_in_any_case_and_name_the_accepted_values_otherwise() {
        assert_eq!("AMP_FP16".parse::<Precision>().unwrap(), Precision::AmpFp16);
        assert_eq!("amp-bf16".parse::<Precision>().unwrap(), Precision::AmpBf16);
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
            assert_eq!(serde_json::to_value(p).unwrap(), p.name());
        }
        let e = "fp8".parse::<Precision>().unwrap_err().to_string();
        assert!(e.contains("\"fp8\"") && e.contains("amp_bf16"), "{e}");
    }

    #[test]
    fn each_precision_keeps_parameters_and_computes_in_its_types() {
        use FloatDType::*;
        let cases = [
            (Precision::Fp32, F32, None, false),
            (Precision::Fp16, F16, Some(F16), true),
            (Precision::Bf16, BF16, Some(BF16), false),
            (Precision::AmpFp16, F32, Some(F16), true),
            (Precision::AmpBf16, F32, Some(BF16), false),
        ];
        for (p, params, compute, scales) in cases {
            assert_eq!(p.parameter_dtype(), params, "{p}");
            assert_eq!(p.compute_dtype(), compute, "{p}");
            assert_eq!(p.scales_loss(), scales, "{p}");
        }
    }

    /// PyTorch's `GradScaler` on the same sequence (init 2^16, growth 2 every 3 clean steps,
    /// backoff 0.5): worked out by hand from its update rule.
    #[test]
    fn the_scaler_backs_off_on_overflow_and_grows_after_the_interval() {
        let mut s = LossScaler::new(LossScaling {
            growth_interval: 3,
            ..LossScaling::default()
        });
        let steps = [false, false, true, false, false, false, false, true, true];
        let mut scales = Vec::new();
        let mut changes = Vec::new();
        for o in steps {
            changes.push(s.update(o));
            scales.push(s.scale);
        }
        let k = 65536.0;
        assert_eq!(
            scales,
            [k, k, k / 2.0, k / 2.0, k / 2.0, k, k, k / 2.0, k / 4.0]
        );
        assert_eq!(changes[2], ScaleChange::BackedOff(k / 2.0));
        assert_eq!(changes[5], ScaleChange::Grew(k));
        assert_eq!(s.skipped_steps, 3);
        assert_eq!(s.clean_steps, 0);
    }

    #[test]
    fn the_scale_never_grows_past_float32() {
        let mut s = LossScaler::new(LossScaling {
            init_scale: 2f64.powi(127),
            growth_interval: 1,
            ..LossScaling::default()
        });
        assert_eq!(s.update(false), ScaleChange::Kept);
        assert_eq!(s.scale, 2f64.powi(127));
    }

    #[test]
    fn bad_scaling_settings_are_named() {
        let bad = [
            LossScaling {
                init_scale: 0.0,
                ..LossScaling::default()
            },
            LossScaling {
                growth_factor: 1.0,
                ..LossScaling::default()
            },
            LossScaling {
                backoff_factor: 1.0,
                ..LossScaling::default()
            },
            LossScaling {
                growth_interval: 0,
                ..LossScaling::default()
            },
        ];
        let names = [
            "init_scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
        ];
        for (s, name) in bad.iter().zip(names) {
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        LossScaling::default().validate().unwrap();
    }

    /// A backend without half types (as ndarray is) refuses each half precision by name;
    /// one with float16 only (as wgpu without bfloat16 shaders) lists what it supports.
    #[test]
    fn a_backend_without_the_half_type_is_a_clear_error() {
        let none = |d: DType| d == DType::F32;
        check_precision_with(Precision::Fp32, "ndarray", none).unwrap();
        let e = check_precision_with(Precision::AmpBf16, "ndarray", none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("amp_bf16") && e.contains("BF16") && e.contains("ndarray"),
            "{e}"
        );
        assert!(e.ends_with("precisions it supports here: fp32"), "{e}");
        let f16_only = |d: DType| matches!(d, DType::F32 | DType::F16);
        let e = check_precision_with(Precision::Bf16, "wgpu", f16_only)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("fp32, fp16, amp_fp16"), "{e}");
    }

    #[test]
    fn flex_supports_every_precision() {
        use burn::backend::Flex;
        let device = Default::default();
        for p in Precision::ALL {
            check_precision::<Flex>(p, &device).unwrap();
        }
    }
}
