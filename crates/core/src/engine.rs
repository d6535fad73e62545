//! The engine runs one event: algorithms whose `matches` is true (reversed at `AFTER_*`
//! events), then callbacks, then loggers; at `INIT`, loggers first so they can record
//! everything that follows. When nothing is registered, running an event costs one branch:
//! that is the trainer's hot path with no algorithms and no callbacks.

use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;

use crate::callback::{Algorithm, Callback};
use crate::error::Result;
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
}

impl<B: AutodiffBackend, M: TrainModel<B>, O: Optimizer<M, B>> Engine<B, M, O> {
    /// An engine over the given parts.
    pub fn new(
        algorithms: Vec<Box<dyn Algorithm<B, M, O>>>,
        callbacks: Vec<Box<dyn Callback<B, M, O>>>,
        logger: Logger,
    ) -> Self {
        let idle = algorithms.is_empty() && callbacks.is_empty() && logger.is_empty();
        Engine {
            algorithms,
            callbacks,
            logger,
            idle,
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

    fn run_all(&mut self, event: Event, state: &mut State<B, M, O>) -> Result<()> {
        if event == Event::Init {
            self.logger.run_event(event, &state.timestamp)?;
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
            self.logger.run_event(event, &state.timestamp)?;
        }
        Ok(())
    }
}
