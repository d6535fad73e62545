//! Data: datasets (Burn's [`Dataset`] trait), a sampler whose order is a pure function of
//! `(seed, epoch, rank, world size)`, a prefetching loader, and the MNIST IDX reader.
//!
//! The trainer sees data only through [`BatchSource`], so it never knows the item type, and a
//! loader can start any epoch at any batch without touching the batches before it. The loader
//! itself reads through two seams, [`BatchOrder`] (which indices make up a batch) and
//! [`ItemSource`] (the item at an index, or why it cannot be read), so that a dataset
//! streamed from shards (`flashover-streaming`) brings its own order and its own errors.

mod idx;
mod loader;
mod sampler;

pub use burn::data::dataloader::batcher::Batcher;
pub use burn::data::dataset::Dataset;
pub use idx::{
    parse_idx_images, parse_idx_labels, read_idx_images, read_idx_labels, IdxImages, MnistBatcher,
    MnistDataset, MnistItem, MnistSplit, MNIST_MEAN, MNIST_STD,
};
pub use loader::{BatchIter, DataLoader, MAX_PREFETCH};
pub use sampler::Sampler;

/// Which dataset indices make up each batch of an epoch, for one rank. It must be a pure
/// function of its settings and `(epoch, batch)`: the loader asks for a batch directly when a
/// run resumes, and asks nothing about the batches before it.
pub trait BatchOrder: Send + Sync {
    /// Batches in one epoch.
    fn num_batches(&self) -> usize;
    /// Samples in one epoch.
    fn num_samples(&self) -> usize;
    /// Samples in a full batch.
    fn batch_size(&self) -> usize;
    /// The indices of batch `batch` of `epoch`, or `None` past the epoch's last batch.
    fn batch_indices(&self, epoch: u64, batch: usize) -> Option<Vec<usize>>;
}

impl BatchOrder for Sampler {
    fn num_batches(&self) -> usize {
        Sampler::num_batches(self)
    }
    fn num_samples(&self) -> usize {
        Sampler::num_samples(self)
    }
    fn batch_size(&self) -> usize {
        Sampler::batch_size(self)
    }
    fn batch_indices(&self, epoch: u64, batch: usize) -> Option<Vec<usize>> {
        Sampler::batch_indices(self, epoch, batch)
    }
}

/// Items by index, where a read can fail with a reason (a shard that cannot be downloaded or
/// decoded): the loader turns the reason into an error naming the loader and the batch.
/// Every Burn [`Dataset`] is one (a missing item's reason names its index).
pub trait ItemSource<I>: Send + Sync {
    /// Items in the source.
    fn len(&self) -> usize;
    /// Whether the source has no item.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The item at `index`.
    fn read(&self, index: usize) -> std::result::Result<I, String>;
}

use derive_new::new;

use crate::error::Result;

/// Anything that yields an epoch's batches in order, starting at any batch.
pub trait BatchSource<T>: Send {
    /// A name for logs and errors ("train", an evaluator's label).
    fn name(&self) -> &str;
    /// Batches in one epoch.
    fn num_batches(&self) -> usize;
    /// Samples in one epoch.
    fn num_samples(&self) -> usize;
    /// Samples in a full batch (the last batch of an epoch may be smaller).
    fn batch_size(&self) -> usize;
    /// The batches of `epoch` from batch `start` on. Items before `start` are not read.
    fn iter_from(&self, epoch: u64, start: usize) -> BatchIter<T>;
}

/// A dataset held in memory (`InMemoryDataset::new(items)`).
#[derive(Debug, Clone, new)]
pub struct InMemoryDataset<I> {
    items: Vec<I>,
}

impl<I> InMemoryDataset<I> {
    /// Keeps only the first `n` items (for quick runs); a no-op when `n` is larger.
    pub fn truncate(&mut self, n: usize) {
        self.items.truncate(n);
    }
}

impl<I: Clone + Send + Sync> Dataset<I> for InMemoryDataset<I> {
    fn get(&self, index: usize) -> Option<I> {
        self.items.get(index).cloned()
    }
    fn len(&self) -> usize {
        self.items.len()
    }
}

/// Checks that a dataset is not empty, naming it otherwise.
pub(crate) fn non_empty(name: &str, len: usize) -> Result<()> {
    if len == 0 {
        Err(crate::error::CoreError::EmptyDataset {
            name: name.to_string(),
        })
    } else {
        Ok(())
    }
}
