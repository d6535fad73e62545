//! Tests that need a program this machine may lack (OpenMPI's `mpirun`, the `s3s-fs` server,
//! TensorBoard's reader, network namespaces) skip visibly instead of passing in silence:
//!
//! - the skip is written to the terminal at once, past libtest's output capture (a direct
//!   write to the process's stderr, which `eprintln!`'s capture does not intercept);
//! - it is recorded in `<target>/<profile>/flashover-skipped/<cargo pid>`, which the
//!   `skipped` test target (`tests/skipped.rs`, run by cargo right after this suite) reads
//!   to end the suite's output with one line that counts what was skipped, by what it
//!   needs, and how to enable it;
//! - where the environment variable that `.ci/run` sets says the program must be there
//!   (`FLASHOVER_REQUIRE_MPI`, `_S3`, `_TENSORBOARD`, `_NETNS`), the test fails instead.
//!
//! The record is keyed by the parent process (the `cargo test` that runs both binaries), so
//! two runs never read each other's skips; the summary deletes what it read.

use std::io::Write;
use std::path::PathBuf;

/// A program (or permission) some tests need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// OpenMPI's `mpirun`, and the MPI development files to build the example with MPI.
    Mpi,
    /// The S3-compatible test server `s3s-fs`.
    S3sFs,
    /// Python's `tensorboard` package (TensorBoard's own event reader).
    TensorBoard,
    /// Root, to create network namespaces and a veth pair.
    NetNs,
    /// Python's `mosaicml-streaming` and `pyarrow` packages (the real writers of the shard
    /// formats the streaming tests read).
    PyWriters,
    /// Python's `mlflow` package (the tracking server and its client).
    Mlflow,
}

impl Need {
    /// Every need, in the order the summary lists them.
    pub const ALL: [Need; 6] = [
        Need::Mpi,
        Need::S3sFs,
        Need::TensorBoard,
        Need::NetNs,
        Need::PyWriters,
        Need::Mlflow,
    ];

    /// The key written in the record.
    pub fn key(self) -> &'static str {
        match self {
            Need::Mpi => "mpi",
            Need::S3sFs => "s3s-fs",
            Need::TensorBoard => "tensorboard",
            Need::NetNs => "netns",
            Need::PyWriters => "pywriters",
            Need::Mlflow => "mlflow",
        }
    }

    /// The need of a record key.
    pub fn from_key(key: &str) -> Option<Need> {
        Need::ALL.into_iter().find(|n| n.key() == key)
    }

    /// What is missing, in words.
    pub fn what(self) -> &'static str {
        match self {
            Need::Mpi => "OpenMPI (mpirun)",
            Need::S3sFs => "the S3 test server s3s-fs",
            Need::TensorBoard => "TensorBoard's reader",
            Need::NetNs => "network namespaces (root)",
            Need::PyWriters => "Python's mosaicml-streaming and pyarrow",
            Need::Mlflow => "an MLflow tracking server (Python's mlflow)",
        }
    }

    /// How to get it.
    pub fn how(self) -> &'static str {
        match self {
            Need::Mpi => "apt-get install -y libopenmpi-dev openmpi-bin libclang-dev",
            Need::S3sFs => "cargo install s3s-fs --version 0.14.1 --locked --features binary",
            Need::TensorBoard => "pip install tensorboard",
            Need::NetNs => "run the tests as root with iproute2 installed",
            Need::PyWriters => "pip install --no-deps mosaicml-streaming==0.13.0 && pip install numpy zstd 'xxhash<4' python-snappy Brotli Pillow filelock typing_extensions tqdm pyarrow",
            Need::Mlflow => "pip install 'mlflow[auth]'",
        }
    }

    /// The variable that makes the need a requirement (`.ci/run` sets it).
    pub fn required_by(self) -> &'static str {
        match self {
            Need::Mpi => "FLASHOVER_REQUIRE_MPI",
            Need::S3sFs => "FLASHOVER_REQUIRE_S3",
            Need::TensorBoard => "FLASHOVER_REQUIRE_TENSORBOARD",
            Need::NetNs => "FLASHOVER_REQUIRE_NETNS",
            Need::PyWriters => "FLASHOVER_REQUIRE_PYWRITERS",
            Need::Mlflow => "FLASHOVER_REQUIRE_MLFLOW",
        }
    }

    /// Whether this run must have it.
    pub fn is_required(self) -> bool {
        std::env::var_os(self.required_by()).is_some()
    }
}

/// The folder the records of skips live in, beside the test binaries
/// (`<target>/<profile>/flashover-skipped`).
pub fn records_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.join("flashover-skipped"))
}

/// The record of the `cargo test` this process runs under.
pub fn record_file() -> Option<PathBuf> {
    Some(records_dir()?.join(std::os::unix::process::parent_id().to_string()))
}

/// The running test's name (libtest names each test's thread after it).
fn test_name() -> String {
    match std::thread::current().name() {
        Some(n) if n != "main" => n.to_string(),
        _ => "(unnamed test)".to_string(),
    }
}

/// The calling test skips what needs `need` (`why`: what was found missing). Fails the test
/// instead where the need is required. Otherwise prints a `SKIPPED` line past the output
/// capture and records the skip for the summary line.
pub fn skipped(need: Need, why: &str) {
    let test = test_name();
    assert!(
        !need.is_required(),
        "{test} needs {} ({why}), and {} says it must run here: {}",
        need.what(),
        need.required_by(),
        need.how()
    );
    let line = format!(
        "SKIPPED {test}: needs {} ({why}); to run it: {}\n",
        need.what(),
        need.how()
    );
    // Past libtest's capture: only the print macros are captured, not the stderr handle.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let (Some(dir), Some(file)) = (records_dir(), record_file()) {
        let _ = std::fs::create_dir_all(dir);
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
        {
            // One short line per write: appends of it do not interleave.
            let _ = f.write_all(format!("{}\t{test}\n", need.key()).as_bytes());
        }
    }
}

/// The summary line of a record's text (`need<TAB>test` lines), or `None` if it is empty.
pub fn summary_line(record: &str) -> Option<String> {
    let mut by_need: std::collections::BTreeMap<Need, Vec<&str>> = Default::default();
    for line in record.lines() {
        if let Some((key, test)) = line.split_once('\t') {
            if let Some(need) = Need::from_key(key) {
                by_need.entry(need).or_default().push(test);
            }
        }
    }
    let total: usize = by_need.values().map(Vec::len).sum();
    if total == 0 {
        return None;
    }
    let parts: Vec<String> = by_need
        .iter()
        .map(|(need, tests)| {
            let mut modules: Vec<&str> = tests
                .iter()
                .map(|t| t.split("::").next().unwrap_or(t))
                .collect();
            modules.sort_unstable();
            modules.dedup();
            format!(
                "{} {} {} [{}] ({})",
                tests.len(),
                if tests.len() == 1 { "needs" } else { "need" },
                need.what(),
                modules.join(", "),
                need.how()
            )
        })
        .collect();
    Some(format!(
        "SKIPPED {total} {}: {}; .ci/run installs all of them and requires them",
        if total == 1 { "test" } else { "tests" },
        parts.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_and_names_what_was_skipped_and_how_to_enable_it() {
        let record =
            "s3s-fs\tobject_store::a\nmpi\tdistributed::b\ns3s-fs\tobject_store::c\nbogus\tx\n";
        let line = summary_line(record).unwrap();
        assert!(
            line.starts_with("SKIPPED 3 tests: 1 needs OpenMPI (mpirun) [distributed]"),
            "{line}"
        );
        assert!(
            line.contains("2 need the S3 test server s3s-fs [object_store] (cargo install s3s-fs"),
            "{line}"
        );
        assert!(!line.contains('\n'));
        assert_eq!(summary_line(""), None);
    }
}
