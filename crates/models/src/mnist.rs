//! The MNIST CNN of the main job, built from this crate's layers: it runs channels-first on
//! Burn's kernels or channels-last on the fast path, with the same parameters either way.

use burn::module::Module;
use burn::nn::conv::Conv2dConfig;
use burn::nn::{LinearConfig, PaddingConfig2d};
use burn::tensor::backend::Backend;
use burn::tensor::module::adaptive_avg_pool2d;
use burn::tensor::{FloatDType, Tensor};
use flashover_core::model::MemoryFormat;
use flashover_core::params::init_model;
use flashover_core::precision::cast_to;
use flashover_surgery::{Layers, Surgical};

use crate::channels_last;
use crate::layers::{nhwc_to_nchw, Conv2d, Linear, MaxPool2d};
use crate::ops::ChannelsLastBackend;

/// A small CNN for 28x28 digits: two 3x3 convolutions (16 and 32 channels, each followed by
/// ReLU and 2x2 max-pooling), then 1568 -> 128 -> 10 fully connected. About 220k parameters.
///
/// Parameter names, shapes, initialisation and the flattening order before `fc1` are those of
/// the model built from Burn's layers, whatever the memory format.
#[derive(Module, Debug)]
pub struct MnistCnn<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    fc1: Linear<B>,
    fc2: Linear<B>,
    pool: MaxPool2d,
    format: MemoryFormat,
    /// The type the forward pass computes in (`None`: the parameters'); see [`Autocast`].
    compute: Option<FloatDType>,
}

impl<B: Backend> MnistCnn<B> {
    /// Rows and columns of the digits the model is built for.
    pub const INPUT_SIZE: (usize, usize) = (28, 28);

    /// A CNN whose parameters are drawn, in field order, from a generator seeded by `seed`;
    /// it runs in the backend's fast memory format ([`MemoryFormat::Auto`]).
    pub fn new(device: &B::Device, seed: u64) -> Self {
        Self::with_widths(device, seed, 16, 32, 128)
    }

    /// The same architecture with `c1` and `c2` convolution channels and `hidden` units (the
    /// larger model of the scaling benchmark).
    pub fn with_widths(device: &B::Device, seed: u64, c1: usize, c2: usize, hidden: usize) -> Self {
        init_model::<B, _>(device, seed, |d| MnistCnn {
            conv1: Conv2d::new(
                &Conv2dConfig::new([1, c1], [3, 3]).with_padding(PaddingConfig2d::Same),
                d,
            ),
            conv2: Conv2d::new(
                &Conv2dConfig::new([c1, c2], [3, 3]).with_padding(PaddingConfig2d::Same),
                d,
            ),
            fc1: Linear::new(&LinearConfig::new(c2 * 7 * 7, hidden), d),
            fc2: Linear::new(&LinearConfig::new(hidden, 10), d),
            pool: MaxPool2d::new([2, 2], [2, 2]),
            format: MemoryFormat::Auto,
            compute: None,
        })
    }

    /// Floating-point operations of one forward pass on one 28x28 digit, counting a
    /// multiply-add as two (biases, activations and pooling, under 1% here, left out):
    /// `2 * (9 * c1 * 28^2 + 9 * c1 * c2 * 14^2 + 49 * c2 * hidden + 10 * hidden)`.
    /// (A factored layer counts its two factors' multiply-adds.)
    pub fn forward_flops(&self) -> f64 {
        let conv1 = self.conv1.macs_per_position() as f64 * 784.0;
        let conv2 = self.conv2.macs_per_position() as f64 * 196.0;
        2.0 * (conv1 + conv2 + self.fc1.macs() as f64 + self.fc2.macs() as f64)
    }
}

impl<B: ChannelsLastBackend> MnistCnn<B> {
    /// Logits `[batch, 10]` for images `[batch, 1, 28, 28]`. Smaller images (progressive
    /// resizing, ColOut) are accepted: their feature maps are average-pooled to the 7x7 the
    /// classifier expects; at full size that step is skipped, so the baseline is unchanged.
    pub fn logits(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let nhwc = channels_last::<B>(self.format);
        let images = match self.compute {
            Some(dtype) => cast_to(images, dtype),
            None => images,
        };
        // Images come channels-first; with one channel, channels-last is the same memory, and
        // a reshape (unlike a permutation) keeps the tensor contiguous, so nothing is copied.
        let x = match (nhwc, images.dims()) {
            (false, _) => images,
            (true, [n, 1, h, w]) => images.reshape([n, h, w, 1]),
            (true, _) => images.permute([0, 2, 3, 1]),
        };
        let x = self.pool.forward(self.conv1.forward(x, nhwc, true), nhwc);
        let x = self.pool.forward(self.conv2.forward(x, nhwc, true), nhwc);
        // Back to channels-first for the classifier, so that `fc1` sees the features in the
        // same order in either format (its weights mean the same thing).
        let x = if nhwc { nhwc_to_nchw(x) } else { x };
        let [_, _, h, w] = x.dims();
        let x = if (h, w) == (7, 7) {
            x
        } else {
            adaptive_avg_pool2d(x, [7, 7])
        };
        let x: Tensor<B, 2> = x.flatten(1, 3);
        // The dense layers take the fast path with the convolutions.
        let logits = self
            .fc2
            .forward(self.fc1.forward(x, nhwc, true), nhwc, false);
        cast_to(logits, FloatDType::F32)
    }
}

image_classifier!(MnistCnn, |m| m.forward_flops());

/// Surgery (`flashover_surgery`) reaches the two convolutions, the max pool, which both
/// stages share (one layer, so one variant for both), and the dense layers, the classifier's
/// input being the dropout site. The CNN has no batch norm, so GhostBatchNorm fails at `INIT`
/// naming what it needs.
impl<B: Backend> Surgical for MnistCnn<B> {
    fn visit_layers(&mut self, layers: &mut Layers<'_>) {
        layers.conv("conv1", &mut self.conv1);
        layers.max_pool("pool", &mut self.pool);
        layers.conv("conv2", &mut self.conv2);
        layers.linear("fc1", &mut self.fc1);
        // GyroDropout's site: the hidden layer's 128 features (where VGG-style networks
        // have their dropout).
        layers.dropout_site("fc2", &mut self.fc2);
        layers.linear("fc2", &mut self.fc2);
    }
}
