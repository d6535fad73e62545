//! Selective backprop (Jiang et al., 2019, "Accelerating Deep Learning by Focusing on the
//! Biggest Losers"): score every sample with a forward pass that builds no gradients, and
//! train only on a `keep` fraction chosen with probability rising with the loss, so the
//! backward pass (two thirds of a step) runs on fewer samples.
//!
//! Selection follows the paper (and Composer): sort by loss; the sample at percentile `p`
//! (mid-rank) is drawn with probability proportional to `p^(1/keep - 1)`; `floor(keep * n)`
//! samples are drawn without replacement. It is active for `start <= fraction < end` of
//! training, and every `interrupt`-th batch *of each epoch* trains on the full batch: batch
//! `i` of an epoch (from 0) is left whole when `(i + 1) % interrupt == 0`, the paper's and
//! Composer's schedule, which restarts with every epoch.
//!
//! On a token model a sample is a sequence, scored by its mean token loss
//! ([`sample_losses`]); Composer's version scores image classifiers only.
//!
//! Hyperparameters: `start` 0.5, `end` 0.9, `keep` 0.5, `interrupt` 2 (Composer's defaults).
//! The time counters count the samples actually trained on.
//!
//! Hook: `AFTER_DATALOADER`.

use burn::tensor::{ElementConversion, Tensor};
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::loss::{
    per_sample_classification_loss, per_sample_classification_loss_counted,
};
use flashover_core::model::{Batch, ClassTargets, Logits, SelectSamples, TrainModel};
use flashover_core::rng::Rng;
use flashover_core::setup::{BatchOf, OutputOf, Setup};
use flashover_core::state::State;

use crate::error::{check_range, AlgorithmError, Result};
use crate::util::{fraction, index_tensor};

/// Whether selective backprop runs at `fraction` of training on batch `batch_in_epoch` of
/// its epoch (from 0).
pub fn should_select(
    fraction: f64,
    batch_in_epoch: u64,
    start: f64,
    end: f64,
    interrupt: u64,
) -> bool {
    let in_window = fraction >= start && fraction < end;
    let interrupted = interrupt > 0 && (batch_in_epoch + 1).is_multiple_of(interrupt);
    in_window && !interrupted
}

/// The indices (ascending) of `floor(keep * n)` samples chosen from `losses` as the paper does.
pub fn select_by_loss(losses: &[f32], keep: f64, rng: &mut Rng) -> Vec<usize> {
    let n = losses.len();
    let k = ((keep * n as f64).floor() as usize).clamp(1.min(n), n);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| losses[a].total_cmp(&losses[b]).then(a.cmp(&b)));
    let exp = 1.0 / keep - 1.0;
    let mut weights: Vec<f64> = (0..n)
        .map(|i| ((i as f64 + 0.5) / n as f64).powf(exp))
        .collect();
    let mut chosen = Vec::with_capacity(k);
    for _ in 0..k {
        let total: f64 = weights.iter().sum();
        let mut r = rng.next_f64() * total;
        let mut pick = n - 1;
        for (i, w) in weights.iter().enumerate() {
            if *w > 0.0 && r < *w {
                pick = i;
                break;
            }
            r -= w;
        }
        // Rounding can leave `r` past the end; take the last rank still available.
        if weights[pick] == 0.0 {
            pick = weights.iter().rposition(|w| *w > 0.0).unwrap_or(pick);
        }
        weights[pick] = 0.0;
        chosen.push(order[pick]);
    }
    chosen.sort_unstable();
    chosen
}

/// Each sample's loss from the loss of each row of logits: the rows themselves when there is
/// one per sample, else the mean of each sample's consecutive rows (a token model scores
/// `seq_len` rows per sequence, and a sequence's loss is its mean token loss). An error when
/// the rows do not split evenly into `samples`.
pub fn sample_losses(rows: &[f32], samples: usize) -> Result<Vec<f32>> {
    if samples == 0 || !rows.len().is_multiple_of(samples) {
        return Err(AlgorithmError::BadBatch {
            algorithm: "selective_backprop",
            reason: format!(
                "{} rows of logits for {samples} samples: expected the same number of rows per sample",
                rows.len()
            ),
        });
    }
    let per = rows.len() / samples;
    if per == 1 {
        return Ok(rows.to_vec());
    }
    Ok(rows
        .chunks_exact(per)
        .map(|c| (c.iter().map(|&v| v as f64).sum::<f64>() / per as f64) as f32)
        .collect())
}

/// [`sample_losses`] for a padded batch: `rows` are the token losses (0 at padding) and
/// `counted` is 1 where a token is scored, 0 at padding; each sample's loss is the mean over
/// its scored tokens (0 for a sample of padding alone), so that padding does not make a
/// sequence look easy.
pub fn padded_sample_losses(rows: &[f32], counted: &[f32], samples: usize) -> Result<Vec<f32>> {
    let sums = sample_losses(rows, samples)?;
    let counts = sample_losses(counted, samples)?;
    Ok(sums
        .iter()
        .zip(&counts)
        .map(|(&s, &c)| if c > 0.0 { s / c } else { 0.0 })
        .collect())
}

/// The selective-backprop algorithm; see the module docs.
#[derive(Debug, Clone)]
pub struct SelectiveBackprop {
    start: f64,
    end: f64,
    keep: f64,
    interrupt: u64,
}

impl SelectiveBackprop {
    /// Active from `start` to `end` (fractions of training), keeping `keep` of each batch,
    /// with every `interrupt`-th batch left whole (0: never).
    pub fn new(start: f64, end: f64, keep: f64, interrupt: u64) -> Result<Self> {
        check_range("selective_backprop", "start", start, 0.0, 1.0)?;
        check_range("selective_backprop", "end", end, 0.0, 1.0)?;
        if end < start {
            return Err(AlgorithmError::param(
                "selective_backprop",
                "end",
                end,
                format!("at least start ({start})"),
            ));
        }
        if !(keep.is_finite() && keep > 0.0 && keep <= 1.0) {
            return Err(AlgorithmError::param(
                "selective_backprop",
                "keep",
                keep,
                "a fraction in (0, 1]",
            ));
        }
        Ok(SelectiveBackprop {
            start,
            end,
            keep,
            interrupt,
        })
    }
}

impl<S: Setup> Algorithm<S> for SelectiveBackprop
where
    BatchOf<S>: ClassTargets<S::Backend> + SelectSamples<S::Backend>,
    OutputOf<S>: Logits<S::Backend>,
{
    fn name(&self) -> &str {
        "selective_backprop"
    }

    fn matches(&self, event: Event, state: &State<S>) -> bool {
        event == Event::AfterDataloader
            && should_select(
                fraction(state),
                state.timestamp().batch_in_epoch,
                self.start,
                self.end,
                self.interrupt,
            )
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let mut rng = state.rng("selective_backprop");
        let Some(batch) = state.batch() else {
            return Ok(());
        };
        // Score with the model's own forward; the graph it records is dropped unused.
        let out = state.model().forward(batch);
        let logits = out.logits().clone().detach();
        drop(out);
        let losses = match batch.ignore_index() {
            None => {
                let losses = read_f32(per_sample_classification_loss(logits, batch));
                sample_losses(&losses, batch.len())?
            }
            // A padded sequence is scored by its mean over the positions that are not
            // padding.
            Some(_) => {
                let (losses, counted) = per_sample_classification_loss_counted(logits, batch);
                padded_sample_losses(&read_f32(losses), &read_f32(counted), batch.len())?
            }
        };
        let keep = select_by_loss(&losses, self.keep, &mut rng);
        let idx = index_tensor::<S::Backend>(&keep, state.device());
        state.map_batch(|batch| Ok(batch.select(idx)))
    }
}

/// The values of a float tensor on the host.
fn read_f32<B: burn::tensor::backend::Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data()
        .iter::<f32>()
        .map(|v| v.elem::<f32>())
        .collect()
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "selective_backprop", params: ["start", "end", "keep", "interrupt"]}
crate::spec::by_name! {general |p| SelectiveBackprop::new(
    p.f64("start", 0.5)?,
    p.f64("end", 0.9)?,
    p.f64("keep", 0.5)?,
    p.parse("interrupt", 2u64, "a non-negative integer")?,
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest};

    #[test]
    fn a_sequence_is_scored_by_its_mean_token_loss() {
        assert_eq!(sample_losses(&[1.0, 2.0], 2).unwrap(), [1.0, 2.0]);
        // Two sequences of three tokens.
        assert_eq!(
            sample_losses(&[1.0, 2.0, 3.0, 0.0, 0.0, 3.0], 2).unwrap(),
            [2.0, 1.0]
        );
        let e = sample_losses(&[1.0; 5], 2).unwrap_err().to_string();
        assert!(e.contains("5 rows") && e.contains("2 samples"), "{e}");
    }

    #[test]
    fn a_padded_sequence_is_scored_by_its_mean_over_scored_tokens() {
        // Three sequences of three positions: all scored (mean 2); one scored token of loss
        // 3 and two of padding (3, not 1: the padding does not make it look easy); padding
        // alone (0).
        let rows = [1.0, 2.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let counted = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(
            padded_sample_losses(&rows, &counted, 3).unwrap(),
            [2.0, 3.0, 0.0]
        );
        assert!(padded_sample_losses(&rows[..8], &counted[..8], 3).is_err());
    }

    #[test]
    fn schedule_follows_start_end_and_interrupt() {
        assert!(!should_select(0.4, 10, 0.5, 0.9, 2));
        assert!(should_select(0.5, 10, 0.5, 0.9, 2));
        assert!(
            !should_select(0.5, 11, 0.5, 0.9, 2),
            "every second batch is whole"
        );
        assert!(!should_select(0.9, 10, 0.5, 0.9, 2));
        assert!(should_select(0.6, 11, 0.5, 0.9, 0));
    }

    proptest! {
        #[test]
        fn selection_has_the_right_size_and_is_reproducible(seed: u64, n in 1usize..200, keep in 0.05f64..1.0) {
            let losses: Vec<f32> = (0..n).map(|i| ((i * 7919) % 101) as f32).collect();
            let a = select_by_loss(&losses, keep, &mut Rng::new(seed));
            let k = ((keep * n as f64).floor() as usize).max(1).min(n);
            prop_assert_eq!(a.len(), k);
            prop_assert!(a.windows(2).all(|w| w[0] < w[1]), "unique and sorted");
            prop_assert!(a.iter().all(|&i| i < n));
            prop_assert_eq!(a, select_by_loss(&losses, keep, &mut Rng::new(seed)));
        }
    }

    #[test]
    fn high_losses_are_kept_more_often() {
        // Losses 0..100; keep 0.5. The paper's weights p^(1/keep - 1) = p make the chance of
        // being picked rise with the rank, so the mean selected loss is well above the mean.
        let losses: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let mut rng = Rng::new(7);
        let trials = 2000;
        let mut mean_sel = 0.0;
        let mut top_decile = 0usize;
        let mut bottom_decile = 0usize;
        for _ in 0..trials {
            let s = select_by_loss(&losses, 0.5, &mut rng);
            mean_sel += s.iter().map(|&i| losses[i] as f64).sum::<f64>() / s.len() as f64;
            top_decile += s.iter().filter(|&&i| i >= 90).count();
            bottom_decile += s.iter().filter(|&&i| i < 10).count();
        }
        mean_sel /= trials as f64;
        assert!(
            mean_sel > 55.0,
            "mean selected loss {mean_sel} vs overall 49.5"
        );
        assert!(
            top_decile > 3 * bottom_decile,
            "top {top_decile} vs bottom {bottom_decile}"
        );
        // keep = 1 keeps everything.
        assert_eq!(
            select_by_loss(&losses, 1.0, &mut rng),
            (0..100).collect::<Vec<_>>()
        );
    }
}
