//! The channels-last ops against Burn's own on random shapes: forward values and both
//! gradients, with and without the fused ReLU, for convolution (groups, stride, padding,
//! dilation, odd sizes), max pooling and average pooling; bit-identical results for 1, 2 and
//! 4 threads; the default (Burn-kernel) implementation against the fast one; the dense layer
//! (forward, gradients, fused ReLU) against Burn's `linear`; and the layers and the MNIST CNN
//! against Burn's layers.
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
use burn::tensor::module::{avg_pool2d, conv2d, linear, max_pool2d};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Tensor, TensorData};
use flashover_core::model::{HasMemoryFormat, MemoryFormat};
use flashover_models::layers::{
    avg_pool2d_nhwc, conv2d_nhwc, dense, max_pool2d_nhwc, nhwc_to_nchw, Conv2d, Linear, MaxPool2d,
};
use flashover_models::{ops, MnistCnn};
use proptest::prelude::*;

mod common;
use common::random;

type B = Flex;
type AB = Autodiff<Flex>;

const TOL: f32 = 1e-4;

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

/// Output, input, weight and bias gradients of `sum(relu?(x · w + b) * probe)` through
/// Burn's `linear` (and `relu`) or (`fast`) the fast path's `dense`.
fn dense_through(
    [rows, d_in, d_out]: [usize; 3],
    bias: bool,
    relu: bool,
    seed: u64,
    fast: bool,
) -> Vec<Option<Tensor<B, 2>>> {
    let x = random::<AB, 2>([rows, d_in], seed).require_grad();
    let w = random::<AB, 2>([d_in, d_out], seed + 1).require_grad();
    let b = bias.then(|| random::<AB, 1>([d_out], seed + 2).require_grad());
    let y = if fast {
        dense(x.clone(), w.clone(), b.clone(), relu)
    } else {
        let y = linear(x.clone(), w.clone(), b.clone());
        if relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        }
    };
    let probe = random::<AB, 2>(y.dims(), seed + 3);
    let grads = (y.clone() * probe).sum().backward();
    vec![
        Some(y.inner()),
        x.grad(&grads),
        w.grad(&grads),
        b.map(|b| b.grad(&grads).unwrap().unsqueeze::<2>()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Shapes around the chunk sizes (16 batch rows, 128 input features, weight-gradient
    /// columns in blocks of 32 or more) and odd ones.
    #[test]
    fn the_dense_layer_and_its_gradients_match_burns(
        rows in prop_oneof![1usize..=5, 14usize..=35],
        d_in in prop_oneof![1usize..=9, 120usize..=300],
        d_out in prop_oneof![1usize..=12, 30usize..=100],
        bias in any::<bool>(),
        relu in any::<bool>(),
        seed in 0u64..1000,
    ) {
        // Up to 300 terms per output in [-1, 1]: a different summation order moves the
        // result by at most about 300 * 2^-23 * 300 < 1.1e-2 in the worst case, and in
        // practice (random signs) by well under 1e-4, the tolerance.
        let want = dense_through([rows, d_in, d_out], bias, relu, seed, false);
        let got = dense_through([rows, d_in, d_out], bias, relu, seed, true);
        let names = ["output", "input gradient", "weight gradient", "bias gradient"];
        for ((g, w), name) in got.into_iter().zip(want).zip(names) {
            match (g, w) {
                (Some(g), Some(w)) => assert_close(g, w, &format!("{name} of [{rows}, {d_in}] x [{d_in}, {d_out}]")),
                (None, None) => {}
                _ => panic!("{name} present on one side only"),
            }
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
    // Then a dense layer over the flattened features (17 rows: two chunks of 16 and one more;
    // 240 features: two chunks of 128 for the weight gradient).
    let [n, h, w2, c] = y.dims();
    let fc = random::<AB, 2>([h * w2 * c, 6], seed + 4).require_grad();
    let fb = random::<AB, 1>([6], seed + 5).require_grad();
    let y = dense(
        y.reshape([n, h * w2 * c]),
        fc.clone(),
        Some(fb.clone()),
        true,
    );
    let probe = random::<AB, 2>(y.dims(), seed + 3);
    let grads = (y.clone() * probe).sum().backward();
    vec![
        bits(y.inner()),
        bits(x.grad(&grads).unwrap()),
        bits(w.grad(&grads).unwrap()),
        bits(b.grad(&grads).unwrap()),
        bits(fc.grad(&grads).unwrap()),
        bits(fb.grad(&grads).unwrap()),
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
        variant: Default::default(),
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
fn the_linear_layer_is_burns_bit_for_bit_off_the_fast_path_and_agrees_on_it() {
    let device = Default::default();
    let burn_fc = burn::nn::LinearConfig::new(37, 5).init::<B>(&device);
    let _ = (burn_fc.weight.val(), burn_fc.bias.as_ref().map(|b| b.val()));
    let ours = Linear::<B>::from(burn_fc.clone());
    let x = random::<B, 2>([19, 37], 12);
    for relu in [false, true] {
        let want = burn_fc.forward(x.clone());
        let want = if relu {
            burn::tensor::activation::relu(want)
        } else {
            want
        };
        assert_eq!(
            bits(ours.forward(x.clone(), false, relu)),
            bits(want.clone()),
            "Burn's path, relu {relu}"
        );
        assert_close(ours.forward(x.clone(), true, relu), want, "fast path");
    }
    // The trait's default (Burn's kernels, what the GPU backends run) against the fast one.
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let t = |p| Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(p));
    let (w, b) = (burn_fc.weight.val(), burn_fc.bias.clone().unwrap().val());
    let out = t(<B as ops::ChannelsLastBackend>::dense(
        prim(x.clone()),
        prim(w.clone()),
        Some(b.clone().into_primitive().tensor()),
        true,
    ));
    let g = random::<B, 2>(out.dims(), 13);
    let run = |fast: bool| {
        let args = (
            prim(x.clone()),
            prim(w.clone()),
            Some(prim(out.clone())),
            prim(g.clone()),
        );
        let r = if fast {
            <B as ops::ChannelsLastBackend>::dense_backward(
                args.0, args.1, args.2, args.3, [true; 3],
            )
        } else {
            ops::burn_dense_backward::<B>(args.0, args.1, args.2, args.3, [true; 3])
        };
        let bias =
            Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(r.bias.unwrap()));
        (t(r.x.unwrap()), t(r.weight.unwrap()), bias)
    };
    let ((fx, fw, fb), (sx, sw, sb)) = (run(true), run(false));
    assert_close(fx, sx, "dense input gradient");
    assert_close(fw, sw, "dense weight gradient");
    assert_close(fb, sb, "dense bias gradient");
}

#[test]
fn the_layout_change_moves_values_as_burns_permute_does_and_back_for_the_gradient() {
    // 17 images of 3x5 pixels and 7 channels: 255 values an image, so the chunks of
    // whole images (16384 values) take 65 images; with 17, one chunk, and with 200, four.
    for n in [17, 200] {
        let x = random::<AB, 4>([n, 3, 5, 7], 21).require_grad();
        let fast = nhwc_to_nchw(x.clone());
        let burn = x.clone().permute([0, 3, 1, 2]);
        assert_eq!(
            bits(fast.clone().inner()),
            bits(burn.clone().inner()),
            "forward, {n} images"
        );
        let probe = random::<AB, 4>(fast.dims(), 22);
        let g_fast = x.grad(&(fast * probe.clone()).sum().backward()).unwrap();
        let g_burn = x.grad(&(burn * probe).sum().backward()).unwrap();
        assert_eq!(bits(g_fast), bits(g_burn), "gradient, {n} images");
    }
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
