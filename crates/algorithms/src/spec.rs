//! Algorithms by name: the `--algorithms` list syntax
//! (`label_smoothing,mixup:alpha=0.2,ema:half_life=100ba`; several parameters are separated by
//! `:` as in `cutout:num_holes=2:length=0.3`) and building the named algorithms for an
//! image-classification model ([`build_image_classification`]) or a language model
//! ([`build_language_model`]). An unknown name or parameter is an error listing the valid ones.

use flashover_core::callback::Algorithm;
use flashover_core::model::{ClassTargets, HasMemoryFormat, Logits, SelectSamples, SequenceBatch};
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::surgery::{
    AttentionSurgery, DropMode, FactorSurgery, GluSurgery, LayerNormSurgery, SurgeryModel,
};
use flashover_core::time::Time;

use crate::alibi::{Alibi, AlibiOptions};
use crate::factorize::Factorize;
use crate::gated_linear_units::{GatedLinearUnits, GluOptions};
use crate::low_precision_layernorm::LowPrecisionLayerNorm;
use crate::seq_length_warmup::SeqLengthWarmup;

use crate::augment::{AugmentationSet, Normalization};
use crate::augmix::{AugMix, AugMixConfig};
use crate::blurpool::BlurPoolOptions;
use crate::channels_last::ChannelsLast;
use crate::colout::ColOut;
use crate::cutmix::CutMix;
use crate::cutout::CutOut;
use crate::ema::Ema;
use crate::error::{AlgorithmError, Result};
use crate::factorize::FactorizeOptions;
use crate::ghost_batchnorm::GhostBatchNorm;
use crate::gradient_clipping::{ClippingType, GradientClipping};
use crate::gyro_dropout::GyroDropoutOptions;
use crate::label_smoothing::LabelSmoothing;
use crate::layer_freezing::LayerFreezing;
use crate::mixup::MixUp;
use crate::progressive_resizing::{ProgressiveResizing, ResizeGrid, ResizeMode};
use crate::randaugment::RandAugment;
use crate::sam::Sam;
use crate::selective_backprop::SelectiveBackprop;
use crate::squeeze_excite::SqueezeExciteOptions;
use crate::stochastic_depth::{DropDistribution, StochasticDepth, StochasticDepthOptions};
use crate::surgery::{NamedSurgery, SurgeryByName};
use crate::swa::{Anneal, Swa, SwaConfig};
use crate::util::ImageClassBatch;

/// One entry of an algorithm list: a name and its `key=value` parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlgorithmSpec {
    /// The algorithm's snake-case name.
    pub name: String,
    /// Parameters in the order given.
    pub params: Vec<(String, String)>,
}

impl std::fmt::Display for AlgorithmSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)?;
        for (k, v) in &self.params {
            write!(f, ":{k}={v}")?;
        }
        Ok(())
    }
}

/// Every algorithm name and its parameters, for error messages and `--help`.
pub const ALGORITHMS: &[(&str, &[&str])] = &[
    ("label_smoothing", &["smoothing"]),
    ("mixup", &["alpha", "interpolate_loss"]),
    ("cutmix", &["alpha", "interpolate_loss"]),
    ("cutout", &["num_holes", "length"]),
    ("colout", &["p_row", "p_col"]),
    (
        "progressive_resizing",
        &[
            "initial_scale",
            "delay_fraction",
            "finetune_fraction",
            "size_increment",
            "mode",
            "grid",
        ],
    ),
    ("randaugment", &["depth", "severity", "augmentation_set"]),
    (
        "augmix",
        &["severity", "depth", "width", "alpha", "augmentation_set"],
    ),
    ("selective_backprop", &["start", "end", "keep", "interrupt"]),
    (
        "gradient_clipping",
        &["clipping_type", "clipping_threshold"],
    ),
    ("ema", &["half_life"]),
    (
        "swa",
        &[
            "swa_start",
            "swa_end",
            "update_interval",
            "schedule_swa_lr",
            "swa_lr",
            "anneal_batches",
            "anneal_strategy",
        ],
    ),
    ("sam", &["rho", "epsilon", "interval"]),
    ("layer_freezing", &["freeze_start", "freeze_level"]),
    ("channels_last", &[]),
    (
        "blurpool",
        &[
            "replace_convs",
            "replace_maxpools",
            "blur_first",
            "min_channels",
        ],
    ),
    ("weight_standardization", &["n_last_layers_ignore"]),
    ("squeeze_excite", &["latent_channels", "min_channels"]),
    ("gyro_dropout", &["p", "sigma", "tau"]),
    (
        "factorize",
        &[
            "factorize_convs",
            "factorize_linears",
            "min_channels",
            "latent_channels",
            "min_features",
            "latent_features",
        ],
    ),
    ("ghost_batchnorm", &["ghost_batch_size"]),
    (
        "stochastic_depth",
        &[
            "stochastic_method",
            "drop_rate",
            "drop_distribution",
            "drop_warmup",
        ],
    ),
    ("low_precision_groupnorm", &[]),
    (
        "seq_length_warmup",
        &[
            "duration",
            "min_seq_length",
            "max_seq_length",
            "step_size",
            "truncate",
        ],
    ),
    (
        "alibi",
        &["max_sequence_length", "train_sequence_length_scaling"],
    ),
    (
        "gated_linear_units",
        &[
            "activation",
            "scale_hidden",
            "gated_layer_bias",
            "non_gated_layer_bias",
        ],
    ),
    ("low_precision_layernorm", &[]),
];

fn valid_names() -> String {
    ALGORITHMS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses an algorithm list (see the module docs). An empty string is an empty list.
pub fn parse_list(input: &str) -> Result<Vec<AlgorithmSpec>> {
    let mut out = Vec::new();
    for item in input.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let mut parts = item.split(':');
        let name = parts.next().unwrap_or_default().trim().to_string();
        let Some((_, allowed)) = ALGORITHMS.iter().find(|(n, _)| *n == name) else {
            return Err(AlgorithmError::UnknownAlgorithm {
                name,
                valid: valid_names(),
            });
        };
        let mut params = Vec::new();
        for p in parts {
            let Some((k, v)) = p.split_once('=') else {
                return Err(AlgorithmError::Parse {
                    input: item.to_string(),
                    reason: format!("parameter {p:?} is not key=value"),
                });
            };
            let (k, v) = (k.trim(), v.trim());
            if !allowed.contains(&k) {
                return Err(AlgorithmError::UnknownParameter {
                    algorithm: name,
                    name: k.to_string(),
                    valid: allowed.join(", "),
                });
            }
            params.push((k.to_string(), v.to_string()));
        }
        out.push(AlgorithmSpec { name, params });
    }
    Ok(out)
}

/// Typed access to a spec's parameters with defaults.
struct Params<'a> {
    spec: &'a AlgorithmSpec,
}

impl Params<'_> {
    fn raw(&self, key: &str) -> Option<&str> {
        self.spec
            .params
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn parse<T: std::str::FromStr>(&self, key: &str, default: T, what: &str) -> Result<T> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| AlgorithmError::Parse {
                input: format!("{}:{key}={v}", self.spec.name),
                reason: format!("expected {what}"),
            }),
        }
    }

    fn f64(&self, key: &str, default: f64) -> Result<f64> {
        self.parse(key, default, "a number")
    }

    fn usize(&self, key: &str, default: usize) -> Result<usize> {
        self.parse(key, default, "a non-negative integer")
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        self.parse(key, default, "true or false")
    }

    fn time(&self, key: &str, default: Time) -> Result<Time> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|e: flashover_core::CoreError| AlgorithmError::Parse {
                    input: format!("{}:{key}={v}", self.spec.name),
                    reason: e.to_string(),
                }),
        }
    }

    fn str<'b>(&'b self, key: &str, default: &'b str) -> &'b str {
        self.raw(key).unwrap_or(default)
    }
}

/// Builds the algorithm `spec` names for an image-classification model whose images are
/// normalised by `norm` (used by RandAugment and AugMix).
pub fn build_image_classification<S: Setup>(
    spec: &AlgorithmSpec,
    norm: &Normalization,
) -> Result<Box<dyn Algorithm<S>>>
where
    BatchOf<S>: ImageClassBatch<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
    S::Model: HasMemoryFormat + SurgeryModel,
{
    if let Some(algorithm) = build_general::<S>(spec)? {
        return Ok(algorithm);
    }
    let p = Params { spec };
    Ok(match spec.name.as_str() {
        name if LANGUAGE_ONLY.contains(&name) => {
            return Err(AlgorithmError::Parse {
                input: spec.to_string(),
                reason: format!(
                    "{name} changes language models (token batches, attention, layer norms), not image classifiers"
                ),
            })
        }
        "mixup" => Box::new(
            MixUp::new(p.f64("alpha", 0.2)?)?
                .with_interpolate_loss(p.bool("interpolate_loss", false)?),
        ),
        "cutmix" => Box::new(
            CutMix::new(p.f64("alpha", 1.0)?)?
                .with_interpolate_loss(p.bool("interpolate_loss", false)?),
        ),
        "cutout" => Box::new(CutOut::new(
            p.usize("num_holes", 1)?,
            p.f64("length", 0.5)?,
        )?),
        "colout" => Box::new(ColOut::new(p.f64("p_row", 0.15)?, p.f64("p_col", 0.15)?)?),
        "progressive_resizing" => {
            let mode = match p.str("mode", "resize") {
                "resize" => ResizeMode::Resize,
                "crop" => ResizeMode::Crop,
                other => {
                    return Err(AlgorithmError::param(
                        "progressive_resizing",
                        "mode",
                        other,
                        "resize or crop",
                    ))
                }
            };
            let grid = ResizeGrid::parse(p.str("grid", "corner"))?;
            Box::new(
                ProgressiveResizing::new()
                    .with(
                        p.f64("initial_scale", 0.5)?,
                        p.f64("delay_fraction", 0.5)?,
                        p.f64("finetune_fraction", 0.2)?,
                        p.usize("size_increment", 4)?,
                        mode,
                    )?
                    .with_grid(grid),
            )
        }
        "randaugment" => Box::new(RandAugment::new(
            p.usize("depth", 1)?,
            p.f64("severity", 9.0)?,
            AugmentationSet::parse(p.str("augmentation_set", "all"), "randaugment")?,
            norm.clone(),
        )?),
        "augmix" => Box::new(AugMix::new(
            AugMixConfig {
                severity: p.f64("severity", 3.0)? as f32,
                depth: p.parse("depth", -1i64, "-1 or an integer >= 1")?,
                width: p.usize("width", 3)?,
                alpha: p.f64("alpha", 1.0)?,
                set: AugmentationSet::parse(p.str("augmentation_set", "all"), "augmix")?,
            },
            norm.clone(),
        )?),
        "channels_last" => Box::new(ChannelsLast),
        "blurpool" => {
            let d = BlurPoolOptions::default();
            Box::new(SurgeryByName::new(NamedSurgery::BlurPool(
                BlurPoolOptions {
                    replace_convs: p.bool("replace_convs", d.replace_convs)?,
                    replace_maxpools: p.bool("replace_maxpools", d.replace_maxpools)?,
                    blur_first: p.bool("blur_first", d.blur_first)?,
                    min_channels: p.usize("min_channels", d.min_channels)?,
                },
            )))
        }
        "ghost_batchnorm" => {
            let size = p.usize(
                "ghost_batch_size",
                GhostBatchNorm::default().ghost_batch_size(),
            )?;
            // The same check as the typed algorithm's, now rather than at INIT.
            GhostBatchNorm::new(size)?;
            Box::new(SurgeryByName::new(NamedSurgery::GhostBatchNorm(size)))
        }
        "stochastic_depth" => {
            let d = StochasticDepthOptions::default();
            let options = StochasticDepthOptions {
                method: match p.str("stochastic_method", "block") {
                    "block" => DropMode::Block,
                    "sample" => DropMode::Sample,
                    other => {
                        return Err(AlgorithmError::param(
                            "stochastic_depth",
                            "stochastic_method",
                            other,
                            "block or sample",
                        ))
                    }
                },
                drop_rate: p.f64("drop_rate", d.drop_rate)?,
                distribution: match p.str("drop_distribution", "linear") {
                    "linear" => DropDistribution::Linear,
                    "uniform" => DropDistribution::Uniform,
                    other => {
                        return Err(AlgorithmError::param(
                            "stochastic_depth",
                            "drop_distribution",
                            other,
                            "linear or uniform",
                        ))
                    }
                },
                drop_warmup: p.f64("drop_warmup", d.drop_warmup)?,
            };
            // The same checks as the typed algorithm's, now rather than at INIT.
            StochasticDepth::new(options)?;
            Box::new(SurgeryByName::new(NamedSurgery::StochasticDepth(options)))
        }
        "weight_standardization" => Box::new(SurgeryByName::new(
            NamedSurgery::WeightStandardization(p.usize("n_last_layers_ignore", 0)?),
        )),
        "squeeze_excite" => {
            let d = SqueezeExciteOptions::default();
            Box::new(SurgeryByName::new(NamedSurgery::SqueezeExcite(
                SqueezeExciteOptions::new(
                    p.f64("latent_channels", d.latent_channels)?,
                    p.usize("min_channels", d.min_channels)?,
                )?,
            )))
        }
        "gyro_dropout" => {
            let d = GyroDropoutOptions::default();
            Box::new(SurgeryByName::new(NamedSurgery::GyroDropout(
                GyroDropoutOptions::new(
                    p.f64("p", d.p)?,
                    p.usize("sigma", d.sigma)?,
                    p.usize("tau", d.tau)?,
                )?,
            )))
        }
        "low_precision_groupnorm" => {
            Box::new(SurgeryByName::new(NamedSurgery::LowPrecisionGroupNorm))
        }
        "factorize" => Box::new(SurgeryByName::new(NamedSurgery::Factorize(
            factorize_options(&p)?,
        ))),
        other => {
            return Err(AlgorithmError::UnknownAlgorithm {
                name: other.to_string(),
                valid: valid_names(),
            })
        }
    })
}

/// The algorithms that apply to any classifier, of images or of tokens (`None` for other
/// names).
fn build_general<S: Setup>(spec: &AlgorithmSpec) -> Result<Option<Box<dyn Algorithm<S>>>>
where
    BatchOf<S>: ClassTargets<S::Backend> + SelectSamples<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
{
    let p = Params { spec };
    Ok(Some(match spec.name.as_str() {
        "label_smoothing" => Box::new(LabelSmoothing::new(p.f64("smoothing", 0.1)?)?),
        "selective_backprop" => Box::new(SelectiveBackprop::new(
            p.f64("start", 0.5)?,
            p.f64("end", 0.9)?,
            p.f64("keep", 0.5)?,
            p.parse("interrupt", 2u64, "a non-negative integer")?,
        )?),
        "gradient_clipping" => Box::new(GradientClipping::new(
            ClippingType::parse(p.str("clipping_type", "norm"))?,
            p.f64("clipping_threshold", 1.0)?,
        )?),
        "ema" => Box::new(Ema::<S::Backend>::new(
            p.time("half_life", Time::Batch(1000))?,
        )?),
        "swa" => {
            let anneal = match p.str("anneal_strategy", "linear") {
                "linear" => Anneal::Linear,
                "cos" => Anneal::Cos,
                other => {
                    return Err(AlgorithmError::param(
                        "swa",
                        "anneal_strategy",
                        other,
                        "linear or cos",
                    ))
                }
            };
            let swa_lr = match p.raw("swa_lr") {
                None => None,
                Some(_) => Some(p.f64("swa_lr", 0.0)?),
            };
            Box::new(Swa::<S::Backend>::new(SwaConfig {
                swa_start: p.f64("swa_start", 0.7)?,
                swa_end: p.f64("swa_end", 1.0)?,
                update_interval: p.time("update_interval", Time::Epoch(1))?,
                schedule_swa_lr: p.bool("schedule_swa_lr", false)?,
                swa_lr,
                anneal_batches: p.parse("anneal_batches", 10u64, "a non-negative integer")?,
                anneal,
            })?)
        }
        "sam" => Box::new(Sam::new(
            p.f64("rho", 0.05)?,
            p.f64("epsilon", 1e-12)?,
            p.parse("interval", 1u64, "an integer >= 1")?,
        )?),
        "layer_freezing" => Box::new(LayerFreezing::new(
            p.f64("freeze_start", 0.5)?,
            p.f64("freeze_level", 1.0)?,
        )?),
        _ => return Ok(None),
    }))
}

/// The names only language models take.
const LANGUAGE_ONLY: &[&str] = &[
    "alibi",
    "gated_linear_units",
    "low_precision_layernorm",
    "seq_length_warmup",
];

/// The names only image models take.
const IMAGE_ONLY: &[&str] = &[
    "mixup",
    "cutmix",
    "cutout",
    "colout",
    "progressive_resizing",
    "randaugment",
    "augmix",
    "channels_last",
    "blurpool",
    "weight_standardization",
    "squeeze_excite",
    "gyro_dropout",
    "ghost_batchnorm",
    "stochastic_depth",
    "low_precision_groupnorm",
];

/// Builds the algorithm `spec` names for a language model on token batches (Flashover's
/// GPT, or any model with the same surgery capabilities): the general algorithms (label
/// smoothing on every token, selective backprop by sequence, gradient clipping, EMA, SWA,
/// SAM, layer freezing), sequence-length warmup, ALiBi, gated linear units,
/// low-precision layer norm and Factorize on the dense layers. An image algorithm is an
/// error naming it.
pub fn build_language_model<S: Setup>(spec: &AlgorithmSpec) -> Result<Box<dyn Algorithm<S>>>
where
    BatchOf<S>: ClassTargets<S::Backend> + SelectSamples<S::Backend> + SequenceBatch<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
    S::Model: AttentionSurgery + GluSurgery + LayerNormSurgery + FactorSurgery,
{
    if let Some(algorithm) = build_general::<S>(spec)? {
        return Ok(algorithm);
    }
    let p = Params { spec };
    Ok(match spec.name.as_str() {
        "seq_length_warmup" => Box::new(SeqLengthWarmup::<S::Backend>::new(
            p.f64("duration", 0.3)?,
            p.usize("min_seq_length", 8)?,
            p.usize("max_seq_length", 1024)?,
            p.usize("step_size", 8)?,
            p.bool("truncate", true)?,
        )?),
        "alibi" => {
            let d = AlibiOptions::default();
            Box::new(Alibi::new(AlibiOptions::new(
                p.usize("max_sequence_length", d.max_sequence_length)?,
                p.f64(
                    "train_sequence_length_scaling",
                    d.train_sequence_length_scaling,
                )?,
            )?))
        }
        "gated_linear_units" => {
            let d = GluOptions::default();
            Box::new(GatedLinearUnits::new(GluOptions {
                activation: GluOptions::activation(p.str("activation", d.activation.name()))?,
                scale_hidden: p.bool("scale_hidden", d.scale_hidden)?,
                gated_layer_bias: p.bool("gated_layer_bias", d.gated_layer_bias)?,
                non_gated_layer_bias: p.bool("non_gated_layer_bias", d.non_gated_layer_bias)?,
            }))
        }
        "low_precision_layernorm" => Box::new(LowPrecisionLayerNorm::default()),
        "factorize" => Box::new(Factorize::new(factorize_options(&p)?)?),
        name if IMAGE_ONLY.contains(&name) => {
            return Err(AlgorithmError::Parse {
                input: spec.to_string(),
                reason: format!(
                    "{name} changes image models (images, convolutions, pools, batch or group norms, residual blocks), not language models"
                ),
            })
        }
        other => {
            return Err(AlgorithmError::UnknownAlgorithm {
                name: other.to_string(),
                valid: valid_names(),
            })
        }
    })
}

/// Factorize's settings from its parameters, checked.
fn factorize_options(p: &Params<'_>) -> Result<FactorizeOptions> {
    let d = FactorizeOptions::default();
    FactorizeOptions {
        factorize_convs: p.bool("factorize_convs", d.factorize_convs)?,
        factorize_linears: p.bool("factorize_linears", d.factorize_linears)?,
        min_channels: p.usize("min_channels", d.min_channels)?,
        latent_channels: p.f64("latent_channels", d.latent_channels)?,
        min_features: p.usize("min_features", d.min_features)?,
        latent_features: p.f64("latent_features", d.latent_features)?,
    }
    .check()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_parameters() {
        let l = parse_list(
            "label_smoothing, mixup:alpha=0.2,ema:half_life=100ba,cutout:num_holes=2:length=0.3",
        )
        .unwrap();
        assert_eq!(l.len(), 4);
        assert_eq!(l[1].params, vec![("alpha".to_string(), "0.2".to_string())]);
        assert_eq!(l[3].to_string(), "cutout:num_holes=2:length=0.3");
        assert!(parse_list("").unwrap().is_empty());
    }

    #[test]
    fn unknown_names_and_parameters_list_the_valid_ones() {
        let e = parse_list("mixup,blur_pool").err().unwrap().to_string();
        assert!(
            e.contains("\"blur_pool\"")
                && e.contains("label_smoothing")
                && e.contains("layer_freezing")
                && e.contains(
                    "weight_standardization, squeeze_excite, gyro_dropout, factorize, ghost_batchnorm"
                ),
            "{e}"
        );
        let l = parse_list(
            "blurpool:blur_first=false:min_channels=8,ghost_batchnorm:ghost_batch_size=16",
        )
        .unwrap();
        assert_eq!(l[0].to_string(), "blurpool:blur_first=false:min_channels=8");
        let e = parse_list("ghost_batchnorm:size=16")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("\"size\"") && e.contains("ghost_batch_size"),
            "{e}"
        );
        let e = parse_list("mixup:beta=1").err().unwrap().to_string();
        assert!(
            e.contains("\"beta\"") && e.contains("alpha, interpolate_loss"),
            "{e}"
        );
        let e = parse_list("mixup:alpha").err().unwrap().to_string();
        assert!(e.contains("key=value"), "{e}");
    }
}
