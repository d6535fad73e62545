//! The [`Callback`] and [`Algorithm`] traits: the two ways user code hooks into training.
//!
//! An algorithm changes training (the batch, the loss, the gradients, the model, each in the
//! window of events [`State`]'s mutators allow); a callback watches it: it reads the state
//! and acts only through its [`Control`] (log, ask the run to stop, ask for a checkpoint).
//! Both are run by the [`Engine`](crate::engine::Engine) in the order the design fixes. This
//! module holds the contracts only.

use serde_json::Value;

use crate::collective::Peers;
use crate::error::Result;
use crate::event::Event;
use crate::logger::Logger;
use crate::setup::Setup;
use crate::state::State;
use crate::world::{OnEveryRank, Ranks};

macro_rules! define_callback {
    ($($variant:ident => $method:ident, $name:literal;)*) => {
        /// Something that watches a run: a monitor, a progress bar, a checkpoint saver.
        ///
        /// There is one method per [`Event`], each a no-op by default; override the ones you
        /// need. `run_event` dispatches to them and is what the engine calls.
        ///
        /// # Lifecycle
        /// See [`crate::event`] for the order of events. At each event the engine runs
        /// algorithms first, then callbacks in the order they were added, then loggers.
        ///
        /// # Errors and stopping
        /// An `Err` from any method stops training at once and is returned from `fit` (or
        /// `eval`, `predict`); later callbacks do not see that event. To stop *cleanly*, call
        /// [`Control::request_stop`]: the trainer finishes the current batch (running its
        /// `BATCH_END` and `BATCH_CHECKPOINT`), then runs `FIT_END`.
        ///
        /// A callback sees the state read-only: what it may do to the run is what its
        /// [`Control`] offers.
        ///
        /// ```
        /// use flashover_core::prelude::*;
        /// use flashover_core::toy;
        ///
        /// /// Stops training after a fixed number of batches.
        /// struct StopAfter(u64);
        ///
        /// impl<S: Setup> Callback<S> for StopAfter {
        ///     fn name(&self) -> &str { "stop_after" }
        ///     fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<(), CoreError> {
        ///         if state.timestamp().batch >= self.0 {
        ///             ctl.request_stop(format!("{} batches done", self.0));
        ///         }
        ///         Ok(())
        ///     }
        /// }
        ///
        /// // A one-weight regression of 4 batches per epoch, for 2 epochs, stopped after 3.
        /// # type B = burn::backend::Autodiff<burn::backend::Flex>;
        /// let mut trainer = toy::trainer::<B>(toy::points(16, 4), Time::Epoch(2))
        ///     .callback(StopAfter(3))
        ///     .build()?;
        /// let report = trainer.fit()?;
        /// assert_eq!(report.batches, 3);
        /// assert_eq!(report.stopped.as_deref(), Some("3 batches done"));
        /// # Ok::<(), CoreError>(())
        /// ```
        pub trait Callback<S: Setup>: Send {
            /// A name for error messages and checkpoints.
            fn name(&self) -> &str;

            $(
                #[doc = concat!("Called at `", $name, "`.")]
                fn $method(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
                    let _ = (state, ctl);
                    Ok(())
                }
            )*

            /// Dispatches `event` to its method.
            fn run_event(&mut self, event: Event, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
                match event {
                    $(Event::$variant => self.$method(state, ctl),)*
                }
            }

            /// Whether this callback reads `State::component_states` (a checkpoint saver does).
            /// Only then does the engine collect every component's state before the
            /// checkpoint events, which keeps that work off the step of other runs.
            fn needs_component_states(&self) -> bool {
                false
            }

            /// The ranks of a data-parallel run on which this callback sees events. Default:
            /// every rank. A callback that writes (a checkpoint saver, a plot, a trace) answers
            /// [`Ranks::Main`], so only rank 0 writes; wrap it in
            /// [`OnEveryRank`] to make it act everywhere. Its
            /// state is saved and restored on every rank either way.
            fn ranks(&self) -> Ranks {
                Ranks::Every
            }

            /// The callback's state, for checkpoints (default: nothing to save).
            fn state_dict(&self) -> Value {
                Value::Null
            }

            /// Restores what `state_dict` returned.
            fn load_state_dict(&mut self, state: Value) -> Result<()> {
                let _ = state;
                Ok(())
            }
        }
    };
}

crate::for_each_event!(define_callback);

/// What a callback may do to the run it watches, beside reading its [`State`]: log, ask the
/// run to stop after the current batch, and ask for a checkpoint at it. The engine applies
/// the requests after the callback returns, so the callbacks after it see them.
///
/// Nothing else: a callback that tries to change the run does not compile.
///
/// ```compile_fail
/// use flashover_core::prelude::*;
///
/// struct Meddle;
///
/// impl<S: Setup> Callback<S> for Meddle {
///     fn name(&self) -> &str { "meddle" }
///     fn batch_start(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<(), CoreError> {
///         state.set_lr(0.0) // the state is read-only here: an algorithm's job
///     }
/// }
/// ```
pub struct Control<'a> {
    logger: &'a mut Logger,
    peers: Option<&'a mut dyn Peers>,
    pub(crate) stop: Option<String>,
    pub(crate) checkpoint: bool,
}

impl<'a> Control<'a> {
    /// A control that logs to `logger` (the engine makes one per callback and event; a test
    /// may make one to call a callback directly).
    pub fn new(logger: &'a mut Logger) -> Self {
        Self {
            logger,
            peers: None,
            stop: None,
            checkpoint: false,
        }
    }

    /// The same, with the run's other ranks reachable through [`Control::peers`].
    pub fn with_peers(logger: &'a mut Logger, peers: &'a mut dyn Peers) -> Self {
        Self {
            peers: Some(peers),
            ..Self::new(logger)
        }
    }

    /// The other ranks of a data-parallel run (`None` in a single process), for a callback
    /// that must agree with them (a sharded checkpoint: every rank writes its shard, rank 0
    /// the manifest over all). Collective: see [`Peers`].
    pub fn peers(&mut self) -> Option<&mut (dyn Peers + 'a)> {
        self.peers.as_deref_mut()
    }

    /// The run's loggers.
    pub fn logger(&mut self) -> &mut Logger {
        self.logger
    }

    /// Asks the trainer to stop after the current batch; `reason` is logged and returned in
    /// the fit report. The first request of a batch wins.
    pub fn request_stop(&mut self, reason: impl Into<String>) {
        if self.stop.is_none() {
            self.stop = Some(reason.into());
        }
    }

    /// Asks for a checkpoint at the end of the current batch: a checkpoint saver saves at
    /// this batch's `BATCH_CHECKPOINT` whatever its interval says
    /// ([`State::checkpoint_requested`]).
    pub fn request_checkpoint(&mut self) {
        self.checkpoint = true;
    }

    /// The stop this control asked for, if any.
    pub fn stop_requested(&self) -> Option<&str> {
        self.stop.as_deref()
    }
}

impl<S: Setup, T: Callback<S>> Callback<S> for OnEveryRank<T> {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn run_event(&mut self, event: Event, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        self.0.run_event(event, state, ctl)
    }
    fn needs_component_states(&self) -> bool {
        self.0.needs_component_states()
    }
    fn state_dict(&self) -> Value {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, state: Value) -> Result<()> {
        self.0.load_state_dict(state)
    }
    fn ranks(&self) -> Ranks {
        Ranks::Every
    }
}

/// A speed-up method that changes training at chosen events.
///
/// The engine asks `matches` at each event and calls `apply` when it is true. At `AFTER_*`
/// events algorithms run in reverse order (first in, last out), so an algorithm can undo at
/// `AFTER_X` what it did at `BEFORE_X` even when others did something in between.
///
/// Randomness must come from [`State::rng`] so that runs reproduce and resume exactly.
///
/// ```
/// use flashover_core::prelude::*;
/// use flashover_core::toy;
///
/// /// Trains with no learning rate on odd batches (a toy algorithm).
/// struct SkipOdd;
///
/// impl<S: Setup> Algorithm<S> for SkipOdd {
///     fn name(&self) -> &str { "skip_odd" }
///     fn matches(&self, event: Event, state: &State<S>) -> bool {
///         event == Event::BatchStart && state.timestamp().batch % 2 == 1
///     }
///     fn apply(&mut self, _event: Event, state: &mut State<S>, _logger: &mut Logger) -> Result<(), CoreError> {
///         state.set_lr(0.0)
///     }
/// }
///
/// // Two batches: the second is skipped, so the weight moves exactly as after one batch.
/// # type B = burn::backend::Autodiff<burn::backend::Flex>;
/// let mut with = toy::trainer::<B>(toy::points(8, 4), Time::Batch(2)).algorithm(SkipOdd).build()?;
/// let mut without = toy::trainer::<B>(toy::points(8, 4), Time::Batch(1)).build()?;
/// with.fit()?;
/// without.fit()?;
/// assert_eq!(toy::weight(with.model()), toy::weight(without.model()));
/// assert_ne!(toy::weight(with.model()), 0.0);
/// # Ok::<(), CoreError>(())
/// ```
pub trait Algorithm<S: Setup>: Send {
    /// The algorithm's name (snake case), used in errors, logs and checkpoints.
    fn name(&self) -> &str;

    /// Whether to run at `event` in this state.
    fn matches(&self, event: Event, state: &State<S>) -> bool;

    /// Does the algorithm's work. An `Err` stops training and is returned from `fit`.
    fn apply(&mut self, event: Event, state: &mut State<S>, logger: &mut Logger) -> Result<()>;

    /// The algorithm's state, for checkpoints (default: nothing to save).
    fn state_dict(&self) -> Value {
        Value::Null
    }

    /// Restores what `state_dict` returned.
    fn load_state_dict(&mut self, state: Value) -> Result<()> {
        let _ = state;
        Ok(())
    }

    /// Whether a checkpoint this run resumes must hold this algorithm's state: true for the
    /// surgery algorithms, since a checkpoint of a model they did not change does not fit
    /// (Composer's `required_on_load`). Default: no.
    fn required_on_load(&self) -> bool {
        false
    }
}
