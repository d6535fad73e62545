//! `cargo xtask`: build and test the workspace for one backend (or all), cheapest checks
//! first. Plain Rust over `cargo` subprocesses; it never edits source files.
//!
//! Each non-default backend builds into its own target directory (`target/backend-<name>`),
//! so switching backends does not rebuild Burn in the default `target/`.

use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    Flex,
    Ndarray,
    Wgpu,
    Cuda,
    All,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Ndarray => "ndarray",
            Backend::Wgpu => "wgpu",
            Backend::Cuda => "cuda",
            Backend::All => "all",
        }
    }

    fn each(self) -> Vec<Backend> {
        match self {
            Backend::All => vec![
                Backend::Flex,
                Backend::Ndarray,
                Backend::Wgpu,
                Backend::Cuda,
            ],
            b => vec![b],
        }
    }

    /// Cargo arguments that select what to build for this backend. The CPU backend builds
    /// `flex_selection` (`--workspace`, or `-p` and a package) in the default target
    /// directory, with `flex_features` (`package/feature`). A GPU backend always builds the
    /// example and test packages together, with the same features (the backend's and `mpi`,
    /// which the multi-process tests and `launch` need), so that its build, test, bench and
    /// launch share one set of artifacts in its own target directory; and without the
    /// default features, so the CPU backend is not compiled in beside it (each program would
    /// otherwise monomorphise the whole trainer for both backends).
    fn cargo_args(self, flex_selection: &[&str], flex_features: &[&str]) -> Vec<String> {
        if self == Backend::Flex {
            let mut args = strings(flex_selection);
            if !flex_features.is_empty() {
                args.push("--features".into());
                args.push(flex_features.join(","));
            }
            return args;
        }
        let mut args = strings(&["-p", "flashover-examples", "-p", "flashover-tests"]);
        args.push("--target-dir".into());
        args.push(format!("target/backend-{}", self.name()));
        args.push("--no-default-features".into());
        args.push("--features".into());
        args.push(format!(
            "flashover-examples/{0},flashover-tests/{0},flashover-tests/mpi",
            self.name()
        ));
        args
    }
}

#[derive(Debug, Parser)]
#[command(about = "Build and test Flashover per backend")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Build the workspace (libraries, example, tests) in release mode for a backend.
    Build {
        #[arg(long, value_enum, default_value_t = Backend::Flex)]
        backend: Backend,
        /// Type-check only (`cargo check`): proves the backend compiles without code
        /// generation, for CI.
        #[arg(long)]
        check: bool,
    },
    /// Run the tests with a backend. The default backend runs the whole workspace suite;
    /// others run a representative subset of the cross-crate suite on that backend (the
    /// tests whose outcome depends on the backend's kernels), or with --all the whole suite
    /// less the long accuracy test and the SIGKILL timing test.
    Test {
        #[arg(long, value_enum, default_value_t = Backend::Flex)]
        backend: Backend,
        /// On a GPU backend, the whole cross-crate suite instead of the subset.
        #[arg(long)]
        all: bool,
    },
    /// fmt check, clippy with warnings denied, then the tests (default backend).
    Check,
    /// Run an example on N processes through mpirun (OpenMPI), after building it with the
    /// `mpi` feature: `cargo xtask launch -n 2 -- --max-duration 6ep`. Arguments after `--`
    /// go to the example; `--processes N` is added so that it checks what it was given.
    Launch {
        /// Number of processes (ranks).
        #[arg(short = 'n', long = "processes")]
        n: usize,
        /// An OpenMPI host file (one line per machine: `host slots=K`), passed to mpirun;
        /// without one, every process runs on this machine.
        #[arg(long)]
        hostfile: Option<std::path::PathBuf>,
        #[arg(long, value_enum, default_value_t = Backend::Flex)]
        backend: Backend,
        /// Which example to run.
        #[arg(long, default_value = "mnist")]
        example: String,
        /// The example's arguments.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Measure, in one run: trainer overhead against a hand-written Burn loop, and
    /// checkpoint save/load against raw I/O of the same bytes. Writes
    /// target/bench/<backend>.json and .md and prints the tables.
    Bench {
        #[arg(long, value_enum, default_value_t = Backend::Flex)]
        backend: Backend,
        /// Fewer steps and repetitions, one time-to-accuracy run (under 2 minutes on 2 cores,
        /// once built).
        #[arg(long)]
        quick: bool,
        /// Leave out the comparison with burn-train's Learner, whose own workspace costs a
        /// cold build of Burn with burn-train's features (CI's smoke run skips it; the
        /// overhead keys for burn-train are then null).
        #[arg(long)]
        no_burn_train: bool,
        /// Measure only the language-model section (`gpt`): the GPT recipes' time to the
        /// plain GPT's loss, ALiBi at twice its training length, and the default run against
        /// the bigram model (about 10 minutes); written to target/bench/<backend>-gpt.json.
        /// `s3`: only the object-storage section (needs s3s-fs), into
        /// target/bench/<backend>-s3.json. `precision`: only the precision rows, into
        /// target/bench/<backend>-precision.json.
        #[arg(long, value_parser = ["gpt", "s3", "precision"])]
        only: Option<String>,
    },
}

/// The variables `cargo run` sets for the program it runs (xtask's package, manifest and
/// crate). They must not reach the builds xtask starts: build scripts that watch one of them
/// (ring's, through `rerun-if-env-changed=CARGO_PKG_NAME` and the like) would see another
/// value than in a plain `cargo build` and rerun, rebuilding ring, reqwest, object_store and
/// everything above them on every switch between the two (about 3 minutes each time).
fn is_cargo_run_variable(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "OUT_DIR"
        )
}

fn cargo(args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let mut command = Command::new(&cargo);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_cargo_run_variable) {
            command.env_remove(&name);
        }
    }
    let status = command
        .args(args)
        .status()
        .with_context(|| format!("running {cargo}"))?;
    if !status.success() {
        bail!("cargo {} failed with {status}", args.join(" "));
    }
    Ok(())
}

/// The mpirun arguments that start `n` copies of `program` on this machine or on the
/// machines of `hostfile`: root needs `--allow-run-as-root`; more processes than cores on
/// one machine need `--oversubscribe` (and no binding to cores); the thread count is pinned
/// to one per process and passed to every machine.
fn mpirun_args(n: usize, hostfile: Option<&std::path::Path>, program: &str) -> Vec<String> {
    let mut a = strings(&["-n"]);
    a.push(n.to_string());
    if is_root() {
        a.push("--allow-run-as-root".into());
    }
    match hostfile {
        Some(h) => {
            a.push("--hostfile".into());
            a.push(h.display().to_string());
        }
        None => {
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            if n > cores {
                a.extend(strings(&["--oversubscribe", "--bind-to", "none"]));
            }
        }
    }
    a.extend(strings(&["-x", "RAYON_NUM_THREADS=1"]));
    if std::env::var_os("RUST_LOG").is_some() {
        a.extend(strings(&["-x", "RUST_LOG"]));
    }
    a.push(program.into());
    a
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn launch(
    n: usize,
    hostfile: Option<std::path::PathBuf>,
    backend: Backend,
    example: &str,
    args: &[String],
) -> Result<()> {
    if n == 0 {
        bail!("invalid value 0 for `-n`: expected a number of processes >= 1");
    }
    if backend == Backend::All {
        bail!("invalid value all for `--backend`: launch runs one backend (flex, ndarray, wgpu or cuda)");
    }
    if let Some(h) = &hostfile {
        if !h.is_file() {
            bail!("host file {} does not exist (expected an OpenMPI host file: one `host slots=K` line per machine)", h.display());
        }
    }
    if Command::new("mpirun").arg("--version").output().is_err() {
        bail!("mpirun not found: install OpenMPI (Debian: apt-get install -y libopenmpi-dev openmpi-bin libclang-dev) or put its bin directory on PATH");
    }
    let program = build_mpi_example(backend, example)?;
    let mut a = mpirun_args(n, hostfile.as_deref(), &program);
    a.push("--processes".into());
    a.push(n.to_string());
    if backend != Backend::Flex {
        a.push("--backend".into());
        a.push(backend.name().into());
    }
    a.extend(args.iter().cloned());
    eprintln!("$ mpirun {}", a.join(" "));
    let status = Command::new("mpirun")
        .args(&a)
        .status()
        .context("running mpirun")?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn build(backend: Backend, check: bool) -> Result<()> {
    let verb = if check { "check" } else { "build" };
    for b in backend.each() {
        let mut args = strings(&[verb, "--release", "--all-targets"]);
        args.extend(b.cargo_args(&["--workspace"], &[]));
        cargo(&args)?;
    }
    Ok(())
}

/// The cross-crate tests a GPU backend runs by default: one or two of each kind whose result
/// depends on the backend's kernels and device buffers (numerics, determinism, exact
/// resumption, every algorithm's tensor code, device memory, the collective's device-host
/// round trip). The rest of the suite checks host code (files, parsing, locks, messages,
/// timing, the source tree) that is the same on every backend, or repeats these on more
/// configurations; `cargo xtask test --backend wgpu --all` runs everything.
const GPU_SUBSET: &[&str] = &[
    "determinism::",
    "microbatch::",
    "events::short_run_trace_matches_the_snapshot",
    "trainer::eval_and_predict_report_sane_values",
    "trainer::sgd_with_momentum_adam_and_adamw_all_train_through_the_trainer",
    "trainer::non_finite_batches_can_be_skipped_and_counted",
    "resume::resume_mid_epoch",
    "resume::resume_from_an_asynchronous_save",
    "algorithms::every_algorithm_trains_and_changes_the_run",
    "algorithms::resume_with_the_stateful_algorithms_together",
    "seams::two_ranks_on_half_batches_train_like_one_process_on_the_whole_batch",
    "seams::sam_steps_alike_on_every_rank",
    "observe::device_memory_is_read_where_the_backend_reports_it",
    "observe::nan_monitor_names_the_batch_of_a_bad_loss_or_gradient",
    "precision::",
    "distributed::two_processes_train_like_one_process_on_the_whole_batch_and_repeat_bit_exactly",
];

fn test(backend: Backend, all: bool) -> Result<()> {
    for b in backend.each() {
        if b == Backend::Flex {
            cargo(&strings(&["test", "--release", "--workspace"]))?;
            continue;
        }
        // The same packages and features as `build`, so a build followed by a test compiles
        // nothing twice.
        if all {
            let mut args = strings(&["test", "--release"]);
            args.extend(b.cargo_args(&[], &[]));
            // Everything but the long accuracy run and the SIGKILL test, whose kill times
            // are tuned to the CPU backend's speed.
            args.extend(strings(&[
                "--",
                "--skip",
                "accuracy::",
                "--skip",
                "crash::",
            ]));
            cargo(&args)?;
            continue;
        }
        // The subset needs only the cross-crate test binary and the example it runs; the
        // other example programs (benchmarks) and the unit tests of the examples would double
        // the build on a GPU backend, where each program monomorphises the trainer anew.
        let mut build = strings(&["build", "--release", "--example", "mnist"]);
        build.extend(b.cargo_args(&[], &[]));
        cargo(&build)?;
        let mut args = strings(&["test", "--release", "--test", "tests"]);
        args.extend(b.cargo_args(&[], &[]));
        args.push("--".into());
        args.extend(strings(GPU_SUBSET));
        cargo(&args)?;
    }
    Ok(())
}

impl Backend {
    fn target_dir(self) -> String {
        match self {
            Backend::Flex => "target".into(),
            b => format!("target/backend-{}", b.name()),
        }
    }
}

/// Runs a built example with `args`, pinned to one compute thread, and returns its stdout.
fn run_example(backend: Backend, name: &str, args: &[String]) -> Result<String> {
    run_example_on(backend, name, args, 1)
}

/// Runs a built example with `args` on `threads` compute threads (`RAYON_NUM_THREADS`).
fn run_example_on(backend: Backend, name: &str, args: &[String], threads: usize) -> Result<String> {
    let bin = format!("{}/release/examples/{name}", backend.target_dir());
    run_binary_on(backend, &bin, args, threads)
}

/// Runs the program `bin` with `args` and `--backend`, pinned to one compute thread, and
/// returns its stdout; a missing device is reported as "no device".
fn run_binary(backend: Backend, bin: &str, args: &[String]) -> Result<String> {
    run_binary_on(backend, bin, args, 1)
}

/// [`run_binary`] on `threads` compute threads.
fn run_binary_on(backend: Backend, bin: &str, args: &[String], threads: usize) -> Result<String> {
    eprintln!("$ RAYON_NUM_THREADS={threads} {bin} {}", args.join(" "));
    let out = Command::new(bin)
        .args(args)
        .args(["--backend", backend.name()])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .with_context(|| format!("running {bin}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No possible adapter")
            || stderr.contains("CUDA")
            || stderr.contains("cuda")
        {
            bail!(
                "no device for backend {}: {}",
                backend.name(),
                stderr.lines().last().unwrap_or("")
            );
        }
        bail!("{bin} failed with {}:\n{stderr}", out.status);
    }
    Ok(stdout)
}

fn last_json(stdout: &str) -> Result<serde_json::Value> {
    let line = stdout.lines().last().unwrap_or("");
    serde_json::from_str(line)
        .with_context(|| format!("expected a JSON summary line, got {line:?}"))
}

/// The overhead section: Flashover against the hand-written loop on the default build, and
/// burn-train's Learner against the hand-written loop on burn-train's own build.
fn overhead_json(plain: &str, learner: Option<&str>) -> Result<serde_json::Value> {
    let mut o = last_json(plain)?;
    let Some(learner) = learner else {
        o["burn_train_over_handwritten"] = serde_json::Value::Null;
        o["burn_train_over_flashover"] = serde_json::Value::Null;
        return Ok(o);
    };
    let l = last_json(learner)?;
    o["burn_train_over_handwritten"] = l["burn_train_over_handwritten"].clone();
    o["burn_train_over_flashover"] = l["burn_train_over_flashover"].clone();
    o["burn_train_build"] = l;
    Ok(o)
}

fn table(stdout: &str) -> String {
    stdout
        .lines()
        .filter(|l| l.starts_with('|'))
        .collect::<Vec<_>>()
        .join("\n")
}

fn machine(backend: Backend) -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let commit = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    serde_json::json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "backend": backend.name(),
        "profile": "release",
        "rayon_num_threads": 1,
        "rayon_num_threads_exceptions": "2 for the ResNet time to accuracy and the GPT section; the CPU fast path's rows say theirs",
        "git_commit": commit,
    })
}

fn bench(backend: Backend, quick: bool, no_burn_train: bool) -> Result<()> {
    for b in backend.each() {
        // Wall seconds of each part, builds included, for the report.
        let mut clock = Sections::start();
        let mut args = strings(&[
            "build",
            "--release",
            "--example",
            "overhead",
            "--example",
            "checkpoint_io",
            "--example",
            "time_to_accuracy",
            "--example",
            "scaling",
            "--example",
            "surgery_cost",
            // The language-model section's programs, built here with the same features (a
            // later build of them would follow the MPI build's and relink).
            "--example",
            "shakespeare",
            "--example",
            "plot",
            "--example",
            "mnist",
        ]);
        args.extend(b.cargo_args(bench_selection(), &[]));
        cargo(&args)?;
        clock.done("build");
        let (steps, reps) = if quick { ("30", "3") } else { ("120", "5") };
        let overhead =
            match run_example(b, "overhead", &strings(&["--steps", steps, "--reps", reps])) {
                Ok(o) => o,
                Err(e) if e.to_string().starts_with("no device") => {
                    eprintln!("{e}; skipping");
                    continue;
                }
                Err(e) => return Err(e),
            };
        clock.done("overhead");
        let checkpoint = run_example(b, "checkpoint_io", &strings(&["--reps", reps]))?;
        clock.done("checkpoint_io");
        // burn-train's Learner, from its own workspace (see benches/learner/Cargo.toml).
        let learner = if no_burn_train {
            None
        } else {
            let mut learner_build = strings(&[
                "build",
                "--release",
                "--manifest-path",
                "benches/learner/Cargo.toml",
                "--target-dir",
                "target/learner",
            ]);
            if b != Backend::Flex {
                learner_build.extend(strings(&["--no-default-features", "--features", b.name()]));
            }
            cargo(&learner_build)?;
            Some(run_binary(
                b,
                "target/learner/release/flashover-learner-bench",
                &strings(&["--steps", steps, "--reps", reps]),
            )?)
        };
        clock.done("burn_train_learner");
        // Each repetition trains the baseline and three recipes to the end (about 100 s on
        // two CPU cores), so the quick mode runs one.
        // The quick mode also evaluates half as often (every 50 batches).
        let (tta_reps, eval_every) = if quick { ("1", "50") } else { ("3", "25") };
        std::fs::create_dir_all("target/bench")?;
        let curves_path = format!("target/bench/{}-curves.json", b.name());
        let plot_path = format!("target/bench/{}-time-to-accuracy.png", b.name());
        let tta = run_example(
            b,
            "time_to_accuracy",
            &strings(&[
                "--reps",
                tta_reps,
                "--eval-every",
                eval_every,
                "--curves",
                &curves_path,
                "--plot",
                &plot_path,
            ]),
        )?;
        let tta_json = last_json(&tta)?;
        clock.done("cnn_time_to_accuracy");
        // The ResNet recipes against the plain ResNet-8 (375 batches, 3 epochs, counted in
        // batches so that every recipe's ratio gives a different length; evaluated every 50
        // batches); quick: one epoch on a quarter of the digits. Two threads: about 70 s a
        // repetition against 130 s on one (2026-12-03: the baseline trains in 20.3 s against
        // 35.5 s), which keeps the whole bench under 25 minutes; the fast path's results do
        // not depend on the thread count, only its times do.
        let resnet_plot = format!("target/bench/{}-resnet-time-to-accuracy.png", b.name());
        let mut resnet_args = strings(&["--model", "resnet8", "--plot", &resnet_plot]);
        resnet_args.extend(if quick {
            strings(&[
                "--reps",
                "1",
                "--max-duration",
                "1ep",
                "--train-limit",
                "2048",
                "--eval-every",
                "8",
            ])
        } else {
            strings(&[
                "--reps",
                "3",
                "--max-duration",
                "375ba",
                "--eval-every",
                "50",
            ])
        });
        let resnet_tta = run_example_on(b, "time_to_accuracy", &resnet_args, 2)?;
        let resnet_json = last_json(&resnet_tta)?;
        clock.done("resnet_time_to_accuracy");
        let (cost_steps, cost_reps) = if quick { ("5", "1") } else { ("30", "5") };
        let surgery_cost = run_example(
            b,
            "surgery_cost",
            &strings(&[
                "--model", "resnet8", "--steps", cost_steps, "--reps", cost_reps,
            ]),
        )?;
        clock.done("surgery_cost");
        let (scale_steps, scale_reps) = if quick { ("10", "1") } else { ("40", "5") };
        let scaling = run_example(
            b,
            "scaling",
            &strings(&["--steps", scale_steps, "--reps", scale_reps]),
        )?;
        clock.done("scaling");
        let distributed = distributed_bench(b, quick)?;
        clock.done("distributed");
        let fast_path = cpu_fast_path_bench(b, quick)?;
        clock.done("cpu_fast_path");
        let object_store = object_store_bench(b, quick)?;
        clock.done("object_store");
        let precision = precision_bench(b, quick)?;
        clock.done("precision");
        // About 10 minutes: full mode only.
        let gpt = if quick { None } else { Some(gpt_bench(b)?) };
        clock.done("gpt");
        let report = serde_json::json!({
            "machine": machine(b),
            "quick": quick,
            "overhead": overhead_json(&overhead, learner.as_deref())?,
            "checkpoint": last_json(&checkpoint)?,
            "recipes": tta_json["recipes"],
            "time_to_accuracy": tta_json,
            "resnet_recipes": resnet_json["recipes"],
            "resnet_time_to_accuracy": resnet_json,
            "surgery_step_cost": last_json(&surgery_cost)?,
            "scaling": last_json(&scaling)?,
            "distributed": distributed.as_ref().map(|d| d.0.clone()),
            "cpu_fast_path": fast_path.as_ref().map(|d| d.0.clone()),
            "object_store": object_store.as_ref().map(|d| d.0.clone()),
            "precision": precision.0,
            "gpt_recipes": gpt.as_ref().map(|g| g.0["gpt_recipes"].clone()),
            "gpt": gpt.as_ref().map(|g| g.0["gpt"].clone()),
            "section_seconds": clock.json(),
        });
        let json_path = format!("target/bench/{}.json", b.name());
        std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
        let md = format!(
            "# Flashover bench: {} ({})\n\n## Trainer overhead\n\n{}\n\n{}\n\n## Checkpoint I/O\n\n{}\n\n## Time to accuracy\n\n{}\n\n{}\n\nCurves: `{plot_path}`\n\n## Time to accuracy: ResNet-8 and the ResNet recipes\n\n{}\n\n{}\n\nCurves: `{resnet_plot}`\n\n## Step cost of each model surgery (ResNet-8)\n\n{}\n\n{}\n\n## Scaling\n\n{}\n\n## Processes (MPI)\n\n{}\n\n## CPU fast path (channels-last kernels against Burn's)\n\n{}\n",
            b.name(),
            if quick { "quick" } else { "full" },
            table(&overhead),
            learner.as_deref().map_or_else(
                || "burn-train's Learner: not measured (`--no-burn-train`)".to_string(),
                table
            ),
            table(&checkpoint),
            tta.lines().find(|l| l.starts_with("Target:")).unwrap_or(""),
            table(&tta),
            resnet_tta.lines().find(|l| l.starts_with("Target:")).unwrap_or(""),
            table(&resnet_tta),
            surgery_cost.lines().find(|l| l.contains("plain step")).unwrap_or(""),
            table(&surgery_cost),
            table(&scaling),
            distributed
                .as_ref()
                .map_or("not measured: mpirun not found (install OpenMPI)".to_string(), |d| d.1.clone()),
            fast_path
                .as_ref()
                .map_or("not measured: a GPU backend keeps Burn's kernels".to_string(), |d| d.1.clone())
        );
        let md = format!(
            "{md}\n## Precision (the main job's CNN)\n\n{}\n",
            precision.1
        );
        let md = format!(
            "{md}\n## Object storage (S3-compatible server on 127.0.0.1)\n\n{}\n\n## Language model (GPT on Shakespeare)\n\n{}\n",
            object_store.as_ref().map_or(
                "not measured: s3s-fs not installed (cargo install s3s-fs --version 0.14.1 --locked --features binary)".to_string(),
                |d| d.1.clone()
            ),
            gpt.as_ref()
                .map_or("not measured in quick mode".to_string(), |g| g.1.clone())
        );
        let md = format!(
            "{md}\n## Wall time of this run\n\n{}\n",
            clock
                .parts
                .iter()
                .map(|(n, t)| format!("{n} {t:.0} s"))
                .chain(std::iter::once(format!(
                    "total {:.1} min",
                    clock.started.elapsed().as_secs_f64() / 60.0
                )))
                .collect::<Vec<_>>()
                .join("; ")
        );
        let md_path = format!("target/bench/{}.md", b.name());
        std::fs::write(&md_path, &md)?;
        println!("{md}\nwritten: {json_path}, {md_path}");
    }
    Ok(())
}

/// The language-model section, on two threads: (1) the GPT recipes against the plain GPT
/// (2 blocks of width 128, 160 batches of 32 windows of 128 characters, evaluated every 20
/// batches on 128 validation windows; 3 interleaved repetitions): seconds of training until
/// the validation loss first reaches the plain GPT's final loss (the median over its
/// repetitions); (2) ALiBi's extrapolation: the same GPT with ALiBi trained on windows of 64
/// evaluated on windows of 64 and of 128 (the same weights: training does not depend on the
/// evaluation), and the plain GPT asked for 128; (3) the default run against the count-based
/// bigram model.
fn gpt_bench(b: Backend) -> Result<(serde_json::Value, String)> {
    let mut args = strings(&[
        "build",
        "--release",
        "--example",
        "shakespeare",
        "--example",
        "plot",
    ]);
    args.extend(b.cargo_args(bench_selection(), &[]));
    cargo(&args)?;
    let bin = format!("{}/release/examples/shakespeare", b.target_dir());
    let plot_bin = format!("{}/release/examples/plot", b.target_dir());
    let run = |extra: &[&str]| -> Result<std::result::Result<serde_json::Value, String>> {
        eprintln!("$ {bin} {}", extra.join(" "));
        let out = Command::new(&bin)
            .args(extra)
            .args(["--no-progress", "--backend", b.name()])
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Ok(Err(err.lines().last().unwrap_or("").to_string()));
        }
        Ok(Ok(last_json(&String::from_utf8_lossy(&out.stdout))?))
    };
    let small = [
        "--layers",
        "2",
        "--width",
        "128",
        "--heads",
        "4",
        "--max-duration",
        "160ba",
        "--warmup",
        "20ba",
        "--eval-interval",
        "20ba",
        "--val-windows",
        "128",
    ];
    let names = ["baseline", "gpt-mild", "gpt-medium", "gpt-hot"];
    let mut runs: Vec<Vec<serde_json::Value>> = vec![Vec::new(); names.len()];
    for _rep in 0..3 {
        for (i, name) in names.iter().enumerate() {
            let mut a: Vec<&str> = small.to_vec();
            if *name != "baseline" {
                a.extend(["--recipe", name]);
            }
            runs[i].push(run(&a)?.map_err(|e| anyhow::anyhow!("{name}: {e}"))?);
        }
    }
    let loss = |s: &serde_json::Value| s["val_loss"].as_f64().unwrap_or(f64::NAN);
    let mut base_losses: Vec<f64> = runs[0].iter().map(loss).collect();
    let (target, _, _) = median_range(&mut base_losses);
    let seconds_to = |s: &serde_json::Value| {
        s["val_curve"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["value"].as_f64().unwrap_or(f64::INFINITY) <= target)
            .and_then(|p| p["train_seconds"].as_f64())
    };
    let mut base_secs: Vec<f64> = runs[0].iter().filter_map(seconds_to).collect();
    let (base_med, _, _) = median_range(&mut base_secs);
    let mut recipes = serde_json::Map::new();
    let mut md = format!(
        "Target: the plain GPT's final validation loss, {target:.4} nats per character (median of 3).\n\n| run | s to target (median, min-max) | speed-up | final loss |\n|---|---|---|---|\n"
    );
    for (i, name) in names.iter().enumerate() {
        let mut secs: Vec<f64> = runs[i].iter().filter_map(seconds_to).collect();
        let reached = secs.len() == runs[i].len();
        let mut finals: Vec<f64> = runs[i].iter().map(loss).collect();
        let (final_med, _, _) = median_range(&mut finals);
        let (med, lo, hi) = median_range(&mut secs);
        let speedup = reached.then(|| base_med / med);
        md.push_str(&format!(
            "| {name} | {} | {} | {final_med:.4} |\n",
            if reached {
                format!("{med:.1} ({lo:.1}-{hi:.1})")
            } else {
                "not reached in every repetition".into()
            },
            speedup.map_or("-".into(), |s| format!("{s:.2}x")),
        ));
        recipes.insert(
            name.to_string(),
            serde_json::json!({
                "speedup_to_baseline_loss": speedup,
                "final_val_loss": final_med,
                "seconds_to_baseline_loss": reached.then_some(med),
                "seconds_min_max": reached.then_some([lo, hi]),
            }),
        );
    }
    // The chart: each run's validation loss against training time in the first repetition,
    // and the target.
    let mut series: Vec<serde_json::Value> = names
        .iter()
        .zip(&runs)
        .map(|(name, reps)| {
            let points: Vec<[f64; 2]> = reps[0]["val_curve"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| Some([p["train_seconds"].as_f64()?, p["value"].as_f64()?]))
                .collect();
            serde_json::json!({"name": name, "points": points})
        })
        .collect();
    let end = runs
        .iter()
        .flat_map(|reps| reps[0]["val_curve"].as_array().into_iter().flatten())
        .filter_map(|p| p["train_seconds"].as_f64())
        .fold(0.0, f64::max);
    series.push(serde_json::json!({
        "name": format!("target {target:.4}"),
        "points": [[0.0, target], [end, target]],
    }));
    let chart_spec = format!("target/bench/{}-gpt-time-to-loss.json", b.name());
    let chart = format!("target/bench/{}-gpt-time-to-loss.png", b.name());
    std::fs::write(
        &chart_spec,
        serde_json::to_string_pretty(&serde_json::json!({
            "title": format!("Shakespeare validation loss against training time (2-block GPT, {})", b.name()),
            "x_label": "training seconds (evaluation excluded)",
            "y_label": "validation loss (nats per character)",
            "series": series,
        }))?,
    )?;
    let status = Command::new(&plot_bin)
        .args([&chart_spec, &chart])
        .status()
        .with_context(|| format!("running {plot_bin}"))?;
    anyhow::ensure!(status.success(), "{plot_bin} {chart_spec} {chart} failed");
    md.push_str(&format!("\nCurves: `{chart}`\n"));
    // ALiBi at twice its training length, and learned positions asked for the same. 480
    // batches: after 160 the model was still too undertrained to gain from the longer
    // context (2026-12-03: loss ratio 1.0005 at 160 batches, 0.994 at 480).
    // One training: the run saves its final state, and a second invocation autoresumes
    // from it (nothing left to train) and only evaluates, on windows of 128.
    let ck_dir = std::env::temp_dir().join(format!("flashover-alibi-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ck_dir);
    let ck = ck_dir.display().to_string();
    let long = |eval: &'static str, alibi: bool, save: bool| {
        let mut a: Vec<&str> = [
            "--layers",
            "2",
            "--width",
            "128",
            "--heads",
            "4",
            "--max-duration",
            "480ba",
            "--warmup",
            "20ba",
            "--eval-interval",
            "480ba",
            "--seq-len",
            "64",
            "--context",
            "64",
            "--eval-seq-len",
        ]
        .to_vec();
        a.push(eval);
        if alibi {
            a.extend(["--algorithms", "alibi:train_sequence_length_scaling=1"]);
        }
        if save {
            a.extend(["--save-folder", ck.as_str(), "--autoresume"]);
        }
        run(&a)
    };
    let at_1x = long("64", true, true)?.map_err(|e| anyhow::anyhow!("alibi at 1x: {e}"))?;
    let at_2x = long("128", true, true)?.map_err(|e| anyhow::anyhow!("alibi at 2x: {e}"))?;
    let _ = std::fs::remove_dir_all(&ck_dir);
    anyhow::ensure!(
        at_1x["params_sha256"] == at_2x["params_sha256"],
        "the 2x evaluation did not use the trained weights"
    );
    let learned_2x = match long("128", false, false)? {
        Ok(s) => format!("ran: loss {}", loss(&s)),
        Err(e) => format!("refused: {e}"),
    };
    let ratio = loss(&at_2x) / loss(&at_1x);
    md.push_str(&format!(
        "\nALiBi trained on 64 characters: validation loss {:.4} on windows of 64, {:.4} on windows of 128 (ratio {ratio:.4}). Learned positions at 128: {learned_2x}\n",
        loss(&at_1x),
        loss(&at_2x)
    ));
    // The default run against the bigram model.
    let default = run(&[])?.map_err(|e| anyhow::anyhow!("default run: {e}"))?;
    let bigram = default["bigram_val_loss"].as_f64().unwrap_or(f64::NAN);
    let below = 1.0 - loss(&default) / bigram;
    md.push_str(&format!(
        "\nDefault run: {:.0} s wall, validation loss {:.4} nats per character; the count-based bigram model {bigram:.4}: {:.0}% lower.\n",
        default["wall_seconds"].as_f64().unwrap_or(f64::NAN),
        loss(&default),
        100.0 * below
    ));
    let json = serde_json::json!({
        "gpt_recipes": recipes,
        "gpt": {
            "target_val_loss": target,
            "time_to_loss_chart": chart,
            "val_loss_at_2x_context_over_1x": ratio,
            "alibi_val_loss_1x": loss(&at_1x),
            "alibi_val_loss_2x": loss(&at_2x),
            "learned_positions_at_2x": learned_2x,
            "default_run": {
                "wall_seconds": default["wall_seconds"],
                "val_loss": default["val_loss"],
                "bigram_val_loss": bigram,
                "fraction_below_bigram": below,
                "tokens_per_second": default["tokens_per_second"],
            },
        },
    });
    Ok((json, md))
}

/// The wall time of each part of a bench run (builds included), in order.
struct Sections {
    last: std::time::Instant,
    started: std::time::Instant,
    parts: Vec<(&'static str, f64)>,
}

impl Sections {
    fn start() -> Self {
        let now = std::time::Instant::now();
        Sections {
            last: now,
            started: now,
            parts: Vec::new(),
        }
    }

    /// Ends the part `name` (from the end of the previous one).
    fn done(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.parts.push((name, (now - self.last).as_secs_f64()));
        self.last = now;
    }

    fn json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (name, secs) in &self.parts {
            m.insert(name.to_string(), serde_json::json!(secs));
        }
        m.insert(
            "total".into(),
            serde_json::json!(self.started.elapsed().as_secs_f64()),
        );
        serde_json::Value::Object(m)
    }
}

/// Median and range of `v` (sorted in place).
fn median_range(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// What every flex build in the bench selects: the whole workspace, exactly as the test
/// command builds it (features unified), so that after the tests the bench builds nothing.
/// It needs no OpenMPI: the multi-process rows run the separate MPI build
/// ([`build_mpi_example`]).
fn bench_selection() -> &'static [&'static str] {
    &["--workspace"]
}

/// Builds `example` with MPI support and returns its path. On the CPU backend: the examples
/// package alone with the `mpi` feature, in `target/mpi`, exactly as the multi-process tests
/// build it (`tests/support/mpi.rs`: same packages, features and directory, so whichever runs
/// first builds it for the other); the plain build in `target` stays free of MPI. A GPU
/// backend's build always has MPI (see [`Backend::cargo_args`]).
fn build_mpi_example(b: Backend, example: &str) -> Result<String> {
    if b != Backend::Flex {
        let mut args = strings(&["build", "--release", "--example", example]);
        args.extend(b.cargo_args(&[], &[]));
        cargo(&args)?;
        return Ok(format!("{}/release/examples/{example}", b.target_dir()));
    }
    cargo(&strings(&[
        "build",
        "--release",
        "-p",
        "flashover-examples",
        "--example",
        example,
        "--no-default-features",
        "--features",
        "flashover-examples/mpi,flashover-examples/flex",
        "--target-dir",
        "target/mpi",
    ]))?;
    Ok(format!("target/mpi/release/examples/{example}"))
}

/// Builds the `mnist` example for `b` as the bench builds every program (without MPI on the
/// CPU backend; a GPU backend's build always has it); returns its path.
fn build_mnist(b: Backend) -> Result<String> {
    let mut args = strings(&["build", "--release", "--example", "mnist"]);
    args.extend(b.cargo_args(bench_selection(), &[]));
    cargo(&args)?;
    Ok(format!("{}/release/examples/mnist", b.target_dir()))
}

/// The `s3s-fs` test server (an S3-compatible server that verifies signatures), if installed
/// (on PATH or in ~/.cargo/bin).
fn s3s_fs() -> Option<std::path::PathBuf> {
    let home = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo/bin"));
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(home)
        .map(|d| d.join("s3s-fs"))
        .find(|p| p.is_file())
}

/// Object storage against a local `s3s-fs` server: (1) the checkpoint upload (local
/// verification, manifest last, `latest`) against plain PUTs of the same bytes, from
/// `checkpoint_io --remote`; (2) the MNIST example's training time (six epochs, one training
/// thread) with checkpoints every 25 batches saved locally, and saved locally and uploaded in
/// the background, interleaved repetitions; the figure is the median of the per-repetition
/// ratios of the time up to the last batch end (the step time: `train_seconds` less
/// `fit_end_wait_seconds`), and beside it the same for the whole `fit`, whose end waits for
/// the last upload (a fixed cost of about one upload, 1-2% of these 3-second runs).
fn object_store_bench(b: Backend, quick: bool) -> Result<Option<(serde_json::Value, String)>> {
    let Some(server_bin) = s3s_fs() else {
        return Ok(None);
    };
    let mnist = build_mnist(b)?;
    let tmp = std::env::temp_dir().join(format!("flashover-s3-bench-{}", std::process::id()));
    let root = tmp.join("root");
    std::fs::create_dir_all(root.join("bench"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let (key, secret) = ("bench-access", "bench-secret-0f3e");
    let mut server = Command::new(&server_bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", key, "--secret-key", secret])
        .arg(&root)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", server_bin.display()))?;
    let result = (|| -> Result<(serde_json::Value, String)> {
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            anyhow::ensure!(started.elapsed().as_secs() < 20, "s3s-fs did not start");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let env = [
            ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ACCESS_KEY_ID", key.to_string()),
            ("AWS_SECRET_ACCESS_KEY", secret.to_string()),
            // Training on one pinned thread, as the other sections: the uploader (and here
            // the server too) run beside it, as on a machine whose cores are not all
            // training.
            ("RAYON_NUM_THREADS", "1".to_string()),
        ];
        // Seven repetitions of six epochs: in three-epoch runs one repetition's ratio ranged
        // 0.94-1.10 on a quiet machine (2026-12-03), wider than the 2% being measured.
        let (reps, epochs) = if quick { (3, 3) } else { (7, 6) };
        let io_bin = format!("{}/release/examples/checkpoint_io", b.target_dir());
        let out = Command::new(&io_bin)
            .args([
                "--reps",
                &reps.to_string(),
                "--remote",
                "s3://bench/io",
                "--backend",
                b.name(),
            ])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .with_context(|| format!("running {io_bin}"))?;
        anyhow::ensure!(
            out.status.success(),
            "checkpoint_io --remote: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let io_text = String::from_utf8_lossy(&out.stdout).into_owned();
        let io = last_json(&io_text)?;
        let train = |extra: &[String]| -> Result<(f64, f64)> {
            let out = Command::new(&mnist)
                .args([
                    "--max-duration",
                    &format!("{epochs}ep"),
                    "--save-interval",
                    "25ba",
                    "--no-progress",
                ])
                .args(["--backend", b.name()])
                .args(extra)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .output()
                .with_context(|| format!("running {mnist}"))?;
            anyhow::ensure!(
                out.status.success(),
                "mnist {extra:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let s = last_json(&String::from_utf8_lossy(&out.stdout))?;
            let train = s["train_seconds"]
                .as_f64()
                .context("the summary has train_seconds")?;
            let wait = s["fit_end_wait_seconds"]
                .as_f64()
                .context("the summary has fit_end_wait_seconds")?;
            // (stepping: up to the last batch end; the whole fit, with FIT_END's wait)
            Ok((train - wait, train))
        };
        let (mut local, mut remote, mut ratios, mut whole) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for rep in 0..reps {
            let dir = tmp.join(format!("local-{rep}"));
            let l = train(&["--save-folder".into(), dir.display().to_string()])?;
            let r = train(&[
                "--save-folder".into(),
                format!("s3://bench/run-{rep}"),
                "--checkpoint-cache".into(),
                tmp.join(format!("cache-{rep}")).display().to_string(),
            ])?;
            local.push(l.0);
            remote.push(r.0);
            ratios.push(r.0 / l.0);
            whole.push(r.1 / l.1);
        }
        let (l, lmin, lmax) = median_range(&mut local);
        let (r, rmin, rmax) = median_range(&mut remote);
        let (q, qmin, qmax) = median_range(&mut ratios);
        let (w, wmin, wmax) = median_range(&mut whole);
        let md = format!(
            "{}\n\n{epochs} MNIST epochs ({} batches) with a checkpoint every 25 batches ({reps} interleaved repetitions, one training thread), time up to the last batch end (training and the epoch-end evaluations): saved locally {l:.2} s ({lmin:.2}-{lmax:.2}), saved locally and uploaded in the background {r:.2} s ({rmin:.2}-{rmax:.2}); step-time ratio {q:.3} ({qmin:.3}-{qmax:.3}), goal <= 1.02. With the end of `fit` (which waits for the last checkpoint's write, and upload): ratio {w:.3} ({wmin:.3}-{wmax:.3}).\n",
            table(&io_text),
            125 * epochs
        );
        let json = serde_json::json!({
            "server": "s3s-fs on 127.0.0.1",
            "checkpoint_upload": io["remote"],
            "bytes": io["bytes"],
            "train_seconds_local": l,
            "train_seconds_local_min_max": [lmin, lmax],
            "train_seconds_uploading": r,
            "train_seconds_uploading_min_max": [rmin, rmax],
            "step_time_uploading_over_local": q,
            "step_time_ratio_min_max": [qmin, qmax],
            "fit_time_uploading_over_local": w,
            "fit_time_ratio_min_max": [wmin, wmax],
            "epochs": epochs,
            "reps": reps,
        });
        Ok((json, md))
    })();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(Some)
}

/// Whether OpenMPI's launcher is installed.
fn have_mpirun() -> bool {
    Command::new("mpirun").arg("--version").output().is_ok()
}

/// The main job on one process and on two (through mpirun, one thread each), interleaved:
/// training throughput of the whole data-parallel batch, its ratio, the share of a step
/// spent in the gradient all-reduce, and (full mode) the training seconds to 97% test
/// accuracy. `None` where mpirun is missing. Returns the JSON section and a Markdown table.
fn distributed_bench(b: Backend, quick: bool) -> Result<Option<(serde_json::Value, String)>> {
    if !have_mpirun() {
        eprintln!("mpirun not found: the multi-process rows are skipped (install OpenMPI)");
        return Ok(None);
    }
    let bin = build_mpi_example(b, "mnist")?;
    let run = |world: usize, extra: &[&str]| -> Result<serde_json::Value> {
        let mut a = strings(&["--no-progress"]);
        a.extend(strings(extra));
        let out = if world == 1 {
            run_binary(b, &bin, &a)?
        } else {
            let mut m = mpirun_args(world, None, &bin);
            m.extend(strings(&[
                "--processes",
                &world.to_string(),
                "--backend",
                b.name(),
            ]));
            m.extend(a);
            eprintln!("$ mpirun {}", m.join(" "));
            let out = Command::new("mpirun")
                .args(&m)
                .env("RAYON_NUM_THREADS", "1")
                .output()
                .context("running mpirun")?;
            if !out.status.success() {
                bail!("mpirun failed:\n{}", String::from_utf8_lossy(&out.stderr));
            }
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        last_json(&out)
    };
    // Throughput: 100 batches of the default global batch (64), no evaluation inside the
    // timed fit; repetitions interleaved so that both sizes see the same machine.
    let reps = if quick { 3 } else { 5 };
    let (mut ratio, mut one, mut two, mut share, mut ms) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let s1 = run(1, &["--max-duration", "100ba"])?;
        let s2 = run(2, &["--max-duration", "100ba"])?;
        let sps = |s: &serde_json::Value| s["samples_per_second"].as_f64().unwrap_or(f64::NAN);
        one.push(sps(&s1));
        two.push(sps(&s2));
        ratio.push(sps(&s2) / sps(&s1));
        let train = s2["train_seconds"].as_f64().unwrap_or(f64::NAN);
        let reduce = s2["allreduce_seconds"].as_f64().unwrap_or(f64::NAN);
        share.push(reduce / train);
        ms.push(reduce * 1000.0 / 100.0);
    }
    let (r_med, r_min, r_max) = median_range(&mut ratio);
    let (o_med, o_min, o_max) = median_range(&mut one);
    let (t_med, t_min, t_max) = median_range(&mut two);
    let (f_med, f_min, f_max) = median_range(&mut share);
    let (m_med, m_min, m_max) = median_range(&mut ms);
    // Time to accuracy: the default run (6 epochs), evaluated about every half epoch (63 of
    // an epoch's 125 batches: epochs are whole numbers on the command line); full mode.
    let target = 0.97;
    let mut tta = serde_json::Map::new();
    if !quick {
        for world in [1usize, 2] {
            let s = run(world, &["--eval-interval", "63ba"])?;
            let seconds = s["accuracy_curve"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["value"].as_f64().unwrap_or(0.0) >= target)
                .and_then(|p| p["train_seconds"].as_f64());
            tta.insert(
                format!("world{world}"),
                serde_json::json!({"seconds_to_target": seconds, "final_accuracy": s["test_accuracy"]}),
            );
        }
    }
    let json = serde_json::json!({
        "reps": reps,
        "global_batch_size": 64,
        "world1_samples_per_second": {"median": o_med, "min": o_min, "max": o_max},
        "world2_samples_per_second": {"median": t_med, "min": t_min, "max": t_max},
        "world2_over_world1": r_med,
        "world2_over_world1_range": [r_min, r_max],
        "allreduce_fraction": f_med,
        "allreduce_fraction_range": [f_min, f_max],
        "allreduce_ms_per_step": m_med,
        "allreduce_ms_per_step_range": [m_min, m_max],
        "target_accuracy": target,
        "time_to_accuracy": tta,
    });
    let mut md = format!(
        "{reps} interleaved repetitions of 100 batches of 64 (one thread per process); median (min-max)\n\n| processes | samples/s | scaling | all-reduce ms/step | all-reduce share of a step |\n|---|---|---|---|---|\n| 1 | {o_med:.0} ({o_min:.0}-{o_max:.0}) | 1.00 | - | - |\n| 2 | {t_med:.0} ({t_min:.0}-{t_max:.0}) | {r_med:.2}x ({r_min:.2}-{r_max:.2}); efficiency {:.0}% | {m_med:.2} ({m_min:.2}-{m_max:.2}) | {:.1}% ({:.1}-{:.1}%) |\n",
        r_med / 2.0 * 100.0,
        f_med * 100.0,
        f_min * 100.0,
        f_max * 100.0
    );
    if !tta.is_empty() {
        md.push_str(&format!(
            "\nTraining seconds to {:.0}% test accuracy (default run, evaluated every half epoch):",
            target * 100.0
        ));
        for (k, v) in &tta {
            md.push_str(&format!(
                " {k}: {} s (final {});",
                v["seconds_to_target"], v["final_accuracy"]
            ));
        }
        md.push('\n');
    }
    Ok(Some((json, md)))
}

/// The main job's training throughput and peak memory with Burn's convolution and pooling
/// kernels (`--memory-format channels-first`) against Flashover's channels-last fast path
/// (`channels-last`), each at 1 and 2 threads (`RAYON_NUM_THREADS`), repetitions interleaved:
/// 100 batches of 64, no evaluation inside the timed fit. CPU backends only (`None` on GPU).
fn cpu_fast_path_bench(b: Backend, quick: bool) -> Result<Option<(serde_json::Value, String)>> {
    if !matches!(b, Backend::Flex | Backend::Ndarray) {
        return Ok(None);
    }
    let bin = build_mnist(b)?;
    let run = |format: &str, threads: usize| -> Result<(f64, f64)> {
        let args = strings(&[
            "--no-progress",
            "--max-duration",
            "100ba",
            "--memory-format",
            format,
            "--backend",
            b.name(),
        ]);
        eprintln!("$ RAYON_NUM_THREADS={threads} {bin} {}", args.join(" "));
        let out = Command::new(&bin)
            .args(&args)
            .env("RAYON_NUM_THREADS", threads.to_string())
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            bail!("{bin} failed:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        let s = last_json(&String::from_utf8_lossy(&out.stdout))?;
        let sps = s["samples_per_second"].as_f64().unwrap_or(f64::NAN);
        let rss = s["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN);
        Ok((sps, rss))
    };
    let reps = if quick { 3 } else { 5 };
    let mut sps = vec![vec![]; 4];
    let (mut s1, mut s2, mut scaling, mut rss) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        // Burn 1 thread, fast 1 thread, Burn 2 threads, fast 2 threads.
        let mut r = vec![];
        for (i, (format, threads)) in [
            ("channels-first", 1),
            ("channels-last", 1),
            ("channels-first", 2),
            ("channels-last", 2),
        ]
        .into_iter()
        .enumerate()
        {
            let (v, m) = run(format, threads)?;
            sps[i].push(v);
            r.push((v, m));
        }
        s1.push(r[1].0 / r[0].0);
        s2.push(r[3].0 / r[2].0);
        scaling.push(r[3].0 / r[1].0);
        rss.push(r[1].1 / r[0].1);
    }
    let ranges: Vec<(f64, f64, f64)> = sps.iter_mut().map(|v| median_range(v)).collect();
    let (a_med, a_min, a_max) = median_range(&mut s1);
    let (b_med, b_min, b_max) = median_range(&mut s2);
    let (c_med, c_min, c_max) = median_range(&mut scaling);
    let (d_med, d_min, d_max) = median_range(&mut rss);
    let row = |r: &(f64, f64, f64)| serde_json::json!({"median": r.0, "min": r.1, "max": r.2});
    let json = serde_json::json!({
        "reps": reps,
        "batches": 100,
        "batch_size": 64,
        "samples_per_second": {
            "burn_1thread": row(&ranges[0]),
            "fast_1thread": row(&ranges[1]),
            "burn_2threads": row(&ranges[2]),
            "fast_2threads": row(&ranges[3]),
        },
        "speedup_1thread": a_med,
        "speedup_1thread_range": [a_min, a_max],
        "speedup_2threads": b_med,
        "speedup_2threads_range": [b_min, b_max],
        "thread_scaling": c_med,
        "thread_scaling_range": [c_min, c_max],
        "peak_rss_ratio": d_med,
        "peak_rss_ratio_range": [d_min, d_max],
    });
    let f = |r: &(f64, f64, f64)| format!("{:.0} ({:.0}-{:.0})", r.0, r.1, r.2);
    let md = format!(
        "{reps} interleaved repetitions of 100 batches of 64 (the main job); median (min-max)\n\n| kernels | samples/s, 1 thread | samples/s, 2 threads |\n|---|---|---|\n| Burn's (channels-first) | {} | {} |\n| Flashover's (channels-last) | {} | {} |\n\nSpeed-up: {a_med:.2}x ({a_min:.2}-{a_max:.2}) at 1 thread, {b_med:.2}x ({b_min:.2}-{b_max:.2}) at 2 threads; fast path 2 threads over 1: {c_med:.2}x ({c_min:.2}-{c_max:.2}); peak RSS fast over Burn (1 thread): {d_med:.3} ({d_min:.3}-{d_max:.3})\n",
        f(&ranges[0]),
        f(&ranges[2]),
        f(&ranges[1]),
        f(&ranges[3]),
    );
    Ok(Some((json, md)))
}

/// Precision (`--precision`): the main job's CNN in each precision, interleaved repetitions
/// of the same short run (one training thread): samples/s and peak memory as ratios to
/// float32's in the same repetition (medians, min-max), and each precision's final test
/// accuracy (the same in every repetition: the runs are deterministic). Memory is the
/// device's reserved bytes at the end of training where the backend reports them (its pools
/// keep their peak), else the process's peak resident set (CPU backends, whose device is
/// the host). A precision the backend cannot compute is a row that says so.
fn precision_bench(b: Backend, quick: bool) -> Result<(serde_json::Value, String)> {
    let bin = build_mnist(b)?;
    // The quick run's epoch is 16 batches: shorter than the default 30-batch warmup, which the
    // example refuses, so it warms up over its first 4.
    let (reps, train_limit, warmup) = if quick {
        (3, "1024", "4ba")
    } else {
        (5, "2048", "30ba")
    };
    const PRECISIONS: [&str; 5] = ["fp32", "amp_bf16", "amp_fp16", "bf16", "fp16"];
    // Per precision: samples/s, memory, accuracy of each repetition, or why it cannot run.
    let mut sps: Vec<Vec<f64>> = vec![vec![]; PRECISIONS.len()];
    let mut mem: Vec<Vec<f64>> = vec![vec![]; PRECISIONS.len()];
    let mut accuracy = vec![f64::NAN; PRECISIONS.len()];
    let mut refused: Vec<Option<String>> = vec![None; PRECISIONS.len()];
    let mut memory_kind = "peak resident set of the process";
    for _ in 0..reps {
        for (i, p) in PRECISIONS.iter().enumerate() {
            if refused[i].is_some() {
                continue;
            }
            let args = strings(&[
                "--no-progress",
                "--precision",
                p,
                "--max-duration",
                "1ep",
                "--train-limit",
                train_limit,
                "--warmup",
                warmup,
            ]);
            match run_binary_on(b, &bin, &args, 1) {
                Ok(out) => {
                    let s = last_json(&out)?;
                    sps[i].push(s["samples_per_second"].as_f64().unwrap_or(f64::NAN));
                    let m = match s["device_reserved_bytes"].as_f64() {
                        Some(m) => {
                            memory_kind = "device memory reserved at the end of training";
                            m
                        }
                        None => s["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN),
                    };
                    mem[i].push(m);
                    accuracy[i] = s["test_accuracy"].as_f64().unwrap_or(f64::NAN);
                }
                Err(e) if e.to_string().contains("does not support") => {
                    let why = e.to_string();
                    let line = why.lines().rev().find(|l| l.contains("does not support"));
                    refused[i] = Some(format!(
                        "no {} type: {}",
                        if p.contains("bf16") {
                            "bfloat16"
                        } else {
                            "float16"
                        },
                        line.unwrap_or("refused").trim()
                    ));
                }
                Err(e) => return Err(e),
            }
        }
    }
    let mut rows = Vec::new();
    let mut md = format!(
        "{reps} interleaved repetitions of one epoch on {train_limit} digits (batches of 64, one thread); ratios to fp32 in the same repetition, median (min-max); memory: {memory_kind}\n\n| precision | samples/s | throughput / fp32 | memory / fp32 | test accuracy |\n|---|---|---|---|---|\n"
    );
    for (i, p) in PRECISIONS.iter().enumerate() {
        if let Some(why) = &refused[i] {
            rows.push(serde_json::json!({"precision": p, "supported": false, "reason": why}));
            md.push_str(&format!("| {p} | {why} | | | |\n"));
            continue;
        }
        let mut thr: Vec<f64> = sps[i].iter().zip(&sps[0]).map(|(a, b)| a / b).collect();
        let mut mr: Vec<f64> = mem[i].iter().zip(&mem[0]).map(|(a, b)| a / b).collect();
        let (s_med, s_min, s_max) = median_range(&mut sps[i].clone());
        let (t_med, t_min, t_max) = median_range(&mut thr);
        let (m_med, m_min, m_max) = median_range(&mut mr);
        rows.push(serde_json::json!({
            "precision": p,
            "supported": true,
            "samples_per_second": {"median": s_med, "min": s_min, "max": s_max},
            "throughput_ratio": t_med,
            "throughput_ratio_range": [t_min, t_max],
            "memory_ratio": m_med,
            "memory_ratio_range": [m_min, m_max],
            "test_accuracy": accuracy[i],
        }));
        md.push_str(&format!(
            "| {p} | {s_med:.0} ({s_min:.0}-{s_max:.0}) | {t_med:.3} ({t_min:.3}-{t_max:.3}) | {m_med:.3} ({m_min:.3}-{m_max:.3}) | {:.4} |\n",
            accuracy[i]
        ));
    }
    let json = serde_json::json!({
        "reps": reps,
        "train_digits": train_limit.parse::<u64>().unwrap_or(0),
        "batch_size": 64,
        "memory": memory_kind,
        "rows": rows,
    });
    Ok((json, md))
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Build { backend, check } => build(backend, check),
        Cmd::Test { backend, all } => test(backend, all),
        Cmd::Bench {
            backend,
            quick,
            no_burn_train,
            only,
        } => match only {
            Some(section) => {
                for b in backend.each() {
                    let (json, md) = if section == "s3" {
                        object_store_bench(b, quick)?
                            .context("s3s-fs is not installed (cargo install s3s-fs --version 0.14.1 --locked --features binary)")?
                    } else if section == "precision" {
                        precision_bench(b, quick)?
                    } else {
                        gpt_bench(b)?
                    };
                    let path = format!("target/bench/{}-{section}.json", b.name());
                    std::fs::create_dir_all("target/bench")?;
                    std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
                    println!("{md}\nwritten: {path}");
                }
                Ok(())
            }
            None => bench(backend, quick, no_burn_train),
        },
        Cmd::Launch {
            n,
            hostfile,
            backend,
            example,
            args,
        } => launch(n, hostfile, backend, &example, &args),
        Cmd::Check => {
            cargo(&strings(&["fmt", "--all", "--check"]))?;
            cargo(&strings(&[
                "fmt",
                "--manifest-path",
                "benches/learner/Cargo.toml",
                "--check",
            ]))?;
            cargo(&strings(&[
                "clippy",
                "--release",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))?;
            test(Backend::Flex, false)
        }
    }
}
