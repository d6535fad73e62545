//! Sharded optimizer state and gradients: ZeRO stages 1 and 2 (Rajbhandari et al., 2020), or
//! in Composer's FSDP terms the `SHARD_GRAD_OP` strategy, on the collective a data-parallel
//! run already has.
//!
//! Every float parameter (in the module's order) has one owning rank: the parameters are cut
//! into `world size` contiguous runs of nearly equal element counts ([`ShardPlan`]). At each
//! optimizer step:
//! 1. every rank brings the same flat buffer of its batch's gradients that a data-parallel
//!    step all-reduces, and the collective reduce-scatters it
//!    ([`Collective::reduce_scatter_sum`]): each rank gets back only the summed elements of
//!    the parameters it owns, summed in the same order as the all-reduce would have (the
//!    MPI transport runs the ring's own reduce-scatter, then hands each element to its
//!    owner), so the averaged gradients a rank keeps are bit for bit the data-parallel ones;
//! 2. `AFTER_TRAIN_BATCH` sees only the owned gradients ([`State::grads`](crate::state::State::grads));
//!    an algorithm that needs a reduction over every parameter asks the state
//!    ([`State::gather_over_shards`](crate::state::State::gather_over_shards), gradient
//!    clipping's norm) or the whole gradient
//!    ([`State::with_whole_gradients`](crate::state::State::with_whole_gradients), SAM's ascent step);
//! 3. the optimizer steps with the owned gradients only: Burn's `OptimizerAdaptor` updates
//!    exactly the parameters present in the `GradientsParams` and keeps state only for them,
//!    so a rank's optimizer state is its share;
//! 4. the updated parameters are gathered, each bucket of a rank's parameters sent from its
//!    owner ([`Collective::broadcast_from`]) and written straight into the other ranks'
//!    models: copies, no arithmetic, so every rank holds every parameter with the owner's
//!    bits.
//!
//! Memory: the exchange never holds a whole second copy of anything. The gradient buffer is
//! built on the host one gradient at a time, each freed as it is copied in; the MPI ring
//! sends it in segments and hands back this rank's share in the buffer's own allocation; the
//! gather holds one bucket ([`GATHER_BUCKET`]) at a time. So at world size `W` a rank holds
//! the weights, one gradient and `1/W` of the optimizer state, against a single process's
//! weights, gradient and whole optimizer state (for Adam, 3 copies against 4 at `W = 2`).
//!
//! Parameters themselves stay whole on every rank (stage 3, Composer's `FULL_SHARD`, is
//! discussed in `docs/DESIGN.md`). A world of one shards nothing.
//!
//! The plan counts every float parameter, trainable or not, so that it does not change when
//! layer freezing stops a parameter's gradients; the gradient buffer holds the trainable
//! ones, as a data-parallel step's does, and [`Layout`] maps one onto the other at each step.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use crate::collective::{nothing_trains, Agreed, Collective, GlobalStep, LocalStep, Outgoing};
use crate::error::{CoreError, Result};
use crate::setup::Setup;
use crate::world::World;

/// How a data-parallel run splits its optimizer step over the ranks (Composer's
/// `sharding_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sharding {
    /// Every rank holds the whole gradient and the whole optimizer state (plain data
    /// parallelism; Composer's `NO_SHARD`).
    #[default]
    NoShard,
    /// Gradients are reduce-scattered and each rank keeps and steps only the parameters it
    /// owns: optimizer state and averaged gradients divided over the ranks (ZeRO stages 1
    /// and 2; Composer's `SHARD_GRAD_OP`).
    ShardGradOp,
}

impl Sharding {
    /// The values `parse` accepts, as a flag's help says them.
    pub const ACCEPTED: &'static str = "no_shard or shard_grad_op";

    /// The name as written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::NoShard => "no_shard",
            Sharding::ShardGradOp => "shard_grad_op",
        }
    }

    /// Parses `no_shard` or `shard_grad_op` (any case, `-` for `_`); `full_shard` is refused
    /// with the reason.
    pub fn parse(s: &str) -> Result<Self> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        match norm.as_str() {
            "no_shard" => Ok(Sharding::NoShard),
            "shard_grad_op" => Ok(Sharding::ShardGradOp),
            "full_shard" | "hybrid_shard" => Err(CoreError::config(
                "sharding",
                s,
                format!(
                    "{}: parameter sharding ({norm}) is not available (Burn 0.21's autodiff keeps every parameter a graph uses until the backward pass ends; see docs/DESIGN.md, \"Sharding\")",
                    Self::ACCEPTED
                ),
            )),
            _ => Err(CoreError::config("sharding", s, Self::ACCEPTED)),
        }
    }

    /// Whether this strategy shards anything in a world of `size` ranks.
    pub fn shards(self, size: usize) -> bool {
        self == Sharding::ShardGradOp && size > 1
    }
}

impl FromStr for Sharding {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        Sharding::parse(s)
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which rank owns each float parameter of a model: contiguous runs in the module's order,
/// of nearly equal element counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    world: World,
    /// The owning rank of each float parameter, in module order (never decreasing).
    owner: Vec<usize>,
}

impl ShardPlan {
    /// The plan for parameters of `sizes` elements (module order) over `world`: parameter
    /// `i`, whose elements span `[start, start + n)` of the `total`, goes to the rank whose
    /// equal share holds its middle element, `floor((2 start + n) W / 2 total)`. Owners never
    /// decrease, so each rank's parameters are one contiguous run; a rank may own nothing
    /// when one parameter is larger than a share.
    pub fn new(sizes: &[usize], world: World) -> Self {
        let w = world.size.max(1) as u128;
        let total: u128 = sizes.iter().map(|&n| n as u128).sum::<u128>().max(1);
        let mut start = 0u128;
        let owner = sizes
            .iter()
            .map(|&n| {
                let n = n as u128;
                let mid2 = 2 * start + n;
                start += n;
                ((mid2 * w) / (2 * total)).min(w - 1) as usize
            })
            .collect();
        ShardPlan { world, owner }
    }

    /// The plan for `model`'s float parameters.
    pub fn for_model<AB: AutodiffBackend, M: AutodiffModule<AB>>(model: &M, world: World) -> Self {
        let sizes: Vec<usize> = slots::<AB, M>(model).iter().map(|s| s.len).collect();
        ShardPlan::new(&sizes, world)
    }

    /// The world the plan divides over.
    pub fn world(&self) -> World {
        self.world
    }

    /// The owning rank of each float parameter, in module order.
    pub fn owners(&self) -> &[usize] {
        &self.owner
    }

    /// The parameter indices (module order) `rank` owns.
    pub fn owned(&self, rank: usize) -> Range<usize> {
        let start = self.owner.partition_point(|&o| o < rank);
        let end = self.owner.partition_point(|&o| o <= rank);
        start..end
    }

    /// The ids of the parameters this rank owns in `model` (whose parameters must be the
    /// ones the plan was made for).
    pub fn owned_ids<AB: AutodiffBackend, M: AutodiffModule<AB>>(
        &self,
        model: &M,
    ) -> Result<HashSet<ParamId>> {
        let slots = self.check(slots::<AB, M>(model))?;
        let range = self.owned(self.world.rank);
        Ok(slots[range].iter().map(|s| s.id).collect())
    }

    /// The element count each rank's parameters hold in `model` (every float parameter).
    pub fn elements_per_rank<AB: AutodiffBackend, M: AutodiffModule<AB>>(
        &self,
        model: &M,
    ) -> Result<Vec<usize>> {
        let slots = self.check(slots::<AB, M>(model))?;
        Ok((0..self.world.size.max(1))
            .map(|r| slots[self.owned(r)].iter().map(|s| s.len).sum())
            .collect())
    }

    fn check(&self, slots: Vec<Slot>) -> Result<Vec<Slot>> {
        if slots.len() != self.owner.len() {
            return Err(CoreError::config(
                "sharding",
                format!("a model of {} float parameters", slots.len()),
                format!(
                    "the {} parameters the shard plan was made for (a model's parameters may not be added or removed after INIT in a sharded run)",
                    self.owner.len()
                ),
            ));
        }
        Ok(slots)
    }

    /// Where each rank's trainable parameters lie in the gradient buffer of this step.
    pub(crate) fn layout<AB: AutodiffBackend, M: AutodiffModule<AB>>(
        &self,
        model: &M,
    ) -> Result<Layout> {
        let slots = self.check(slots::<AB, M>(model))?;
        let w = self.world.size.max(1);
        let mut per_rank = vec![0..0; w];
        let mut offset = 0;
        for (rank, range) in per_rank.iter_mut().enumerate() {
            let start = offset;
            for s in &slots[self.owned(rank)] {
                if s.trainable {
                    offset += s.len;
                }
            }
            *range = start..offset;
        }
        Ok(Layout {
            slots,
            owner: self.owner.clone(),
            per_rank,
            len: offset,
            rank: self.world.rank,
        })
    }
}

/// One float parameter as a plan sees it.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    id: ParamId,
    len: usize,
    trainable: bool,
}

fn slots<AB: AutodiffBackend, M: AutodiffModule<AB>>(model: &M) -> Vec<Slot> {
    struct Slots<AB> {
        out: Vec<Slot>,
        _b: std::marker::PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Slots<AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let value = param.val();
            self.out.push(Slot {
                id: param.id,
                len: value.shape().num_elements(),
                trainable: value.is_require_grad(),
            });
        }
    }
    let mut v = Slots::<AB> {
        out: Vec::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut v);
    v.out
}

/// A plan applied to this step's trainable parameters: each rank's element range in the
/// flat gradient buffer ([`flatten_grads`]'s layout).
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    slots: Vec<Slot>,
    owner: Vec<usize>,
    /// Per rank, its trainable parameters' elements in the buffer.
    per_rank: Vec<Range<usize>>,
    /// The buffer's length (every trainable element).
    len: usize,
    rank: usize,
}

impl Layout {
    /// Elements per rank, in rank order.
    pub(crate) fn counts(&self) -> Vec<usize> {
        self.per_rank.iter().map(|r| r.len()).collect()
    }

    /// This rank's trainable parameters, in module order.
    fn mine(&self) -> impl Iterator<Item = &Slot> {
        self.slots
            .iter()
            .zip(&self.owner)
            .filter(move |(s, &o)| o == self.rank && s.trainable)
            .map(|(s, _)| s)
    }
}

/// The sharded form of [`Collective::sync_gradients`]: the same buffer, reduce-scattered in
/// pieces of one parameter each ([`Collective::reduce_scatter_pieces`]), so that this rank
/// gets the averaged gradients of the parameters it owns (and had gradients for), bit for bit
/// those the all-reduce gives, and the ranks agree on the loss and on skipping as they do
/// there. Each owned piece becomes its parameter's gradient without a copy. Also returns the
/// ids this rank had gradients for (the parameters [`gather_gradients`] fills in).
pub(crate) fn sync_gradient_shards<S: Setup>(
    c: &mut dyn Collective<S>,
    plan: &ShardPlan,
    model: &S::Model,
    local: LocalStep,
) -> Result<(GlobalStep, HashSet<ParamId>)> {
    let out = Outgoing::of::<S>(model, local);
    let keep = out.keep;
    let Some(pieces) = out.pieces else {
        return Ok((nothing_trains(c, out.extras, out.had_grads)?, keep));
    };
    let layout = plan.layout::<S::Backend, S::Model>(model)?;
    let trainable: Vec<&Slot> = layout.slots.iter().filter(|s| s.trainable).collect();
    let mut needs: Vec<Option<usize>> = layout
        .slots
        .iter()
        .zip(&layout.owner)
        .filter(|(s, _)| s.trainable)
        .map(|(_, &o)| Some(o))
        .collect();
    needs.push(None);
    let lengths_match =
        pieces.len() == needs.len() && pieces.iter().zip(&trainable).all(|(p, s)| p.len() == s.len);
    if !lengths_match {
        let got: usize = pieces.iter().map(Vec::len).sum::<usize>().saturating_sub(3);
        return Err(CoreError::config(
            "sharding",
            format!(
                "a gradient buffer of {got} values in {} pieces",
                pieces.len()
            ),
            format!(
                "{} values in {} pieces, the model's trainable parameters",
                layout.len,
                trainable.len()
            ),
        ));
    }
    let device = present_device::<S::Backend, S::Model>(model);
    let mut got = c.reduce_scatter_pieces(pieces, &needs, &device)?;
    let extras = got.pop().unwrap_or_default();
    let agreed = Agreed::from_values(&extras);
    if agreed.skipped_ranks > 0 {
        return Ok((agreed.skipped(), keep));
    }
    let grads = out.had_grads.then(|| {
        let mut grads = GradientsParams::new();
        let mut owned = got.into_iter();
        register_owned::<S::Backend, S::Model>(
            model,
            &layout,
            &mut owned,
            agreed.total,
            &keep,
            &mut grads,
        );
        grads
    });
    Ok((agreed.step(grads), keep))
}

/// Registers this rank's summed pieces (one per trainable parameter in module order, empty
/// for the ones other ranks own), divided by `total`, as the gradients of the parameters
/// `keep` holds; each piece becomes its tensor without a copy, divided in place.
fn register_owned<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    layout: &Layout,
    pieces: &mut dyn Iterator<Item = Vec<f32>>,
    total: f32,
    keep: &HashSet<ParamId>,
    out: &mut GradientsParams,
) {
    struct Register<'a, AB: AutodiffBackend> {
        layout: &'a Layout,
        index: usize,
        pieces: &'a mut dyn Iterator<Item = Vec<f32>>,
        total: f32,
        keep: &'a HashSet<ParamId>,
        out: &'a mut GradientsParams,
        _b: std::marker::PhantomData<AB>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Register<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let i = self.index;
            self.index += 1;
            let value = param.val();
            if !value.is_require_grad() {
                return;
            }
            let piece = self.pieces.next().unwrap_or_default();
            let mine = self.layout.owner.get(i) == Some(&self.layout.rank);
            if !mine || !self.keep.contains(&param.id) {
                return;
            }
            let shape: [usize; D] = value.dims();
            let device = value.device();
            let g =
                Tensor::<AB::InnerBackend, D>::from_data(TensorData::new(piece, shape), &device)
                    .div_scalar(self.total);
            self.out.register::<AB::InnerBackend, D>(param.id, g);
        }
    }
    model.visit(&mut Register::<AB> {
        layout,
        index: 0,
        pieces,
        total,
        keep,
        out,
        _b: std::marker::PhantomData,
    });
}

/// Registers the pieces of `flat` (this rank's trainable parameters, in order) as the
/// gradients of the parameters `keep` holds.
fn register_pieces<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    layout: &Layout,
    flat: Tensor<AB::InnerBackend, 1>,
    keep: &HashSet<ParamId>,
    out: &mut GradientsParams,
) {
    struct Register<'a, AB: AutodiffBackend> {
        mine: HashSet<ParamId>,
        keep: &'a HashSet<ParamId>,
        flat: Tensor<AB::InnerBackend, 1>,
        offset: usize,
        out: &'a mut GradientsParams,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Register<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let value = param.val();
            if !value.is_require_grad() || !self.mine.contains(&param.id) {
                return;
            }
            let shape: [usize; D] = value.dims();
            let n: usize = shape.iter().product();
            if self.keep.contains(&param.id) {
                let g = self.flat.clone().narrow(0, self.offset, n).reshape(shape);
                self.out.register::<AB::InnerBackend, D>(param.id, g);
            }
            self.offset += n;
        }
    }
    let mine = layout.mine().map(|s| s.id).collect();
    let mut v = Register::<AB> {
        mine,
        keep,
        flat,
        offset: 0,
        out,
    };
    model.visit(&mut v);
}

/// This rank's trainable owned parameters (or their gradients in `grads`, zeros where one
/// has none) as host numbers, in module order.
fn owned_values<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    layout: &Layout,
    grads: Option<&GradientsParams>,
) -> Vec<f32> {
    struct Owned<'a, AB: AutodiffBackend> {
        mine: HashSet<ParamId>,
        grads: Option<&'a GradientsParams>,
        pieces: Vec<Tensor<AB::InnerBackend, 1>>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Owned<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let value = param.val();
            if !value.is_require_grad() || !self.mine.contains(&param.id) {
                return;
            }
            let n = value.shape().num_elements();
            let piece = match self.grads {
                None => value.inner().reshape([n]),
                Some(g) => match g.get::<AB::InnerBackend, D>(param.id) {
                    Some(g) => g.reshape([n]),
                    None => Tensor::zeros([n], &value.device()),
                },
            };
            self.pieces.push(piece);
        }
    }
    let mine = layout.mine().map(|s| s.id).collect();
    let mut v = Owned::<AB> {
        mine,
        grads,
        pieces: Vec::new(),
    };
    model.visit(&mut v);
    if v.pieces.is_empty() {
        return Vec::new();
    }
    Tensor::cat(v.pieces, 0)
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .collect()
}

/// The most elements one bucket of the parameter gather carries (16 MiB of `f32`) unless a
/// single parameter is larger: the gather holds one bucket at a time, never a copy of the
/// model.
const GATHER_BUCKET: usize = 1 << 22;

/// One bucket of the parameter gather: consecutive trainable parameters of one owner.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bucket {
    owner: usize,
    /// The parameters (indices in module order) it spans.
    slots: Range<usize>,
    /// Its element count.
    len: usize,
}

/// Cuts the trainable parameters into buckets: runs of one owner, each at most `limit`
/// elements or a single larger parameter. Every rank cuts the same buckets.
fn buckets(layout: &Layout, limit: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    for (i, (slot, &owner)) in layout.slots.iter().zip(&layout.owner).enumerate() {
        if !slot.trainable {
            continue;
        }
        match out.last_mut() {
            Some(b) if b.owner == owner && b.slots.end == i && b.len + slot.len <= limit => {
                b.slots.end = i + 1;
                b.len += slot.len;
            }
            _ => out.push(Bucket {
                owner,
                slots: i..i + 1,
                len: slot.len,
            }),
        }
    }
    out
}

/// After a sharded optimizer step: every rank's owned trainable parameters, sent from their
/// owners bucket by bucket ([`Collective::broadcast_from`]) and written straight into the
/// other ranks' models (copies of the owners' bits; ids and dtypes kept). A rank holds one
/// bucket beyond its model at a time. On an error the model comes back with the parameters
/// gathered so far.
pub(crate) fn gather_params<S: Setup>(
    c: &mut dyn Collective<S>,
    plan: &ShardPlan,
    model: S::Model,
) -> (S::Model, Result<()>) {
    let layout = match plan.layout::<S::Backend, S::Model>(&model) {
        Ok(l) => l,
        Err(e) => return (model, Err(e)),
    };
    let buckets = buckets(&layout, GATHER_BUCKET);
    let mut bucket_of = vec![usize::MAX; layout.slots.len()];
    for (b, bucket) in buckets.iter().enumerate() {
        for i in bucket.slots.clone() {
            bucket_of[i] = b;
        }
    }
    let mine = owned_tensors::<S::Backend, S::Model>(&model, &layout);
    let mut gather = GatherInto::<S> {
        c,
        buckets,
        bucket_of,
        mine,
        rank: layout.rank,
        received: Vec::new(),
        at: 0,
        index: 0,
        error: None,
    };
    let model = model.map(&mut gather);
    let result = match gather.error {
        Some(e) => Err(e),
        None => Ok(()),
    };
    (model, result)
}

/// This rank's trainable owned parameters (handles to the model's own tensors, flattened;
/// no copies), by parameter index.
fn owned_tensors<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
    layout: &Layout,
) -> Vec<Option<Tensor<AB::InnerBackend, 1>>> {
    struct Mine<'a, AB: AutodiffBackend> {
        layout: &'a Layout,
        index: usize,
        out: Vec<Option<Tensor<AB::InnerBackend, 1>>>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Mine<'_, AB> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let i = self.index;
            self.index += 1;
            let value = param.val();
            let owned = self.layout.owner.get(i) == Some(&self.layout.rank);
            self.out.push((owned && value.is_require_grad()).then(|| {
                let n = value.shape().num_elements();
                value.inner().reshape([n])
            }));
        }
    }
    let mut v = Mine::<AB> {
        layout,
        index: 0,
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}

/// The mapper of [`gather_params`]: at the first parameter of each bucket it runs the
/// bucket's broadcast (the owner packs its parameters' values; the others receive them),
/// then writes the received values into the parameters the bucket spans.
struct GatherInto<'a, S: Setup> {
    c: &'a mut dyn Collective<S>,
    buckets: Vec<Bucket>,
    bucket_of: Vec<usize>,
    mine: Vec<Option<Tensor<crate::setup::InnerBackendOf<S>, 1>>>,
    rank: usize,
    /// The current bucket's values, on a rank that does not own it.
    received: Vec<f32>,
    /// Where the next parameter's values start in `received`.
    at: usize,
    index: usize,
    error: Option<CoreError>,
}

impl<S: Setup> GatherInto<'_, S> {
    /// Runs bucket `b`'s broadcast.
    fn exchange(&mut self, b: usize) -> Result<()> {
        let bucket = &self.buckets[b];
        let values = if bucket.owner == self.rank {
            let mut values = Vec::with_capacity(bucket.len);
            for t in self.mine[bucket.slots.clone()].iter().flatten() {
                let data = t.clone().into_data().convert::<f32>();
                match data.as_slice::<f32>() {
                    Ok(v) => values.extend_from_slice(v),
                    Err(_) => values.extend(data.iter::<f32>()),
                }
            }
            values
        } else {
            Vec::new()
        };
        let got = self.c.broadcast_from(bucket.owner, values, bucket.len)?;
        if got.len() != bucket.len {
            return Err(CoreError::config(
                "sharding",
                format!("a parameter bucket of {} values", got.len()),
                format!(
                    "{} values, as its owner rank {} sent",
                    bucket.len, bucket.owner
                ),
            ));
        }
        self.received = if bucket.owner == self.rank {
            Vec::new()
        } else {
            got
        };
        self.at = 0;
        Ok(())
    }
}

impl<S: Setup> ModuleMapper<S::Backend> for GatherInto<'_, S> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<S::Backend, D>>,
    ) -> Param<Tensor<S::Backend, D>> {
        let i = self.index;
        self.index += 1;
        let Some(&b) = self.bucket_of.get(i).filter(|&&b| b != usize::MAX) else {
            return param;
        };
        if self.error.is_some() {
            return param;
        }
        if self.buckets[b].slots.start == i {
            if let Err(e) = self.exchange(b) {
                self.error = Some(e);
                return param;
            }
        }
        let last = self.buckets[b].slots.end == i + 1;
        if self.buckets[b].owner == self.rank {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let shape: [usize; D] = tensor.dims();
        let n: usize = shape.iter().product();
        let dtype = tensor.dtype();
        let device = tensor.device();
        drop(tensor);
        let values = self.received[self.at..self.at + n].to_vec();
        self.at += n;
        if last {
            self.received = Vec::new();
        }
        let data = TensorData::new(values, shape);
        let value =
            Tensor::<crate::setup::InnerBackendOf<S>, D>::from_data(data, &device).cast(dtype);
        let value = Tensor::<S::Backend, D>::from_inner(value).require_grad();
        Param::from_mapped_value(id, value, mapper)
    }
}

/// The whole averaged gradient on every rank (the parameters any rank kept gradients for
/// through `keep`, this rank's own set; the others' come from their owners).
pub(crate) fn gather_gradients<S: Setup>(
    c: &mut dyn Collective<S>,
    plan: &ShardPlan,
    model: &S::Model,
    grads: &GradientsParams,
    keep: &HashSet<ParamId>,
) -> Result<GradientsParams> {
    let layout = plan.layout::<S::Backend, S::Model>(model)?;
    let mine = owned_values::<S::Backend, S::Model>(model, &layout, Some(grads));
    let all = c.all_gather_f32(mine, &layout.counts())?;
    if all.len() != layout.len {
        return Err(gathered_length(all.len(), layout.len));
    }
    let mut out = GradientsParams::new();
    if layout.len == 0 {
        return Ok(out);
    }
    let device = present_device::<S::Backend, S::Model>(model);
    let flat = Tensor::<crate::setup::InnerBackendOf<S>, 1>::from_data(
        TensorData::new(all, [layout.len]),
        &device,
    );
    let everything = Layout {
        owner: vec![layout.rank; layout.owner.len()],
        ..layout
    };
    register_pieces::<S::Backend, S::Model>(model, &everything, flat, keep, &mut out);
    Ok(out)
}

fn present_device<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    model: &M,
) -> burn::tensor::Device<AB::InnerBackend> {
    model.devices().into_iter().next().unwrap_or_default()
}

fn gathered_length(got: usize, expected: usize) -> CoreError {
    CoreError::config(
        "sharding",
        format!("an all-gather of {got} values"),
        format!("{expected} values, the model's trainable elements on every rank"),
    )
}

/// Gives `model`'s parameters rank 0's parameter ids (the weights are rank 0's already, from
/// the broadcast). Each rank's optimizer state is keyed by parameter id, and a sharded
/// checkpoint holds every rank's part: with one set of ids the parts make one record, which
/// a run at any world size loads. The ids travel as four 16-bit pieces each, exact in the
/// `f32` buffer a broadcast carries.
pub(crate) fn take_rank0_ids<S: Setup>(
    c: &mut dyn Collective<S>,
    model: S::Model,
) -> Result<S::Model> {
    let ids: Vec<u64> = slots::<S::Backend, S::Model>(&model)
        .iter()
        .map(|s| s.id.val())
        .collect();
    if ids.is_empty() {
        return Ok(model);
    }
    let pieces: Vec<f32> = ids
        .iter()
        .flat_map(|id| (0..4).map(move |k| ((id >> (16 * k)) & 0xFFFF) as f32))
        .collect();
    let n = pieces.len();
    let device = present_device::<S::Backend, S::Model>(&model);
    let buffer = Tensor::<crate::setup::InnerBackendOf<S>, 1>::from_data(
        TensorData::new(pieces, [n]),
        &device,
    );
    let got: Vec<f32> = c
        .broadcast(buffer)?
        .into_data()
        .convert::<f32>()
        .iter::<f32>()
        .collect();
    let rank0: Vec<u64> = got
        .chunks(4)
        .map(|p| {
            p.iter()
                .enumerate()
                .fold(0u64, |id, (k, &v)| id | ((v as u64) << (16 * k)))
        })
        .collect();
    if rank0.len() != ids.len() {
        return Err(CoreError::config(
            "sharding",
            format!("rank 0's {} parameter ids", rank0.len()),
            format!(
                "{} ids, one per float parameter of this rank's model",
                ids.len()
            ),
        ));
    }
    struct Rename {
        ids: Vec<u64>,
        at: usize,
    }
    impl<AB: AutodiffBackend> ModuleMapper<AB> for Rename {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            let (id, tensor, mapper) = param.consume();
            let id = self.ids.get(self.at).map_or(id, |&v| ParamId::from(v));
            self.at += 1;
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    Ok(model.map(&mut Rename { ids: rank0, at: 0 }))
}

/// Every rank's `mine` (host numbers of any lengths), concatenated in rank order: the
/// lengths are agreed first (one small sum), then the values are gathered.
pub(crate) fn gather_host<S: Setup>(c: &mut dyn Collective<S>, mine: Vec<f32>) -> Result<Vec<f32>> {
    let world = c.world();
    let mut counts = vec![0.0; world.size.max(1)];
    if let Some(n) = counts.get_mut(world.rank) {
        *n = mine.len() as f64;
    }
    c.all_reduce_sum_host(&mut counts)?;
    let counts: Vec<usize> = counts.iter().map(|&n| n.round() as usize).collect();
    c.all_gather_f32(mine, &counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_buckets_are_one_owners_runs_within_the_limit_or_one_larger_parameter() {
        // (length, trainable, owner)
        let params = [
            (4, true, 0),
            (3, true, 0),
            (2, false, 0),
            (5, true, 0),
            (20, true, 1),
            (1, true, 1),
            (2, true, 1),
        ];
        let layout = Layout {
            slots: params
                .iter()
                .map(|&(len, trainable, _)| Slot {
                    id: ParamId::new(),
                    len,
                    trainable,
                })
                .collect(),
            owner: params.iter().map(|p| p.2).collect(),
            per_rank: vec![0..12, 12..35],
            len: 35,
            rank: 0,
        };
        let got: Vec<(usize, Range<usize>, usize)> = buckets(&layout, 8)
            .into_iter()
            .map(|b| (b.owner, b.slots, b.len))
            .collect();
        // The frozen parameter ends a run (it is never sent); the 20-element one goes alone.
        assert_eq!(
            got,
            vec![(0, 0..2, 7), (0, 3..4, 5), (1, 4..5, 20), (1, 5..7, 3)]
        );
        let total: usize = buckets(&layout, 1 << 22).iter().map(|b| b.len).sum();
        assert_eq!(total, 35, "every trainable element once");
    }

    fn world(size: usize) -> World {
        World { rank: 0, size }
    }

    #[test]
    fn owners_are_contiguous_and_balanced_by_elements() {
        // 10 + 10 + 10 + 10 over two ranks: two each.
        let p = ShardPlan::new(&[10, 10, 10, 10], world(2));
        assert_eq!(p.owners(), &[0, 0, 1, 1]);
        assert_eq!((p.owned(0), p.owned(1)), (0..2, 2..4));
        // A parameter larger than a share: its middle decides; a rank may own nothing.
        let p = ShardPlan::new(&[1, 100, 1], world(3));
        assert_eq!(p.owners(), &[0, 1, 2]);
        let p = ShardPlan::new(&[100, 1, 1], world(3));
        assert_eq!(p.owners(), &[1, 2, 2]);
        assert_eq!(p.owned(0), 0..0);
        // Hand-worked: sizes 3, 5, 2, 6 (total 16) over 2: middles 1.5, 5.5, 9, 13 against
        // the half 8: owners 0, 0, 1, 1.
        let p = ShardPlan::new(&[3, 5, 2, 6], world(2));
        assert_eq!(p.owners(), &[0, 0, 1, 1]);
        // One rank owns everything.
        let p = ShardPlan::new(&[3, 5], world(1));
        assert_eq!(p.owners(), &[0, 0]);
        assert_eq!(p.owned(0), 0..2);
    }

    #[test]
    fn every_parameter_has_one_owner_and_owners_never_decrease() {
        let mut rng = crate::rng::Rng::new(7);
        for _ in 0..200 {
            let n = 1 + rng.below(30) as usize;
            let sizes: Vec<usize> = (0..n).map(|_| 1 + rng.below(1000) as usize).collect();
            let w = 1 + rng.below(6) as usize;
            let p = ShardPlan::new(&sizes, world(w));
            assert!(p.owners().windows(2).all(|o| o[0] <= o[1]));
            assert!(p.owners().iter().all(|&o| o < w));
            let covered: usize = (0..w).map(|r| p.owned(r).len()).sum();
            assert_eq!(covered, n);
            // No rank's share exceeds an equal share by more than its largest parameter.
            let total: usize = sizes.iter().sum();
            let largest = *sizes.iter().max().unwrap();
            for r in 0..w {
                let mine: usize = sizes[p.owned(r)].iter().sum();
                assert!(
                    mine <= total / w + largest,
                    "{sizes:?} over {w}: rank {r} {mine}"
                );
            }
        }
    }

    #[test]
    fn strategies_parse_and_full_sharding_says_why_not() {
        assert_eq!(
            Sharding::parse("shard_grad_op").unwrap(),
            Sharding::ShardGradOp
        );
        assert_eq!(
            Sharding::parse("SHARD-GRAD-OP").unwrap(),
            Sharding::ShardGradOp
        );
        assert_eq!(Sharding::parse("no_shard").unwrap(), Sharding::NoShard);
        let e = Sharding::parse("full_shard").unwrap_err().to_string();
        assert!(e.contains("full_shard") && e.contains("DESIGN.md"), "{e}");
        let e = Sharding::parse("zero3").unwrap_err().to_string();
        assert!(
            e.contains("zero3") && e.contains("no_shard or shard_grad_op"),
            "{e}"
        );
        assert!(!Sharding::ShardGradOp.shards(1));
        assert!(Sharding::ShardGradOp.shards(2));
        assert!(!Sharding::NoShard.shards(2));
    }
}
