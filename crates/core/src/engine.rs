//! The engine runs one event: algorithms whose `matches` is true (reversed at `AFTER_*`
//! events), then callbacks, then loggers; at `INIT`, loggers first so they can record
//! everything that follows. When nothing is registered, running an event costs one branch:
//! that is the trainer's hot path with no algorithms and no callbacks.
//!
//! On ranks other than 0 of a data-parallel run, callbacks that act on rank 0 only
//! ([`Ranks::Main`](crate::collective::Ranks)) see no events, but their states are still
//! saved and restored, so every rank's checkpoint keys agree.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::callback::{Algorithm, Callback, Control};
use crate::collective::Collective;
use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::logger::Logger;
use crate::setup::Setup;
use crate::state::{State, World};

/// Runs events over the registered algorithms, callbacks and loggers.
pub struct Engine<S: Setup> {
    pub(crate) algorithms: Vec<Box<dyn Algorithm<S>>>,
    pub(crate) callbacks: Vec<Box<dyn Callback<S>>>,
    /// Whether each callback acts on this rank.
    active: Vec<bool>,
    world: World,
    pub(crate) logger: Logger,
    idle: bool,
    collect_states: bool,
}

impl<S: Setup> Engine<S> {
    /// An engine over the given parts, for rank `world.rank`: loggers and callbacks that act
    /// on rank 0 only are left out elsewhere.
    pub fn new(
        algorithms: Vec<Box<dyn Algorithm<S>>>,
        callbacks: Vec<Box<dyn Callback<S>>>,
        logger: Logger,
        world: World,
    ) -> Self {
        let logger = logger.for_rank(world);
        let active: Vec<bool> = callbacks.iter().map(|c| world.runs(c.ranks())).collect();
        let idle = algorithms.is_empty() && !active.contains(&true) && logger.is_empty();
        let collect_states = callbacks
            .iter()
            .zip(&active)
            .any(|(c, &on)| on && c.needs_component_states());
        Engine {
            algorithms,
            callbacks,
            active,
            world,
            logger,
            idle,
            collect_states,
        }
    }

    /// Tells the engine that the run's optimizer state is sharded (or not), so that
    /// callbacks acting on [`Ranks::Shards`](crate::world::Ranks::Shards) act on every rank.
    pub(crate) fn set_sharded(&mut self, sharded: bool) {
        let world = self.world;
        self.active = self
            .callbacks
            .iter()
            .map(|c| world.runs_in(c.ranks(), sharded))
            .collect();
        self.idle =
            self.algorithms.is_empty() && !self.active.contains(&true) && self.logger.is_empty();
        self.collect_states = self
            .callbacks
            .iter()
            .zip(&self.active)
            .any(|(c, &on)| on && c.needs_component_states());
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
    pub fn run(&mut self, event: Event, state: &mut State<S>) -> Result<()> {
        if self.idle {
            return Ok(());
        }
        self.run_all(event, state)
    }

    /// Every algorithm's, callback's and (on this rank) logger's saved state, keyed
    /// `algorithm/<name>`, `callback/<name>` and `logger/<name>` (a repeated name gets `#2`,
    /// `#3`... in registration order).
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
        // Loggers are numbered as the restore numbers them (every one), and only those with
        // something to save are kept: checkpoints of runs whose loggers keep nothing do not
        // change.
        let mut loggers = BTreeMap::new();
        for (key, value) in self.logger.states() {
            let key = unique_key(&loggers, key);
            loggers.insert(key.clone(), Value::Null);
            if !value.is_null() {
                out.insert(key, value);
            }
        }
        out
    }

    /// Gives each algorithm and callback the state saved under its key. Components without a
    /// saved state keep their own; a saved state whose component is not registered is an
    /// error, since the run would silently differ from the one that was saved. A logger's
    /// saved state without the logger is dropped: loggers record and do not change the run
    /// (and act on rank 0 only, so the other ranks never have them).
    pub fn restore_component_states(&mut self, mut saved: BTreeMap<String, Value>) -> Result<()> {
        let mut seen = BTreeMap::new();
        for a in self.algorithms.iter_mut() {
            let key = unique_key(&seen, format!("algorithm/{}", a.name()));
            seen.insert(key.clone(), Value::Null);
            match saved.remove(&key) {
                Some(v) => a.load_state_dict(v)?,
                None if a.required_on_load() => {
                    return Err(CoreError::MissingComponentState { component: key })
                }
                None => {}
            }
        }
        for c in self.callbacks.iter_mut() {
            let key = unique_key(&seen, format!("callback/{}", c.name()));
            seen.insert(key.clone(), Value::Null);
            if let Some(v) = saved.remove(&key) {
                c.load_state_dict(v)?;
            }
        }
        for d in self.logger.destinations_mut() {
            let key = unique_key(&seen, format!("logger/{}", d.name()));
            seen.insert(key.clone(), Value::Null);
            if let Some(v) = saved.remove(&key).filter(|v| !v.is_null()) {
                d.load_state_dict(v)?;
            }
        }
        saved.retain(|k, _| !k.starts_with("logger/"));
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

    fn run_all(&mut self, event: Event, state: &mut State<S>) -> Result<()> {
        state.event = Some(event);
        let result = self.run_components(event, state);
        state.event = None;
        result
    }

    fn run_components(&mut self, event: Event, state: &mut State<S>) -> Result<()> {
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
        // The states a saver writes, collected after the algorithms ran: one that changes the
        // model at the event (EMA's end-of-run swap at `FIT_END`) saves what it changed.
        if self.collect_states
            && matches!(
                event,
                Event::BatchCheckpoint | Event::EpochCheckpoint | Event::FitEnd
            )
        {
            state.component_states = self.component_states();
        }
        // The collective leaves the state while callbacks run, lent to them through their
        // `Control` (the state itself they see read-only), and is put back whatever happens.
        let mut collective = state.collective.take();
        let ran = self.run_callbacks(event, state, collective.as_mut());
        state.collective = collective;
        ran?;
        if event != Event::Init {
            self.logger
                .run_event(event, &state.timestamp, &state.progress())?;
        }
        Ok(())
    }
}

impl<S: Setup> Engine<S> {
    fn run_callbacks(
        &mut self,
        event: Event,
        state: &mut State<S>,
        mut collective: Option<&mut Box<dyn Collective<S>>>,
    ) -> Result<()> {
        for (c, _) in self
            .callbacks
            .iter_mut()
            .zip(&self.active)
            .filter(|(_, &on)| on)
        {
            let mut control = match collective.as_deref_mut() {
                Some(peers) => Control::with_peers(&mut self.logger, peers),
                None => Control::new(&mut self.logger),
            };
            c.run_event(event, state, &mut control)?;
            // The requests reach the state for the callbacks after this one; the first stop
            // asked for wins.
            if let Some(reason) = control.stop.take() {
                state.stop_reason.get_or_insert(reason);
            }
            state.checkpoint_requested |= control.checkpoint;
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
