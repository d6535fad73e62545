//! Model surgery across the crates: the surgery algorithms change the layers their
//! definitions name (on the ResNets and the CNN), in code and by name; a surgery needing
//! layers the model lacks is an error naming them; every surgery resumes bit-exactly in a new
//! process; a checkpoint shaped by other surgery (or none) is refused with both descriptions.

use crate::support::*;
use flashover::algorithms::blurpool::{apply_blurpool, BlurPoolOptions};
use flashover::algorithms::ghost_batchnorm::apply_ghost_batchnorm;
use flashover::algorithms::spec::parse_list;
use flashover::models::{MnistCnn, ResNetConfig};
use flashover::surgery::{LayerMut, SurgicalExt};
use flashover_examples::MnistModel;

/// The suite's training backend (flex by default; the GPU backends' builds compile this too).
type AB = TB;

#[test]
fn blurpool_blurs_the_strided_convolutions_with_enough_channels_and_every_max_pool() {
    let device = Default::default();
    let mut r20 = ResNetConfig::cifar(20, 16).unwrap().init::<AB>(&device, 1);
    let record = apply_blurpool(&mut r20, &BlurPoolOptions::default());
    // Stage 2 starts at block 3 (16 -> 32 channels), stage 3 at block 6 (32 -> 64); each
    // first block's 3x3 convolution and its 1x1 projection have stride 2.
    assert_eq!(
        record.layers,
        [
            "blocks.3.conv1",
            "blocks.3.shortcut.conv",
            "blocks.6.conv1",
            "blocks.6.shortcut.conv"
        ]
    );
    assert_eq!(
        record.settings,
        "blurpool:replace_convs=true:replace_maxpools=true:blur_first=true:min_channels=16"
    );
    let mut r20 = ResNetConfig::cifar(20, 16).unwrap().init::<AB>(&device, 1);
    let options = BlurPoolOptions {
        min_channels: 32,
        ..Default::default()
    };
    assert_eq!(
        apply_blurpool(&mut r20, &options).layers,
        ["blocks.6.conv1", "blocks.6.shortcut.conv"]
    );
    // The CNN's convolutions have stride 1: only its (shared) max pool changes.
    let mut cnn = MnistCnn::<AB>::new(&device, 1);
    assert_eq!(
        apply_blurpool(&mut cnn, &BlurPoolOptions::default()).layers,
        ["pool"]
    );
    let options = BlurPoolOptions {
        replace_maxpools: false,
        ..Default::default()
    };
    assert!(apply_blurpool(&mut cnn, &options).layers.is_empty());
}

/// `model` once `algorithms` (the `--algorithms` syntax, built by name as the example builds
/// them) ran at `INIT` of a run of `max_duration` on the bundled digits, or the error the
/// build ended with.
fn built<M: MnistModel<AB>>(model: M, algorithms: &str, max_duration: &str) -> Result<M, String> {
    let mut run = short_run(128, 32, 100, max_duration);
    run.algorithms = parse_list(algorithms).map_err(|e| e.to_string())?;
    let optimizer = burn::optim::AdamWConfig::new().init::<AB, M>();
    let builder = run
        .builder_with(model, optimizer, &device())
        .map_err(|e| e.to_string())?;
    let trainer = builder.build().map_err(|e| e.to_string())?;
    Ok(trainer.into_model())
}

/// The paths of `model`'s layers for which `changed` says yes.
fn changed<M: SurgicalExt>(model: &mut M, changed: impl Fn(&LayerMut<'_>) -> bool) -> Vec<String> {
    let mut paths = Vec::new();
    model.visit(&mut |path, layer| {
        if changed(&layer) {
            paths.push(path.to_string());
        }
    });
    paths
}

#[test]
fn ghost_batchnorm_reaches_every_batch_norm_and_needs_some() {
    let device = Default::default();
    let mut r20 = ResNetConfig::cifar(20, 16).unwrap().init::<AB>(&device, 1);
    let record = apply_ghost_batchnorm(&mut r20, 16).unwrap();
    // The stem's, two per block, one per projection: 1 + 2 * 9 + 2.
    assert_eq!(record.layers.len(), 21);
    assert_eq!(
        record.layers[..3],
        ["stem_norm", "blocks.0.norm1", "blocks.0.norm2"]
    );
    assert!(apply_ghost_batchnorm(&mut r20, 0).is_err());
    // On a model without batch norms: an error at INIT naming what is missing.
    let cnn = MnistCnn::<AB>::new(&device, 1);
    let err = built(cnn, "ghost_batchnorm:ghost_batch_size=16", "2ba").unwrap_err();
    assert!(
        err.contains("ghost_batchnorm needs a model with surgery-ready batch norms"),
        "{err}"
    );
}

#[test]
fn the_example_refuses_a_surgery_its_model_cannot_take() {
    let out = run_mnist(&short_args(&["--algorithms", "ghost_batchnorm"]));
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("ghost_batchnorm needs a model with surgery-ready batch norms"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&[
        "--model",
        "resnet8",
        "--algorithms",
        "ghost_batchnorm:ghost_batch_size=0",
    ]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("ghost_batch_size") && out.stderr.contains(">= 1"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&[
        "--model",
        "resnet8",
        "--algorithms",
        "stochastic_depth:stochastic_method=layer",
    ]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("layer") && out.stderr.contains("block or sample"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&["--algorithms", "stochastic_depth"]));
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("stochastic_depth needs a model with surgery-ready residual blocks"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&["--model", "resnet9"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("resnet9") && out.stderr.contains("resnet20"),
        "{}",
        out.stderr
    );
}

/// The tiny ResNet of these tests, on a short run.
fn resnet(algorithms: &str) -> Vec<&str> {
    vec![
        "--model",
        "resnet8",
        "--algorithms",
        algorithms,
        "--max-duration",
        "2ep",
    ]
}

#[test]
fn each_surgery_resumes_exactly_and_changes_the_result() {
    let plain = summary_of(&short_args(&[
        "--model",
        "resnet8",
        "--max-duration",
        "2ep",
    ]));
    for algorithms in [
        "blurpool",
        "blurpool:blur_first=false",
        "ghost_batchnorm:ghost_batch_size=8",
        "stochastic_depth:drop_rate=0.5",
        "stochastic_depth:stochastic_method=sample:drop_warmup=0.3",
        "squeeze_excite:min_channels=32:latent_channels=8",
        "gyro_dropout:sigma=16:tau=4",
        "factorize:min_channels=32:latent_channels=8",
        // Selective backprop scores whole batches in training mode outside the step: never
        // with a stale draw (of another batch size), the same in a resumed run.
        "selective_backprop:start=0:end=1:interrupt=3,stochastic_depth:stochastic_method=sample",
    ] {
        let changed = summary_of(&short_args(&resnet(algorithms)));
        assert_ne!(
            changed["params_sha256"], plain["params_sha256"],
            "{algorithms} changed nothing"
        );
        crate::resume::resumed(
            &resnet(algorithms),
            &["--stop-after", "13ba"],
            crate::resume::autoresume,
        );
    }
}

#[test]
fn a_checkpoint_of_other_surgery_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().to_str().unwrap();
    let mut first = short_args(&resnet("blurpool"));
    first.extend(["--save-folder", folder, "--stop-after", "6ba"]);
    summary_of(&first);
    let resume = |algorithms: &str| {
        let mut a = short_args(&resnet(algorithms));
        a.extend(["--save-folder", folder, "--autoresume"]);
        run_mnist(&a)
    };
    // Other settings of the same surgery.
    let out = resume("blurpool:min_channels=64");
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("changed by blurpool")
            && out.stderr.contains("min_channels=16 on [blocks.1.conv1")
            && out.stderr.contains("min_channels=64 on []"),
        "{}",
        out.stderr
    );
    // A surgery the checkpoint's model did not have.
    let out = resume("blurpool,ghost_batchnorm");
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("no state for algorithm/ghost_batchnorm"),
        "{}",
        out.stderr
    );
    // Without the checkpoint's surgery.
    let mut a = short_args(&["--model", "resnet8", "--max-duration", "2ep"]);
    a.extend(["--save-folder", folder, "--autoresume"]);
    let out = run_mnist(&a);
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("algorithm/blurpool")
            && out
                .stderr
                .contains("only algorithms and callbacks that this run registers"),
        "{}",
        out.stderr
    );
    // The checkpoint itself is untouched: the right run still resumes it.
    summary_of(&{
        let mut a = short_args(&resnet("blurpool"));
        a.extend(["--save-folder", folder, "--autoresume"]);
        a
    });
}

#[test]
fn weight_standardization_reaches_all_convolutions_but_the_last_ones() {
    use flashover::algorithms::weight_standardization::apply_weight_standardization;
    let device = Default::default();
    let mut r8 = ResNetConfig::cifar(8, 16).unwrap().init::<AB>(&device, 1);
    let all = apply_weight_standardization(&mut r8, 0).layers;
    // The stem, two per block, and the two projections, in module order.
    assert_eq!(all.len(), 1 + 2 * 3 + 2);
    let mut r8 = ResNetConfig::cifar(8, 16).unwrap().init::<AB>(&device, 1);
    let some = apply_weight_standardization(&mut r8, 2).layers;
    assert_eq!(some, all[..all.len() - 2]);
    let mut cnn = MnistCnn::<AB>::new(&device, 1);
    assert_eq!(
        apply_weight_standardization(&mut cnn, 5).layers,
        Vec::<String>::new()
    );
    assert_eq!(apply_weight_standardization(&mut cnn, 1).layers, ["conv1"]);
}

#[test]
fn squeeze_excite_and_gyro_dropout_reach_their_layers_in_code_and_by_name() {
    use flashover::algorithms::gyro_dropout::{Gyro, GyroDropoutOptions};
    use flashover::algorithms::squeeze_excite::{apply_squeeze_excite, SqueezeExciteOptions};
    let device = Default::default();
    // ResNet-20 at widths 16, 32, 64: Composer's defaults (min 128) reach nothing; at 64,
    // every convolution of the last stage but the first block's 3x3 (32 in) and projection.
    let mut r20 = ResNetConfig::cifar(20, 16).unwrap().init::<AB>(&device, 1);
    let none = apply_squeeze_excite(&mut r20, &SqueezeExciteOptions::default(), 1);
    assert!(none.layers.is_empty());
    let options = SqueezeExciteOptions::new(0.25, 64).unwrap();
    let record = apply_squeeze_excite(&mut r20, &options, 1);
    assert_eq!(
        record.layers,
        [
            "blocks.6.conv2",
            "blocks.7.conv1",
            "blocks.7.conv2",
            "blocks.8.conv1",
            "blocks.8.conv2"
        ]
    );
    assert_eq!(
        record.settings,
        "squeeze_excite:latent_channels=0.25:min_channels=64"
    );
    let hidden = r20.blocks[7]
        .conv1
        .excite
        .as_ref()
        .unwrap()
        .reduce
        .weight
        .dims();
    assert_eq!(hidden, [64, 16], "a quarter of 64 channels");
    // By name: the same layers.
    let r20b = ResNetConfig::cifar(20, 16).unwrap().init::<AB>(&device, 1);
    let mut r20b = built(
        r20b,
        "squeeze_excite:latent_channels=0.25:min_channels=64",
        "2ba",
    )
    .unwrap();
    let by_name = changed(
        &mut r20b,
        |l| matches!(l, LayerMut::Conv(c) if c.has_squeeze_excite()),
    );
    assert_eq!(by_name, record.layers);
    // Gyro dropout reaches the classifier's input of either model.
    let mut cnn = MnistCnn::<AB>::new(&device, 1);
    let (g, record) = Gyro::apply(&mut cnn, GyroDropoutOptions::default(), 1, 500);
    assert_eq!(record.layers, ["fc2"]);
    assert_eq!(g.period(), 16, "floor(500 / 256) * 16");
    let r20 = ResNetConfig::cifar(20, 16).unwrap().init::<AB>(&device, 1);
    let mut r20 = built(r20, "gyro_dropout", "2ba").unwrap();
    let mut sites = Vec::new();
    r20.for_each_dropout(&mut |info, variant| {
        if variant.gyro.is_some() {
            sites.push(info.path.clone());
        }
    });
    assert_eq!(sites, ["head"]);
    // A run whose length is not in batches has no schedule to pick masks on.
    let cnn = MnistCnn::<AB>::new(&device, 1);
    let err = built(cnn, "gyro_dropout", "1000tok").unwrap_err();
    assert!(
        err.contains("max_duration") && err.contains("1000tok"),
        "{err}"
    );
    // Bad settings by name are named.
    let out = run_mnist(&short_args(&["--algorithms", "gyro_dropout:p=1"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("`p`") && out.stderr.contains("[0, 1)"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&[
        "--algorithms",
        "squeeze_excite:latent_channels=2.5",
    ]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("latent_channels") && out.stderr.contains("2.5"),
        "{}",
        out.stderr
    );
}

#[test]
fn factorize_reaches_the_wide_layers_and_cuts_the_flops() {
    use flashover::algorithms::factorize::{apply_factorize, FactorizeOptions};
    use flashover::core::model::TrainModel;
    let device = Default::default();
    let mut cnn = MnistCnn::<AB>::new(&device, 1);
    let before = cnn.flops_per_sample().unwrap();
    // Composer's defaults (256 wide) reach nothing here.
    let (none, _) = apply_factorize(&mut cnn, &FactorizeOptions::default());
    assert!(none.layers.is_empty());
    let options = FactorizeOptions {
        min_channels: 16,
        latent_channels: 4.0,
        min_features: 64,
        latent_features: 16.0,
        ..Default::default()
    };
    let (record, report) = apply_factorize(&mut cnn, &options);
    // conv1 has one input channel; fc2 ten outputs.
    assert_eq!(record.layers, ["conv2", "fc1"]);
    assert_eq!(
        report.layers,
        [
            ("conv2".to_string(), 4, 16 * 9 * 32, 4 * 16 * 9 + 32 * 4),
            ("fc1".to_string(), 16, 1568 * 128, 16 * 1568 + 128 * 16),
        ]
    );
    let after = cnn.flops_per_sample().unwrap();
    let saved = 3.0
        * 2.0
        * ((16 * 9 * 32 - (4 * 16 * 9 + 32 * 4)) as f64 * 196.0
            + (1568 * 128 - (16 * 1568 + 128 * 16)) as f64);
    assert!(
        (before - after - saved).abs() < 1.0,
        "{before} - {after} vs {saved}"
    );
    // A second pass leaves factored layers alone.
    assert!(apply_factorize(&mut cnn, &options).0.layers.is_empty());
    // By name on a ResNet: the 3x3 convolutions 32 wide or more.
    let r8 = ResNetConfig::cifar(8, 16).unwrap().init::<AB>(&device, 1);
    let mut r8 = built(r8, "factorize:min_channels=32:latent_channels=8", "2ba").unwrap();
    assert_eq!(
        changed(
            &mut r8,
            |l| matches!(l, LayerMut::Conv(c) if c.is_factored())
        ),
        [
            "blocks.1.conv2",
            "blocks.2.conv1",
            "blocks.2.conv2",
            "blocks.2.shortcut.conv"
        ],
    );
    let out = run_mnist(&short_args(&[
        "--algorithms",
        "factorize:latent_features=0",
    ]));
    assert!(!out.status.success());
    assert!(out.stderr.contains("latent_features"), "{}", out.stderr);
}

#[test]
fn low_precision_groupnorm_is_refused_on_a_backend_without_a_fast_half_type() {
    use flashover::algorithms::low_precision_groupnorm::accelerated_half;
    let device = Default::default();
    if accelerated_half::<AB>(&device).is_some() {
        // A GPU backend with half precision: the refusal below does not apply.
        return;
    }
    let out = run_mnist(&short_args(&["--algorithms", "low_precision_groupnorm"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("low_precision_groupnorm")
            && out.stderr.contains("float32")
            && !out.stderr.contains("panicked"),
        "{}",
        out.stderr
    );
    // On a model without group norms, where the backend has no half type: the backend is
    // named first (it is the reason nothing could change).
    let r8 = ResNetConfig::cifar(8, 4).unwrap().init::<AB>(&device, 1);
    let err = built(r8, "low_precision_groupnorm", "2ba").unwrap_err();
    assert!(err.contains("backend") && err.contains("float32"), "{err}");
}

/// A model of the user's own, built from Flashover's layers: it takes every image surgery by
/// implementing the one trait, `Surgical`, and nothing else of surgery.
mod user_model {
    use burn::module::Module;
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::{BatchNormConfig, LinearConfig, PaddingConfig2d};
    use burn::tensor::activation::relu;
    use burn::tensor::backend::Backend;
    use burn::tensor::Tensor;
    use flashover::core::loss::classification_loss;
    use flashover::core::model::{
        ClassificationBatch, ClassificationOutput, EvalModel, TrainModel,
    };
    use flashover::models::layers::{Conv2d, Linear, MaxPool2d};
    use flashover::models::norm::BatchNorm;
    use flashover::models::{ChannelsLastBackend, TrainBackend};
    use flashover::surgery::{Layers, Surgical};

    /// conv (1 -> 16) - batch norm - strided conv (16 -> 32) - max pool - global average -
    /// dense head.
    #[derive(Module, Debug)]
    pub struct TinyNet<B: Backend> {
        conv: Conv2d<B>,
        norm: BatchNorm<B>,
        down: Conv2d<B>,
        pool: MaxPool2d,
        head: Linear<B>,
    }

    impl<B: Backend> TinyNet<B> {
        pub fn new(device: &B::Device) -> Self {
            let conv = |i, o, s| {
                Conv2d::new(
                    &Conv2dConfig::new([i, o], [3, 3])
                        .with_stride([s, s])
                        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
                    device,
                )
            };
            Self {
                conv: conv(1, 16, 1),
                norm: BatchNorm::new(&BatchNormConfig::new(16), device),
                down: conv(16, 32, 2),
                pool: MaxPool2d::new([2, 2], [2, 2]),
                head: Linear::new(&LinearConfig::new(32, 10), device),
            }
        }
    }

    impl<B: ChannelsLastBackend> TinyNet<B> {
        fn logits(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
            let x = relu(self.norm.forward(self.conv.forward(x, false, false), false));
            let x = self.pool.forward(self.down.forward(x, false, true), false);
            let [n, c, h, w] = x.dims();
            let x = x.reshape([n, c, h * w]).mean_dim(2).reshape([n, c]);
            self.head.forward(x, false, false)
        }
    }

    /// All the surgery this model has: its layers, with their paths, in module order.
    impl<B: Backend> Surgical for TinyNet<B> {
        fn visit_layers(&mut self, layers: &mut Layers<'_>) {
            layers.conv("conv", &mut self.conv);
            layers.batch_norm("norm", &mut self.norm);
            layers.conv("down", &mut self.down);
            layers.max_pool("pool", &mut self.pool);
            layers.dropout_site("head", &mut self.head);
            layers.linear("head", &mut self.head);
        }
    }

    impl<B: TrainBackend> TrainModel<B> for TinyNet<B> {
        type Batch = ClassificationBatch<B, 4>;
        type Output = Tensor<B, 2>;

        fn forward(&self, batch: &Self::Batch) -> Tensor<B, 2> {
            self.logits(batch.inputs.clone())
        }

        fn loss(&self, logits: &Tensor<B, 2>, batch: &Self::Batch) -> Tensor<B, 1> {
            classification_loss(logits.clone(), batch)
        }
    }

    impl<B: ChannelsLastBackend> EvalModel<B> for TinyNet<B> {
        type Batch = ClassificationBatch<B, 4>;
        type Output = ClassificationOutput<B>;

        fn forward_eval(&self, batch: &Self::Batch) -> ClassificationOutput<B> {
            ClassificationOutput::scored(self.logits(batch.inputs.clone()), batch.targets.clone())
        }
    }
}

#[test]
fn a_users_model_built_from_flashovers_layers_takes_the_surgeries_through_one_trait() {
    use flashover::algorithms::blurpool::BlurPool;
    use flashover::algorithms::factorize::{Factorize, FactorizeOptions};
    use flashover::algorithms::ghost_batchnorm::GhostBatchNorm;
    use flashover::algorithms::gyro_dropout::GyroDropout;
    use flashover::algorithms::squeeze_excite::{SqueezeExcite, SqueezeExciteOptions};
    use flashover::algorithms::weight_standardization::WeightStandardization;
    use flashover::core::callback::Algorithm;
    use flashover::core::params::params_sha256;
    use flashover::core::time::Time;
    use flashover::core::trainer::Trainer;
    use flashover_examples::mnist_loaders;
    use user_model::TinyNet;

    let run = short_run(128, 32, 100, "4ba");
    let train = |algorithms: Vec<Box<dyn Algorithm<_>>>| {
        let (loader, _) = mnist_loaders::<AB>(&run.data, &device()).unwrap();
        let model = TinyNet::<AB>::new(&device());
        let optimizer = burn::optim::AdamWConfig::new().init::<AB, TinyNet<AB>>();
        let mut builder =
            Trainer::builder(model, optimizer, loader, Time::Batch(4), device()).seed(3);
        for a in algorithms {
            builder = builder.boxed_algorithm(a);
        }
        let mut trainer = builder.build().map_err(|e| e.to_string())?;
        trainer.fit().map_err(|e| e.to_string())?;
        Ok::<_, String>(trainer.into_model())
    };
    let plain = train(Vec::new()).unwrap();
    let mut model = train(vec![
        Box::new(BlurPool::default()),
        Box::new(GhostBatchNorm::new(8).unwrap()),
        Box::new(WeightStandardization::new(1)),
        Box::new(SqueezeExcite::new(
            SqueezeExciteOptions::new(0.25, 16).unwrap(),
        )),
        Box::new(GyroDropout::default()),
        Box::new(
            Factorize::new(FactorizeOptions {
                min_channels: 16,
                latent_channels: 4.0,
                factorize_linears: false,
                ..Default::default()
            })
            .unwrap(),
        ),
    ])
    .unwrap();
    let mut conv_settings = Vec::new();
    model.for_each_conv(&mut |info, v| conv_settings.push((info.path.clone(), *v)));
    use flashover::surgery::{Blur, ConvVariant};
    assert_eq!(
        conv_settings,
        [
            // Weight standardization leaves the last convolution alone; BlurPool blurs the
            // strided one with 16 input channels.
            (
                "conv".to_string(),
                ConvVariant {
                    blur: None,
                    standardize: true
                }
            ),
            (
                "down".to_string(),
                ConvVariant {
                    blur: Some(Blur::First),
                    standardize: false
                }
            ),
        ]
    );
    let mut norms = Vec::new();
    model.for_each_batch_norm(&mut |info, v| norms.push((info.path.clone(), v.ghost_batch_size)));
    assert_eq!(norms, [("norm".to_string(), Some(8))]);
    let mut pools = Vec::new();
    model.for_each_max_pool(&mut |info, v| pools.push((info.path.clone(), v.blur)));
    assert_eq!(pools, [("pool".to_string(), true)]);
    let mut sites = Vec::new();
    model.for_each_dropout(&mut |info, v| {
        sites.push((info.path.clone(), info.features, v.gyro.is_some()))
    });
    assert_eq!(sites, [("head".to_string(), 32, true)]);
    assert_eq!(
        changed(
            &mut model,
            |l| matches!(l, LayerMut::Conv(c) if c.has_squeeze_excite())
        ),
        ["down"],
        "SqueezeExcite's rule: 16 channels in and out or more"
    );
    assert_eq!(
        changed(
            &mut model,
            |l| matches!(l, LayerMut::Conv(c) if c.is_factored())
        ),
        ["down"],
        "Factorize's rule: a 16-wide input at rank 4"
    );
    assert_ne!(params_sha256(&model), params_sha256(&plain));
    // A surgery whose layers the model does not have is refused at INIT, naming them.
    let err = train(vec![Box::new(
        flashover::algorithms::stochastic_depth::StochasticDepth::default(),
    )])
    .unwrap_err();
    assert!(
        err.contains("stochastic_depth needs a model with surgery-ready residual blocks"),
        "{err}"
    );
}
