//! Writes the bundled datasets as shards, so that training from shards can be tried at once
//! (`cargo xtask shards ...` runs this program):
//!
//! - `mnist <out>`: the bundled digits as two MDS datasets, `<out>/train` and `<out>/test`,
//!   with columns `id` (the digit's index in its IDX file), `x` (`ndarray:uint8:28,28`) and
//!   `y` (`int`), as mosaicml-streaming's `MDSWriter` lays them out; train with
//!   `cargo run --release --example mnist -- --data <out>` (or upload `<out>` to a bucket and
//!   pass `--data s3://bucket/prefix`).
//! - `shakespeare <out>`: the bundled plays as one MDS dataset, one sample per work
//!   (`title`, `text`).
//! - `index <folder>`: writes `index.json` for a folder of `.parquet` files (rows, size and
//!   sha1 of each), which a Parquet dataset in an object store needs.
//!
//! Prints one JSON line: what was written.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use flashover::core::data::{Dataset, MnistDataset, MnistSplit};
use flashover::streaming::{write_parquet_index, MdsWriter, WriteValue};
use flashover_examples::shakespeare::{bundled_shakespeare, read_text, works};
use flashover_examples::{bundled_mnist_dir, cli};

#[derive(Debug, Parser)]
#[command(about = "Write the bundled datasets as shards (MDS), or index a Parquet folder")]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// The bundled MNIST digits: <out>/train and <out>/test.
    Mnist {
        /// The output folder (it must not hold a dataset already).
        out: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
        /// Only the first N training digits (for quick runs and tests).
        #[arg(long)]
        train_limit: Option<usize>,
        /// Only the first N test digits.
        #[arg(long)]
        test_limit: Option<usize>,
        /// Write the training digits N times over (ids stay unique): a dataset many times
        /// the cache, for the memory measurement.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
        repeat: u64,
    },
    /// The bundled Shakespeare plays, one sample per work.
    Shakespeare {
        /// The output folder.
        out: PathBuf,
        #[command(flatten)]
        shards: ShardArgs,
    },
    /// Write index.json for a folder of .parquet files.
    Index {
        /// The folder.
        folder: PathBuf,
    },
    /// Read every training digit of an epoch in training order and decode it, timed: from
    /// MNIST shards (`--data`), or without it from the bundled IDX files in memory (the
    /// bench's `streaming.samples_per_second_read`).
    Read {
        #[command(flatten)]
        stream: cli::StreamArgs,
        /// The epoch to read (each epoch's order differs).
        #[arg(long, default_value_t = 0)]
        epoch: u64,
    },
}

#[derive(Debug, clap::Args)]
struct ShardArgs {
    /// The largest shard, such as 1MB or 64MiB (MDSWriter's `size_limit`).
    #[arg(long, default_value = "1MB", value_parser = cli::parse_bytes)]
    size_limit: u64,
    /// `zstd:<level>` (1-22) to compress each shard, or `none`.
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    compression: Compression,
}

/// A zstd level, or none.
#[derive(Debug, Clone, Copy)]
struct Compression(Option<i32>);

fn parse_compression(text: &str) -> Result<Compression, String> {
    if text == "none" {
        return Ok(Compression(None));
    }
    let level = text
        .strip_prefix("zstd:")
        .and_then(|l| l.parse::<i32>().ok())
        .filter(|l| (1..=22).contains(l));
    match level {
        Some(l) => Ok(Compression(Some(l))),
        None => Err(format!(
            "expected none or zstd:<level> with a level from 1 to 22, not {text:?}"
        )),
    }
}

fn mnist(
    out: &std::path::Path,
    shards: &ShardArgs,
    limits: [Option<usize>; 2],
    repeat: u64,
) -> anyhow::Result<serde_json::Value> {
    let mut written = serde_json::Map::new();
    for ((split, name), limit) in [(MnistSplit::Train, "train"), (MnistSplit::Test, "test")]
        .into_iter()
        .zip(limits)
    {
        let mut data = MnistDataset::from_dir(&bundled_mnist_dir(), split)?;
        if let Some(n) = limit {
            data.truncate(n);
        }
        let mut w = MdsWriter::new(
            &out.join(name),
            &[("id", "int"), ("x", "ndarray:uint8:28,28"), ("y", "int")],
            shards.size_limit,
            shards.compression.0,
        )?;
        let times = if name == "train" { repeat as usize } else { 1 };
        for i in 0..data.len() * times {
            let k = i % data.len();
            let item = data
                .get(k)
                .ok_or_else(|| anyhow::anyhow!("the bundled {name} digits end at {k}"))?;
            w.write(&[
                WriteValue::Int(i as i64),
                WriteValue::Bytes(&item.pixels),
                WriteValue::Int(item.label as i64),
            ])?;
        }
        let index = w.finish()?;
        written.insert(
            name.into(),
            serde_json::json!({"samples": data.len() * times, "shards": index.shards.len()}),
        );
    }
    Ok(serde_json::Value::Object(written))
}

fn shakespeare(out: &std::path::Path, shards: &ShardArgs) -> anyhow::Result<serde_json::Value> {
    let text = read_text(&bundled_shakespeare())?;
    let mut w = MdsWriter::new(
        out,
        &[("text", "str"), ("title", "str")],
        shards.size_limit,
        shards.compression.0,
    )?;
    let all = works(&text);
    for work in &all {
        let body = String::from_utf8_lossy(&text[work.range.clone()]);
        w.write(&[WriteValue::Str(&body), WriteValue::Str(&work.title)])?;
    }
    let index = w.finish()?;
    Ok(serde_json::json!({"samples": all.len(), "shards": index.shards.len()}))
}

/// Reads the training split's epoch `epoch` in training order, decoding each digit; returns
/// the samples and the seconds (opening included, so a cold cache counts its downloads).
fn read(stream: &cli::StreamArgs, epoch: u64) -> anyhow::Result<serde_json::Value> {
    use flashover::core::data::BatchOrder;
    let start = std::time::Instant::now();
    let mut checksum = 0u64;
    let mut n = 0usize;
    let source = match &stream.data {
        Some(location) => {
            let mut options = stream.options();
            options.seed = 1;
            let data = flashover::streaming::StreamingDataset::open(
                &format!("{}/train", location.trim_end_matches('/')),
                options,
            )?;
            let order = data.order(32)?;
            for b in 0..order.num_batches() {
                for id in order.batch_indices(epoch, b).unwrap_or_default() {
                    let item = flashover_examples::mnist_item_from_sample(data.get(id)?)
                        .map_err(|e| anyhow::anyhow!(e))?;
                    checksum = checksum.wrapping_add(item.label as u64 + item.pixels[400] as u64);
                    n += 1;
                }
            }
            "shards"
        }
        None => {
            let data = MnistDataset::from_dir(&bundled_mnist_dir(), MnistSplit::Train)?;
            let order = flashover::core::data::Sampler::new(data.len(), 32, true, 1)?;
            for b in 0..order.num_batches() {
                for id in order.batch_indices(epoch, b).unwrap_or_default() {
                    let item = data
                        .get(id)
                        .ok_or_else(|| anyhow::anyhow!("no digit {id}"))?;
                    checksum = checksum.wrapping_add(item.label as u64 + item.pixels[400] as u64);
                    n += 1;
                }
            }
            "memory"
        }
    };
    let seconds = start.elapsed().as_secs_f64();
    Ok(serde_json::json!({
        "source": source,
        "samples": n,
        "seconds": seconds,
        "samples_per_second": n as f64 / seconds,
        "checksum": checksum,
        "peak_rss_bytes": flashover::callbacks::monitors::process_memory().map(|(_, peak)| peak),
    }))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let summary = match &args.what {
        What::Mnist {
            out,
            shards,
            train_limit,
            test_limit,
            repeat,
        } => mnist(out, shards, [*train_limit, *test_limit], *repeat)?,
        What::Shakespeare { out, shards } => shakespeare(out, shards)?,
        What::Index { folder } => {
            let index = write_parquet_index(folder)?;
            serde_json::json!({"files": index.shards.len(), "rows": index.shards.iter().map(|s| s.samples).sum::<u64>()})
        }
        What::Read { stream, epoch } => read(stream, *epoch)?,
    };
    println!("{summary}");
    Ok(())
}
