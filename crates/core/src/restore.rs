//! The [`Restore`] trait: how saved state gets into a trainer being built. Core calls it
//! between `BEFORE_LOAD` and `AFTER_LOAD` and knows nothing of files; `flashover-checkpoint`
//! implements it (verified checkpoint directories), and so can anything else that holds a
//! trainer's state.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::Result;
use crate::precision::LossScaler;
use crate::setup::Setup;
use crate::state::State;
use crate::time::Timestamp;

/// Restores a trainer's state (from a checkpoint) between `BEFORE_LOAD` and `AFTER_LOAD`.
///
/// The trainer checks the restored position against its training data afterwards, and hands
/// the returned component states to the algorithms and callbacks it has (a saved state
/// without a registered component is an error there).
pub trait Restore<S: Setup>: Send {
    /// Puts the saved model, optimizer, timestamp and the rest into `state`, and returns the
    /// saved states of algorithms and callbacks (keyed as in `State::component_states`), or
    /// `None` when only weights were loaded (a new run: every component starts fresh).
    fn restore(
        self: Box<Self>,
        state: &mut Restoring<'_, S>,
    ) -> Result<Option<BTreeMap<String, Value>>>;
}

/// The state of a trainer being built, as a [`Restore`] sees it: everything can be read
/// (through `Deref`), and what a checkpoint holds can be put in: the model, the optimizer's
/// state, the run's position and its loss-scaling and evaluation history. Nothing else of the
/// state changes on a restore.
pub struct Restoring<'a, S: Setup> {
    state: &'a mut State<S>,
}

impl<'a, S: Setup> Restoring<'a, S> {
    pub(crate) fn new(state: &'a mut State<S>) -> Self {
        Self { state }
    }

    /// Replaces the model through a function of the old one (the saved weights and ids).
    pub fn map_model(&mut self, f: impl FnOnce(S::Model) -> S::Model) {
        self.state.map_model(f);
    }

    /// Replaces the optimizer (with its saved moments).
    pub fn set_optimizer(&mut self, optimizer: S::Optimizer) {
        self.state.optimizer = optimizer;
    }

    /// Puts the saved position in: the seed, the timestamp, the batches skipped so far and the
    /// microbatch size automatic microbatching had settled on.
    pub fn set_position(
        &mut self,
        seed: u64,
        timestamp: Timestamp,
        skipped_batches: u64,
        auto_microbatch_size: Option<usize>,
    ) {
        self.state.seed = seed;
        self.state.timestamp = timestamp;
        self.state.skipped_batches = skipped_batches;
        self.state.auto_microbatch_size = auto_microbatch_size;
    }

    /// The loss scaler, to take the saved scale and step counts (float16 runs only).
    pub fn loss_scaler_mut(&mut self) -> Option<&mut LossScaler> {
        self.state.loss_scaler.as_mut()
    }

    /// Puts the saved evaluation history in: the batch of the last evaluation and its
    /// results.
    pub fn set_eval_history(
        &mut self,
        last_eval_batch: Option<u64>,
        eval_metrics: BTreeMap<String, BTreeMap<String, f64>>,
    ) {
        self.state.last_eval_batch = last_eval_batch;
        self.state.eval_metrics = eval_metrics;
    }
}

impl<S: Setup> std::ops::Deref for Restoring<'_, S> {
    type Target = State<S>;

    fn deref(&self) -> &State<S> {
        self.state
    }
}
