//! Whole-model parameter plumbing shared by the weight-space algorithms (EMA, SWA, SAM,
//! gradient clipping, layer freezing): flat copies of every float parameter keyed by
//! `ParamId`, writing such a copy back into a model without changing any id (so optimizer
//! state stays attached), walking gradients with their parameters, and freezing parameters.
//!
//! Nothing here knows the trainer or the events.

use std::collections::HashMap;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use serde_json::{json, Value};

use crate::error::{AlgorithmError, Result};

/// One parameter in a [`ParamSet`].
#[derive(Debug, Clone)]
pub struct ParamEntry<B: Backend> {
    /// The parameter's id in the model.
    pub id: ParamId,
    /// Its path, dot-separated (`conv1.weight`).
    pub path: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values, flattened.
    pub value: Tensor<B, 1>,
}

/// A flat copy of every float parameter of a model, in the model's visiting order.
#[derive(Debug, Clone)]
pub struct ParamSet<B: Backend> {
    /// The parameters.
    pub entries: Vec<ParamEntry<B>>,
}

fn join(path: &[String]) -> String {
    path.join(".")
}

struct Collect<B: Backend> {
    path: Vec<String>,
    entries: Vec<ParamEntry<B>>,
}

impl<B: Backend> ModuleVisitor<B> for Collect<B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val();
        let shape = value.dims().to_vec();
        let n: usize = shape.iter().product();
        self.entries.push(ParamEntry {
            id: param.id,
            path: join(&self.path),
            shape,
            value: value.reshape([n]),
        });
    }
}

impl<B: Backend> ParamSet<B> {
    /// Copies every float parameter of `module` (tensors are shared, not duplicated, until
    /// one side changes).
    pub fn of<M: Module<B>>(module: &M) -> Self {
        let mut c = Collect {
            path: Vec::new(),
            entries: Vec::new(),
        };
        module.visit(&mut c);
        ParamSet { entries: c.entries }
    }

    /// The gradient-free copy of an autodiff model's parameters.
    pub fn of_autodiff<AB, M>(model: &M) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: burn::module::AutodiffModule<AB>,
    {
        ParamSet::of(&model.valid())
    }

    /// Sets every entry to `f(entry, other's entry with the same id)`; `other` must hold the
    /// same parameters (same ids and shapes).
    pub fn zip_update(
        &mut self,
        other: &ParamSet<B>,
        algorithm: &'static str,
        mut f: impl FnMut(Tensor<B, 1>, Tensor<B, 1>) -> Tensor<B, 1>,
    ) -> Result<()> {
        let index: HashMap<ParamId, usize> = other
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.id, i))
            .collect();
        if index.len() != self.entries.len() {
            return Err(AlgorithmError::BadState {
                algorithm,
                reason: format!(
                    "the model has {} parameters, the averaged copy {}",
                    index.len(),
                    self.entries.len()
                ),
            });
        }
        for e in self.entries.iter_mut() {
            let o = index
                .get(&e.id)
                .map(|&i| &other.entries[i])
                .filter(|o| o.shape == e.shape)
                .ok_or_else(|| AlgorithmError::BadState {
                    algorithm,
                    reason: format!("parameter {} ({}) is not in the model", e.path, e.id),
                })?;
            e.value = f(e.value.clone(), o.value.clone());
        }
        Ok(())
    }

    /// Writes these values into an autodiff model's parameters with the same ids; every
    /// parameter keeps its id and whether it requires gradients.
    pub fn load_into<AB, M>(&self, model: M, algorithm: &'static str) -> Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        self.load(model, algorithm, true)
    }

    /// Like [`ParamSet::load_into`], but parameters this set does not hold keep their values
    /// (SAM perturbs only the parameters that have gradients).
    pub fn load_some_into<AB, M>(&self, model: M, algorithm: &'static str) -> Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        self.load(model, algorithm, false)
    }

    fn load<AB, M>(&self, model: M, algorithm: &'static str, all: bool) -> Result<M>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        let mut mapper = Load {
            values: self.entries.iter().map(|e| (e.id, e)).collect(),
            missing: None,
        };
        let model = model.map(&mut mapper);
        match mapper.missing.filter(|_| all) {
            None => Ok(model),
            Some(id) => Err(AlgorithmError::BadState {
                algorithm,
                reason: format!("the model's parameter {id} has no saved value"),
            }),
        }
    }

    /// The values as JSON: per parameter its id, path, shape and the little-endian bytes of
    /// its `f32` elements in base64. Exact: restoring gives bit-identical values.
    pub fn to_json(&self) -> Value {
        Value::Array(
            self.entries
                .iter()
                .map(|e| {
                    let data = e.value.clone().into_data().convert::<f32>();
                    json!({
                        "id": e.id.val().to_string(),
                        "path": e.path,
                        "shape": e.shape,
                        "f32_le": STANDARD.encode(data.as_bytes()),
                    })
                })
                .collect(),
        )
    }

    /// Reads what [`ParamSet::to_json`] wrote, onto `device`.
    pub fn from_json(value: &Value, device: &B::Device, algorithm: &'static str) -> Result<Self> {
        let bad = |reason: String| AlgorithmError::BadState { algorithm, reason };
        let items = value
            .as_array()
            .ok_or_else(|| bad("expected a list of parameters".into()))?;
        let mut entries = Vec::with_capacity(items.len());
        for item in items {
            let id = item["id"]
                .as_str()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| bad(format!("parameter without a numeric id: {item}")))?;
            let path = item["path"].as_str().unwrap_or_default().to_string();
            let shape: Vec<usize> = item["shape"]
                .as_array()
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
                .ok_or_else(|| bad(format!("parameter {path} has no shape")))?;
            let bytes = item["f32_le"]
                .as_str()
                .and_then(|s| STANDARD.decode(s).ok())
                .ok_or_else(|| bad(format!("parameter {path} has no base64 values")))?;
            let n: usize = shape.iter().product();
            if bytes.len() != n * 4 {
                return Err(bad(format!(
                    "parameter {path}: {} bytes for shape {shape:?} (expected {})",
                    bytes.len(),
                    n * 4
                )));
            }
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            entries.push(ParamEntry {
                id: ParamId::from(id),
                path,
                shape,
                value: Tensor::from_data(TensorData::new(values, [n]), device),
            });
        }
        Ok(ParamSet { entries })
    }
}

struct Load<'a, B: Backend> {
    values: HashMap<ParamId, &'a ParamEntry<B>>,
    missing: Option<ParamId>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Load<'_, AB::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(entry) = self.values.get(&id) else {
            self.missing.get_or_insert(id);
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let shape: [usize; D] = tensor.dims();
        let value = Tensor::<AB, D>::from_inner(entry.value.clone().reshape(shape));
        let value = if tensor.is_require_grad() {
            value.require_grad()
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// A parameter with its gradient, both flattened, as [`grads_of`] hands them out.
pub struct GradView<B: Backend> {
    /// The parameter's id.
    pub id: ParamId,
    /// Its path, dot-separated.
    pub path: String,
    /// The type name of the module that owns it (`Linear`, `Conv2d`, or the user's own),
    /// as Burn's module visitor reports it; empty for a parameter at the root.
    pub owner: String,
    /// Its shape (the gradient has the same).
    pub shape: Vec<usize>,
    /// The parameter's values, flattened.
    pub param: Tensor<B, 1>,
    /// The gradient, flattened.
    pub grad: Tensor<B, 1>,
}

struct Grads<'a, AB: AutodiffBackend> {
    path: Vec<String>,
    owners: Vec<String>,
    grads: &'a GradientsParams,
    out: Vec<GradView<AB::InnerBackend>>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for Grads<'_, AB> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push(name.to_string());
        // Burn names the struct (or enum) whose field is entered: "Struct:Linear".
        let owner = container_type
            .split_once(':')
            .map_or(container_type, |(_, t)| t);
        self.owners.push(owner.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
        self.owners.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        if let Some(g) = self.grads.get::<AB::InnerBackend, D>(param.id) {
            let shape = g.dims().to_vec();
            let n: usize = shape.iter().product();
            self.out.push(GradView {
                id: param.id,
                path: join(&self.path),
                owner: self.owners.last().cloned().unwrap_or_default(),
                shape,
                param: param.val().inner().reshape([n]),
                grad: g.reshape([n]),
            });
        }
    }
}

/// Every parameter of `model` that has a gradient in `grads`, in the model's order.
pub fn grads_of<AB: AutodiffBackend, M: Module<AB>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<GradView<AB::InnerBackend>> {
    let mut v = Grads {
        path: Vec::new(),
        owners: Vec::new(),
        grads,
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}

/// Replaces the gradient of `view.id` in `grads` by `grad` (flattened, reshaped back to the
/// parameter's shape).
pub fn set_grad<B: Backend>(grads: &mut GradientsParams, view: &GradView<B>, grad: Tensor<B, 1>) {
    macro_rules! put {
        ($($d:literal),*) => {
            match view.shape.len() {
                $($d => {
                    // Invariant: this arm matched the shape's length, so the array fits.
                    let shape: [usize; $d] = view.shape.clone().try_into().expect("length checked by the match");
                    grads.register::<B, $d>(view.id, grad.reshape(shape));
                })*
                // Burn's built-in layers have parameters of rank 1 to 5; higher ranks are
                // registered flat, which optimizers would reject, so keep them out of reach
                // by matching every rank Burn's modules use.
                _ => grads.register::<B, 1>(view.id, grad),
            }
        };
    }
    put!(1, 2, 3, 4, 5, 6);
}

pub use flashover_core::params::layer_of;

/// The layers of a model that own float parameters, in the model's order.
pub fn layers<B: Backend, M: Module<B>>(model: &M) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in ParamSet::of(model).entries {
        let layer = layer_of(&e.path).to_string();
        if out.last() != Some(&layer) && !out.contains(&layer) {
            out.push(layer);
        }
    }
    out
}

struct Freeze<'a> {
    path: Vec<String>,
    frozen: &'a [String],
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Freeze<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let path = join(&self.path);
        let frozen = self.frozen.iter().any(|l| l == layer_of(&path));
        let (id, tensor, mapper) = param.consume();
        // A frozen parameter that still requires gradients, or a trainable one that does not.
        let tensor = if frozen == tensor.is_require_grad() {
            // Detach from (or re-attach to) the graph; the values are unchanged.
            Tensor::<AB, D>::from_inner(tensor.inner()).set_require_grad(!frozen)
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Makes the parameters of the layers in `frozen` constants (no gradient is computed for
/// them, so backward skips their work) and every other parameter trainable again.
pub fn freeze_layers<AB: AutodiffBackend, M: Module<AB>>(model: M, frozen: &[String]) -> M {
    model.map(&mut Freeze {
        path: Vec::new(),
        frozen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::nn::{Linear, LinearConfig};

    type AB = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    fn model() -> Two<AB> {
        let d = Default::default();
        flashover_core::params::init_model::<AB, _>(&d, 3, |d| Two {
            a: LinearConfig::new(3, 2).init(d),
            b: LinearConfig::new(2, 1).init(d),
        })
    }

    #[test]
    fn json_round_trip_is_bit_exact_and_loading_keeps_ids() {
        let m = model();
        let set = ParamSet::of_autodiff(&m);
        assert_eq!(set.entries.len(), 4);
        assert_eq!(layers(&m), vec!["a".to_string(), "b".to_string()]);
        let back = ParamSet::<Flex>::from_json(&set.to_json(), &Default::default(), "t").unwrap();
        for (x, y) in set.entries.iter().zip(&back.entries) {
            assert_eq!(x.id, y.id);
            assert_eq!(
                x.value.clone().into_data().as_bytes(),
                y.value.clone().into_data().as_bytes()
            );
        }
        // Load doubled values: ids stay, values change, gradients still flow.
        let mut doubled = back.clone();
        doubled.zip_update(&back, "t", |a, _| a * 2.0).unwrap();
        let m2 = doubled.load_into(m.clone(), "t").unwrap();
        let s2 = ParamSet::of_autodiff(&m2);
        for (x, y) in set.entries.iter().zip(&s2.entries) {
            assert_eq!(x.id, y.id);
            let a = x.value.clone().into_data().to_vec::<f32>().unwrap();
            let b = y.value.clone().into_data().to_vec::<f32>().unwrap();
            assert!(a.iter().zip(&b).all(|(a, b)| (2.0 * a - b).abs() < 1e-7));
        }
        assert!(m2.a.weight.val().is_require_grad());
    }

    #[test]
    fn freezing_stops_gradients_of_the_named_layers_only() {
        let m = freeze_layers(model(), &["a".to_string()]);
        let x = Tensor::<AB, 2>::ones([4, 3], &Default::default());
        let loss = m.b.forward(m.a.forward(x)).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        let with: Vec<String> = grads_of(&m, &grads).into_iter().map(|g| g.path).collect();
        assert_eq!(with, vec!["b.weight".to_string(), "b.bias".to_string()]);
        // Unfreezing brings them back.
        let m = freeze_layers(m, &[]);
        let x = Tensor::<AB, 2>::ones([4, 3], &Default::default());
        let loss = m.b.forward(m.a.forward(x)).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        assert_eq!(grads_of(&m, &grads).len(), 4);
    }
}
