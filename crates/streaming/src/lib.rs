//! Datasets larger than memory: shards in MosaicML Streaming's MDS format or in Parquet, read
//! from a local folder or an object store (`s3://...`, the `s3` feature), through a bounded
//! local cache with download ahead, in a seeded `py1b` shuffle that any rank computes for any
//! batch, so that a run resumes mid-epoch (also on another number of ranks) without reading
//! the samples before its position.
//!
//! ```no_run
//! # use std::sync::Arc;
//! use flashover_streaming::{StreamingDataset, StreamingOptions};
//! let options = StreamingOptions { cache_limit: Some(1 << 30), seed: 42, ..Default::default() };
//! let data = Arc::new(StreamingDataset::open("s3://bucket/mnist-mds", options)?);
//! let order = data.order(64)?.sharded(0, 1)?;
//! let first = data.get(0)?;
//! # Ok::<(), flashover_streaming::StreamingError>(())
//! ```
//!
//! The parts: [`mds`] (the format, and a writer), [`parquet_shard`] (Parquet files as shards),
//! [`codec`] (Streaming's compressions and hashes), [`storage`] (folder or object store),
//! [`order`] (`py1b`), [`dataset`] (cache, download ahead, readers, the loader).

pub mod codec;
pub mod dataset;
pub mod error;
pub mod mds;
pub mod order;
pub mod parquet_shard;
pub mod storage;
pub mod value;

pub use dataset::{
    default_cache_dir, describe_index, CacheStats, StreamingDataset, StreamingOptions,
};
pub use error::{Result, StreamingError};
pub use mds::{IndexFile, MdsWriter, ShardEntry, WriteValue};
pub use order::{ShardOrder, DEFAULT_BLOCK_SIZE};
pub use parquet_shard::write_parquet_index;
pub use value::{DType, Image, NdArray, Sample, Value};
