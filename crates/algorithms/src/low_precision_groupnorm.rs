//! Low-precision group norm (Composer's `LowPrecisionGroupNorm`): group normalisation
//! computed in a half-precision type, activations, scale and shift cast down and the result
//! cast back, so that a mixed-precision model's group norms stop running in float32 (in
//! PyTorch, autocast keeps `group_norm` in float32; Composer's replacement runs it in the
//! autocast type). It saves memory traffic and time on accelerators with fast half types;
//! the normalisation loses precision (bf16 keeps 8 bits of mantissa, f16 11).
//!
//! The half type is the backend's: bf16 where the device runs it accelerated, else f16 where
//! that is accelerated (Burn's `DTypeUsage::Accelerated`: tensor cores on CUDA, GPU shader
//! support on wgpu). Where neither is, the algorithm refuses to start, naming the backend,
//! rather than emulate half precision in software (slower and less precise: on flex, the
//! CPU backend, half types exist only as emulated storage). Composer's version is a no-op
//! without autocast; here the choice is explicit.
//!
//! No hyperparameters. When it helps: models with group norms (detection and segmentation
//! backbones, small-batch training) on a GPU in mixed precision.
//!
//! Surgery at `INIT` through the model's [`GroupNormSurgery`] (Flashover's layer:
//! `flashover_models::norm::GroupNorm`); no parameter is added or changed. The layers changed
//! and the half type are the checkpoint state; a checkpoint of another surgery is refused.

use burn::tensor::backend::Backend;
use burn::tensor::backend::DTypeUsage;
use burn::tensor::DType;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::precision::Precision;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::surgery::{GroupNormSurgery, HalfType, SurgeryRecord};

use crate::error::AlgorithmError;
use crate::surgery::{surgery_at_init, Applied};

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

/// A low-precision normalisation's settings in the `--algorithms` syntax, with the half type
/// chosen (shared with `low_precision_layernorm`).
pub(crate) fn describe_half(algorithm: &str, half: Option<HalfType>) -> String {
    match half {
        Some(HalfType::BF16) => format!("{algorithm}:bf16"),
        Some(HalfType::F16) => format!("{algorithm}:f16"),
        None => algorithm.to_string(),
    }
}

/// A low-precision normalisation's error for a backend without an accelerated half type:
/// `layer` then stays in float32 (shared with `low_precision_layernorm`).
pub(crate) fn no_half_type(
    algorithm: &'static str,
    layer: &str,
    backend: String,
) -> AlgorithmError {
    AlgorithmError::param(
        algorithm,
        "backend",
        backend,
        format!("a run in a half or mixed precision (--precision amp_bf16, amp_fp16, bf16 or fp16), or a backend whose device runs f16 or bf16 accelerated (cuda, or wgpu on a GPU with half-precision matrix units); this float32 run on this backend would keep {layer} in float32: set a precision or remove the algorithm"),
    )
}

/// The settings in the `--algorithms` syntax, with the half type chosen.
pub(crate) fn describe(half: Option<HalfType>) -> String {
    describe_half("low_precision_groupnorm", half)
}

/// The error for a backend without an accelerated half type.
pub(crate) fn unsupported(backend: String) -> AlgorithmError {
    no_half_type("low_precision_groupnorm", "group norm", backend)
}

/// Makes every group norm of `model` compute in `half` (the functional form; call it
/// before training) and returns what it changed.
pub fn apply_low_precision_groupnorm<M: GroupNormSurgery + ?Sized>(
    model: &mut M,
    half: HalfType,
) -> SurgeryRecord {
    let mut layers = Vec::new();
    model.for_each_group_norm(&mut |info, variant| {
        variant.low_precision = Some(half);
        layers.push(info.path.clone());
    });
    SurgeryRecord {
        settings: describe(Some(half)),
        layers,
    }
}

/// The LowPrecisionGroupNorm algorithm: [`apply_low_precision_groupnorm`] at `INIT` in the
/// run's half type, or in a float32 run the backend's accelerated one ([`norm_half`]); an
/// error where there is none.
#[derive(Debug, Clone, Default)]
pub struct LowPrecisionGroupNorm {
    half: Option<HalfType>,
    applied: Applied,
}

impl<S: Setup> Algorithm<S> for LowPrecisionGroupNorm
where
    S::Model: GroupNormSurgery,
{
    surgery_at_init!("low_precision_groupnorm", |this| describe(this.half));

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let half = norm_half::<S::Backend>(state.precision, &state.device)
            .ok_or_else(|| unsupported(S::Backend::name(&state.device)))?;
        self.half = Some(half);
        self.applied.run("low_precision_groupnorm", state, |model| {
            Ok(apply_low_precision_groupnorm(model, half))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name!(name: "low_precision_groupnorm", params: []);
crate::spec::by_name!(
    image | _p,
    _norm
        | crate::surgery::SurgeryByName::new(crate::surgery::NamedSurgery::LowPrecisionGroupNorm,)
);

#[cfg(test)]
mod tests {
    use super::*;
    use flashover_core::surgery::{GroupNormVariant, NormInfo};

    struct Norms(Vec<GroupNormVariant>);

    impl GroupNormSurgery for Norms {
        fn for_each_group_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut GroupNormVariant)) {
            for (i, v) in self.0.iter_mut().enumerate() {
                let info = NormInfo {
                    path: format!("gn{i}"),
                    channels: 8,
                };
                f(&info, v);
            }
        }
    }

    #[test]
    fn every_group_norm_gets_the_half_type() {
        let mut m = Norms(vec![GroupNormVariant::default(); 2]);
        let record = apply_low_precision_groupnorm(&mut m, HalfType::BF16);
        assert_eq!(record.layers, ["gn0", "gn1"]);
        assert_eq!(record.settings, "low_precision_groupnorm:bf16");
        assert!(m.0.iter().all(|v| v.low_precision == Some(HalfType::BF16)));
    }

    #[test]
    fn the_cpu_backend_has_no_accelerated_half_type_and_the_error_says_so() {
        type F = burn::backend::Flex;
        assert_eq!(accelerated_half::<F>(&Default::default()), None);
        let e = unsupported(<F as Backend>::name(&Default::default())).to_string();
        assert!(
            e.contains("low_precision_groupnorm") && e.contains("float32"),
            "{e}"
        );
    }
}
