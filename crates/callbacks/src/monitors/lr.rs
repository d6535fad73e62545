//! The learning-rate monitor.

use derive_new::new;
use flashover_core::callback::{Callback, Control};
use flashover_core::error::Result;
use flashover_core::setup::Setup;
use flashover_core::state::State;

/// Logs the learning rate each batch trained with, per parameter group, as `lr/group<i>`.
///
/// Burn 0.21's `Optimizer::step` takes one learning rate for the whole module, so a Flashover
/// run has exactly one group, `lr/group0`: the base rate times the schedule's factor at that
/// batch (warm-up, decay and the scale-schedule ratio included).
///
/// ```
/// use flashover_callbacks::monitors::LrMonitor;
/// let monitor = LrMonitor::new(); // trainer builder: .callback(LrMonitor::new())
/// # let _ = monitor;
/// ```
#[derive(Debug, Default, new)]
pub struct LrMonitor;

impl<S: Setup> Callback<S> for LrMonitor {
    fn name(&self) -> &str {
        "lr_monitor"
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        // `state.lr()` is the rate the optimizer step of this batch used (set at BATCH_START,
        // possibly changed by an algorithm before the step, untouched after it).
        ctl.logger()
            .log_metrics(state.timestamp(), &[("lr/group0", state.lr())])
    }
}
