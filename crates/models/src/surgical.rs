//! Flashover's layers as surgery sees them: each implements the `flashover_surgery` trait of
//! its kind by handing over the settings it carries, or by rebuilding itself (a
//! convolution's squeeze-and-excitation block, a layer's factors). A model built from these
//! layers takes every surgery by implementing `flashover_surgery::Surgical`, listing its
//! layers with their paths (as [`MnistCnn`](crate::MnistCnn), [`ResNet`](crate::ResNet) and
//! [`Gpt`](crate::Gpt) do).

use burn::tensor::backend::Backend;
use flashover_surgery::{
    BatchNormLayer, ConvInfo, ConvLayer, ConvVariant, DropoutSite, DropoutVariant, GroupNormLayer,
    GroupNormVariant, LayerNormLayer, LayerNormVariant, LinearInfo, LinearLayer, MaxPoolLayer,
    NormInfo, NormVariant, PoolInfo, PoolVariant,
};

use crate::layers::{Conv2d, Linear, MaxPool2d, SqueezeExcite};
use crate::norm::{BatchNorm, GroupNorm, LayerNorm};

impl<B: Backend> ConvLayer for Conv2d<B> {
    fn info(&self, path: &str) -> ConvInfo {
        Conv2d::info(self, path)
    }

    fn variant(&mut self) -> &mut ConvVariant {
        &mut self.variant
    }

    fn has_squeeze_excite(&self) -> bool {
        self.excite.is_some()
    }

    fn add_squeeze_excite(&mut self, hidden: usize, seed: u64) {
        let channels = Conv2d::info(self, "").out_channels;
        let device = self.weight.device();
        self.excite = Some(SqueezeExcite::new(channels, hidden, seed, &device));
    }

    fn is_factored(&self) -> bool {
        self.factors.is_some()
    }

    fn factorize(&mut self, rank: usize) {
        Conv2d::factorize(self, rank);
    }
}

impl<B: Backend> LinearLayer for Linear<B> {
    fn info(&self, path: &str) -> LinearInfo {
        Linear::info(self, path)
    }

    fn is_factored(&self) -> bool {
        self.factors.is_some()
    }

    fn factorize(&mut self, rank: usize) {
        Linear::factorize(self, rank);
    }
}

/// A dense layer's input is where Flashover's models accept dropout (GyroDropout).
impl<B: Backend> DropoutSite for Linear<B> {
    fn features(&self) -> usize {
        self.dims()[0]
    }

    fn dropout(&mut self) -> &mut DropoutVariant {
        &mut self.input_dropout
    }
}

impl MaxPoolLayer for MaxPool2d {
    fn info(&self, path: &str) -> PoolInfo {
        MaxPool2d::info(self, path)
    }

    fn variant(&mut self) -> &mut PoolVariant {
        &mut self.variant
    }
}

impl<B: Backend> BatchNormLayer for BatchNorm<B> {
    fn info(&self, path: &str) -> NormInfo {
        BatchNorm::info(self, path)
    }

    fn variant(&mut self) -> &mut NormVariant {
        &mut self.variant
    }
}

impl<B: Backend> GroupNormLayer for GroupNorm<B> {
    fn info(&self, path: &str) -> NormInfo {
        GroupNorm::info(self, path)
    }

    fn variant(&mut self) -> &mut GroupNormVariant {
        &mut self.variant
    }
}

impl<B: Backend> LayerNormLayer for LayerNorm<B> {
    fn info(&self, path: &str) -> NormInfo {
        LayerNorm::info(self, path)
    }

    fn variant(&mut self) -> &mut LayerNormVariant {
        &mut self.variant
    }
}
