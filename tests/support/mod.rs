//! Shared test support for the cross-crate tests: the backend under test, recording
//! callbacks, algorithms and loggers, and helpers to read gradients and build short MNIST
//! runs. Tests import from here instead of copying these pieces.
//!
//! A module of the test binary, not a library of its own: a library would compile the trainer
//! for the backend under test once for itself and again for the binary (release builds share
//! no generic code between crates), about 3 of a 2-core machine's minutes per backend.

use std::sync::{Arc, Mutex};

pub mod mpi;
pub mod skip;
pub mod threads;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
pub use flashover::core::callback::Control;
use flashover::core::callback::{Algorithm, Callback};
use flashover::core::error::Result;
use flashover::core::event::Event;
use flashover::core::logger::{Logger, LoggerDestination};
use flashover::core::setup::Setup;
use flashover::core::state::State;
use flashover::core::time::{Progress, Time, Timestamp};
use flashover_examples::{MnistData, MnistRun};

/// The inner backend the tests run on: the most specific one compiled in.
#[cfg(feature = "cuda")]
pub type Inner = flashover::backend::Cuda;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
pub type Inner = flashover::backend::Wgpu;
#[cfg(all(feature = "ndarray", not(any(feature = "wgpu", feature = "cuda"))))]
pub type Inner = flashover::backend::NdArray;
#[cfg(all(
    feature = "flex",
    not(any(feature = "ndarray", feature = "wgpu", feature = "cuda"))
))]
pub type Inner = flashover::backend::Flex;

/// The name of [`Inner`] as the example's `--backend` flag spells it.
#[cfg(feature = "cuda")]
pub const BACKEND: &str = "cuda";
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
pub const BACKEND: &str = "wgpu";
#[cfg(all(feature = "ndarray", not(any(feature = "wgpu", feature = "cuda"))))]
pub const BACKEND: &str = "ndarray";
#[cfg(all(
    feature = "flex",
    not(any(feature = "ndarray", feature = "wgpu", feature = "cuda"))
))]
pub const BACKEND: &str = "flex";

/// The autodiff backend the tests train on.
pub type TB = flashover::backend::Autodiff<Inner>;

/// A shared, ordered log of what happened.
pub type Log = Arc<Mutex<Vec<String>>>;

pub fn new_log() -> Log {
    Arc::new(Mutex::new(Vec::new()))
}

pub fn lines(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// Records every event it sees as `"{prefix}{EVENT}"`.
pub struct Recorder {
    pub prefix: String,
    pub log: Log,
}

impl<S: Setup> Callback<S> for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn run_event(&mut self, event: Event, _state: &State<S>, _ctl: &mut Control<'_>) -> Result<()> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{}{}", self.prefix, event.name()));
        Ok(())
    }
}

/// An algorithm that matches every event and records `"{name} {EVENT}"`.
pub struct RecordingAlgorithm {
    pub name: String,
    pub log: Log,
}

impl<S: Setup> Algorithm<S> for RecordingAlgorithm {
    fn name(&self) -> &str {
        &self.name
    }
    fn matches(&self, _event: Event, _state: &State<S>) -> bool {
        true
    }
    fn apply(&mut self, event: Event, _state: &mut State<S>, _logger: &mut Logger) -> Result<()> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {}", self.name, event.name()));
        Ok(())
    }
}

/// A logger destination that records `"{name} {EVENT}"` at every event.
pub struct RecordingLogger {
    pub name: String,
    pub log: Log,
}

impl LoggerDestination for RecordingLogger {
    fn name(&self) -> &str {
        &self.name
    }
    fn run_event(&mut self, event: Event, _ts: &Timestamp, _p: &Progress) -> Result<()> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {}", self.name, event.name()));
        Ok(())
    }
}

/// An algorithm that runs a closure at one event (for tests that need to poke the state,
/// through the mutators an algorithm has).
pub struct At<F> {
    pub event: Event,
    pub f: F,
}

impl<S, F> Algorithm<S> for At<F>
where
    S: Setup,
    F: FnMut(&mut State<S>) -> Result<()> + Send,
{
    fn name(&self) -> &str {
        "at"
    }
    fn matches(&self, event: Event, _state: &State<S>) -> bool {
        event == self.event
    }
    fn apply(&mut self, _event: Event, state: &mut State<S>, _logger: &mut Logger) -> Result<()> {
        (self.f)(state)
    }
}

/// A callback that runs a closure at one event (for tests that watch the state, or stop the
/// run through the callback's control).
pub struct Watch<F> {
    pub event: Event,
    pub f: F,
}

impl<S, F> Callback<S> for Watch<F>
where
    S: Setup,
    F: FnMut(&State<S>, &mut Control<'_>) -> Result<()> + Send,
{
    fn name(&self) -> &str {
        "watch"
    }
    fn run_event(&mut self, event: Event, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        if event == self.event {
            (self.f)(state, ctl)
        } else {
            Ok(())
        }
    }
}

struct FlatGrads<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    out: Vec<f32>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for FlatGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let g: Tensor<B::InnerBackend, D> = self
            .grads
            .get(param.id)
            .unwrap_or_else(|| panic!("no gradient for parameter {:?}", param.id));
        self.out
            .extend(g.into_data().to_vec::<f32>().expect("float gradients"));
    }
}

/// The largest absolute difference between two equally long lists of values.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every parameter's gradient, flattened in the module's field order.
pub fn flat_grads<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<f32> {
    let mut v = FlatGrads::<B> {
        grads,
        out: Vec::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut v);
    v.out
}

/// A short MNIST run: `train` digits in batches of `batch_size`, `test` digits evaluated in
/// one or more batches of up to 500, constant learning rate, for `max_duration`.
pub fn short_run(train: usize, batch_size: usize, test: usize, max_duration: &str) -> MnistRun {
    let mut data = MnistData::bundled(batch_size, 7);
    data.train_limit = Some(train);
    data.test_limit = Some(test);
    data.eval_batch_size = test.clamp(1, 500);
    MnistRun {
        data,
        max_duration: max_duration
            .parse::<Time>()
            .expect("test durations are valid"),
        scheduler: flashover::core::schedule::Scheduler::constant(),
        seed: 7,
        ..MnistRun::default()
    }
}

/// In one process, the run the example makes of `SHORT` plus `--max-duration max_duration`
/// (512 training and 200 test digits, batches of 32, the example's seed, warmup and cosine
/// schedule): for tests that a GPU backend's subset runs without an example program.
pub fn short_example_run(max_duration: &str) -> MnistRun {
    let defaults = MnistRun::default();
    let mut data = MnistData::bundled(32, defaults.seed);
    data.train_limit = Some(512);
    data.test_limit = Some(200);
    MnistRun {
        data,
        max_duration: max_duration
            .parse::<Time>()
            .expect("test durations are valid"),
        scheduler: flashover::core::schedule::Scheduler::cosine(Time::Duration(1.0), 0.0)
            .with_warmup(Time::Batch(20)),
        ..defaults
    }
}

/// The example's optimizer (AdamW over the MNIST CNN) on the test backend.
pub type MnistOptimizer = burn::optim::adaptor::OptimizerAdaptor<
    burn::optim::AdamW,
    flashover_examples::MnistCnn<TB>,
    TB,
>;

/// The trainer the example builds (MNIST CNN, AdamW) on the test backend.
pub type MnistTrainer = flashover::core::trainer::Trainer<MnistSetup>;

/// The setup of that trainer.
pub type MnistSetup =
    flashover::core::setup::SetupOf<TB, flashover_examples::MnistCnn<TB>, MnistOptimizer>;

/// The state of that trainer.
pub type MnistState = flashover::core::state::State<MnistSetup>;

/// `run` with the example's AdamW and nothing else registered, trained to its `max_duration`.
pub fn trained(run: &MnistRun) -> MnistTrainer {
    let mut t = run
        .builder::<TB, _>(MnistRun::adamw::<TB>(), &device())
        .unwrap()
        .build()
        .unwrap();
    t.fit().unwrap();
    t
}

/// The device tests run on.
pub fn device() -> <TB as burn::tensor::backend::BackendTypes>::Device {
    Default::default()
}

/// Set (to anything) where no example program may be started: see [`example_bin`].
pub const NO_EXAMPLE_PROGRAMS: &str = "FLASHOVER_NO_EXAMPLE_PROGRAMS";

/// A built example program, next to this test binary (`cargo test --workspace` builds the
/// examples; `cargo test -p flashover-tests` alone does not).
///
/// With `NO_EXAMPLE_PROGRAMS` set: the test is being run as one of a GPU backend's subset, which
/// builds no example program, and fails at once saying so.
pub fn example_bin(name: &str) -> std::path::PathBuf {
    assert!(
        std::env::var_os(NO_EXAMPLE_PROGRAMS).is_none(),
        "this test starts the example program `{name}`, and the GPU backends' test subset \
         (GPU_SUBSET in xtask/src/build.rs) builds none: put the test's in-process form in the \
         subset instead"
    );
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binaries live in <target>/<profile>/deps");
    let bin = profile_dir.join("examples").join(name);
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build --release --example {name}` (or run `cargo test --release --workspace`)",
        bin.display()
    );
    bin
}

/// Output of one run of the MNIST example.
#[derive(Debug)]
pub struct RunOutput {
    pub status: std::process::ExitStatus,
    pub summary: Option<serde_json::Value>,
    pub stderr: String,
}

/// Runs the MNIST example with `args` (plus `--no-progress`) and parses its summary line.
pub fn run_mnist(args: &[&str]) -> RunOutput {
    run_example("mnist", args)
}

/// Runs the example `name` with `args` (plus `--no-progress` and the suite's backend) and
/// parses its summary line.
pub fn run_example(name: &str, args: &[&str]) -> RunOutput {
    run_example_env(name, args, &[])
}

/// The arguments of a short MNIST run: 512 digits in batches of 32 (16 batches per epoch),
/// 200 test digits, 20 batches of warmup; 3 epochs unless `extra` sets `--max-duration`.
pub const SHORT: &[&str] = &[
    "--train-limit",
    "512",
    "--test-limit",
    "200",
    "--batch-size",
    "32",
    "--warmup",
    "20ba",
];

/// `SHORT` plus `extra` (and `--max-duration 3ep` unless `extra` sets it).
pub fn short_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = SHORT.iter().copied().chain(extra.iter().copied()).collect();
    if !extra.contains(&"--max-duration") {
        v.extend(["--max-duration", "3ep"]);
    }
    v
}

/// Runs the example and returns its summary, failing the test with its stderr otherwise.
pub fn summary_of(args: &[&str]) -> serde_json::Value {
    let out = run_mnist(args);
    assert!(
        out.status.success(),
        "mnist {args:?} failed:\n{}",
        out.stderr
    );
    out.summary
        .unwrap_or_else(|| panic!("mnist {args:?} printed no summary:\n{}", out.stderr))
}

/// The fields of a summary that an exact resumption must reproduce.
pub fn outcome(s: &serde_json::Value) -> (String, String, String, u64) {
    (
        s["params_sha256"].as_str().unwrap_or_default().to_string(),
        s["test_accuracy"].to_string(),
        s["test_loss"].to_string(),
        s["batches"].as_u64().unwrap_or(0),
    )
}

/// The batch count of the checkpoint `folder/latest` names (`ep2-ba35` -> 35), 0 if none.
pub fn latest_batch(folder: &std::path::Path) -> u64 {
    flashover::checkpoint::format::read_latest(folder)
        .and_then(|name| name.rsplit_once("-ba").and_then(|(_, b)| b.parse().ok()))
        .unwrap_or(0)
}

/// Waits until `child` has saved a checkpoint at least `batches` batches past `from` (by
/// `folder/latest`), then `extra` longer, so that a kill lands at a random point of the
/// following steps and saves whatever the machine's speed: returns `true` then, or `false`
/// if the child ended first. Gives up (and returns `true`, leaving the kill to the caller)
/// after `deadline`.
pub fn wait_for_progress(
    child: &mut std::process::Child,
    folder: &std::path::Path,
    from: u64,
    batches: u64,
    extra: std::time::Duration,
    deadline: std::time::Duration,
) -> bool {
    let started = std::time::Instant::now();
    while latest_batch(folder) < from + batches && started.elapsed() < deadline {
        if child.try_wait().expect("the child can be polled").is_some() {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    std::thread::sleep(extra);
    child.try_wait().expect("the child can be polled").is_none()
}

/// What TensorBoard's own `EventAccumulator` reads from the log folder `dir`
/// (`tests/scripts/read_tensorboard.py`: scalars, and text summaries by tag), or `None`,
/// with a recorded skip (see [`skip`]), when python3 or the `tensorboard` package is missing and
/// `FLASHOVER_REQUIRE_TENSORBOARD` is unset (`.ci/run` installs it and sets it).
pub fn read_tensorboard(dir: &std::path::Path) -> Option<serde_json::Value> {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/read_tensorboard.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(dir)
        .output();
    let required = std::env::var_os("FLASHOVER_REQUIRE_TENSORBOARD").is_some();
    let out = match out {
        Ok(o) if o.status.code() == Some(3) && !required => {
            skip::skipped(skip::Need::TensorBoard, "python3 cannot import tensorboard");
            return None;
        }
        Ok(o) => o,
        Err(e) if !required => {
            skip::skipped(skip::Need::TensorBoard, &format!("no python3: {e}"));
            return None;
        }
        Err(e) => panic!("python3: {e}"),
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("the reader prints JSON"))
}

/// The access key the test S3 server accepts.
pub const S3_ACCESS_KEY: &str = "flashover-test-access";
/// The secret key the test S3 server accepts; tests grep every output for it.
pub const S3_SECRET_KEY: &str = "flashover-test-secret-7d1f9c3a";

/// A real S3-compatible server process (`s3s-fs`, which verifies SigV4 signatures) on a free
/// port of 127.0.0.1, serving a temporary folder in which each bucket is a directory and each
/// object a file (so tests can damage objects on disk). Stopped when dropped.
pub struct S3Server {
    bin: std::path::PathBuf,
    child: Option<std::process::Child>,
    /// The folder it serves (`root/<bucket>/<key>`).
    pub root: tempfile::TempDir,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl S3Server {
    /// Starts the server with `buckets` created, or returns `None` (with a recorded skip)
    /// when `s3s-fs` is not installed and `FLASHOVER_REQUIRE_S3` is unset (`.ci/run`
    /// installs it: `cargo install s3s-fs --version 0.14.1 --locked --features binary`).
    pub fn start(buckets: &[&str]) -> Option<S3Server> {
        let home = std::env::var_os("CARGO_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo"))
            });
        let candidates = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .chain(home.map(|h| h.join("bin")));
        let bin = candidates.map(|d| d.join("s3s-fs")).find(|p| p.is_file());
        let Some(bin) = bin else {
            skip::skipped(
                skip::Need::S3sFs,
                "s3s-fs is not on PATH or in ~/.cargo/bin",
            );
            return None;
        };
        let root = tempfile::tempdir().expect("a temporary folder");
        for b in buckets {
            std::fs::create_dir(root.path().join(b)).expect("a bucket directory");
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut server = S3Server {
            bin,
            child: None,
            root,
            port,
        };
        server.restart();
        Some(server)
    }

    /// The endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The environment a client needs: endpoint, region and the keys.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY.into()),
        ]
    }

    /// The object `key` of `bucket` as the server stores it.
    pub fn object(&self, bucket: &str, key: &str) -> std::path::PathBuf {
        key.split('/')
            .fold(self.root.path().join(bucket), |p, s| p.join(s))
    }

    /// Kills the server (SIGKILL) and waits for it; the port is then closed.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server (again) on the same port and folder, and waits until it accepts
    /// connections.
    pub fn restart(&mut self) {
        self.stop();
        let child = std::process::Command::new(&self.bin)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", S3_ACCESS_KEY, "--secret-key", S3_SECRET_KEY])
            .arg(self.root.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("s3s-fs starts");
        self.child = Some(child);
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "s3s-fs did not listen on port {} within 20 s",
                self.port
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The example `name` with `args` (plus `--no-progress`, the suite's backend and
/// `RUST_LOG=info`) and the environment `env`, added to the test's after removing every
/// `AWS_*` and `MLFLOW_*` variable (so that only what a test gives reaches an object store or
/// a tracking server).
pub fn example_command(name: &str, args: &[&str], env: &[(&str, String)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(example_bin(name));
    cmd.args(args)
        .args(["--no-progress", "--backend", BACKEND])
        .env("RUST_LOG", "info");
    for (k, _) in std::env::vars_os() {
        let key = k.to_string_lossy();
        if key.starts_with("AWS_") || key.starts_with("MLFLOW_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// [`run_example`] with the environment `env` (see [`example_command`]).
pub fn run_example_env(name: &str, args: &[&str], env: &[(&str, String)]) -> RunOutput {
    let out = example_command(name, args, env)
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok());
    RunOutput {
        status: out.status,
        summary,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Writes a test dataset with the real Python writers (`tests/scripts/write_shards.py`:
/// mosaicml-streaming's `MDSWriter`, pyarrow's Parquet writer) and returns what the script
/// says it wrote, or `None`, with a recorded skip, when python3 or a package is missing and
/// `FLASHOVER_REQUIRE_PYWRITERS` is unset (`.ci/run` installs them and sets it).
pub fn write_shards(args: &[&str]) -> Option<serde_json::Value> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/write_shards.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args(args)
        .output();
    let need = skip::Need::PyWriters;
    let out = match out {
        Ok(o) if o.status.code() == Some(3) && !need.is_required() => {
            skip::skipped(need, "python3 cannot import mosaicml-streaming or pyarrow");
            return None;
        }
        Ok(o) => o,
        Err(e) if !need.is_required() => {
            skip::skipped(need, &format!("no python3: {e}"));
            return None;
        }
        Err(e) => panic!("python3: {e}"),
    };
    assert!(
        out.status.success(),
        "write_shards.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("the writer prints JSON"))
}

/// Runs the `shards` converter (`cargo xtask shards`) with `args`, failing the test with its
/// stderr if it fails.
pub fn write_example_shards(args: &[&str]) {
    let o = std::process::Command::new(example_bin("shards"))
        .args(args)
        .output()
        .expect("the shards example starts");
    assert!(
        o.status.success(),
        "shards {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A real MLflow tracking server (`mlflow server` from Python's `mlflow` package) on a free
/// port of 127.0.0.1, with a SQLite backend store and a local artifact root in a temporary
/// folder, serving artifacts itself (its default). Stopped (its whole process group) when
/// dropped; [`restart`](Self::restart) brings it back on the same port and store.
pub struct MlflowServer {
    child: Option<std::process::Child>,
    /// With MLflow's basic-auth app: the admin's password (user `admin`).
    admin_password: Option<String>,
    /// The folder holding `mlflow.db` and `artifacts/`.
    pub root: tempfile::TempDir,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl MlflowServer {
    /// Starts the server, or returns `None` (with a recorded skip) when `mlflow` is not
    /// installed and `FLASHOVER_REQUIRE_MLFLOW` is unset (`.ci/run` installs it).
    pub fn start() -> Option<MlflowServer> {
        Self::start_with(None)
    }

    /// As [`start`](Self::start), with MLflow's basic-auth app: every request must carry
    /// the user `admin` and `password` (needs `pip install 'mlflow[auth]'`).
    pub fn start_with_basic_auth(password: &str) -> Option<MlflowServer> {
        Self::start_with(Some(password.to_string()))
    }

    fn start_with(admin_password: Option<String>) -> Option<MlflowServer> {
        let found = std::process::Command::new("mlflow")
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        match found {
            Ok(s) if s.success() => {}
            other => {
                skip::skipped(
                    skip::Need::Mlflow,
                    &format!("`mlflow --version` did not run: {other:?}"),
                );
                return None;
            }
        }
        if admin_password.is_some() {
            let auth = std::process::Command::new("python3")
                .args(["-c", "import flask_wtf"])
                .stderr(std::process::Stdio::null())
                .status();
            if !auth.is_ok_and(|s| s.success()) {
                skip::skipped(
                    skip::Need::Mlflow,
                    "MLflow's basic-auth app needs Flask-WTF (pip install 'mlflow[auth]')",
                );
                return None;
            }
        }
        let root = tempfile::tempdir().expect("a temporary folder");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut server = MlflowServer {
            child: None,
            admin_password,
            root,
            port,
        };
        server.restart();
        Some(server)
    }

    /// The tracking URI.
    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGTERM to its process group, then SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let group = format!("-{}", c.id());
            let _ = std::process::Command::new("kill")
                .args(["-TERM", "--", &group])
                .status();
            let started = std::time::Instant::now();
            while c.try_wait().ok().flatten().is_none()
                && started.elapsed() < std::time::Duration::from_secs(10)
            {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &group])
                .status();
            let _ = c.wait();
        }
    }

    /// Starts the server (again) on the same port and store, and waits until it answers
    /// `/health` (up to 180 s: a first start creates its database).
    pub fn restart(&mut self) {
        use std::io::{Read, Write};
        use std::os::unix::process::CommandExt;
        self.stop();
        let root = self.root.path();
        let log = std::fs::File::create(root.join("server.log")).expect("a log file");
        let mut cmd = std::process::Command::new("mlflow");
        cmd.arg("server");
        if let Some(password) = &self.admin_password {
            cmd.args(["--app-name", "basic-auth"])
                .env("MLFLOW_AUTH_ADMIN_PASSWORD", password)
                .env("MLFLOW_FLASK_SERVER_SECRET_KEY", "flashover-tests");
        }
        let child = cmd
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--workers", "1"])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", root.join("mlflow.db").display()))
            .arg("--artifacts-destination")
            .arg(root.join("artifacts"))
            .current_dir(root)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("mlflow server starts");
        self.child = Some(child);
        let started = std::time::Instant::now();
        loop {
            let healthy = std::net::TcpStream::connect(("127.0.0.1", self.port))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
                    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
                    let mut answer = String::new();
                    s.read_to_string(&mut answer)?;
                    Ok(answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"))
                })
                .unwrap_or(false);
            if healthy {
                return;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none(),
                "mlflow server exited ({exited:?}): {}",
                std::fs::read_to_string(root.join("server.log")).unwrap_or_default()
            );
            assert!(
                started.elapsed() < std::time::Duration::from_secs(180),
                "mlflow server did not answer on port {} within 180 s: {}",
                self.port,
                std::fs::read_to_string(root.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// Every run of `experiment`, read back with MLflow's own Python client
    /// (`tests/scripts/read_mlflow.py`).
    pub fn read(&self, experiment: &str) -> serde_json::Value {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/read_mlflow.py");
        let mut cmd = std::process::Command::new("python3");
        if let Some(password) = &self.admin_password {
            cmd.env("MLFLOW_TRACKING_USERNAME", "admin")
                .env("MLFLOW_TRACKING_PASSWORD", password);
        }
        let out = cmd
            .arg(&script)
            .arg(self.uri())
            .arg(experiment)
            .output()
            .expect("python3 runs the MLflow reader");
        assert!(
            out.status.success(),
            "read_mlflow.py: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("the reader prints JSON")
    }

    /// The file the server stores for artifact `path` of `run` (its local artifact root).
    pub fn artifact(&self, experiment_id: &str, run: &str, path: &str) -> std::path::PathBuf {
        path.split('/').fold(
            self.root
                .path()
                .join("artifacts")
                .join(experiment_id)
                .join(run)
                .join("artifacts"),
            |p, s| p.join(s),
        )
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A JSONL log written by `JsonlLogger`, as the tests read it.
pub struct JsonlLog {
    /// Every value, by (batch, metric); NaN and infinities parsed back from their strings.
    pub values: std::collections::BTreeMap<(u64, String), f64>,
    /// The hyperparameter records (one per process, or per resumed run, that wrote to it).
    pub hyperparameters: Vec<serde_json::Value>,
    /// The image lines' `image` objects (tag, path, width, height), in order.
    pub images: Vec<serde_json::Value>,
}

/// Reads the JSONL log at `path`.
pub fn read_jsonl(path: &std::path::Path) -> JsonlLog {
    use serde_json::Value;
    let mut log = JsonlLog {
        values: Default::default(),
        hyperparameters: Vec::new(),
        images: Vec::new(),
    };
    for line in std::fs::read_to_string(path).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        if let Some(h) = v.get("hyperparameters") {
            log.hyperparameters.push(h.clone());
        }
        if let Some(i) = v.get("image") {
            log.images.push(i.clone());
        }
        if let Some(m) = v.get("metrics").and_then(Value::as_object) {
            let batch = v["batch"].as_u64().unwrap();
            for (k, x) in m {
                let x = match x {
                    Value::String(s) => s.parse().unwrap(),
                    n => n.as_f64().unwrap(),
                };
                log.values.insert((batch, k.clone()), x);
            }
        }
    }
    log
}
