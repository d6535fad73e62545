//! The sampler decides which dataset indices make up each batch of each epoch, for one rank.
//! Its order is a pure function of `(seed, epoch, rank, world size)`: it never reads data and
//! has no state that advances, so a resumed run asks for "epoch e, batch b" directly.
//!
//! The shuffle is a keyed bijection on `0..len` (a four-round Feistel network over the next
//! power of four, with cycle walking), so the item at any position of any epoch is computed
//! in O(1) time and memory: jumping to batch b costs the same as reading batch 0, and no
//! epoch-sized permutation is ever materialised.

use crate::error::{CoreError, Result};
use crate::rng::{derive_seed, Permutation};

/// Shuffled (or sequential), sharded, batched index order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampler {
    len: usize,
    batch_size: usize,
    shuffle: bool,
    drop_last: bool,
    seed: u64,
    rank: usize,
    world_size: usize,
    pad: bool,
}

impl Sampler {
    /// A sampler over every item of `dataset` in batches of `batch_size`, for a single
    /// process: [`Sampler::new`] with the dataset's own length.
    pub fn for_dataset<I>(
        dataset: &(impl super::Dataset<I> + ?Sized),
        batch_size: usize,
        shuffle: bool,
        seed: u64,
    ) -> Result<Self> {
        Self::new(dataset.len(), batch_size, shuffle, seed)
    }

    /// A sampler over `len` items in batches of `batch_size`, for a single process.
    pub fn new(len: usize, batch_size: usize, shuffle: bool, seed: u64) -> Result<Self> {
        if batch_size == 0 {
            return Err(CoreError::config(
                "batch_size",
                batch_size,
                "an integer >= 1",
            ));
        }
        Ok(Sampler {
            len,
            batch_size,
            shuffle,
            drop_last: false,
            seed,
            rank: 0,
            world_size: 1,
            pad: true,
        })
    }

    /// Shards the order over `world_size` ranks; this sampler yields rank `rank`'s share.
    /// When the length does not divide evenly, the order is padded by wrapping around so that
    /// every rank gets the same number of items and no item is left out.
    pub fn sharded(mut self, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(CoreError::config(
                "world_size",
                world_size,
                "an integer >= 1",
            ));
        }
        if rank >= world_size {
            return Err(CoreError::config(
                "rank",
                rank,
                format!("a rank in 0..{world_size}"),
            ));
        }
        self.rank = rank;
        self.world_size = world_size;
        Ok(self)
    }

    /// Shards without padding: rank `rank` gets the positions `rank, rank + world_size, ...`
    /// of the epoch's order that exist, so the ranks' shares differ by at most one item and
    /// every item is seen exactly once over all ranks. For evaluation, where a metric must
    /// not count an item twice and ranks need not take the same number of batches (metrics
    /// are summed once, after the last batch). Training pads instead ([`Sampler::sharded`]):
    /// there every rank must take the same number of optimizer steps.
    pub fn sharded_exact(self, rank: usize, world_size: usize) -> Result<Self> {
        let mut s = self.sharded(rank, world_size)?;
        s.pad = false;
        Ok(s)
    }

    /// Drops the last batch of each epoch when it is smaller than `batch_size`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Items this rank sees per epoch (before `drop_last`).
    pub fn rank_len(&self) -> usize {
        if self.pad {
            self.len.div_ceil(self.world_size)
        } else {
            self.len.saturating_sub(self.rank).div_ceil(self.world_size)
        }
    }

    /// Items in one epoch of the whole data-parallel order: the dataset's length, padded (by
    /// wrapping around) to a multiple of the world size when the sampler pads.
    pub fn global_len(&self) -> usize {
        if self.pad {
            self.rank_len() * self.world_size
        } else {
            self.len
        }
    }

    /// Batches per epoch for this rank.
    pub fn num_batches(&self) -> usize {
        let n = self.rank_len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// Samples per epoch for this rank (after `drop_last`).
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.num_batches() * self.batch_size
        } else {
            self.rank_len()
        }
    }

    /// The epoch's shuffle: a bijection on `0..len`.
    fn permutation(&self, epoch: u64) -> Permutation {
        Permutation::new(
            self.len as u64,
            derive_seed(&[self.seed, epoch, 0x05A3_D1E5]),
        )
    }

    /// The dataset index at position `pos` of this rank's order, given the epoch's shuffle:
    /// the epoch's permutation of all items, padded by wrapping to a multiple of the world
    /// size, then every `world_size`-th item from `rank`.
    fn at(&self, perm: &Permutation, pos: usize) -> usize {
        let global = ((pos * self.world_size + self.rank) % self.len.max(1)) as u64;
        if self.shuffle {
            perm.apply(global) as usize
        } else {
            global as usize
        }
    }

    /// The dataset index at position `pos` of this rank's order in `epoch`. O(1).
    pub fn index_at(&self, epoch: u64, pos: usize) -> usize {
        self.at(&self.permutation(epoch), pos)
    }

    /// This rank's whole order for `epoch` (for tests and small datasets; loaders ask for
    /// single batches).
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        if self.len == 0 {
            return Vec::new();
        }
        let perm = self.permutation(epoch);
        (0..self.rank_len())
            .map(|pos| self.at(&perm, pos))
            .collect()
    }

    /// Indices of batch `batch` of `epoch`, or `None` past the end. O(batch size).
    pub fn batch_indices(&self, epoch: u64, batch: usize) -> Option<Vec<usize>> {
        if batch >= self.num_batches() {
            return None;
        }
        let start = batch * self.batch_size;
        let end = (start + self.batch_size).min(self.rank_len());
        let perm = self.permutation(epoch);
        Some((start..end).map(|pos| self.at(&perm, pos)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn zero_batch_size_is_an_error_naming_it() {
        let err = Sampler::new(10, 0, true, 1).unwrap_err().to_string();
        assert!(err.contains("batch_size") && err.contains('0'), "{err}");
        assert!(Sampler::new(10, 2, true, 1).unwrap().sharded(2, 2).is_err());
    }

    #[test]
    fn a_shuffled_epoch_moves_items_far() {
        // A shuffle that left most items near their place would not decorrelate batches:
        // the mean displacement of a uniform permutation of n is about n/3.
        let n = 10_000;
        let s = Sampler::new(n, 64, true, 3).unwrap();
        let idx = s.epoch_indices(0);
        let mean: f64 = idx
            .iter()
            .enumerate()
            .map(|(p, &i)| (p as f64 - i as f64).abs())
            .sum::<f64>()
            / n as f64;
        assert!(
            (mean - n as f64 / 3.0).abs() < n as f64 * 0.02,
            "mean displacement {mean}"
        );
        // And the first batch draws from all over the dataset.
        let first: Vec<usize> = s.batch_indices(0, 0).unwrap();
        assert!(first.iter().any(|&i| i < n / 4) && first.iter().any(|&i| i > 3 * n / 4));
    }

    #[test]
    fn sequential_order_batches_with_a_short_last_batch() {
        let s = Sampler::new(10, 4, false, 0).unwrap();
        assert_eq!(s.num_batches(), 3);
        assert_eq!(s.batch_indices(0, 2), Some(vec![8, 9]));
        assert_eq!(s.batch_indices(0, 3), None);
        let d = s.clone().drop_last(true);
        assert_eq!(d.num_batches(), 2);
        assert_eq!(d.num_samples(), 8);
    }

    proptest! {
        #[test]
        fn exact_shards_see_every_item_once(len in 0usize..300, world in 1usize..7, seed: u64, epoch in 0u64..4) {
            let mut seen = vec![0u32; len];
            let mut sizes = Vec::new();
            for rank in 0..world {
                let s = Sampler::new(len, 5, true, seed).unwrap().sharded_exact(rank, world).unwrap();
                let order = s.epoch_indices(epoch);
                prop_assert_eq!(order.len(), s.rank_len());
                let batched: Vec<usize> = (0..s.num_batches()).flat_map(|b| s.batch_indices(epoch, b).unwrap()).collect();
                prop_assert_eq!(&batched, &order);
                for i in order { seen[i] += 1; }
                sizes.push(s.rank_len());
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "every item exactly once: {:?}", seen);
            let (lo, hi) = (sizes.iter().min().copied().unwrap_or(0), sizes.iter().max().copied().unwrap_or(0));
            prop_assert!(hi - lo <= 1);
        }

        #[test]
        fn a_global_batch_holds_the_same_items_at_every_world_size(len in 1usize..400, per_rank in 1usize..6, seed: u64) {
            // With the global batch fixed (each rank reading global / world), batch k of an
            // epoch is the same set of items for any world size dividing it: what lets a
            // checkpoint resume on another number of ranks.
            let global = per_rank * 6;
            let batches = |world: usize| -> Vec<Vec<usize>> {
                let samplers: Vec<_> = (0..world)
                    .map(|r| Sampler::new(len, global / world, true, seed).unwrap().sharded(r, world).unwrap())
                    .collect();
                (0..samplers[0].num_batches())
                    .map(|b| {
                        let mut v: Vec<usize> = samplers.iter().flat_map(|s| s.batch_indices(1, b).unwrap()).collect();
                        v.sort_unstable();
                        v
                    })
                    .collect()
            };
            let one = batches(1);
            for world in [2, 3, 6] {
                let other = batches(world);
                prop_assert_eq!(one.len(), other.len());
                // Every batch but the last is identical; the last differs only by the
                // wrap-around padding that makes it divide.
                let last = one.len() - 1;
                prop_assert_eq!(&one[..last], &other[..last]);
                for i in &one[last] { prop_assert!(other[last].contains(i)); }
                prop_assert!(other[last].len() - one[last].len() < world);
            }
        }

        #[test]
        fn each_epoch_is_a_permutation_that_depends_on_seed_and_epoch(len in 1usize..500, seed: u64, epoch in 0u64..100) {
            let s = Sampler::new(len, 7, true, seed).unwrap();
            let mut idx = s.epoch_indices(epoch);
            prop_assert_eq!(idx.clone(), s.epoch_indices(epoch));
            if len > 20 {
                prop_assert_ne!(idx.clone(), s.epoch_indices(epoch + 1));
                let other = Sampler::new(len, 7, true, seed.wrapping_add(1)).unwrap();
                prop_assert_ne!(idx.clone(), other.epoch_indices(epoch));
            }
            idx.sort();
            prop_assert_eq!(idx, (0..len).collect::<Vec<_>>());
        }

        #[test]
        fn shards_cover_everything_and_are_equal(len in 1usize..400, world in 1usize..6, seed: u64) {
            let mut seen = vec![0usize; len];
            let mut sizes = vec![];
            for rank in 0..world {
                let s = Sampler::new(len, 5, true, seed).unwrap().sharded(rank, world).unwrap();
                let idx = s.epoch_indices(3);
                sizes.push(idx.len());
                for i in idx { seen[i] += 1; }
            }
            prop_assert!(sizes.iter().all(|&n| n == sizes[0]));
            prop_assert!(seen.iter().all(|&c| c >= 1));
            prop_assert!(sizes[0] * world - len < world);
        }

        #[test]
        fn positions_are_computed_directly(len in 1usize..300, world in 1usize..4, seed: u64, epoch in 0u64..5) {
            let s = Sampler::new(len, 4, true, seed).unwrap().sharded(world - 1, world).unwrap();
            let whole = s.epoch_indices(epoch);
            for (pos, &i) in whole.iter().enumerate() {
                prop_assert_eq!(s.index_at(epoch, pos), i);
            }
        }

        #[test]
        fn any_batch_can_be_asked_for_directly(len in 1usize..300, bs in 1usize..40, seed: u64) {
            let s = Sampler::new(len, bs, true, seed).unwrap();
            let whole = s.epoch_indices(2);
            let joined: Vec<usize> = (0..s.num_batches()).flat_map(|b| s.batch_indices(2, b).unwrap()).collect();
            prop_assert_eq!(joined, whole);
        }
    }
}
