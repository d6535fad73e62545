//! Low-precision layer norm (Composer's `LowPrecisionLayerNorm`): layer normalisation
//! computed in a half-precision type (activations, scale and shift cast down, the result cast
//! back), so that a mixed-precision transformer's layer norms stop running in float32. It
//! saves memory traffic and time on accelerators with fast half types, at the cost of the
//! normalisation's precision (bf16 keeps 8 bits of mantissa, f16 11).
//!
//! The half type is chosen as for [`LowPrecisionGroupNorm`](crate::low_precision_groupnorm):
//! bf16 where the device runs it accelerated, else f16; a backend with neither (flex, the CPU
//! backend) is refused at `INIT` with an error naming it. No hyperparameters. When it helps:
//! transformers on a GPU in mixed precision.
//!
//! Surgery at `INIT` on the layer norms the model shows ([`Surgical`]; Flashover's layer:
//! `flashover_models::norm::LayerNorm`); no parameter is added or changed. The layers
//! changed and the half type are the checkpoint state.

use flashover_surgery::{HalfType, LayerKind, SurgeryRecord, Surgical, SurgicalExt};

use crate::low_precision_norm::{LowPrecisionNorm, NormKind};

/// The layer norms of a model (the kind of [`LowPrecisionLayerNorm`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerNorms;

impl NormKind for LayerNorms {
    const NAME: &'static str = "low_precision_layernorm";
    const LAYER: &'static str = "layer norm";
    const KINDS: &'static [LayerKind] = &[LayerKind::LayerNorm];
    const NEEDS: &'static str = "surgery-ready layer norms";

    fn set_half<M: Surgical + ?Sized>(model: &mut M, half: HalfType) -> Vec<String> {
        let mut layers = Vec::new();
        model.for_each_layer_norm(&mut |info, variant| {
            variant.low_precision = Some(half);
            layers.push(info.path.clone());
        });
        layers
    }
}

/// Makes every layer norm of `model` compute in `half` (the functional form; call it before
/// training) and returns what it changed.
pub fn apply_low_precision_layernorm<M: Surgical + ?Sized>(
    model: &mut M,
    half: HalfType,
) -> SurgeryRecord {
    crate::low_precision_norm::apply::<LayerNorms, M>(model, half)
}

/// The LowPrecisionLayerNorm algorithm: [`apply_low_precision_layernorm`] at `INIT` in the
/// run's half type, or in a float32 run the backend's accelerated one
/// ([`norm_half`](crate::low_precision_norm::norm_half)); an error where there is none.
pub type LowPrecisionLayerNorm = LowPrecisionNorm<LayerNorms>;

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "low_precision_layernorm", params: []}
crate::spec::by_name! {language |_p| LowPrecisionLayerNorm::default()}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::low_precision_norm::norm_half;
    use burn::tensor::backend::Backend;
    use flashover_surgery::{LayerNormLayer, LayerNormVariant, Layers, NormInfo};

    struct Norms(Vec<LayerNormVariant>);

    struct Norm<'a>(&'a mut LayerNormVariant);

    impl LayerNormLayer for Norm<'_> {
        fn info(&self, path: &str) -> NormInfo {
            NormInfo {
                path: path.into(),
                channels: 8,
            }
        }

        fn variant(&mut self) -> &mut LayerNormVariant {
            self.0
        }
    }

    impl Surgical for Norms {
        fn visit_layers(&mut self, layers: &mut Layers<'_>) {
            for (i, v) in self.0.iter_mut().enumerate() {
                layers.layer_norm(&format!("ln{i}"), &mut Norm(v));
            }
        }
    }

    #[test]
    fn every_layer_norm_gets_the_half_type() {
        let mut m = Norms(vec![LayerNormVariant::default(); 3]);
        let record = apply_low_precision_layernorm(&mut m, HalfType::F16);
        assert_eq!(record.layers, ["ln0", "ln1", "ln2"]);
        assert_eq!(record.settings, "low_precision_layernorm:f16");
        assert!(m.0.iter().all(|v| v.low_precision == Some(HalfType::F16)));
    }

    #[test]
    fn the_cpu_backend_is_refused_by_name_in_a_float32_run_only() {
        use flashover_core::precision::Precision;
        type F = burn::backend::Flex;
        let d = Default::default();
        assert_eq!(norm_half::<F>(Precision::Fp32, &d), None);
        assert_eq!(norm_half::<F>(Precision::AmpBf16, &d), Some(HalfType::BF16));
        assert_eq!(norm_half::<F>(Precision::Fp16, &d), Some(HalfType::F16));
        let e = crate::low_precision_norm::unsupported::<LayerNorms>(<F as Backend>::name(
            &Default::default(),
        ))
        .to_string();
        assert!(
            e.contains("low_precision_layernorm") && e.contains("float32"),
            "{e}"
        );
    }
}
