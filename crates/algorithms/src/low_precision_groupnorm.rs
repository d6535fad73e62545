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
//! Surgery at `INIT` on the group norms the model shows ([`Surgical`]; Flashover's layer:
//! `flashover_models::norm::GroupNorm`); no parameter is added or changed. The layers changed
//! and the half type are the checkpoint state; a checkpoint of another surgery is refused.

use flashover_surgery::{HalfType, LayerKind, SurgeryRecord, Surgical, SurgicalExt};

pub use crate::low_precision_norm::{accelerated_half, norm_half};
use crate::low_precision_norm::{LowPrecisionNorm, NormKind};

/// The group norms of a model (the kind of [`LowPrecisionGroupNorm`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupNorms;

impl NormKind for GroupNorms {
    const NAME: &'static str = "low_precision_groupnorm";
    const LAYER: &'static str = "group norm";
    const KINDS: &'static [LayerKind] = &[LayerKind::GroupNorm];
    const NEEDS: &'static str = "surgery-ready group norms";

    fn set_half<M: Surgical + ?Sized>(model: &mut M, half: HalfType) -> Vec<String> {
        let mut layers = Vec::new();
        model.for_each_group_norm(&mut |info, variant| {
            variant.low_precision = Some(half);
            layers.push(info.path.clone());
        });
        layers
    }
}

/// Makes every group norm of `model` compute in `half` (the functional form; call it
/// before training) and returns what it changed.
pub fn apply_low_precision_groupnorm<M: Surgical + ?Sized>(
    model: &mut M,
    half: HalfType,
) -> SurgeryRecord {
    crate::low_precision_norm::apply::<GroupNorms, M>(model, half)
}

/// The LowPrecisionGroupNorm algorithm: [`apply_low_precision_groupnorm`] at `INIT` in the
/// run's half type, or in a float32 run the backend's accelerated one ([`norm_half`]); an
/// error where there is none.
pub type LowPrecisionGroupNorm = LowPrecisionNorm<GroupNorms>;

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "low_precision_groupnorm", params: []}
crate::spec::by_name! {image |_p, _norm| LowPrecisionGroupNorm::default()}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::low_precision_norm::unsupported;
    use burn::tensor::backend::Backend;
    use flashover_surgery::{GroupNormLayer, GroupNormVariant, Layers, NormInfo};

    struct Norms(Vec<GroupNormVariant>);

    struct Norm<'a>(&'a mut GroupNormVariant);

    impl GroupNormLayer for Norm<'_> {
        fn info(&self, path: &str) -> NormInfo {
            NormInfo {
                path: path.into(),
                channels: 8,
            }
        }

        fn variant(&mut self) -> &mut GroupNormVariant {
            self.0
        }
    }

    impl Surgical for Norms {
        fn visit_layers(&mut self, layers: &mut Layers<'_>) {
            for (i, v) in self.0.iter_mut().enumerate() {
                layers.group_norm(&format!("gn{i}"), &mut Norm(v));
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
        let e = unsupported::<GroupNorms>(<F as Backend>::name(&Default::default())).to_string();
        assert!(
            e.contains("low_precision_groupnorm") && e.contains("float32"),
            "{e}"
        );
    }
}
