//! The training step's precision and loss scaling, apart from the step itself: the three
//! points where they act, each a function of its inputs alone, so that they can be read and
//! tested without a trainer.
//!
//! - [`backward_loss`]: a microbatch's loss before `backward` (float32, weighted by its share
//!   of the batch, multiplied by the loss scale);
//! - [`optimizer_gradients`]: the batch's gradients before the optimizer (float32 and
//!   unscaled in the half precisions, with the overflow check that rides along with the
//!   batch's one read);
//! - [`after_step`]: the scale after the step (lowered after an overflow, raised after
//!   enough clean steps) and whether the batch counts as skipped, and [`step_in_precision`],
//!   the optimizer step itself in float32 for the pure half precisions.
//!
//! A float32 run passes through each unchanged: no cast, no multiplication, no extra read.

use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor};

use crate::model::TrainModel;
use crate::precision::{
    cast_params, cast_to, prepare_gradients, LossScaler, Precision, ScaleChange,
};

/// The loss `backward` starts from for a microbatch whose model returned `loss`: in float32
/// (a model in a half precision may return the half type), times `weight` (its share of a
/// split batch), times the loss scale. Also returns the weighted, unscaled value, detached,
/// for the batch's one read of its losses.
pub(super) fn backward_loss<B: AutodiffBackend>(
    loss: Tensor<B, 1>,
    weight: Option<f64>,
    scaler: Option<&LossScaler>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let loss = cast_to(loss, FloatDType::F32);
    let loss = match weight {
        Some(w) => loss.mul_scalar(w),
        None => loss,
    };
    let value = loss.clone().detach();
    let loss = match scaler {
        Some(s) => loss.mul_scalar(s.scale),
        None => loss,
    };
    (loss, value)
}

/// The batch's gradients as the optimizer takes them: in the half precisions, float32 and
/// divided by the loss scale, with a one-element flag that is not finite where they
/// overflowed (under loss scaling only), read with the batch's losses. A float32 run gets
/// its gradients back as they are.
pub(super) fn optimizer_gradients<B: AutodiffBackend, M: TrainModel<B>>(
    precision: Precision,
    model: &M,
    grads: GradientsParams,
    scaler: Option<&LossScaler>,
) -> (GradientsParams, Option<Tensor<B::InnerBackend, 1>>) {
    if precision == Precision::Fp32 {
        return (grads, None);
    }
    prepare_gradients::<B, M>(
        model,
        grads,
        scaler.map(|s| 1.0 / s.scale),
        scaler.is_some(),
    )
}

/// Loss scaling after a step: `skipped` when the step was not taken for an overflow or a
/// non-finite loss on any rank (the scale is lowered), else one clean step more (it may
/// grow). Returns the log line of a back-off, naming `batch` and both scales.
fn settle_scale(scaler: &mut LossScaler, skipped: bool, batch: u64) -> Option<String> {
    let from = scaler.scale;
    match scaler.update(skipped) {
        ScaleChange::BackedOff(to) => {
            tracing::warn!(
                batch,
                from,
                to,
                "loss scaling: gradients overflowed in float16, step skipped, scale lowered"
            );
            Some(format!(
                "batch {batch}: gradients overflowed, step skipped; loss scale {from} -> {to}"
            ))
        }
        ScaleChange::Kept | ScaleChange::Grew(_) => None,
    }
}

/// What a step's end means for loss scaling and the count of skipped batches.
#[derive(Debug, PartialEq)]
pub(super) struct Settled {
    /// The batch counts as skipped for its loss.
    pub(super) skipped_for_loss: bool,
    /// The log line of a back-off of the scale.
    pub(super) log: Option<String>,
}

/// The end of a step: under loss scaling a skipped step (`skipped`, on any rank) or gradients
/// an algorithm computed and overflowed (`overflowed_later`) lower the scale on every rank,
/// and only a non-finite loss (`!finite`) counts the batch as skipped (an overflow alone is
/// loss scaling at work); without it, every skipped step counts.
pub(super) fn after_step(
    scaler: Option<&mut LossScaler>,
    skipped: bool,
    finite: bool,
    overflowed_later: bool,
    batch: u64,
) -> Settled {
    match scaler {
        Some(scaler) => Settled {
            skipped_for_loss: skipped && !finite,
            log: settle_scale(scaler, skipped || overflowed_later, batch),
        },
        None => Settled {
            skipped_for_loss: skipped,
            log: None,
        },
    }
}

/// The optimizer step at `lr`. The pure half precisions step in float32 (the optimizer's
/// moments are float32, see `crate::precision`) and round the new weights to the half type;
/// the others step as the optimizer does.
pub(super) fn step_in_precision<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>>(
    optimizer: &mut O,
    precision: Precision,
    lr: f64,
    model: M,
    grads: GradientsParams,
) -> M {
    let stored = precision.parameter_dtype();
    if stored == FloatDType::F32 {
        return optimizer.step(lr, model, grads);
    }
    // Float32 gradients also where an algorithm put its own at `AFTER_TRAIN_BATCH` in the
    // model's half type without `State::replace_gradients`.
    let (grads, _) = prepare_gradients::<B, M>(&model, grads, None, false);
    let model = cast_params::<B, M>(model, FloatDType::F32);
    let model = optimizer.step(lr, model, grads);
    cast_params::<B, M>(model, stored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::LossScaling;

    type B = burn::backend::Autodiff<burn::backend::Flex>;

    fn one(v: f32) -> Tensor<B, 1> {
        Tensor::from_floats([v], &Default::default())
    }

    fn value(t: Tensor<B, 1>) -> f32 {
        t.into_scalar()
    }

    #[test]
    fn the_backward_loss_is_weighted_then_scaled_and_its_value_only_weighted() {
        let scaler = LossScaler::new(LossScaling::default());
        let (to_backward, read) = backward_loss(one(0.5), Some(0.25), Some(&scaler));
        assert_eq!(value(read), 0.125);
        assert_eq!(value(to_backward), 0.125 * 65536.0);
        // Float32, unsplit, unscaled: the loss itself.
        let (to_backward, read) = backward_loss(one(0.5), None, None);
        assert_eq!((value(to_backward), value(read)), (0.5, 0.5));
    }

    #[test]
    fn an_overflow_halves_the_scale_and_says_so_and_clean_steps_say_nothing() {
        let mut scaler = LossScaler::new(LossScaling {
            growth_interval: 2,
            ..LossScaling::default()
        });
        let line = settle_scale(&mut scaler, true, 7).expect("a back-off is logged");
        assert_eq!(
            line,
            "batch 7: gradients overflowed, step skipped; loss scale 65536 -> 32768"
        );
        assert_eq!(scaler.scale, 32768.0);
        assert_eq!(settle_scale(&mut scaler, false, 8), None);
        assert_eq!(settle_scale(&mut scaler, false, 9), None);
        assert_eq!(
            scaler.scale, 65536.0,
            "two clean steps at interval 2 double it"
        );
    }

    #[test]
    fn only_a_non_finite_loss_counts_a_batch_as_skipped_under_loss_scaling() {
        let mut scaler = LossScaler::new(LossScaling::default());
        // An overflow: the scale backs off, the batch is not counted as skipped.
        let s = after_step(Some(&mut scaler), true, true, false, 3);
        assert!(!s.skipped_for_loss && s.log.is_some(), "{s:?}");
        // A non-finite loss: both.
        let s = after_step(Some(&mut scaler), true, false, false, 4);
        assert!(s.skipped_for_loss && s.log.is_some(), "{s:?}");
        // SAM's own gradients overflowed after a clean batch: the scale backs off.
        let s = after_step(Some(&mut scaler), false, true, true, 5);
        assert!(!s.skipped_for_loss && s.log.is_some(), "{s:?}");
        assert_eq!(scaler.scale, 65536.0 / 8.0);
        // No loss scaling: a skipped step is a skipped batch, nothing to log.
        let s = after_step(None, true, true, false, 6);
        assert_eq!(
            s,
            Settled {
                skipped_for_loss: true,
                log: None
            }
        );
    }
}
