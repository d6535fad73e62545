//! The [`Restore`] trait: how saved state gets into a trainer being built. Core calls it
//! between `BEFORE_LOAD` and `AFTER_LOAD` and knows nothing of files; `flashover-checkpoint`
//! implements it (verified checkpoint directories), and so can anything else that holds a
//! trainer's state.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::Result;
use crate::setup::Setup;
use crate::state::State;

/// Restores a trainer's state (from a checkpoint) between `BEFORE_LOAD` and `AFTER_LOAD`.
///
/// The trainer checks the restored position against its training data afterwards, and hands
/// the returned component states to the algorithms and callbacks it has (a saved state
/// without a registered component is an error there).
pub trait Restore<S: Setup>: Send {
    /// Puts the saved model, optimizer, timestamp and the rest into `state`, and returns the
    /// saved states of algorithms and callbacks (keyed as in `State::component_states`), or
    /// `None` when only weights were loaded (a new run: every component starts fresh).
    fn restore(self: Box<Self>, state: &mut State<S>) -> Result<Option<BTreeMap<String, Value>>>;
}
