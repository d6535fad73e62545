//! Stochastic depth (Huang, Sun, Liu, Sedra and Weinberger, "Deep Networks with Stochastic
//! Depth", ECCV 2016; Composer's `StochasticDepth`): in training, the residual branch of a
//! block is dropped at random, so the network trains as an ensemble of shallower ones; in
//! evaluation every branch runs, scaled by its survival probability `1 - p`.
//!
//! - `drop_rate` (0.2) and `drop_distribution`: `linear` (default, the paper's rule) gives
//!   block `i` of `L` (from 0 at the input) `p_i = (i + 1) / L * drop_rate`; `uniform` gives
//!   every block `drop_rate`.
//! - `stochastic_method`: `block` (default, the paper's) drops a block's branch for the whole
//!   batch (the block is then `relu(shortcut(x))`); `sample` drops it sample by sample
//!   (Composer's sample-wise variant: a zeroed branch, no rescaling in training).
//! - `drop_warmup` (0): the fraction of training over which the rates rise linearly from 0.
//!   Composer allows it for the block method only; here it applies to both.
//!
//! The draws come from the trainer's random stream of the current batch (and microbatch),
//! so a resumed run draws what the uninterrupted one drew (Composer marks its resumption test
//! as an expected failure). Block-wise draws are the same on every rank of a data-parallel
//! run (Composer's `use_same_gpu_seed`, its default): the ranks train the same sub-network.
//! Sample-wise draws differ per rank, as the samples do.
//!
//! When it helps: deep residual networks (the paper: ResNet-110 and deeper on CIFAR, 25%
//! faster training and better accuracy); on shallow ones it mostly regularises. A dropped
//! block saves its branch's compute in the block method.
//!
//! Surgery at `INIT` on the residual blocks the model shows ([`Surgical`]); no parameter changes. The layers
//! changed are the checkpoint state, and a checkpoint of another surgery is refused.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::Batch;
use flashover_core::rng::{derive_seed, hash_str, Rng};
use flashover_core::setup::{BatchOf, Setup};
use flashover_core::state::State;
use flashover_surgery::{
    DepthDrop, DropMode, Keep, LayerKind, SurgeryRecord, Surgical, SurgicalExt,
};
use serde_json::Value;

use crate::error::{AlgorithmError, Result};
use crate::surgery::{Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "stochastic_depth",
    kinds: &[LayerKind::Residual],
    describe: "surgery-ready residual blocks",
};

/// How the drop rate is spread over the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropDistribution {
    /// The same rate for every block.
    Uniform,
    /// Rising linearly with depth to `drop_rate` at the last block.
    Linear,
}

/// Stochastic depth's settings (Composer's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StochasticDepthOptions {
    /// Block-wise or sample-wise.
    pub method: DropMode,
    /// The largest drop probability.
    pub drop_rate: f64,
    /// How the rate is spread over the blocks.
    pub distribution: DropDistribution,
    /// Fraction of training over which the rates rise from 0.
    pub drop_warmup: f64,
}

impl Default for StochasticDepthOptions {
    fn default() -> Self {
        Self {
            method: DropMode::Block,
            drop_rate: 0.2,
            distribution: DropDistribution::Linear,
            drop_warmup: 0.0,
        }
    }
}

impl StochasticDepthOptions {
    /// Checks the ranges: `drop_rate` and `drop_warmup` in `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("drop_rate", self.drop_rate),
            ("drop_warmup", self.drop_warmup),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(AlgorithmError::param(
                    "stochastic_depth",
                    name,
                    v,
                    "a number from 0 to 1",
                ));
            }
        }
        Ok(())
    }

    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "stochastic_depth:stochastic_method={}:drop_rate={}:drop_distribution={}:drop_warmup={}",
            match self.method {
                DropMode::Block => "block",
                DropMode::Sample => "sample",
            },
            self.drop_rate,
            match self.distribution {
                DropDistribution::Uniform => "uniform",
                DropDistribution::Linear => "linear",
            },
            self.drop_warmup
        )
    }

    /// The drop probability of block `index` of `count` when a fraction `fraction` of
    /// training is done.
    pub fn rate(&self, index: usize, count: usize, fraction: f64) -> f64 {
        let base = if self.drop_warmup > 0.0 && fraction < self.drop_warmup {
            self.drop_rate * fraction.max(0.0) / self.drop_warmup
        } else {
            self.drop_rate
        };
        match self.distribution {
            DropDistribution::Uniform => base,
            DropDistribution::Linear => (index + 1) as f64 / count.max(1) as f64 * base,
        }
    }
}

/// Turns stochastic depth on in every residual block of `model` at the rates of `fraction`
/// (the functional form; call it before building the optimizer) and returns what it changed.
/// In a hand-written loop, call [`draw`] before every training forward pass (without a draw
/// every branch runs) and [`settle`] after the step; evaluation scales each branch by its
/// survival probability either way.
pub fn apply_stochastic_depth<M: Surgical + ?Sized>(
    model: &mut M,
    options: &StochasticDepthOptions,
    fraction: f64,
) -> Result<SurgeryRecord> {
    options.validate()?;
    let mut layers = Vec::new();
    model.for_each_residual(&mut |info, variant| {
        variant.drop = Some(DepthDrop {
            mode: options.method,
            rate: options.rate(info.index, info.count, fraction),
            keep: None,
        });
        layers.push(info.path.clone());
    });
    Ok(SurgeryRecord {
        settings: options.describe(),
        layers,
    })
}

/// Sets every block's rate for `fraction` and draws which branches run for a batch of
/// `samples` samples: block-wise from `block_rng`, sample-wise from `sample_rng`, block after
/// block in module order (a branch is dropped when its uniform draw falls below its rate).
pub fn draw<M: Surgical + ?Sized>(
    model: &mut M,
    options: &StochasticDepthOptions,
    fraction: f64,
    samples: usize,
    block_rng: &mut Rng,
    sample_rng: &mut Rng,
) {
    model.for_each_residual(&mut |info, variant| {
        let rate = options.rate(info.index, info.count, fraction);
        let keep = match options.method {
            DropMode::Block => Keep::Block(block_rng.next_f64() >= rate),
            DropMode::Sample => Keep::Samples(
                (0..samples)
                    .map(|_| sample_rng.next_f64() >= rate)
                    .collect(),
            ),
        };
        variant.drop = Some(DepthDrop {
            mode: options.method,
            rate,
            keep: Some(keep),
        });
    });
}

/// What a draw reads of the trainer's state, taken before the model is borrowed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DrawInputs {
    epoch: u64,
    batch_in_epoch: u64,
    seed: u64,
    /// This rank's stream of the batch (sample-wise draws).
    rank_seed: u64,
    samples: usize,
    fraction: f64,
    /// The attempt at the batch (see `State::batch_attempt`).
    attempt: u32,
}

impl DrawInputs {
    pub(crate) fn of<S: Setup>(state: &State<S>) -> Self {
        let ts = state.timestamp();
        Self {
            epoch: ts.epoch,
            batch_in_epoch: ts.batch_in_epoch,
            seed: state.seed(),
            rank_seed: state.rng("stochastic_depth").next_u64(),
            samples: state.batch().map_or(0, Batch::len),
            fraction: crate::util::fraction(state),
            attempt: state.batch_attempt(),
        }
    }
}

/// The per-batch part shared by the typed and the by-name algorithm.
#[derive(Debug, Clone, Default)]
pub(crate) struct Draws {
    /// `(epoch, batch_in_epoch, attempt)` of the last draw and the forward passes drawn for
    /// it (a retried batch counts again from 0).
    last: Option<((u64, u64, u32), u64)>,
}

impl Draws {
    /// Draws for the coming forward pass (one per microbatch, each its own stream).
    pub(crate) fn before_forward(
        &mut self,
        model: &mut dyn Surgical,
        options: &StochasticDepthOptions,
        inputs: &DrawInputs,
    ) {
        let at = (inputs.epoch, inputs.batch_in_epoch, inputs.attempt);
        let call = match self.last {
            Some((last, n)) if last == at => n + 1,
            _ => 0,
        };
        self.last = Some((at, call));
        // Block-wise: the same on every rank (no rank in the seed).
        let mut block_rng = Rng::new(derive_seed(&[
            inputs.seed,
            inputs.epoch,
            inputs.batch_in_epoch,
            hash_str("stochastic_depth"),
            call,
        ]));
        let mut sample_rng = Rng::new(derive_seed(&[inputs.rank_seed, call]));
        draw(
            model,
            options,
            inputs.fraction,
            inputs.samples,
            &mut block_rng,
            &mut sample_rng,
        );
    }
}

/// Sets every block's rate for `fraction` of training done and forgets the last draw: at
/// the end of each batch (so that an evaluation, or a training-mode forward pass outside the
/// step such as selective backprop's scoring, never reuses a stale draw, and sees the rates
/// of the timestamp a checkpoint saves) and after a restore (the same state, rebuilt).
pub fn settle(model: &mut dyn Surgical, options: &StochasticDepthOptions, fraction: f64) {
    model.for_each_residual(&mut |info, variant| {
        if let Some(d) = &mut variant.drop {
            d.rate = options.rate(info.index, info.count, fraction);
            d.keep = None;
        }
    });
}

/// The StochasticDepth algorithm: surgery at `INIT`, draws before every forward pass, rates
/// settled at the end of every batch and after a restore. `Default` is Composer's settings.
#[derive(Debug, Clone, Default)]
pub struct StochasticDepth {
    options: StochasticDepthOptions,
    draws: Draws,
    applied: Applied,
}

impl StochasticDepth {
    /// Stochastic depth with `options` (checked).
    pub fn new(options: StochasticDepthOptions) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            options,
            draws: Draws::default(),
            applied: Applied::default(),
        })
    }
}

impl<S: Setup> Algorithm<S> for StochasticDepth
where
    S::Model: Surgical,
    BatchOf<S>: Batch,
{
    fn name(&self) -> &str {
        "stochastic_depth"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        matches!(
            event,
            Event::Init | Event::AfterLoad | Event::BeforeForward | Event::BatchEnd
        )
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let options = self.options;
        match event {
            Event::Init => {
                let fraction = crate::util::fraction(state);
                let mut record = None;
                state.map_model(|mut model| {
                    record = Some(
                        NEEDS
                            .check(&mut model)
                            .and_then(|()| apply_stochastic_depth(&mut model, &options, fraction)),
                    );
                    model
                });
                // Invariant: `map_model` ran the closure.
                let record = record.expect("the surgery ran")?;
                self.applied.keep("stochastic_depth", record);
            }
            Event::AfterLoad | Event::BatchEnd => {
                let fraction = crate::util::fraction(state);
                state.map_model(|mut model| {
                    settle(&mut model, &options, fraction);
                    model
                });
            }
            _ => {
                let inputs = DrawInputs::of(state);
                let draws = &mut self.draws;
                state.map_model(|mut model| {
                    draws.before_forward(&mut model, &options, &inputs);
                    model
                });
            }
        }
        Ok(())
    }

    fn state_dict(&self) -> Value {
        self.applied.state_dict()
    }

    fn required_on_load(&self) -> bool {
        true
    }

    fn load_state_dict(&mut self, state: Value) -> flashover_core::Result<()> {
        self.applied
            .check("stochastic_depth", self.options.describe(), state)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "stochastic_depth",
    params: [
        "stochastic_method",
        "drop_rate",
        "drop_distribution",
        "drop_warmup",
    ],
}
crate::spec::by_name! {image |p, _norm| {
    let d = StochasticDepthOptions::default();
    let options = StochasticDepthOptions {
        method: match p.str("stochastic_method", "block") {
            "block" => flashover_surgery::DropMode::Block,
            "sample" => flashover_surgery::DropMode::Sample,
            other => {
                return Err(crate::error::AlgorithmError::param(
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
                return Err(crate::error::AlgorithmError::param(
                    "stochastic_depth",
                    "drop_distribution",
                    other,
                    "linear or uniform",
                ))
            }
        },
        drop_warmup: p.f64("drop_warmup", d.drop_warmup)?,
    };
    StochasticDepth::new(options)?
}}

#[cfg(test)]
mod tests {
    use flashover_surgery::{Layers, ResidualBlock, ResidualVariant};

    use super::*;

    /// A model of `n` residual blocks, as surgery sees them.
    struct Blocks(Vec<ResidualVariant>);

    struct Block<'a>(&'a mut ResidualVariant);

    impl ResidualBlock for Block<'_> {
        fn variant(&mut self) -> &mut ResidualVariant {
            self.0
        }
    }

    impl Surgical for Blocks {
        fn visit_layers(&mut self, layers: &mut Layers<'_>) {
            for (index, v) in self.0.iter_mut().enumerate() {
                layers.residual(&format!("blocks.{index}"), &mut Block(v));
            }
        }
    }

    #[test]
    fn rates_follow_the_papers_linear_rule_and_the_warmup() {
        let o = StochasticDepthOptions::default();
        // Huang et al.: p_l = l / L * p_L for blocks l = 1..L.
        for (i, want) in [(0, 0.2 / 9.0), (4, 0.2 * 5.0 / 9.0), (8, 0.2)] {
            assert!((o.rate(i, 9, 0.5) - want).abs() < 1e-15, "block {i}");
        }
        let u = StochasticDepthOptions {
            distribution: DropDistribution::Uniform,
            drop_warmup: 0.1,
            ..o
        };
        assert!(
            (u.rate(0, 9, 0.05) - 0.1).abs() < 1e-15,
            "halfway through the warmup"
        );
        assert_eq!(u.rate(8, 9, 0.0), 0.0);
        assert_eq!(u.rate(3, 9, 0.1), 0.2);
        assert!(StochasticDepthOptions {
            drop_rate: 1.5,
            ..o
        }
        .validate()
        .is_err());
        assert!(StochasticDepthOptions {
            drop_warmup: -0.1,
            ..o
        }
        .validate()
        .is_err());
    }

    #[test]
    fn draws_drop_at_the_rates_and_repeat_with_the_seed() {
        for method in [DropMode::Block, DropMode::Sample] {
            let o = StochasticDepthOptions {
                method,
                drop_rate: 0.5,
                ..Default::default()
            };
            let mut model = Blocks(vec![ResidualVariant::default(); 4]);
            apply_stochastic_depth(&mut model, &o, 0.0).unwrap();
            let (mut dropped, mut seen) = ([0usize; 4], 0usize);
            let mut first = None;
            for t in 0..2000u64 {
                let (mut a, mut b) = (Rng::new(t), Rng::new(t + 7));
                draw(&mut model, &o, 1.0, 8, &mut a, &mut b);
                let keeps: Vec<Keep> = model
                    .0
                    .iter()
                    .map(|v| v.drop.as_ref().unwrap().keep.clone().unwrap())
                    .collect();
                if t == 0 {
                    first = Some(keeps.clone());
                }
                for (i, k) in keeps.iter().enumerate() {
                    match k {
                        Keep::Block(keep) => dropped[i] += usize::from(!keep),
                        Keep::Samples(s) => {
                            assert_eq!(s.len(), 8);
                            dropped[i] += s.iter().filter(|k| !**k).count();
                        }
                    }
                }
                seen += if method == DropMode::Block { 1 } else { 8 };
            }
            for (i, d) in dropped.iter().enumerate() {
                let want = o.rate(i, 4, 1.0);
                let got = *d as f64 / seen as f64;
                // Binomial standard error at these counts is under 0.012.
                assert!(
                    (got - want).abs() < 0.04,
                    "{method:?} block {i}: {got} vs {want}"
                );
            }
            let (mut a, mut b) = (Rng::new(0), Rng::new(7));
            draw(&mut model, &o, 1.0, 8, &mut a, &mut b);
            let again: Vec<Keep> = model
                .0
                .iter()
                .map(|v| v.drop.as_ref().unwrap().keep.clone().unwrap())
                .collect();
            assert_eq!(Some(again), first, "same seeds, same draws");
        }
    }
}
