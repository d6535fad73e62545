//! Where a data-parallel run meets its other ranks. Core never talks to another process: it
//! calls a [`Collective`] at four fixed points, and `flashover-distributed` (or a test)
//! implements the trait. Without one, a run is a single process and none of this runs.
//!
//! The seams, in the order a run meets them:
//! 1. **Initial weights** ([`Collective::broadcast_model`]): once, while the trainer is built,
//!    after `INIT` and any restore, before `AFTER_LOAD`: every rank takes rank 0's weights.
//! 2. **Gradients** ([`Collective::sync_gradients`]): once per optimizer step, after the
//!    microbatches are accumulated and before `AFTER_TRAIN_BATCH`, so that gradient clipping
//!    sees the averaged gradients. The whole step's gradients travel in one flat buffer
//!    (every trainable parameter in the module's order), with the batch loss and a flag for a
//!    non-finite loss: one all-reduce per step. If any rank's loss was not finite (and the run
//!    skips such batches), every rank skips the step. An algorithm that computes gradients of
//!    its own (SAM's second pass) averages them through
//!    [`State::replace_gradients`](crate::state::State::replace_gradients) (or
//!    [`State::average_gradients`](crate::state::State::average_gradients)), the same call.
//! 3. **Progress** ([`Collective::sync_progress`]): at every batch end, before `BATCH_END`,
//!    the ranks agree on the samples and tokens of the whole data-parallel batch (the
//!    timestamp counts those, as Composer's does) and on the run's wall-clock time (the
//!    slowest rank's), so every rank takes the same decisions about `max_duration`, intervals
//!    and fraction-driven algorithms. Also at each epoch end and fit end.
//! 4. **Evaluation metrics** ([`Collective::reduce_metrics`]): after each evaluator's last
//!    batch, its metrics' running totals (sums and counts) are summed over ranks, so every rank
//!    reads the global value; each rank evaluates its own shard of the data. (A sharded
//!    sampler pads the last shard by wrapping, as PyTorch's `DistributedSampler` does, so when
//!    the evaluation set does not divide evenly a few samples count twice.)
//! 5. **Stop requests** ([`Collective::any_stop`]): after `FIT_START` and every
//!    `BATCH_CHECKPOINT` and `EPOCH_CHECKPOINT`: one rank asking to stop stops all, at the
//!    same batch.
//!
//! A rank that fails (an error from a component, a non-finite loss without skipping) returns
//! its error; its peers learn of it through the implementation (MPI aborts the job, and the
//! contract below asks for a timeout), not through core.
//!
//! And one rule that needs no communication: components that write (loggers, the progress
//! bar, plots, the profiler's trace, the checkpoint saver) act on rank 0 only, unless wrapped
//! in [`OnEveryRank`]; [`World`] says which rank this is and [`Ranks`] what a component asks.
//!
//! An implementation provides four primitives (the world, a sum of a device buffer, a sum of
//! host numbers, a broadcast of a device buffer); the seams are provided methods built on them,
//! which an implementation may override (to bucket gradients, for example).

use std::collections::HashSet;
use std::time::Duration;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{ElementConversion, Tensor, TensorData};

use crate::error::{CoreError, Result};
use crate::params::{
    drain_grads_to_host, flatten_params, grad_ids, load_flat_params, unflatten_grads,
};
use crate::setup::{InnerBackendOf, Setup};

use crate::world::World;
pub use crate::world::{OnEveryRank, Ranks};

/// One rank's share of an optimizer step, as the trainer hands it to
/// [`Collective::sync_gradients`].
pub struct LocalStep {
    /// The batch's gradients on this rank (summed over its microbatches); `None` when its
    /// loss was not finite, or a component removed them.
    pub grads: Option<GradientsParams>,
    /// The batch's loss on this rank (ignored when it is not finite).
    pub loss: f64,
    /// Whether every microbatch loss on this rank was finite.
    pub finite: bool,
    /// Samples in this rank's batch: each rank's mean gradient and loss weigh by it, so the
    /// average is the mean over every sample of the data-parallel batch even when the ranks'
    /// batches differ in size.
    pub samples: u64,
}

/// What the ranks agreed a batch added to the run (see [`Collective::sync_progress`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progressed {
    /// Samples of the whole data-parallel batch.
    pub samples: u64,
    /// Tokens of the whole data-parallel batch.
    pub tokens: u64,
    /// The run's wall-clock time: the largest of the ranks'.
    pub wall: Duration,
}

/// What the ranks agreed on for an optimizer step.
pub struct GlobalStep {
    /// The gradients averaged over every rank, for the parameters that had one here; `None`
    /// when any rank skipped the batch (then no rank steps).
    pub grads: Option<GradientsParams>,
    /// The loss averaged over every rank; `None` when the step is skipped.
    pub loss: Option<f64>,
    /// How many ranks had a non-finite loss.
    pub skipped_ranks: usize,
}

/// The communication a data-parallel run needs; see the module docs for where the trainer
/// calls it.
///
/// Every method is collective: every rank calls it, in the same order, with buffers of the
/// same length. Every rank must receive the same bits (reduce in a fixed order, or reduce on
/// one rank and broadcast), or the ranks' weights drift apart. A rank that cannot reach its
/// peers returns an error naming the peer, within a timeout; it never waits forever.
pub trait Collective<S: Setup>: Send {
    /// This process's rank and the number of ranks.
    fn world(&self) -> World;

    /// The element-wise sum of `buffer` over every rank.
    fn all_reduce_sum(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> Result<Tensor<InnerBackendOf<S>, 1>>;

    /// Sums `values` element-wise over every rank, in place (metric totals, stop flags).
    fn all_reduce_sum_host(&mut self, values: &mut [f64]) -> Result<()>;

    /// Rank 0's `buffer`, on every rank (other ranks' values are ignored).
    fn broadcast(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> Result<Tensor<InnerBackendOf<S>, 1>>;

    /// Sums a buffer given as consecutive `pieces` element-wise over every rank, as
    /// [`Collective::all_reduce_sum`] sums their concatenation and with the same bits, and
    /// returns only the pieces this rank needs: piece `p` goes to rank `r` where `needs[p]` is
    /// `Some(r)`, to every rank where it is `None`; the others come back empty, their memory
    /// freed. A sharded run's gradient seam ([`crate::shard`]): one piece per parameter, so a
    /// rank never holds the whole gradient twice. The provided form concatenates the pieces
    /// on `device` and all-reduces them; a transport overrides it to send each element to its
    /// owner only (the MPI ring), piece by piece.
    fn reduce_scatter_pieces(
        &mut self,
        pieces: Vec<Vec<f32>>,
        needs: &[Option<usize>],
        device: &burn::tensor::Device<InnerBackendOf<S>>,
    ) -> Result<Vec<Vec<f32>>> {
        check_needs(&pieces, needs)?;
        let rank = self.world().rank;
        let lens: Vec<usize> = pieces.iter().map(Vec::len).collect();
        let sum = self.all_reduce_sum(Outgoing::buffer::<InnerBackendOf<S>>(pieces, device))?;
        let all: Vec<f32> = sum.into_data().convert::<f32>().iter::<f32>().collect();
        let mut at = 0;
        Ok(lens
            .iter()
            .zip(needs)
            .map(|(&n, need)| {
                let piece = match need.is_none_or(|r| r == rank) {
                    true => all[at..at + n].to_vec(),
                    false => Vec::new(),
                };
                at += n;
                piece
            })
            .collect())
    }

    /// Every rank's `mine` (rank `r` brings `counts[r]` values), concatenated in rank order,
    /// on every rank: copies of each rank's bits. The provided form rides on
    /// [`Collective::all_reduce_sum_host`] (each value's bits as an integer, exact); a
    /// transport overrides it to send the values once.
    fn all_gather_f32(&mut self, mine: Vec<f32>, counts: &[usize]) -> Result<Vec<f32>> {
        all_gather_by_sum(self, mine, counts)
    }

    /// Rank `root`'s `values` (`len` of them) on every rank, copies of its bits; the other
    /// ranks' `values` are ignored (a sharded run's parameter gather sends each bucket of a
    /// rank's parameters this way). The provided form is an all-gather in which only `root`
    /// brings values; a transport overrides it to send them once from `root`.
    fn broadcast_from(&mut self, root: usize, values: Vec<f32>, len: usize) -> Result<Vec<f32>> {
        let world = self.world();
        let mut counts = vec![0; world.size.max(1)];
        if let Some(n) = counts.get_mut(root) {
            *n = len;
        }
        let mine = if world.rank == root {
            values
        } else {
            Vec::new()
        };
        self.all_gather_f32(mine, &counts)
    }

    /// Every rank's `text`, in rank order (a sharded checkpoint's report of each rank's
    /// file). The provided form rides on [`Collective::all_reduce_sum_host`], one byte a
    /// number.
    fn all_gather_text(&mut self, text: &str) -> Result<Vec<String>> {
        let world = self.world();
        let mut lengths = vec![0.0; world.size.max(1)];
        if let Some(n) = lengths.get_mut(world.rank) {
            *n = text.len() as f64;
        }
        self.all_reduce_sum_host(&mut lengths)?;
        let lengths: Vec<usize> = lengths.iter().map(|&n| n.round() as usize).collect();
        let start: usize = lengths[..world.rank.min(lengths.len())].iter().sum();
        let mut all = vec![0.0; lengths.iter().sum()];
        for (slot, b) in all[start..].iter_mut().zip(text.as_bytes()) {
            *slot = f64::from(*b);
        }
        self.all_reduce_sum_host(&mut all)?;
        let mut at = 0;
        Ok(lengths
            .iter()
            .map(|&n| {
                let bytes: Vec<u8> = all[at..at + n].iter().map(|&v| v as u8).collect();
                at += n;
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .collect())
    }

    /// Gives every rank rank 0's weights; parameter ids are kept.
    fn broadcast_model(&mut self, model: S::Model) -> Result<S::Model> {
        match flatten_params::<S::Backend, _>(&model) {
            Some(flat) => {
                let flat = self.broadcast(flat)?;
                load_flat_params::<S::Backend, _>(model, flat)
            }
            None => Ok(model),
        }
    }

    /// Averages an optimizer step's gradients and loss over every sample of the data-parallel
    /// batch, in one all-reduce of one buffer: this rank's mean gradients (the trainable
    /// parameters in `model`'s order, zeros for a rank without gradients) times its sample
    /// count, then its loss times its sample count, its sample count, and a flag that is 1
    /// where the loss was not finite. The sums divided by the total sample count are the
    /// global means, so ranks with batches of different sizes (a user's uneven shards) weigh
    /// correctly. If any rank's loss was not finite, no rank gets gradients. A rank gets back
    /// the parameters it had gradients for.
    fn sync_gradients(&mut self, model: &S::Model, local: LocalStep) -> Result<GlobalStep> {
        let out = Outgoing::of::<S>(model, local);
        let Some(pieces) = out.pieces else {
            return nothing_trains(self, out.extras, out.had_grads);
        };
        let device = model.devices().into_iter().next().unwrap_or_default();
        let buffer = Outgoing::buffer::<InnerBackendOf<S>>(pieces, &device);
        let len = buffer.dims()[0] - 3;
        let sum = self.all_reduce_sum(buffer)?;
        let agreed = Agreed::read(&sum, len);
        if agreed.skipped_ranks > 0 {
            return Ok(agreed.skipped());
        }
        let keep = out.keep;
        let grads = out.had_grads.then(|| {
            let mean = sum.narrow(0, 0, len).div_scalar(agreed.total);
            unflatten_grads::<S::Backend, _>(model, mean, &|id| keep.contains(&id))
        });
        Ok(agreed.step(grads))
    }

    /// Agrees on the run's progress after a batch: the samples and tokens of every rank's
    /// batch (summed, so the timestamp counts the whole data-parallel batch, as a single
    /// process training on it would) and the run's wall-clock time (the largest of the
    /// ranks'), so that every rank decides the same about durations, intervals and
    /// fraction-driven algorithms.
    fn sync_progress(&mut self, samples: u64, tokens: u64, wall: Duration) -> Result<Progressed> {
        let world = self.world();
        let mut v = vec![0.0; 2 + world.size.max(1)];
        v[0] = samples as f64;
        v[1] = tokens as f64;
        if let Some(w) = v.get_mut(2 + world.rank) {
            *w = wall.as_secs_f64();
        }
        self.all_reduce_sum_host(&mut v)?;
        let slowest = v[2..].iter().copied().fold(0.0, f64::max);
        Ok(Progressed {
            samples: v[0].round() as u64,
            tokens: v[1].round() as u64,
            // The same bits on every rank: computed from the summed values alone.
            wall: Duration::try_from_secs_f64(slowest).unwrap_or(Duration::MAX),
        })
    }

    /// Sums every rank's metric totals, in place.
    fn reduce_metrics(&mut self, totals: &mut [f64]) -> Result<()> {
        self.all_reduce_sum_host(totals)
    }

    /// Whether any rank asked to stop, and the first that did.
    fn any_stop(&mut self, requested: bool) -> Result<Option<usize>> {
        let world = self.world();
        let mut flags = vec![0.0; world.size.max(1)];
        if requested {
            if let Some(f) = flags.get_mut(world.rank) {
                *f = 1.0;
            }
        }
        self.all_reduce_sum_host(&mut flags)?;
        Ok(flags.iter().position(|&f| f > 0.0))
    }
}

/// One rank's share of an optimizer step as the gradient seams send it (data-parallel and
/// sharded alike, so both sum the same buffer): the batch's gradients (every trainable
/// parameter in the model's order, zeros where one has none) times the rank's sample count,
/// then its loss times its sample count, the count and the non-finite flag.
pub(crate) struct Outgoing {
    /// The parameters this rank had gradients for.
    pub(crate) keep: HashSet<ParamId>,
    /// Whether the rank brought gradients at all.
    pub(crate) had_grads: bool,
    /// The buffer in pieces, one per trainable parameter (module order), then the three
    /// extras; `None` when nothing trains.
    pub(crate) pieces: Option<Vec<Vec<f32>>>,
    /// The three extras, for a model that trains nothing.
    pub(crate) extras: [f64; 3],
}

impl Outgoing {
    /// `local` laid out for the exchange, on the host one gradient at a time, each freed once
    /// copied (the exchange never holds the gradient twice).
    pub(crate) fn of<S: Setup>(model: &S::Model, local: LocalStep) -> Self {
        let keep = local
            .grads
            .as_ref()
            .map(|g| grad_ids::<S::Backend, _>(model, g))
            .unwrap_or_default();
        let n = local.samples as f64;
        let (loss, flag) = if local.finite {
            (local.loss * n, 0.0)
        } else {
            (0.0, 1.0)
        };
        let had_grads = local.grads.is_some();
        let (grads, weight) = match local.finite {
            true => (local.grads, Some(n)),
            false => (None, None),
        };
        let mut pieces = drain_grads_to_host::<S::Backend, _>(model, grads, weight);
        let pieces = (!pieces.is_empty()).then(|| {
            pieces.push(vec![loss as f32, n as f32, flag as f32]);
            pieces
        });
        Outgoing {
            keep,
            had_grads,
            pieces,
            extras: [loss, n, flag],
        }
    }

    /// The pieces as one device buffer (each freed once copied in), for an all-reduce.
    pub(crate) fn buffer<B: burn::tensor::backend::Backend>(
        pieces: Vec<Vec<f32>>,
        device: &B::Device,
    ) -> Tensor<B, 1> {
        let total = pieces.iter().map(Vec::len).sum();
        let mut flat = Vec::with_capacity(total);
        for piece in pieces {
            flat.extend_from_slice(&piece);
        }
        Tensor::from_data(TensorData::new(flat, [total]), device)
    }
}

/// A model that trains nothing still agrees on the loss and the skip flag.
pub(crate) fn nothing_trains<S: Setup>(
    c: &mut (impl Collective<S> + ?Sized),
    extras: [f64; 3],
    had_grads: bool,
) -> Result<GlobalStep> {
    let mut v = extras;
    c.all_reduce_sum_host(&mut v)?;
    let skipped_ranks = v[2].round() as usize;
    Ok(GlobalStep {
        grads: (skipped_ranks == 0 && had_grads).then(GradientsParams::new),
        loss: (skipped_ranks == 0).then(|| v[0] / v[1].max(1.0)),
        skipped_ranks,
    })
}

/// The summed extras of an exchanged buffer: the loss sum, the total sample count (at least
/// 1) and how many ranks skipped.
pub(crate) struct Agreed {
    loss: Option<f32>,
    pub(crate) total: f32,
    pub(crate) skipped_ranks: usize,
}

impl Agreed {
    /// Reads the three extras at `at` of the summed buffer `sum` (one read from the device).
    pub(crate) fn read<B: burn::tensor::backend::Backend>(sum: &Tensor<B, 1>, at: usize) -> Self {
        let tail: Vec<f32> = sum
            .clone()
            .narrow(0, at, 3)
            .into_data()
            .iter::<f32>()
            .map(|v| v.elem::<f32>())
            .collect();
        Agreed::from_values(&tail)
    }

    /// Reads the three summed extras from the host.
    pub(crate) fn from_values(tail: &[f32]) -> Self {
        Agreed {
            loss: tail.first().copied(),
            total: tail.get(1).copied().unwrap_or(1.0).max(1.0),
            skipped_ranks: tail.get(2).copied().unwrap_or(0.0).round() as usize,
        }
    }

    /// The step every rank skips.
    pub(crate) fn skipped(&self) -> GlobalStep {
        GlobalStep {
            grads: None,
            loss: None,
            skipped_ranks: self.skipped_ranks,
        }
    }

    /// The step with `grads`, its loss the mean over every sample.
    pub(crate) fn step(&self, grads: Option<GradientsParams>) -> GlobalStep {
        GlobalStep {
            grads,
            loss: self.loss.map(|l| f64::from(l) / f64::from(self.total)),
            skipped_ranks: 0,
        }
    }
}

/// The collective calls a callback may make through its
/// [`Control`](crate::callback::Control) (host numbers and text only: callbacks do not touch
/// tensors). Collective: a callback may call it only at an event every rank runs it at, which
/// holds for callbacks acting on every rank ([`Ranks::Every`], and [`Ranks::Shards`] in a
/// sharded run), never for one acting on rank 0 only (its peers would wait forever).
pub trait Peers {
    /// This process's rank and the number of ranks.
    fn world(&self) -> World;
    /// Sums `values` element-wise over every rank, in place.
    fn sum(&mut self, values: &mut [f64]) -> Result<()>;
    /// Every rank's `text`, in rank order.
    fn gather_text(&mut self, text: &str) -> Result<Vec<String>>;
}

impl<S: Setup> Peers for Box<dyn Collective<S>> {
    fn world(&self) -> World {
        self.as_ref().world()
    }
    fn sum(&mut self, values: &mut [f64]) -> Result<()> {
        self.as_mut().all_reduce_sum_host(values)
    }
    fn gather_text(&mut self, text: &str) -> Result<Vec<String>> {
        self.as_mut().all_gather_text(text)
    }
}

/// [`Collective::all_gather_f32`]'s provided form, on the host sum alone: each value's bits,
/// as an integer below 2^32 (exact in an `f64`), in its rank's place and zeros elsewhere, so
/// the sum is every rank's bits, exactly (adding floats would turn a `-0.0` into `0.0`).
fn all_gather_by_sum<S: Setup>(
    c: &mut (impl Collective<S> + ?Sized),
    mine: Vec<f32>,
    counts: &[usize],
) -> Result<Vec<f32>> {
    let world = c.world();
    check_counts(counts, world, mine.len())?;
    let start: usize = counts[..world.rank].iter().sum();
    let total: usize = counts.iter().sum();
    let mut all = vec![0.0f64; total];
    for (slot, v) in all[start..start + mine.len()].iter_mut().zip(&mine) {
        *slot = f64::from(v.to_bits());
    }
    c.all_reduce_sum_host(&mut all)?;
    Ok(all.iter().map(|&b| f32::from_bits(b as u32)).collect())
}

/// One entry of `needs` per piece.
pub fn check_needs(pieces: &[Vec<f32>], needs: &[Option<usize>]) -> Result<()> {
    if pieces.len() != needs.len() {
        return Err(CoreError::config(
            "reduce-scatter pieces",
            format!("{} pieces with {} owners", pieces.len(), needs.len()),
            "one owner (or every rank) per piece",
        ));
    }
    Ok(())
}

/// `counts` has one entry per rank and this rank's is `mine`.
fn check_counts(counts: &[usize], world: World, mine: usize) -> Result<()> {
    if counts.len() != world.size.max(1) || counts.get(world.rank) != Some(&mine) {
        return Err(CoreError::config(
            "all-gather counts",
            format!("{counts:?} with {mine} values on rank {}", world.rank),
            format!(
                "one count per rank ({}), this rank's equal to the values it brings",
                world.size
            ),
        ));
    }
    Ok(())
}

/// The error for a metric that cannot be summed over ranks.
pub(crate) fn unreducible_metric(evaluator: &str, metric: &str) -> CoreError {
    CoreError::config(
        "evaluator metrics",
        format!("`{metric}` of evaluator `{evaluator}`"),
        "metrics whose running totals add over ranks (implement `Metric::totals` and `Metric::set_totals`) in a data-parallel run",
    )
}
