//! Data: datasets (Burn's [`Dataset`] trait), a sampler whose order is a pure function of
//! `(seed, epoch, rank, world size)`, a prefetching loader, and the MNIST IDX reader.
//!
//! The trainer sees data only through [`BatchSource`], so it never knows the item type, and a
//! loader can start any epoch at any batch without touching the batches before it.

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
