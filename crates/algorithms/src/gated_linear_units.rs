//! Gated linear units (Dauphin et al., "Language Modeling with Gated Convolutional
//! Networks", 2017; Shazeer, "GLU Variants Improve Transformer", 2020): a transformer's MLP
//! `W2 act(x W1)` becomes `W2 (act(x W) * (x V))`, the hidden features gated elementwise by a
//! second projection of the input. Shazeer's variants are named by the activation: GEGLU
//! (GELU, the default here as in Composer, which takes the model's own activation), ReGLU,
//! SwiGLU, GLU (sigmoid) and bilinear (none).
//!
//! Three weight matrices instead of two: to keep the parameter count and the compute, the
//! hidden width is scaled by 2/3 (Shazeer's choice: `d_ff` 3072 -> 2048), rounded to the
//! nearest integer; `scale_hidden=false` keeps the width (50% more MLP parameters), which is
//! what Composer does. The gate and value layers have no bias by default (Composer's
//! `gated_layer_bias` and `non_gated_layer_bias`, both false); the output layer keeps its bias.
//! The layers are initialised afresh as the model initialises its own (the GPT: GPT-2's
//! N(0, 0.02), the output layer scaled by `1 / sqrt(2 * layers)`), from the run's seed.
//!
//! When it helps: language models, where Shazeer measured lower perplexity at equal
//! parameters and compute; Composer reports BERT pretraining quality gains.
//!
//! Surgery at `INIT` on the MLPs the model shows ([`Surgical`]; each rebuilds itself); the layers
//! changed and the settings are the checkpoint state.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{
    GluActivation, GluSettings, LayerKind, SurgeryRecord, Surgical, SurgicalExt,
};

use crate::error::{AlgorithmError, Result};
use crate::surgery::{surgery_at_init, Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "gated_linear_units",
    kinds: &[LayerKind::Mlp],
    describe: "transformer MLPs that can become gated linear units",
};

/// GatedLinearUnits' settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GluOptions {
    /// The gate's activation.
    pub activation: GluActivation,
    /// Scale the hidden width by 2/3 to keep the parameter count.
    pub scale_hidden: bool,
    /// A bias on the gate layer.
    pub gated_layer_bias: bool,
    /// A bias on the value layer.
    pub non_gated_layer_bias: bool,
}

impl Default for GluOptions {
    fn default() -> Self {
        Self {
            activation: GluActivation::Gelu,
            scale_hidden: true,
            gated_layer_bias: false,
            non_gated_layer_bias: false,
        }
    }
}

impl GluOptions {
    /// Parses an activation name: gelu, relu, silu, sigmoid or identity.
    pub fn activation(name: &str) -> Result<GluActivation> {
        GluActivation::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| {
                AlgorithmError::param(
                    "gated_linear_units",
                    "activation",
                    name,
                    "gelu, relu, silu, sigmoid or identity",
                )
            })
    }

    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "gated_linear_units:activation={}:scale_hidden={}:gated_layer_bias={}:non_gated_layer_bias={}",
            self.activation.name(),
            self.scale_hidden,
            self.gated_layer_bias,
            self.non_gated_layer_bias
        )
    }

    /// The gated MLP's hidden width for an MLP of `hidden` features: `round(2 * hidden / 3)`
    /// (at least 1) when scaling, else `hidden`.
    pub fn hidden(&self, hidden: usize) -> usize {
        if self.scale_hidden {
            ((2 * hidden) as f64 / 3.0).round().max(1.0) as usize
        } else {
            hidden
        }
    }
}

/// Rebuilds every MLP of `model` as a gated linear unit (the functional form; call it before
/// the optimizer sees the parameters), drawing the new weights from `seed`. Returns what it
/// changed.
pub fn apply_gated_linear_units<M: Surgical + ?Sized>(
    model: &mut M,
    options: &GluOptions,
    seed: u64,
) -> SurgeryRecord {
    let layers = model.gated_linear_units(
        &mut |info| {
            Some(GluSettings {
                activation: options.activation,
                hidden: options.hidden(info.hidden),
                gated_bias: options.gated_layer_bias,
                non_gated_bias: options.non_gated_layer_bias,
            })
        },
        seed,
    );
    SurgeryRecord {
        settings: options.describe(),
        layers,
    }
}

/// The GatedLinearUnits algorithm: [`apply_gated_linear_units`] at `INIT`, seeded by the
/// run's seed.
#[derive(Debug, Clone, Default)]
pub struct GatedLinearUnits {
    options: GluOptions,
    applied: Applied,
}

impl GatedLinearUnits {
    /// The algorithm with `options`.
    pub fn new(options: GluOptions) -> Self {
        Self {
            options,
            applied: Applied::default(),
        }
    }
}

impl<S: Setup> Algorithm<S> for GatedLinearUnits
where
    S::Model: Surgical,
{
    surgery_at_init!("gated_linear_units", |this| this.options.describe());

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let (options, seed) = (self.options, state.seed());
        self.applied.run(NEEDS, state, |model| {
            Ok(apply_gated_linear_units(model, &options, seed))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "gated_linear_units",
    params: [
        "activation",
        "scale_hidden",
        "gated_layer_bias",
        "non_gated_layer_bias",
    ],
}
crate::spec::by_name! {language |p| {
    let d = GluOptions::default();
    GatedLinearUnits::new(GluOptions {
        activation: GluOptions::activation(p.str("activation", d.activation.name()))?,
        scale_hidden: p.bool("scale_hidden", d.scale_hidden)?,
        gated_layer_bias: p.bool("gated_layer_bias", d.gated_layer_bias)?,
        non_gated_layer_bias: p.bool("non_gated_layer_bias", d.non_gated_layer_bias)?,
    })
}}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hidden_width_keeps_the_parameter_count() {
        let o = GluOptions::default();
        // A 4x MLP of width 768: 3072 -> 2048, Shazeer's figure.
        assert_eq!(o.hidden(3072), 2048);
        // Width 128: 512 -> 341; 3 * 128 * 341 = 130_944 against 2 * 128 * 512 = 131_072.
        assert_eq!(o.hidden(512), 341);
        let keep = GluOptions {
            scale_hidden: false,
            ..o
        };
        assert_eq!(keep.hidden(512), 512);
    }

    #[test]
    fn activations_are_named_and_checked() {
        assert_eq!(GluOptions::activation("silu").unwrap(), GluActivation::Silu);
        let e = GluOptions::activation("tanh").unwrap_err().to_string();
        assert!(e.contains("tanh") && e.contains("gelu, relu"), "{e}");
        assert_eq!(
            GluOptions::default().describe(),
            "gated_linear_units:activation=gelu:scale_hidden=true:gated_layer_bias=false:non_gated_layer_bias=false"
        );
    }
}
