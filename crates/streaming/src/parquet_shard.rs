//! Parquet datasets: each `.parquet` file is a shard and each row a sample, read through the
//! Apache Arrow project's `parquet` crate (its row reader; the codecs pyarrow writes by
//! default, snappy, and gzip and zstd, are compiled in).
//!
//! A folder of `.parquet` files needs no index: their footers give the row counts (files in
//! name order). A dataset in an object store needs an `index.json` (Streaming's layout, one
//! entry per file with `"format": "parquet"`), written by [`write_parquet_index`] next to the
//! files before they are uploaded, so that opening the dataset does not read every footer
//! over the network; the index also records each file's size and sha1, which every fetch
//! checks.
//!
//! A shard is decoded whole when it is opened (its rows stay in memory while it is in the
//! read window), since Parquet's column chunks cannot be read one row at a time cheaply.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;

use crate::codec;
use crate::error::{Result, StreamingError};
use crate::mds::{FileInfo, IndexFile, ShardEntry};
use crate::storage::Storage;
use crate::value::{Sample, Value};

fn is_parquet(name: &str) -> bool {
    name.ends_with(".parquet") && !name.contains('/')
}

fn entry(name: &str, bytes: u64, rows: u64, hashes: BTreeMap<String, String>) -> ShardEntry {
    ShardEntry {
        format: "parquet".into(),
        samples: rows,
        raw_data: FileInfo {
            basename: name.to_string(),
            bytes,
            hashes,
        },
        zip_data: None,
        compression: None,
        hashes: Vec::new(),
        column_names: Vec::new(),
        column_encodings: Vec::new(),
        column_sizes: Vec::new(),
        size_limit: None,
        version: Some(2),
    }
}

fn rows_in(path: &Path) -> std::result::Result<u64, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let reader = SerializedFileReader::new(file).map_err(|e| e.to_string())?;
    Ok(reader.metadata().file_metadata().num_rows().max(0) as u64)
}

/// The index of a location without `index.json`: a local folder of `.parquet` files.
pub(crate) fn index_folder(storage: &Storage) -> Result<IndexFile> {
    let location = storage.describe("index.json");
    let missing = |reason: String| StreamingError::Index {
        location: location.clone(),
        reason,
    };
    let Some(dir) = storage.local() else {
        return Err(missing(
            "not found: a dataset in an object store needs its index.json (for Parquet files, write it with `cargo xtask shards index <folder>` before uploading)".into(),
        ));
    };
    let files = storage.list().map_err(&missing)?;
    let mut shards = Vec::new();
    for (name, bytes) in files.into_iter().filter(|(n, _)| is_parquet(n)) {
        let rows = rows_in(&dir.join(&name)).map_err(|e| StreamingError::Damaged {
            shard: dir.join(&name).display().to_string(),
            reason: format!("not a readable Parquet file: {e}"),
        })?;
        shards.push(entry(&name, bytes, rows, BTreeMap::new()));
    }
    if shards.is_empty() {
        return Err(missing(
            "not found, and the folder has no .parquet file (expected an MDS dataset's index.json or Parquet files)".into(),
        ));
    }
    Ok(IndexFile { version: 2, shards })
}

/// Writes `index.json` for the `.parquet` files of `folder` (rows, size and sha1 of each), so
/// that the folder can be read from an object store. Returns the index.
pub fn write_parquet_index(folder: &Path) -> Result<IndexFile> {
    let storage = Storage::Local(folder.to_path_buf());
    if folder.join("index.json").exists() {
        return Err(StreamingError::config(
            "folder",
            folder.display(),
            "a folder of .parquet files without an index.json",
        ));
    }
    let mut index = index_folder(&storage)?;
    for s in &mut index.shards {
        let path = folder.join(&s.raw_data.basename);
        let data = std::fs::read(&path).map_err(|e| StreamingError::io("read", &path, e))?;
        if let Some(h) = codec::digest("sha1", &data) {
            s.raw_data.hashes.insert("sha1".into(), h);
        }
    }
    let text = serde_json::to_vec_pretty(&index).map_err(|e| StreamingError::Index {
        location: folder.display().to_string(),
        reason: e.to_string(),
    })?;
    crate::mds::write_atomic(&folder.join("index.json"), &text)?;
    Ok(index)
}

fn value(field: &Field) -> Value {
    match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(v) => Value::Int(*v as i64),
        Field::Short(v) => Value::Int(*v as i64),
        Field::Int(v) => Value::Int(*v as i64),
        Field::Long(v) => Value::Int(*v),
        Field::UByte(v) => Value::UInt(*v as u64),
        Field::UShort(v) => Value::UInt(*v as u64),
        Field::UInt(v) => Value::UInt(*v as u64),
        Field::ULong(v) => Value::UInt(*v),
        Field::Float16(v) => Value::Float(v.to_f32() as f64),
        Field::Float(v) => Value::Float(*v as f64),
        Field::Double(v) => Value::Float(*v),
        Field::Str(s) => Value::Str(s.clone()),
        Field::Bytes(b) => Value::Bytes(b.data().to_vec()),
        Field::Decimal(d) => Value::Bytes(d.data().to_vec()),
        Field::Date(d) => Value::Int(*d as i64),
        Field::TimeMillis(t) => Value::Int(*t as i64),
        Field::TimeMicros(t) => Value::Int(*t),
        Field::TimestampMillis(t) => Value::Int(*t),
        Field::TimestampMicros(t) => Value::Int(*t),
        Field::Group(row) => Value::Struct(sample(row)),
        Field::ListInternal(list) => Value::List(list.elements().iter().map(value).collect()),
        Field::MapInternal(map) => Value::Struct(Sample::new(
            map.entries()
                .iter()
                .map(|(k, v)| (k.to_string(), value(v)))
                .collect(),
        )),
    }
}

fn sample(row: &parquet::record::Row) -> Sample {
    Sample::new(
        row.get_column_iter()
            .map(|(name, f)| (name.clone(), value(f)))
            .collect(),
    )
}

/// Every row of the Parquet file at `path` (the shard `entry`).
pub(crate) fn read_rows(path: &Path, entry: &ShardEntry) -> Result<Vec<Sample>> {
    let damaged = |reason: String| StreamingError::Damaged {
        shard: entry.raw_data.basename.clone(),
        reason,
    };
    let file = File::open(path).map_err(|e| StreamingError::io("open", path, e))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| damaged(format!("not a readable Parquet file: {e}")))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| damaged(format!("cannot read rows: {e}")))?;
    let mut out = Vec::with_capacity(entry.samples as usize);
    for r in rows {
        let r = r.map_err(|e| damaged(format!("row {}: {e}", out.len())))?;
        out.push(sample(&r));
    }
    if out.len() as u64 != entry.samples {
        return Err(damaged(format!(
            "{} rows where the index says {}",
            out.len(),
            entry.samples
        )));
    }
    Ok(out)
}
