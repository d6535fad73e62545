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
    },
    /// Run the tests with a backend. The default backend runs the whole workspace suite;
    /// others run the cross-crate suite on that backend, less the long accuracy test.
    Test {
        #[arg(long, value_enum, default_value_t = Backend::Flex)]
        backend: Backend,
    },
    /// fmt check, clippy with warnings denied, then the tests (default backend).
    Check,
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

fn build(backend: Backend) -> Result<()> {
    for b in backend.each() {
        let mut args = strings(&["build", "--release", "--workspace", "--all-targets"]);
        if b != Backend::Flex {
            args = strings(&[
                "build",
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
        args.extend(strings(&["--", "--skip", "accuracy::"]));
        cargo(&args)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Build { backend } => build(backend),
        Cmd::Test { backend } => test(backend),
        Cmd::Check => {
            cargo(&strings(&["fmt", "--all", "--check"]))?;
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
