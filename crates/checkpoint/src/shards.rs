//! Optimizer state across shards: a sharded run's checkpoint holds one optimizer file per
//! rank (each with the state of the parameters that rank owned), and a run resumed at any
//! world size, sharded or not, needs the state of the parameters it owns now. Burn's
//! optimizers (`OptimizerAdaptor`) record their state as a map from parameter id to that
//! parameter's state, which the record file (named MessagePack: `{metadata, item}`) keeps
//! as a map keyed by the id's text. So the files merge as maps: the union of every file's
//! entries, each id in one file only, filtered to the ids this rank owns; the result is a
//! record file again, which Burn decodes into the optimizer's own record type.
//!
//! Written here rather than through the optimizer's record type because that type is the
//! user's optimizer's, opaque to a generic loader; `rmpv` reads and writes the format's
//! values without knowing their types, so the tensors inside pass through untouched.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rmpv::Value;

use crate::error::CheckpointError;

/// One optimizer file's bytes and where they came from.
pub(crate) struct Part {
    /// The file (named in errors).
    pub path: PathBuf,
    /// Its bytes, verified against the manifest.
    pub bytes: Vec<u8>,
}

/// The optimizer record made of every part's entries, keeping only the parameter ids in
/// `keep` (all of them when `None`). A part that is not a record keyed by parameter, or an
/// id found in two parts, is an error naming the file.
pub(crate) fn merge(
    parts: Vec<Part>,
    keep: Option<&HashSet<String>>,
) -> Result<Vec<u8>, CheckpointError> {
    let mut base: Option<Value> = None;
    let mut entries: Vec<(Value, Value)> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for part in parts {
        let mut value = rmpv::decode::read_value(&mut part.bytes.as_slice())
            .map_err(|e| CheckpointError::damaged(&part.path, format!("not a record file: {e}")))?;
        let item = item_of(&mut value, &part.path)?;
        for (key, state) in std::mem::take(item) {
            let Some(id) = key.as_str().map(str::to_string) else {
                return Err(not_keyed(&part.path));
            };
            if !seen.insert(id.clone()) {
                return Err(CheckpointError::damaged(
                    &part.path,
                    format!("the state of parameter {id} is also in another shard"),
                ));
            }
            if keep.is_none_or(|k| k.contains(&id)) {
                entries.push((key, state));
            }
        }
        base.get_or_insert(value);
    }
    let Some(mut record) = base else {
        return Err(CheckpointError::damaged(
            Path::new("optimizer"),
            "no optimizer file to read",
        ));
    };
    // Invariant: `item_of` succeeded on this value above.
    *item_of(&mut record, Path::new("optimizer"))? = entries;
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &record).map_err(|e| CheckpointError::Format {
        path: PathBuf::from("optimizer"),
        message: e.to_string(),
    })?;
    Ok(out)
}

/// The entries of a record file's `item` map.
fn item_of<'v>(
    value: &'v mut Value,
    path: &Path,
) -> Result<&'v mut Vec<(Value, Value)>, CheckpointError> {
    let Value::Map(fields) = value else {
        return Err(not_keyed(path));
    };
    match fields.iter_mut().find(|(k, _)| k.as_str() == Some("item")) {
        Some((_, Value::Map(entries))) => Ok(entries),
        _ => Err(not_keyed(path)),
    }
}

fn not_keyed(path: &Path) -> CheckpointError {
    CheckpointError::damaged(
        path,
        "not an optimizer record keyed by parameter id (sharded checkpoints need an optimizer whose state is per parameter, as Burn's OptimizerAdaptor keeps it)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::{Module, Param};
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    use burn::tensor::Tensor;

    type AB = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Two<B: burn::tensor::backend::Backend> {
        a: Param<Tensor<B, 1>>,
        b: Param<Tensor<B, 1>>,
    }

    fn record<O: Optimizer<Two<AB>, AB>>(o: &O) -> Vec<u8> {
        let r = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        Recorder::<AB>::record(&r, o.to_record(), ()).unwrap()
    }

    #[test]
    fn shards_of_an_adam_state_merge_into_the_whole_and_split_by_owner() {
        let dev = Default::default();
        let model = Two::<AB> {
            a: Param::from_tensor(Tensor::from_floats([1.0, 2.0], &dev).require_grad()),
            b: Param::from_tensor(Tensor::from_floats([3.0], &dev).require_grad()),
        };
        let (ida, idb) = (model.a.id, model.b.id);
        let loss = model.a.val().powi_scalar(2).sum() + model.b.val().mul_scalar(3.0).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let ga = grads.get::<Flex, 1>(ida).unwrap();
        let gb = grads.get::<Flex, 1>(idb).unwrap();
        let only = |id, g| {
            let mut p = GradientsParams::new();
            p.register::<Flex, 1>(id, g);
            p
        };
        // The whole optimizer, and two that each stepped one parameter (two ranks' shards).
        let mut whole = AdamConfig::new().init::<AB, Two<AB>>();
        let mut one = AdamConfig::new().init::<AB, Two<AB>>();
        let mut two = AdamConfig::new().init::<AB, Two<AB>>();
        let stepped = whole.step(1e-2, model.clone(), grads);
        let _ = one.step(1e-2, model.clone(), only(ida, ga));
        let _ = two.step(1e-2, model.clone(), only(idb, gb));
        let part = |o: &dyn Fn() -> Vec<u8>, n: &str| Part {
            path: PathBuf::from(n),
            bytes: o(),
        };
        let parts = || {
            vec![
                part(&|| record(&one), "rank0"),
                part(&|| record(&two), "rank1"),
            ]
        };
        let merged = merge(parts(), None).unwrap();
        let r = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let load = |bytes: Vec<u8>| {
            let rec = Recorder::<AB>::load(&r, bytes, &dev).unwrap();
            AdamConfig::new().init::<AB, Two<AB>>().load_record(rec)
        };
        // The merged state steps exactly as the whole one does.
        let mut from_merged = load(merged);
        let next = |o: &mut dyn FnMut(Two<AB>, GradientsParams) -> Two<AB>| {
            let m = stepped.clone();
            let loss = m.a.val().powi_scalar(2).sum() + m.b.val().mul_scalar(3.0).sum();
            let g = GradientsParams::from_grads(loss.backward(), &m);
            let out = o(m, g);
            (out.a.val().into_data(), out.b.val().into_data())
        };
        let want = next(&mut |m, g| whole.step(1e-2, m, g));
        let got = next(&mut |m, g| from_merged.step(1e-2, m, g));
        assert_eq!(want, got);
        // Kept to one parameter: the other has no state.
        let keep: HashSet<String> = [idb.serialize()].into_iter().collect();
        let just_b = load(merge(parts(), Some(&keep)).unwrap());
        assert_eq!(just_b.to_record().len(), 1);
        assert!(just_b.to_record().contains_key(&idb));
        // The same parameter in two files is damage, named.
        let twice = vec![
            part(&|| record(&one), "rank0"),
            part(&|| record(&one), "rank1"),
        ];
        let e = merge(twice, None).unwrap_err().to_string();
        assert!(e.contains("rank1") && e.contains("another shard"), "{e}");
        let e = merge(
            vec![Part {
                path: "junk".into(),
                bytes: b"\x01\x02".to_vec(),
            }],
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("junk"), "{e}");
    }
}
