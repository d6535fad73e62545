//! The channels-last ops against Burn's own on random shapes: forward values and both
//! gradients, with and without the fused ReLU, for convolution (groups, stride, padding,
//! dilation, odd sizes), max pooling and average pooling; bit-identical results for 1, 2 and
//! 4 threads; the default (Burn-kernel) implementation against the fast one; and the layers
//! and the MNIST CNN against Burn's layers.
//!
//! Tolerance: both sides compute the same f32 sums in different orders. With inputs and
//! weights in [-1, 1] and at most 3 * 3 * 6 = 54 terms per output (and a few hundred per
//! weight gradient), the difference is bounded by about terms * 2^-23 * sum(|terms|), well
//! under 1e-4 absolute on these magnitudes (errors of a wrong index or a missing term are of
//! order 0.1 to 1). Pooling moves values without arithmetic (max) or divides one sum (avg).

use burn::backend::{Autodiff, Flex};
use burn::nn::conv::Conv2dConfig;
use burn::nn::pool::MaxPool2dConfig;
use burn::nn::PaddingConfig2d;
use burn::tensor::backend::Backend;
use burn::tensor::module::{avg_pool2d, conv2d, max_pool2d};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Tensor, TensorData};
use flashover_core::model::{HasMemoryFormat, MemoryFormat};
use flashover_models::layers::{avg_pool2d_nhwc, conv2d_nhwc, max_pool2d_nhwc, Conv2d, MaxPool2d};
use flashover_models::{ops, MnistCnn};
use proptest::prelude::*;

type B = Flex;
type AB = Autodiff<Flex>;

const TOL: f32 = 1e-4;

/// Values uniform in [-1, 1) from `seed` alone (a SplitMix64 stream), so that tests running
/// in parallel never share a generator (the backend's is global).
fn random<Bk: Backend, const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Bk, D> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn assert_close<Bk: Backend, const D: usize>(got: Tensor<Bk, D>, want: Tensor<Bk, D>, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let got = got.into_data().to_vec::<f32>().unwrap();
    let want = want.into_data().to_vec::<f32>().unwrap();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= TOL, "{what}: largest difference {worst} > {TOL}");
}

fn bits<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<u32> {
    t.into_data()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[derive(Debug, Clone)]
struct ConvCase {
    batch: usize,
    groups: usize,
    cin_per_group: usize,
    cout_per_group: usize,
    size: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    bias: bool,
    relu: bool,
}

fn conv_case() -> impl Strategy<Value = ConvCase> {
    (
        (1usize..=3, 1usize..=2, 1usize..=3, 1usize..=3),
        ([3usize..=9, 3usize..=9], [1usize..=3, 1usize..=3]),
        (
            [1usize..=2, 1usize..=2],
            [0usize..=2, 0usize..=2],
            [1usize..=2, 1usize..=2],
        ),
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                (batch, groups, cin, cout),
                (size, kernel),
                (stride, padding, dilation),
                (bias, relu),
            )| ConvCase {
                batch,
                groups,
                cin_per_group: cin,
                cout_per_group: cout,
                size,
                kernel,
                stride,
                padding,
                dilation,
                bias,
                relu,
            },
        )
        .prop_filter("the kernel fits the padded input", |c| {
            (0..2).all(|i| c.size[i] + 2 * c.padding[i] > c.dilation[i] * (c.kernel[i] - 1))
        })
}

/// Input, weight and bias gradients of `sum(output * probe)` and the output, through Burn's
/// NCHW op or (`nhwc`) the channels-last op with inputs and outputs permuted.
fn conv_through(c: &ConvCase, seed: u64, nhwc: bool) -> [Option<Tensor<B, 4>>; 4] {
    let cin = c.groups * c.cin_per_group;
    let cout = c.groups * c.cout_per_group;
    let x = random::<AB, 4>([c.batch, cin, c.size[0], c.size[1]], seed).require_grad();
    let w =
        random::<AB, 4>([cout, c.cin_per_group, c.kernel[0], c.kernel[1]], seed + 1).require_grad();
    let b = c
        .bias
        .then(|| random::<AB, 1>([cout], seed + 2).require_grad());
    let options = ConvOptions::new(c.stride, c.padding, c.dilation, c.groups);
    let y = if nhwc {
        let y = conv2d_nhwc(
            x.clone().permute([0, 2, 3, 1]),
            w.clone(),
            b.clone(),
            options,
            c.relu,
        );
        y.permute([0, 3, 1, 2])
    } else {
        let y = conv2d(x.clone(), w.clone(), b.clone(), options);
        if c.relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        }
    };
    let probe = random::<AB, 4>(y.dims(), seed + 3);
    let grads = (y.clone() * probe).sum().backward();
    let gx = x.grad(&grads).unwrap();
    let gw = w.grad(&grads).unwrap();
    let gb = b.map(|b| b.grad(&grads).unwrap().unsqueeze::<4>());
    [Some(gx), Some(gw), gb, Some(y.inner())]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn convolution_and_its_gradients_match_burns(c in conv_case(), seed in 0u64..1000) {
        let want = conv_through(&c, seed, false);
        let got = conv_through(&c, seed, true);
        let names = ["input gradient", "weight gradient", "bias gradient", "output"];
        for ((g, w), name) in got.into_iter().zip(want).zip(names) {
            match (g, w) {
                (Some(g), Some(w)) => assert_close(g, w, &format!("{name} of {c:?}")),
                (None, None) => {}
                _ => panic!("{name} present on one side only"),
            }
        }
    }

    #[test]
    fn max_and_average_pooling_and_their_gradients_match_burns(
        batch in 1usize..=2,
        channels in 1usize..=5,
        size in [2usize..=9, 2usize..=9],
        kernel in [1usize..=3, 1usize..=3],
        stride in [1usize..=3, 1usize..=3],
        pad in [0usize..=1, 0usize..=1],
        dilation in [1usize..=2, 1usize..=2],
        count_include_pad in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let padding = [pad[0].min(kernel[0] / 2), pad[1].min(kernel[1] / 2)];
        let fits = (0..2).all(|i| size[i] + 2 * padding[i] > dilation[i] * (kernel[i] - 1));
        prop_assume!(fits);
        for max in [true, false] {
            let dilation = if max { dilation } else { [1, 1] };
            let run = |nhwc: bool| {
                let x = random::<AB, 4>([batch, channels, size[0], size[1]], seed).require_grad();
                let y = match (max, nhwc) {
                    (true, false) => max_pool2d(x.clone(), kernel, stride, padding, dilation, false),
                    (true, true) => max_pool2d_nhwc(x.clone().permute([0, 2, 3, 1]), kernel, stride, padding, dilation)
                        .permute([0, 3, 1, 2]),
                    (false, false) => avg_pool2d(x.clone(), kernel, stride, padding, count_include_pad, false),
                    (false, true) => avg_pool2d_nhwc(x.clone().permute([0, 2, 3, 1]), kernel, stride, padding, count_include_pad)
                        .permute([0, 3, 1, 2]),
                };
                let probe = random::<AB, 4>(y.dims(), seed + 7);
                let grads = (y.clone() * probe).sum().backward();
                (y.inner(), x.grad(&grads).unwrap())
            };
            let (y1, g1) = run(true);
            let (y0, g0) = run(false);
            let what = if max { "max pool" } else { "avg pool" };
            assert_close(y1, y0, &format!("{what} output"));
            assert_close(g1, g0, &format!("{what} input gradient"));
        }
    }
}

/// Forward and every gradient of a convolution and a pool on the fast path, as bits.
fn fast_path_bits(seed: u64) -> Vec<Vec<u32>> {
    let x = random::<AB, 4>([17, 13, 11, 5], seed).require_grad();
    let w = random::<AB, 4>([8, 5, 3, 3], seed + 1).require_grad();
    let b = random::<AB, 1>([8], seed + 2).require_grad();
    let y = conv2d_nhwc(
        x.clone(),
        w.clone(),
        Some(b.clone()),
        ConvOptions::new([1, 1], [1, 1], [1, 1], 1),
        true,
    );
    let y = max_pool2d_nhwc(y, [2, 2], [2, 2], [0, 0], [1, 1]);
    let probe = random::<AB, 4>(y.dims(), seed + 3);
    let grads = (y.clone() * probe).sum().backward();
    vec![
        bits(y.inner()),
        bits(x.grad(&grads).unwrap()),
        bits(w.grad(&grads).unwrap()),
        bits(b.grad(&grads).unwrap()),
    ]
}

#[test]
fn the_fast_path_is_bit_identical_for_one_two_and_four_threads() {
    let on = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| fast_path_bits(11))
    };
    let one = on(1);
    assert_eq!(one, fast_path_bits(11), "run to run");
    assert_eq!(on(2), one, "2 threads");
    assert_eq!(on(4), one, "4 threads");
}

#[test]
fn burns_kernels_behind_the_trait_agree_with_the_fast_ones() {
    // The default implementation (what wgpu, CUDA and ndarray run) on flex's tensors.
    let x = random::<B, 4>([3, 7, 9, 4], 5);
    let w = random::<B, 4>([6, 2, 3, 3], 6);
    let b = random::<B, 1>([6], 7);
    let options = ConvOptions::new([2, 1], [1, 1], [1, 2], 2);
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let fast = <B as ops::ChannelsLastBackend>::conv2d_nhwc(
        prim(x.clone()),
        prim(w.clone()),
        Some(b.clone().into_primitive().tensor()),
        options.clone(),
        true,
    );
    let slow = ops::burn_conv2d_nhwc::<B>(
        prim(x.clone()),
        prim(w.clone()),
        Some(b.clone().into_primitive().tensor()),
        options.clone(),
        true,
    );
    let t = |p| Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(p));
    let (fast, slow) = (t(fast), t(slow));
    let g = random::<B, 4>(fast.dims(), 8);
    assert_close(fast.clone(), slow.clone(), "forward");
    let grads = |fast_path: bool| {
        let args = (
            prim(x.clone()),
            prim(w.clone()),
            Some(b.clone().into_primitive().tensor()),
            Some(prim(fast.clone())),
            prim(g.clone()),
        );
        let r = if fast_path {
            <B as ops::ChannelsLastBackend>::conv2d_nhwc_backward(
                args.0,
                args.1,
                args.2,
                args.3,
                args.4,
                options.clone(),
                [true; 3],
            )
        } else {
            ops::burn_conv2d_nhwc_backward::<B>(
                args.0,
                args.1,
                args.2,
                args.3,
                args.4,
                options.clone(),
                [true; 3],
            )
        };
        (
            t(r.x.unwrap()),
            t(r.weight.unwrap()),
            Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(r.bias.unwrap())),
        )
    };
    let (fx, fw, fb) = grads(true);
    let (sx, sw, sb) = grads(false);
    assert_close(fx, sx, "input gradient");
    assert_close(fw, sw, "weight gradient");
    assert_close(fb, sb, "bias gradient");
}

#[test]
fn layers_channels_first_are_burns_layers_bit_for_bit_and_channels_last_agrees() {
    let device = Default::default();
    B::seed(&device, 3);
    let config = Conv2dConfig::new([3, 8], [4, 3]).with_padding(PaddingConfig2d::Same);
    let burn_conv = config.init::<B>(&device);
    // Parameters are initialised lazily: draw them once, before the two layers share them.
    let _ = (
        burn_conv.weight.val(),
        burn_conv.bias.as_ref().map(|b| b.val()),
    );
    let ours = Conv2d::<B>::from(burn_conv.clone());
    let burn_pool = MaxPool2dConfig::new([3, 2])
        .with_strides([2, 2])
        .with_padding(PaddingConfig2d::Same)
        .init();
    let our_pool = MaxPool2d {
        kernel_size: [3, 2],
        stride: [2, 2],
        padding: PaddingConfig2d::Same,
        dilation: [1, 1],
    };
    // 10x9 input: 'same' padding of the even kernel and of the pool is asymmetric.
    let x = random::<B, 4>([2, 3, 10, 9], 4);
    let want = burn_pool.forward(burn::tensor::activation::relu(burn_conv.forward(x.clone())));
    let got = our_pool.forward(ours.forward(x.clone(), false, true), false);
    assert_eq!(bits(got), bits(want.clone()), "channels-first");
    let nhwc = our_pool
        .forward(ours.forward(x.permute([0, 2, 3, 1]), true, true), true)
        .permute([0, 3, 1, 2]);
    assert_close(nhwc, want, "channels-last");
}

#[test]
fn the_mnist_cnn_gives_the_same_logits_in_both_formats_from_the_same_weights() {
    let device = Default::default();
    let first = MnistCnn::<B>::new(&device, 9).with_memory_format(MemoryFormat::ChannelsFirst);
    let last = first.clone().with_memory_format(MemoryFormat::ChannelsLast);
    assert_eq!(
        MnistCnn::<B>::new(&device, 9).memory_format(),
        MemoryFormat::Auto
    );
    let images = Tensor::<B, 4>::from_data(
        TensorData::new(
            (0..4 * 784)
                .map(|i| ((i * 37) % 255) as f32 / 255.0)
                .collect::<Vec<_>>(),
            [4, 1, 28, 28],
        ),
        &device,
    );
    assert_close(
        last.logits(images.clone()),
        first.logits(images.clone()),
        "logits",
    );
    // Smaller images (progressive resizing) go through the adaptive pool in both formats.
    let small = images.slice([0..4, 0..1, 0..20, 0..20]);
    assert_close(
        last.logits(small.clone()),
        first.logits(small),
        "logits at 20x20",
    );
}
