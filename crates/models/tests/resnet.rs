//! Batch norm and the ResNets: batch norm against values worked out by hand and against
//! Burn's `BatchNorm` (channels-first bit for bit, channels-last within a tolerance: the same
//! means summed in another order), running statistics in training and their use in
//! evaluation; the ResNet family's shapes, parameter counts from the paper's layer list,
//! FLOPs, and channels-last against channels-first on the same parameters.
//!
//! Tolerance (1e-4 absolute on values of order 1): both layouts compute the same f32 means of
//! a few hundred to a few thousand terms in different orders; a wrong axis or a missing term
//! changes results by order 0.1.

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::BatchNormConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use flashover_core::model::{HasMemoryFormat, MemoryFormat};
use flashover_models::norm::BatchNorm;
use flashover_models::{ResNet, ResNetConfig};

mod common;
use common::random;

type B = Flex;
type AB = Autodiff<Flex>;

const TOL: f32 = 1e-4;

fn values<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= TOL, "{what}: worst difference {worst}");
}

fn nchw_to_nhwc<Bk: Backend>(x: Tensor<Bk, 4>) -> Tensor<Bk, 4> {
    x.permute([0, 2, 3, 1])
}

#[test]
fn batch_norm_matches_the_formula_by_hand() {
    // One channel, values 1, 2, 3, 4 over a 2x2 image: mean 2.5, biased variance 1.25.
    let device = Default::default();
    let norm = BatchNorm::<AB>::new(&BatchNormConfig::new(1), &device);
    let x = Tensor::<AB, 4>::from_data(
        TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [1, 1, 2, 2]),
        &device,
    );
    let y = values(norm.forward(x, false));
    let sd = (1.25f64 + 1e-5).sqrt();
    let want: Vec<f32> = [1.0, 2.0, 3.0, 4.0]
        .iter()
        .map(|v| ((v - 2.5) / sd) as f32)
        .collect();
    assert_close(&y, &want, "normalised values");
    // Running statistics: 0.9 * (0, 1) + 0.1 * (2.5, 1.25).
    assert_close(
        &values(norm.running_mean.value_sync()),
        &[0.25],
        "running mean",
    );
    assert_close(
        &values(norm.running_var.value_sync()),
        &[1.025],
        "running variance",
    );
    // Evaluation (the inner backend) normalises with the running statistics.
    let eval = norm.valid();
    let x = Tensor::<B, 4>::from_data(
        TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [1, 1, 2, 2]),
        &device,
    );
    let sd = (1.025f64 + 1e-5).sqrt();
    let want: Vec<f32> = [1.0, 2.0, 3.0, 4.0]
        .iter()
        .map(|v| ((v - 0.25) / sd) as f32)
        .collect();
    assert_close(&values(eval.forward(x, false)), &want, "evaluation");
}

#[test]
fn batch_norm_channels_first_is_burns_bit_for_bit_and_channels_last_agrees() {
    let device = Default::default();
    for (shape, seed) in [([4, 3, 5, 5], 1u64), ([2, 7, 3, 4], 2), ([1, 1, 6, 1], 3)] {
        // Three layers with the same initial values (a clone would share running state).
        let config = BatchNormConfig::new(shape[1]).with_momentum(0.3);
        let burn_norm = config.init::<AB>(&device);
        let ours: BatchNorm<AB> = config.init::<AB>(&device).into();
        let ours_nhwc = BatchNorm::<AB>::new(&config, &device);
        for step in 0..3 {
            // One leaf per graph (a backward pass frees the graph it walks).
            let x = random::<AB, 4>(shape, seed * 10 + step).require_grad();
            let x_ours = random::<AB, 4>(shape, seed * 10 + step).require_grad();
            let w = random::<AB, 4>(shape, seed * 10 + step + 5);
            let want = burn_norm.forward(x.clone());
            let got = ours.forward(x_ours.clone(), false);
            assert_eq!(
                values(got.clone()),
                values(want.clone()),
                "forward {shape:?}"
            );
            let x_cl = Tensor::<AB, 4>::from_data(nchw_to_nhwc(x.clone()).into_data(), &device)
                .require_grad();
            let got_cl = ours_nhwc.forward(x_cl.clone(), true);
            assert_close(
                &values(got_cl.clone().permute([0, 3, 1, 2])),
                &values(want.clone()),
                "channels-last forward",
            );
            // Gradients of a weighted sum, against Burn's.
            let g_want = want.mul(w.clone()).sum().backward();
            let g_ours = got.mul(w.clone()).sum().backward();
            let g_cl = got_cl.mul(nchw_to_nhwc(w)).sum().backward();
            let gx = |g: &_, t: &Tensor<AB, 4>| values(t.grad(g).unwrap());
            assert_eq!(
                gx(&g_ours, &x_ours),
                gx(&g_want, &x),
                "input gradient {shape:?}"
            );
            let gx_cl = Tensor::<B, 4>::from_data(
                TensorData::new(gx(&g_cl, &x_cl), [shape[0], shape[2], shape[3], shape[1]]),
                &device,
            );
            assert_close(
                &values(gx_cl.permute([0, 3, 1, 2])),
                &gx(&g_want, &x),
                "channels-last input gradient",
            );
            for (name, p, q, r) in [
                ("gamma", &ours.gamma, &burn_norm.gamma, &ours_nhwc.gamma),
                ("beta", &ours.beta, &burn_norm.beta, &ours_nhwc.beta),
            ] {
                let a = values(p.val().grad(&g_ours).unwrap());
                let b = values(q.val().grad(&g_want).unwrap());
                assert_eq!(a, b, "{name} gradient {shape:?}");
                assert_close(&values(r.val().grad(&g_cl).unwrap()), &b, name);
            }
        }
        assert_eq!(
            values(ours.running_mean.value_sync()),
            values(burn_norm.running_mean.value_sync())
        );
        assert_eq!(
            values(ours.running_var.value_sync()),
            values(burn_norm.running_var.value_sync())
        );
        assert_close(
            &values(ours_nhwc.running_var.value_sync()),
            &values(burn_norm.running_var.value_sync()),
            "channels-last running variance",
        );
        // Evaluation on the inner backend, both layouts.
        let x = random::<B, 4>(shape, seed + 99);
        let want = values(burn_norm.valid().forward(x.clone()));
        assert_eq!(values(ours.valid().forward(x.clone(), false)), want);
        assert_close(
            &values(
                ours_nhwc
                    .valid()
                    .forward(nchw_to_nhwc(x), true)
                    .permute([0, 3, 1, 2]),
            ),
            &want,
            "channels-last evaluation",
        );
    }
}

#[test]
#[should_panic(expected = "BatchNorm over 3 channels")]
fn batch_norm_names_the_shape_it_cannot_take() {
    let norm = BatchNorm::<B>::new(&BatchNormConfig::new(3), &Default::default());
    norm.forward(random::<B, 4>([2, 4, 3, 3], 1), false);
}

/// Trainable weights of a CIFAR-style ResNet with projection shortcuts, from the layer list
/// (a 3x3 stem, per block two 3x3 convolutions and two batch norms of 2 parameters per
/// channel, a 1x1 convolution and a batch norm where the block changes width or size, the
/// classifier), and the batch norms' channels.
fn parameter_count(
    blocks: &[usize],
    widths: &[usize],
    in_c: usize,
    classes: usize,
) -> (usize, usize) {
    let mut total = 9 * in_c * widths[0] + 2 * widths[0];
    let mut norm_channels = widths[0];
    let mut c = widths[0];
    for (stage, (&n, &w)) in blocks.iter().zip(widths).enumerate() {
        for i in 0..n {
            total += 9 * c * w + 9 * w * w + 4 * w;
            norm_channels += 2 * w;
            if (stage > 0 && i == 0) || c != w {
                total += c * w + 2 * w;
                norm_channels += w;
            }
            c = w;
        }
    }
    (total + c * classes + classes, norm_channels)
}

/// Burn's `num_params` counts the running mean and variance of each batch norm too.
fn trainable(model: &ResNet<B>, norm_channels: usize) -> usize {
    model.num_params() - 2 * norm_channels
}

#[test]
fn the_family_has_the_papers_shapes() {
    let device = Default::default();
    let r20 = ResNetConfig::cifar(20, 16).unwrap();
    assert_eq!(
        (r20.blocks().to_vec(), r20.widths().to_vec(), r20.depth()),
        (vec![3; 3], vec![16, 32, 64], 20)
    );
    let r56 = ResNetConfig::cifar(56, 16).unwrap();
    assert_eq!((r56.blocks().to_vec(), r56.depth()), (vec![9; 3], 56));
    let r18 = ResNetConfig::resnet18(64).unwrap();
    assert_eq!(
        (r18.widths().to_vec(), r18.depth()),
        (vec![64, 128, 256, 512], 18)
    );
    for bad in [19, 2, 0, 21] {
        let err = ResNetConfig::cifar(bad, 16).unwrap_err().to_string();
        assert!(
            err.contains(&bad.to_string()) && err.contains("6n + 2"),
            "{err}"
        );
    }
    assert!(ResNetConfig::cifar(20, 0).is_err() && ResNetConfig::resnet18(0).is_err());
    // No shape that init could not build gets past the constructors.
    assert!(r20.clone().with_io(0, 10).is_err() && r20.clone().with_io(3, 0).is_err());
    assert!(r20.clone().with_widths(vec![8, 16]).is_err());
    assert!(r20.clone().with_widths(vec![8, 0, 32]).is_err());
    for config in [
        r20.clone(),
        r56,
        ResNetConfig::resnet18(8).unwrap(),
        r20.clone().with_widths(vec![8, 12, 20]).unwrap(),
        r20.with_io(3, 100).unwrap(),
    ] {
        let model: ResNet<B> = config.init(&device, 7);
        let (weights, norm_channels) = parameter_count(
            config.blocks(),
            config.widths(),
            config.in_channels(),
            config.classes(),
        );
        assert_eq!(trainable(&model, norm_channels), weights, "{config:?}");
        assert_eq!(model.blocks.len(), config.blocks().iter().sum::<usize>());
    }
    // ResNet-20 on 3-channel 32x32 images: the paper's 0.27M parameters (with option A
    // shortcuts; B adds the two 1x1 projections and their norms, 512 + 64 + 2048 + 128).
    let config = ResNetConfig::cifar(20, 16).unwrap().with_io(3, 10).unwrap();
    let cifar: ResNet<B> = config.init(&device, 1);
    let (_, norm_channels) = parameter_count(config.blocks(), config.widths(), 3, 10);
    assert_eq!(
        trainable(&cifar, norm_channels),
        269_722 + 512 + 64 + 2048 + 128
    );
}

#[test]
fn flops_follow_the_layer_list() {
    let model: ResNet<B> = ResNetConfig::cifar(20, 16)
        .unwrap()
        .init(&Default::default(), 1);
    // 28x28 digits: stem at 28x28, stage 1 at 28x28, stages 2 and 3 at 14x14 and 7x7.
    let conv = |o: usize, i: usize, k: usize, hw: usize| 2.0 * (o * i * k * k * hw * hw) as f64;
    let mut want = conv(16, 1, 3, 28) + 6.0 * conv(16, 16, 3, 28);
    want += conv(32, 16, 3, 14) + 5.0 * conv(32, 32, 3, 14) + conv(32, 16, 1, 14);
    want += conv(64, 32, 3, 7) + 5.0 * conv(64, 64, 3, 7) + conv(64, 32, 1, 7);
    want += 2.0 * 64.0 * 10.0;
    assert_eq!(model.forward_flops(28, 28), want);
}

#[test]
fn channels_last_computes_what_channels_first_does_on_the_same_parameters() {
    let device = Default::default();
    let config = ResNetConfig::resnet18(4).unwrap().with_io(3, 5).unwrap();
    let first: ResNet<AB> = config
        .init::<AB>(&device, 3)
        .with_memory_format(MemoryFormat::ChannelsFirst);
    let last: ResNet<AB> = config
        .init::<AB>(&device, 3)
        .with_memory_format(MemoryFormat::ChannelsLast);
    for (size, seed) in [(28usize, 1u64), (17, 2)] {
        let x = random::<AB, 4>([3, 3, size, size], seed);
        let a = first.logits(x.clone());
        let b = last.logits(x);
        assert_eq!(a.dims(), [3, 5]);
        assert_close(&values(b.clone()), &values(a.clone()), "logits");
        // Gradients of the stem's weights through the whole network.
        let ga = a.sum().backward();
        let gb = b.sum().backward();
        assert_close(
            &values(last.stem.weight.val().grad(&gb).unwrap()),
            &values(first.stem.weight.val().grad(&ga).unwrap()),
            "stem weight gradient",
        );
    }
    // Evaluation: running statistics were updated identically (within rounding).
    let x = random::<B, 4>([2, 3, 28, 28], 9);
    assert_close(
        &values(last.valid().logits(x.clone())),
        &values(first.valid().logits(x)),
        "evaluation logits",
    );
}

/// BlurPool's filter by its definition, in f64, NCHW: each channel convolved with
/// `[1, 2, 1]^T [1, 2, 1] / 16`, zero padding 1, at `stride`.
fn naive_blur(x: &[f32], [n, c, h, w]: [usize; 4], stride: usize) -> (Vec<f64>, [usize; 4]) {
    let taps = [1.0, 2.0, 1.0];
    let (oh, ow) = ((h - 1) / stride + 1, (w - 1) / stride + 1);
    let mut out = vec![0.0; n * c * oh * ow];
    for b in 0..n {
        for ch in 0..c {
            for i in 0..oh {
                for j in 0..ow {
                    let mut acc = 0.0;
                    for (di, ti) in taps.iter().enumerate() {
                        for (dj, tj) in taps.iter().enumerate() {
                            let (y, xx) = (
                                (i * stride + di) as isize - 1,
                                (j * stride + dj) as isize - 1,
                            );
                            if y >= 0 && xx >= 0 && (y as usize) < h && (xx as usize) < w {
                                let v = x[((b * c + ch) * h + y as usize) * w + xx as usize] as f64;
                                acc += ti * tj / 16.0 * v;
                            }
                        }
                    }
                    out[((b * c + ch) * oh + i) * ow + j] = acc;
                }
            }
        }
    }
    (out, [n, c, oh, ow])
}

fn assert_close_f64(got: &[f32], want: &[f64], what: &str) {
    let want: Vec<f32> = want.iter().map(|v| *v as f32).collect();
    assert_close(got, &want, what);
}

#[test]
fn blur_is_the_binomial_filter_in_both_layouts() {
    use flashover_models::layers::blur2d;
    // A single bright pixel spreads into the filter itself.
    let mut delta = vec![0.0f32; 25];
    delta[12] = 16.0;
    let x = Tensor::<B, 4>::from_data(TensorData::new(delta, [1, 1, 5, 5]), &Default::default());
    let y = values(blur2d(x, [1, 1], false));
    let mut want = vec![0.0f32; 25];
    for (k, v) in [1.0, 2.0, 1.0, 2.0, 4.0, 2.0, 1.0, 2.0, 1.0]
        .iter()
        .enumerate()
    {
        want[(1 + k / 3) * 5 + 1 + k % 3] = *v;
    }
    assert_close(&y, &want, "blurred delta");
    for (shape, stride, seed) in [
        ([2, 3, 7, 6], 1, 1u64),
        ([2, 5, 8, 8], 2, 2),
        ([1, 2, 5, 9], 2, 3),
    ] {
        let x = random::<B, 4>(shape, seed);
        let (want, out_shape) = naive_blur(&values(x.clone()), shape, stride);
        let first = blur2d(x.clone(), [stride, stride], false);
        assert_eq!(first.dims(), out_shape);
        assert_close_f64(&values(first), &want, "channels-first blur");
        let last = blur2d(nchw_to_nhwc(x), [stride, stride], true).permute([0, 3, 1, 2]);
        assert_close_f64(&values(last), &want, "channels-last blur");
    }
}

#[test]
fn blurred_layers_compose_as_the_paper_says() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    use flashover_models::layers::{blur2d, Conv2d, MaxPool2d};
    use flashover_surgery::Blur;
    let device = Default::default();
    let x = random::<B, 4>([2, 4, 9, 9], 11);
    // Initialised now (Burn's parameters are lazy, and each clone would draw its own).
    let conv = flashover_core::params::init_model::<B, _>(&device, 3, |d| {
        Conv2d::<B>::new(
            &Conv2dConfig::new([4, 6], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
            d,
        )
    });
    let plain_at = |x: Tensor<B, 4>, stride| {
        let mut c = conv.clone();
        c.stride = stride;
        c.forward(x, false, false)
    };
    for nhwc in [false, true] {
        let input = if nhwc {
            nchw_to_nhwc(x.clone())
        } else {
            x.clone()
        };
        let back = |t: Tensor<B, 4>| if nhwc { t.permute([0, 3, 1, 2]) } else { t };
        let mut first = conv.clone();
        first.variant.blur = Some(Blur::First);
        let want = plain_at(blur2d(x.clone(), [1, 1], false), [2, 2]);
        assert_close(
            &values(back(first.forward(input.clone(), nhwc, false))),
            &values(want),
            "blur first",
        );
        let mut last = conv.clone();
        last.variant.blur = Some(Blur::Last);
        let want = blur2d(plain_at(x.clone(), [1, 1]), [2, 2], false);
        assert_close(
            &values(back(last.forward(input.clone(), nhwc, false))),
            &values(want),
            "blur last",
        );
        // MaxBlurPool: the maxima at stride 1, then the blur with the pool's stride.
        let mut pool = MaxPool2d::new([2, 2], [2, 2]);
        let plain = MaxPool2d::new([2, 2], [1, 1]).forward(x.clone(), false);
        pool.variant.blur = true;
        let got = back(pool.forward(input, nhwc));
        assert_eq!(got.dims(), [2, 4, 4, 4]);
        assert_close(
            &values(got),
            &values(blur2d(plain, [2, 2], false)),
            "max blur pool",
        );
    }
}

#[test]
fn ghost_batch_norm_normalises_each_ghost_batch_and_averages_their_statistics() {
    use flashover_surgery::NormVariant;
    let device = Default::default();
    // 5 samples in ghost batches of 2: torch.chunk cuts 3 pieces of 2, 2 and 1.
    let shape = [5, 2, 3, 1];
    for nhwc in [false, true] {
        let mut norm = BatchNorm::<AB>::new(&BatchNormConfig::new(2), &device);
        norm.variant = NormVariant {
            ghost_batch_size: Some(2),
        };
        let x = random::<AB, 4>(shape, 5);
        let data = values(x.clone());
        let input = if nhwc { nchw_to_nhwc(x) } else { x };
        let out = norm.forward(input, nhwc);
        let out = values(if nhwc { out.permute([0, 3, 1, 2]) } else { out });
        let (mut mean_sum, mut var_sum) = ([0.0f64; 2], [0.0f64; 2]);
        for (start, len) in [(0, 2), (2, 2), (4, 1)] {
            for ch in 0..2 {
                let vals: Vec<f64> = (start..start + len)
                    .flat_map(|b| (0..3).map(move |p| (b, p)))
                    .map(|(b, p)| data[(b * 2 + ch) * 3 + p] as f64)
                    .collect();
                let mean = vals.iter().sum::<f64>() / vals.len() as f64;
                let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / vals.len() as f64;
                mean_sum[ch] += mean;
                var_sum[ch] += var;
                for b in start..start + len {
                    for p in 0..3 {
                        let i = (b * 2 + ch) * 3 + p;
                        let want = (data[i] as f64 - mean) / (var + 1e-5).sqrt();
                        assert!(
                            (out[i] as f64 - want).abs() < 1e-4,
                            "sample {b} channel {ch}: {} vs {want}",
                            out[i]
                        );
                    }
                }
            }
        }
        let running_mean: Vec<f64> = mean_sum.iter().map(|m| 0.1 * m / 3.0).collect();
        let running_var: Vec<f64> = var_sum.iter().map(|v| 0.9 + 0.1 * v / 3.0).collect();
        assert_close_f64(
            &values(norm.running_mean.value_sync()),
            &running_mean,
            "running mean",
        );
        assert_close_f64(
            &values(norm.running_var.value_sync()),
            &running_var,
            "running variance",
        );
    }
    // A batch no larger than the ghost size is one ghost batch: the plain layer, bit for bit.
    let mut ghost = BatchNorm::<AB>::new(&BatchNormConfig::new(2), &device);
    ghost.variant = NormVariant {
        ghost_batch_size: Some(8),
    };
    let plain = BatchNorm::<AB>::new(&BatchNormConfig::new(2), &device);
    let x = random::<AB, 4>([4, 2, 3, 3], 6);
    assert_eq!(
        values(ghost.forward(x.clone(), false)),
        values(plain.forward(x, false))
    );
    // Evaluation ignores the ghost batches.
    let x = random::<B, 4>([6, 2, 3, 3], 7);
    assert_eq!(
        values(ghost.valid().forward(x.clone(), false)),
        values(plain.valid().forward(x, false))
    );
}

#[test]
fn stochastic_depth_skips_or_masks_the_branch_in_training_and_scales_it_in_evaluation() {
    use flashover_surgery::{DepthDrop, DropMode, Keep, ResidualVariant};
    let device = Default::default();
    // Block 1 of ResNet-8 halves the resolution: its shortcut is a projection.
    let model: ResNet<AB> = ResNetConfig::cifar(8, 4).unwrap().init(&device, 5);
    for (index, nhwc) in [(0usize, false), (1, false), (1, true)] {
        let mut block = model.blocks[index].clone();
        let c_in = block.conv1.weight.dims()[1];
        let x = random::<AB, 4>([3, c_in, 8, 8], 21);
        let x = if nhwc { nchw_to_nhwc(x) } else { x };
        let back = |t: Tensor<AB, 4>| if nhwc { t.permute([0, 3, 1, 2]) } else { t };
        let shortcut = match &block.shortcut {
            Some(p) => p.norm.forward(p.conv.forward(x.clone(), nhwc, false), nhwc),
            None => x.clone(),
        };
        let plain = values(back(block.forward(x.clone(), nhwc)));
        block.variant = ResidualVariant {
            drop: Some(DepthDrop {
                mode: DropMode::Block,
                rate: 0.3,
                keep: Some(Keep::Block(false)),
            }),
        };
        let skipped = values(back(block.forward(x.clone(), nhwc)));
        let want = values(back(burn::tensor::activation::relu(shortcut)));
        assert_close(&skipped, &want, "a dropped block is relu(shortcut)");
        block.variant.drop.as_mut().unwrap().keep = Some(Keep::Block(true));
        assert_close(
            &values(back(block.forward(x.clone(), nhwc))),
            &plain,
            "a kept block",
        );
        // Sample-wise: sample 1's branch dropped, the others kept.
        block.variant.drop.as_mut().unwrap().keep = Some(Keep::Samples(vec![true, false, true]));
        let mixed = values(back(block.forward(x.clone(), nhwc)));
        let per = plain.len() / 3;
        assert_close(&mixed[..per], &plain[..per], "kept sample 0");
        assert_close(
            &mixed[per..2 * per],
            &skipped[per..2 * per],
            "dropped sample 1",
        );
        assert_close(&mixed[2 * per..], &plain[2 * per..], "kept sample 2");
    }
    // Evaluation: the branch scaled by its survival probability 0.7.
    let mut block = model.blocks[0].clone();
    block.variant = ResidualVariant {
        drop: Some(DepthDrop {
            mode: DropMode::Block,
            rate: 0.3,
            keep: None,
        }),
    };
    let eval = block.valid();
    let x = random::<B, 4>([2, 4, 6, 6], 22);
    let branch = eval.norm2.forward(
        eval.conv2.forward(
            burn::tensor::activation::relu(
                eval.norm1
                    .forward(eval.conv1.forward(x.clone(), false, false), false),
            ),
            false,
            false,
        ),
        false,
    );
    let want = burn::tensor::activation::relu(branch.mul_scalar(0.7).add(x.clone()));
    assert_close(
        &values(eval.forward(x, false)),
        &values(want),
        "evaluation scales the branch",
    );
}

#[test]
fn weight_standardization_is_the_papers_per_channel_formula() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    use flashover_models::layers::{standardize_weight, Conv2d};
    let device = Default::default();
    let w = random::<B, 4>([3, 2, 3, 3], 31);
    let raw = values(w.clone());
    let got = values(standardize_weight(w));
    for o in 0..3 {
        let row: Vec<f64> = raw[o * 18..][..18].iter().map(|v| *v as f64).collect();
        let mean = row.iter().sum::<f64>() / 18.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 18.0;
        let want: Vec<f64> = row
            .iter()
            .map(|v| (v - mean) / (var + 1e-10).sqrt())
            .collect();
        assert_close_f64(&got[o * 18..][..18], &want, "standardised channel");
    }
    // A standardised convolution is the plain one on standardised weights, in both layouts,
    // and the raw weights get the gradient.
    let conv = flashover_core::params::init_model::<AB, _>(&device, 4, |d| {
        Conv2d::<AB>::new(
            &Conv2dConfig::new([2, 3], [3, 3]).with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
            d,
        )
    });
    let mut ws = conv.clone();
    ws.variant.standardize = true;
    let mut manual = conv.clone();
    manual.weight =
        burn::module::Param::from_tensor(standardize_weight(conv.weight.val()).detach());
    let x = random::<AB, 4>([2, 2, 5, 5], 32);
    for nhwc in [false, true] {
        let input = if nhwc {
            nchw_to_nhwc(x.clone())
        } else {
            x.clone()
        };
        assert_close(
            &values(ws.forward(input.clone(), nhwc, false)),
            &values(manual.forward(input, nhwc, false)),
            "standardised convolution",
        );
    }
    let grads = ws.forward(x, false, false).sum().backward();
    assert!(
        ws.weight.val().grad(&grads).is_some(),
        "the raw weights get a gradient"
    );
}

/// In float16, `1e-10` is zero and squares below about `6e-8` underflow: a constant channel
/// (variance 0) and one of +-1e-4 (variance 1e-8) must still standardise to 0 and to +-1,
/// in float16, as they do in float32 (the statistics are computed in float32).
#[test]
fn weight_standardization_in_float16_neither_divides_by_zero_nor_underflows() {
    use burn::tensor::{DType, FloatDType};
    use flashover_models::layers::standardize_weight;
    let device = Default::default();
    let mut raw = vec![0.5f32; 9];
    raw.extend((0..9).map(|k| if k % 2 == 0 { 1e-4f32 } else { -1e-4 }));
    // Nine values of +-1e-4 have mean 1e-4 / 9; the exact standardisation is computed here.
    let row = &raw[9..];
    let mean = row.iter().map(|v| *v as f64).sum::<f64>() / 9.0;
    let var = row.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / 9.0;
    let mut want = vec![0.0f64; 9];
    want.extend(
        row.iter()
            .map(|v| (*v as f64 - mean) / (var + 1e-10).sqrt()),
    );
    let w = Tensor::<B, 4>::from_data(TensorData::new(raw, [2, 1, 3, 3]), &device)
        .cast(FloatDType::F16);
    let out = standardize_weight(w);
    assert_eq!(out.dtype(), DType::F16, "the result stays in float16");
    let got = values(out.cast(FloatDType::F32));
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.is_finite() && (*g as f64 - w).abs() < 2e-3,
            "element {k}: {g} against {w}"
        );
    }
}

/// Squeeze-and-excitation by hand: channel means, `relu(s W1)`, `sigmoid(. W2)`, each
/// channel scaled; through the block alone and after a convolution (before its ReLU), in
/// both layouts, with the block's initialisation in PyTorch's bounds.
#[test]
fn squeeze_excite_scales_each_channel_by_the_papers_formula() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::PaddingConfig2d;
    use flashover_models::layers::{Conv2d, SqueezeExcite};
    let device = Default::default();
    let (n, c, h, w, latent) = (2usize, 4usize, 3usize, 5usize, 3usize);
    let se = SqueezeExcite::<B>::new(c, latent, 9, &device);
    let w1 = values(se.reduce.weight.val());
    let w2 = values(se.expand.weight.val());
    assert_eq!(se.reduce.weight.dims(), [c, latent]);
    assert_eq!(se.expand.weight.dims(), [latent, c]);
    assert!(se.reduce.bias.is_none() && se.expand.bias.is_none());
    let b1 = 1.0 / (c as f32).sqrt();
    let b2 = 1.0 / (latent as f32).sqrt();
    assert!(w1.iter().all(|v| v.abs() <= b1) && w2.iter().all(|v| v.abs() <= b2));
    assert_eq!(
        values(
            SqueezeExcite::<B>::new(c, latent, 9, &device)
                .reduce
                .weight
                .val()
        ),
        w1,
        "the seed alone decides the block"
    );
    let x = random::<B, 4>([n, c, h, w], 41);
    let xs = values(x.clone());
    let mut want = vec![0.0f64; xs.len()];
    for s in 0..n {
        let mean: Vec<f64> = (0..c)
            .map(|ch| {
                xs[(s * c + ch) * h * w..][..h * w]
                    .iter()
                    .map(|&v| v as f64)
                    .sum::<f64>()
                    / (h * w) as f64
            })
            .collect();
        let hidden: Vec<f64> = (0..latent)
            .map(|j| {
                (0..c)
                    .map(|i| mean[i] * w1[i * latent + j] as f64)
                    .sum::<f64>()
                    .max(0.0)
            })
            .collect();
        for ch in 0..c {
            let z: f64 = (0..latent).map(|j| hidden[j] * w2[j * c + ch] as f64).sum();
            let scale = 1.0 / (1.0 + (-z).exp());
            for k in 0..h * w {
                let i = (s * c + ch) * h * w + k;
                want[i] = xs[i] as f64 * scale;
            }
        }
    }
    assert_close_f64(
        &values(se.forward(x.clone(), false)),
        &want,
        "channels-first",
    );
    let nhwc = se
        .forward(nchw_to_nhwc(x.clone()), true)
        .permute([0, 3, 1, 2]);
    assert_close_f64(&values(nhwc), &want, "channels-last");

    // After a convolution: the block rescales its output, then the ReLU.
    let mut conv = Conv2d::<B>::new(
        &Conv2dConfig::new([2, c], [3, 3]).with_padding(PaddingConfig2d::Same),
        &device,
    );
    let input = random::<B, 4>([n, 2, h, w], 42);
    let pre = conv.forward(input.clone(), false, false);
    conv.excite = Some(se.clone());
    let want = burn::tensor::activation::relu(se.forward(pre, false));
    for nhwc in [false, true] {
        let x = if nhwc {
            nchw_to_nhwc(input.clone())
        } else {
            input.clone()
        };
        let got = conv.forward(x, nhwc, true);
        let got = if nhwc { got.permute([0, 3, 1, 2]) } else { got };
        assert_close(&values(got), &values(want.clone()), "conv, block, relu");
    }
}

/// Squeeze-and-excitation surgery on the ResNet: blocks where Composer's rule puts them,
/// with the parameters they add, the same on a second build from the same seed, and a
/// forward and backward pass through them.
#[test]
fn squeeze_excite_surgery_adds_blocks_after_the_wide_convolutions() {
    use flashover_surgery::SurgicalExt;
    let device = Default::default();
    let mut model: ResNet<AB> = ResNetConfig::cifar(8, 4).unwrap().init(&device, 5);
    let before = model.num_params();
    // Widths 4, 8, 16: blocks after convolutions with at least 8 channels in and out.
    let added = model.add_squeeze_excite(
        &mut |conv| (conv.in_channels.min(conv.out_channels) >= 8).then_some(2),
        77,
    );
    assert_eq!(
        added,
        [
            "blocks.1.conv2",
            "blocks.2.conv1",
            "blocks.2.conv2",
            "blocks.2.shortcut.conv"
        ]
    );
    let extra = 2 * (8 * 2) + 2 * (16 * 2) * 3;
    assert_eq!(model.num_params(), before + extra);
    let again = model.add_squeeze_excite(&mut |_| Some(2), 77);
    assert_eq!(
        again,
        [
            "stem",
            "blocks.0.conv1",
            "blocks.0.conv2",
            "blocks.1.conv1",
            "blocks.1.shortcut.conv"
        ],
        "a convolution with a block keeps it"
    );
    let mut twin: ResNet<AB> = ResNetConfig::cifar(8, 4).unwrap().init(&device, 5);
    twin.add_squeeze_excite(
        &mut |conv| (conv.in_channels.min(conv.out_channels) >= 8).then_some(2),
        77,
    );
    let w = |m: &ResNet<AB>| {
        values(
            m.blocks[2]
                .conv1
                .excite
                .as_ref()
                .unwrap()
                .expand
                .weight
                .val(),
        )
    };
    assert_eq!(w(&twin), w(&model));
    let x = random::<AB, 4>([2, 1, 12, 12], 3);
    let loss = model.logits(x).sum();
    let grads = loss.backward();
    let se = model.blocks[2].conv1.excite.as_ref().unwrap();
    let g = se.reduce.weight.grad(&grads).expect("the block is trained");
    assert!(values(g).iter().any(|v| *v != 0.0));
}

/// Gyro dropout's masking: sample `i` of `n` uses mask row `i * rows / n`, kept features
/// scaled by `1 / (1 - p)`; evaluation and a training pass without masks leave the input
/// alone.
#[test]
fn gyro_dropout_masks_parts_of_the_batch_and_scales_the_kept_features() {
    use flashover_models::layers::gyro_dropout;
    use flashover_surgery::GyroMasks;
    let x = random::<B, 2>([5, 3], 51);
    let xs = values(x.clone());
    // Two rows: samples 0-2 use row 0 (5 * 0 / 2 .. ), samples 3-4 row 1.
    let keep = vec![true, false, true, false, true, true];
    let masks = GyroMasks {
        p: 0.2,
        keep: Some((2, keep.clone())),
    };
    let got = values(gyro_dropout(x.clone(), &masks));
    for i in 0..5 {
        let row = i * 2 / 5;
        for f in 0..3 {
            let want = if keep[row * 3 + f] {
                xs[i * 3 + f] / 0.8
            } else {
                0.0
            };
            assert!(
                (got[i * 3 + f] - want).abs() < 1e-6,
                "sample {i} feature {f}"
            );
        }
    }
    let none = GyroMasks { p: 0.2, keep: None };
    assert_eq!(values(gyro_dropout(x, &none)), xs);
    // Through the ResNet head: only training passes are masked.
    use flashover_surgery::{DropoutVariant, SurgicalExt};
    let device = Default::default();
    let mut model: ResNet<AB> = ResNetConfig::cifar(8, 4).unwrap().init(&device, 5);
    let mut sites = Vec::new();
    model.for_each_dropout(&mut |info, variant: &mut DropoutVariant| {
        sites.push((info.path.clone(), info.features));
        variant.gyro = Some(GyroMasks {
            p: 0.5,
            keep: Some((1, vec![false; info.features])),
        });
    });
    assert_eq!(sites, [("head".to_string(), 16)]);
    let images = random::<AB, 4>([2, 1, 8, 8], 4);
    let logits = values(model.logits(images.clone()));
    let bias = values(model.head.bias.as_ref().unwrap().val());
    assert_close(
        &logits[..10],
        &bias,
        "every feature dropped: the bias alone",
    );
    let eval = values(model.valid().logits(images.inner()));
    assert!(eval[..10] != bias[..], "evaluation drops nothing");
}

/// Factorize on a layer: the factors multiply to the truncated SVD of the weights (at full
/// rank, the weights themselves), the factored layer computes what a plain layer with that
/// product computes in both layouts, the weight is emptied under its id, and the factors
/// train.
#[test]
fn factored_layers_are_their_truncated_svd_and_train() {
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::{LinearConfig, PaddingConfig2d};
    use flashover_models::layers::{Conv2d, Linear};
    let device = Default::default();
    let config = Conv2dConfig::new([3, 5], [3, 3])
        .with_stride([2, 1])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1));
    let plain = Conv2d::<AB>::new(&config, &device);
    let x = random::<AB, 4>([2, 3, 7, 6], 61);
    let want = values(plain.forward(x.clone(), false, true));
    // Full rank: min(5, 27) = 5 reproduces the layer.
    let mut full = plain.clone();
    full.factorize(5);
    assert_eq!(full.weight.dims(), [0, 3, 3, 3]);
    assert_eq!(full.weight.id, plain.weight.id, "the weight keeps its id");
    assert_eq!(full.weight_dims(), [5, 3, 3, 3]);
    for nhwc in [false, true] {
        let input = if nhwc {
            nchw_to_nhwc(x.clone())
        } else {
            x.clone()
        };
        let got = full.forward(input, nhwc, true);
        let got = if nhwc { got.permute([0, 3, 1, 2]) } else { got };
        assert_close(&values(got), &want, "full rank reproduces the layer");
    }
    // Rank 2: the product of the factors is the rank-2 truncation, and the layer computes
    // the convolution with it.
    let mut low = plain.clone();
    low.factorize(2);
    assert_eq!(low.macs_per_position(), 2 * 27 + 5 * 2);
    let product = low.effective_weight();
    let w = values(plain.weight.val());
    let (p, q) = flashover_models::lowrank::truncated_svd(&w, 5, 27, 2);
    let mut truncation = vec![0.0f32; 5 * 27];
    for r in 0..5 {
        for c in 0..27 {
            truncation[r * 27 + c] = (0..2).map(|k| p[r * 2 + k] * q[k * 27 + c]).sum();
        }
    }
    assert_close(
        &values(product.clone()),
        &truncation,
        "the factors' product",
    );
    let mut with_product = plain.clone();
    with_product.weight = burn::module::Param::from_tensor(product.detach());
    let want_low = values(with_product.forward(x.clone(), false, false));
    for nhwc in [false, true] {
        let input = if nhwc {
            nchw_to_nhwc(x.clone())
        } else {
            x.clone()
        };
        let got = low.forward(input, nhwc, false);
        let got = if nhwc { got.permute([0, 3, 1, 2]) } else { got };
        assert_close(&values(got), &want_low, "rank 2");
    }
    let grads = low.forward(nchw_to_nhwc(x), true, true).sum().backward();
    let f = low.factors.as_ref().unwrap();
    assert!(f.first.grad(&grads).is_some() && f.second.grad(&grads).is_some());

    // A dense layer: full rank reproduces it, rank 3 computes x P Q + b.
    let dense = Linear::<AB>::new(&LinearConfig::new(6, 4), &device);
    let x = random::<AB, 2>([3, 6], 62);
    let want = values(dense.forward(x.clone(), false, false));
    let mut full = dense.clone();
    full.factorize(4);
    assert_eq!(full.weight.dims(), [0, 0]);
    assert_eq!(full.dims(), [6, 4]);
    for fast in [false, true] {
        assert_close(
            &values(full.forward(x.clone(), fast, false)),
            &want,
            "dense, full rank",
        );
    }
    let mut low = dense.clone();
    low.factorize(3);
    assert_eq!(low.macs(), 6 * 3 + 3 * 4);
    let f = low.factors.as_ref().unwrap();
    let by_hand = x
        .clone()
        .matmul(f.first.val())
        .matmul(f.second.val())
        .add(dense.bias.as_ref().unwrap().val().unsqueeze());
    assert_close(
        &values(low.forward(x, true, false)),
        &values(by_hand),
        "dense, rank 3",
    );
}

/// Group norm by hand: each sample's group of channels normalised over the group and the
/// image with its biased variance, then scaled and shifted per channel, in both layouts; in
/// a half type (LowPrecisionGroupNorm's variant) the result is the same to that type's
/// precision, comes back in float32, and gradients flow through the casts.
#[test]
fn group_norm_is_the_papers_formula_in_both_layouts_and_in_half_precision() {
    use flashover_models::norm::GroupNorm;
    use flashover_surgery::HalfType;
    let device = Default::default();
    let (n, c, h, w, g) = (2usize, 6usize, 3usize, 2usize, 3usize);
    let mut norm = GroupNorm::<AB>::new(g, c, &device).unwrap();
    assert!(
        GroupNorm::<AB>::new(4, c, &device).is_err()
            && GroupNorm::<AB>::new(0, c, &device).is_err()
    );
    norm.gamma = burn::module::Param::from_tensor(random::<AB, 1>([c], 71).add_scalar(1.0));
    norm.beta = burn::module::Param::from_tensor(random::<AB, 1>([c], 72));
    let (gamma, beta) = (values(norm.gamma.val()), values(norm.beta.val()));
    let x = random::<AB, 4>([n, c, h, w], 73)
        .mul_scalar(3.0)
        .add_scalar(0.5);
    let xs = values(x.clone());
    let per = c / g;
    let mut want = vec![0.0f64; xs.len()];
    for s in 0..n {
        for grp in 0..g {
            let idx: Vec<usize> = (grp * per..(grp + 1) * per)
                .flat_map(|ch| (0..h * w).map(move |k| (s * c + ch) * h * w + k))
                .collect();
            let mean = idx.iter().map(|&i| xs[i] as f64).sum::<f64>() / idx.len() as f64;
            let var = idx
                .iter()
                .map(|&i| (xs[i] as f64 - mean).powi(2))
                .sum::<f64>()
                / idx.len() as f64;
            for &i in &idx {
                let ch = (i / (h * w)) % c;
                want[i] = (xs[i] as f64 - mean) / (var + 1e-5).sqrt() * gamma[ch] as f64
                    + beta[ch] as f64;
            }
        }
    }
    assert_close_f64(
        &values(norm.forward(x.clone(), false)),
        &want,
        "channels-first",
    );
    let last = norm
        .forward(nchw_to_nhwc(x.clone()), true)
        .permute([0, 3, 1, 2]);
    assert_close_f64(&values(last), &want, "channels-last");
    for (half, tol) in [(HalfType::F16, 1e-2), (HalfType::BF16, 6e-2)] {
        let mut low = norm.clone();
        low.variant.low_precision = Some(half);
        let y = low.forward(x.clone(), false);
        assert_eq!(y.dtype(), x.dtype(), "cast back to the activations' type");
        let got = values(y.clone());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < tol, "{half:?}: worst difference {worst}");
        assert!(worst > 1e-6, "{half:?}: computed in float32 after all");
        let grads = y.sum().backward();
        assert!(
            low.gamma.grad(&grads).is_some(),
            "{half:?}: gradient through the casts"
        );
    }
}
