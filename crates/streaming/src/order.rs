//! The order in which a streamed dataset's samples are read: Streaming's `py1b` shuffle,
//! computed position by position.
//!
//! Each epoch, the shards are put in a random order (seeded by `(seed, epoch)`), their
//! samples concatenated, and the concatenation cut into blocks of `block_size` samples;
//! inside each block the samples are permuted at random. A block therefore mixes the samples
//! of the few shards it spans, and reading it touches only those: reads stay within a window
//! of shards (what the cache must hold) while every batch still draws from several shards.
//!
//! Why `py1b` and not `py1s` (samples shuffled within each shard): with `py1s` consecutive
//! batches come from one shard, so a dataset written in sorted order (by class, by source)
//! trains on one class at a time; `py1b`'s blocks span shards and mix them, at the price of
//! holding a block's shards at once. Streaming's default today, `py1e`, blurs block edges
//! further; `py1b` is the simplest of its block shuffles whose window is exact, which is what
//! lets the cache check its limit before a download instead of thrashing.
//!
//! Unlike Streaming, which materialises the epoch's sample order (8 bytes a sample), every
//! position is computed on demand: the shard order and its prefix sums are O(shards), the
//! permutation inside a block is a keyed Feistel bijection ([`Permutation`]) evaluated in
//! O(1), and a position maps to its shard by binary search. Memory is independent of the
//! number of samples, and resuming at batch `b` computes batch `b` directly, reading nothing
//! before it.
//!
//! Ranks: the epoch's sample sequence does not depend on the world size. Rank `r` of `w` takes
//! positions `r, r + w, ...` of it (with the in-memory [`Sampler`]'s padding by wrap-around),
//! so with the global batch fixed, batch `b` holds the same samples at every world size and a
//! run resumes exactly on another number of ranks. Streaming instead gives each node its own
//! span of shards (`num_canonical_nodes`), which cuts downloads per node but ties the order to
//! the node count; here every rank reads from the same block window (on one machine, ranks
//! can share a cache folder's downloads only through the object store).

use std::sync::{Arc, Mutex};

use flashover_core::data::{BatchOrder, Sampler};
use flashover_core::rng::{derive_seed, Permutation, Rng};

use crate::error::{Result, StreamingError};

const SHARD_TAG: u64 = 0x5_4A2D_0A1B;
const BLOCK_TAG: u64 = 0xB1_0C4B;

/// Streaming's default block size for `py1b` (`1 << 18` samples).
pub const DEFAULT_BLOCK_SIZE: usize = 1 << 18;

/// Called with `(epoch, first, last)`: the global positions a batch reads.
pub type BatchHook = Arc<dyn Fn(u64, u64, u64) + Send + Sync>;

/// One epoch's shard order and where each shard starts in the concatenation.
#[derive(Debug)]
pub struct EpochLayout {
    epoch: u64,
    /// Shard ids in the epoch's order.
    order: Vec<u32>,
    /// `starts[k]`: the position in the concatenation where `order[k]` starts; one more entry
    /// at the end (the number of samples).
    starts: Vec<u64>,
}

impl EpochLayout {
    /// The shard (id) and position within it of concatenation position `q`.
    fn locate(&self, q: u64) -> (usize, u64) {
        let k = self.starts.partition_point(|&s| s <= q) - 1;
        (self.order[k] as usize, q - self.starts[k])
    }
}

/// The sample order of a sharded dataset (see the module's documentation).
#[derive(Clone)]
pub struct ShardOrder {
    shard_sizes: Arc<Vec<u64>>,
    shard_base: Arc<Vec<u64>>,
    total: u64,
    seed: u64,
    shuffle: bool,
    block_size: u64,
    positions: Sampler,
    layout: Arc<Mutex<Option<Arc<EpochLayout>>>>,
    on_batch: Option<BatchHook>,
}

impl std::fmt::Debug for ShardOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardOrder")
            .field("shards", &self.shard_sizes.len())
            .field("samples", &self.total)
            .field("seed", &self.seed)
            .field("shuffle", &self.shuffle)
            .field("block_size", &self.block_size)
            .field("positions", &self.positions)
            .finish()
    }
}

impl ShardOrder {
    /// The order over shards of `shard_sizes` samples, in batches of `batch_size` for one
    /// process; `shuffle` with `py1b` blocks of `block_size` samples, else shard by shard.
    pub fn new(
        shard_sizes: Vec<u64>,
        batch_size: usize,
        shuffle: bool,
        seed: u64,
        block_size: usize,
    ) -> Result<ShardOrder> {
        if block_size == 0 {
            return Err(StreamingError::config(
                "shuffle_block_size",
                block_size,
                "a number of samples >= 1",
            ));
        }
        let mut base = Vec::with_capacity(shard_sizes.len());
        let mut total = 0u64;
        for &s in &shard_sizes {
            base.push(total);
            total += s;
        }
        let positions = Sampler::new(total as usize, batch_size, false, seed)
            .map_err(|e| StreamingError::config("batch_size", batch_size, e.to_string()))?;
        Ok(ShardOrder {
            shard_sizes: Arc::new(shard_sizes),
            shard_base: Arc::new(base),
            total,
            seed,
            shuffle,
            block_size: block_size as u64,
            positions,
            layout: Arc::new(Mutex::new(None)),
            on_batch: None,
        })
    }

    /// Rank `rank` of `world_size`'s share (positions `rank, rank + world_size, ...`, padded
    /// by wrap-around as the in-memory sampler pads).
    pub fn sharded(mut self, rank: usize, world_size: usize) -> Result<ShardOrder> {
        self.positions = self
            .positions
            .sharded(rank, world_size)
            .map_err(|e| StreamingError::config("rank", rank, e.to_string()))?;
        Ok(self)
    }

    /// Like [`ShardOrder::sharded`] without padding (evaluation: every sample once).
    pub fn sharded_exact(mut self, rank: usize, world_size: usize) -> Result<ShardOrder> {
        self.positions = self
            .positions
            .sharded_exact(rank, world_size)
            .map_err(|e| StreamingError::config("rank", rank, e.to_string()))?;
        Ok(self)
    }

    /// Drops an epoch's last, short batch.
    pub fn drop_last(mut self, drop_last: bool) -> ShardOrder {
        self.positions = self.positions.drop_last(drop_last);
        self
    }

    /// Calls `f(epoch, first, last)` with the first and last global positions of each batch
    /// asked for (the dataset's download-ahead follows them).
    pub fn on_batch(mut self, f: BatchHook) -> ShardOrder {
        self.on_batch = Some(f);
        self
    }

    /// Samples in the dataset.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The block size.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Whether the order is shuffled.
    pub fn shuffled(&self) -> bool {
        self.shuffle
    }

    /// The epoch's shard order and offsets (cached for the latest epoch asked for).
    pub fn layout(&self, epoch: u64) -> Arc<EpochLayout> {
        let mut slot = self.layout.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = slot.as_ref().filter(|l| l.epoch == epoch) {
            return Arc::clone(l);
        }
        let mut order: Vec<u32> = (0..self.shard_sizes.len() as u32).collect();
        if self.shuffle {
            let mut rng = Rng::new(derive_seed(&[self.seed, epoch, SHARD_TAG]));
            for i in (1..order.len()).rev() {
                let j = (rng.next_u64() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        let mut starts = Vec::with_capacity(order.len() + 1);
        let mut at = 0;
        for &k in &order {
            starts.push(at);
            at += self.shard_sizes[k as usize];
        }
        starts.push(at);
        let l = Arc::new(EpochLayout {
            epoch,
            order,
            starts,
        });
        *slot = Some(Arc::clone(&l));
        l
    }

    /// The sample id (index over the shards in index order) at global position `q` of
    /// `epoch`.
    pub fn sample_at(&self, layout: &EpochLayout, q: u64) -> u64 {
        if !self.shuffle {
            return q;
        }
        let b = q / self.block_size;
        let start = b * self.block_size;
        let len = self.block_size.min(self.total - start);
        let perm = Permutation::new(len, derive_seed(&[self.seed, layout.epoch, b, BLOCK_TAG]));
        let (shard, within) = layout.locate(start + perm.apply(q - start));
        self.shard_base[shard] + within
    }

    /// The shard of sample id `id`, and its index within the shard.
    pub fn shard_of(&self, id: u64) -> (usize, u64) {
        let k = self.shard_base.partition_point(|&s| s <= id) - 1;
        (k, id - self.shard_base[k])
    }

    /// The shards (ids) read for the samples of block `b` of `epoch`, in the epoch's shard
    /// order; without shuffling, block `b` is the same span of positions.
    pub fn block_shards(&self, epoch: u64, b: u64) -> Vec<usize> {
        let start = b * self.block_size;
        if start >= self.total {
            return Vec::new();
        }
        let end = (start + self.block_size).min(self.total);
        let layout = self.layout(epoch);
        let first = layout.starts.partition_point(|&s| s <= start) - 1;
        let mut out = Vec::new();
        for k in first..layout.order.len() {
            if layout.starts[k] >= end {
                break;
            }
            if self.shard_sizes[layout.order[k] as usize] > 0 {
                out.push(layout.order[k] as usize);
            }
        }
        out
    }

    /// Every position of rank's epoch, as sample ids (for tests and checks; O(epoch)).
    pub fn epoch_samples(&self, epoch: u64) -> Vec<u64> {
        (0..BatchOrder::num_batches(self))
            .flat_map(|b| self.batch_indices(epoch, b).unwrap_or_default())
            .map(|i| i as u64)
            .collect()
    }
}

impl BatchOrder for ShardOrder {
    fn num_batches(&self) -> usize {
        self.positions.num_batches()
    }
    fn num_samples(&self) -> usize {
        self.positions.num_samples()
    }
    fn batch_size(&self) -> usize {
        self.positions.batch_size()
    }
    fn batch_indices(&self, epoch: u64, batch: usize) -> Option<Vec<usize>> {
        let positions = self.positions.batch_indices(epoch, batch)?;
        if let (Some(f), Some(&first), Some(&last)) =
            (&self.on_batch, positions.first(), positions.last())
        {
            f(epoch, first as u64, last as u64);
        }
        let layout = self.layout(epoch);
        Some(
            positions
                .into_iter()
                .map(|q| self.sample_at(&layout, q as u64) as usize)
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn order(sizes: &[u64], block: usize, seed: u64) -> ShardOrder {
        ShardOrder::new(sizes.to_vec(), 4, true, seed, block).unwrap()
    }

    #[test]
    fn unshuffled_reads_shards_in_index_order() {
        let o = ShardOrder::new(vec![3, 2], 2, false, 0, 4).unwrap();
        assert_eq!(o.epoch_samples(5), vec![0, 1, 2, 3, 4]);
        assert_eq!(o.shard_of(3), (1, 0));
        assert_eq!(o.shard_of(2), (0, 2));
    }

    #[test]
    fn a_block_draws_only_from_the_shards_it_spans() {
        // 20 shards of 50 samples, blocks of 100: each block spans 2 or 3 shards.
        let o = order(&[50; 20], 100, 7);
        let samples = o.epoch_samples(3);
        for (b, chunk) in samples.chunks(100).enumerate() {
            let shards: std::collections::BTreeSet<usize> =
                chunk.iter().map(|&id| o.shard_of(id).0).collect();
            let allowed: std::collections::BTreeSet<usize> =
                o.block_shards(3, b as u64).into_iter().collect();
            assert!(
                shards.is_subset(&allowed),
                "block {b}: {shards:?} not in {allowed:?}"
            );
            assert!(allowed.len() <= 3);
        }
        // The shard order changes between epochs, and within a block samples are mixed.
        assert_ne!(o.layout(0).order, o.layout(1).order);
        assert_ne!(samples[..100].to_vec(), {
            let mut s = samples[..100].to_vec();
            s.sort();
            s
        });
    }

    proptest! {
        #[test]
        fn every_sample_once_per_epoch_at_every_world_size(
            sizes in proptest::collection::vec(0u64..40, 1..8),
            block in 1usize..70, seed: u64, epoch in 0u64..3, world in 1usize..5,
        ) {
            let total: u64 = sizes.iter().sum();
            prop_assume!(total > 0);
            let mut seen = vec![0u32; total as usize];
            for rank in 0..world {
                let o = order(&sizes, block, seed).sharded_exact(rank, world).unwrap();
                for id in o.epoch_samples(epoch) {
                    seen[id as usize] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "{:?}", seen);
        }

        #[test]
        fn global_batch_b_holds_the_same_samples_at_every_world_size(
            sizes in proptest::collection::vec(1u64..30, 1..6),
            block in 1usize..50, seed: u64, world in 1usize..5, batch in 0usize..6,
        ) {
            // A global batch of 12 (divisible by 1..4): batch b of the whole order.
            let one = ShardOrder::new(sizes.clone(), 12, true, seed, block).unwrap();
            let mut whole = one.batch_indices(1, batch).unwrap_or_default();
            let mut split = Vec::new();
            for rank in 0..world {
                let o = ShardOrder::new(sizes.clone(), 12 / world, true, seed, block).unwrap()
                    .sharded(rank, world).unwrap();
                split.extend(o.batch_indices(1, batch).unwrap_or_default());
            }
            let total: u64 = sizes.iter().sum();
            // Without padding (the one-process order) the last batch may be short; the
            // sharded orders pad it by wrap-around, so compare on the samples the whole order has.
            if (batch + 1) * 12 <= total as usize {
                whole.sort();
                split.sort();
                prop_assert_eq!(whole, split);
            }
        }
    }
}
