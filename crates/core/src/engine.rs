//! The engine runs one event: algorithms whose `matches` is true (reversed at `AFTER_*`
//! events), then callbacks, then loggers; at `INIT`, loggers first so they can record
//! everything that follows. When nothing is registered, running an event costs one branch:
//! that is the trainer's hot path with no algorithms and no callbacks.

use std::collections::BTreeMap;

use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;
use serde_json::Value;

use crate::callback::{Algorithm, Callback};
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::logger::Logger;
use crate::model::TrainModel;
use crate::state::State;

/// Runs events over the registered algorithms, callbacks and loggers.
pub struct Engine<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> {
    pub(crate) algorithms: Vec<Box<dyn Algorithm<B, M, O>>>,
    pub(crate) callbacks: Vec<Box<dyn Callback<B, M, O>>>,
    pub(crate) logger: Logger,
    idle: bool,
    collect_states: bool,
}

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> Engine<B, M, O> {
    /// An engine over the given parts.
    pub fn new(
        algorithms: Vec<Box<dyn Algorithm<B, M, O>>>,
        callbacks: Vec<Box<dyn Callback<B, M, O>>>,
        logger: Logger,
    ) -> Self {
        let idle = algorithms.is_empty() && callbacks.is_empty() && logger.is_empty();
        let collect_states = callbacks.iter().any(|c| c.needs_component_states());
        Engine {
            algorithms,
            callbacks,
            logger,
            idle,
            collect_states,
        }
    }

    /// The logger, for values the trainer itself logs.
    pub fn logger(&mut self) -> &mut Logger {
        &mut self.logger
    }

    /// Whether any algorithm, callback or logger is registered.
    pub fn is_idle(&self) -> bool {
        self.idle
    }

    /// Runs `event`.
    #[inline]
    pub fn run(&mut self, event: Event, state: &mut State<B, M, O>) -> Result<()> {
        if self.idle {
            return Ok(());
        }
        self.run_all(event, state)
    }

    /// Every algorithm's and callback's saved state, keyed `algorithm/<name>` and
    /// `callback/<name>` (a repeated name gets `#2`, `#3`... in registration order).
    pub fn component_states(&self) -> BTreeMap<String, Value> {
        let mut out = BTreeMap::new();
        let algorithms = self
            .algorithms
            .iter()
            .map(|a| (format!("algorithm/{}", a.name()), a.state_dict()));
        let callbacks = self
            .callbacks
            .iter()
            .map(|c| (format!("callback/{}", c.name()), c.state_dict()));
        for (key, value) in algorithms.chain(callbacks) {
            out.insert(unique_key(&out, key), value);
        }
        out
    }

    /// Gives each algorithm and callback the state saved under its key. Components without a
    /// saved state keep their own; a saved state whose component is not registered is an
    /// error, since the run would silently differ from the one that was saved.
    pub fn restore_component_states(&mut self, mut saved: BTreeMap<String, Value>) -> Result<()> {
        let mut seen = BTreeMap::new();
        for a in self.algorithms.iter_mut() {
            let key = unique_key(&seen, format!("algorithm/{}", a.name()));
            seen.insert(key.clone(), Value::Null);
            if let Some(v) = saved.remove(&key) {
                a.load_state_dict(v)?;
            }
        }
        for c in self.callbacks.iter_mut() {
            let key = unique_key(&seen, format!("callback/{}", c.name()));
            seen.insert(key.clone(), Value::Null);
            if let Some(v) = saved.remove(&key) {
                c.load_state_dict(v)?;
            }
        }
        let unused: Vec<String> = saved
            .into_iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, _)| k)
            .collect();
        if !unused.is_empty() {
            return Err(CoreError::config(
                "checkpoint components",
                unused.join(", "),
                "only algorithms and callbacks that this run registers (add them, or load weights only)",
            ));
        }
        Ok(())
    }

    fn run_all(&mut self, event: Event, state: &mut State<B, M, O>) -> Result<()> {
        if self.collect_states
            && matches!(
                event,
                Event::BatchCheckpoint | Event::EpochCheckpoint | Event::FitEnd
            )
        {
            state.component_states = self.component_states();
        }
        if event == Event::Init {
            self.logger
                .run_event(event, &state.timestamp, &state.progress())?;
        }
        if event.is_after() {
            for a in self.algorithms.iter_mut().rev() {
                if a.matches(event, state) {
                    a.apply(event, state, &mut self.logger)?;
                }
            }
        } else {
            for a in self.algorithms.iter_mut() {
                if a.matches(event, state) {
                    a.apply(event, state, &mut self.logger)?;
                }
            }
        }
        for c in self.callbacks.iter_mut() {
            c.run_event(event, state, &mut self.logger)?;
        }
        if event != Event::Init {
            self.logger
                .run_event(event, &state.timestamp, &state.progress())?;
        }
        Ok(())
    }
}

fn unique_key(existing: &BTreeMap<String, Value>, key: String) -> String {
    if !existing.contains_key(&key) {
        return key;
    }
    (2..)
        .map(|i| format!("{key}#{i}"))
        .find(|k| !existing.contains_key(k))
        .unwrap_or(key)
}
