//! Experiment tracking in a real MLflow tracking server (`mlflow server` with a SQLite store
//! and a local artifact root, started by each test; skipped with a note where `mlflow` is not
//! installed), read back with MLflow's own Python client: the MNIST example's params, every
//! metric's full history, tags and artifacts (plot, weights, summary, images, checkpoints), a
//! resumed run appending to the same MLflow run; a server stopped mid-run and restarted loses
//! no metric; a server that is down costs the run only warnings; credentials from the
//! environment reach a server with MLflow's basic-auth app and are never printed. Images through every logger:
//! TensorBoard's reader sees them, the log folder holds them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flashover::callbacks::{InMemoryLogger, MlflowLogger, MlflowOptions};
use flashover::core::toy;
use flashover::prelude::*;
use serde_json::Value;

use crate::support::{self, MlflowServer, TB};

/// The JSONL log as (batch, metric) -> value, and its image lines.
fn jsonl(path: &Path) -> (BTreeMap<(u64, String), f64>, Vec<Value>) {
    let log = support::read_jsonl(path);
    (log.values, log.images)
}

/// The batches at which `metric` was logged, in order.
fn steps_of<V>(values: &BTreeMap<(u64, String), V>, metric: &str) -> Vec<u64> {
    values
        .keys()
        .filter(|(_, k)| k == metric)
        .map(|(b, _)| *b)
        .collect()
}

/// The run's metrics as (step, metric) -> values (every point of every history).
fn histories(run: &Value) -> BTreeMap<(u64, String), Vec<f64>> {
    let mut out: BTreeMap<(u64, String), Vec<f64>> = BTreeMap::new();
    for (k, points) in run["metrics"].as_object().unwrap() {
        for p in points.as_array().unwrap() {
            let v = match &p[1] {
                Value::String(s) => s.parse().unwrap(),
                n => n.as_f64().unwrap(),
            };
            out.entry((p[0].as_u64().unwrap(), k.clone()))
                .or_default()
                .push(v);
        }
    }
    out
}

/// The SHA-256 of a file, as the TensorBoard reader script prints an image's.
fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    flashover::checkpoint::format::sha256_hex(&bytes)
}

#[test]
fn mlflow_holds_the_examples_run_and_a_resumed_run_continues_it() {
    let Some(server) = MlflowServer::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).to_string_lossy().into_owned();
    let (logs, out, ck) = (p("logs"), p("out"), p("ck"));
    let uri = server.uri();
    let run = |max_duration: &str, extra: &[&str]| {
        let mut args = support::short_args(&[
            "--max-duration",
            max_duration,
            "--eval-interval",
            "8ba",
            "--log-every",
            "4",
            "--log-dir",
            &logs,
            "--tensorboard",
            "--out",
            &out,
            "--visualize-images",
            "8",
            "--save-folder",
            &ck,
            "--save-interval",
            "8ba",
            "--algorithms",
            "cutout:num_holes=1:length=0.5",
            "--mlflow",
            &uri,
            "--mlflow-experiment",
            "digits",
            "--mlflow-run-name",
            "cnn-cutout",
            "--mlflow-checkpoints",
        ]);
        args.extend(extra);
        let o = support::run_mnist(&args);
        assert!(o.status.success(), "{}", o.stderr);
        o
    };
    // Interrupted at batch 12 (a checkpoint there), then resumed and lengthened to batch 32:
    // MLflow keeps a param's first value, so the new one becomes a tag, with a warning.
    let first = run("24ba", &["--stop-after", "12ba"]);
    assert!(!first.stderr.contains("WARN"), "{}", first.stderr);
    let second = run("32ba", &["--autoresume"]);
    let warnings: Vec<&str> = second
        .stderr
        .lines()
        .filter(|l| l.contains("WARN"))
        .collect();
    assert_eq!(warnings.len(), 1, "{}", second.stderr);
    assert!(
        warnings[0].contains("MLflow params cannot change")
            && warnings[0].contains("max_duration: 24ba -> 32ba"),
        "{}",
        warnings[0]
    );

    let read = server.read("digits");
    let runs = read["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "a resumed run is one MLflow run: {read}");
    let mlrun = &runs[0];
    assert_eq!(mlrun["name"], "cnn-cutout");
    assert_eq!(mlrun["status"], "FINISHED");

    // Every value of the local logs is in MLflow once, at its step, exactly.
    let logs = Path::new(&logs);
    let (local, image_lines) = jsonl(&logs.join("metrics.jsonl"));
    let remote = histories(mlrun);
    assert_eq!(
        remote.keys().collect::<BTreeSet<_>>(),
        local.keys().collect::<BTreeSet<_>>(),
        "MLflow holds the same (step, metric) pairs as metrics.jsonl"
    );
    for (key, v) in &local {
        assert_eq!(remote[key].len(), 1, "{key:?} logged once");
        assert_eq!(remote[key][0].to_bits(), v.to_bits(), "{key:?}");
    }
    assert_eq!(
        steps_of(&remote, "train/loss"),
        (1..=32).collect::<Vec<_>>()
    );

    // Params: the hyperparameters, as MLflow's strings (the resumed run's; max_duration
    // changed, and is a tag).
    let hp: Value = serde_json::from_str(
        &std::fs::read_to_string(logs.join("metrics.hyperparameters.json")).unwrap(),
    )
    .unwrap();
    let params = mlrun["params"].as_object().unwrap();
    for (k, v) in hp.as_object().unwrap() {
        let want = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if k == "max_duration" {
            assert_eq!(params[k], "24ba");
            assert_eq!(mlrun["tags"]["flashover.param.max_duration"], "32ba");
            continue;
        }
        assert_eq!(params[k].as_str(), Some(want.as_str()), "param {k}");
    }
    assert_eq!(params.len(), hp.as_object().unwrap().len());
    let tags = &mlrun["tags"];
    assert_eq!(tags["flashover.world_size"], "1");
    assert_eq!(tags["flashover.precision"], "fp32");
    assert_eq!(tags["flashover.algorithms"], "cutout");
    assert!(tags["flashover.backend"]
        .as_str()
        .unwrap()
        .contains(support::BACKEND));
    assert_eq!(tags["mlflow.source.name"], "mnist");
    assert!(tags["flashover_run_uid"].as_str().unwrap().len() >= 16);
    // The commit, where the example runs inside a git checkout (the tests do).
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if let Some(head) = head {
        assert_eq!(
            tags["mlflow.source.git.commit"].as_str(),
            Some(head.as_str())
        );
    }

    // Artifacts: the plot, the final weights, the summary, the configuration, the images
    // and every checkpoint, byte for byte.
    let experiment = read["experiment_id"].as_str().unwrap();
    let run_id = mlrun["run_id"].as_str().unwrap();
    let artifacts: BTreeMap<String, u64> = mlrun["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a[0].as_str().unwrap().to_string(), a[1].as_u64().unwrap()))
        .collect();
    let stored = |name: &str| server.artifact(experiment, run_id, name);
    for (name, local) in [
        (
            "model.safetensors",
            Path::new(&out).join("model.safetensors"),
        ),
        ("training.png", Path::new(&out).join("training.png")),
    ] {
        assert!(artifacts.contains_key(name), "{name} in {artifacts:?}");
        assert_eq!(sha256(&stored(name)), sha256(&local), "{name}");
    }
    let summary: Value =
        serde_json::from_slice(&std::fs::read(stored("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["batches"], 32);
    assert_eq!(
        summary["test_accuracy"],
        second.summary.as_ref().unwrap()["test_accuracy"]
    );
    assert!(artifacts.contains_key("hyperparameters.json"));
    let checkpoints: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| Path::new(&ck).join(n).join("manifest.json").is_file())
        .collect();
    assert!(checkpoints.len() >= 3, "{checkpoints:?}");
    for name in &checkpoints {
        for file in std::fs::read_dir(Path::new(&ck).join(name)).unwrap() {
            let file = file.unwrap();
            let artifact = format!("checkpoints/{name}/{}", file.file_name().to_string_lossy());
            assert_eq!(
                sha256(&stored(&artifact)),
                sha256(&file.path()),
                "{artifact}"
            );
        }
    }

    // The image visualizer's grids: in the JSONL (with a file in media/), in MLflow and in
    // TensorBoard, the same PNG at batches 8, 16, 24 and 32.
    let steps: Vec<u64> = image_lines
        .iter()
        .map(|i| i["path"].as_str().unwrap().to_string())
        .map(|p| {
            Path::new(&p)
                .file_stem()
                .unwrap()
                .to_string_lossy()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [8, 16, 24, 32]);
    let tb = support::read_tensorboard(&logs.join("tensorboard"));
    for (line, step) in image_lines.iter().zip(steps) {
        assert_eq!(line["tag"], "inputs/train");
        let local = logs.join(line["path"].as_str().unwrap());
        let name = format!("images/inputs/train/{step:08}.png");
        assert_eq!(sha256(&stored(&name)), sha256(&local), "{name}");
        let decoder = png::Decoder::new(std::fs::File::open(&local).unwrap());
        let info = decoder.read_info().unwrap();
        assert_eq!(
            (info.info().width as u64, info.info().height as u64),
            (
                line["width"].as_u64().unwrap(),
                line["height"].as_u64().unwrap()
            )
        );
        if let Some(tb) = &tb {
            let seen = tb["images"]["inputs/train"]
                .as_array()
                .unwrap()
                .iter()
                .find(|i| i[0].as_u64() == Some(step))
                .unwrap_or_else(|| panic!("TensorBoard has no image at step {step}"));
            assert_eq!(seen[1], line["width"]);
            assert_eq!(seen[2], line["height"]);
            assert_eq!(seen[3].as_str().unwrap(), sha256(&local));
        }
        let labels = format!("text/inputs/train/labels/{step:08}.txt");
        assert!(artifacts.contains_key(&labels), "{labels}");
    }
}

/// A callback that stops the server after one batch and brings it back after another
/// (blocking the run until it answers, as a long run would go on meanwhile).
struct Outage {
    server: Arc<Mutex<MlflowServer>>,
    stop_at: u64,
    restart_at: u64,
}

impl<S: Setup> Callback<S> for Outage {
    fn name(&self) -> &str {
        "outage"
    }
    fn batch_end(&mut self, state: &State<S>, _ctl: &mut Control<'_>) -> Result<(), CoreError> {
        let batch = state.timestamp().batch;
        if batch == self.stop_at {
            self.server.lock().unwrap().stop();
        }
        if batch == self.restart_at {
            self.server.lock().unwrap().restart();
        }
        Ok(())
    }
}

#[test]
fn a_server_stopped_mid_run_and_restarted_loses_no_metric() {
    let Some(server) = MlflowServer::start() else {
        return;
    };
    let uri = server.uri();
    let server = Arc::new(Mutex::new(server));
    let mut options = MlflowOptions::new(&uri);
    options.experiment = "outage".into();
    options.flush_interval = Duration::from_millis(100);
    options.max_backoff = Duration::from_secs(1);
    options.warn_after = 2;
    let mlflow = MlflowLogger::new(options).unwrap();
    let handle = mlflow.handle();
    let memory = InMemoryLogger::new();
    // 40 batches of a one-weight regression; the server is away from batch 10 to batch 30.
    let mut trainer = toy::trainer::<TB>(toy::points(40, 1), Time::Batch(40))
        .logger(mlflow)
        .logger(memory.clone())
        .callback(Outage {
            server: server.clone(),
            stop_at: 10,
            restart_at: 30,
        })
        .build()
        .unwrap();
    trainer.fit().unwrap();
    drop(trainer);
    let report = handle.finish();
    assert_eq!(report.metrics_unsent, 0, "{report:?}");
    assert!(
        report.failed_requests >= 1,
        "the outage was seen: {report:?}"
    );
    assert_eq!(report.ended_as.as_deref(), Some("FINISHED"));

    let read = server.lock().unwrap().read("outage");
    let runs = read["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1);
    let remote = histories(&runs[0]);
    let logged = memory.snapshot();
    let mut count = 0;
    for (name, points) in &logged.metrics {
        for (ts, v) in points {
            let got = remote
                .get(&(ts.batch, name.clone()))
                .unwrap_or_else(|| panic!("{name} at batch {} lost", ts.batch));
            // A request whose answer the outage cut off may have been stored and sent again:
            // duplicates are possible, losses are not.
            assert!(
                got.iter().all(|g| g.to_bits() == v.to_bits()),
                "{name} at {}",
                ts.batch
            );
            count += 1;
        }
    }
    assert_eq!(logged.values("train/loss").len(), 40);
    assert!(count >= 40, "{count}");
    assert_eq!(
        remote
            .keys()
            .map(|(_, k)| k.clone())
            .collect::<BTreeSet<_>>(),
        logged.metrics.keys().cloned().collect::<BTreeSet<_>>()
    );
}

#[test]
fn a_server_that_is_down_costs_the_run_only_warnings() {
    // A port nothing listens on: the run trains to the end, warns, and its local logs are
    // whole; the end waits no longer than --mlflow-finish-timeout.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let uri = format!("http://user:pw-never-shown@127.0.0.1:{port}");
    let started = std::time::Instant::now();
    let o = support::run_mnist(&support::short_args(&[
        "--max-duration",
        "24ba",
        "--log-dir",
        logs.to_str().unwrap(),
        "--mlflow",
        &uri,
        "--mlflow-finish-timeout",
        "3s",
    ]));
    assert!(o.status.success(), "{}", o.stderr);
    assert!(started.elapsed() < Duration::from_secs(60));
    let warning = o
        .stderr
        .lines()
        .find(|l| l.contains("MLflow did not take everything"))
        .unwrap_or_else(|| panic!("no warning at the end: {}", o.stderr));
    // It names the server and why (no answer to the first request).
    assert!(
        warning.contains(&format!("127.0.0.1:{port}"))
            && warning.contains("experiments/get-by-name"),
        "{warning}"
    );
    assert!(!o.stderr.contains("pw-never-shown"), "{}", o.stderr);
    let (local, _) = jsonl(&logs.join("metrics.jsonl"));
    assert_eq!(steps_of(&local, "train/loss"), (1..=24).collect::<Vec<_>>());
}

#[test]
fn bad_mlflow_settings_are_errors_naming_them() {
    for (uri, want) in [
        ("file:///tmp/mlruns", "tracking_uri"),
        ("databricks", "tracking_uri"),
        ("http://", "tracking_uri"),
    ] {
        let o = support::run_mnist(&support::short_args(&[
            "--max-duration",
            "1ba",
            "--mlflow",
            uri,
        ]));
        assert!(!o.status.success());
        assert!(
            o.stderr.contains("--mlflow")
                && o.stderr.contains(want)
                && o.stderr.contains("http://host:port"),
            "{uri}: {}",
            o.stderr
        );
    }
    let o = support::run_mnist(&support::short_args(&[
        "--max-duration",
        "1ba",
        "--mlflow",
        "http://127.0.0.1:1",
        "--mlflow-checkpoints",
    ]));
    assert!(!o.status.success());
    assert!(o.stderr.contains("--save-folder"), "{}", o.stderr);
}

#[test]
fn credentials_come_from_the_environment_and_are_never_printed() {
    // MLflow's basic-auth app: requests without the admin's password are refused (401).
    let password = "pw-7c1e-never-printed";
    let Some(server) = MlflowServer::start_with_basic_auth(password) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let uri = server.uri();
    let run = |pw: &str, experiment: &str| {
        let logs = dir.path().join(experiment);
        let args = support::short_args(&[
            "--max-duration",
            "24ba",
            "--log-dir",
            logs.to_str().unwrap(),
            "--mlflow",
            &uri,
            "--mlflow-experiment",
            experiment,
            "--mlflow-finish-timeout",
            "20s",
        ]);
        let o = support::run_example_env(
            "mnist",
            &args,
            &[
                ("MLFLOW_TRACKING_USERNAME", "admin".to_string()),
                ("MLFLOW_TRACKING_PASSWORD", pw.to_string()),
            ],
        );
        assert!(o.status.success(), "{}", o.stderr);
        assert!(
            !o.stderr.contains(pw),
            "the password is printed: {}",
            o.stderr
        );
        o
    };
    let good = run(password, "with-auth");
    assert!(!good.stderr.contains("WARN"), "{}", good.stderr);
    let read = server.read("with-auth");
    let runs = read["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{read}");
    assert_eq!(
        runs[0]["metrics"]["train/loss"].as_array().unwrap().len(),
        24
    );

    // A wrong password: the server refuses, the run says so once and trains on.
    let bad = run("wrong-password-1234", "refused");
    let warning = bad
        .stderr
        .lines()
        .find(|l| l.contains("MLflow refused to open the run"))
        .unwrap_or_else(|| {
            panic!(
                "no refusal warning: {}\nserver log: {}",
                bad.stderr,
                std::fs::read_to_string(server.root.path().join("server.log")).unwrap_or_default()
            )
        });
    assert!(warning.contains("401"), "{warning}");
    assert!(server.read("refused")["runs"]
        .as_array()
        .is_none_or(|r| r.is_empty()));
}
