//! The MNIST example built with MPI support, for the multi-process tests.
//!
//! The test command builds nothing that links a system library (a machine without OpenMPI
//! builds and runs everything else), so where `mpirun` is installed these tests build the
//! example with the `mpi` feature themselves, once per test binary, in a target directory of
//! its own (`<target>/mpi`: a nested cargo cannot share the running `cargo test`'s directory,
//! which it holds locked, and another feature set there would replace the plain example the
//! other tests run). `cargo xtask launch` and the bench's multi-process rows build the same
//! way into the same directory, so after the tests they build nothing. Where the suite itself
//! was built with the `mpi` feature (`cargo xtask test --backend wgpu`), the example beside
//! the test binary already has it.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use super::skip::{skipped, Need};

/// Whether `mpirun` runs here.
pub fn have_mpirun() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The workspace's root and the test binary's target directory and profile.
fn locations() -> (PathBuf, PathBuf, String) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests package lives in the workspace")
        .to_path_buf();
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binaries live in <target>/<profile>/deps");
    let profile = profile_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "release".into());
    let target = profile_dir
        .parent()
        .expect("a profile directory lives in the target directory")
        .to_path_buf();
    (root, target, profile)
}

/// Whether `name` is one of the variables cargo sets for the program it runs (a test binary
/// here): the package's `CARGO_PKG_*`, its manifest, crate and output directory, and the
/// test-only ones. (`CARGO`, `CARGO_HOME` and cargo's own settings pass through.)
fn is_cargo_test_variable(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "OUT_DIR"
        )
}

/// Builds the MPI example into `<target>/mpi`; its path, or the build's error output.
fn build() -> Result<PathBuf, String> {
    let (root, target, profile) = locations();
    let dir = target.join("mpi");
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    // The variables `cargo test` sets for this process (its package, manifest, crate) must
    // not reach the nested build: ring's build script watches several of them
    // (`rerun-if-env-changed=CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, ...), so with them the
    // build here and CI's or `cargo xtask`'s plain build of the same example would each
    // rerun it and rebuild ring, reqwest, object_store and everything above them (minutes
    // of CI's two cores, twice). xtask's `is_cargo_run_variable` strips the same set.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_cargo_test_variable) {
            c.env_remove(&name);
        }
    }
    c.current_dir(&root).arg("build");
    if profile == "release" {
        c.arg("--release");
    }
    if super::BACKEND == "flex" {
        // The whole workspace's features, as the test command and the README's `cargo run`
        // resolve them, plus `mpi`: every crate that does not depend on MPI is the same unit
        // as in the plain build, so a copy of that build's directory (CI seeds `target/mpi`
        // with one) leaves only the MPI crates and those above them to compile.
        c.args([
            "--workspace",
            "--example",
            "mnist",
            "--features",
            "flashover-examples/mpi",
        ]);
    } else {
        c.args([
            "-p",
            "flashover-examples",
            "--example",
            "mnist",
            "--no-default-features",
        ]);
        c.arg("--features").arg(format!(
            "flashover-examples/mpi,flashover-examples/{}",
            super::BACKEND
        ));
    }
    c.arg("--target-dir").arg(&dir);
    use std::io::Write;
    let _ = std::io::stderr().write_all(
        format!(
            "building the MNIST example with MPI for the multi-process tests in {} (minutes, the first time)\n",
            dir.display()
        )
        .as_bytes(),
    );
    let out = c.output().map_err(|e| format!("running cargo: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        return Err(tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    let bin = dir.join(profile).join("examples").join("mnist");
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "the build succeeded but {} is missing",
            bin.display()
        ))
    }
}

/// The MNIST example with MPI support, or `None` after recording a skip: `mpirun` is
/// missing, or the example does not build with MPI (no MPI development files or libclang).
/// Fails instead where `FLASHOVER_REQUIRE_MPI` is set.
pub fn mnist() -> Option<PathBuf> {
    if !have_mpirun() {
        skipped(Need::Mpi, "mpirun not found");
        return None;
    }
    if cfg!(feature = "mpi") {
        return Some(super::example_bin("mnist"));
    }
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BUILT.get_or_init(build) {
        Ok(bin) => Some(bin.clone()),
        Err(e) if Need::Mpi.is_required() => {
            panic!("the MNIST example does not build with MPI:\n{e}")
        }
        Err(e) => {
            let first = e.lines().find(|l| l.contains("error")).unwrap_or(
                "see `cargo build --release --workspace --example mnist --features flashover-examples/mpi`",
            );
            skipped(
                Need::Mpi,
                &format!("mpirun is there, but the example does not build with MPI: {first}"),
            );
            None
        }
    }
}
