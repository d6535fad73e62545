//! Model parameters as a whole: seeded initialisation and a canonical digest.
//!
//! Burn 0.21 initialises parameters lazily, at first use, from the backend's global random
//! generator. [`init_model`] therefore seeds the backend and forces every parameter in the
//! module's field order while holding a process-wide lock, so that two models built with the
//! same seed are identical even when other threads build models at the same time.
//! [`params_sha256`] hashes every parameter in a canonical order (sorted by path), which is how
//! runs are compared bit for bit. The flat buffers ([`flatten_grads`], [`flatten_params`] and
//! their inverses) lay every parameter out in the module's order, which is the same on every
//! rank of a data-parallel run: one buffer per collective operation.

use std::collections::HashSet;
use std::sync::Mutex;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
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

/// Folds the pending updates of the model's running state (Burn's `RunningState`, the
/// statistics of `BatchNorm`) into its values. Burn keeps each update pending until the
/// layer's next training step and a module visitor reads the value without it, so a
/// checkpoint or a digest taken between steps would see the statistics of one batch
/// earlier, and a resumed run would differ from the straight one. Turning a clone into a
/// record syncs the shared state; parameters are untouched.
pub fn sync_running_states<B: Backend, M: Module<B>>(model: &M) {
    let _ = model.clone().into_record();
}

/// SHA-256 (hex) over every float parameter: for each, in order of its path, the path, dtype,
/// shape and raw element bytes. Equal digests mean bit-identical weights.
pub fn params_sha256<B: Backend, M: Module<B>>(model: &M) -> String {
    sync_running_states::<B, M>(model);
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

/// Collects every trainable parameter's gradient, flattened, in the module's order; a
/// trainable parameter without a gradient (or every one, when `grads` is `None`) contributes
/// zeros, so every rank's buffer has the same layout.
struct FlattenGrads<'a, AB: AutodiffBackend> {
    grads: Option<&'a GradientsParams>,
    pieces: Vec<Tensor<AB::InnerBackend, 1>>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for FlattenGrads<'_, AB> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let n = value.shape().num_elements();
        let piece = match self
            .grads
            .and_then(|g| g.get::<AB::InnerBackend, D>(param.id))
        {
            Some(g) => g.reshape([n]),
            None => Tensor::zeros([n], &value.device()),
        };
        self.pieces.push(piece);
    }
}

/// Every trainable parameter's gradient in one flat buffer, in the module's parameter order
/// (zeros where a parameter has none, or for all of them when `grads` is `None`): what one
/// all-reduce per optimizer step sends. `None` when the model has no trainable parameter.
pub fn flatten_grads<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    grads: Option<&GradientsParams>,
) -> Option<Tensor<AB::InnerBackend, 1>> {
    let mut v = FlattenGrads::<AB> {
        grads,
        pieces: Vec::new(),
    };
    model.visit(&mut v);
    (!v.pieces.is_empty()).then(|| Tensor::cat(v.pieces, 0))
}

/// [`flatten_grads`]'s buffer on the host, one piece per trainable parameter (module order):
/// each gradient is taken out of `grads`, multiplied by `weight` (in its own dtype, element by
/// element, so the bits are those of multiplying the whole buffer), copied out and freed, so
/// the gradients and their host copy never coexist whole. A parameter without a gradient
/// brings zeros.
pub fn drain_grads_to_host<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    grads: Option<GradientsParams>,
    weight: Option<f64>,
) -> Vec<Vec<f32>> {
    struct Drain<AB> {
        grads: Option<GradientsParams>,
        weight: Option<f64>,
        out: Vec<Vec<f32>>,
        _b: std::marker::PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Drain<AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let value = param.val();
            if !value.is_require_grad() {
                return;
            }
            let n = value.shape().num_elements();
            let grad = self
                .grads
                .as_mut()
                .and_then(|g| g.remove::<AB::InnerBackend, D>(param.id));
            let Some(grad) = grad else {
                self.out.push(vec![0.0; n]);
                return;
            };
            let grad = grad.reshape([n]);
            let grad = match self.weight {
                Some(w) => grad.mul_scalar(w),
                None => grad,
            };
            let data = grad.into_data().convert::<f32>();
            // The data's own allocation (no copy) where the backend hands it over whole. (An
            // error is unreachable after `convert`; the exchange checks every piece's length.)
            self.out.push(data.into_vec::<f32>().unwrap_or_default());
        }
    }
    let mut v = Drain::<AB> {
        grads,
        weight,
        out: Vec::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut v);
    v.out
}

/// Reads gradients back from a buffer laid out by [`flatten_grads`].
struct UnflattenGrads<'a, AB: AutodiffBackend> {
    flat: Tensor<AB::InnerBackend, 1>,
    offset: usize,
    keep: &'a dyn Fn(ParamId) -> bool,
    out: GradientsParams,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for UnflattenGrads<'_, AB> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let shape: [usize; D] = value.dims();
        let n: usize = shape.iter().product();
        if (self.keep)(param.id) {
            let g = self.flat.clone().narrow(0, self.offset, n).reshape(shape);
            self.out.register::<AB::InnerBackend, D>(param.id, g);
        }
        self.offset += n;
    }
}

/// The gradients in `flat` (laid out by [`flatten_grads`] for the same model), for the
/// parameters `keep` accepts.
pub fn unflatten_grads<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    flat: Tensor<AB::InnerBackend, 1>,
    keep: &dyn Fn(ParamId) -> bool,
) -> GradientsParams {
    let mut v = UnflattenGrads::<AB> {
        flat,
        offset: 0,
        keep,
        out: GradientsParams::new(),
    };
    model.visit(&mut v);
    v.out
}

/// The parameter ids that have a gradient in `grads`, for [`unflatten_grads`]'s `keep`.
pub fn grad_ids<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    grads: &GradientsParams,
) -> HashSet<ParamId> {
    struct Ids<'a, AB> {
        grads: &'a GradientsParams,
        out: HashSet<ParamId>,
        _b: std::marker::PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Ids<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if self.grads.get::<AB::InnerBackend, D>(param.id).is_some() {
                self.out.insert(param.id);
            }
        }
    }
    let mut v = Ids::<AB> {
        grads,
        out: HashSet::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut v);
    v.out
}

struct FlattenParams<B: Backend> {
    pieces: Vec<Tensor<B, 1>>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for FlattenParams<AB::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let value = param.val().inner();
        let n = value.shape().num_elements();
        self.pieces.push(value.reshape([n]));
    }
}

/// Every float parameter's values in one flat buffer, in the module's order (what a weight
/// broadcast sends). `None` for a model without float parameters.
pub fn flatten_params<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
) -> Option<Tensor<AB::InnerBackend, 1>> {
    let mut v = FlattenParams::<AB::InnerBackend> { pieces: Vec::new() };
    model.visit(&mut v);
    (!v.pieces.is_empty()).then(|| Tensor::cat(v.pieces, 0))
}

struct LoadFlat {
    values: Vec<f32>,
    offset: usize,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for LoadFlat {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape: [usize; D] = tensor.dims();
        let n: usize = shape.iter().product();
        let (dtype, device, trainable) =
            (tensor.dtype(), tensor.device(), tensor.is_require_grad());
        drop(tensor);
        // Each parameter its own copy: a view of the buffer would keep all of it alive for
        // as long as the parameter lives (an optimizer step may update a sole view in place).
        let data = TensorData::new(self.values[self.offset..self.offset + n].to_vec(), shape);
        self.offset += n;
        let value = Tensor::<AB::InnerBackend, D>::from_data(data, &device).cast(dtype);
        let value = Tensor::<AB, D>::from_inner(value);
        let value = if trainable {
            value.require_grad()
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Writes a buffer laid out by [`flatten_params`] (for a model of the same structure) into
/// `model`'s parameters; every parameter keeps its id and whether it requires gradients.
/// A buffer of the wrong length is an error naming both lengths.
pub fn load_flat_params<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: M,
    flat: Tensor<AB::InnerBackend, 1>,
) -> crate::Result<M> {
    let expected = model.num_params();
    let got = flat.dims()[0];
    if got != expected {
        return Err(crate::CoreError::config(
            "parameter buffer",
            format!("{got} values"),
            format!("{expected} values, one per parameter element of the model"),
        ));
    }
    let values = flat
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default();
    if values.len() != expected {
        return Err(crate::CoreError::config(
            "parameter buffer",
            format!("{} float32 values", values.len()),
            format!("{expected} values, one per parameter element of the model"),
        ));
    }
    Ok(model.map(&mut LoadFlat { values, offset: 0 }))
}

#[cfg(test)]
mod running_state_tests {
    use burn::backend::{Autodiff, Flex};
    use burn::nn::BatchNormConfig;
    use burn::tensor::Tensor;

    use super::*;

    #[test]
    fn a_digest_sees_the_latest_batch_norm_statistics() {
        type AB = Autodiff<Flex>;
        let device = Default::default();
        let norm = BatchNormConfig::new(1).init::<AB>(&device);
        let before = params_sha256::<AB, _>(&norm);
        // One training step: the running mean moves from 0 to 0.1 * 2.5.
        let x = Tensor::<AB, 4>::from_floats([[[[1.0, 2.0], [3.0, 4.0]]]], &device);
        let _ = norm.forward(x);
        let after = params_sha256::<AB, _>(&norm);
        assert_ne!(before, after, "the digest missed the pending update");
        let mean = norm
            .running_mean
            .value()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert!((mean[0] - 0.25).abs() < 1e-6, "{mean:?}");
    }
}
