//! The training step's gradient synchronisation, apart from the step itself: what one rank
//! brings to the optimizer step ([`Accumulated`]) and what every rank agrees on
//! ([`synchronise`]). In a single process nothing crosses a wire and the batch's own
//! gradients and loss go on; in a data-parallel run the collective averages them, and a
//! rank whose loss was not finite or whose gradients overflowed makes every rank skip the
//! step together.

use std::collections::HashSet;

use burn::module::ParamId;
use burn::optim::GradientsParams;

use crate::collective::{Collective, LocalStep};
use crate::error::Result;
use crate::setup::Setup;
use crate::shard::{sync_gradient_shards, ShardPlan};

/// What the microbatches of one batch left for the optimizer step.
pub(super) struct Accumulated {
    /// The batch's gradients (summed over microbatches); `None` when a loss was not finite.
    pub(super) grads: Option<GradientsParams>,
    /// The batch's loss (the sum of the weighted microbatch losses).
    pub(super) loss: f64,
    /// The gradients overflowed under loss scaling (the step is skipped, the scale lowered).
    pub(super) overflowed: bool,
    /// The batch's scored tokens when the ranks are weighed by them rather than by their
    /// samples (`accumulate_on_tokens` in a data-parallel run).
    pub(super) loss_tokens: Option<u64>,
}

/// What every rank steps with.
pub(super) struct Synced {
    /// The gradients to step with (averaged over the ranks), `None` to skip the step.
    pub(super) grads: Option<GradientsParams>,
    /// The batch's loss (the mean over the ranks), `None` when not finite.
    pub(super) loss: Option<f64>,
    /// The step is skipped on every rank (a non-finite loss or an overflow on some rank).
    pub(super) skipped: bool,
    /// In a sharded run, the parameters this rank had gradients for (`grads` holds those it
    /// owns); empty otherwise.
    pub(super) keep: HashSet<ParamId>,
}

/// Brings this rank's `local` share (of a batch of `samples` samples, `finite` when its loss
/// was) to the step every rank takes: through `collective` in a data-parallel run (reduced
/// and scattered to the owners under a shard `plan`), as it is otherwise. `batch` names the
/// batch in the warning a rank logs when another rank's loss made it skip.
pub(super) fn synchronise<S: Setup>(
    collective: Option<&mut Box<dyn Collective<S>>>,
    plan: Option<&ShardPlan>,
    model: &S::Model,
    local: Accumulated,
    finite: bool,
    samples: u64,
    batch: u64,
) -> Result<Synced> {
    let Some(c) = collective else {
        return Ok(Synced {
            grads: local.grads,
            loss: finite.then_some(local.loss),
            skipped: !finite || local.overflowed,
            keep: HashSet::new(),
        });
    };
    // An overflowed rank skips like a rank with a non-finite loss, so that every rank skips
    // the step (and lowers its scale) together.
    let mine = LocalStep {
        grads: local.grads,
        loss: local.loss,
        finite: finite && !local.overflowed,
        samples,
    };
    let (global, keep) = match plan {
        Some(plan) => sync_gradient_shards(c.as_mut(), plan, model, mine)?,
        None => (c.sync_gradients(model, mine)?, HashSet::new()),
    };
    if finite && global.skipped_ranks > 0 {
        tracing::warn!(
            ranks = global.skipped_ranks,
            batch,
            "skipping batch: another rank's loss was not finite"
        );
    }
    Ok(Synced {
        grads: global.grads,
        loss: global.loss,
        skipped: global.skipped_ranks > 0,
        keep,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::SetupOf;
    use crate::toy::{Line, ToyOptimizer};

    type B = burn::backend::Autodiff<burn::backend::Flex>;
    type S = SetupOf<B, Line<B>, ToyOptimizer<B>>;

    fn alone(finite: bool, overflowed: bool) -> Synced {
        let model = Line::<B> {
            w: burn::module::Param::from_tensor(burn::tensor::Tensor::zeros(
                [1],
                &Default::default(),
            )),
        };
        let local = Accumulated {
            grads: None,
            loss: 0.5,
            overflowed,
            loss_tokens: None,
        };
        synchronise::<S>(None, None, &model, local, finite, 4, 0).unwrap()
    }

    #[test]
    fn a_single_process_steps_unless_its_loss_or_gradients_went_bad() {
        let ok = alone(true, false);
        assert_eq!((ok.loss, ok.skipped), (Some(0.5), false));
        let overflow = alone(true, true);
        assert_eq!((overflow.loss, overflow.skipped), (Some(0.5), true));
        let nan = alone(false, false);
        assert_eq!((nan.loss, nan.skipped), (None, true));
    }
}
