//! ChannelsLast (Composer's `ChannelsLast`; NVIDIA's and PyTorch's "channels last memory
//! format"): run the model's convolutions and pools on activations laid out
//! `[batch, height, width, channels]`, where the kernels read a pixel's channels contiguously.
//!
//! In Flashover the switch selects `flashover-models`' channels-last path: on the CPU backend
//! flex that is the fast hand-written kernels, and it is already the default there
//! (`MemoryFormat::Auto`), so the algorithm states the choice explicitly; on GPU backends it
//! makes the models permute around Burn's own kernels (a measurement aid, not a speed-up).
//! Parameters and checkpoints are the same in either format, so the algorithm has no state
//! and resumes trivially. Composer applies it at `INIT`; so does this.
//!
//! Needs a model that implements `HasMemoryFormat` (the models of `flashover-models` do), so
//! adding it to a model without convolutions does not compile.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::model::{HasMemoryFormat, MemoryFormat};
use flashover_core::setup::Setup;
use flashover_core::state::State;

/// Sets the model's memory format to channels-last at `INIT`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChannelsLast;

impl<S: Setup> Algorithm<S> for ChannelsLast
where
    S::Model: HasMemoryFormat,
{
    fn name(&self) -> &str {
        "channels_last"
    }

    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        event == Event::Init
    }

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        state.map_model(|m| m.with_memory_format(MemoryFormat::ChannelsLast));
        Ok(())
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "channels_last", params: []}
crate::spec::by_name! {image |_p, _norm| ChannelsLast}
