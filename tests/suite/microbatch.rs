//! Gradient accumulation: the summed, weighted microbatch gradients equal the full-batch
//! gradient within float tolerance, also when the microbatch size does not divide the batch.

use std::sync::{Arc, Mutex};

use crate::support::*;
use flashover::core::event::Event;
use flashover_examples::MnistRun;

fn first_step_grads(microbatch: Option<usize>) -> Vec<f32> {
    let mut run = short_run(32, 32, 10, "1ba");
    run.microbatch_size = microbatch;
    let captured = Arc::new(Mutex::new(Vec::new()));
    let sink = captured.clone();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(Watch {
            event: Event::AfterTrainBatch,
            f: move |s: &flashover::core::state::State<
                flashover::core::setup::SetupOf<TB, _, _>,
            >,
                     _: &mut Control<'_>| {
                let grads = s.grads().expect("gradients are set at AFTER_TRAIN_BATCH");
                *sink.lock().unwrap() = flat_grads::<TB, _>(s.model(), grads);
                Ok(())
            },
        })
        .build()
        .unwrap();
    t.fit().unwrap();
    let g = captured.lock().unwrap().clone();
    g
}

#[test]
fn microbatch_gradients_equal_the_full_batch_gradient() {
    let full = first_step_grads(None);
    assert!(full.iter().any(|g| *g != 0.0));
    let scale = full.iter().fold(0f32, |m, g| m.max(g.abs()));
    // 2 and 4 equal microbatches, and 7 uneven ones (6 of 5 samples and one of 2).
    for size in [16, 8, 5] {
        let micro = first_step_grads(Some(size));
        assert_eq!(micro.len(), full.len());
        let worst = micro
            .iter()
            .zip(&full)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-5 * scale.max(1.0),
            "microbatch {size}: max abs difference {worst} (largest gradient {scale})"
        );
    }
}

/// The training step reads from the device once per batch, however many microbatches it
/// has (and with loss scaling's overflow check): its losses are read together after the
/// last backward pass is queued.
#[test]
fn the_step_reads_from_the_device_once_per_batch() {
    use flashover::core::precision::Precision;
    for (microbatch, precision) in [
        (None, Precision::Fp32),
        (Some(8), Precision::Fp32),
        (Some(5), Precision::AmpFp16),
    ] {
        let mut run = short_run(128, 32, 10, "1ep");
        run.microbatch_size = microbatch;
        run.precision = precision;
        let mut t = run
            .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .build()
            .unwrap();
        let report = t.fit().unwrap();
        assert_eq!(report.batches, 4);
        assert_eq!(
            report.device_reads, report.batches,
            "{microbatch:?} {precision}"
        );
    }
}

/// With nothing running out of memory (the CPU backends never do), automatic microbatching
/// trains exactly as the whole batch does.
#[test]
fn auto_microbatching_changes_nothing_while_memory_suffices() {
    use flashover::core::params::params_sha256;
    let sha = |auto: bool| {
        let mut run = short_run(96, 32, 10, "3ba");
        run.auto_microbatching = auto;
        let t = trained(&run);
        assert_eq!(t.state().auto_microbatch_size(), None);
        params_sha256::<TB, _>(t.model())
    };
    assert_eq!(sha(true), sha(false));
}

/// What a retried batch restores: the running statistics a forward pass moved (batch norm's),
/// bit for bit, and nothing else changes.
#[test]
fn running_statistics_are_restored_after_a_forward_pass() {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::{Distribution, Tensor};
    use flashover::core::memory::RunningStats;
    use flashover::core::model::{ClassificationBatch, TrainModel};

    struct Floats(Vec<Vec<f32>>);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Floats {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.push(p.val().into_data().to_vec::<f32>().unwrap());
        }
    }
    let floats = |m: &flashover_examples::ResNet<TB>| {
        let mut f = Floats(Vec::new());
        m.visit(&mut f);
        f.0
    };
    let model = flashover_examples::ResNetConfig::cifar(8, 8)
        .unwrap()
        .with_io(1, 10)
        .unwrap()
        .init::<TB>(&device(), 3);
    let before = floats(&model);
    let snapshot = RunningStats::<TB>::take(&model);
    // The running mean and variance of each of the ResNet-8's 9 batch norms (stem, two per
    // block, two projection shortcuts); its trained parameters are not in the snapshot.
    assert_eq!(snapshot.len(), 18);
    let images = Tensor::<TB, 4>::random([4, 1, 28, 28], Distribution::Normal(0.0, 1.0), &device());
    let targets = Tensor::<TB, 1, burn::tensor::Int>::from_ints([1, 2, 3, 4], &device());
    let batch = ClassificationBatch::new(images, targets);
    let _ = model.forward(&batch);
    let moved = floats(&model);
    assert_ne!(
        moved, before,
        "the forward pass moves the running statistics"
    );
    let model = snapshot.restore(model);
    assert_eq!(floats(&model), before);
}

/// Automatic microbatching on a real out-of-memory: a wgpu device whose memory pools take no
/// allocation above 1 MiB (CubeCL's memory configuration; on the software Vulkan driver), a
/// ResNet with batch norms (running statistics a failed attempt changes) and mixup (random
/// draws counted per microbatch). Whole batches of 64 do not fit; the trainer halves until
/// they do, and the run equals, bit for bit, one started at the size it settled on.
#[cfg(feature = "wgpu")]
mod out_of_memory {
    use super::*;
    use flashover::core::params::params_sha256;

    const LIMIT: u64 = 1 << 20;

    /// The count of allocation failures that tells the trainer it ran out of memory is per
    /// device (`flashover::core::memory`), and these tests share one: they take turns, so
    /// that one's failures are not counted in the other's batch.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Records logged text as `tag: text` and the logged microbatch size as `size N`.
    struct TextLines(Log);

    impl flashover::core::logger::LoggerDestination for TextLines {
        fn name(&self) -> &str {
            "text"
        }
        fn log_text(
            &mut self,
            _ts: &flashover::core::time::Timestamp,
            tag: &str,
            text: &str,
        ) -> flashover::core::Result<()> {
            self.0.lock().unwrap().push(format!("{tag}: {text}"));
            Ok(())
        }
        fn log_metrics(
            &mut self,
            _ts: &flashover::core::time::Timestamp,
            metrics: &[(&str, f64)],
        ) -> flashover::core::Result<()> {
            for (k, v) in metrics {
                if *k == "train/microbatch_size" {
                    self.0.lock().unwrap().push(format!("size {v}"));
                }
            }
            Ok(())
        }
    }

    type ResNetBuilder = flashover::core::trainer::TrainerBuilder<
        flashover::core::setup::SetupOf<
            TB,
            flashover_examples::ResNet<TB>,
            burn::optim::adaptor::OptimizerAdaptor<
                burn::optim::AdamW,
                flashover_examples::ResNet<TB>,
                TB,
            >,
        >,
    >;

    /// Three batches of 64 of a ResNet-8 with mixup on the limited device, logging to `log`.
    fn limited(auto: bool, size: Option<usize>, log: Log) -> ResNetBuilder {
        let device = flashover_examples::wgpu_device_with_allocation_limit(LIMIT).unwrap();
        let mut run = short_run(192, 64, 16, "3ba");
        run.microbatch_size = size;
        run.auto_microbatching = auto;
        run.algorithms = flashover::algorithms::spec::parse_list("mixup").unwrap();
        let model = flashover_examples::ResNetConfig::cifar(8, 8)
            .unwrap()
            .with_io(1, 10)
            .unwrap()
            .init::<TB>(&device, run.seed);
        let optimizer = burn::optim::AdamWConfig::new().init();
        run.builder_with::<TB, _, _>(model, optimizer, &device)
            .unwrap()
            .logger(TextLines(log))
    }

    fn run(auto: bool, size: Option<usize>) -> (String, Option<usize>, Vec<String>) {
        let log = new_log();
        let mut t = limited(auto, size, log.clone()).build().unwrap();
        let report = t.fit().unwrap();
        assert_eq!(report.batches, 3);
        let sha = params_sha256::<TB, _>(t.model());
        (sha, t.state().auto_microbatch_size(), lines(&log))
    }

    #[test]
    fn auto_microbatching_survives_it_and_equals_a_run_started_at_its_size() {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let (auto_sha, settled, texts) = run(true, None);
        // The stem's activation, 8 channels of 28 x 28 float32, is 1,605,632 bytes for 64
        // samples, over the 1 MiB limit, and 802,816 for 32: one halving.
        let settled = settled.expect("batches of 64 exceed the 1 MiB allocation limit");
        assert_eq!(settled, 32);
        let changes: Vec<_> = texts
            .iter()
            .filter(|l| l.contains("auto_microbatching"))
            .collect();
        assert!(!changes.is_empty(), "each change is logged: {texts:?}");
        assert!(changes[0].contains("microbatches of 64"), "{changes:?}");
        // Every batch logs the size it trained in: the settled one from the first batch on.
        let sizes: Vec<_> = texts.iter().filter(|l| l.starts_with("size")).collect();
        assert_eq!(sizes.len(), 3, "{texts:?}");
        assert!(
            sizes.iter().all(|l| **l == format!("size {settled}")),
            "{texts:?}"
        );
        let (fixed_sha, none, _) = run(false, Some(settled));
        assert_eq!(none, None);
        assert_eq!(auto_sha, fixed_sha, "auto settled on {settled}");
    }

    /// A layer whose activation of a single sample exceeds the limit: halving down to one
    /// sample does not help, and the run stops with an error that says so (no hang, no
    /// training on the unbound buffers).
    #[test]
    fn one_sample_too_large_is_a_clear_error() {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        use flashover::core::CoreError;
        let device = flashover_examples::wgpu_device_with_allocation_limit(LIMIT).unwrap();
        let mut run = short_run(64, 16, 16, "2ba");
        run.auto_microbatching = true;
        // 400 channels of 28 x 28 float32: 1.25 MB per sample.
        let model = flashover_examples::MnistCnn::<TB>::with_widths(&device, run.seed, 400, 8, 16);
        let optimizer = burn::optim::AdamWConfig::new().init();
        let mut t = run
            .builder_with::<TB, _, _>(model, optimizer, &device)
            .unwrap()
            .build()
            .unwrap();
        match t.fit() {
            Err(CoreError::OutOfMemory {
                batch: 0, during, ..
            }) => {
                assert_eq!(during, "in microbatches of 1 sample");
            }
            other => panic!("expected running out of memory at one sample, got {other:?}"),
        }
        // The device works again afterwards.
        let x = burn::tensor::Tensor::<Inner, 1>::ones([4], &device).sum();
        assert_eq!(x.into_scalar(), 4.0);
    }

    /// Without automatic microbatching a batch that does not fit stops the run with an error
    /// that names the size and the way out (it would otherwise train on unbound buffers).
    #[test]
    fn without_auto_a_batch_that_does_not_fit_is_a_clear_error() {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = limited(false, None, new_log()).build().unwrap();
        let err = t.fit().unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("ran out of memory at epoch 0, batch 0 in microbatches of 64 samples")
                && msg.contains("--microbatch-size auto"),
            "{msg}"
        );
    }

    /// The settled size is in the checkpoint: a run resumed from it continues in microbatches
    /// of 32 without running out of memory again, and ends with the uninterrupted run's bits.
    #[test]
    fn a_resumed_run_continues_at_the_settled_size() {
        use flashover::callbacks::StopAt;
        use flashover::checkpoint::{autoresume, SaveInterval, Saver, SaverConfig};
        use flashover::core::time::Time;
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let (straight, _, _) = run(true, None);
        let dir = tempfile::tempdir().unwrap();
        let trainer = |resume: bool, log: Log| {
            let saver = Saver::new(
                SaverConfig::new(dir.path()),
                SaveInterval::Every(Time::Batch(1)),
            )
            .unwrap();
            let b = limited(true, None, log).callback(saver);
            let b = match resume {
                true => b.restore(autoresume(dir.path()).unwrap().expect("a checkpoint")),
                false => b.callback(StopAt::new(Time::Batch(2))),
            };
            b.build().unwrap()
        };
        let first_log = new_log();
        let mut first = trainer(false, first_log.clone());
        first.fit().unwrap();
        assert_eq!(first.state().auto_microbatch_size(), Some(32));
        drop(first);
        let log = new_log();
        let mut resumed = trainer(true, log.clone());
        assert_eq!(resumed.state().auto_microbatch_size(), Some(32));
        resumed.fit().unwrap();
        let lines = lines(&log);
        assert!(
            lines.iter().all(|l| !l.contains("auto_microbatching")),
            "no new out-of-memory: {lines:?}"
        );
        assert_eq!(
            lines.iter().filter(|l| *l == "size 32").count(),
            1,
            "{lines:?}"
        );
        assert_eq!(params_sha256::<TB, _>(resumed.model()), straight);
    }
}

/// Padded token batches and `accumulate_on_tokens` (Composer's
/// `accumulate_train_batch_on_tokens`): a GPT's gradient over one batch of four sequences
/// padded to 8 positions, of 8, 2, 8 and 3 scored tokens.
mod tokens {
    use std::sync::{Arc, Mutex};

    use burn::optim::SgdConfig;
    use burn::tensor::{Int, Tensor, TensorData};
    use flashover::core::data::{BatchIter, BatchSource};
    use flashover::core::event::Event;
    use flashover::core::loss::IGNORE_INDEX;
    use flashover::core::model::TokenBatch;
    use flashover::core::state::World;
    use flashover::core::time::Time;
    use flashover::core::trainer::Trainer;
    use flashover::models::{Gpt, GptConfig};

    use crate::support::threads::ranks;
    use crate::support::*;

    /// Scored tokens of the four sequences.
    const LENGTHS: [usize; 4] = [8, 2, 8, 3];

    /// The batch of the sequences `rows` (indices into [`LENGTHS`]): token `t` of sequence `s`
    /// is `(3 s + 5 t) mod 11`, its target the next one, and targets past the sequence's
    /// length are padding.
    fn batch(rows: &[usize]) -> TokenBatch<TB> {
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for &s in rows {
            for t in 0..8 {
                let token = |t: usize| ((3 * s + 5 * t) % 11) as i64;
                tokens.push(token(t));
                targets.push(if t < LENGTHS[s] {
                    token(t + 1)
                } else {
                    IGNORE_INDEX
                });
            }
        }
        let n = rows.len();
        TokenBatch::padded(
            Tensor::<TB, 2, Int>::from_data(TensorData::new(tokens, [n, 8]), &device()),
            Tensor::<TB, 2, Int>::from_data(TensorData::new(targets, [n, 8]), &device()),
        )
    }

    /// One epoch of one batch.
    struct OneBatch(Vec<usize>);

    impl BatchSource<TokenBatch<TB>> for OneBatch {
        fn name(&self) -> &str {
            "padded"
        }
        fn num_batches(&self) -> usize {
            1
        }
        fn num_samples(&self) -> usize {
            self.0.len()
        }
        fn batch_size(&self) -> usize {
            self.0.len()
        }
        fn iter_from(&self, _epoch: u64, start: usize) -> BatchIter<TokenBatch<TB>> {
            let rows = self.0.clone();
            let left = 1 - start.min(1);
            BatchIter::from_iter(
                std::iter::once(())
                    .take(left)
                    .map(move |_| Ok(batch(&rows))),
                left,
            )
        }
    }

    /// The first step's gradients (every parameter, flattened) and loss, training on the
    /// sequences `rows` in microbatches of `microbatch`, by tokens or by samples; as `rank`
    /// of a run of `world` ranks when a collective is given.
    fn first_step(
        rows: &[usize],
        microbatch: Option<usize>,
        on_tokens: bool,
        rank: Option<(World, crate::support::threads::ThreadCollective)>,
    ) -> (Vec<f32>, f64) {
        let config = GptConfig::new(11, 8, 1, 2, 16).unwrap();
        let model: Gpt<TB> = config.init(&device(), 3);
        let captured = Arc::new(Mutex::new((Vec::new(), f64::NAN)));
        let sink = captured.clone();
        let mut b = Trainer::builder(
            model,
            SgdConfig::new().init::<TB, Gpt<TB>>(),
            OneBatch(rows.to_vec()),
            "1ba".parse::<Time>().unwrap(),
            device(),
        )
        .lr(0.1)
        .accumulate_on_tokens(on_tokens)
        .callback(Watch {
            event: Event::AfterTrainBatch,
            f: move |s: &flashover::core::state::State<_>, _: &mut Control<'_>| {
                let grads = s.grads().expect("gradients are set at AFTER_TRAIN_BATCH");
                let loss = s.loss_value().unwrap_or(f64::NAN);
                *sink.lock().unwrap() = (flat_grads::<TB, _>(s.model(), grads), loss);
                Ok(())
            },
        });
        if let Some(size) = microbatch {
            b = b.microbatch_size(size);
        }
        if let Some((world, c)) = rank {
            b = b.world(world).collective(c);
        }
        let mut t = b.build().unwrap();
        t.fit().unwrap();
        let out = captured.lock().unwrap().clone();
        out
    }

    #[test]
    fn microbatches_weighed_by_tokens_give_the_unsplit_gradient_and_loss() {
        let all = [0, 1, 2, 3];
        let (full, full_loss) = first_step(&all, None, false, None);
        let scale = full.iter().fold(0f32, |m, g| m.max(g.abs()));
        assert!(scale > 0.0);
        // Microbatches of [8, 2] and [8, 3] tokens, and of one sequence each.
        for size in [2, 1] {
            let (g, loss) = first_step(&all, Some(size), true, None);
            assert!(
                max_abs_diff(&g, &full) <= 1e-5 * scale,
                "by tokens, microbatch {size}: {} (largest gradient {scale})",
                max_abs_diff(&g, &full)
            );
            assert!(
                (loss - full_loss).abs() < 1e-5,
                "{loss} against {full_loss}"
            );
            // By samples, a microbatch of 2 or 3 tokens weighs as much as one of 8: the
            // gradient is another one.
            // (Its loss differs too, but little: at initialisation every token's loss is
            // near ln 11.)
            let (g, _) = first_step(&all, Some(size), false, None);
            assert!(
                max_abs_diff(&g, &full) > 1e-3 * scale,
                "by samples, microbatch {size}, should differ"
            );
        }
    }

    #[test]
    fn ranks_weighed_by_tokens_give_the_one_process_gradient() {
        // Rank 0 trains on the sequences of 8 and 2 tokens, rank 1 on those of 8 and 3, each
        // in microbatches of one sequence: the averaged gradient is the one process's over
        // all four sequences (21 tokens) only when ranks weigh by tokens (10 and 11).
        let (full, full_loss) = first_step(&[0, 1, 2, 3], None, false, None);
        let scale = full.iter().fold(0f32, |m, g| m.max(g.abs()));
        for on_tokens in [true, false] {
            let out = ranks(2, move |rank, c| {
                let rows = [[0, 1], [2, 3]][rank];
                first_step(
                    &rows,
                    Some(1),
                    on_tokens,
                    Some((World { rank, size: 2 }, c)),
                )
            });
            assert_eq!(out[0].0, out[1].0, "both ranks step with the same gradient");
            let (g, loss) = &out[0];
            if on_tokens {
                assert!(
                    max_abs_diff(g, &full) <= 1e-5 * scale,
                    "{}",
                    max_abs_diff(g, &full)
                );
                assert!(
                    (loss - full_loss).abs() < 1e-5,
                    "{loss} against {full_loss}"
                );
            } else {
                assert!(max_abs_diff(g, &full) > 1e-3 * scale);
            }
        }
    }

    #[test]
    fn accumulate_on_tokens_is_refused_for_batches_without_tokens() {
        let run = short_run(32, 32, 10, "1ba");
        let err = run
            .builder::<TB, _>(flashover_examples::MnistRun::adamw::<TB>(), &device())
            .unwrap()
            .accumulate_on_tokens(true)
            .build()
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("accumulate_on_tokens") && err.contains("COUNTS_TOKENS"),
            "{err}"
        );
    }
}
