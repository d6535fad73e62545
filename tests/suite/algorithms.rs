//! The speed-up algorithms through the trainer on the real MNIST CNN: each one alone and each
//! recipe trains, changes what it should, and resumes exactly; target rewriters compose in a
//! defined order; bad lists are typed errors; sequence-length warmup trains a character model
//! on the bundled Shakespeare text.

use crate::support::*;
use flashover::algorithms::label_smoothing::smooth_labels;
use flashover::algorithms::mixup::{mix, mixing_coefficient};
use flashover::algorithms::recipes::RECIPES;
use flashover::algorithms::spec::parse_list;
use flashover::core::error::CoreError;
use flashover::core::event::Event;
use flashover::core::model::ClassTargets;
use flashover::core::params::params_sha256;
use flashover::core::time::Time;
use flashover_examples::MnistRun;

/// Every algorithm the `--algorithms` list knows, with settings that make it act within a
/// short run (12 to 48 batches).
pub const ACTIVE: &[&str] = &[
    "label_smoothing",
    "mixup",
    "cutmix",
    "cutout",
    "colout",
    "progressive_resizing:delay_fraction=0:finetune_fraction=0.2",
    "randaugment",
    "augmix",
    "selective_backprop:start=0:end=1:interrupt=3",
    "gradient_clipping:clipping_type=norm:clipping_threshold=0.5",
    "ema:half_life=5ba",
    "swa:swa_start=0.3:update_interval=4ba:schedule_swa_lr=true:swa_lr=0.001",
    "sam:interval=2",
    "layer_freezing:freeze_start=0",
    "channels_last",
    "blurpool",
    "weight_standardization",
    "squeeze_excite:min_channels=16:latent_channels=0.25",
    "gyro_dropout:sigma=8:tau=4",
    "factorize:min_channels=16:latent_channels=4:min_features=64:latent_features=16",
];

/// The algorithms the CNN cannot take (it has no batch norm and no residual block);
/// `surgery.rs` trains and resumes them on a ResNet.
pub const NEED_RESNET: &[&str] = &["ghost_batchnorm", "stochastic_depth"];

/// The algorithms that need a backend with an accelerated half type (not flex) and a model
/// with group norms; `surgery.rs` checks the refusal and the layer's half-precision path.
pub const NEED_HALF: &[&str] = &["low_precision_groupnorm"];

/// The algorithms for language models, which the CNN cannot take (they change attention,
/// MLPs, layer norms or token sequences); `language.rs` trains and resumes them on the GPT
/// (and checks low-precision layer norm's refusal on flex).
pub const FOR_LANGUAGE_MODELS: &[&str] = &[
    "seq_length_warmup",
    "alibi",
    "gated_linear_units",
    "low_precision_layernorm",
];

/// 48 digits in batches of 16, three epochs (9 batches), 48 test digits: enough batches for
/// every algorithm's schedule to act (start and end fractions, intervals in batches, SAM's
/// second pass, SWA's updates), small enough for a software GPU (`GPU_SUBSET` in
/// `xtask/src/build.rs` runs these on wgpu, where each sample of a batch costs).
pub(crate) fn tiny(algorithms: &str) -> MnistRun {
    let mut run = short_run(48, 16, 48, "3ep");
    run.algorithms = parse_list(algorithms).unwrap();
    run
}

fn outcome_of(run: &MnistRun) -> (String, f64, u64) {
    let mut t = trained(run);
    let metrics = t.eval().unwrap();
    let state = t.state();
    assert!(state.loss_value().unwrap().is_finite());
    (
        params_sha256::<TB, _>(t.model()),
        metrics["test"]["loss"],
        state.timestamp().sample,
    )
}

#[test]
fn every_algorithm_trains_and_changes_the_run() {
    let names: Vec<&str> = ACTIVE
        .iter()
        .map(|a| a.split(':').next().unwrap())
        .chain(NEED_RESNET.iter().copied())
        .chain(NEED_HALF.iter().copied())
        .chain(FOR_LANGUAGE_MODELS.iter().copied())
        .collect();
    let mut known: Vec<&str> = flashover::algorithms::spec::algorithms()
        .iter()
        .map(|n| n.name)
        .collect();
    let mut covered = names.clone();
    covered.sort();
    known.sort();
    assert_eq!(
        covered, known,
        "ACTIVE and the lists after it cover every algorithm of the registry, each once"
    );
    let (base_digest, base_loss, base_samples) = outcome_of(&tiny(""));
    assert_eq!(base_samples, 3 * 48);
    let fast_by_default = <TB as flashover::models::ChannelsLastBackend>::CHANNELS_LAST_IS_FAST;
    if fast_by_default {
        // The default run on the CPU is the channels-last fast path: Burn's kernels
        // (channels-first) sum in another order and end elsewhere.
        let mut burn = tiny("");
        burn.memory_format = flashover::core::model::MemoryFormat::ChannelsFirst;
        assert_ne!(
            outcome_of(&burn).0,
            base_digest,
            "the CPU default is the fast path"
        );
    }
    for spec in ACTIVE {
        let (digest, loss, samples) = outcome_of(&tiny(spec));
        if *spec == "channels_last" {
            // It states the format explicitly: where channels-last is already the default it
            // must change nothing; on GPU backends it changes which kernels run.
            if fast_by_default {
                assert_eq!((digest, loss), (base_digest.clone(), base_loss), "{spec}");
            }
            assert_eq!(samples, base_samples, "{spec}");
            continue;
        }
        // EMA ends training with its average in the model (the weights evaluated and saved;
        // that it leaves training itself alone is `library::ema_ends_fit_with_the_average...`);
        // every other method changes the weights.
        assert!(
            digest != base_digest || loss != base_loss,
            "{spec} changed nothing"
        );
        if spec.starts_with("ema") {
            assert_ne!(
                digest, base_digest,
                "EMA ends training with its average in the model"
            );
        }
        if spec.starts_with("selective_backprop") {
            assert!(
                samples < base_samples,
                "selective backprop trains on fewer samples"
            );
        } else {
            assert_eq!(samples, base_samples, "{spec}");
        }
    }
}

#[test]
fn every_recipe_trains() {
    for r in RECIPES {
        let run = short_run(128, 32, 100, "4ep").with_recipe(r.name).unwrap();
        assert_eq!(run.scale_schedule_ratio, r.scale_schedule_ratio);
        let t = trained(&run);
        let expected = Time::Epoch(4).scaled(r.scale_schedule_ratio);
        assert_eq!(t.state().max_duration(), expected, "{}", r.name);
        assert!(t.state().loss_value().unwrap().is_finite());
    }
}

#[test]
fn target_rewriters_compose_in_the_order_added() {
    // MixUp then label smoothing: the loss sees smooth(mix(one_hot)). A recording callback
    // reads the targets at BEFORE_LOSS (after the algorithms) and recomputes them from the
    // same random stream the trainer hands MixUp.
    for order in [
        "mixup,label_smoothing:smoothing=0.2",
        "label_smoothing:smoothing=0.2,mixup",
    ] {
        let run = tiny(order);
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = seen.clone();
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Watch {
                event: Event::BeforeLoss,
                f: move |s: &MnistState, _: &mut Control<'_>| {
                    let b = s.batch().unwrap();
                    let got = b.soft_targets().expect("soft targets are set").clone();
                    let mut rng = s.rng("mixup/0");
                    let lambda = mixing_coefficient(&mut rng, 0.2);
                    let mut perm: Vec<usize> = (0..b.len_samples()).collect();
                    rng.shuffle(&mut perm);
                    let p = burn::tensor::Tensor::from_data(
                        burn::tensor::TensorData::new(
                            perm.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                            [perm.len()],
                        ),
                        s.device(),
                    );
                    let one_hot = b.classes().clone().one_hot::<2>(10).float();
                    let want = smooth_labels(mix(one_hot, p, lambda), 0.2);
                    let diff: f32 = (got - want).abs().max().into_scalar();
                    sink.lock().unwrap().push(diff);
                    Ok(())
                },
            })
            .build()
            .unwrap();
        t.fit_for(Time::Batch(2)).unwrap();
        let diffs = seen.lock().unwrap().clone();
        assert_eq!(diffs.len(), 2);
        assert!(diffs.iter().all(|d| *d < 1e-6), "{order}: {diffs:?}");
    }
}

/// `Batch::len` under a name that does not clash with `ClassTargets` in scope.
trait LenSamples {
    fn len_samples(&self) -> usize;
}
impl<T: flashover::core::model::Batch> LenSamples for T {
    fn len_samples(&self) -> usize {
        self.len()
    }
}

#[test]
fn the_same_algorithm_twice_is_refused() {
    let run = tiny("mixup,label_smoothing,mixup:alpha=1");
    let err = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .build()
        .err()
        .expect("a repeated algorithm is an error");
    assert!(
        matches!(
            err,
            CoreError::InvalidConfig {
                name: "algorithms",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("`mixup` added twice"), "{err}");
}

#[test]
fn bad_algorithm_lists_are_errors_that_list_the_valid_names() {
    let out = run_mnist(&short_args(&["--algorithms", "mixup,blurpoool"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("unknown algorithm \"blurpoool\"")
            && out.stderr.contains("label_smoothing, selective_backprop")
            && out.stderr.contains("mixup, cutmix")
            && out.stderr.contains("low_precision_groupnorm"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&["--algorithms", "mixup:alpha=-1"]));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("alpha") && out.stderr.contains("-1"),
        "{}",
        out.stderr
    );
    let out = run_mnist(&short_args(&["--recipe", "spicy"]));
    assert!(!out.status.success());
    assert!(out.stderr.contains("mild, medium, hot"), "{}", out.stderr);
}

/// Resuming mid-run (in a new process) with one algorithm on ends with the same bits as the
/// straight run. On GPU backends only the combined run below is exercised (time).
mod resume_each {
    use super::ACTIVE;
    use crate::resume::{autoresume, resumed};

    fn check(i: usize) {
        resumed(
            &["--algorithms", ACTIVE[i]],
            &["--stop-after", "20ba"],
            autoresume,
        );
    }

    #[test]
    fn label_smoothing() {
        check(0)
    }
    #[test]
    fn mixup() {
        check(1)
    }
    #[test]
    fn cutmix() {
        check(2)
    }
    #[test]
    fn cutout() {
        check(3)
    }
    #[test]
    fn colout() {
        check(4)
    }
    #[test]
    fn progressive_resizing() {
        check(5)
    }
    #[test]
    fn randaugment() {
        check(6)
    }
    #[test]
    fn augmix() {
        check(7)
    }
    #[test]
    fn selective_backprop() {
        check(8)
    }
    #[test]
    fn gradient_clipping() {
        check(9)
    }
    #[test]
    fn ema() {
        check(10)
    }
    #[test]
    fn swa() {
        check(11)
    }
    #[test]
    fn sam() {
        check(12)
    }
    #[test]
    fn layer_freezing() {
        check(13)
    }

    #[test]
    fn channels_last() {
        check(14)
    }
    #[test]
    fn blurpool() {
        check(15)
    }
    #[test]
    fn weight_standardization() {
        check(16)
    }
    #[test]
    fn squeeze_excite() {
        check(17)
    }
    #[test]
    fn gyro_dropout() {
        check(18)
    }
    #[test]
    fn factorize() {
        check(19)
    }
}

#[test]
fn resume_with_the_stateful_algorithms_together() {
    crate::resume::resumed(
        &[
            "--algorithms",
            "label_smoothing,ema:half_life=5ba,swa:swa_start=0.3:update_interval=4ba,layer_freezing:freeze_start=0,sam:interval=3",
        ],
        &["--stop-after", "20ba"],
        crate::resume::autoresume,
    );
}

/// The same algorithms resumed inside one process (the GPU subset's form of the test above).
#[test]
fn the_stateful_algorithms_together_resume_in_one_process() {
    // 24 batches, stopped at 12: SWA averages from 0.3 of the run on, so the checkpoint holds
    // its average beside EMA's and SAM's state, and the resumed part crosses the epoch
    // boundary (16).
    let mut run = crate::resume::in_process::epoch_and_a_half();
    run.algorithms = parse_list(
        "label_smoothing,ema:half_life=5ba,swa:swa_start=0.3:update_interval=4ba,layer_freezing:freeze_start=0,sam:interval=3",
    )
    .unwrap();
    crate::resume::in_process::resumes(&run, Time::Batch(4), Time::Batch(12), false);
}

#[test]
fn every_resnet_recipe_trains_and_resumes_exactly() {
    use flashover::algorithms::recipes::RESNET_RECIPES;
    for r in RESNET_RECIPES {
        crate::resume::resumed(
            &[
                "--model",
                "resnet8",
                "--recipe",
                r.name,
                "--max-duration",
                "60ba",
            ],
            &["--stop-after", "9ba"],
            crate::resume::autoresume,
        );
    }
}

#[test]
fn every_recipe_resumes_exactly() {
    for r in RECIPES {
        crate::resume::resumed(
            &["--recipe", r.name],
            &["--stop-after", "15ba"],
            crate::resume::autoresume,
        );
    }
}

mod sequence {
    use std::sync::{Arc, Mutex};

    use crate::support::*;
    use flashover::algorithms::seq_length_warmup::{warmup_length, SeqLengthWarmup};
    use flashover::core::event::Event;
    use flashover::core::time::Time;
    use flashover::core::trainer::Trainer;
    use flashover_examples::shakespeare::{bundled_shakespeare, token_loader, CharCorpus, CharLm};

    type Lm = CharLm<TB>;

    /// Trains the character model for 40 batches of 16 windows of 64 characters with
    /// sequence-length warmup over the first half; returns the tokens trained on and the
    /// first and last losses.
    fn train(truncate: bool) -> (u64, Vec<f64>) {
        let corpus = CharCorpus::load(&bundled_shakespeare()).unwrap();
        assert_eq!(
            corpus.vocab.len(),
            84,
            "the README's count of distinct characters"
        );
        let dev = device();
        let loader = token_loader::<TB>(&corpus, 64, 16, Some(640), 3, &dev).unwrap();
        let model = Lm::new(&dev, corpus.vocab.len(), 64, 3);
        let opt = burn::optim::AdamConfig::new().init::<TB, Lm>();
        let losses = Arc::new(Mutex::new(Vec::new()));
        let sink = losses.clone();
        let mut t = Trainer::builder(model, opt, loader, Time::Batch(40), dev)
            .lr(1e-2)
            .algorithm(SeqLengthWarmup::new(0.5, 8, 64, 8, truncate).unwrap())
            .callback(Watch {
                event: Event::BatchEnd,
                f: move |s: &flashover::core::state::State<
                    flashover::core::setup::SetupOf<TB, Lm, _>,
                >,
                         _: &mut Control<'_>| {
                    sink.lock().unwrap().push(s.loss_value().unwrap());
                    Ok(())
                },
            })
            .build()
            .unwrap();
        t.fit().unwrap();
        let v = losses.lock().unwrap().clone();
        (t.state().timestamp().token, v)
    }

    #[test]
    fn seq_length_warmup_trains_a_character_model_on_shakespeare() {
        // Truncation: batch k trains 16 sequences of warmup_length(k / 40) tokens.
        let expected: u64 = (0..40u64)
            .map(|k| 16 * warmup_length(k as f64 / 40.0, 0.5, 8, 64, 8) as u64)
            .sum();
        let (tokens, losses) = train(true);
        assert_eq!(tokens, expected);
        assert!(tokens < 40 * 16 * 64, "warmup trains on fewer tokens");
        let first: f64 = losses[..5].iter().sum::<f64>() / 5.0;
        let last: f64 = losses[35..].iter().sum::<f64>() / 5.0;
        assert!(last < first - 0.5, "loss fell from {first} to {last}");
        assert!(last < (84f64).ln(), "better than uniform guessing");
        // Folding keeps every whole piece: 64 / len pieces of len tokens per sequence.
        let expected: u64 = (0..40u64)
            .map(|k| {
                let l = warmup_length(k as f64 / 40.0, 0.5, 8, 64, 8) as u64;
                16 * (64 / l) * l
            })
            .sum();
        let (tokens, _) = train(false);
        assert_eq!(tokens, expected);
    }
}

mod schedules {
    use std::sync::{Arc, Mutex};

    use crate::support::*;
    use burn::tensor::{Int, Tensor, TensorData};
    use flashover::algorithms::sam::Sam;
    use flashover::algorithms::spec::parse_list;
    use flashover::core::callback::{Algorithm, Callback};
    use flashover::core::error::{CoreError, Result};
    use flashover::core::event::Event;
    use flashover::core::logger::Logger;
    use flashover::core::setup::Setup;
    use flashover::core::state::State;
    use flashover_examples::MnistRun;

    /// Records the samples each batch trained on.
    struct Samples(Arc<Mutex<Vec<u64>>>);

    impl<S: Setup> Callback<S> for Samples {
        fn name(&self) -> &str {
            "samples"
        }
        fn batch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
            let mut v = self.0.lock().unwrap();
            let before: u64 = v.iter().sum();
            v.push(state.timestamp().sample - before);
            Ok(())
        }
    }

    #[test]
    fn selective_backprop_leaves_every_interrupt_th_batch_of_each_epoch_whole() {
        // Three batches of 32 an epoch, two epochs; keep half, every second batch whole. The
        // count restarts each epoch (the paper's and Composer's `batch_in_epoch`), so batch 0
        // of epoch 1 is thinned even though it is the run's fourth batch.
        let mut run = short_run(96, 32, 20, "2ep");
        run.algorithms =
            parse_list("selective_backprop:start=0:end=1:keep=0.5:interrupt=2").unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .callback(Samples(seen.clone()))
            .build()
            .unwrap();
        t.fit().unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![16, 32, 16, 16, 32, 16]);
    }

    /// Notes, for each batch, whether the gradients reaching the optimizer differ from the
    /// backward pass's (added before SAM, it runs after SAM at `AFTER_TRAIN_BATCH`).
    struct SamProbe {
        backward: Option<Vec<f32>>,
        log: Arc<Mutex<Vec<(u64, bool)>>>,
    }

    impl<S: Setup> Algorithm<S> for SamProbe {
        fn name(&self) -> &str {
            "sam_probe"
        }
        fn matches(&self, event: Event, _state: &State<S>) -> bool {
            matches!(event, Event::AfterBackward | Event::AfterTrainBatch)
        }
        fn apply(&mut self, event: Event, state: &mut State<S>, _l: &mut Logger) -> Result<()> {
            let Some(grads) = state.grads() else {
                return Ok(());
            };
            let flat = flat_grads::<S::Backend, S::Model>(state.model(), grads);
            if event == Event::AfterBackward {
                self.backward = Some(flat);
            } else {
                let changed = self.backward.take().is_some_and(|b| b != flat);
                self.log
                    .lock()
                    .unwrap()
                    .push((state.timestamp().batch + 1, changed));
            }
            Ok(())
        }
    }

    #[test]
    fn sam_takes_its_extra_step_on_batches_k_2k_3k() {
        let run = short_run(192, 32, 20, "1ep");
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .algorithm(SamProbe {
                backward: None,
                log: log.clone(),
            })
            .algorithm(Sam::new(0.05, 1e-12, 2).unwrap())
            .build()
            .unwrap();
        t.fit().unwrap();
        let sam_batches: Vec<u64> = log
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, changed)| *changed)
            .map(|(b, _)| *b)
            .collect();
        assert_eq!(sam_batches, vec![2, 4, 6]);
    }

    #[test]
    fn label_smoothing_refuses_a_negative_class_instead_of_wrapping_it() {
        let mut run = short_run(64, 32, 20, "1ep");
        run.algorithms = parse_list("label_smoothing").unwrap();
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .algorithm(At {
                event: Event::AfterDataloader,
                f: |s: &mut MnistState| {
                    if let Some(b) = s.batch_mut()? {
                        let mut v: Vec<i64> = b.targets.clone().into_data().iter::<i64>().collect();
                        v[0] = -1;
                        let n = v.len();
                        b.targets =
                            Tensor::<TB, 1, Int>::from_data(TensorData::new(v, [n]), &device());
                    }
                    Ok(())
                },
            })
            .build()
            .unwrap();
        let err = t.fit().unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::ClassIndex {
                    value: -1,
                    num_classes: 10
                }
            ),
            "{err}"
        );
    }
}

/// The language-model algorithms are refused for the CNN by name, before training.
#[test]
fn language_model_algorithms_are_refused_for_image_models() {
    for name in FOR_LANGUAGE_MODELS {
        let err = match tiny(name).builder::<TB, _>(MnistRun::adamw::<TB>(), &device()) {
            Ok(_) => panic!("{name} was accepted for the CNN"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(name) && err.contains("language models"),
            "{name}: {err}"
        );
    }
}
