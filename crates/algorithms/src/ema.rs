//! Exponential moving average of the weights (Polyak and Juditsky, 1992; as in Composer's
//! EMA): keep `ema = d * ema + (1 - d) * w` after every optimizer step and evaluate with `ema`.
//! The decay comes from a half-life in any time unit: after `delta` units,
//! `d = 0.5^(delta / half_life)`, so the weight of old values halves every half-life whatever
//! the batch size.
//!
//! Hyperparameter: `half_life` (default `1000ba`, Composer's). Evaluation (and prediction)
//! uses the averaged weights; they are swapped in at `EVAL_BEFORE_ALL` (`PREDICT_START`) and
//! the training weights swapped back at `EVAL_AFTER_ALL` (`PREDICT_END`), so training itself
//! is unchanged. The average starts from the weights at `FIT_START` and is saved in
//! checkpoints bit for bit.
//!
//! **The model ends training with the averaged weights**, as in Composer (whose EMA leaves
//! them in the model after its last checkpoint event): at the `BATCH_END` of the run's last
//! batch (or at `FIT_END`, when a stop request ends the run sooner) the averaged weights
//! replace the model's, so `trainer.model()`, the checkpoints written after that point (the
//! one at the end of the run) and any weights a program saves are the ones that were
//! evaluated. The training weights are kept (and saved in this algorithm's checkpoint state):
//! a run resumed or continued from there (`fit` again with a longer `max_duration`) gets them
//! back at `FIT_START`, so resumption stays bit-exact. A checkpoint a save interval took at
//! the last batch before a stop request holds the training weights, with the average in this
//! algorithm's state.
//!
//! The averaged copy lives apart from the model (a [`ParamSet`] keyed by parameter id), never
//! as a clone of the module, so that no state is shared with the training model.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::Time;
use serde_json::{json, Value};

use crate::error::{AlgorithmError, Result};
use crate::params::ParamSet;

/// Decay for `delta` units of time with half-life `half_life` units: `0.5^(delta/half_life)`.
pub fn decay_for(delta: f64, half_life: f64) -> f64 {
    0.5f64.powf(delta / half_life)
}

/// One EMA step: `decay * avg + (1 - decay) * w`.
pub fn ema_update<B: Backend, const D: usize>(
    avg: Tensor<B, D>,
    w: Tensor<B, D>,
    decay: f64,
) -> Tensor<B, D> {
    avg.mul_scalar(decay) + w.mul_scalar(1.0 - decay)
}

/// The EMA algorithm; see the module docs.
pub struct Ema<B: AutodiffBackend> {
    half_life: Time,
    averaged: Option<ParamSet<B::InnerBackend>>,
    /// Elapsed time (in the half-life's unit) at the last update.
    last: f64,
    /// The training weights while the averaged ones are swapped in for an evaluation.
    training: Option<ParamSet<B::InnerBackend>>,
    /// The training weights once the averaged ones replaced them at the end of the run
    /// (until a later `FIT_START` puts them back).
    held: Option<ParamSet<B::InnerBackend>>,
    /// Saved state waiting for a device to be decoded on.
    pending: Option<Value>,
}

impl<B: AutodiffBackend> Ema<B> {
    /// EMA with `half_life` greater than zero, in any unit.
    pub fn new(half_life: Time) -> Result<Self> {
        if half_life.is_zero() || !half_life.value().is_finite() {
            return Err(AlgorithmError::param(
                "ema",
                "half_life",
                half_life,
                "a time greater than zero, e.g. 100ba or 0.05dur",
            ));
        }
        Ok(Ema {
            half_life,
            averaged: None,
            last: 0.0,
            training: None,
            held: None,
            pending: None,
        })
    }

    /// The averaged weights, once training has started.
    pub fn averaged(&self) -> Option<&ParamSet<B::InnerBackend>> {
        self.averaged.as_ref()
    }

    fn elapsed<S: Setup>(&self, state: &State<S>) -> f64 {
        state
            .progress()
            .elapsed(state.timestamp(), self.half_life.unit())
    }

    fn decode_pending(&mut self, device: &B::Device) -> Result<()> {
        if let Some(v) = self.pending.take() {
            self.averaged = Some(ParamSet::from_json(&v["averaged"], device, "ema")?);
            self.held = match v.get("training") {
                Some(t) if !t.is_null() => Some(ParamSet::from_json(t, device, "ema")?),
                _ => None,
            };
            self.last = v["last"].as_f64().ok_or_else(|| AlgorithmError::BadState {
                algorithm: "ema",
                reason: "no `last` time".into(),
            })?;
        }
        Ok(())
    }

    /// Puts the averaged weights in the model for good, keeping the training weights (once).
    fn replace_with_average<S: Setup<Backend = B>>(&mut self, state: &mut State<S>) -> Result<()> {
        if self.held.is_some() {
            return Ok(());
        }
        if let Some(avg) = &self.averaged {
            let train = ParamSet::of_autodiff(state.model());
            load_into_model(state, avg)?;
            self.held = Some(train);
        }
        Ok(())
    }
}

/// Loads `params` into the state's model.
fn load_into_model<S: Setup>(
    state: &mut State<S>,
    params: &ParamSet<<S::Backend as AutodiffBackend>::InnerBackend>,
) -> Result<()> {
    let mut result = Ok(());
    state.map_model(|m| match params.load_into(m.clone(), "ema") {
        Ok(m) => m,
        Err(e) => {
            result = Err(e);
            m
        }
    });
    result
}

impl<S: Setup> Algorithm<S> for Ema<S::Backend> {
    fn name(&self) -> &str {
        "ema"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        matches!(
            event,
            Event::FitStart
                | Event::BatchEnd
                | Event::FitEnd
                | Event::EvalBeforeAll
                | Event::EvalAfterAll
                | Event::PredictStart
                | Event::PredictEnd
        )
    }

    fn apply(
        &mut self,
        event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        self.decode_pending(state.device())?;
        if event == Event::FitStart {
            state.check_countable("ema half_life", self.half_life)?;
        }
        match event {
            Event::FitStart => {
                // A run continued or resumed after the end-of-run swap trains on from the
                // training weights, not from the average.
                if let Some(train) = self.held.take() {
                    load_into_model(state, &train)?;
                }
                if self.averaged.is_none() {
                    self.averaged = Some(ParamSet::of_autodiff(state.model()));
                    self.last = self.elapsed(state);
                }
            }
            Event::BatchEnd => {
                let now = self.elapsed(state);
                let decay = decay_for(now - self.last, self.half_life.value());
                self.last = now;
                let current = ParamSet::of_autodiff(state.model());
                match self.averaged.as_mut() {
                    Some(avg) => avg.zip_update(&current, "ema", |a, w| ema_update(a, w, decay))?,
                    None => self.averaged = Some(current),
                }
                if state.progress().is_done(state.timestamp()) {
                    self.replace_with_average(state)?;
                }
            }
            Event::FitEnd => self.replace_with_average(state)?,
            // After the end-of-run swap the model already holds the average.
            Event::EvalBeforeAll | Event::PredictStart if self.held.is_some() => {}
            Event::EvalBeforeAll | Event::PredictStart => {
                if let Some(avg) = &self.averaged {
                    self.training = Some(ParamSet::of_autodiff(state.model()));
                    let mut result = Ok(());
                    state.map_model(|m| match avg.load_into(m.clone(), "ema") {
                        Ok(m) => m,
                        Err(e) => {
                            result = Err(e);
                            m
                        }
                    });
                    result?;
                }
            }
            Event::EvalAfterAll | Event::PredictEnd => {
                if let Some(train) = self.training.take() {
                    let mut result = Ok(());
                    state.map_model(|m| match train.load_into(m.clone(), "ema") {
                        Ok(m) => m,
                        Err(e) => {
                            result = Err(e);
                            m
                        }
                    });
                    result?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn state_dict(&self) -> Value {
        match (&self.averaged, &self.pending) {
            (Some(avg), _) => json!({
                "averaged": avg.to_json(),
                "last": self.last,
                "training": self.held.as_ref().map(ParamSet::to_json),
            }),
            (None, Some(p)) => p.clone(),
            (None, None) => Value::Null,
        }
    }

    fn load_state_dict(&mut self, state: Value) -> flashover_core::Result<()> {
        if !state.is_null() {
            self.averaged = None;
            self.held = None;
            self.pending = Some(state);
        }
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "ema", params: ["half_life"]}
crate::spec::by_name! {general |p| Ema::<S::Backend>::new(
    p.time("half_life", flashover_core::time::Time::Batch(1000))?,
)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[test]
    fn decay_halves_the_old_weight_every_half_life() {
        assert!((decay_for(100.0, 100.0) - 0.5).abs() < 1e-15);
        assert!((decay_for(1.0, 100.0) - 0.5f64.powf(0.01)).abs() < 1e-15);
        // 100 per-batch steps equal one step of 100 batches.
        let d1 = decay_for(1.0, 100.0);
        assert!((d1.powi(100) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn update_with_a_known_half_life_matches_the_formula() {
        // Average 0, weights 1, half-life 2 batches, one batch: d = 2^-0.5 = 0.70711;
        // ema = 1 - d = 0.29289. A second step: ema = d * 0.29289 + (1 - d) = 0.5 exactly,
        // as two steps make one half-life.
        let dev = Default::default();
        let w = Tensor::<Flex, 1>::from_data(TensorData::new(vec![1.0f32], [1]), &dev);
        let d = decay_for(1.0, 2.0);
        let a = ema_update(Tensor::<Flex, 1>::zeros([1], &dev), w.clone(), d);
        let v: f32 = a.clone().into_scalar();
        assert!((v as f64 - (1.0 - 0.5f64.sqrt())).abs() < 1e-6);
        let v: f32 = ema_update(a, w, d).into_scalar();
        assert!((v - 0.5).abs() < 1e-6);
    }

    #[test]
    fn zero_half_life_is_refused() {
        let e = Ema::<burn::backend::Autodiff<Flex>>::new(Time::Batch(0))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("half_life") && e.contains("0ba"), "{e}");
    }
}
