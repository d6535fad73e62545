//! Model weights as safetensors (through burn-store, at the tensors' own dtype: never rounded
//! to f16), and the parameter ids that tie optimizer state to parameters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::store::{ModuleSnapshot, PathFilter, SafetensorsStore};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::CheckpointError;
use crate::format::write_atomic;

/// The model's weights encoded as safetensors bytes.
pub fn weights_to_bytes<B: Backend, M: Module<B>>(model: &M) -> Result<Vec<u8>, CheckpointError> {
    // The latest batch-norm statistics, not the ones of a batch before (see the function).
    flashover_core::params::sync_running_states::<B, M>(model);
    let mut store = SafetensorsStore::from_bytes(None);
    let format = |e: burn::store::SafetensorsStoreError| CheckpointError::Format {
        path: PathBuf::from("<model weights>"),
        message: e.to_string(),
    };
    model.save_into(&mut store).map_err(format)?;
    store.get_bytes().map_err(format)
}

/// Saves the model's weights to `path` as safetensors, atomically.
pub fn save_weights<B: Backend, M: Module<B>>(
    model: &M,
    path: &Path,
) -> Result<(), CheckpointError> {
    write_atomic(path, &weights_to_bytes(model)?)
}

/// How to load weights into a model.
#[derive(Debug, Clone, Default)]
pub struct WeightsLoad {
    /// Accept missing and unexpected tensors (they are reported, not loaded); otherwise every
    /// parameter must be in the file and the file must hold nothing else.
    pub non_strict: bool,
    /// Glob patterns (`*` matches any run of characters) of parameter paths to leave as the
    /// model has them, for example `fc2.*` to keep a freshly initialised head.
    pub ignore_keys: Vec<String>,
}

/// What a load did, for logs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightsReport {
    /// Parameters loaded from the file.
    pub loaded: usize,
    /// Parameters the file lacked (non-strict only).
    pub missing: Vec<String>,
    /// Tensors in the file the model lacks (non-strict only).
    pub unexpected: Vec<String>,
    /// Parameters left as they were because of `ignore_keys`.
    pub ignored: Vec<String>,
}

fn glob_to_regex(glob: &str) -> String {
    let mut re = String::from("^");
    for c in glob.chars() {
        match c {
            '*' => re.push_str(".*"),
            c if c.is_alphanumeric() || c == '_' => re.push(c),
            c => {
                re.push('\\');
                re.push(c);
            }
        }
    }
    re.push('$');
    re
}

/// Loads safetensors `bytes` (read from `path`, used in messages) into `model`.
pub fn load_weights_bytes<B: Backend, M: Module<B>>(
    mut model: M,
    bytes: Vec<u8>,
    path: &Path,
    options: &WeightsLoad,
) -> Result<(M, WeightsReport), CheckpointError> {
    // Parameters to keep are copied out first and put back after the load.
    let kept = if options.ignore_keys.is_empty() {
        Vec::new()
    } else {
        let mut filter = PathFilter::new();
        for g in &options.ignore_keys {
            filter = filter.with_regex(glob_to_regex(g));
        }
        model.collect(Some(filter), None, false)
    };
    let ignored: Vec<String> = kept.iter().map(|s| s.full_path()).collect();
    let mut store = SafetensorsStore::from_bytes(Some(bytes))
        .allow_partial(true)
        .validate(true);
    let result = model
        .load_from(&mut store)
        .map_err(|e| CheckpointError::Format {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let errors: Vec<String> = result.errors.iter().map(|e| format!("{e:?}")).collect();
    let missing: Vec<String> = result
        .missing
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| !ignored.contains(p))
        .collect();
    let unexpected = result.unused;
    if !errors.is_empty()
        || (!options.non_strict && (!missing.is_empty() || !unexpected.is_empty()))
    {
        return Err(CheckpointError::Mismatch {
            path: path.to_path_buf(),
            missing,
            unexpected,
            errors,
        });
    }
    if !kept.is_empty() {
        let back = model.apply(kept, None, None, false);
        if !back.errors.is_empty() {
            return Err(CheckpointError::Format {
                path: path.to_path_buf(),
                message: format!("restoring ignored keys failed: {:?}", back.errors),
            });
        }
    }
    let loaded = result
        .applied
        .iter()
        .filter(|p| !ignored.contains(p))
        .count();
    Ok((
        model,
        WeightsReport {
            loaded,
            missing,
            unexpected,
            ignored,
        },
    ))
}

/// Loads weights from a safetensors file into `model`, strictly.
pub fn load_weights<B: Backend, M: Module<B>>(model: M, path: &Path) -> Result<M, CheckpointError> {
    let bytes = std::fs::read(path).map_err(CheckpointError::io("read", path))?;
    Ok(load_weights_bytes(model, bytes, path, &WeightsLoad::default())?.0)
}

struct PathIds {
    path: Vec<String>,
    ids: BTreeMap<String, u64>,
}

impl<B: Backend> ModuleVisitor<B> for PathIds {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.ids.insert(self.path.join("."), param.id.val());
    }
}

/// Each float parameter's id, by path. Optimizer state is keyed by these ids, so a resumed
/// model must carry the saved ones (see [`set_param_ids`]).
pub fn param_ids<B: Backend, M: Module<B>>(model: &M) -> BTreeMap<String, u64> {
    let mut v = PathIds {
        path: Vec::new(),
        ids: BTreeMap::new(),
    };
    model.visit(&mut v);
    v.ids
}

struct SetIds<'a> {
    path: Vec<String>,
    ids: &'a BTreeMap<String, u64>,
    missing: Vec<String>,
}

impl<B: Backend> ModuleMapper<B> for SetIds<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.path.join(".");
        match self.ids.get(&path) {
            Some(&id) => {
                let (_, value, mapper) = param.consume();
                Param::from_mapped_value(ParamId::from(id), value, mapper)
            }
            None => {
                self.missing.push(path);
                param
            }
        }
    }
}

/// Gives each parameter the id saved for its path; returns the model and the paths that had
/// no saved id.
pub fn set_param_ids<B: Backend, M: Module<B>>(
    model: M,
    ids: &BTreeMap<String, u64>,
) -> (M, Vec<String>) {
    let mut m = SetIds {
        path: Vec::new(),
        ids,
        missing: Vec::new(),
    };
    let model = model.map(&mut m);
    (model, m.missing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};
    use flashover_core::params::{init_model, params_sha256};
    use std::fs;

    type B = Flex;

    #[derive(burn::module::Module, Debug)]
    struct Two<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    fn two(seed: u64, out: usize) -> Two<B> {
        init_model::<B, _>(&Default::default(), seed, |d| Two {
            a: LinearConfig::new(3, 4).init(d),
            b: LinearConfig::new(4, out).init(d),
        })
    }

    #[test]
    fn weights_round_trip_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let m = two(1, 2);
        save_weights(&m, &path).unwrap();
        let back = load_weights(two(2, 2), &path).unwrap();
        assert_eq!(params_sha256::<B, _>(&back), params_sha256::<B, _>(&m));
        assert_ne!(params_sha256::<B, _>(&two(2, 2)), params_sha256::<B, _>(&m));
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("model.safetensors")],
            "no temporary file is left"
        );
    }

    #[test]
    fn strict_load_reports_the_mismatch_and_non_strict_load_skips_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save_weights(&two(1, 2), &path).unwrap();
        let err = load_weights(two(1, 5), &path).unwrap_err().to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("b.weight"),
            "{err}"
        );
        fs::write(&path, b"not safetensors").unwrap();
        assert!(load_weights(two(1, 2), &path)
            .unwrap_err()
            .to_string()
            .contains("model.safetensors"));
        let err = load_weights(two(1, 2), &dir.path().join("absent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent"), "{err}");
    }

    #[test]
    fn ignored_keys_keep_the_models_own_values() {
        let src = two(1, 2);
        let bytes = weights_to_bytes(&src).unwrap();
        let fresh = two(2, 2);
        let opts = WeightsLoad {
            non_strict: false,
            ignore_keys: vec!["b.*".into()],
        };
        let (loaded, report) = load_weights_bytes(fresh, bytes, Path::new("m"), &opts).unwrap();
        assert_eq!(report.ignored.len(), 2, "{report:?}");
        assert_eq!(report.loaded, 2);
        let a_loaded = loaded.a.weight.val().into_data();
        assert_eq!(a_loaded, src.a.weight.val().into_data());
        assert_eq!(
            loaded.b.weight.val().into_data(),
            two(2, 2).b.weight.val().into_data()
        );
    }

    #[test]
    fn ids_move_by_path() {
        let a = two(1, 2);
        let ids = param_ids::<B, _>(&a);
        assert_eq!(
            ids.keys().cloned().collect::<Vec<_>>(),
            ["a.bias", "a.weight", "b.bias", "b.weight"]
        );
        let (b, missing) = set_param_ids::<B, _>(two(1, 2), &ids);
        assert!(missing.is_empty());
        assert_eq!(param_ids::<B, _>(&b), ids);
        assert_eq!(glob_to_regex("fc2.*"), "^fc2\\..*$");
    }
}
