//! `cargo xtask launch`: the MNIST example under `mpirun`, built with MPI.

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::backend::Backend;
use crate::process::*;

pub(crate) fn launch(
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
