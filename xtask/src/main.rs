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

    /// Cargo arguments that select this backend for the example and test packages.
    fn cargo_args(self) -> Vec<String> {
        match self {
            Backend::Flex => vec![],
            b => vec![
                "--target-dir".into(),
                format!("target/backend-{}", b.name()),
                "--features".into(),
                format!("flashover-examples/{0},flashover-tests/{0}", b.name()),
            ],
        }
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
    /// others run the cross-crate suite on that backend, less the long accuracy test and the
    /// SIGKILL timing test.
    Test {
        #[arg(long, value_enum, default_value_t = Backend::Flex)]
        backend: Backend,
    },
    /// fmt check, clippy with warnings denied, then the tests (default backend).
    Check,
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
    },
}

fn cargo(args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .with_context(|| format!("running {cargo}"))?;
    if !status.success() {
        bail!("cargo {} failed with {status}", args.join(" "));
    }
    Ok(())
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn build(backend: Backend, check: bool) -> Result<()> {
    let verb = if check { "check" } else { "build" };
    for b in backend.each() {
        let mut args = strings(&[verb, "--release", "--workspace", "--all-targets"]);
        if b != Backend::Flex {
            args = strings(&[
                verb,
                "--release",
                "-p",
                "flashover-examples",
                "-p",
                "flashover-tests",
                "--all-targets",
            ]);
        }
        args.extend(b.cargo_args());
        cargo(&args)?;
    }
    Ok(())
}

fn test(backend: Backend) -> Result<()> {
    for b in backend.each() {
        if b == Backend::Flex {
            cargo(&strings(&["test", "--release", "--workspace"]))?;
            continue;
        }
        // The same packages as `build`, so a build followed by a test compiles nothing twice.
        let mut args = strings(&[
            "test",
            "--release",
            "-p",
            "flashover-examples",
            "-p",
            "flashover-tests",
        ]);
        args.extend(b.cargo_args());
        // The long accuracy run and the SIGKILL test (whose kill times are tuned to the CPU
        // backend's speed) run on the default backend only.
        // Per-algorithm resumption (14 runs of three processes each) is exercised on the
        // default backend; GPU backends run the combined resumption test with every stateful
        // algorithm on. The example's log files, trace and plot are written by host code that
        // does not depend on the backend; the monitors themselves run on every backend.
        // The tidy rules read source files and the wall-clock tests time the host loop:
        // neither depends on the backend. The hardening tests check inputs, files, locks and
        // messages on the host before or around training, the same code on every backend.
        args.extend(strings(&[
            "--",
            "--skip",
            "accuracy::",
            "--skip",
            "crash::",
            "--skip",
            "algorithms::resume_each::",
            "--skip",
            "observe::example_",
            "--skip",
            "tidy::",
            "--skip",
            "trainer::wall_clock::",
            "--skip",
            "hardening::",
        ]));
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
    let bin = format!("{}/release/examples/{name}", backend.target_dir());
    run_binary(backend, &bin, args)
}

/// Runs the program `bin` with `args` and `--backend`, pinned to one compute thread, and
/// returns its stdout; a missing device is reported as "no device".
fn run_binary(backend: Backend, bin: &str, args: &[String]) -> Result<String> {
    eprintln!("$ {bin} {}", args.join(" "));
    let out = Command::new(bin)
        .args(args)
        .args(["--backend", backend.name()])
        .env("RAYON_NUM_THREADS", "1")
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
fn overhead_json(plain: &str, learner: &str) -> Result<serde_json::Value> {
    let mut o = last_json(plain)?;
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
        "git_commit": commit,
    })
}

fn bench(backend: Backend, quick: bool) -> Result<()> {
    for b in backend.each() {
        let mut args = strings(&[
            "build",
            "--release",
            "-p",
            "flashover-examples",
            "--example",
            "overhead",
            "--example",
            "checkpoint_io",
            "--example",
            "time_to_accuracy",
            "--example",
            "scaling",
        ]);
        args.extend(
            b.cargo_args()
                .into_iter()
                .filter(|a| !a.contains("flashover-tests")),
        );
        if b != Backend::Flex {
            let n = args.len();
            args[n - 1] = format!("flashover-examples/{}", b.name());
        }
        cargo(&args)?;
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
        let checkpoint = run_example(b, "checkpoint_io", &strings(&["--reps", reps]))?;
        // burn-train's Learner, from its own workspace (see benches/learner/Cargo.toml).
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
        let learner = run_binary(
            b,
            "target/learner/release/flashover-learner-bench",
            &strings(&["--steps", steps, "--reps", reps]),
        )?;
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
        let (scale_steps, scale_reps) = if quick { ("10", "1") } else { ("40", "5") };
        let scaling = run_example(
            b,
            "scaling",
            &strings(&["--steps", scale_steps, "--reps", scale_reps]),
        )?;
        let report = serde_json::json!({
            "machine": machine(b),
            "quick": quick,
            "overhead": overhead_json(&overhead, &learner)?,
            "checkpoint": last_json(&checkpoint)?,
            "recipes": tta_json["recipes"],
            "time_to_accuracy": tta_json,
            "scaling": last_json(&scaling)?,
        });
        let json_path = format!("target/bench/{}.json", b.name());
        std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)?;
        let md = format!(
            "# Flashover bench: {} ({})\n\n## Trainer overhead\n\n{}\n\n{}\n\n## Checkpoint I/O\n\n{}\n\n## Time to accuracy\n\n{}\n\n{}\n\nCurves: `{plot_path}`\n\n## Scaling\n\n{}\n",
            b.name(),
            if quick { "quick" } else { "full" },
            table(&overhead),
            table(&learner),
            table(&checkpoint),
            tta.lines().find(|l| l.starts_with("Target:")).unwrap_or(""),
            table(&tta),
            table(&scaling)
        );
        let md_path = format!("target/bench/{}.md", b.name());
        std::fs::write(&md_path, &md)?;
        println!("{md}\nwritten: {json_path}, {md_path}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Build { backend, check } => build(backend, check),
        Cmd::Test { backend } => test(backend),
        Cmd::Bench { backend, quick } => bench(backend, quick),
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
            test(Backend::Flex)
        }
    }
}
