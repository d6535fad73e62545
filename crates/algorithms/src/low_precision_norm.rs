//! What the two low-precision normalisations ([`LowPrecisionGroupNorm`] and
//! [`LowPrecisionLayerNorm`]) share: the half type they compute in, their settings and their
//! error, and the algorithm itself, generic over which norms it changes ([`NormKind`], which
//! also walks them on a `Surgical` model). Each kind's module adds its name, its layer kind,
//! its walk and its documentation.
//!
//! [`LowPrecisionGroupNorm`]: crate::low_precision_groupnorm::LowPrecisionGroupNorm
//! [`LowPrecisionLayerNorm`]: crate::low_precision_layernorm::LowPrecisionLayerNorm

use std::marker::PhantomData;

use burn::tensor::backend::{Backend, DTypeUsage};
use burn::tensor::DType;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::precision::Precision;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{HalfType, LayerKind, SurgeryRecord, Surgical};

use crate::error::AlgorithmError;
use crate::surgery::{surgery_at_init, Applied, Needs};

/// The half type `B` runs accelerated on `device`: bf16 first, then f16; `None` where
/// neither is.
pub fn accelerated_half<B: Backend>(device: &B::Device) -> Option<HalfType> {
    let fast = |d: DType| B::dtype_usage(device, d).contains(DTypeUsage::Accelerated);
    if fast(DType::BF16) {
        Some(HalfType::BF16)
    } else if fast(DType::F16) {
        Some(HalfType::F16)
    } else {
        None
    }
}

/// The half type the low-precision norms compute in: the run's, when it trains in a half or
/// mixed precision (the norms then join the rest of the forward pass in that type, where
/// they would otherwise be float32: Composer's use of them under autocast); in a float32
/// run, the device's accelerated half type ([`accelerated_half`]); `None` where neither is.
pub fn norm_half<B: Backend>(precision: Precision, device: &B::Device) -> Option<HalfType> {
    precision.half().or_else(|| accelerated_half::<B>(device))
}

/// Which norms a low-precision algorithm changes.
pub trait NormKind: std::fmt::Debug + Clone + Default + Send + Sync + 'static {
    /// The algorithm's name.
    const NAME: &'static str;
    /// The layers, in words (`group norm`).
    const LAYER: &'static str;
    /// The kind of layer, for surgery.
    const KINDS: &'static [LayerKind];
    /// The layers as the error for a model without any names them.
    const NEEDS: &'static str;

    /// Sets `half` on every norm of this kind in `model`; returns their paths.
    fn set_half<M: Surgical + ?Sized>(model: &mut M, half: HalfType) -> Vec<String>;
}

/// The algorithm's settings in the `--algorithms` syntax, with the half type chosen.
pub fn describe<K: NormKind>(half: Option<HalfType>) -> String {
    match half {
        Some(HalfType::BF16) => format!("{}:bf16", K::NAME),
        Some(HalfType::F16) => format!("{}:f16", K::NAME),
        None => K::NAME.to_string(),
    }
}

/// The error for a backend without an accelerated half type: the norms would then stay in
/// float32.
pub fn unsupported<K: NormKind>(backend: String) -> AlgorithmError {
    AlgorithmError::param(
        K::NAME,
        "backend",
        backend,
        format!("a run in a half or mixed precision (--precision amp_bf16, amp_fp16, bf16 or fp16), or a backend whose device runs f16 or bf16 accelerated (cuda, or wgpu on a GPU with half-precision matrix units); this float32 run on this backend would keep {} in float32: set a precision or remove the algorithm", K::LAYER),
    )
}

/// Makes every norm of kind `K` of `model` compute in `half` (the functional form; call it
/// before training) and returns what it changed.
pub fn apply<K: NormKind, M: Surgical + ?Sized>(model: &mut M, half: HalfType) -> SurgeryRecord {
    SurgeryRecord {
        settings: describe::<K>(Some(half)),
        layers: K::set_half(model, half),
    }
}

/// A low-precision normalisation: [`apply`] at `INIT` in the run's half type, or in a float32
/// run the backend's accelerated one ([`norm_half`]); an error where there is none.
#[derive(Debug, Clone, Default)]
pub struct LowPrecisionNorm<K> {
    half: Option<HalfType>,
    applied: Applied,
    kind: PhantomData<K>,
}

impl<S: Setup, K: NormKind> Algorithm<S> for LowPrecisionNorm<K>
where
    S::Model: Surgical,
{
    surgery_at_init!(K::NAME, |this| describe::<K>(this.half));

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let half = norm_half::<S::Backend>(state.precision(), state.device())
            .ok_or_else(|| unsupported::<K>(S::Backend::name(state.device())))?;
        self.half = Some(half);
        let needs = Needs {
            algorithm: K::NAME,
            kinds: K::KINDS,
            describe: K::NEEDS,
        };
        self.applied
            .run(needs, state, |model| Ok(apply::<K, _>(model, half)))
    }
}
