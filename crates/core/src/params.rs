//! Model parameters as a whole: seeded initialisation and a canonical digest.
//!
//! Burn 0.21 initialises parameters lazily, at first use, from the backend's global random
//! generator. [`init_model`] therefore seeds the backend and forces every parameter in the
//! module's field order while holding a process-wide lock, so that two models built with the
//! same seed are identical even when other threads build models at the same time.
//! [`params_sha256`] hashes every parameter in a canonical order (sorted by path), which is how
//! runs are compared bit for bit.

use std::sync::Mutex;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sha2::{Digest, Sha256};

/// Serialises every use of a backend's global random generator by Flashover.
static BACKEND_RNG: Mutex<()> = Mutex::new(());

/// Seeds the backend's global generator (used by random tensor ops such as dropout).
pub fn seed_backend<B: Backend>(device: &B::Device, seed: u64) {
    // A poisoned lock only means another thread panicked while seeding; the guarded data is
    // `()`, so continuing is sound.
    let _guard = BACKEND_RNG.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
}

struct ForceInit;

impl<B: Backend> ModuleVisitor<B> for ForceInit {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // Reading the value of a lazy parameter initialises it.
        let _ = param.val();
    }
}

/// Builds a model with `build`, with every parameter drawn from a generator seeded by `seed`,
/// in the module's field order.
pub fn init_model<B: Backend, M: Module<B>>(
    device: &B::Device,
    seed: u64,
    build: impl FnOnce(&B::Device) -> M,
) -> M {
    let _guard = BACKEND_RNG.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
    let model = build(device);
    model.visit(&mut ForceInit);
    model
}

/// The parameter's layer: its path without the final name (`conv1.weight` -> `conv1`), the
/// module that owns it. Layer freezing and the norm monitor group parameters by it.
pub fn layer_of(path: &str) -> &str {
    path.rsplit_once('.').map(|(l, _)| l).unwrap_or(path)
}

struct Collect {
    path: Vec<String>,
    entries: Vec<(String, String, Vec<usize>, Vec<u8>)>,
}

impl<B: Backend> ModuleVisitor<B> for Collect {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let data = param.val().into_data();
        let mut path = self.path.join(".");
        if path.is_empty() {
            path = format!("param{}", self.entries.len());
        }
        self.entries.push((
            path,
            format!("{:?}", data.dtype),
            data.shape.to_vec(),
            data.as_bytes().to_vec(),
        ));
    }
}

/// SHA-256 (hex) over every float parameter: for each, in order of its path, the path, dtype,
/// shape and raw element bytes. Equal digests mean bit-identical weights.
pub fn params_sha256<B: Backend, M: Module<B>>(model: &M) -> String {
    let mut c = Collect {
        path: Vec::new(),
        entries: Vec::new(),
    };
    model.visit(&mut c);
    c.entries.sort_by(|a, b| a.0.cmp(&b.0));
    let mut h = Sha256::new();
    for (path, dtype, shape, bytes) in &c.entries {
        h.update((path.len() as u64).to_le_bytes());
        h.update(path.as_bytes());
        h.update(dtype.as_bytes());
        h.update((shape.len() as u64).to_le_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}
