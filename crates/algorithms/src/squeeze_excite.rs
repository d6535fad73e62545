//! Squeeze-and-excitation (Hu, Shen and Sun, "Squeeze-and-Excitation Networks", CVPR 2018;
//! Composer's `SqueezeExcite`): after a convolution, a small block rescales each output
//! channel by `sigmoid(relu(s · W1) · W2)`, where `s` is the channel's mean over the image: a
//! channel-wise attention computed from the whole image, which a convolution's local window
//! cannot see. See `flashover_models::layers::SqueezeExcite` for the block.
//!
//! - `min_channels` (128): a block follows a convolution only if it has at least this many
//!   input *and* output channels (Composer's rule): the deep, narrow-image layers, where a
//!   block costs least.
//! - `latent_channels` (64): the hidden width, as a count (an integer >= 1) or, below 1, as a
//!   fraction of the convolution's output channels (rounded down, at least 1; Composer rounds
//!   down to 0 there and builds an empty layer).
//!
//! When it helps: ResNet-style image classifiers; the paper and Composer report about +0.5-1.5%
//! ImageNet accuracy for about 25% slower steps. Composer's defaults reach only convolutions
//! 128 wide or more (the last stages of an ImageNet ResNet); on the narrow CIFAR ResNets here
//! lower `min_channels` (the ResNet recipes use 32).
//!
//! Surgery at `INIT` on the convolutions the model shows ([`Surgical`]): unlike the other surgeries this one
//! adds parameters (`<conv>.excite.reduce.weight`, `<conv>.excite.expand.weight`), drawn from
//! the run's seed alone (the same on every rank; PyTorch's `Linear` initialisation), before
//! the optimizer or a checkpoint sees the model. The layers given a block are the checkpoint
//! state; a checkpoint of another surgery is refused.

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::rng::{derive_seed, hash_str};
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{ConvInfo, LayerKind, SurgeryRecord, Surgical, SurgicalExt};

use crate::error::Result;
use crate::surgery::{surgery_at_init, Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "squeeze_excite",
    kinds: &[LayerKind::Conv],
    describe: "convolutions that take squeeze-and-excitation blocks",
};
use crate::util::check_latent;

/// SqueezeExcite's settings (Composer's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SqueezeExciteOptions {
    /// Hidden width: a count (an integer >= 1) or, below 1, a fraction of the channels.
    pub latent_channels: f64,
    /// Least input and output channels of a convolution that gets a block.
    pub min_channels: usize,
}

impl Default for SqueezeExciteOptions {
    fn default() -> Self {
        Self {
            latent_channels: 64.0,
            min_channels: 128,
        }
    }
}

impl SqueezeExciteOptions {
    /// The settings, checked: `latent_channels` a fraction in `(0, 1)` or a whole count.
    pub fn new(latent_channels: f64, min_channels: usize) -> Result<Self> {
        check_latent("squeeze_excite", "latent_channels", latent_channels)?;
        Ok(Self {
            latent_channels,
            min_channels,
        })
    }

    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "squeeze_excite:latent_channels={}:min_channels={}",
            self.latent_channels, self.min_channels
        )
    }

    /// The hidden width of the block after `conv`, or `None` where it gets none.
    pub fn latent_width(&self, conv: &ConvInfo) -> Option<usize> {
        if conv.in_channels.min(conv.out_channels) < self.min_channels {
            return None;
        }
        Some(if self.latent_channels >= 1.0 {
            self.latent_channels as usize
        } else {
            ((self.latent_channels * conv.out_channels as f64) as usize).max(1)
        })
    }
}

/// Adds a block after every convolution of `model` that `options` selects (the functional
/// form; call it before building the optimizer), drawn from `seed`, and returns what it
/// changed.
pub fn apply_squeeze_excite<M: Surgical + ?Sized>(
    model: &mut M,
    options: &SqueezeExciteOptions,
    seed: u64,
) -> SurgeryRecord {
    let seed = derive_seed(&[seed, hash_str("squeeze_excite")]);
    let layers = model.add_squeeze_excite(&mut |conv| options.latent_width(conv), seed);
    SurgeryRecord {
        settings: options.describe(),
        layers,
    }
}

/// The SqueezeExcite algorithm: [`apply_squeeze_excite`] at `INIT`, from the trainer's seed.
#[derive(Debug, Clone)]
pub struct SqueezeExcite {
    options: SqueezeExciteOptions,
    applied: Applied,
}

impl Default for SqueezeExcite {
    fn default() -> Self {
        Self::new(SqueezeExciteOptions::default())
    }
}

impl SqueezeExcite {
    /// The algorithm with `options` (see [`SqueezeExciteOptions::new`] for the checks).
    pub fn new(options: SqueezeExciteOptions) -> Self {
        Self {
            options,
            applied: Applied::default(),
        }
    }
}

impl<S: Setup> Algorithm<S> for SqueezeExcite
where
    S::Model: Surgical,
{
    surgery_at_init!("squeeze_excite", |this| this.options.describe());

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        let seed = state.seed();
        self.applied.run(NEEDS, state, |model| {
            Ok(apply_squeeze_excite(model, &self.options, seed))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "squeeze_excite", params: ["latent_channels", "min_channels"]}
crate::spec::by_name! {image |p, _norm| {
    let d = SqueezeExciteOptions::default();
    SqueezeExcite::new(SqueezeExciteOptions::new(
        p.f64("latent_channels", d.latent_channels)?,
        p.usize("min_channels", d.min_channels)?,
    )?)
}}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(in_channels: usize, out_channels: usize) -> ConvInfo {
        ConvInfo {
            path: "c".into(),
            in_channels,
            out_channels,
            kernel: [3, 3],
            stride: [1, 1],
            groups: 1,
        }
    }

    #[test]
    fn widths_follow_composers_rule() {
        let d = SqueezeExciteOptions::default();
        assert_eq!((d.latent_channels, d.min_channels), (64.0, 128));
        assert_eq!(d.latent_width(&conv(128, 256)), Some(64));
        assert_eq!(d.latent_width(&conv(64, 256)), None, "min of in and out");
        assert_eq!(d.latent_width(&conv(256, 64)), None);
        let ratio = SqueezeExciteOptions::new(0.25, 16).unwrap();
        assert_eq!(ratio.latent_width(&conv(16, 32)), Some(8));
        assert_eq!(ratio.latent_width(&conv(16, 3)), None);
        let tiny = SqueezeExciteOptions::new(0.01, 1).unwrap();
        assert_eq!(
            tiny.latent_width(&conv(16, 16)),
            Some(1),
            "at least one unit"
        );
    }

    #[test]
    fn bad_widths_are_named() {
        for bad in [0.0, -2.0, 1.5, f64::NAN, f64::INFINITY] {
            let e = SqueezeExciteOptions::new(bad, 8).unwrap_err().to_string();
            assert!(
                e.contains("latent_channels") && e.contains("fraction"),
                "{e}"
            );
        }
    }
}
