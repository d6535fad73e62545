//! The MDS format of `mosaicml-streaming`, read from its documentation and from files its
//! writer (`MDSWriter`) produces, and written the same way by [`MdsWriter`].
//!
//! A dataset is a folder with `index.json` (`{"version": 2, "shards": [...]}`) and shard
//! files. Each shard's entry gives its columns (`column_names`, `column_encodings`,
//! `column_sizes`: a size for a fixed-size encoding, `null` otherwise), its sample count, the
//! raw file (`raw_data`: basename, bytes, hashes) and, when compressed, the compressed file
//! (`zip_data`) and `compression`. A raw shard is:
//!
//! ```text
//! u32 num_samples | u32 offsets[num_samples + 1] | writer's JSON config | samples
//! ```
//!
//! little-endian, with each offset counted from the start of the file. A sample is the
//! `u32` sizes of its variable-size columns, in column order, then every column's bytes in
//! column order. The column encodings are Streaming's (`bytes`, `str`, `int`, `uint8` ...
//! `float64`, `str_int`, `str_float`, `str_decimal`, `ndarray[:dtype[:shape]]`, `pil`,
//! `jpeg`, `png`, `jpeg_array`, `list[pil|jpeg|png]`, `json`, `pkl`); `jpeg` and `png` come
//! back as the encoded file's bytes (decode them with the image crate of your choice), and
//! `pkl` is refused (unpickling runs code).
//!
//! Hand-written because there is no Rust reader of MDS: the format is small and fixed, and
//! the crate reads only the parts that make samples.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::codec;
use crate::error::{Result, StreamingError};
use crate::value::{DType, Image, NdArray, Sample, Value};

/// One file of a shard as the index describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    /// The file's name in the dataset's folder.
    pub basename: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Hex digests by algorithm name.
    #[serde(default)]
    pub hashes: BTreeMap<String, String>,
}

/// One shard's entry in `index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The format (`"mds"`; this crate also writes `"parquet"` entries for Parquet datasets).
    pub format: String,
    /// Samples in the shard.
    pub samples: u64,
    /// The raw (uncompressed) file.
    pub raw_data: FileInfo,
    /// The compressed file, if the shard is compressed.
    #[serde(default)]
    pub zip_data: Option<FileInfo>,
    /// The codec (`"zstd"`, `"zstd:7"`, ...), if compressed.
    #[serde(default)]
    pub compression: Option<String>,
    /// Hash algorithms the writer computed.
    #[serde(default)]
    pub hashes: Vec<String>,
    /// Column names (MDS).
    #[serde(default)]
    pub column_names: Vec<String>,
    /// Column encodings (MDS).
    #[serde(default)]
    pub column_encodings: Vec<String>,
    /// Column sizes (MDS): bytes for a fixed-size encoding, `None` otherwise.
    #[serde(default)]
    pub column_sizes: Vec<Option<u64>>,
    /// The writer's shard size limit.
    #[serde(default)]
    pub size_limit: Option<u64>,
    /// The entry's version (2).
    #[serde(default)]
    pub version: Option<u64>,
}

/// `index.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexFile {
    /// The index's version (2).
    pub version: u64,
    /// The shards, in sample order.
    pub shards: Vec<ShardEntry>,
}

impl IndexFile {
    /// Parses and checks an index read from `location`.
    pub fn parse(location: &str, text: &[u8]) -> Result<IndexFile> {
        let bad = |reason: String| StreamingError::Index {
            location: location.to_string(),
            reason,
        };
        let index: IndexFile =
            serde_json::from_slice(text).map_err(|e| bad(format!("not a Streaming index: {e}")))?;
        if index.version != 2 {
            return Err(bad(format!(
                "version {} (this reader knows version 2)",
                index.version
            )));
        }
        if index.shards.is_empty() {
            return Err(bad("lists no shard".into()));
        }
        for (i, s) in index.shards.iter().enumerate() {
            let name = &s.raw_data.basename;
            check_basename(name).map_err(|e| bad(format!("shard {i}: {e}")))?;
            if let Some(z) = &s.zip_data {
                check_basename(&z.basename).map_err(|e| bad(format!("shard {i}: {e}")))?;
                let c = s.compression.as_deref().unwrap_or("");
                if codec::codec_name(c).is_none() {
                    return Err(bad(format!(
                        "shard {name}: compression {c:?} is not one of {:?}",
                        codec::CODECS
                    )));
                }
            }
            match s.format.as_str() {
                "mds" => {
                    Columns::new(&s.column_names, &s.column_encodings, &s.column_sizes)
                        .map_err(|e| bad(format!("shard {name}: {e}")))?;
                }
                "parquet" => {}
                f => {
                    return Err(bad(format!(
                        "shard {name} has format {f:?}; this reader reads \"mds\" and \"parquet\""
                    )))
                }
            }
        }
        Ok(index)
    }
}

/// A shard's file name must stay inside the dataset's folder.
fn check_basename(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('\\')
        && !name.starts_with('/')
        && name.split('/').all(|p| !p.is_empty() && p != "..");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "file name {name:?} is not a relative path inside the dataset's folder"
        ))
    }
}

/// How one column is encoded.
#[derive(Debug, Clone, PartialEq)]
enum Encoding {
    Bytes,
    Str,
    /// `int`: int64.
    Int,
    Scalar(DType),
    StrInt,
    StrFloat,
    StrDecimal,
    NdArray {
        dtype: Option<DType>,
        shape: Option<Vec<usize>>,
    },
    Pil,
    /// `jpeg`, `png`: the encoded file.
    EncodedImage,
    /// `jpeg_array`: `u32 n | u32 sizes[n] | files`.
    JpegArray,
    /// `list[...]`: `u32 0 | u32 n | u32 sizes[n] | elements`.
    List(Box<Encoding>),
    Json,
    Pickle,
}

impl Encoding {
    fn parse(text: &str) -> std::result::Result<Encoding, String> {
        let (name, config) = match text.find(':') {
            Some(i) => (&text[..i], Some(&text[i + 1..])),
            None => (text, None),
        };
        let plain = |e: Encoding| match config {
            None => Ok(e),
            Some(c) => Err(format!("encoding {name:?} takes no settings (got {c:?})")),
        };
        match name {
            "bytes" => plain(Encoding::Bytes),
            "str" => plain(Encoding::Str),
            "int" => plain(Encoding::Int),
            "str_int" => plain(Encoding::StrInt),
            "str_float" => plain(Encoding::StrFloat),
            "str_decimal" => plain(Encoding::StrDecimal),
            "pil" => plain(Encoding::Pil),
            "jpeg" | "png" => plain(Encoding::EncodedImage),
            "jpeg_array" | "jpegarray" => plain(Encoding::JpegArray),
            "list[pil]" => plain(Encoding::List(Box::new(Encoding::Pil))),
            "list[jpeg]" | "list[png]" => plain(Encoding::List(Box::new(Encoding::EncodedImage))),
            "json" => plain(Encoding::Json),
            "pkl" => plain(Encoding::Pickle),
            "ndarray" => {
                let args: Vec<&str> = config.map(|c| c.split(':').collect()).unwrap_or_default();
                if args.len() > 2 {
                    return Err(format!(
                        "encoding {text:?}: expected ndarray[:dtype[:shape]]"
                    ));
                }
                let dtype = match args.first() {
                    Some(d) => Some(
                        DType::from_name(d)
                            .ok_or_else(|| format!("encoding {text:?}: unknown dtype {d:?}"))?,
                    ),
                    None => None,
                };
                let shape = match args.get(1) {
                    Some(s) => Some(
                        s.split(',')
                            .map(|d| d.trim().parse::<usize>().ok().filter(|&d| d >= 1))
                            .collect::<Option<Vec<usize>>>()
                            .ok_or_else(|| format!("encoding {text:?}: bad shape {s:?}"))?,
                    ),
                    None => None,
                };
                Ok(Encoding::NdArray { dtype, shape })
            }
            d => match DType::from_name(d) {
                Some(dt) => plain(Encoding::Scalar(dt)),
                None => Err(format!("unknown encoding {text:?}")),
            },
        }
    }

    /// The encoded size when it is fixed.
    fn fixed_size(&self) -> Option<usize> {
        match self {
            Encoding::Int => Some(8),
            Encoding::Scalar(d) => Some(d.size()),
            Encoding::NdArray {
                dtype: Some(d),
                shape: Some(s),
            } => Some(s.iter().product::<usize>() * d.size()),
            _ => None,
        }
    }

    fn decode(&self, data: &[u8]) -> std::result::Result<Value, String> {
        let utf8 = |d: &[u8]| {
            std::str::from_utf8(d)
                .map(str::to_string)
                .map_err(|e| format!("not UTF-8: {e}"))
        };
        Ok(match self {
            Encoding::Bytes | Encoding::EncodedImage => Value::Bytes(data.to_vec()),
            Encoding::Str => Value::Str(utf8(data)?),
            Encoding::StrDecimal => Value::Str(utf8(data)?),
            Encoding::StrInt => Value::Int(
                utf8(data)?
                    .trim()
                    .parse()
                    .map_err(|e| format!("not an integer: {e}"))?,
            ),
            Encoding::StrFloat => Value::Float(
                utf8(data)?
                    .trim()
                    .parse()
                    .map_err(|e| format!("not a float: {e}"))?,
            ),
            Encoding::Int => Value::Int(i64::from_le_bytes(fixed::<8>(data)?)),
            Encoding::Scalar(d) => scalar(*d, data)?,
            Encoding::Json => Value::Json(
                serde_json::from_slice(data).map_err(|e| format!("not JSON: {e}"))?,
            ),
            Encoding::Pickle => {
                return Err(
                    "encoding \"pkl\" is refused: unpickling runs code; re-encode the column as json, bytes or ndarray"
                        .into(),
                )
            }
            Encoding::Pil => {
                let h = data.get(..12).ok_or("PIL header cut short")?;
                let width = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
                let height = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
                let mode_len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
                let mode = data
                    .get(12..12 + mode_len)
                    .ok_or("PIL mode cut short")
                    .and_then(|m| std::str::from_utf8(m).map_err(|_| "PIL mode not UTF-8"))?;
                Value::Image(Image {
                    mode: mode.to_string(),
                    width,
                    height,
                    data: data[12 + mode_len..].to_vec(),
                })
            }
            Encoding::JpegArray => {
                let n = u32::from_le_bytes(fixed::<4>(data.get(..4).ok_or("cut short")?)?) as usize;
                Value::List(split_sized(data, 4, n, &Encoding::EncodedImage)?)
            }
            Encoding::List(inner) => {
                let n = u32::from_le_bytes(fixed::<4>(data.get(4..8).ok_or("cut short")?)?) as usize;
                Value::List(split_sized(data, 8, n, inner)?)
            }
            Encoding::NdArray { dtype, shape } => {
                let mut i = 0;
                let dtype = match dtype {
                    Some(d) => *d,
                    None => {
                        let code = *data.first().ok_or("cut short")?;
                        i += 1;
                        DType::from_code(code).ok_or(format!("unknown dtype code {code}"))?
                    }
                };
                let shape = match shape {
                    Some(s) => s.clone(),
                    None => {
                        let byte = *data.get(i).ok_or("cut short")?;
                        i += 1;
                        let ndim = (byte >> 2) as usize;
                        let width = 1usize << (byte & 3);
                        let mut shape = Vec::with_capacity(ndim);
                        for _ in 0..ndim {
                            let d = data.get(i..i + width).ok_or("shape cut short")?;
                            let mut b = [0u8; 8];
                            b[..width].copy_from_slice(d);
                            shape.push(u64::from_le_bytes(b) as usize);
                            i += width;
                        }
                        shape
                    }
                };
                let want = shape.iter().product::<usize>() * dtype.size();
                let values = &data[i.min(data.len())..];
                if values.len() != want {
                    return Err(format!(
                        "array of shape {shape:?} and dtype {} has {} bytes, not {want}",
                        dtype.name(),
                        values.len()
                    ));
                }
                Value::Array(NdArray {
                    dtype,
                    shape,
                    data: values.to_vec(),
                })
            }
        })
    }
}

fn fixed<const N: usize>(data: &[u8]) -> std::result::Result<[u8; N], String> {
    data.try_into()
        .map_err(|_| format!("{} bytes where {N} are expected", data.len()))
}

fn scalar(d: DType, data: &[u8]) -> std::result::Result<Value, String> {
    let a = NdArray {
        dtype: d,
        shape: vec![1],
        data: data.to_vec(),
    };
    if data.len() != d.size() {
        return Err(format!("{} bytes for a {}", data.len(), d.name()));
    }
    Ok(match d {
        DType::U8 => Value::UInt(data[0] as u64),
        DType::U16 => Value::UInt(u16::from_le_bytes(fixed(data)?) as u64),
        DType::U32 => Value::UInt(u32::from_le_bytes(fixed(data)?) as u64),
        DType::U64 => Value::UInt(u64::from_le_bytes(fixed(data)?)),
        DType::I8 => Value::Int(data[0] as i8 as i64),
        DType::I16 => Value::Int(i16::from_le_bytes(fixed(data)?) as i64),
        DType::I32 => Value::Int(i32::from_le_bytes(fixed(data)?) as i64),
        DType::I64 => Value::Int(i64::from_le_bytes(fixed(data)?)),
        DType::F16 | DType::F32 => Value::Float(a.to_f32()[0] as f64),
        DType::F64 => Value::Float(f64::from_le_bytes(fixed(data)?)),
    })
}

/// `n` elements after a `u32` size table at `at`.
fn split_sized(
    data: &[u8],
    at: usize,
    n: usize,
    inner: &Encoding,
) -> std::result::Result<Vec<Value>, String> {
    let table = data.get(at..at + 4 * n).ok_or("size table cut short")?;
    let mut i = at + 4 * n;
    let mut out = Vec::with_capacity(n);
    for c in table.chunks_exact(4) {
        let size = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize;
        let d = data.get(i..i + size).ok_or("element cut short")?;
        out.push(inner.decode(d)?);
        i += size;
    }
    Ok(out)
}

/// A shard's columns: names, encodings, and which are variable-size.
#[derive(Debug, Clone, PartialEq)]
pub struct Columns {
    names: Vec<String>,
    encodings: Vec<Encoding>,
    sizes: Vec<Option<usize>>,
}

impl Columns {
    /// Checks an index entry's columns.
    pub fn new(
        names: &[String],
        encodings: &[String],
        sizes: &[Option<u64>],
    ) -> std::result::Result<Columns, String> {
        if names.is_empty() || names.len() != encodings.len() || names.len() != sizes.len() {
            return Err(format!(
                "{} column names, {} encodings and {} sizes (they must match, at least one)",
                names.len(),
                encodings.len(),
                sizes.len()
            ));
        }
        let mut parsed = Vec::new();
        let mut fixed_sizes = Vec::new();
        for ((name, enc), size) in names.iter().zip(encodings).zip(sizes) {
            let e = Encoding::parse(enc).map_err(|e| format!("column {name:?}: {e}"))?;
            let own = e.fixed_size();
            if let (Some(s), Some(o)) = (size, own) {
                if *s as usize != o {
                    return Err(format!(
                        "column {name:?}: size {s} in the index, {o} for encoding {enc:?}"
                    ));
                }
            }
            fixed_sizes.push(size.map(|s| s as usize));
            parsed.push(e);
        }
        Ok(Columns {
            names: names.to_vec(),
            encodings: parsed,
            sizes: fixed_sizes,
        })
    }

    /// Decodes one sample's bytes.
    pub fn decode(&self, data: &[u8]) -> std::result::Result<Sample, String> {
        let var = self.sizes.iter().filter(|s| s.is_none()).count();
        let head = data
            .get(..4 * var)
            .ok_or_else(|| format!("{} bytes, too few for {var} column sizes", data.len()))?;
        let mut var_sizes = head
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize);
        let mut at = 4 * var;
        let mut out = Vec::with_capacity(self.names.len());
        for ((name, enc), size) in self.names.iter().zip(&self.encodings).zip(&self.sizes) {
            let n = match size {
                Some(n) => *n,
                None => var_sizes.next().unwrap_or(0),
            };
            let bytes = data.get(at..at + n).ok_or_else(|| {
                format!(
                    "column {name:?} runs past the sample's {} bytes",
                    data.len()
                )
            })?;
            let v = enc
                .decode(bytes)
                .map_err(|e| format!("column {name:?}: {e}"))?;
            out.push((name.clone(), v));
            at += n;
        }
        if at != data.len() {
            return Err(format!(
                "the columns take {at} of the sample's {} bytes",
                data.len()
            ));
        }
        Ok(Sample::new(out))
    }
}

/// An open raw MDS shard: its sample offsets in memory, samples read from the file on
/// demand (one positioned read each), so an open shard costs `4 (n + 1)` bytes.
#[derive(Debug)]
pub struct MdsShard {
    name: String,
    file: File,
    offsets: Vec<u64>,
    columns: Columns,
}

fn read_at(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, at)
}

impl MdsShard {
    /// Opens the raw shard at `path` described by `entry`, checking its header against the
    /// index (sample count, offsets inside the file).
    pub fn open(path: &Path, entry: &ShardEntry) -> Result<MdsShard> {
        let name = entry.raw_data.basename.clone();
        let damaged = |reason: String| StreamingError::Damaged {
            shard: name.clone(),
            reason,
        };
        let columns = Columns::new(
            &entry.column_names,
            &entry.column_encodings,
            &entry.column_sizes,
        )
        .map_err(damaged)?;
        let file = File::open(path).map_err(|e| StreamingError::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| StreamingError::io("read", path, e))?
            .len();
        let mut n = [0u8; 4];
        read_at(&file, &mut n, 0).map_err(|_| damaged(format!("{len} bytes: no header")))?;
        let n = u32::from_le_bytes(n) as u64;
        if n != entry.samples {
            return Err(damaged(format!(
                "the header says {n} samples, the index {}",
                entry.samples
            )));
        }
        let mut table = vec![0u8; 4 * (n as usize + 1)];
        read_at(&file, &mut table, 4).map_err(|_| damaged("offsets cut short".into()))?;
        let offsets: Vec<u64> = table
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64)
            .collect();
        let first_ok = offsets
            .first()
            .is_some_and(|&o| o >= 4 + table.len() as u64);
        if !first_ok
            || offsets.windows(2).any(|w| w[1] < w[0])
            || offsets.last().copied() != Some(len)
        {
            return Err(damaged(format!(
                "offsets do not cover the file's {len} bytes in order"
            )));
        }
        Ok(MdsShard {
            name,
            file,
            offsets,
            columns,
        })
    }

    /// Samples in the shard.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Whether the shard has no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `i` of the shard.
    pub fn sample(&self, i: usize) -> Result<Sample> {
        let decode = |reason: String| StreamingError::Decode {
            shard: self.name.clone(),
            sample: i,
            reason,
        };
        if i >= self.len() {
            return Err(decode(format!("the shard has {} samples", self.len())));
        }
        let (a, b) = (self.offsets[i], self.offsets[i + 1]);
        let mut buf = vec![0u8; (b - a) as usize];
        read_at(&self.file, &mut buf, a).map_err(|e| decode(format!("read: {e}")))?;
        self.columns.decode(&buf).map_err(decode)
    }
}

/// A column value to write.
#[derive(Debug, Clone)]
pub enum WriteValue<'a> {
    /// For `bytes`, and for an `ndarray` of fixed dtype and shape (its raw elements).
    Bytes(&'a [u8]),
    /// For `str`.
    Str(&'a str),
    /// For `int`, `int8`...`int64`, `uint8`...`uint64`.
    Int(i64),
    /// For `float32`, `float64`.
    Float(f64),
}

/// Writes a dataset in MDS, as `mosaicml-streaming`'s `MDSWriter` lays it out (columns
/// sorted by name, shards cut at `size_limit`, the writer's config in each shard, sha1 and
/// xxh64 hashes of each file, optional zstd compression), so that Streaming reads what it
/// writes. It writes the encodings the converter needs: `bytes`, `str`, `int`, the integer
/// and float scalars, and `ndarray` with fixed dtype and shape.
#[derive(Debug)]
pub struct MdsWriter {
    folder: std::path::PathBuf,
    names: Vec<String>,
    encodings: Vec<String>,
    parsed: Vec<Encoding>,
    sizes: Vec<Option<u64>>,
    size_limit: u64,
    compression: Option<i32>,
    samples: Vec<Vec<u8>>,
    pending: u64,
    shards: Vec<ShardEntry>,
}

const WRITER_HASHES: [&str; 2] = ["sha1", "xxh64"];

impl MdsWriter {
    /// A writer into `folder` (created; it must not hold an `index.json`) of samples with
    /// `columns` (name, encoding), shards of at most `size_limit` bytes, compressed with zstd
    /// at `zstd_level` if given.
    pub fn new(
        folder: &Path,
        columns: &[(&str, &str)],
        size_limit: u64,
        zstd_level: Option<i32>,
    ) -> Result<MdsWriter> {
        if !(1024..(1u64 << 32)).contains(&size_limit) {
            return Err(StreamingError::config(
                "size_limit",
                size_limit,
                "1024 to 2^32 - 1 bytes",
            ));
        }
        if folder.join("index.json").exists() {
            return Err(StreamingError::config(
                "output folder",
                folder.display(),
                "a folder without an index.json (a dataset is never overwritten)",
            ));
        }
        std::fs::create_dir_all(folder).map_err(|e| StreamingError::io("create", folder, e))?;
        let mut sorted = columns.to_vec();
        sorted.sort();
        let mut names = Vec::new();
        let mut encodings = Vec::new();
        let mut parsed = Vec::new();
        let mut sizes = Vec::new();
        for (n, e) in sorted {
            let enc = Encoding::parse(e).map_err(|r| StreamingError::config("encoding", e, r))?;
            let writable = matches!(
                enc,
                Encoding::Bytes | Encoding::Str | Encoding::Int | Encoding::Scalar(_)
            ) || matches!(
                enc,
                Encoding::NdArray {
                    dtype: Some(_),
                    shape: Some(_)
                }
            );
            if !writable {
                return Err(StreamingError::config(
                    "encoding",
                    e,
                    "bytes, str, int, a numeric scalar, or ndarray:<dtype>:<shape>",
                ));
            }
            sizes.push(enc.fixed_size().map(|s| s as u64));
            names.push(n.to_string());
            encodings.push(e.to_string());
            parsed.push(enc);
        }
        Ok(MdsWriter {
            folder: folder.to_path_buf(),
            names,
            encodings,
            parsed,
            sizes,
            size_limit,
            compression: zstd_level,
            samples: Vec::new(),
            pending: 0,
            shards: Vec::new(),
        })
    }

    /// Adds a sample: one value per column, in the order the columns were given to `new`
    /// sorted by name.
    pub fn write(&mut self, values: &[WriteValue<'_>]) -> Result<()> {
        if values.len() != self.names.len() {
            return Err(StreamingError::config(
                "sample",
                format!("{} values", values.len()),
                format!("{} values (columns {:?})", self.names.len(), self.names),
            ));
        }
        let mut head = Vec::new();
        let mut body = Vec::new();
        for (((v, enc), size), name) in values
            .iter()
            .zip(&self.parsed)
            .zip(&self.sizes)
            .zip(&self.names)
        {
            let bytes: Vec<u8> = match (v, enc) {
                (WriteValue::Bytes(b), Encoding::Bytes | Encoding::NdArray { .. }) => b.to_vec(),
                (WriteValue::Str(s), Encoding::Str) => s.as_bytes().to_vec(),
                (WriteValue::Int(i), Encoding::Int) => i.to_le_bytes().to_vec(),
                (WriteValue::Int(i), Encoding::Scalar(d))
                    if !matches!(d, DType::F16 | DType::F32 | DType::F64) =>
                {
                    i.to_le_bytes()[..d.size()].to_vec()
                }
                (WriteValue::Float(f), Encoding::Scalar(DType::F32)) => {
                    (*f as f32).to_le_bytes().to_vec()
                }
                (WriteValue::Float(f), Encoding::Scalar(DType::F64)) => f.to_le_bytes().to_vec(),
                _ => {
                    return Err(StreamingError::config(
                        "sample",
                        format!("{v:?}"),
                        format!("a value for column {name:?}'s encoding"),
                    ))
                }
            };
            match size {
                Some(s) if *s as usize != bytes.len() => {
                    return Err(StreamingError::config(
                        "sample",
                        format!("{} bytes for column {name:?}", bytes.len()),
                        format!("{s} bytes"),
                    ))
                }
                Some(_) => {}
                None => head.extend_from_slice(&(bytes.len() as u32).to_le_bytes()),
            }
            body.extend_from_slice(&bytes);
        }
        head.extend_from_slice(&body);
        // Each sample also costs its offset (4 bytes), as in Streaming's writer.
        let cost = head.len() as u64 + 4;
        if !self.samples.is_empty() && self.pending + cost > self.size_limit {
            self.flush()?;
        }
        self.pending += cost;
        self.samples.push(head);
        Ok(())
    }

    fn config_json(&self) -> String {
        let compression = self.compression.map(|l| format!("zstd:{l}"));
        serde_json::json!({
            "column_encodings": self.encodings,
            "column_names": self.names,
            "column_sizes": self.sizes,
            "compression": compression,
            "format": "mds",
            "hashes": WRITER_HASHES,
            "size_limit": self.size_limit,
            "version": 2,
        })
        .to_string()
    }

    fn flush(&mut self) -> Result<()> {
        if self.samples.is_empty() {
            return Ok(());
        }
        let config = self.config_json();
        let n = self.samples.len();
        let mut raw = Vec::with_capacity(self.pending as usize + config.len() + 8);
        raw.extend_from_slice(&(n as u32).to_le_bytes());
        let mut at = 4 + 4 * (n as u64 + 1) + config.len() as u64;
        raw.extend_from_slice(&(at as u32).to_le_bytes());
        for s in &self.samples {
            at += s.len() as u64;
            if at >= 1 << 32 {
                return Err(StreamingError::config(
                    "size_limit",
                    self.size_limit,
                    "a limit under which each shard stays below 4 GiB",
                ));
            }
            raw.extend_from_slice(&(at as u32).to_le_bytes());
        }
        raw.extend_from_slice(config.as_bytes());
        for s in &self.samples {
            raw.extend_from_slice(s);
        }
        let index = self.shards.len();
        let raw_name = format!("shard.{index:05}.mds");
        let info = |name: String, data: &[u8]| FileInfo {
            basename: name,
            bytes: data.len() as u64,
            hashes: WRITER_HASHES
                .iter()
                .filter_map(|h| codec::digest(h, data).map(|d| (h.to_string(), d)))
                .collect(),
        };
        let raw_info = info(raw_name.clone(), &raw);
        let (zip_info, file, data) = match self.compression {
            Some(level) => {
                let z = codec::compress_zstd(&raw, level)
                    .map_err(|r| StreamingError::config("zstd level", level, r))?;
                let name = format!("{raw_name}.zstd");
                (Some(info(name.clone(), &z)), name, z)
            }
            None => (None, raw_name, raw),
        };
        write_atomic(&self.folder.join(&file), &data)?;
        self.shards.push(ShardEntry {
            format: "mds".into(),
            samples: n as u64,
            raw_data: raw_info,
            zip_data: zip_info,
            compression: self.compression.map(|l| format!("zstd:{l}")),
            hashes: WRITER_HASHES.iter().map(|s| s.to_string()).collect(),
            column_names: self.names.clone(),
            column_encodings: self.encodings.clone(),
            column_sizes: self.sizes.clone(),
            size_limit: Some(self.size_limit),
            version: Some(2),
        });
        self.samples.clear();
        self.pending = 0;
        Ok(())
    }

    /// Writes the last shard and the index (last, so that a folder with an index is whole).
    pub fn finish(mut self) -> Result<IndexFile> {
        self.flush()?;
        let index = IndexFile {
            version: 2,
            shards: std::mem::take(&mut self.shards),
        };
        let text = serde_json::to_vec_pretty(&index).map_err(|e| StreamingError::Index {
            location: self.folder.display().to_string(),
            reason: e.to_string(),
        })?;
        write_atomic(&self.folder.join("index.json"), &text)?;
        Ok(index)
    }
}

/// Writes a dataset's file whole (temporary file, fsync, rename): checkpoint's writer.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    flashover_checkpoint::write_atomic(path, data).map_err(|e| StreamingError::Io {
        action: "write",
        path: path.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_decode_hand_built_bytes() {
        // ndarray with dynamic dtype and shape: code 8 (uint8), ndim 2 with uint8 dims
        // ((2 << 2) | 0), shape [2, 3], six values.
        let e = Encoding::parse("ndarray").unwrap();
        let v = e.decode(&[8, 8, 2, 3, 1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(
            v,
            Value::Array(NdArray {
                dtype: DType::U8,
                shape: vec![2, 3],
                data: vec![1, 2, 3, 4, 5, 6]
            })
        );
        let e = Encoding::parse("ndarray:float32:2").unwrap();
        assert_eq!(e.fixed_size(), Some(8));
        let mut d = 1.5f32.to_le_bytes().to_vec();
        d.extend((-2.0f32).to_le_bytes());
        match e.decode(&d).unwrap() {
            Value::Array(a) => assert_eq!(a.to_f32(), vec![1.5, -2.0]),
            v => panic!("{v:?}"),
        }
        assert_eq!(
            Encoding::parse("int16")
                .unwrap()
                .decode(&(-3i16).to_le_bytes())
                .unwrap(),
            Value::Int(-3)
        );
        assert_eq!(
            Encoding::parse("str_int").unwrap().decode(b"42").unwrap(),
            Value::Int(42)
        );
        // PIL: width 2, height 1, mode "L" (1 byte), pixels.
        let mut pil = Vec::new();
        for x in [2u32, 1, 1] {
            pil.extend(x.to_le_bytes());
        }
        pil.extend(b"L");
        pil.extend([7, 9]);
        assert_eq!(
            Encoding::parse("pil").unwrap().decode(&pil).unwrap(),
            Value::Image(Image {
                mode: "L".into(),
                width: 2,
                height: 1,
                data: vec![7, 9]
            })
        );
        // list[png]: placeholder 0, two elements of sizes 1 and 2.
        let mut l = Vec::new();
        for x in [0u32, 2, 1, 2] {
            l.extend(x.to_le_bytes());
        }
        l.extend([1, 2, 3]);
        assert_eq!(
            Encoding::parse("list[png]").unwrap().decode(&l).unwrap(),
            Value::List(vec![Value::Bytes(vec![1]), Value::Bytes(vec![2, 3])])
        );
        let err = Encoding::parse("pkl").unwrap().decode(b"x").unwrap_err();
        assert!(err.contains("pkl"), "{err}");
        assert!(Encoding::parse("ndarray:complex64").is_err());
        assert!(Encoding::parse("float128").is_err());
    }

    #[test]
    fn written_shards_read_back_with_their_index() {
        let dir = tempfile::tempdir().unwrap();
        for level in [None, Some(3)] {
            let folder = dir.path().join(format!("{level:?}"));
            let mut w = MdsWriter::new(
                &folder,
                &[("y", "int"), ("x", "ndarray:uint8:2,2"), ("name", "str")],
                1024,
                level,
            )
            .unwrap();
            for i in 0..100i64 {
                let x = [i as u8, 1, 2, 3];
                let name = format!("sample {i}");
                // Columns sorted: name, x, y.
                w.write(&[
                    WriteValue::Str(&name),
                    WriteValue::Bytes(&x),
                    WriteValue::Int(i),
                ])
                .unwrap();
            }
            let index = w.finish().unwrap();
            assert!(index.shards.len() > 1, "1 KiB shards split 100 samples");
            let text = std::fs::read(folder.join("index.json")).unwrap();
            let parsed = IndexFile::parse("test", &text).unwrap();
            assert_eq!(parsed, index);
            let mut i = 0i64;
            for s in &parsed.shards {
                let raw = match &s.zip_data {
                    Some(z) => {
                        let data = std::fs::read(folder.join(&z.basename)).unwrap();
                        codec::verify(&data, Some(z.bytes), &z.hashes).unwrap();
                        let raw =
                            codec::decompress(s.compression.as_deref().unwrap(), &data).unwrap();
                        let p = dir.path().join("raw");
                        std::fs::write(&p, &raw).unwrap();
                        p
                    }
                    None => folder.join(&s.raw_data.basename),
                };
                codec::verify(
                    &std::fs::read(&raw).unwrap(),
                    Some(s.raw_data.bytes),
                    &s.raw_data.hashes,
                )
                .unwrap();
                let shard = MdsShard::open(&raw, s).unwrap();
                for k in 0..shard.len() {
                    let sample = shard.sample(k).unwrap();
                    assert_eq!(sample.int("y").unwrap(), i);
                    assert_eq!(sample.str("name").unwrap(), format!("sample {i}"));
                    assert_eq!(sample.bytes("x").unwrap(), &[i as u8, 1, 2, 3]);
                    i += 1;
                }
            }
            assert_eq!(i, 100);
        }
    }

    #[test]
    fn a_damaged_header_or_index_is_an_error_naming_the_shard() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = MdsWriter::new(dir.path(), &[("y", "int")], 1 << 20, None).unwrap();
        for i in 0..10 {
            w.write(&[WriteValue::Int(i)]).unwrap();
        }
        let index = w.finish().unwrap();
        let path = dir.path().join("shard.00000.mds");
        let mut data = std::fs::read(&path).unwrap();
        data[0] = 11;
        std::fs::write(&path, &data).unwrap();
        let err = MdsShard::open(&path, &index.shards[0])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shard.00000.mds") && err.contains("11 samples"),
            "{err}"
        );
        data[0] = 10;
        data.truncate(data.len() - 3);
        std::fs::write(&path, &data).unwrap();
        let err = MdsShard::open(&path, &index.shards[0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("offsets"), "{err}");
        let bad = br#"{"version": 2, "shards": [{"format": "mds", "samples": 1, "raw_data": {"basename": "../etc/passwd", "bytes": 1}, "column_names": ["y"], "column_encodings": ["int"], "column_sizes": [8]}]}"#;
        let err = IndexFile::parse("idx", bad).unwrap_err().to_string();
        assert!(err.contains("../etc/passwd"), "{err}");
        assert!(IndexFile::parse("idx", b"{}").is_err());
    }
}
