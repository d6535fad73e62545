//! Residual networks for small images (He et al., "Deep Residual Learning for Image
//! Recognition", 2016), built from this crate's layers so that they run channels-first on
//! Burn's kernels or channels-last on the fast path with the same parameters.
//!
//! - [`ResNetConfig::cifar`]: the paper's CIFAR family (section 4.2): a 3x3 stem convolution,
//!   three stages of `n` basic blocks at widths `w, 2w, 4w` (the paper: `w = 16`), the last two
//!   starting with a stride-2 block, global average pooling and one linear classifier; `6n +
//!   2` layers (ResNet-20: `n = 3`, ResNet-56: `n = 9`).
//! - [`ResNetConfig::resnet18`]: the ImageNet ResNet-18's four stages of two basic blocks at
//!   `w, 2w, 4w, 8w` (`w = 64`) with the small-image stem (a 3x3 convolution, no max pool)
//!   common for 32x32 inputs.
//!
//! A basic block is `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`. Where a block
//! changes the width or the resolution its shortcut is a 1x1 strided convolution with batch
//! norm (the paper's option B); the paper's CIFAR runs used option A (zero-padded identity),
//! which has no parameters; we use B in every stage for one shortcut kind across the family,
//! as torchvision and Composer's CIFAR ResNets do. Convolutions before a batch norm have no
//! bias. Initialisation is Burn's default for each layer (PyTorch's), drawn from the model's
//! seed in field order.

use burn::module::Module;
use burn::nn::conv::Conv2dConfig;
use burn::nn::{BatchNormConfig, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use flashover_core::model::MemoryFormat;
use flashover_core::params::init_model;
use flashover_core::precision::cast_to;
use flashover_surgery::{DepthDrop, Keep, Layers, ResidualBlock, ResidualVariant, Surgical};

use crate::layers::{Conv2d, Linear};
use crate::norm::BatchNorm;
use crate::ops::ChannelsLastBackend;
use crate::{channels_last, ModelError};

/// The shape of a [`ResNet`]: stages of basic blocks, their widths, the input channels and
/// the classes. Built by its constructors, which check it, so every `ResNetConfig` is one a
/// model can be built with (the fields are private for that reason; read them through the
/// methods of the same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResNetConfig {
    blocks: Vec<usize>,
    widths: Vec<usize>,
    in_channels: usize,
    classes: usize,
}

impl ResNetConfig {
    /// Basic blocks per stage.
    pub fn blocks(&self) -> &[usize] {
        &self.blocks
    }
    /// Output channels of each stage; the first stage keeps the stem's width and resolution,
    /// every later one halves the resolution in its first block.
    pub fn widths(&self) -> &[usize] {
        &self.widths
    }
    /// Channels of the input images.
    pub fn in_channels(&self) -> usize {
        self.in_channels
    }
    /// Classes (outputs of the classifier).
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// The CIFAR ResNet of `depth = 6n + 2` layers (20, 32, 44, 56, 110, ...) with stage
    /// widths `base_width`, twice and four times that (the paper: 16), for one-channel
    /// images and 10 classes (the bundled digits); [`ResNetConfig::with_io`] for CIFAR's
    /// three channels or other classes.
    pub fn cifar(depth: usize, base_width: usize) -> Result<Self, ModelError> {
        if depth < 8 || !(depth - 2).is_multiple_of(6) {
            return Err(ModelError::config(
                "a CIFAR ResNet",
                "depth",
                depth,
                "6n + 2 layers (8, 20, 32, 44, 56, 110, ...)",
            ));
        }
        if base_width == 0 {
            return Err(ModelError::config(
                "a CIFAR ResNet",
                "base_width",
                0,
                "at least 1",
            ));
        }
        let n = (depth - 2) / 6;
        Ok(Self {
            blocks: vec![n; 3],
            widths: vec![base_width, 2 * base_width, 4 * base_width],
            in_channels: 1,
            classes: 10,
        })
    }

    /// ResNet-18's stages (two basic blocks each at `base_width` times 1, 2, 4 and 8; the
    /// original: 64) with the small-image stem.
    pub fn resnet18(base_width: usize) -> Result<Self, ModelError> {
        if base_width == 0 {
            return Err(ModelError::config(
                "a ResNet-18",
                "base_width",
                0,
                "at least 1",
            ));
        }
        Ok(Self {
            blocks: vec![2; 4],
            widths: (0..4).map(|i| base_width << i).collect(),
            in_channels: 1,
            classes: 10,
        })
    }

    /// The same stages at other widths (one per stage, each at least 1).
    pub fn with_widths(mut self, widths: Vec<usize>) -> Result<Self, ModelError> {
        if widths.len() != self.blocks.len() || widths.contains(&0) {
            return Err(ModelError::config(
                "a ResNet",
                "widths",
                format!("{widths:?}"),
                format!(
                    "{} widths (one per stage), each at least 1",
                    self.blocks.len()
                ),
            ));
        }
        self.widths = widths;
        Ok(self)
    }

    /// The same network for `in_channels` input channels and `classes` classes (each at
    /// least 1).
    pub fn with_io(mut self, in_channels: usize, classes: usize) -> Result<Self, ModelError> {
        for (name, v) in [("in_channels", in_channels), ("classes", classes)] {
            if v == 0 {
                return Err(ModelError::config("a ResNet", name, 0, "at least 1"));
            }
        }
        self.in_channels = in_channels;
        self.classes = classes;
        Ok(self)
    }

    /// Layers with weights on the main path (the convolutions outside shortcuts and the
    /// classifier): `2 * blocks + 2`, the number in the family's names.
    pub fn depth(&self) -> usize {
        2 * self.blocks.iter().sum::<usize>() + 2
    }

    /// A model with this shape, its parameters drawn in field order from a generator seeded
    /// by `seed`.
    pub fn init<B: Backend>(&self, device: &B::Device, seed: u64) -> ResNet<B> {
        init_model::<B, _>(device, seed, |d| {
            let stem_width = self.widths[0];
            let mut blocks = Vec::new();
            let mut width = stem_width;
            for (stage, (&n, &out)) in self.blocks.iter().zip(&self.widths).enumerate() {
                for i in 0..n {
                    let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                    blocks.push(BasicBlock::new(width, out, stride, d));
                    width = out;
                }
            }
            ResNet {
                stem: conv3x3(self.in_channels, stem_width, 1, d),
                stem_norm: batch_norm(stem_width, d),
                blocks,
                head: Linear::new(&LinearConfig::new(width, self.classes), d),
                format: MemoryFormat::Auto,
                compute: None,
            }
        })
    }
}

fn conv3x3<B: Backend>(c_in: usize, c_out: usize, stride: usize, d: &B::Device) -> Conv2d<B> {
    Conv2d::new(
        &Conv2dConfig::new([c_in, c_out], [3, 3])
            .with_stride([stride, stride])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .with_bias(false),
        d,
    )
}

fn batch_norm<B: Backend>(channels: usize, d: &B::Device) -> BatchNorm<B> {
    BatchNorm::new(&BatchNormConfig::new(channels), d)
}

/// The 1x1 strided convolution and batch norm of a shortcut that changes width or size.
#[derive(Module, Debug)]
pub struct Projection<B: Backend> {
    /// 1x1 convolution, no bias.
    pub conv: Conv2d<B>,
    /// Its batch norm.
    pub norm: BatchNorm<B>,
}

/// Two 3x3 convolutions with batch norm and a shortcut.
#[derive(Module, Debug)]
pub struct BasicBlock<B: Backend> {
    /// First 3x3 convolution (strided when the block halves the resolution).
    pub conv1: Conv2d<B>,
    /// Its batch norm.
    pub norm1: BatchNorm<B>,
    /// Second 3x3 convolution.
    pub conv2: Conv2d<B>,
    /// Its batch norm.
    pub norm2: BatchNorm<B>,
    /// The projection when the block changes width or resolution, else the identity.
    pub shortcut: Option<Projection<B>>,
    /// The variant model surgery chose (default: the plain block).
    pub variant: ResidualVariant,
}

impl<B: Backend> BasicBlock<B> {
    fn new(c_in: usize, c_out: usize, stride: usize, d: &B::Device) -> Self {
        let shortcut = (stride != 1 || c_in != c_out).then(|| Projection {
            conv: Conv2d::new(
                &Conv2dConfig::new([c_in, c_out], [1, 1])
                    .with_stride([stride, stride])
                    .with_padding(PaddingConfig2d::Valid)
                    .with_bias(false),
                d,
            ),
            norm: batch_norm(c_out, d),
        });
        Self {
            conv1: conv3x3(c_in, c_out, stride, d),
            norm1: batch_norm(c_out, d),
            conv2: conv3x3(c_out, c_out, 1, d),
            norm2: batch_norm(c_out, d),
            shortcut,
            variant: ResidualVariant::default(),
        }
    }
}

impl<B: ChannelsLastBackend> BasicBlock<B> {
    /// The block on `x` (NHWC when `nhwc`). With stochastic depth (Huang et al., 2016), in
    /// training a dropped branch is skipped (the block is `relu(shortcut(x))`) or, sample by
    /// sample, zeroed; in evaluation the branch is scaled by its survival probability.
    pub fn forward(&self, x: Tensor<B, 4>, nhwc: bool) -> Tensor<B, 4> {
        let training = B::ad_enabled(&x.device());
        let drop = self.variant.drop.as_ref();
        let skip =
            training && matches!(drop.and_then(|d| d.keep.as_ref()), Some(Keep::Block(false)));
        let shortcut = match &self.shortcut {
            Some(p) => p.norm.forward(p.conv.forward(x.clone(), nhwc, false), nhwc),
            None => x.clone(),
        };
        if skip {
            return relu(shortcut);
        }
        let y = relu(self.norm1.forward(self.conv1.forward(x, nhwc, false), nhwc));
        let mut y = self.norm2.forward(self.conv2.forward(y, nhwc, false), nhwc);
        match (drop, training) {
            (Some(d), false) => y = y.mul_scalar(1.0 - d.rate),
            (
                Some(DepthDrop {
                    keep: Some(Keep::Samples(keep)),
                    ..
                }),
                true,
            ) => {
                let n = y.dims()[0];
                assert_eq!(
                    keep.len(),
                    n,
                    "stochastic depth drew {} samples for a batch of {n}",
                    keep.len()
                );
                let mask: Vec<f32> = keep.iter().map(|&k| if k { 1.0 } else { 0.0 }).collect();
                let mask =
                    Tensor::<B, 4>::from_data(TensorData::new(mask, [n, 1, 1, 1]), &y.device());
                let mask = flashover_core::precision::cast_like(mask, y.dtype());
                y = y.mul(mask);
            }
            _ => {}
        }
        relu(y.add(shortcut))
    }
}

/// A residual network (see the module docs), generic over the backend.
#[derive(Module, Debug)]
pub struct ResNet<B: Backend> {
    /// 3x3 stem convolution.
    pub stem: Conv2d<B>,
    /// Its batch norm.
    pub stem_norm: BatchNorm<B>,
    /// The basic blocks, stage after stage.
    pub blocks: Vec<BasicBlock<B>>,
    /// The classifier on the globally averaged features.
    pub head: Linear<B>,
    format: MemoryFormat,
    /// The type the forward pass computes in (`None`: the parameters'); see [`Autocast`].
    compute: Option<FloatDType>,
}

impl<B: Backend> ResNet<B> {
    /// Floating-point operations of one forward pass on one `h x w` image, counting a
    /// multiply-add as two: the convolutions and the classifier (batch norm, ReLU, additions
    /// and pooling, about 1% here, left out).
    pub fn forward_flops(&self, h: usize, w: usize) -> f64 {
        fn conv<B: Backend>(c: &Conv2d<B>, (h, w): (usize, usize)) -> (f64, (usize, usize)) {
            let [_, _, kh, kw] = c.weight_dims();
            let (s0, s1) = (c.stride[0], c.stride[1]);
            let pad = |k: usize| k / 2; // 'same'-style padding of the 1x1 and 3x3 kernels here
            let out = (
                (h + 2 * pad(kh) - kh) / s0 + 1,
                (w + 2 * pad(kw) - kw) / s1 + 1,
            );
            let flops = 2.0 * c.macs_per_position() as f64 * (out.0 * out.1) as f64;
            (flops, out)
        }
        let (mut total, mut size) = conv(&self.stem, (h, w));
        for b in &self.blocks {
            let (f1, s1) = conv(&b.conv1, size);
            let (f2, s2) = conv(&b.conv2, s1);
            total += f1 + f2;
            if let Some(p) = &b.shortcut {
                total += conv(&p.conv, size).0;
            }
            size = s2;
        }
        total + 2.0 * self.head.macs() as f64
    }
}

impl<B: ChannelsLastBackend> ResNet<B> {
    /// Logits `[batch, classes]` for images `[batch, channels, height, width]` of any size
    /// (the features are averaged over whatever resolution remains).
    pub fn logits(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let nhwc = channels_last::<B>(self.format);
        let images = match self.compute {
            Some(dtype) => cast_to(images, dtype),
            None => images,
        };
        let x = match (nhwc, images.dims()) {
            (false, _) => images,
            (true, [n, 1, h, w]) => images.reshape([n, h, w, 1]),
            (true, _) => images.permute([0, 2, 3, 1]),
        };
        let mut x = relu(
            self.stem_norm
                .forward(self.stem.forward(x, nhwc, false), nhwc),
        );
        for block in &self.blocks {
            x = block.forward(x, nhwc);
        }
        // Global average pooling to [batch, channels].
        let features = if nhwc {
            let [n, h, w, c] = x.dims();
            x.reshape([n, h * w, c]).mean_dim(1).reshape([n, c])
        } else {
            let [n, c, h, w] = x.dims();
            x.reshape([n, c, h * w]).mean_dim(2).reshape([n, c])
        };
        cast_to(self.head.forward(features, nhwc, false), FloatDType::F32)
    }
}

// flops_per_sample: on the main job's 28x28 digits (the trait asks for one figure per
// sample, whatever the batch's image size).
image_classifier!(ResNet, |m| m.forward_flops(28, 28));

/// Surgery (`flashover_surgery`) reaches every convolution (the stem, each block's two and
/// each projection) and every batch norm, in module order, with their paths in the model's
/// record (`blocks.3.conv1`), each residual block, and the classifier, whose input is the
/// dropout site. The ResNet has no max pool: BlurPool blurs its strided convolutions only.
impl<B: Backend> Surgical for ResNet<B> {
    fn visit_layers(&mut self, layers: &mut Layers<'_>) {
        layers.conv("stem", &mut self.stem);
        layers.batch_norm("stem_norm", &mut self.stem_norm);
        for (i, block) in self.blocks.iter_mut().enumerate() {
            let path = format!("blocks.{i}");
            layers.residual(&path, &mut *block);
            layers.conv(&format!("{path}.conv1"), &mut block.conv1);
            layers.batch_norm(&format!("{path}.norm1"), &mut block.norm1);
            layers.conv(&format!("{path}.conv2"), &mut block.conv2);
            layers.batch_norm(&format!("{path}.norm2"), &mut block.norm2);
            if let Some(p) = &mut block.shortcut {
                layers.conv(&format!("{path}.shortcut.conv"), &mut p.conv);
                layers.batch_norm(&format!("{path}.shortcut.norm"), &mut p.norm);
            }
        }
        layers.dropout_site("head", &mut self.head);
        layers.linear("head", &mut self.head);
    }
}

/// StochasticDepth drops the block's residual branch.
impl<B: Backend> ResidualBlock for BasicBlock<B> {
    fn variant(&mut self) -> &mut ResidualVariant {
        &mut self.variant
    }
}
