//! Gradient and parameter norms, global and per layer.

use std::collections::{BTreeMap, HashMap};

use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor};
use flashover_core::callback::{Callback, Control};
use flashover_core::collective::{Peers, Ranks};
use flashover_core::error::{CoreError, Result};
use flashover_core::params::layer_of;
use flashover_core::precision::cast_to;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::Time;

use super::{batch_interval, due};

/// What [`ParamStats`] computes per tensor.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stat {
    /// The sum of squares (one value).
    SumOfSquares,
    /// How many elements are NaN, and how many infinite (two values).
    NonFinite,
}

impl Stat {
    fn width(self) -> usize {
        match self {
            Stat::SumOfSquares => 1,
            Stat::NonFinite => 2,
        }
    }
}

/// A statistic of every float parameter (or of its gradient), with the parameter's path, all
/// read back to the host in one transfer.
pub(crate) struct ParamStats<'a, AB: AutodiffBackend> {
    path: Vec<String>,
    grads: Option<&'a GradientsParams>,
    stat: Stat,
    names: Vec<String>,
    values: Vec<Tensor<AB::InnerBackend, 1>>,
}

impl<'a, AB: AutodiffBackend> ParamStats<'a, AB> {
    /// `stat` of each gradient in `grads` (parameters without a gradient are left out), or of
    /// each parameter when `grads` is `None`.
    pub(crate) fn of<M: burn::module::Module<AB>>(
        model: &M,
        grads: Option<&'a GradientsParams>,
        stat: Stat,
    ) -> Vec<(String, Vec<f64>)> {
        let mut v = ParamStats {
            path: Vec::new(),
            grads,
            stat,
            names: Vec::new(),
            values: Vec::new(),
        };
        model.visit(&mut v);
        if v.values.is_empty() {
            return Vec::new();
        }
        let all: Vec<f64> = Tensor::cat(v.values, 0).into_data().iter::<f64>().collect();
        v.names
            .into_iter()
            .zip(all.chunks(stat.width()).map(<[f64]>::to_vec))
            .collect()
    }

    /// Sums of squares, one per parameter.
    pub(crate) fn sums<M: burn::module::Module<AB>>(
        model: &M,
        grads: Option<&'a GradientsParams>,
    ) -> Vec<(String, f64)> {
        Self::of(model, grads, Stat::SumOfSquares)
            .into_iter()
            .map(|(n, v)| (n, v[0]))
            .collect()
    }

    fn push<const D: usize>(&mut self, t: Tensor<AB::InnerBackend, D>) {
        let mut name = self.path.join(".");
        if name.is_empty() {
            name = format!("param{}", self.names.len());
        }
        self.names.push(name);
        // Reduced along one flattened axis: a fixed reduction order on every backend; in
        // float32 whatever the run's precision (half weights and gradients would overflow a
        // sum of squares, and the statistics of all parameters are concatenated, which needs
        // one type).
        let flat = cast_to(t.flatten::<1>(0, D - 1), FloatDType::F32);
        let value = match self.stat {
            Stat::SumOfSquares => blocked_sum(flat.clone().mul(flat)),
            Stat::NonFinite => Tensor::cat(
                vec![
                    flat.clone().is_nan().int().sum().float(),
                    flat.is_inf().int().sum().float(),
                ],
                0,
            ),
        };
        self.values.push(value);
    }
}

/// The sum of a vector in two stages, over blocks of 1024 and then over the blocks' sums:
/// in 32-bit floats a straight sum of a 200k-element layer drifts by about 3e-5 (relative),
/// the blocked one by about 1e-6.
fn blocked_sum<B: burn::tensor::backend::Backend>(v: Tensor<B, 1>) -> Tensor<B, 1> {
    const BLOCK: usize = 1024;
    let n = v.dims()[0];
    if n <= BLOCK {
        return v.sum_dim(0);
    }
    let blocks = n.div_ceil(BLOCK);
    let v = if blocks * BLOCK > n {
        let pad = Tensor::zeros([blocks * BLOCK - n], &v.device());
        Tensor::cat(vec![v, pad], 0)
    } else {
        v
    };
    v.reshape([blocks, BLOCK])
        .sum_dim(1)
        .reshape([blocks])
        .sum_dim(0)
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for ParamStats<'_, AB> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        match self.grads {
            Some(grads) => {
                if let Some(g) = grads.get::<AB::InnerBackend, D>(param.id) {
                    self.push(g);
                }
            }
            None => self.push(param.val().inner()),
        }
    }
}

/// Global and per-layer L2 norms from per-parameter sums of squares: `(global, [(layer,
/// norm)])`, layers in the model's order.
pub fn norms_by_layer(sums: &[(String, f64)]) -> (f64, Vec<(String, f64)>) {
    let mut order: Vec<String> = Vec::new();
    let mut by_layer: BTreeMap<String, f64> = BTreeMap::new();
    for (path, s) in sums {
        let layer = layer_of(path).to_string();
        if !by_layer.contains_key(&layer) {
            order.push(layer.clone());
        }
        *by_layer.entry(layer).or_insert(0.0) += s;
    }
    let global = sums.iter().map(|(_, s)| s).sum::<f64>().sqrt();
    let layers = order
        .into_iter()
        .map(|l| {
            let n = by_layer[&l].sqrt();
            (l, n)
        })
        .collect();
    (global, layers)
}

/// Logs L2 norms every `interval`: of the gradients the optimizer step used (after any
/// clipping), `l2_norm/grad/global` and `l2_norm/grad/<layer>`, and of the weights after the
/// step, `l2_norm/param/global` and `l2_norm/param/<layer>`. A layer is a parameter's path
/// without its last part (`conv1.weight` and `conv1.bias` make `conv1`).
///
/// Each logged batch costs one pass over the parameters and one read back to the host;
/// batches in between cost nothing.
///
/// ```
/// use flashover_callbacks::monitors::NormMonitor;
/// use flashover_core::time::Time;
/// let norms = NormMonitor::new(Time::Batch(50))?.per_layer(true);
/// # let _ = norms;
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct NormMonitor {
    every: Time,
    per_layer: bool,
    grads: Option<Vec<(String, f64)>>,
}

impl NormMonitor {
    /// Norms every `every` (batches or epochs, greater than zero), global and per layer.
    pub fn new(every: Time) -> crate::error::Result<Self> {
        Ok(NormMonitor {
            every: batch_interval("norm_monitor", every)?,
            per_layer: true,
            grads: None,
        })
    }

    /// Whether to log each layer's norms as well as the global ones (default true).
    pub fn per_layer(mut self, per_layer: bool) -> Self {
        self.per_layer = per_layer;
        self
    }

    fn due_next<S: Setup>(&self, state: &State<S>) -> bool {
        // At AFTER_TRAIN_BATCH the batch has not been counted yet.
        let ts = state.timestamp();
        due(
            self.every,
            ts.batch + 1,
            ts.epoch,
            ts.batch_in_epoch + 1,
            state.batches_per_epoch(),
        )
    }
}

fn push_norms(out: &mut Vec<(String, f64)>, kind: &str, sums: &[(String, f64)], per_layer: bool) {
    let (global, layers) = norms_by_layer(sums);
    out.push((format!("l2_norm/{kind}/global"), global));
    if per_layer {
        for (layer, n) in layers {
            out.push((format!("l2_norm/{kind}/{layer}"), n));
        }
    }
}

/// Every rank's gradient sums of squares (each over the parameters it owns), in the model's
/// parameter order, on every rank: sent as text, whose numbers read back exactly.
fn every_shard<S: Setup>(
    state: &State<S>,
    mine: Vec<(String, f64)>,
    peers: &mut dyn Peers,
) -> Result<Vec<(String, f64)>> {
    let text = serde_json::to_string(&mine).map_err(|e| CoreError::Component {
        component: "norm_monitor".into(),
        event: "after_train_batch",
        message: e.to_string(),
    })?;
    let mut all: HashMap<String, f64> = HashMap::new();
    for (rank, t) in peers.gather_text(&text)?.iter().enumerate() {
        let part: Vec<(String, f64)> =
            serde_json::from_str(t).map_err(|e| CoreError::Component {
                component: "norm_monitor".into(),
                event: "after_train_batch",
                message: format!("rank {rank}'s gradient norms did not arrive whole: {e}"),
            })?;
        all.extend(part);
    }
    Ok(ParamStats::<S::Backend>::sums(state.model(), None)
        .into_iter()
        .filter_map(|(name, _)| all.remove(&name).map(|v| (name, v)))
        .collect())
}

impl<S: Setup> Callback<S> for NormMonitor {
    fn name(&self) -> &str {
        "norm_monitor"
    }

    /// Rank 0 logs; in a sharded run every rank takes part, since each holds the gradients
    /// of its own parameters only.
    fn ranks(&self) -> Ranks {
        Ranks::Shards
    }

    fn after_train_batch(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        self.grads = None;
        if self.due_next(state) {
            if let Some(grads) = state.grads() {
                let mine = ParamStats::<S::Backend>::sums(state.model(), Some(grads));
                self.grads = Some(match (state.is_sharded(), ctl.peers()) {
                    (true, Some(peers)) => every_shard(state, mine, peers)?,
                    _ => mine,
                });
            }
        }
        Ok(())
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        if !state.world().is_main() {
            return Ok(());
        }
        let ts = state.timestamp();
        if !due(
            self.every,
            ts.batch,
            ts.epoch,
            ts.batch_in_epoch,
            state.batches_per_epoch(),
        ) {
            return Ok(());
        }
        let mut values: Vec<(String, f64)> = Vec::new();
        if let Some(g) = self.grads.take() {
            push_norms(&mut values, "grad", &g, self.per_layer);
        }
        let params = ParamStats::<S::Backend>::sums(state.model(), None);
        push_norms(&mut values, "param", &params, self.per_layer);
        let refs: Vec<(&str, f64)> = values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        ctl.logger().log_metrics(state.timestamp(), &refs)
    }
}
