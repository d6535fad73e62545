//! Monitors, stoppers, loggers, profiler and plot (issue: callbacks, loggers and profiler).
//! Monitors are checked against hand-computed values on scripted short runs (a fake clock for
//! speed and time left, the schedule's formula for the learning rate, host-side sums for the
//! norms); the MNIST example's files are read back by independent readers (TensorBoard's own
//! `EventAccumulator` when the `tensorboard` package is installed, as `.ci/run` does).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use burn::tensor::Tensor;
use flashover::algorithms::params::{grads_of, set_grad};
use flashover::callbacks::clock::ManualClock;
use flashover::callbacks::monitors::*;
use flashover::callbacks::stop::MetricStopper;
use flashover::core::error::{CoreError, Result};
use flashover::core::event::Event;
use flashover::core::logger::LoggerDestination;
use flashover::core::time::{Time, Timestamp};
use flashover_examples::{MnistCnn, MnistRun};
use serde_json::Value;

/// Every logged value: (batch, name, value), in order.
type Logged = Arc<Mutex<Vec<(u64, String, f64)>>>;

struct Capture(Logged);

impl LoggerDestination for Capture {
    fn name(&self) -> &str {
        "capture"
    }
    fn log_metrics(&mut self, ts: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let mut v = self.0.lock().unwrap();
        for (k, x) in metrics {
            v.push((ts.batch, k.to_string(), *x));
        }
        Ok(())
    }
}

/// Values of `name` by batch.
fn series(log: &Logged, name: &str) -> BTreeMap<u64, f64> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|(_, k, _)| k == name)
        .map(|(b, _, v)| (*b, *v))
        .collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-12)
}

#[test]
fn lr_monitor_logs_the_schedule_formula() {
    // 8 batches per epoch, 2 epochs; cosine over the run after 4 batches of linear warmup.
    let mut run = short_run(256, 32, 10, "2ep");
    run.lr = 0.01;
    run.scheduler = flashover::core::schedule::Scheduler::cosine(Time::Duration(1.0), 0.0)
        .with_warmup(Time::Batch(4));
    let log = Logged::default();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(LrMonitor::new())
        .logger(Capture(log.clone()))
        .build()
        .unwrap();
    t.fit().unwrap();
    let lr = series(&log, "lr/group0");
    assert_eq!(lr.len(), 16);
    for (batch, v) in lr {
        // Logged at BATCH_END of the batch that trained at step `batch - 1`.
        let b = (batch - 1) as f64;
        let expected = if b < 4.0 {
            0.01 * b / 4.0
        } else {
            0.01 * 0.5 * (1.0 + (std::f64::consts::PI * (b - 4.0) / 12.0).cos())
        };
        assert!(
            (v - expected).abs() < 1e-12,
            "batch {batch}: {v} vs {expected}"
        );
    }
}

#[test]
fn speed_and_runtime_monitors_match_a_fake_clock() {
    // 16 batches of 32 per epoch, 3 epochs; every batch takes 0.25 s on the fake clock, and
    // each evaluation (every epoch) 10 s, which the monitors must leave out.
    let run = short_run(512, 32, 50, "3ep");
    let clock = ManualClock::default();
    let (tick, eval) = (clock.clone(), clock.clone());
    let log = Logged::default();
    let peak = 1e9;
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(Watch {
            event: Event::BatchStart,
            f: move |_: &MnistState, _: &mut Control<'_>| {
                tick.advance(Duration::from_millis(250));
                Ok(())
            },
        })
        .callback(Watch {
            event: Event::EvalStart,
            f: move |_: &MnistState, _: &mut Control<'_>| {
                eval.advance(Duration::from_secs(10));
                Ok(())
            },
        })
        .callback(
            SpeedMonitor::new(4)
                .unwrap()
                .with_peak_flops(peak)
                .unwrap()
                .with_clock(clock.clone()),
        )
        .callback(RuntimeEstimator::new(4).unwrap().with_clock(clock.clone()))
        .logger(Capture(log.clone()))
        .build()
        .unwrap();
    t.fit().unwrap();
    let flops =
        MnistCnn::<crate::support::Inner>::new(&Default::default(), 1).forward_flops() * 3.0;
    assert_eq!(
        flops,
        3.0 * 2.0 * (9.0 * 16.0 * 784.0 + 9.0 * 16.0 * 32.0 * 196.0 + 49.0 * 32.0 * 128.0 + 1280.0)
    );
    let check = |name: &str, expected: &dyn Fn(u64) -> f64| {
        let s = series(&log, name);
        assert_eq!(s.len(), 48, "{name}");
        for (b, v) in s {
            assert!(
                close(v, expected(b), 1e-9),
                "{name} at batch {b}: {v} vs {}",
                expected(b)
            );
        }
    };
    check("time/batch_seconds", &|_| 0.25);
    check("throughput/batches_per_sec", &|_| 4.0);
    check("throughput/samples_per_sec", &|_| 128.0);
    check("throughput/flops_per_sec", &|_| 128.0 * flops);
    check("throughput/mfu", &|_| 128.0 * flops / peak);
    check("time/elapsed_seconds", &|b| 0.25 * b as f64);
    check("time/remaining_estimate_seconds", &|b| {
        0.25 * (48 - b) as f64
    });
    assert!(
        series(&log, "throughput/tokens_per_sec").is_empty(),
        "images count no tokens"
    );
}

#[test]
fn memory_monitor_reports_the_process_and_a_device_reader() {
    let run = short_run(256, 32, 10, "1ep");
    let log = Logged::default();
    let ballast: Arc<Mutex<Vec<u8>>> = Arc::default();
    let grow = ballast.clone();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(Watch {
            // Before batch 5 the process takes 256 MiB more, touched so that it is resident.
            event: Event::BatchStart,
            f: move |s: &MnistState, _: &mut Control<'_>| {
                if s.timestamp().batch == 4 {
                    *grow.lock().unwrap() = vec![1u8; 256 << 20];
                }
                Ok(())
            },
        })
        .callback(
            MemoryMonitor::new(Time::Batch(2))
                .unwrap()
                .with_device_reader(|| {
                    Some(DeviceMemory {
                        in_use: 1234,
                        reserved: 4096,
                    })
                }),
        )
        .logger(Capture(log.clone()))
        .build()
        .unwrap();
    t.fit().unwrap();
    assert_eq!(ballast.lock().unwrap().len(), 256 << 20);
    let rss = series(&log, "memory/rss_bytes");
    assert_eq!(rss.keys().copied().collect::<Vec<_>>(), [2, 4, 6, 8]);
    let gained = rss[&6] - rss[&4];
    assert!(
        gained >= 0.95 * (256 << 20) as f64,
        "RSS grew by {gained} bytes"
    );
    let peak = series(&log, "memory/peak_rss_bytes");
    assert!(peak.iter().all(|(b, p)| *p >= rss[b]));
    assert!(series(&log, "memory/device_in_use_bytes")
        .values()
        .all(|&v| v == 1234.0));
    assert!(series(&log, "memory/device_reserved_bytes")
        .values()
        .all(|&v| v == 4096.0));
}

/// L2 norms by layer (and `global`).
type Norms = BTreeMap<String, f64>;

/// Host-side L2 norms by layer from flattened tensors.
fn host_norms(parts: &[(String, Vec<f32>)]) -> Norms {
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    for (path, v) in parts {
        let s: f64 = v.iter().map(|x| (*x as f64) * (*x as f64)).sum();
        let layer = path.rsplit_once('.').map(|(l, _)| l).unwrap_or(path);
        *out.entry(layer.to_string()).or_default() += s;
        *out.entry("global".into()).or_default() += s;
    }
    out.into_iter().map(|(k, v)| (k, v.sqrt())).collect()
}

#[test]
fn norm_monitor_matches_host_side_sums() {
    let run = short_run(256, 32, 10, "1ep");
    let log = Logged::default();
    let seen: Arc<Mutex<BTreeMap<(u64, &'static str), Norms>>> = Arc::default();
    let (g, p) = (seen.clone(), seen.clone());
    let data = |t: Tensor<crate::support::Inner, 1>| t.into_data().to_vec::<f32>().unwrap();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(Watch {
            event: Event::AfterTrainBatch,
            f: move |s: &MnistState, _: &mut Control<'_>| {
                let grads = s.grads().expect("gradients before the step");
                let parts: Vec<(String, Vec<f32>)> = grads_of(s.model(), grads)
                    .into_iter()
                    .map(|v| (v.path, data(v.grad)))
                    .collect();
                g.lock()
                    .unwrap()
                    .insert((s.timestamp().batch + 1, "grad"), host_norms(&parts));
                Ok(())
            },
        })
        .callback(NormMonitor::new(Time::Batch(3)).unwrap())
        .callback(Watch {
            event: Event::BatchEnd,
            f: move |s: &MnistState, _: &mut Control<'_>| {
                let parts: Vec<(String, Vec<f32>)> =
                    flashover::algorithms::params::ParamSet::of_autodiff(s.model())
                        .entries
                        .into_iter()
                        .map(|e| (e.path, data(e.value)))
                        .collect();
                p.lock()
                    .unwrap()
                    .insert((s.timestamp().batch, "param"), host_norms(&parts));
                Ok(())
            },
        })
        .logger(Capture(log.clone()))
        .build()
        .unwrap();
    t.fit().unwrap();
    let seen = seen.lock().unwrap();
    let mut checked = 0;
    for kind in ["grad", "param"] {
        for layer in ["global", "conv1", "conv2", "fc1", "fc2"] {
            let s = series(&log, &format!("l2_norm/{kind}/{layer}"));
            assert_eq!(
                s.keys().copied().collect::<Vec<_>>(),
                [3, 6],
                "{kind}/{layer}"
            );
            for (b, v) in s {
                let expected = seen[&(b, kind)][layer];
                assert!(
                    close(v, expected, 1e-5),
                    "{kind}/{layer} at {b}: {v} vs {expected}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 20);
}

#[test]
fn nan_monitor_names_the_batch_of_a_bad_loss_or_gradient() {
    // A NaN loss at batch 2, seen by the monitor before the trainer's own check.
    let run = short_run(256, 32, 10, "1ep");
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .microbatch_size(16)
        .algorithm(At {
            event: Event::AfterLoss,
            f: |s: &mut MnistState| {
                if s.timestamp().batch == 2 {
                    let loss = s.loss_mut()?.unwrap();
                    *loss = loss.clone().mul_scalar(f32::NAN);
                }
                Ok(())
            },
        })
        .callback(NanMonitor::new())
        .build()
        .unwrap();
    let e = t.fit().unwrap_err().to_string();
    assert!(
        e.contains("non-finite loss (NaN)") && e.contains("batch 2") && e.contains("microbatch 0"),
        "{e}"
    );
    assert_eq!(t.state().timestamp().batch, 2);

    // An infinite gradient in fc1.weight at batch 5: the step is not taken.
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .algorithm(At {
            event: Event::AfterBackward,
            f: |s: &mut MnistState| {
                if s.timestamp().batch == 5 {
                    let (model, grads) = s.model_and_grads_mut()?;
                    let grads = grads.unwrap();
                    let views = grads_of(model, grads);
                    let v = views.iter().find(|v| v.path == "fc1.weight").unwrap();
                    set_grad(grads, v, v.grad.clone().add_scalar(f32::INFINITY));
                }
                Ok(())
            },
        })
        .callback(NanMonitor::new())
        .build()
        .unwrap();
    let before = flashover::core::params::params_sha256::<TB, _>(t.model());
    let err = t.fit().unwrap_err();
    assert!(matches!(err, CoreError::External { .. }), "{err}");
    let e = err.to_string();
    assert!(
        e.contains("non-finite gradient (inf)")
            && e.contains("batch 5")
            && e.contains("fc1.weight (0 NaN, 200704 inf)"),
        "{e}"
    );
    assert_eq!(t.state().timestamp().batch, 5);
    assert_ne!(
        before,
        flashover::core::params::params_sha256::<TB, _>(t.model())
    );
}

#[test]
fn threshold_and_early_stopping_stop_a_real_run_where_the_policy_says() {
    // Threshold: evaluation every 4 batches; stops at the first evaluation at 0.6 or more.
    let mut run = short_run(1024, 32, 200, "3ep");
    run.eval_interval = Time::Batch(4);
    let curve = flashover_examples::MetricCurve::default();
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(curve.clone())
        .callback(MetricStopper::parse_threshold("test/accuracy=0.6").unwrap())
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    let points = curve.points();
    let first = points
        .iter()
        .position(|p| p.value >= 0.6)
        .expect("reaches 0.6");
    assert_eq!(
        points.len(),
        first + 1,
        "stopped at the first crossing: {points:?}"
    );
    assert_eq!(report.batches, points[first].batch);
    assert!(report.stopped.unwrap().contains("threshold 0.6"));

    // Early stopping on the training loss with a min_delta no batch can beat: it stops
    // exactly `patience` batches after the first.
    let run = short_run(512, 32, 10, "2ep");
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(MetricStopper::parse_early("train/loss:patience=5ba:min_delta=100").unwrap())
        .build()
        .unwrap();
    let report = t.fit().unwrap();
    assert_eq!(report.batches, 6, "{:?}", report.stopped);

    // A metric the run does not have is an error listing the ones it has.
    let run = short_run(256, 32, 10, "1ep");
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(MetricStopper::parse_early("test/f1").unwrap())
        .build()
        .unwrap();
    let e = t.fit().unwrap_err().to_string();
    assert!(
        e.contains("\"test/f1\"") && e.contains("test/accuracy"),
        "{e}"
    );
}

/// One run of the example with every output on, shared by the file tests below.
fn logged_run(dir: &Path) -> Value {
    let log_dir = dir.join("logs");
    let out = dir.join("out");
    let (log_dir, out) = (log_dir.to_str().unwrap(), out.to_str().unwrap());
    summary_of(&short_args(&[
        "--max-duration",
        "2ep",
        "--eval-interval",
        "8ba",
        "--log-every",
        "4",
        "--log-dir",
        log_dir,
        "--tensorboard",
        "--profile",
        "--profile-schedule",
        "2,1,1,3,2",
        "--out",
        out,
    ]))
}

/// The JSONL file as (batch, metric) -> value, and the hyperparameter records (one per
/// process that wrote to it).
fn read_jsonl(path: &Path) -> (BTreeMap<(u64, String), f64>, Vec<Value>) {
    let log = crate::support::read_jsonl(path);
    (log.values, log.hyperparameters)
}

#[test]
fn example_logs_round_trip_and_tensorboard_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let summary = logged_run(dir.path());
    let logs = dir.path().join("logs");

    // JSONL and CSV hold the same values, bit for bit, and agree with the summary.
    let (jsonl, hps) = read_jsonl(&logs.join("metrics.jsonl"));
    assert_eq!(hps.len(), 1, "hyperparameters are logged once");
    let hp = &hps[0];
    assert_eq!(hp["batch_size"], 32);
    assert_eq!(hp["optimizer"], "adamw");
    let csv = std::fs::read_to_string(logs.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(flashover::callbacks::CSV_HEADER));
    let mut from_csv = BTreeMap::new();
    for l in lines {
        let f: Vec<&str> = l.split(',').collect();
        assert_eq!(f.len(), 7, "{l}");
        from_csv.insert(
            (f[1].parse::<u64>().unwrap(), f[5].to_string()),
            f[6].parse::<f64>().unwrap(),
        );
    }
    assert_eq!(from_csv.len(), jsonl.len());
    for (k, v) in &jsonl {
        assert_eq!(from_csv[k].to_bits(), v.to_bits(), "{k:?}");
    }
    let hp_csv: Value = serde_json::from_str(
        &std::fs::read_to_string(logs.join("metrics.hyperparameters.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(&hp_csv, hp);
    assert_eq!(summary["batches"], 32);
    let final_acc = jsonl[&(32, "eval/test/accuracy".to_string())];
    assert_eq!(summary["test_accuracy"].as_f64().unwrap(), final_acc);
    for name in [
        "train/loss",
        "train/lr",
        "lr/group0",
        "throughput/samples_per_sec",
        "throughput/flops_per_sec",
        "time/remaining_estimate_seconds",
        "memory/rss_bytes",
        "l2_norm/grad/global",
        "l2_norm/param/fc2",
    ] {
        assert!(
            jsonl.keys().any(|(_, k)| k == name),
            "{name} missing from the logs"
        );
    }
    let losses: Vec<u64> = jsonl
        .keys()
        .filter(|(_, k)| k == "train/loss")
        .map(|(b, _)| *b)
        .collect();
    assert_eq!(losses, (1..=32).collect::<Vec<_>>());

    // TensorBoard's own reader sees the same scalars at the same steps.
    let tb = logs.join("tensorboard");
    let Some(read) = read_tensorboard(&tb) else {
        return;
    };
    let scalars = read["scalars"].as_object().unwrap();
    let mut count = 0;
    for ((batch, name), v) in &jsonl {
        let points = scalars[name]
            .as_array()
            .unwrap_or_else(|| panic!("{name} not in TensorBoard"));
        let p = points
            .iter()
            .find(|p| p[0].as_u64() == Some(*batch))
            .unwrap_or_else(|| panic!("{name} has no step {batch} in TensorBoard"));
        let got = p[1].as_f64().unwrap();
        // TensorBoard keeps scalars as 32-bit floats.
        assert_eq!(got as f32, *v as f32, "{name} at {batch}");
        count += 1;
    }
    let tb_total: usize = scalars.values().map(|p| p.as_array().unwrap().len()).sum();
    assert_eq!(
        tb_total, count,
        "TensorBoard holds exactly the logged values"
    );
    let text = read["text"]["hyperparameters"].as_str().unwrap();
    assert!(text.contains("| batch_size | 32 |"), "{text}");
}

#[test]
fn example_trace_nests_and_plot_has_its_size() {
    let dir = tempfile::tempdir().unwrap();
    logged_run(dir.path());

    // The trace: the scheduled steps (2,1,1,3,2: steps 4-6 and 9-11), each phase inside its
    // step, phases in order.
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("logs/trace.json")).unwrap())
            .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let spans: Vec<(&str, u64, f64, f64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (
                e["name"].as_str().unwrap(),
                e["args"]["batch"].as_u64().unwrap(),
                ts,
                ts + e["dur"].as_f64().unwrap(),
            )
        })
        .collect();
    let steps: Vec<_> = spans.iter().filter(|s| s.0 == "train_step").collect();
    assert_eq!(
        steps.iter().map(|s| s.1).collect::<Vec<_>>(),
        [4, 5, 6, 9, 10, 11]
    );
    let mut evals = 0;
    for &(name, batch, start, end) in &spans {
        if name == "train_step" {
            continue;
        }
        let step = steps.iter().find(|s| s.1 == batch);
        match (name, step) {
            (_, Some(s)) => assert!(
                s.2 <= start && end <= s.3,
                "{name} of batch {batch} ({start}-{end}) outside its step ({}-{})",
                s.2,
                s.3
            ),
            ("eval", None) => {}
            _ => panic!("{name} of batch {batch} belongs to no recorded step"),
        }
        evals += usize::from(name == "eval");
    }
    for s in &steps {
        let order: Vec<&str> = spans
            .iter()
            .filter(|p| p.1 == s.1 && p.0 != "train_step" && p.0 != "eval")
            .map(|p| p.0)
            .collect();
        assert_eq!(
            order,
            ["data", "forward", "loss", "backward", "optimizer"],
            "step {}",
            s.1
        );
    }
    // Evaluation every 8 batches: after batch 8 (step 7, not recorded) there is none.
    assert_eq!(evals, 0);
    let markers = events.iter().filter(|e| e["ph"] == "i").count();
    assert!(
        markers >= 6 * 12,
        "every event of a recorded step is marked ({markers})"
    );

    // The plot decodes as a 900x900 RGB image with something drawn on it.
    let file = std::fs::File::open(dir.path().join("out/training.png")).unwrap();
    let mut reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (900, 900));
    let pixels = &buf[..info.buffer_size()];
    let non_white = pixels.chunks(3).filter(|p| p != &[255, 255, 255]).count();
    assert!(
        non_white > 900 * 9,
        "the plot has lines and text ({non_white} pixels)"
    );
}

#[test]
fn example_refuses_bad_observability_flags() {
    for (args, needle) in [
        (vec!["--tensorboard"], "--log-dir"),
        (vec!["--early-stop", "accuracy"], "\"accuracy\""),
        (vec!["--stop-threshold", "test/accuracy=high"], "high"),
        (
            vec!["--log-dir", "/dev/null/x", "--max-duration", "1ba"],
            "/dev/null/x",
        ),
        (
            vec![
                "--log-dir",
                "target/x",
                "--profile",
                "--profile-schedule",
                "1,2",
            ],
            "\"1,2\"",
        ),
    ] {
        let out = run_mnist(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(
            out.stderr.contains(needle) && !out.stderr.contains("panicked"),
            "{args:?}: {}",
            out.stderr
        );
    }
}

#[test]
fn device_memory_is_read_where_the_backend_reports_it() {
    let reader = flashover_examples::device_memory_reader(&device());
    match BACKEND {
        "flex" | "ndarray" => assert!(reader.is_none(), "CPU backends have no device pool"),
        _ => {
            let read = reader.expect("the CubeCL backends report memory");
            let model = MnistCnn::<TB>::new(&device(), 1);
            let m = read().expect("a reading");
            // The weights alone (about 220k f32) are resident on the device.
            assert!(m.in_use >= 4 * 200_000 && m.reserved >= m.in_use, "{m:?}");
            drop(model);
        }
    }
}

#[test]
fn token_throughput_and_time_left_in_tokens_on_a_character_model() {
    use flashover::core::data::BatchSource;
    use flashover::core::model::Batch;
    use flashover::core::trainer::Trainer;
    use flashover_examples::shakespeare::{bundled_shakespeare, token_loader, CharCorpus, CharLm};
    type Lm = CharLm<TB>;
    let corpus = CharCorpus::load(&bundled_shakespeare()).unwrap();
    let dev = device();
    let loader = token_loader::<TB>(&corpus, 64, 16, Some(640), 3, &dev).unwrap();
    let per_batch = loader.iter_from(0, 0).next().unwrap().unwrap().num_tokens();
    assert!(per_batch > 0);
    let model = Lm::new(&dev, corpus.vocab.len(), 32, 3);
    let opt = burn::optim::AdamConfig::new().init::<TB, Lm>();
    let clock = ManualClock::default();
    let tick = clock.clone();
    let log = Logged::default();
    // The run's length in tokens: 20 batches' worth; each batch takes 0.5 s.
    let mut t = Trainer::builder(model, opt, loader, Time::Token(20 * per_batch), dev)
        .callback(Watch {
            event: Event::BatchStart,
            f: move |_: &flashover::core::state::State<
                flashover::core::setup::SetupOf<TB, Lm, _>,
            >,
                     _: &mut Control<'_>| {
                tick.advance(Duration::from_millis(500));
                Ok(())
            },
        })
        .callback(SpeedMonitor::new(3).unwrap().with_clock(clock.clone()))
        .callback(RuntimeEstimator::new(3).unwrap().with_clock(clock.clone()))
        .logger(Capture(log.clone()))
        .build()
        .unwrap();
    t.fit().unwrap();
    let tokens = series(&log, "throughput/tokens_per_sec");
    assert_eq!(tokens.len(), 20);
    assert!(
        tokens
            .values()
            .all(|&v| close(v, 2.0 * per_batch as f64, 1e-9)),
        "{tokens:?}"
    );
    let left = series(&log, "time/remaining_estimate_seconds");
    for (b, v) in left {
        assert!(
            close(v, 0.5 * (20 - b) as f64, 1e-9) || (b == 20 && v == 0.0),
            "batch {b}: {v}"
        );
    }
}

#[test]
fn example_resumed_run_appends_to_its_logs() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let ck = dir.path().join("ck");
    let (logs_s, ck_s) = (logs.to_str().unwrap(), ck.to_str().unwrap());
    let common = ["--log-dir", logs_s, "--save-folder", ck_s, "--autoresume"];
    let first: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--stop-after", "20ba"])
        .collect();
    summary_of(&short_args(&first));
    let (before, _) = read_jsonl(&logs.join("metrics.jsonl"));
    assert_eq!(before.keys().filter(|(_, k)| k == "train/loss").count(), 20);
    let s = summary_of(&short_args(&common));
    assert_eq!(s["batches"], 48);
    let (after, hps) = read_jsonl(&logs.join("metrics.jsonl"));
    assert_eq!(hps.len(), 2, "each process logs the configuration once");
    let losses: Vec<u64> = after
        .keys()
        .filter(|(_, k)| k == "train/loss")
        .map(|(b, _)| *b)
        .collect();
    assert_eq!(
        losses,
        (1..=48).collect::<Vec<_>>(),
        "the first run's lines are kept"
    );
    for (k, v) in &before {
        assert_eq!(after[k].to_bits(), v.to_bits(), "{k:?}");
    }
    let csv = std::fs::read_to_string(logs.join("metrics.csv")).unwrap();
    assert_eq!(
        csv.lines().filter(|l| l.starts_with("epoch,")).count(),
        1,
        "one header"
    );
}

/// Every precision runs with every monitor and logger on (`--log-dir` with TensorBoard and
/// the trace: norms, NaN watch, memory, speed, learning rate, JSONL, CSV), in both examples;
/// the norms are computed in float32 and reach the logs. Before, the norm monitor's
/// concatenation of half and float32 tensors panicked at the first log write. (Here rather
/// than in `precision`, which the GPU subset runs: two examples in four precisions is long
/// on software Vulkan.)
#[test]
fn every_precision_runs_with_every_monitor_and_logger() {
    for p in [
        flashover::core::precision::Precision::Fp16,
        flashover::core::precision::Precision::Bf16,
        flashover::core::precision::Precision::AmpFp16,
        flashover::core::precision::Precision::AmpBf16,
    ] {
        let computes = p.compute_dtype().is_none_or(|d| {
            <TB as burn::tensor::backend::Backend>::supports_dtype(
                &device(),
                burn::tensor::DType::from(d),
            )
        });
        if !computes {
            eprintln!("skipped {p} on {BACKEND}: it does not compute that type on this device");
            continue;
        }
        let name = p.to_string();
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        let logs_s = logs.to_str().unwrap();
        let common = [
            "--max-duration",
            "4ba",
            "--warmup",
            "0ba",
            "--precision",
            &name,
            "--log-dir",
            logs_s,
            "--log-every",
            "1",
            "--tensorboard",
            "--profile",
        ];
        let mut mnist = vec!["--train-limit", "256", "--test-limit", "100"];
        mnist.extend(common);
        let out = run_mnist(&mnist);
        assert!(out.status.success(), "mnist {name}:\n{}", out.stderr);
        let jsonl = std::fs::read_to_string(logs.join("metrics.jsonl")).unwrap();
        let norm = jsonl
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find_map(|v| {
                v["metrics"]
                    .get("l2_norm/grad/global")
                    .and_then(|n| n.as_f64())
            });
        assert!(
            norm.is_some_and(|n| n.is_finite() && n > 0.0),
            "{name}: no finite gradient norm in the logs:\n{jsonl}"
        );
        std::fs::remove_dir_all(&logs).unwrap();
        let gpt: Vec<&str> = [
            "--layers",
            "1",
            "--heads",
            "2",
            "--width",
            "32",
            "--context",
            "32",
            "--seq-len",
            "32",
            "--batch-size",
            "8",
            "--train-windows",
            "64",
            "--val-windows",
            "8",
        ]
        .into_iter()
        .chain(common)
        .collect();
        let out = run_example("shakespeare", &gpt);
        assert!(out.status.success(), "shakespeare {name}:\n{}", out.stderr);
    }
}

/// Records, at the `AFTER_LOSS` of batch 3, the first four images of the batch (after the
/// algorithms), their classes and the model's predictions.
#[derive(Clone, Default)]
struct SeenAtBatch3(Arc<Mutex<Option<Seen>>>);

/// Images (4 x 28 x 28, flat), classes and predictions.
type Seen = (Vec<f32>, Vec<i64>, Vec<usize>);

impl flashover::core::callback::Callback<MnistSetup> for SeenAtBatch3 {
    fn name(&self) -> &str {
        "seen"
    }
    fn after_loss(&mut self, state: &MnistState, _ctl: &mut Control<'_>) -> Result<()> {
        use flashover::core::model::{ClassTargets, ImageBatch, Logits};
        if state.timestamp().batch + 1 != 3 {
            return Ok(());
        }
        let batch = state.batch().unwrap();
        let images: Vec<f32> = batch
            .images()
            .clone()
            .narrow(0, 0, 4)
            .into_data()
            .convert::<f32>()
            .to_vec()
            .unwrap();
        let classes: Vec<i64> = batch
            .classes()
            .clone()
            .narrow(0, 0, 4)
            .into_data()
            .convert::<i64>()
            .to_vec()
            .unwrap();
        let predicted: Vec<usize> = state
            .outputs()
            .unwrap()
            .logits()
            .clone()
            .narrow(0, 0, 4)
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|p| p as usize)
            .collect();
        *self.0.lock().unwrap() = Some((images, classes, predicted));
        Ok(())
    }
}

/// The image visualizer logs the batch as the algorithms left it (here CutOut's holes), with
/// the model's predictions and the true classes: its grid is exactly the one drawn from the
/// batch the model trained on, scaled per image as documented.
#[test]
fn the_image_visualizer_shows_the_batch_as_the_algorithms_left_it() {
    use flashover::callbacks::visualize::{grid, Cell};
    use flashover::callbacks::{ImageVisualizer, InMemoryLogger};
    let run = crate::algorithms::tiny("cutout:num_holes=1:length=0.5");
    let seen = SeenAtBatch3::default();
    let memory = InMemoryLogger::new();
    let mut trainer = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .callback(seen.clone())
        .callback(
            ImageVisualizer::new(Time::Batch(3))
                .unwrap()
                .with_images(4, 2)
                .unwrap(),
        )
        .logger(memory.clone())
        .build()
        .unwrap();
    trainer.fit().unwrap();
    let logged = memory.snapshot();
    let steps: Vec<u64> = logged.images.iter().map(|(t, _, _)| t.batch).collect();
    assert_eq!(steps, [3, 6, 9], "every 3 batches of 9");
    assert!(logged
        .images
        .iter()
        .all(|(_, tag, _)| tag == "inputs/train"));
    let (images, classes, predicted) = seen.0.lock().unwrap().clone().unwrap();

    // CutOut's hole: a block of exact zeros (MNIST's normalised background is -0.42).
    let has_hole = images.chunks(28 * 28).any(|img| {
        (0..=21).any(|y0| {
            (0..=21).any(|x0| (0..7).all(|y| (0..7).all(|x| img[(y0 + y) * 28 + x0 + x] == 0.0)))
        })
    });
    assert!(has_hole, "CutOut left no hole in the first four images");

    let cells: Vec<Cell> = images
        .chunks(28 * 28)
        .zip(&classes)
        .zip(&predicted)
        .map(|((img, &class), &pred)| {
            let lo = img.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = img.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            Cell {
                pixels: img
                    .iter()
                    .map(|&v| ((v - lo) / (hi - lo) * 255.0).round() as u8)
                    .collect(),
                channels: 1,
                height: 28,
                width: 28,
                predicted: pred.to_string(),
                truth: class.to_string(),
                correct: pred as i64 == class,
            }
        })
        .collect();
    let expected = grid(&cells, 2).unwrap();
    assert_eq!(logged.images[0].2, expected, "the grid of batch 3");
    let caption = &logged
        .texts
        .iter()
        .find(|(t, tag, _)| t.batch == 3 && tag == "inputs/train/labels")
        .unwrap()
        .2;
    let pairs: Vec<String> = predicted
        .iter()
        .zip(&classes)
        .map(|(p, c)| format!("{p}/{c}"))
        .collect();
    assert!(caption.ends_with(&pairs.join(" ")), "{caption}");
}
