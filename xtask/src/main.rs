//! `cargo xtask`: build and test the workspace for one backend (or all), cheapest checks
//! first. Plain Rust over `cargo` subprocesses; it never edits source files.
//!
//! Each non-default backend builds into its own target directory (`target/backend-<name>`),
//! so switching backends does not rebuild Burn in the default `target/`.
//!
//! One module per job, as rust-analyzer's xtask: this file holds the command line and the
//! dispatch; `backend.rs` the backends, `process.rs` running cargo and the built programs,
//! `build.rs` the build, check and test commands, `launch.rs` the `mpirun` launcher and
//! `bench/` the benchmark (`mod.rs`) with one module per optional section.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

mod backend;
mod bench;
mod build;
mod launch;
mod process;

use backend::Backend;
use bench::*;
use build::*;
use launch::*;
use process::*;

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
        /// Fewer steps, one repetition of each row and one time-to-accuracy run (CI's smoke
        /// run: about 5 minutes on 2 cores, once built).
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
        /// target/bench/<backend>-precision.json. `memory`: only sharding and activation
        /// checkpointing (the `sharding.*` and `activation_checkpointing.*` rows), into
        /// target/bench/<backend>-memory.json.
        /// `gpt_fast_path`: only the GPT's CPU fast path against Burn's ops (the
        /// `gpt_fast_path.*` rows), into target/bench/<backend>-gpt_fast_path.json.
        /// `gpu`: the prepared GPU check (`--backend cuda --only gpu`, under 10 minutes on
        /// one GPU): the CNN's, ResNet-8's and the GPT's throughput in fp32, amp_bf16 and
        /// amp_fp16, and automatic microbatching through a real out-of-memory, into
        /// target/bench/<backend>-gpu.json.
        /// `streaming`: only the main job fed from shards (local and S3) against memory, the
        /// read throughput and the peak memory over a dataset 20x the cache, into
        /// target/bench/<backend>-streaming.json.
        #[arg(long, value_parser = ["gpt", "s3", "precision", "memory", "gpt_fast_path", "gpu", "streaming"])]
        only: Option<String>,
        /// With `--only gpu`: run the programs already built in the backend's target
        /// directory, without cargo (on a machine that received only the built programs).
        #[arg(long, requires = "only")]
        no_build: bool,
    },
    /// Write the bundled datasets as shards, or index Parquet files (runs the `shards`
    /// example): `cargo xtask shards mnist <out>` writes <out>/train and <out>/test in MDS
    /// (then `cargo run --release --example mnist -- --data <out>`); `shards shakespeare
    /// <out>`; `shards index <parquet folder>` writes the index.json an object store needs.
    /// `--size-limit 1MB` and `--compression zstd:3` shape the shards.
    Shards {
        /// The `shards` example's arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        args: Vec<String>,
    },
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
            no_build,
        } => match only {
            Some(section) => {
                for b in backend.each() {
                    let (json, md) = if section == "s3" {
                        object_store_bench(b, quick)?
                            .context("s3s-fs is not installed (cargo install s3s-fs --version 0.14.1 --locked --features binary)")?
                    } else if section == "gpu" {
                        gpu_bench(b, !no_build)?
                    } else if section == "streaming" {
                        streaming_bench(b, quick)?
                    } else if section == "precision" {
                        precision_bench(b, quick)?
                    } else if section == "gpt_fast_path" {
                        let mut args = strings(&["build", "--release", "--example", "shakespeare"]);
                        args.extend(b.cargo_args(bench_selection(), &[]));
                        cargo(&args)?;
                        gpt_fast_path_bench(b, quick)?
                            .context("the GPT's fast path is measured on the CPU backends only")?
                    } else if section == "memory" {
                        // The single-process rows run the example as the full bench builds it.
                        let mut args = strings(&["build", "--release", "--example", "shakespeare"]);
                        args.extend(b.cargo_args(bench_selection(), &[]));
                        cargo(&args)?;
                        memory_bench(b, quick)?
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
        Cmd::Shards { args } => {
            let mut cmd = strings(&["run", "--release", "--example", "shards", "--"]);
            cmd.extend(args);
            cargo(&cmd)
        }
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
