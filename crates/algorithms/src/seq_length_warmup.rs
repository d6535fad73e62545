//! Sequence-length warmup (Li et al., 2022, "The Stability-Efficiency Dilemma: Investigating
//! Sequence Length Warmup for Training GPT Models"): train on short sequences first and grow
//! them linearly to full length over the first `duration` of training, which is cheaper and
//! steadier for language models.
//!
//! The length at fraction `f` of training is `min_seq_length + (max_seq_length -
//! min_seq_length) * f / duration`, rounded down to a multiple of `step_size` (and at least
//! `min_seq_length`); from `duration` on, batches are left at full length. `truncate` keeps the
//! first positions of every sequence; otherwise each sequence is cut into pieces of that length
//! that become separate sequences (no token is dropped but the remainder).
//!
//! Hyperparameters: `duration` 0.3, `min_seq_length` 8, `max_seq_length` 1024, `step_size` 8,
//! `truncate` true (Composer's defaults). Token counts in time are those actually trained on.
//!
//! Hook: `AFTER_DATALOADER`.

use std::marker::PhantomData;

use burn::tensor::backend::Backend;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::SequenceBatch;
use flashover_core::setup::{BatchOf, Setup};
use flashover_core::state::State;

use crate::error::{check_range, AlgorithmError, Result};
use crate::util::fraction;

/// Sequence length at `fraction` of training (see the module docs).
pub fn warmup_length(fraction: f64, duration: f64, min: usize, max: usize, step: usize) -> usize {
    if fraction >= duration {
        return max;
    }
    let raw = min as f64 + (max - min) as f64 * fraction / duration;
    let stepped = (raw / step as f64).floor() as usize * step;
    stepped.clamp(min, max)
}

/// Shortens `batch` to `len` positions, by truncation or by folding (the functional form).
pub fn shorten<B: Backend, T: SequenceBatch<B>>(batch: T, len: usize, truncate: bool) -> T {
    if len >= batch.seq_len() {
        batch
    } else if truncate {
        batch.truncate(len)
    } else {
        batch.fold(len)
    }
}

/// The sequence-length warmup algorithm; see the module docs.
#[derive(Debug, Clone)]
pub struct SeqLengthWarmup<B: Backend> {
    duration: f64,
    min: usize,
    max: usize,
    step: usize,
    truncate: bool,
    _b: PhantomData<B>,
}

impl<B: Backend> SeqLengthWarmup<B> {
    /// Warmup over `duration` (a fraction of training) from `min` to `max` in steps of `step`.
    pub fn new(duration: f64, min: usize, max: usize, step: usize, truncate: bool) -> Result<Self> {
        check_range("seq_length_warmup", "duration", duration, 0.0, 1.0)?;
        if min == 0 || step == 0 {
            return Err(AlgorithmError::param(
                "seq_length_warmup",
                if min == 0 {
                    "min_seq_length"
                } else {
                    "step_size"
                },
                0,
                "an integer >= 1",
            ));
        }
        if max < min {
            return Err(AlgorithmError::param(
                "seq_length_warmup",
                "max_seq_length",
                max,
                format!("at least min_seq_length ({min})"),
            ));
        }
        Ok(SeqLengthWarmup {
            duration,
            min,
            max,
            step,
            truncate,
            _b: PhantomData,
        })
    }

    /// The length at `fraction` of training.
    pub fn length(&self, fraction: f64) -> usize {
        warmup_length(fraction, self.duration, self.min, self.max, self.step)
    }
}

impl<S: Setup> Algorithm<S> for SeqLengthWarmup<S::Backend>
where
    BatchOf<S>: SequenceBatch<S::Backend>,
{
    fn name(&self) -> &str {
        "seq_length_warmup"
    }

    fn matches(&self, event: Event, state: &State<S>) -> bool {
        event == Event::AfterDataloader && fraction(state) < self.duration
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let len = self.length(fraction(state));
        let truncate = self.truncate;
        state.map_batch(|batch| Ok(shorten(batch, len, truncate)))
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "seq_length_warmup",
    params: [
        "duration",
        "min_seq_length",
        "max_seq_length",
        "step_size",
        "truncate",
    ],
}
crate::spec::by_name! {language |p| SeqLengthWarmup::<S::Backend>::new(
    p.f64("duration", 0.3)?,
    p.usize("min_seq_length", 8)?,
    p.usize("max_seq_length", 1024)?,
    p.usize("step_size", 8)?,
    p.bool("truncate", true)?,
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Int, Tensor, TensorData};
    use flashover_core::model::{Batch, TokenBatch};
    use proptest::prelude::{prop_assert, proptest};

    #[test]
    fn lengths_follow_the_linear_schedule() {
        // min 8, max 1024, duration 0.3: at 0.15 the raw length is 8 + 1016 / 2 = 516 -> 512.
        assert_eq!(warmup_length(0.0, 0.3, 8, 1024, 8), 8);
        assert_eq!(warmup_length(0.15, 0.3, 8, 1024, 8), 512);
        assert_eq!(warmup_length(0.3, 0.3, 8, 1024, 8), 1024);
        assert_eq!(warmup_length(0.9, 0.3, 8, 1024, 8), 1024);
    }

    proptest! {
        #[test]
        fn lengths_grow_and_stay_in_bounds(a in 0.0f64..1.0, b in 0.0f64..1.0, min in 1usize..64, extra in 0usize..512, step in 1usize..16) {
            let max = min + extra;
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let l1 = warmup_length(lo, 0.3, min, max, step);
            let l2 = warmup_length(hi, 0.3, min, max, step);
            prop_assert!(l1 <= l2);
            prop_assert!(l1 >= min && l2 <= max);
        }
    }

    #[test]
    fn truncating_and_folding_keep_the_right_tokens() {
        let d = Default::default();
        let v: Vec<i64> = (0..2 * 10).collect();
        let t = Tensor::<Flex, 2, Int>::from_data(TensorData::new(v.clone(), [2, 10]), &d);
        let y = Tensor::<Flex, 2, Int>::from_data(
            TensorData::new(v.iter().map(|x| x + 1).collect::<Vec<_>>(), [2, 10]),
            &d,
        );
        let batch = TokenBatch::new(t, y);
        let tr = shorten(batch.clone(), 4, true);
        assert_eq!(
            tr.tokens
                .clone()
                .into_data()
                .convert::<i64>()
                .to_vec::<i64>()
                .unwrap(),
            vec![0, 1, 2, 3, 10, 11, 12, 13]
        );
        assert_eq!(tr.num_tokens(), 8);
        let f = shorten(batch, 4, false);
        assert_eq!(f.tokens.dims(), [4, 4]);
        assert_eq!(
            f.tokens
                .into_data()
                .convert::<i64>()
                .to_vec::<i64>()
                .unwrap(),
            vec![0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17]
        );
        assert_eq!(
            f.targets
                .into_data()
                .convert::<i64>()
                .to_vec::<i64>()
                .unwrap()[0],
            1
        );
    }
}
