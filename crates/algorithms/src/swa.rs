//! Stochastic weight averaging (Izmailov et al., 2018, "Averaging Weights Leads to Wider
//! Optima and Better Generalization"): late in training, average the weights at regular
//! intervals (an equal-weight running mean) and finish with the average. Optionally the
//! learning rate is annealed to a constant `swa_lr` from `swa_start` on, as the paper does.
//!
//! Hyperparameters (Composer's names): `swa_start` 0.7 (fraction of training), `swa_end` 1.0
//! (when the average replaces the weights; at 1.0 that is the end of the last batch, before
//! the final evaluation), `update_interval` `1ep` (or `Nba`), `schedule_swa_lr` false,
//! `swa_lr` (default: the scheduled learning rate at `swa_start`), `anneal_batches` 10,
//! `anneal_strategy` linear or cos. Batch-norm statistics are not recomputed (the models here
//! have none; a model with batch norm should run a few batches after `swa_end`).
//!
//! Hooks: `BATCH_START` (learning rate), `BATCH_END` (update the average; replace the weights
//! once `swa_end` is reached). The average, its count and whether it was applied are saved in
//! checkpoints.

use burn::tensor::backend::AutodiffBackend;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::schedule::ScheduleContext;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::Time;
use serde_json::{json, Value};

use crate::error::{check_range, AlgorithmError, Result};
use crate::params::ParamSet;
use crate::util::fraction;

/// How the learning rate moves to `swa_lr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anneal {
    /// Linearly.
    Linear,
    /// Along a half cosine.
    Cos,
}

/// Learning rate `steps` batches after `swa_start`, annealing from `from` to `to` over `anneal`
/// batches.
pub fn swa_lr_at(steps: f64, anneal: f64, from: f64, to: f64, strategy: Anneal) -> f64 {
    let t = if anneal <= 0.0 {
        1.0
    } else {
        (steps / anneal).clamp(0.0, 1.0)
    };
    match strategy {
        Anneal::Linear => from + (to - from) * t,
        Anneal::Cos => to + (from - to) * (1.0 + (std::f64::consts::PI * t).cos()) / 2.0,
    }
}

/// SWA's settings.
#[derive(Debug, Clone)]
pub struct SwaConfig {
    /// Fraction of training at which averaging starts.
    pub swa_start: f64,
    /// Fraction at which the average replaces the weights.
    pub swa_end: f64,
    /// Averaging interval, in epochs or batches.
    pub update_interval: Time,
    /// Whether to anneal the learning rate to `swa_lr` from `swa_start` on.
    pub schedule_swa_lr: bool,
    /// Target learning rate (default: the scheduled rate at `swa_start`).
    pub swa_lr: Option<f64>,
    /// Batches over which to anneal.
    pub anneal_batches: u64,
    /// Annealing shape.
    pub anneal: Anneal,
}

impl Default for SwaConfig {
    fn default() -> Self {
        SwaConfig {
            swa_start: 0.7,
            swa_end: 1.0,
            update_interval: Time::Epoch(1),
            schedule_swa_lr: false,
            swa_lr: None,
            anneal_batches: 10,
            anneal: Anneal::Linear,
        }
    }
}

/// The SWA algorithm; see the module docs.
pub struct Swa<B: AutodiffBackend> {
    cfg: SwaConfig,
    averaged: Option<ParamSet<B::InnerBackend>>,
    count: u64,
    applied: bool,
    pending: Option<Value>,
}

impl<B: AutodiffBackend> Swa<B> {
    /// SWA with `cfg`.
    pub fn new(cfg: SwaConfig) -> Result<Self> {
        check_range("swa", "swa_start", cfg.swa_start, 0.0, 1.0)?;
        check_range("swa", "swa_end", cfg.swa_end, 0.0, 1.0)?;
        if cfg.swa_end < cfg.swa_start {
            return Err(AlgorithmError::param(
                "swa",
                "swa_end",
                cfg.swa_end,
                format!("at least swa_start ({})", cfg.swa_start),
            ));
        }
        match cfg.update_interval {
            Time::Epoch(n) | Time::Batch(n) if n > 0 => {}
            other => {
                return Err(AlgorithmError::param(
                    "swa",
                    "update_interval",
                    other,
                    "a positive number of epochs or batches, e.g. 1ep or 50ba",
                ))
            }
        }
        if let Some(lr) = cfg.swa_lr {
            if !(lr.is_finite() && lr >= 0.0) {
                return Err(AlgorithmError::param(
                    "swa",
                    "swa_lr",
                    lr,
                    "a finite number >= 0",
                ));
            }
        }
        Ok(Swa {
            cfg,
            averaged: None,
            count: 0,
            applied: false,
            pending: None,
        })
    }

    /// How many weight snapshots the average holds.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn due<S: Setup>(&self, state: &State<S>) -> bool {
        let ts = state.timestamp();
        match self.cfg.update_interval {
            Time::Epoch(n) => {
                ts.batch_in_epoch == state.batches_per_epoch() && (ts.epoch + 1).is_multiple_of(n)
            }
            Time::Batch(n) => ts.batch.is_multiple_of(n),
            _ => false,
        }
    }
}

impl<S: Setup> Algorithm<S> for Swa<S::Backend> {
    fn name(&self) -> &str {
        "swa"
    }

    fn matches(&self, event: Event, state: &State<S>) -> bool {
        match event {
            Event::BatchStart => self.cfg.schedule_swa_lr && fraction(state) >= self.cfg.swa_start,
            Event::BatchEnd => !self.applied,
            _ => false,
        }
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        if let Some(v) = self.pending.take() {
            let bad = |r: &str| AlgorithmError::BadState {
                algorithm: "swa",
                reason: r.to_string(),
            };
            self.count = v["count"].as_u64().ok_or_else(|| bad("no count"))?;
            self.applied = v["applied"]
                .as_bool()
                .ok_or_else(|| bad("no applied flag"))?;
            self.averaged = match &v["averaged"] {
                Value::Null => None,
                a => Some(ParamSet::from_json(a, state.device(), "swa")?),
            };
        }
        let progress = state.progress();
        if event == Event::BatchStart {
            let start = progress
                .to_batches(Time::Duration(self.cfg.swa_start))
                .unwrap_or(0.0)
                .floor();
            let ctx = ScheduleContext {
                batch: start,
                progress,
                scale_schedule_ratio: state.scale_schedule_ratio(),
            };
            let from = state.base_lr() * state.scheduler().factor(&ctx);
            let to = self.cfg.swa_lr.unwrap_or(from);
            let steps = state.timestamp().batch as f64 - start;
            return state.set_lr(swa_lr_at(
                steps,
                self.cfg.anneal_batches as f64,
                from,
                to,
                self.cfg.anneal,
            ));
        }
        if fraction(state) >= self.cfg.swa_start && self.due(state) {
            let current = ParamSet::of_autodiff(state.model());
            let k = self.count as f64;
            match self.averaged.as_mut() {
                // Running mean: avg + (w - avg) / (k + 1).
                Some(avg) => avg.zip_update(&current, "swa", |a, w| {
                    a.clone() + (w - a).div_scalar(k + 1.0)
                })?,
                None => self.averaged = Some(current),
            }
            self.count += 1;
        }
        if fraction(state) >= self.cfg.swa_end {
            if let Some(avg) = &self.averaged {
                let mut result = Ok(());
                state.map_model(|m| match avg.load_into(m.clone(), "swa") {
                    Ok(m) => m,
                    Err(e) => {
                        result = Err(e);
                        m
                    }
                });
                result?;
                tracing::info!(
                    snapshots = self.count,
                    "swa: model weights replaced by their average"
                );
            }
            self.applied = true;
        }
        Ok(())
    }

    fn state_dict(&self) -> Value {
        if let Some(p) = &self.pending {
            return p.clone();
        }
        json!({
            "count": self.count,
            "applied": self.applied,
            "averaged": self.averaged.as_ref().map(|a| a.to_json()),
        })
    }

    fn load_state_dict(&mut self, state: Value) -> flashover_core::Result<()> {
        if !state.is_null() {
            self.pending = Some(state);
        }
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "swa",
    params: [
        "swa_start",
        "swa_end",
        "update_interval",
        "schedule_swa_lr",
        "swa_lr",
        "anneal_batches",
        "anneal_strategy",
    ],
}
crate::spec::by_name! {general |p| {
    let anneal = match p.str("anneal_strategy", "linear") {
        "linear" => Anneal::Linear,
        "cos" => Anneal::Cos,
        other => {
            return Err(crate::error::AlgorithmError::param(
                "swa",
                "anneal_strategy",
                other,
                "linear or cos",
            ))
        }
    };
    let swa_lr = match p.raw("swa_lr") {
        None => None,
        Some(_) => Some(p.f64("swa_lr", 0.0)?),
    };
    Swa::<S::Backend>::new(SwaConfig {
        swa_start: p.f64("swa_start", 0.7)?,
        swa_end: p.f64("swa_end", 1.0)?,
        update_interval: p.time("update_interval", flashover_core::time::Time::Epoch(1))?,
        schedule_swa_lr: p.bool("schedule_swa_lr", false)?,
        swa_lr,
        anneal_batches: p.parse("anneal_batches", 10u64, "a non-negative integer")?,
        anneal,
    })?
}}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};

    #[test]
    fn lr_anneals_from_the_scheduled_rate_to_swa_lr() {
        assert_eq!(swa_lr_at(0.0, 10.0, 0.1, 0.01, Anneal::Linear), 0.1);
        assert!((swa_lr_at(5.0, 10.0, 0.1, 0.01, Anneal::Linear) - 0.055).abs() < 1e-12);
        assert!((swa_lr_at(20.0, 10.0, 0.1, 0.01, Anneal::Linear) - 0.01).abs() < 1e-15);
        // Half way along the cosine is the midpoint too; a quarter is (1 + cos(pi/4)) / 2 of the way back.
        assert!((swa_lr_at(5.0, 10.0, 0.1, 0.01, Anneal::Cos) - 0.055).abs() < 1e-12);
        let q = 0.01 + 0.09 * (1.0 + (std::f64::consts::PI / 4.0).cos()) / 2.0;
        assert!((swa_lr_at(2.5, 10.0, 0.1, 0.01, Anneal::Cos) - q).abs() < 1e-12);
    }

    #[test]
    fn bad_settings_name_the_value() {
        type AB = Autodiff<Flex>;
        let e = Swa::<AB>::new(SwaConfig {
            swa_start: 0.8,
            swa_end: 0.5,
            ..Default::default()
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("swa_end") && e.contains("0.5"), "{e}");
        let e = Swa::<AB>::new(SwaConfig {
            update_interval: Time::Sample(5),
            ..Default::default()
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("update_interval"), "{e}");
    }
}
