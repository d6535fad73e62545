//! A dataset streamed from shards: the index, a bounded local cache, a background thread
//! that downloads ahead of the reads, and the readers of the open shards.
//!
//! **Cache.** Shards that are remote or compressed are kept, raw, in a local folder of at most
//! `cache_limit` bytes. Room is made by evicting least-recently-used shards, never one of the
//! current block's (the shards being read); a shard that cannot get room is an error naming
//! the limit and what the block needs. Every file enters the cache through a temporary name
//! and a rename, after its size and hashes were checked against the index, so the folder only
//! ever holds verified shards (a file left by a killed process is checked again on first use).
//! Local raw shards are read in place (checked once per process).
//!
//! **Download ahead.** The order reports each batch's positions; a thread then fetches the
//! shards of the current and the next block, in the order they will be read, several at once
//! (`download_threads`), as far as the cache has room without evicting the current block. A read finds its shard ready or
//! fetches it itself; both wait for a download already under way.
//!
//! **Failures.** A fetch is retried `download_retries` times with doubling backoff (on top of
//! the object store's own retries of each request); then the read fails with an error naming
//! the shard, its location, the attempts and the last reason, and the loader reports it for
//! the batch: an epoch never comes out shorter.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::backend::Backend;
use flashover_core::data::{DataLoader, ItemSource};

use crate::codec;
use crate::error::{Result, StreamingError};
use crate::mds::{FileInfo, IndexFile, MdsShard, ShardEntry};
use crate::order::{ShardOrder, DEFAULT_BLOCK_SIZE};
use crate::parquet_shard;
use crate::storage::Storage;
use crate::value::Sample;

/// How a streamed dataset is read.
#[derive(Debug, Clone)]
pub struct StreamingOptions {
    /// The local cache folder; by default a folder named after the location under the
    /// system's temporary folder.
    pub cache_dir: Option<PathBuf>,
    /// The cache's size limit in bytes (`None`: unbounded).
    pub cache_limit: Option<u64>,
    /// Fetches of a shard after the first fails (default 4).
    pub download_retries: u32,
    /// The first wait between fetches, doubling up to 30 s (default 0.5 s).
    pub download_backoff: Duration,
    /// Shards fetched at once by the download-ahead (default 4): one request's latency, not
    /// the bandwidth, bounds a single fetcher (about 25 ms a 256 KB shard from a local S3
    /// server here), so several in flight keep up with a fast model.
    pub download_threads: usize,
    /// Whether the training order is shuffled (`py1b`).
    pub shuffle: bool,
    /// The order's seed.
    pub seed: u64,
    /// `py1b`'s block size in samples (default Streaming's `1 << 18`).
    pub shuffle_block_size: usize,
    /// Object-store settings given in code over the environment's (S3's `object_store`
    /// keys: `aws_endpoint`, `aws_access_key_id`, ...), as for remote checkpoints.
    pub store_config: Vec<(String, String)>,
}

impl Default for StreamingOptions {
    fn default() -> Self {
        StreamingOptions {
            cache_dir: None,
            cache_limit: None,
            download_retries: 4,
            download_backoff: Duration::from_millis(500),
            download_threads: 4,
            shuffle: true,
            seed: 0,
            shuffle_block_size: DEFAULT_BLOCK_SIZE,
            store_config: Vec::new(),
        }
    }
}

/// A shard opened for reading.
enum Reader {
    Mds(MdsShard),
    /// A Parquet file's rows, decoded when opened.
    Rows(Vec<Sample>),
}

#[derive(Default)]
struct CacheState {
    /// Cached shard id -> (bytes, last use).
    entries: HashMap<usize, (u64, u64)>,
    used: u64,
    clock: u64,
    /// Being fetched now (by the reader or the download-ahead thread).
    fetching: HashSet<usize>,
    /// Checked in this process (read in place, or cached).
    verified: HashSet<usize>,
    /// The current block's shards (never evicted) and the next block's, and both in the
    /// order they will be read.
    must: HashSet<usize>,
    next: HashSet<usize>,
    wanted: Vec<usize>,
    /// Open readers.
    open: HashMap<usize, Arc<Reader>>,
    /// The last (epoch, position) the order reported, and whether it changed since the
    /// download-ahead thread looked.
    progress: Option<(u64, u64)>,
    moved: bool,
    stop: bool,
    /// Bytes fetched from the location, and fetches that were retried.
    fetched_bytes: u64,
    retried: u64,
}

struct Inner {
    storage: Storage,
    location: String,
    index: IndexFile,
    cache_dir: PathBuf,
    options: StreamingOptions,
    /// The order over every sample (for the blocks' shards).
    order: ShardOrder,
    state: Mutex<CacheState>,
    changed: Condvar,
}

/// A dataset of MDS or Parquet shards in a folder or an object store.
pub struct StreamingDataset {
    inner: Arc<Inner>,
    ahead: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StreamingDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StreamingDataset({}, {} shards, {} samples)",
            self.inner.location,
            self.inner.index.shards.len(),
            self.inner.order.total()
        )
    }
}

/// What the cache did so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes the cache holds now.
    pub used: u64,
    /// Shards it holds now.
    pub shards: usize,
    /// Bytes fetched from the location.
    pub fetched_bytes: u64,
    /// Fetches that failed and were retried.
    pub retried: u64,
}

fn lock(m: &Mutex<CacheState>) -> MutexGuard<'_, CacheState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StreamingDataset {
    /// Opens the dataset at `data` (a folder, or `s3://bucket/prefix`): reads its
    /// `index.json`, or, for a folder of `.parquet` files without one, their footers.
    pub fn open(data: &str, options: StreamingOptions) -> Result<StreamingDataset> {
        if options.cache_limit == Some(0) {
            return Err(StreamingError::config(
                "cache_limit",
                0,
                "a number of bytes >= 1 (or no limit)",
            ));
        }
        let storage = Storage::open(data, options.store_config.clone())?;
        let location = storage.describe("");
        let index = match storage.get("index.json") {
            Ok(Some(text)) => IndexFile::parse(&storage.describe("index.json"), &text)?,
            Ok(None) => parquet_shard::index_folder(&storage)?,
            Err(e) => {
                return Err(StreamingError::Index {
                    location: storage.describe("index.json"),
                    reason: e,
                })
            }
        };
        let cache_dir = options
            .cache_dir
            .clone()
            .unwrap_or_else(|| default_cache_dir(&location));
        let sizes: Vec<u64> = index.shards.iter().map(|s| s.samples).collect();
        let order = ShardOrder::new(
            sizes,
            1,
            options.shuffle,
            options.seed,
            options.shuffle_block_size,
        )?;
        let mut state = CacheState::default();
        if needs_cache(&storage, &index) {
            std::fs::create_dir_all(&cache_dir)
                .map_err(|e| StreamingError::io("create", &cache_dir, e))?;
            scan_cache(&cache_dir, &index, &mut state)?;
        }
        let inner = Arc::new(Inner {
            storage,
            location,
            index,
            cache_dir,
            options,
            order,
            state: Mutex::new(state),
            changed: Condvar::new(),
        });
        let worker = Arc::clone(&inner);
        let ahead = std::thread::Builder::new()
            .name("flashover-streaming-ahead".into())
            .spawn(move || worker.download_ahead())
            .map_err(|e| StreamingError::Cache {
                folder: inner.cache_dir.display().to_string(),
                reason: format!("cannot start the download-ahead thread: {e}"),
            })?;
        Ok(StreamingDataset {
            inner,
            ahead: Some(ahead),
        })
    }

    /// Samples in the dataset.
    pub fn len(&self) -> usize {
        self.inner.order.total() as usize
    }

    /// Whether the dataset has no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The index (shards, their files and columns).
    pub fn index(&self) -> &IndexFile {
        &self.inner.index
    }

    /// The cache folder.
    pub fn cache_dir(&self) -> &Path {
        &self.inner.cache_dir
    }

    /// What the cache holds and has fetched.
    pub fn cache_stats(&self) -> CacheStats {
        let s = lock(&self.inner.state);
        CacheStats {
            used: s.used,
            shards: s.entries.len(),
            fetched_bytes: s.fetched_bytes,
            retried: s.retried,
        }
    }

    /// The training order in batches of `batch_size` (per rank: shard it with
    /// [`ShardOrder::sharded`]); it tells this dataset's download-ahead where reading is.
    pub fn order(&self, batch_size: usize) -> Result<ShardOrder> {
        let o = &self.inner.options;
        let sizes: Vec<u64> = self.inner.index.shards.iter().map(|s| s.samples).collect();
        let weak = Arc::downgrade(&self.inner);
        Ok(
            ShardOrder::new(sizes, batch_size, o.shuffle, o.seed, o.shuffle_block_size)?.on_batch(
                Arc::new(move |epoch, first, last| {
                    if let Some(inner) = weak.upgrade() {
                        inner.report(epoch, first, last);
                    }
                }),
            ),
        )
    }

    /// An order that reads every sample once, in index order, without shuffling (for
    /// evaluation; shard it with [`ShardOrder::sharded_exact`]).
    pub fn eval_order(&self, batch_size: usize) -> Result<ShardOrder> {
        let sizes: Vec<u64> = self.inner.index.shards.iter().map(|s| s.samples).collect();
        let weak = Arc::downgrade(&self.inner);
        Ok(ShardOrder::new(
            sizes,
            batch_size,
            false,
            0,
            self.inner.options.shuffle_block_size,
        )?
        .on_batch(Arc::new(move |_, first, last| {
            if let Some(inner) = weak.upgrade() {
                inner.report_unshuffled(first, last);
            }
        })))
    }

    /// Sample `id` (its index over the shards in index order).
    pub fn get(&self, id: usize) -> Result<Sample> {
        self.inner.read(id)
    }

    /// A loader of this dataset's samples, each turned into an item by `decode` and batched
    /// by `batcher`, in `order` (from [`StreamingDataset::order`]).
    pub fn loader<B, I, O>(
        self: &Arc<Self>,
        name: &str,
        decode: impl Fn(Sample) -> std::result::Result<I, String> + Send + Sync + 'static,
        batcher: Arc<dyn Batcher<B, I, O>>,
        order: ShardOrder,
        device: B::Device,
    ) -> flashover_core::error::Result<DataLoader<B, I, O>>
    where
        B: Backend,
        I: Send + Sync + 'static,
        O: Send + 'static,
    {
        let source = Decoded {
            dataset: Arc::clone(self),
            decode: Box::new(decode),
        };
        DataLoader::from_source(name, Arc::new(source), batcher, Arc::new(order), device)
    }
}

impl Drop for StreamingDataset {
    fn drop(&mut self) {
        lock(&self.inner.state).stop = true;
        self.inner.changed.notify_all();
        if let Some(h) = self.ahead.take() {
            let _ = h.join();
        }
    }
}

/// The cache folder a location gets by default: `flashover-streaming/<hash of the location>`
/// under the system's temporary folder, so that a restarted run finds its shards again. A
/// cache folder belongs to one process at a time: processes on one machine (ranks) each need
/// their own.
pub fn default_cache_dir(location: &str) -> PathBuf {
    let tag = codec::digest("sha256", location.as_bytes()).unwrap_or_default();
    std::env::temp_dir()
        .join("flashover-streaming")
        .join(&tag[..16])
}

/// Samples decoded into a user's items.
struct Decoded<I> {
    dataset: Arc<StreamingDataset>,
    #[allow(clippy::type_complexity)]
    decode: Box<dyn Fn(Sample) -> std::result::Result<I, String> + Send + Sync>,
}

impl<I> ItemSource<I> for Decoded<I> {
    fn len(&self) -> usize {
        self.dataset.len()
    }
    fn read(&self, index: usize) -> std::result::Result<I, String> {
        let sample = self.dataset.get(index).map_err(|e| e.to_string())?;
        (self.decode)(sample).map_err(|e| {
            let (shard, within) = self.dataset.inner.order.shard_of(index as u64);
            format!(
                "sample {index} ({}, sample {within}): {e}",
                self.dataset.inner.index.shards[shard].raw_data.basename
            )
        })
    }
}

/// Whether any shard goes through the cache (remote, or compressed).
fn needs_cache(storage: &Storage, index: &IndexFile) -> bool {
    storage.local().is_none() || index.shards.iter().any(|s| s.zip_data.is_some())
}

/// Writes a fetched shard into the cache through a temporary name and a rename, so that the
/// folder never shows a partial shard. Unlike a dataset's or a checkpoint's files
/// (`flashover_checkpoint::write_atomic`) it is not fsynced: a shard a crash lost is fetched
/// again, and one that survived is verified again on its first use after a restart, so the
/// fetch path does not wait for the disk.
fn cache_write(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!(
        "{}.partial-{}",
        path.extension().and_then(|e| e.to_str()).unwrap_or(""),
        std::process::id()
    ));
    std::fs::write(&tmp, data).map_err(|e| StreamingError::io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        StreamingError::io("rename", path, e)
    })
}

/// Counts the shards a previous process left in the cache folder (they are checked again on
/// first use) and removes its unfinished temporary files.
fn scan_cache(dir: &Path, index: &IndexFile, state: &mut CacheState) -> Result<()> {
    let by_name: HashMap<String, usize> = index
        .shards
        .iter()
        .enumerate()
        .map(|(i, s)| (s.raw_data.basename.replace('/', "__"), i))
        .collect();
    let entries = std::fs::read_dir(dir).map_err(|e| StreamingError::io("read", dir, e))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.contains(".partial-") {
            let _ = std::fs::remove_file(e.path());
            continue;
        }
        if let (Some(&id), Ok(meta)) = (by_name.get(&name), e.metadata()) {
            state.entries.insert(id, (meta.len(), 0));
            state.used += meta.len();
        }
    }
    Ok(())
}

/// How a fetch is asked for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    /// A read is waiting: evict the next block's shards too if needed.
    Now,
    /// Download-ahead: only if there is room without touching either block.
    Ahead,
}

impl Inner {
    fn entry(&self, id: usize) -> &ShardEntry {
        &self.index.shards[id]
    }

    fn cached_path(&self, id: usize) -> PathBuf {
        let name = &self.entry(id).raw_data.basename;
        self.cache_dir.join(name.replace('/', "__"))
    }

    /// Where shard `id`'s raw file is read from, and whether it goes through the cache.
    fn in_place(&self, id: usize) -> Option<PathBuf> {
        match (self.storage.local(), &self.entry(id).zip_data) {
            (Some(dir), None) => Some(dir.join(&self.entry(id).raw_data.basename)),
            _ => None,
        }
    }

    /// A batch reads positions `first..=last` of `epoch`: the blocks they fall in are read
    /// now, the block after them next.
    ///
    /// A padded rank's last batch wraps around to the epoch's start (positions ascend, then
    /// restart at 0), so `last < first` reads the blocks from `first`'s to the epoch's end and
    /// from the start to `last`'s, never everything between.
    fn report(&self, epoch: u64, first: u64, last: u64) {
        let size = self.order.block_size();
        let end_block = self.order.total().saturating_sub(1) / size;
        let blocks: Vec<u64> = if first <= last {
            (first / size..=last / size).collect()
        } else {
            (first / size..=end_block).chain(0..=last / size).collect()
        };
        let must: Vec<usize> = blocks
            .iter()
            .flat_map(|&k| self.order.block_shards(epoch, k))
            .collect();
        self.set_window(
            epoch,
            first,
            must,
            self.order.block_shards(epoch, last / size + 1),
        );
    }

    /// The same for an unshuffled order (evaluation): the shards of the batch's positions,
    /// and the shard after them.
    fn report_unshuffled(&self, first: u64, last: u64) {
        let end = self.order.total().saturating_sub(1);
        let (a, _) = self.order.shard_of(first.min(end));
        let (z, _) = self.order.shard_of(last.min(end));
        let n = self.index.shards.len();
        let must: Vec<usize> = if a <= z {
            (a..=z).collect()
        } else {
            (a..n).chain(0..=z).collect()
        };
        self.set_window(u64::MAX, first, must, ((z + 1)..n.min(z + 2)).collect());
    }

    fn set_window(&self, epoch: u64, position: u64, must: Vec<usize>, next: Vec<usize>) {
        let mut s = lock(&self.state);
        let mut wanted = must.clone();
        wanted.extend(next.iter().filter(|k| !must.contains(k)));
        s.wanted = wanted;
        s.must = must.into_iter().collect();
        s.next = next.into_iter().filter(|k| !s.must.contains(k)).collect();
        // Readers outside the window are closed (a read in flight keeps its own handle).
        let keep: HashSet<usize> = s.must.union(&s.next).copied().collect();
        s.open.retain(|k, _| keep.contains(k));
        if s.progress != Some((epoch, position)) {
            s.progress = Some((epoch, position));
            s.moved = true;
        }
        drop(s);
        self.changed.notify_all();
    }

    /// The download-ahead thread: fetches the window's shards in reading order while there is
    /// room.
    fn download_ahead(&self) {
        loop {
            let wanted = {
                let mut s = lock(&self.state);
                while !s.stop && !s.moved {
                    s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                }
                if s.stop {
                    return;
                }
                s.moved = false;
                s.wanted.clone()
            };
            // `download_threads` fetches in flight, in reading order, until the window is
            // fetched or the cache has no room; a window that moved meanwhile is taken up by
            // the next round (fetches for the old one never evict the new one's shards).
            let queue = Mutex::new(wanted.into_iter());
            let full = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|scope| {
                for _ in 0..self.options.download_threads.max(1) {
                    scope.spawn(|| loop {
                        if full.load(std::sync::atomic::Ordering::Relaxed) || lock(&self.state).stop
                        {
                            return;
                        }
                        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                        let Some(id) = next else {
                            return;
                        };
                        // A failure here is left for the read, which retries and reports it.
                        if let Ok(false) = self.ensure(id, Need::Ahead) {
                            full.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                    });
                }
            });
        }
    }

    /// Makes shard `id` readable: verified in place, or fetched into the cache. `Ok(false)`:
    /// an `Ahead` fetch found no room.
    fn ensure(&self, id: usize, need: Need) -> Result<bool> {
        if let Some(path) = self.in_place(id) {
            if lock(&self.state).verified.contains(&id) {
                return Ok(true);
            }
            let data = std::fs::read(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => StreamingError::Download {
                    shard: path.display().to_string(),
                    attempts: 1,
                    reason: "the file is missing".into(),
                },
                _ => StreamingError::io("read", &path, e),
            })?;
            let raw = &self.entry(id).raw_data;
            codec::verify(&data, Some(raw.bytes), &raw.hashes).map_err(|reason| {
                StreamingError::Damaged {
                    shard: path.display().to_string(),
                    reason,
                }
            })?;
            lock(&self.state).verified.insert(id);
            return Ok(true);
        }
        let size = self.entry(id).raw_data.bytes;
        {
            let mut s = lock(&self.state);
            loop {
                if s.fetching.contains(&id) {
                    if need == Need::Ahead {
                        return Ok(true);
                    }
                    s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                if let Some(e) = s.entries.get(&id).copied() {
                    s.clock += 1;
                    let now = s.clock;
                    s.entries.insert(id, (e.0, now));
                    if s.verified.contains(&id) {
                        return Ok(true);
                    }
                    // Left by an earlier process: check it once, marked as under way so that
                    // no other thread evicts, fetches or checks it meanwhile.
                    s.fetching.insert(id);
                    drop(s);
                    let good = self.check_cached(id);
                    s = lock(&self.state);
                    s.fetching.remove(&id);
                    if good {
                        s.verified.insert(id);
                    } else {
                        if let Some((b, _)) = s.entries.remove(&id) {
                            s.used -= b;
                        }
                        let _ = std::fs::remove_file(self.cached_path(id));
                    }
                    self.changed.notify_all();
                    if good {
                        return Ok(true);
                    }
                    continue;
                }
                if !self.make_room(&mut s, id, size, need)? {
                    return Ok(false);
                }
                s.fetching.insert(id);
                // Room is reserved now so that two fetches never overrun the limit.
                s.used += size;
                break;
            }
        }
        let fetched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.fetch(id)))
            .unwrap_or_else(|_| {
                Err(StreamingError::Damaged {
                    shard: self.storage.describe(&self.entry(id).raw_data.basename),
                    reason: "decoding the fetched shard panicked".into(),
                })
            });
        let mut s = lock(&self.state);
        s.fetching.remove(&id);
        match fetched {
            Ok(n) => {
                s.clock += 1;
                let now = s.clock;
                s.entries.insert(id, (size, now));
                s.verified.insert(id);
                s.fetched_bytes += n;
                drop(s);
                self.changed.notify_all();
                Ok(true)
            }
            Err(e) => {
                s.used -= size;
                drop(s);
                self.changed.notify_all();
                Err(e)
            }
        }
    }

    /// Evicts least-recently-used shards until `size` more bytes fit. Never evicts the
    /// current block's shards; an `Ahead` fetch does not evict the next block's either.
    fn make_room(&self, s: &mut CacheState, id: usize, size: u64, need: Need) -> Result<bool> {
        let Some(limit) = self.options.cache_limit else {
            return Ok(true);
        };
        let too_big = |reason: String| StreamingError::Cache {
            folder: self.cache_dir.display().to_string(),
            reason,
        };
        if size > limit {
            return Err(too_big(format!(
                "shard {} has {size} bytes, more than the cache limit of {limit} bytes: raise the limit (--cache-limit)",
                self.entry(id).raw_data.basename
            )));
        }
        while s.used + size > limit {
            let victim = s
                .entries
                .iter()
                .filter(|(k, _)| !s.must.contains(k) && !s.fetching.contains(k))
                .filter(|(k, _)| need == Need::Now || !s.next.contains(k))
                .min_by_key(|(k, (_, t))| (s.next.contains(k), *t))
                .map(|(k, _)| *k);
            let Some(k) = victim else {
                if need == Need::Ahead {
                    return Ok(false);
                }
                let held: u64 = s.must.iter().map(|&k| self.entry(k).raw_data.bytes).sum();
                return Err(too_big(format!(
                    "the cache limit of {limit} bytes cannot hold the {} shards the current batch's shuffle blocks read ({held} bytes) plus shard {} ({size} bytes): raise --cache-limit (to hold two blocks' shards) or lower --shuffle-block-size",
                    s.must.len(),
                    self.entry(id).raw_data.basename
                )));
            };
            if let Some((b, _)) = s.entries.remove(&k) {
                s.used -= b;
            }
            s.open.remove(&k);
            s.verified.remove(&k);
            let _ = std::fs::remove_file(self.cached_path(k));
        }
        Ok(true)
    }

    fn check_cached(&self, id: usize) -> bool {
        let raw = &self.entry(id).raw_data;
        std::fs::read(self.cached_path(id))
            .map(|d| codec::verify(&d, Some(raw.bytes), &raw.hashes).is_ok())
            .unwrap_or(false)
    }

    /// Fetches shard `id` into the cache with retries; returns the bytes transferred.
    fn fetch(&self, id: usize) -> Result<u64> {
        let entry = self.entry(id);
        let (file, compressed): (&FileInfo, bool) = match &entry.zip_data {
            Some(z) => (z, true),
            None => (&entry.raw_data, false),
        };
        let where_ = self.storage.describe(&file.basename);
        let attempts = self.options.download_retries + 1;
        let mut last = String::new();
        let mut damaged = false;
        for attempt in 1..=attempts {
            if attempt > 1 {
                lock(&self.state).retried += 1;
                let wait = (self.options.download_backoff * 2u32.saturating_pow(attempt - 2))
                    .min(Duration::from_secs(30));
                tracing::warn!(shard = %where_, attempt, reason = %last, "retrying a shard fetch in {wait:?}");
                std::thread::sleep(wait);
            }
            let data = match self.storage.get(&file.basename) {
                Ok(Some(d)) => d,
                Ok(None) => {
                    last = "not found".into();
                    damaged = false;
                    continue;
                }
                Err(e) => {
                    last = e;
                    damaged = false;
                    continue;
                }
            };
            let n = data.len() as u64;
            let raw = match codec::verify(&data, Some(file.bytes), &file.hashes) {
                Err(e) => Err(e),
                Ok(()) if compressed => {
                    codec::decompress(entry.compression.as_deref().unwrap_or(""), &data).and_then(
                        |raw| {
                            codec::verify(&raw, Some(entry.raw_data.bytes), &entry.raw_data.hashes)
                                .map(|()| raw)
                                .map_err(|e| format!("decompressed: {e}"))
                        },
                    )
                }
                Ok(()) => Ok(data),
            };
            match raw {
                Ok(raw) => {
                    cache_write(&self.cached_path(id), &raw)?;
                    return Ok(n);
                }
                Err(e) => {
                    last = e;
                    damaged = true;
                }
            }
        }
        if damaged {
            Err(StreamingError::Damaged {
                shard: where_,
                reason: format!("{last} (fetched {attempts} times)"),
            })
        } else {
            Err(StreamingError::Download {
                shard: where_,
                attempts,
                reason: last,
            })
        }
    }

    fn reader(&self, id: usize) -> Result<Arc<Reader>> {
        if let Some(r) = lock(&self.state).open.get(&id) {
            return Ok(Arc::clone(r));
        }
        self.ensure(id, Need::Now)?;
        let entry = self.entry(id);
        let path = self.in_place(id).unwrap_or_else(|| self.cached_path(id));
        let reader = Arc::new(match entry.format.as_str() {
            "parquet" => Reader::Rows(parquet_shard::read_rows(&path, entry)?),
            _ => Reader::Mds(MdsShard::open(&path, entry)?),
        });
        let mut s = lock(&self.state);
        s.clock += 1;
        let now = s.clock;
        if let Some(e) = s.entries.get_mut(&id) {
            e.1 = now;
        }
        s.open.insert(id, Arc::clone(&reader));
        Ok(reader)
    }

    fn read(&self, id: usize) -> Result<Sample> {
        if id as u64 >= self.order.total() {
            return Err(StreamingError::config(
                "sample",
                id,
                format!(
                    "an index below the dataset's {} samples",
                    self.order.total()
                ),
            ));
        }
        let (shard, within) = self.order.shard_of(id as u64);
        let reader = self.reader(shard)?;
        match reader.as_ref() {
            Reader::Mds(m) => m.sample(within as usize),
            Reader::Rows(rows) => {
                rows.get(within as usize)
                    .cloned()
                    .ok_or_else(|| StreamingError::Decode {
                        shard: self.entry(shard).raw_data.basename.clone(),
                        sample: within as usize,
                        reason: format!("the file has {} rows", rows.len()),
                    })
            }
        }
    }
}

/// A summary of a dataset's shards for logs: formats, columns and compression.
pub fn describe_index(index: &IndexFile) -> String {
    let mut formats: BTreeMap<String, usize> = BTreeMap::new();
    for s in &index.shards {
        let key = format!(
            "{}{}",
            s.format,
            s.compression
                .as_deref()
                .map(|c| format!(" ({c})"))
                .unwrap_or_default()
        );
        *formats.entry(key).or_default() += 1;
    }
    let samples: u64 = index.shards.iter().map(|s| s.samples).sum();
    let parts: Vec<String> = formats.iter().map(|(k, n)| format!("{n} {k}")).collect();
    format!(
        "{samples} samples in {} shards: {}",
        index.shards.len(),
        parts.join(", ")
    )
}
