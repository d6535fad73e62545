//! Algorithms by name: the `--algorithms` list syntax
//! (`label_smoothing,mixup:alpha=0.2,ema:half_life=100ba`; several parameters are separated by
//! `:` as in `cutout:num_holes=2:length=0.3`) and building the named algorithms for an
//! image-classification model ([`build_image_classification`]) or a language model
//! ([`build_language_model`]). An unknown name or parameter is an error listing the valid ones.
//!
//! **One registry.** Each algorithm's module declares, once, its name and parameters
//! (`by_name! {name: ..., params: [...]}`) and its constructor from parameters for the
//! workloads it takes (`by_name! {general |p| ...}` for any classifier, `image`, `language`;
//! braces, so that rustfmt leaves the closure-like syntax alone). The
//! `registry!` call below lists each module once per workload; the parser, the error
//! messages, [`help`] (the examples' `--algorithms` help) and the refusals of the other
//! workload's algorithms are generated from it. Adding an algorithm is its module plus its name
//! in that list.

use flashover_core::callback::Algorithm;
use flashover_core::model::{ClassTargets, HasMemoryFormat, Logits, SelectSamples, SequenceBatch};
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::time::Time;
use flashover_surgery::Surgical;

use crate::augment::Normalization;
use crate::error::{AlgorithmError, Result};
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

/// An algorithm's name in `--algorithms` lists and the parameters it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Named {
    /// The snake-case name.
    pub name: &'static str,
    /// The `key=value` parameters it accepts.
    pub params: &'static [&'static str],
}

/// Declares, in an algorithm's module, its name and parameters (`NAMED`) or its constructor
/// from `--algorithms` parameters for one workload: `general` (any classifier, of images or of
/// tokens: `build_general`), `image` (an image classifier whose images are normalised by the
/// given `Normalization`: `build_image`) or `language` (a language model on token batches:
/// `build_language`). The body is the algorithm value, built from the `Params` (and the
/// normalisation) bound to the names given.
macro_rules! by_name {
    (name: $name:literal, params: [$($param:literal),* $(,)?] $(,)?) => {
        /// This algorithm's name and parameters in `--algorithms` lists (see [`crate::spec`]).
        pub const NAMED: $crate::spec::Named = $crate::spec::Named {
            name: $name,
            params: &[$($param),*],
        };
    };
    (general |$p:ident| $body:expr) => {
        /// Builds this algorithm from its `--algorithms` parameters, for any classifier.
        pub(crate) fn build_general<S: flashover_core::setup::Setup>(
            $p: &$crate::spec::Params<'_>,
        ) -> $crate::error::Result<Box<dyn flashover_core::callback::Algorithm<S>>>
        where
            flashover_core::setup::BatchOf<S>: flashover_core::model::ClassTargets<S::Backend>
                + flashover_core::model::SelectSamples<S::Backend>,
            flashover_core::setup::OutputOf<S>: flashover_core::model::Logits<S::Backend>,
        {
            Ok(Box::new($body))
        }
    };
    (image |$p:ident, $norm:ident| $body:expr) => {
        /// Builds this algorithm from its `--algorithms` parameters, for an image classifier.
        pub(crate) fn build_image<S: flashover_core::setup::Setup>(
            $p: &$crate::spec::Params<'_>,
            $norm: &$crate::augment::Normalization,
        ) -> $crate::error::Result<Box<dyn flashover_core::callback::Algorithm<S>>>
        where
            flashover_core::setup::BatchOf<S>: $crate::util::ImageClassBatch<S::Backend>,
            flashover_core::setup::OutputOf<S>: flashover_core::model::Logits<S::Backend>,
            S::Model: flashover_core::model::HasMemoryFormat + flashover_surgery::Surgical,
        {
            Ok(Box::new($body))
        }
    };
    (language |$p:ident| $body:expr) => {
        /// Builds this algorithm from its `--algorithms` parameters, for a language model.
        pub(crate) fn build_language<S: flashover_core::setup::Setup>(
            $p: &$crate::spec::Params<'_>,
        ) -> $crate::error::Result<Box<dyn flashover_core::callback::Algorithm<S>>>
        where
            flashover_core::setup::BatchOf<S>: flashover_core::model::ClassTargets<S::Backend>
                + flashover_core::model::SelectSamples<S::Backend>
                + flashover_core::model::SequenceBatch<S::Backend>,
            flashover_core::setup::OutputOf<S>: flashover_core::model::Logits<S::Backend>,
            S::Model: flashover_surgery::Surgical,
        {
            Ok(Box::new($body))
        }
    };
}
pub(crate) use by_name;

/// Generates, from the lists of modules per workload, everything that goes by name: the
/// table of names and parameters, the workload tests and the three dispatchers.
macro_rules! registry {
    (
        general: [$($g:ident),* $(,)?],
        image: [$($i:ident),* $(,)?],
        language: [$($l:ident),* $(,)?] $(,)?
    ) => {
        /// Every algorithm's name and parameters, in registry order, each once.
        pub fn algorithms() -> Vec<Named> {
            let all = [$(crate::$g::NAMED,)* $(crate::$i::NAMED,)* $(crate::$l::NAMED,)*];
            let mut out: Vec<Named> = Vec::new();
            for n in all {
                if !out.contains(&n) {
                    out.push(n);
                }
            }
            out
        }

        /// The general algorithms' names.
        fn general_names() -> Vec<&'static str> {
            vec![$(crate::$g::NAMED.name),*]
        }

        /// The names an image classifier takes beyond the general ones.
        fn image_names() -> Vec<&'static str> {
            vec![$(crate::$i::NAMED.name),*]
        }

        /// The names a language model takes beyond the general ones.
        fn language_names() -> Vec<&'static str> {
            vec![$(crate::$l::NAMED.name),*]
        }

        fn dispatch_general<S: Setup>(
            spec: &AlgorithmSpec,
            p: &Params<'_>,
        ) -> Option<Result<Box<dyn Algorithm<S>>>>
        where
            BatchOf<S>: ClassTargets<S::Backend> + SelectSamples<S::Backend>,
            OutputOf<S>: Logits<S::Backend>,
        {
            $(if spec.name == crate::$g::NAMED.name {
                return Some(crate::$g::build_general::<S>(p));
            })*
            None
        }

        fn dispatch_image<S: Setup>(
            spec: &AlgorithmSpec,
            p: &Params<'_>,
            norm: &Normalization,
        ) -> Option<Result<Box<dyn Algorithm<S>>>>
        where
            BatchOf<S>: ImageClassBatch<S::Backend>,
            OutputOf<S>: Logits<S::Backend>,
            S::Model: HasMemoryFormat + Surgical,
        {
            $(if spec.name == crate::$i::NAMED.name {
                return Some(crate::$i::build_image::<S>(p, norm));
            })*
            None
        }

        fn dispatch_language<S: Setup>(
            spec: &AlgorithmSpec,
            p: &Params<'_>,
        ) -> Option<Result<Box<dyn Algorithm<S>>>>
        where
            BatchOf<S>: ClassTargets<S::Backend>
                + SelectSamples<S::Backend>
                + SequenceBatch<S::Backend>,
            OutputOf<S>: Logits<S::Backend>,
            S::Model: flashover_surgery::Surgical,
        {
            $(if spec.name == crate::$l::NAMED.name {
                return Some(crate::$l::build_language::<S>(p));
            })*
            None
        }
    };
}

// The registry: each algorithm once per workload it takes (Factorize takes both: convolutions
// and dense layers of an image model, dense layers of a language model).
registry! {
    general: [
        label_smoothing,
        selective_backprop,
        gradient_clipping,
        ema,
        swa,
        sam,
        layer_freezing,
    ],
    image: [
        mixup,
        cutmix,
        cutout,
        colout,
        progressive_resizing,
        randaugment,
        augmix,
        channels_last,
        blurpool,
        weight_standardization,
        squeeze_excite,
        gyro_dropout,
        factorize,
        ghost_batchnorm,
        stochastic_depth,
        low_precision_groupnorm,
    ],
    language: [
        seq_length_warmup,
        alibi,
        gated_linear_units,
        low_precision_layernorm,
        factorize,
    ],
}

fn valid_names() -> String {
    algorithms()
        .iter()
        .map(|n| n.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The names `--algorithms` takes, by workload, for a program's help: `image` for an image
/// classifier's, otherwise a language model's.
pub fn help(image: bool) -> String {
    let mut names = general_names();
    names.extend(if image {
        image_names()
    } else {
        language_names()
    });
    format!(
        "Speed-up algorithms, comma-separated, each with optional `:key=value` parameters, for example `{}`. Names: {}. Added after the recipe's.",
        if image {
            "label_smoothing,mixup:alpha=0.2,ema:half_life=100ba"
        } else {
            "alibi:train_sequence_length_scaling=0.5,gated_linear_units"
        },
        names.join(", ")
    )
}

/// Parses an algorithm list (see the module docs). An empty string is an empty list.
pub fn parse_list(input: &str) -> Result<Vec<AlgorithmSpec>> {
    let table = algorithms();
    let mut out = Vec::new();
    for item in input.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let mut parts = item.split(':');
        let name = parts.next().unwrap_or_default().trim().to_string();
        let Some(named) = table.iter().find(|n| n.name == name) else {
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
            if !named.params.contains(&k) {
                return Err(AlgorithmError::UnknownParameter {
                    algorithm: name,
                    name: k.to_string(),
                    valid: named.params.join(", "),
                });
            }
            params.push((k.to_string(), v.to_string()));
        }
        out.push(AlgorithmSpec { name, params });
    }
    Ok(out)
}

/// Typed access to a spec's parameters with defaults (what each algorithm's constructor
/// by name reads).
pub(crate) struct Params<'a> {
    spec: &'a AlgorithmSpec,
}

impl Params<'_> {
    pub(crate) fn raw(&self, key: &str) -> Option<&str> {
        self.spec
            .params
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn parse<T: std::str::FromStr>(
        &self,
        key: &str,
        default: T,
        what: &str,
    ) -> Result<T> {
        match self.raw(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| AlgorithmError::Parse {
                input: format!("{}:{key}={v}", self.spec.name),
                reason: format!("expected {what}"),
            }),
        }
    }

    pub(crate) fn f64(&self, key: &str, default: f64) -> Result<f64> {
        self.parse(key, default, "a number")
    }

    pub(crate) fn usize(&self, key: &str, default: usize) -> Result<usize> {
        self.parse(key, default, "a non-negative integer")
    }

    pub(crate) fn bool(&self, key: &str, default: bool) -> Result<bool> {
        self.parse(key, default, "true or false")
    }

    pub(crate) fn time(&self, key: &str, default: Time) -> Result<Time> {
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

    pub(crate) fn str<'b>(&'b self, key: &str, default: &'b str) -> &'b str {
        self.raw(key).unwrap_or(default)
    }
}

/// Builds the algorithm `spec` names for an image-classification model whose images are
/// normalised by `norm` (used by RandAugment and AugMix). A language model's algorithm is an
/// error naming it.
pub fn build_image_classification<S: Setup>(
    spec: &AlgorithmSpec,
    norm: &Normalization,
) -> Result<Box<dyn Algorithm<S>>>
where
    BatchOf<S>: ImageClassBatch<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
    S::Model: HasMemoryFormat + Surgical,
{
    let p = Params { spec };
    if let Some(built) = dispatch_general::<S>(spec, &p) {
        return built;
    }
    if let Some(built) = dispatch_image::<S>(spec, &p, norm) {
        return built;
    }
    if language_names().contains(&spec.name.as_str()) {
        return Err(AlgorithmError::Parse {
            input: spec.to_string(),
            reason: format!(
                "{} changes language models (token batches, attention, layer norms), not image classifiers",
                spec.name
            ),
        });
    }
    Err(AlgorithmError::UnknownAlgorithm {
        name: spec.name.clone(),
        valid: valid_names(),
    })
}

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
    S::Model: Surgical,
{
    let p = Params { spec };
    if let Some(built) = dispatch_general::<S>(spec, &p) {
        return built;
    }
    if let Some(built) = dispatch_language::<S>(spec, &p) {
        return built;
    }
    if image_names().contains(&spec.name.as_str()) {
        return Err(AlgorithmError::Parse {
            input: spec.to_string(),
            reason: format!(
                "{} changes image models (images, convolutions, pools, batch or group norms, residual blocks), not language models",
                spec.name
            ),
        });
    }
    Err(AlgorithmError::UnknownAlgorithm {
        name: spec.name.clone(),
        valid: valid_names(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_names_each_algorithm_once_and_the_help_each_workloads() {
        let names: Vec<&str> = algorithms().iter().map(|n| n.name).collect();
        assert_eq!(names.len(), 27, "{names:?}");
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
        let image = help(true);
        let language = help(false);
        for n in &names {
            let general = general_names().contains(n);
            let for_image = general || image_names().contains(n);
            let for_language = general || language_names().contains(n);
            assert!(for_image || for_language, "{n}");
            assert_eq!(
                image.contains(&format!(" {n},")) || image.contains(&format!(" {n}.")),
                for_image,
                "{n}: {image}"
            );
            assert_eq!(
                language.contains(&format!(" {n},")) || language.contains(&format!(" {n}.")),
                for_language,
                "{n}: {language}"
            );
            // Every name parses, with each of its parameters.
            let named = algorithms().into_iter().find(|a| a.name == *n).unwrap();
            for param in named.params {
                assert!(parse_list(&format!("{n}:{param}=1")).is_ok(), "{n}:{param}");
            }
        }
        // The drift the registry ends: the image help names low_precision_groupnorm.
        assert!(image.contains("low_precision_groupnorm"));
        assert!(language.contains("factorize") && image.contains("factorize"));
    }

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
