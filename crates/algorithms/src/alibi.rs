//! ALiBi, attention with linear biases (Press, Smith and Lewis, "Train Short, Test Long:
//! Attention with Linear Biases Enables Input Length Extrapolation", ICLR 2022): the model
//! loses its position embeddings, and each attention head adds `-m * (i - j)` to the score
//! of query `i` for key `j <= i`, a penalty growing with the distance, with a fixed slope
//! `m` per head. The slopes are a geometric sequence that starts at `2^(-8/n)` for `n` heads
//! and has that ratio (`1/2, 1/4, ..., 1/256` for 8 heads); when `n` is not a power of two,
//! the paper's rule takes the `2^floor(log2 n)` slopes of the nearest smaller power of two and
//! then every other slope of the sequence for twice that many heads, until there are `n`.
//!
//! A model trained this way extrapolates: it runs on sequences longer than it was trained
//! on (up to `max_sequence_length`, the longest input it then accepts) with a loss no worse,
//! which Composer turns into speed by training on shorter sequences: every training batch
//! `[batch, L]` is reshaped to `[batch / s, L * s]` for `train_sequence_length_scaling` `s`
//! (each sequence cut into `1 / s` consecutive pieces; the same tokens, shorter attention),
//! while evaluation keeps its full length. `L * s` must be a whole number dividing `L`; a
//! batch for which it is not is an error naming both.
//!
//! Hyperparameters: `max_sequence_length` 8192, `train_sequence_length_scaling` 0.25
//! (Composer's defaults). When it helps: language models whose attention is a real part of
//! the step (long contexts), and any model asked to read longer inputs than it trained on.
//! As in Composer, the time counters count the pieces as the samples trained on.
//!
//! Where this differs from Composer: Composer zeroes and freezes the position embeddings
//! (enlarged to `max_sequence_length` rows); here the parameter is removed, which a
//! checkpoint of the run records (the same model, nothing to train).
//!
//! Surgery at `INIT` on the attention layers and position embeddings the model shows
//! ([`Surgical`]); `AFTER_DATALOADER` reshapes
//! the batch. The layers changed and the settings are the checkpoint state.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::SequenceBatch;
use flashover_core::setup::{BatchOf, Setup};
use flashover_core::state::State;
use flashover_surgery::{LayerKind, SurgeryRecord, Surgical, SurgicalExt};

use crate::error::{AlgorithmError, Result};
use crate::seq_length_warmup::shorten;
use crate::surgery::{Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "alibi",
    kinds: &[LayerKind::Attention],
    describe: "surgery-ready attention layers",
};

/// ALiBi's slope for each of `heads` heads, the paper's sequence (see the module docs).
/// Panics on 0 heads.
pub fn alibi_slopes(heads: usize) -> Vec<f32> {
    assert!(heads > 0, "ALiBi needs at least one head");
    fn power_of_two(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-8.0 / n as f64);
        (1..=n).map(|i| start.powi(i as i32)).collect()
    }
    if heads.is_power_of_two() {
        return power_of_two(heads).into_iter().map(|m| m as f32).collect();
    }
    let closest = 1usize << heads.ilog2();
    let mut slopes = power_of_two(closest);
    slopes.extend(
        power_of_two(2 * closest)
            .into_iter()
            .step_by(2)
            .take(heads - closest),
    );
    slopes.into_iter().map(|m| m as f32).collect()
}

/// ALiBi's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlibiOptions {
    /// The longest input the model accepts afterwards.
    pub max_sequence_length: usize,
    /// Training sequences are cut to this fraction of their length (1: left whole).
    pub train_sequence_length_scaling: f64,
}

impl Default for AlibiOptions {
    fn default() -> Self {
        Self {
            max_sequence_length: 8192,
            train_sequence_length_scaling: 0.25,
        }
    }
}

impl AlibiOptions {
    /// The settings, checked: a length of at least 1 and a scaling in (0, 1].
    pub fn new(max_sequence_length: usize, train_sequence_length_scaling: f64) -> Result<Self> {
        if max_sequence_length == 0 {
            return Err(AlgorithmError::param(
                "alibi",
                "max_sequence_length",
                0,
                "an integer >= 1",
            ));
        }
        let s = train_sequence_length_scaling;
        if !(s.is_finite() && s > 0.0 && s <= 1.0) {
            return Err(AlgorithmError::param(
                "alibi",
                "train_sequence_length_scaling",
                s,
                "a fraction in (0, 1]",
            ));
        }
        Ok(Self {
            max_sequence_length,
            train_sequence_length_scaling: s,
        })
    }

    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "alibi:max_sequence_length={}:train_sequence_length_scaling={}",
            self.max_sequence_length, self.train_sequence_length_scaling
        )
    }

    /// The training length for sequences of `len` tokens: `len * scaling`, which must be a
    /// whole number of at least 1 dividing `len`.
    pub fn train_length(&self, len: usize) -> Result<usize> {
        let s = self.train_sequence_length_scaling;
        let short = (len as f64 * s).round() as usize;
        if short == 0 || !len.is_multiple_of(short) || (short as f64 - len as f64 * s).abs() > 1e-9
        {
            return Err(AlgorithmError::param(
                "alibi",
                "train_sequence_length_scaling",
                s,
                format!(
                    "a fraction that cuts the training sequences of {len} tokens into whole pieces (1/k for k dividing {len})"
                ),
            ));
        }
        Ok(short)
    }
}

/// Applies ALiBi to `model` (the functional form; call it before training): removes its
/// position embeddings, lets it take `max_sequence_length` tokens, and gives every attention
/// layer its heads' slopes. Returns what it changed.
pub fn apply_alibi<M: Surgical + ?Sized>(model: &mut M, options: &AlibiOptions) -> SurgeryRecord {
    let mut layers = Vec::new();
    if let Some(path) = model.remove_position_embeddings(options.max_sequence_length) {
        layers.push(path);
    }
    model.for_each_attention(&mut |info, variant| {
        variant.alibi_slopes = Some(alibi_slopes(info.heads));
        layers.push(info.path.clone());
    });
    SurgeryRecord {
        settings: options.describe(),
        layers,
    }
}

/// The ALiBi algorithm: [`apply_alibi`] at `INIT`, and training batches reshaped to
/// shorter sequences at `AFTER_DATALOADER` (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Alibi {
    options: AlibiOptions,
    applied: Applied,
}

impl Alibi {
    /// The algorithm with `options`.
    pub fn new(options: AlibiOptions) -> Self {
        Self {
            options,
            applied: Applied::default(),
        }
    }
}

impl<S: Setup> Algorithm<S> for Alibi
where
    S::Model: Surgical,
    BatchOf<S>: SequenceBatch<S::Backend>,
{
    fn name(&self) -> &str {
        "alibi"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        event == Event::Init
            || (event == Event::AfterDataloader && self.options.train_sequence_length_scaling < 1.0)
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        if event == Event::Init {
            let options = self.options;
            return self
                .applied
                .run(NEEDS, state, |model| Ok(apply_alibi(model, &options)));
        }
        let Some(len) = state.batch().map(|b| b.seq_len()) else {
            return Ok(());
        };
        let short = self.options.train_length(len)?;
        state.map_batch(|batch| Ok(shorten::<S::Backend, _>(batch, short, false)))
    }

    fn state_dict(&self) -> serde_json::Value {
        self.applied.state_dict()
    }

    fn required_on_load(&self) -> bool {
        true
    }

    fn load_state_dict(&mut self, state: serde_json::Value) -> flashover_core::Result<()> {
        self.applied.check("alibi", self.options.describe(), state)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "alibi",
    params: ["max_sequence_length", "train_sequence_length_scaling"],
}
crate::spec::by_name! {language |p| {
    let d = AlibiOptions::default();
    Alibi::new(AlibiOptions::new(
        p.usize("max_sequence_length", d.max_sequence_length)?,
        p.f64(
            "train_sequence_length_scaling",
            d.train_sequence_length_scaling,
        )?,
    )?)
}}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slopes_follow_the_paper() {
        // 8 heads: 2^-1 ... 2^-8 (the paper's example).
        let s = alibi_slopes(8);
        let want: Vec<f32> = (1..=8).map(|i| 0.5f32.powi(i)).collect();
        assert_eq!(s, want);
        // 4 heads: start 2^(-2) = 0.25, ratio 0.25.
        assert_eq!(alibi_slopes(4), [0.25, 0.0625, 0.015625, 0.00390625]);
        // 1 head: 2^-8.
        assert_eq!(alibi_slopes(1), [2f32.powi(-8)]);
        // 6 heads (not a power of two): the 4-head slopes, then every other 8-head slope
        // (2^-1, 2^-3) for the remaining two.
        assert_eq!(
            alibi_slopes(6),
            [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
        );
        // 12 heads: 8 slopes 2^-1..2^-8, then 16-head slopes 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
        let s = alibi_slopes(12);
        for (k, e) in [0.5f64, 1.5, 2.5, 3.5].iter().enumerate() {
            assert!((s[8 + k] as f64 - 2f64.powf(-e)).abs() < 1e-7, "{s:?}");
        }
    }

    #[test]
    fn settings_are_checked_and_named() {
        let e = AlibiOptions::new(0, 0.5).unwrap_err().to_string();
        assert!(e.contains("max_sequence_length") && e.contains('0'), "{e}");
        let e = AlibiOptions::new(64, 1.5).unwrap_err().to_string();
        assert!(e.contains("1.5") && e.contains("(0, 1]"), "{e}");
        let o = AlibiOptions::new(64, 0.25).unwrap();
        assert_eq!(o.train_length(128).unwrap(), 32);
        let e = o.train_length(10).unwrap_err().to_string();
        assert!(e.contains("10 tokens") && e.contains("0.25"), "{e}");
        assert_eq!(
            AlibiOptions::new(64, 1.0).unwrap().train_length(7).unwrap(),
            7
        );
    }
}
