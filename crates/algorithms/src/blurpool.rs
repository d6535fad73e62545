//! BlurPool (Zhang, "Making Convolutional Networks Shift-Invariant Again", ICML 2019;
//! Composer's `BlurPool`): a low-pass filter before every downsampling, so that a strided
//! convolution or max pool stops aliasing high frequencies. The filter is the binomial
//! `[1, 2, 1]^T [1, 2, 1] / 16`, per channel, zero-padded by one pixel.
//!
//! - **Strided convolutions** (`replace_convs`, stride above 1 along an axis and at least
//!   `min_channels` input channels): with `blur_first` (the default) the input is blurred at
//!   stride 1 and the convolution keeps its stride, costing one depthwise pass; without it the
//!   convolution runs at stride 1 and its output is blurred with the stride (the paper's
//!   order, about four times the convolution's cost at stride 2).
//! - **Max pools** (`replace_maxpools`): the maxima are taken at stride 1 and blurred with
//!   the pool's stride (the paper's MaxBlurPool).
//!
//! Defaults are Composer's (`replace_convs`, `replace_maxpools` and `blur_first` on,
//! `min_channels = 16`). When it helps: image classifiers with strided convolutions or max
//! pools; the paper reports about +0.5-1% ImageNet accuracy and better consistency under
//! shifts; it slows a step by the cost of the filter passes. Zero padding follows Composer;
//! the paper's reference code pads by reflection.
//!
//! Surgery at `INIT` on the convolutions and max pools the model shows ([`Surgical`]; a
//! model with neither fails there, naming them); no parameter is added or changed. The
//! layers changed are the algorithm's checkpoint state, and a checkpoint of another surgery is
//! refused ([`flashover_surgery::check_surgery_record`]).

use flashover_core::callback::Algorithm;
use flashover_core::event::Event;
use flashover_core::logger::Logger;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_surgery::{Blur, LayerKind, SurgeryRecord, Surgical, SurgicalExt};

use crate::surgery::{surgery_at_init, Applied, Needs};

const NEEDS: Needs = Needs {
    algorithm: "blurpool",
    kinds: &[LayerKind::Conv, LayerKind::MaxPool],
    describe: "surgery-ready convolutions or max pools",
};

/// BlurPool's settings (Composer's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlurPoolOptions {
    /// Blur the strided convolutions.
    pub replace_convs: bool,
    /// Blur the max pools.
    pub replace_maxpools: bool,
    /// Blur a convolution's input (else its stride-1 output).
    pub blur_first: bool,
    /// Leave convolutions with fewer input channels alone.
    pub min_channels: usize,
}

impl Default for BlurPoolOptions {
    fn default() -> Self {
        Self {
            replace_convs: true,
            replace_maxpools: true,
            blur_first: true,
            min_channels: 16,
        }
    }
}

impl BlurPoolOptions {
    /// The settings in the `--algorithms` syntax.
    pub fn describe(&self) -> String {
        format!(
            "blurpool:replace_convs={}:replace_maxpools={}:blur_first={}:min_channels={}",
            self.replace_convs, self.replace_maxpools, self.blur_first, self.min_channels
        )
    }
}

/// Applies BlurPool to `model` (the functional form, for a hand-written loop: call it before
/// building the optimizer) and returns what it changed. Applying it twice changes nothing
/// more.
pub fn apply_blurpool<M: Surgical + ?Sized>(
    model: &mut M,
    options: &BlurPoolOptions,
) -> SurgeryRecord {
    let mut layers = Vec::new();
    blur_convs(model, options, &mut layers);
    blur_pools(model, options, &mut layers);
    SurgeryRecord {
        settings: options.describe(),
        layers,
    }
}

/// The convolution half of [`apply_blurpool`]; appends the paths it changed to `layers`.
pub(crate) fn blur_convs<M: Surgical + ?Sized>(
    model: &mut M,
    options: &BlurPoolOptions,
    layers: &mut Vec<String>,
) {
    if !options.replace_convs {
        return;
    }
    let blur = if options.blur_first {
        Blur::First
    } else {
        Blur::Last
    };
    model.for_each_conv(&mut |info, variant| {
        if info.stride.iter().any(|&s| s > 1) && info.in_channels >= options.min_channels {
            variant.blur = Some(blur);
            layers.push(info.path.clone());
        }
    });
}

/// The max-pool half of [`apply_blurpool`].
pub(crate) fn blur_pools<M: Surgical + ?Sized>(
    model: &mut M,
    options: &BlurPoolOptions,
    layers: &mut Vec<String>,
) {
    if !options.replace_maxpools {
        return;
    }
    model.for_each_max_pool(&mut |info, variant| {
        variant.blur = true;
        layers.push(info.path.clone());
    });
}

/// The BlurPool algorithm: [`apply_blurpool`] at `INIT`.
#[derive(Debug, Clone, Default)]
pub struct BlurPool {
    options: BlurPoolOptions,
    applied: Applied,
}

impl BlurPool {
    /// BlurPool with `options`.
    pub fn new(options: BlurPoolOptions) -> Self {
        Self {
            options,
            applied: Applied::default(),
        }
    }

    /// Its settings.
    pub fn options(&self) -> &BlurPoolOptions {
        &self.options
    }
}

impl<S: Setup> Algorithm<S> for BlurPool
where
    S::Model: Surgical,
{
    surgery_at_init!("blurpool", |this| this.options.describe());

    fn apply(
        &mut self,
        _event: Event,
        state: &mut State<S>,
        _logger: &mut Logger,
    ) -> flashover_core::Result<()> {
        self.applied.run(NEEDS, state, |model| {
            Ok(apply_blurpool(model, &self.options))
        })
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {
    name: "blurpool",
    params: [
        "replace_convs",
        "replace_maxpools",
        "blur_first",
        "min_channels",
    ],
}
crate::spec::by_name! {image |p, _norm| {
    let d = BlurPoolOptions::default();
    BlurPool::new(BlurPoolOptions {
        replace_convs: p.bool("replace_convs", d.replace_convs)?,
        replace_maxpools: p.bool("replace_maxpools", d.replace_maxpools)?,
        blur_first: p.bool("blur_first", d.blur_first)?,
        min_channels: p.usize("min_channels", d.min_channels)?,
    })
}}
