//! The backends xtask builds for: their features, target directories and names.

use clap::ValueEnum;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
    Flex,
    Ndarray,
    Wgpu,
    Cuda,
    All,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Ndarray => "ndarray",
            Backend::Wgpu => "wgpu",
            Backend::Cuda => "cuda",
            Backend::All => "all",
        }
    }

    pub(crate) fn each(self) -> Vec<Backend> {
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
    pub(crate) fn cargo_args(self, flex_selection: &[&str], flex_features: &[&str]) -> Vec<String> {
        self.cargo_args_mpi(flex_selection, flex_features, true)
    }

    /// [`Backend::cargo_args`], with a GPU backend's `mpi` feature only if `mpi`: the test
    /// subset (`GPU_SUBSET`) runs no multi-process test, and leaving MPI out spares its build
    /// the bindings to OpenMPI (a libclang run over `mpi.h`) at the cost of compiling the
    /// example and test packages apart from `build`'s.
    pub(crate) fn cargo_args_mpi(
        self,
        flex_selection: &[&str],
        flex_features: &[&str],
        mpi: bool,
    ) -> Vec<String> {
        if self == Backend::Flex {
            let mut args: Vec<String> = flex_selection.iter().map(|s| s.to_string()).collect();
            if !flex_features.is_empty() {
                args.push("--features".into());
                args.push(flex_features.join(","));
            }
            return args;
        }
        let mut args: Vec<String> = ["-p", "flashover-examples", "-p", "flashover-tests"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push("--target-dir".into());
        args.push(format!("target/backend-{}", self.name()));
        args.push("--no-default-features".into());
        args.push("--features".into());
        let mut features = format!("flashover-examples/{0},flashover-tests/{0}", self.name());
        if mpi {
            features.push_str(",flashover-tests/mpi");
        }
        args.push(features);
        args
    }
}

impl Backend {
    pub(crate) fn target_dir(self) -> String {
        match self {
            Backend::Flex => "target".into(),
            b => format!("target/backend-{}", b.name()),
        }
    }
}
