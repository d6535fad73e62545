//! Ghost batch normalisation (Hoffer, Hubara and Soudry, "Train longer, generalize better:
//! closing the generalization gap in large batch training of neural networks", NeurIPS 2017;
//! Composer's `GhostBatchNorm`): in training, every batch norm computes its statistics over
//! consecutive *ghost batches* of `ghost_batch_size` samples instead of the whole batch, which
//! adds the noise of small-batch statistics (a regulariser) to large-batch training. The
//! running statistics move towards the mean of the ghost batches' statistics; evaluation is
//! unchanged. See `flashover_models::norm` for the exact cut of a batch and how it differs
//! from Composer's.
//!
//! Default `ghost_batch_size = 32` (Composer's). When it helps: models with batch norm trained
//! at batches well above the ghost size; it costs a few small reductions per norm.
//!
//! Surgery at `INIT` on the batch norms the model shows ([`Surgical`]; a model without
//! batch norms fails there, naming them); no parameter changes. The layers changed are the
//! algorithm's checkpoint state, and a checkpoint of another surgery is refused.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{LayerKind, SurgeryRecord, Surgical, SurgicalExt};

use crate::error::{AlgorithmError, Result};
use crate::surgery::{surgery_at_init, Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "ghost_batchnorm",
    kinds: &[LayerKind::BatchNorm],
    describe: "surgery-ready batch norms",
};

/// Sets every batch norm of `model` to normalise over ghost batches of `ghost_batch_size`
/// samples (the functional form; call it before building the optimizer) and returns what it
/// changed. `ghost_batch_size` must be at least 1.
pub fn apply_ghost_batchnorm<M: Surgical + ?Sized>(
    model: &mut M,
    ghost_batch_size: usize,
) -> Result<SurgeryRecord> {
    check_size(ghost_batch_size)?;
    let mut layers = Vec::new();
    model.for_each_batch_norm(&mut |info, variant| {
        variant.ghost_batch_size = Some(ghost_batch_size);
        layers.push(info.path.clone());
    });
    Ok(SurgeryRecord {
        settings: describe(ghost_batch_size),
        layers,
    })
}

pub(crate) fn check_size(ghost_batch_size: usize) -> Result<()> {
    if ghost_batch_size == 0 {
        return Err(AlgorithmError::param(
            "ghost_batchnorm",
            "ghost_batch_size",
            ghost_batch_size,
            "a whole number of samples >= 1",
        ));
    }
    Ok(())
}

pub(crate) fn describe(ghost_batch_size: usize) -> String {
    format!("ghost_batchnorm:ghost_batch_size={ghost_batch_size}")
}

/// The GhostBatchNorm algorithm: [`apply_ghost_batchnorm`] at `INIT`.
#[derive(Debug, Clone)]
pub struct GhostBatchNorm {
    ghost_batch_size: usize,
    applied: Applied,
}

impl GhostBatchNorm {
    /// Ghost batches of `ghost_batch_size` samples (at least 1).
    pub fn new(ghost_batch_size: usize) -> Result<Self> {
        check_size(ghost_batch_size)?;
        Ok(Self {
            ghost_batch_size,
            applied: Applied::default(),
        })
    }

    /// The ghost batch size.
    pub fn ghost_batch_size(&self) -> usize {
        self.ghost_batch_size
    }
}

impl Default for GhostBatchNorm {
    /// Composer's default, ghost batches of 32.
    fn default() -> Self {
        Self {
            ghost_batch_size: 32,
            applied: Applied::default(),
        }
    }
}

impl<S: Setup> Algorithm<S> for GhostBatchNorm
where
    S::Model: Surgical,
{
    surgery_at_init!("ghost_batchnorm", |this| describe(this.ghost_batch_size));

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        self.applied.run(NEEDS, state, |model| {
            Ok(apply_ghost_batchnorm(model, self.ghost_batch_size)?)
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "ghost_batchnorm", params: ["ghost_batch_size"]}
crate::spec::by_name! {image |p, _norm| {
    let size = p.usize("ghost_batch_size", GhostBatchNorm::default().ghost_batch_size())?;
    GhostBatchNorm::new(size)?
}}
