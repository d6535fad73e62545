//! Weight standardization (Qiao, Wang, Liu, Shen and Yuille, "Micro-Batch Training with
//! Batch-Channel Normalization and Weight Standardization", 2019; Composer's
//! `WeightStandardization`): every convolution uses its weights standardised per output
//! channel, `(w - mean) / sqrt(var + 1e-10)` over the input channels and the kernel, which
//! smooths the loss landscape; the raw weights stay the parameters and receive the gradients
//! through the standardization. See `flashover_models::layers::standardize_weight` for the
//! constant and where it differs from the paper's code.
//!
//! `n_last_layers_ignore` (Composer's, default 0) leaves the last that many convolutions, in
//! the model's module order, alone (Composer orders them by a symbolic trace of execution;
//! module order is the order Flashover's models run them in, a projection shortcut counted
//! after its block's two convolutions).
//!
//! When it helps: paired with group or batch norm at small per-device batches; it costs one
//! pass over each convolution's weights per step.
//!
//! Surgery at `INIT` on the convolutions the model shows ([`Surgical`]); no parameter is added or changed.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{LayerKind, SurgeryRecord, Surgical, SurgicalExt};

use crate::surgery::{surgery_at_init, Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "weight_standardization",
    kinds: &[LayerKind::Conv],
    describe: "surgery-ready convolutions",
};

/// The settings in the `--algorithms` syntax.
pub(crate) fn describe(n_last_layers_ignore: usize) -> String {
    format!("weight_standardization:n_last_layers_ignore={n_last_layers_ignore}")
}

/// Standardises the weights of every convolution of `model` but the last
/// `n_last_layers_ignore` (the functional form; call it before building the optimizer) and
/// returns what it changed.
pub fn apply_weight_standardization<M: Surgical + ?Sized>(
    model: &mut M,
    n_last_layers_ignore: usize,
) -> SurgeryRecord {
    let mut count = 0usize;
    model.for_each_conv(&mut |_, _| count += 1);
    let target = count.saturating_sub(n_last_layers_ignore);
    let mut layers = Vec::new();
    model.for_each_conv(&mut |info, variant| {
        if layers.len() < target {
            variant.standardize = true;
            layers.push(info.path.clone());
        }
    });
    SurgeryRecord {
        settings: describe(n_last_layers_ignore),
        layers,
    }
}

/// The WeightStandardization algorithm: [`apply_weight_standardization`] at `INIT`.
#[derive(Debug, Clone, Default)]
pub struct WeightStandardization {
    n_last_layers_ignore: usize,
    applied: Applied,
}

impl WeightStandardization {
    /// Standardization of all convolutions but the last `n_last_layers_ignore`.
    pub fn new(n_last_layers_ignore: usize) -> Self {
        Self {
            n_last_layers_ignore,
            applied: Applied::default(),
        }
    }
}

impl<S: Setup> Algorithm<S> for WeightStandardization
where
    S::Model: Surgical,
{
    surgery_at_init!("weight_standardization", |this| describe(
        this.n_last_layers_ignore
    ));

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        self.applied.run(NEEDS, state, |model| {
            Ok(apply_weight_standardization(
                model,
                self.n_last_layers_ignore,
            ))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "weight_standardization", params: ["n_last_layers_ignore"]}
crate::spec::by_name! {image |p, _norm| WeightStandardization::new(
    p.usize("n_last_layers_ignore", 0)?,
)}
