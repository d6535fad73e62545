//! Running cargo and the built programs: the variables `cargo run` sets that must not reach
//! nested builds, the examples pinned to a thread count, their JSON output, the MPI build of
//! an example, and the programs the optional parts need (`mpirun`, `s3s-fs`).

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::backend::Backend;

/// The variables `cargo run` sets for the program it runs (xtask's package, manifest and
/// crate). They must not reach the builds xtask starts: build scripts that watch one of them
/// (ring's, through `rerun-if-env-changed=CARGO_PKG_NAME` and the like) would see another
/// value than in a plain `cargo build` and rerun, rebuilding ring, reqwest, object_store and
/// everything above them on every switch between the two (about 3 minutes each time).
pub(crate) fn is_cargo_run_variable(name: &str) -> bool {
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

pub(crate) fn cargo(args: &[String]) -> Result<()> {
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
pub(crate) fn mpirun_args(
    n: usize,
    hostfile: Option<&std::path::Path>,
    program: &str,
) -> Vec<String> {
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

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

pub(crate) fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Runs a built example with `args`, pinned to one compute thread, and returns its stdout.
pub(crate) fn run_example(backend: Backend, name: &str, args: &[String]) -> Result<String> {
    run_example_on(backend, name, args, 1)
}

/// Runs a built example with `args` on `threads` compute threads (`RAYON_NUM_THREADS`).
pub(crate) fn run_example_on(
    backend: Backend,
    name: &str,
    args: &[String],
    threads: usize,
) -> Result<String> {
    let bin = format!("{}/release/examples/{name}", backend.target_dir());
    run_binary_on(backend, &bin, args, threads)
}

/// Runs the program `bin` with `args` and `--backend`, pinned to one compute thread, and
/// returns its stdout; a missing device is reported as "no device".
pub(crate) fn run_binary(backend: Backend, bin: &str, args: &[String]) -> Result<String> {
    run_binary_on(backend, bin, args, 1)
}

/// [`run_binary`] on `threads` compute threads.
pub(crate) fn run_binary_on(
    backend: Backend,
    bin: &str,
    args: &[String],
    threads: usize,
) -> Result<String> {
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

pub(crate) fn last_json(stdout: &str) -> Result<serde_json::Value> {
    let line = stdout.lines().last().unwrap_or("");
    serde_json::from_str(line)
        .with_context(|| format!("expected a JSON summary line, got {line:?}"))
}

/// What every flex build in the bench selects: the whole workspace, exactly as the test
/// command builds it (features unified), so that after the tests the bench builds nothing.
/// It needs no OpenMPI: the multi-process rows run the separate MPI build
/// ([`build_mpi_example`]).
pub(crate) fn bench_selection() -> &'static [&'static str] {
    &["--workspace"]
}

/// Builds `example` with MPI support and returns its path. On the CPU backend: the whole
/// workspace's features plus `mpi`, in `target/mpi`, exactly as the multi-process tests
/// build it (`tests/support/mpi.rs`: same packages, features and directory, so whichever runs
/// first builds it for the other; the crates without MPI are the plain build's units, so a
/// copy of `target/release` there seeds it, as CI does); the plain build in `target` stays
/// free of MPI. A GPU backend's build always has MPI (see [`Backend::cargo_args`]).
pub(crate) fn build_mpi_example(b: Backend, example: &str) -> Result<String> {
    if b != Backend::Flex {
        let mut args = strings(&["build", "--release", "--example", example]);
        args.extend(b.cargo_args(&[], &[]));
        cargo(&args)?;
        return Ok(format!("{}/release/examples/{example}", b.target_dir()));
    }
    cargo(&strings(&[
        "build",
        "--release",
        "--workspace",
        "--example",
        example,
        "--features",
        "flashover-examples/mpi",
        "--target-dir",
        "target/mpi",
    ]))?;
    Ok(format!("target/mpi/release/examples/{example}"))
}

/// Builds the `mnist` example for `b` as the bench builds every program (without MPI on the
/// CPU backend; a GPU backend's build always has it); returns its path.
pub(crate) fn build_mnist(b: Backend) -> Result<String> {
    let mut args = strings(&["build", "--release", "--example", "mnist"]);
    args.extend(b.cargo_args(bench_selection(), &[]));
    cargo(&args)?;
    Ok(format!("{}/release/examples/mnist", b.target_dir()))
}

/// The `s3s-fs` test server (an S3-compatible server that verifies signatures), if installed
/// (on PATH or in ~/.cargo/bin).
pub(crate) fn s3s_fs() -> Option<std::path::PathBuf> {
    let home = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo/bin"));
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(home)
        .map(|d| d.join("s3s-fs"))
        .find(|p| p.is_file())
}

/// Starts `s3s-fs` (`bin`) on a free port of 127.0.0.1 serving `root` with the given keys,
/// and waits until it accepts connections; returns the process and its port.
pub(crate) fn start_s3s_fs(
    bin: &std::path::Path,
    root: &std::path::Path,
    key: &str,
    secret: &str,
) -> Result<(std::process::Child, u16)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = Command::new(bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", key, "--secret-key", secret])
        .arg(root)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let started = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if started.elapsed().as_secs() >= 20 {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("s3s-fs did not start");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok((child, port))
}

/// A tracking server `mlflow server` (Python's `mlflow`) on a free port of 127.0.0.1, with a
/// SQLite store and artifacts in a scratch folder under `target/`; stopped (its process group)
/// and the folder removed when dropped.
pub(crate) struct MlflowServer {
    child: std::process::Child,
    root: std::path::PathBuf,
    /// The tracking URI.
    pub(crate) uri: String,
}

impl MlflowServer {
    /// Starts one, or says why not and returns `None` where `mlflow` is not installed.
    pub(crate) fn start() -> Result<Option<MlflowServer>> {
        use std::os::unix::process::CommandExt;
        let installed = Command::new("mlflow")
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !installed {
            eprintln!(
                "mlflow is not installed (pip install mlflow): the MLflow overhead row is skipped"
            );
            return Ok(None);
        }
        let root = std::path::Path::new("target")
            .join("bench-mlflow")
            .join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)?;
        let root = root.canonicalize()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("mlflow")
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--workers", "1"])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", root.join("mlflow.db").display()))
            .arg("--artifacts-destination")
            .arg(root.join("artifacts"))
            .current_dir(&root)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(root.join("server.log"))?)
            .process_group(0)
            .spawn()
            .context("starting mlflow server")?;
        let server = MlflowServer {
            child,
            root,
            uri: format!("http://127.0.0.1:{port}"),
        };
        let started = std::time::Instant::now();
        loop {
            use std::io::{Read, Write};
            let healthy = std::net::TcpStream::connect(("127.0.0.1", port))
                .and_then(|mut s| {
                    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
                    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
                    let mut answer = String::new();
                    s.read_to_string(&mut answer)?;
                    Ok(answer.contains(" 200 "))
                })
                .unwrap_or(false);
            if healthy {
                return Ok(Some(server));
            }
            if started.elapsed().as_secs() >= 180 {
                bail!(
                    "mlflow server did not answer within 180 s: {}",
                    std::fs::read_to_string(server.root.join("server.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        std::thread::sleep(std::time::Duration::from_millis(500));
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Whether OpenMPI's launcher is installed.
/// Runs `mpirun` with `args` (from [`mpirun_args`] on), one compute thread per rank, and
/// returns rank 0's JSON summary line; the job's stderr in the error when it fails.
pub(crate) fn mpirun_summary(args: &[String]) -> Result<serde_json::Value> {
    eprintln!("$ mpirun {}", args.join(" "));
    let out = Command::new("mpirun")
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .context("running mpirun")?;
    if !out.status.success() {
        anyhow::bail!("mpirun failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    last_json(&String::from_utf8_lossy(&out.stdout))
}

pub(crate) fn have_mpirun() -> bool {
    Command::new("mpirun").arg("--version").output().is_ok()
}
