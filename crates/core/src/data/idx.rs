//! The IDX file format (MNIST's) and the MNIST dataset and batcher built on it.
//!
//! Files may be raw or gzipped (recognised by their first two bytes, not their name). Every
//! header is checked against the bytes actually present before anything large is allocated,
//! so a truncated or hostile file is an error that names it, never a panic or a huge
//! allocation.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::error::{CoreError, Result};
use crate::model::ClassificationBatch;

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;
/// No real IDX file in this format is larger than this; a header that claims more is refused
/// before reading.
const MAX_PAYLOAD: u64 = 1 << 32;

/// The most a gzipped IDX file may expand, as payload bytes per compressed byte. Deflate
/// cannot expand more than about 1032:1, and real IDX files expand 2 to 10 times (MNIST's
/// training images: 4.7); a header that claims more than this of a small file is a
/// decompression bomb, refused before anything is allocated.
const MAX_GZIP_EXPANSION: u64 = 64;
/// Headroom for small files, whose ratio says little (an all-black test image compresses
/// almost to nothing).
const GZIP_SLACK_BYTES: u64 = 16 << 20;

/// An opened IDX file: its reader, whether it is gzipped, and its size on disk.
struct Opened {
    reader: Box<dyn Read>,
    gzip: bool,
    file_bytes: u64,
}

fn open(path: &Path) -> Result<Opened> {
    let io = |source| CoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_bytes = file.metadata().map_err(io)?.len();
    sniff(Box::new(BufReader::new(file)), file_bytes).map_err(io)
}

/// Wraps `reader` (of `file_bytes` bytes) in a gzip decoder if its first two bytes are gzip's.
fn sniff(mut reader: Box<dyn Read>, file_bytes: u64) -> std::io::Result<Opened> {
    let mut head = [0u8; 2];
    let n = read_up_to(&mut reader, &mut head)?;
    let prefix = std::io::Cursor::new(head[..n].to_vec());
    let chained = prefix.chain(reader);
    let gzip = n == 2 && head == [0x1f, 0x8b];
    let reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::GzDecoder::new(chained))
    } else {
        Box::new(chained)
    };
    Ok(Opened {
        reader,
        gzip,
        file_bytes,
    })
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..])? {
            0 => break,
            k => filled += k,
        }
    }
    Ok(filled)
}

/// Reads a header of `1 + dims` big-endian u32s, checks the magic, and returns the payload,
/// which must hold exactly the product of the dimensions in bytes.
fn read_idx(path: &Path, magic: u32, dims: usize) -> Result<(Vec<u32>, Vec<u8>)> {
    decode_idx(open(path)?, path, magic, dims)
}

/// [`read_idx`] over an opened stream; `path` names it in errors.
fn decode_idx(opened: Opened, path: &Path, magic: u32, dims: usize) -> Result<(Vec<u32>, Vec<u8>)> {
    let malformed = |reason: String| CoreError::MalformedData {
        path: path.to_path_buf(),
        reason,
    };
    let io = |source| CoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let Opened {
        reader: mut r,
        gzip,
        file_bytes,
    } = opened;
    // A gzip stream that stops decoding is damage in the file, reported as such.
    let read_err = |source: std::io::Error| {
        if gzip
            && matches!(
                source.kind(),
                std::io::ErrorKind::InvalidInput
                    | std::io::ErrorKind::InvalidData
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            malformed(format!("corrupt gzip stream: {source}"))
        } else {
            io(source)
        }
    };
    let mut header = vec![0u8; 4 * (1 + dims)];
    let got = read_up_to(&mut r, &mut header).map_err(read_err)?;
    if got < header.len() {
        return Err(malformed(format!(
            "file ends after {got} bytes, inside the {}-byte header",
            header.len()
        )));
    }
    let words: Vec<u32> = header
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if words[0] != magic {
        return Err(malformed(format!(
            "magic number 0x{:08x}, expected 0x{magic:08x} ({})",
            words[0],
            if magic == IMAGES_MAGIC {
                "unsigned-byte images, 3 dimensions"
            } else {
                "unsigned-byte labels, 1 dimension"
            }
        )));
    }
    let shape = words[1..].to_vec();
    let expected = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .unwrap_or(u64::MAX);
    if expected > MAX_PAYLOAD {
        return Err(malformed(format!("header claims dimensions {shape:?} ({expected} bytes), more than any IDX file this reader accepts ({MAX_PAYLOAD} bytes)")));
    }
    // The claim is checked against the file before anything is read: a raw file must hold
    // it, and a gzipped one cannot plausibly expand to it.
    let header_bytes = header.len() as u64;
    if !gzip && file_bytes.saturating_sub(header_bytes) < expected {
        return Err(malformed(format!(
            "truncated: header dimensions {shape:?} need {expected} bytes of data, the file has {}",
            file_bytes.saturating_sub(header_bytes)
        )));
    }
    let most = file_bytes
        .saturating_mul(MAX_GZIP_EXPANSION)
        .saturating_add(GZIP_SLACK_BYTES);
    if gzip && expected > most {
        return Err(malformed(format!(
            "header claims dimensions {shape:?} ({expected} bytes), more than a {file_bytes}-byte \
             gzip file holds at the most this reader accepts ({MAX_GZIP_EXPANSION}x its size plus \
             {GZIP_SLACK_BYTES} bytes); refused before decompressing"
        )));
    }
    // Read exactly what the header promises (the buffer grows with the bytes that really
    // arrive), then to the end of the stream: a gzip member's checksum is only checked there,
    // and anything past the promised bytes is trailing data.
    let mut payload = Vec::new();
    (&mut r)
        .take(expected)
        .read_to_end(&mut payload)
        .map_err(read_err)?;
    if (payload.len() as u64) < expected {
        return Err(malformed(format!(
            "truncated: header dimensions {shape:?} need {expected} bytes of data, the file has {}",
            payload.len()
        )));
    }
    let mut extra = [0u8; 1];
    if read_up_to(&mut r, &mut extra).map_err(read_err)? > 0 {
        // A damaged deflate stream often decodes to more bytes before its checksum fails:
        // read on (into nothing, as far as a gzip file may expand) to tell damage from a
        // stream that really is longer than its header says.
        if gzip {
            let rest = most.saturating_sub(expected);
            std::io::copy(&mut (&mut r).take(rest), &mut std::io::sink()).map_err(read_err)?;
        }
        return Err(malformed(format!(
            "trailing data after the {expected} bytes that dimensions {shape:?} describe"
        )));
    }
    Ok((shape, payload))
}

/// Images from an IDX3 file: `count` images of `rows x cols` bytes each, row-major.
#[derive(Debug, Clone)]
pub struct IdxImages {
    /// Number of images.
    pub count: usize,
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
    /// All pixels, image after image.
    pub pixels: Vec<u8>,
}

/// Reads an IDX3 unsigned-byte image file (raw or gzipped).
pub fn read_idx_images(path: &Path) -> Result<IdxImages> {
    let (shape, pixels) = read_idx(path, IMAGES_MAGIC, 3)?;
    Ok(IdxImages {
        count: shape[0] as usize,
        rows: shape[1] as usize,
        cols: shape[2] as usize,
        pixels,
    })
}

/// Reads an IDX1 unsigned-byte label file (raw or gzipped).
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    Ok(read_idx(path, LABELS_MAGIC, 1)?.1)
}

/// The bytes of an IDX file held in memory, named `<memory>` in errors.
fn from_memory(bytes: &[u8]) -> Opened {
    let reader: Box<dyn Read> = Box::new(std::io::Cursor::new(bytes.to_vec()));
    match sniff(reader, bytes.len() as u64) {
        Ok(o) => o,
        // Reading from memory cannot fail; an empty stream stands in, which decodes to the
        // same "inside the header" error as an empty file.
        Err(_) => Opened {
            reader: Box::new(std::io::empty()),
            gzip: false,
            file_bytes: 0,
        },
    }
}

/// [`read_idx_images`] on the bytes of a file held in memory (raw or gzipped), with the same
/// checks: what a fuzzer or a network source feeds the reader.
pub fn parse_idx_images(bytes: &[u8]) -> Result<IdxImages> {
    let (shape, pixels) = decode_idx(from_memory(bytes), Path::new("<memory>"), IMAGES_MAGIC, 3)?;
    Ok(IdxImages {
        count: shape[0] as usize,
        rows: shape[1] as usize,
        cols: shape[2] as usize,
        pixels,
    })
}

/// [`read_idx_labels`] on the bytes of a file held in memory (raw or gzipped).
pub fn parse_idx_labels(bytes: &[u8]) -> Result<Vec<u8>> {
    Ok(decode_idx(from_memory(bytes), Path::new("<memory>"), LABELS_MAGIC, 1)?.1)
}

/// Which part of MNIST to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MnistSplit {
    /// The training files (`train-*`).
    Train,
    /// The test files (`t10k-*` or `test-*`).
    Test,
}

/// One MNIST digit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MnistItem {
    /// Pixels, row-major, 0 = background, 255 = ink.
    pub pixels: Vec<u8>,
    /// Rows of the image.
    pub rows: usize,
    /// Columns of the image.
    pub cols: usize,
    /// The digit, 0 to 9.
    pub label: u8,
}

/// MNIST (or any IDX image/label pair with labels 0-9), held in memory.
#[derive(Debug, Clone)]
pub struct MnistDataset {
    images: IdxImages,
    labels: Vec<u8>,
}

fn find(dir: &Path, what: &'static str, stems: &[&str]) -> Result<PathBuf> {
    let mut names = Vec::new();
    for stem in stems {
        for name in [stem.to_string(), format!("{stem}.gz")] {
            let p = dir.join(&name);
            if p.is_file() {
                return Ok(p);
            }
            names.push(name);
        }
    }
    Err(CoreError::MissingDataFile {
        what,
        dir: dir.to_path_buf(),
        candidates: names.join(", "),
    })
}

impl MnistDataset {
    /// Loads a split from a directory with the standard MNIST file names, raw or `.gz`:
    /// `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, and for the test split
    /// `t10k-*` or `test-*` (also the `.idx3-ubyte` spelling).
    pub fn from_dir(dir: &Path, split: MnistSplit) -> Result<Self> {
        let (images, labels) = match split {
            MnistSplit::Train => (
                find(
                    dir,
                    "training images",
                    &["train-images-idx3-ubyte", "train-images.idx3-ubyte"],
                )?,
                find(
                    dir,
                    "training labels",
                    &["train-labels-idx1-ubyte", "train-labels.idx1-ubyte"],
                )?,
            ),
            MnistSplit::Test => (
                find(
                    dir,
                    "test images",
                    &[
                        "t10k-images-idx3-ubyte",
                        "test-images-idx3-ubyte",
                        "t10k-images.idx3-ubyte",
                    ],
                )?,
                find(
                    dir,
                    "test labels",
                    &[
                        "t10k-labels-idx1-ubyte",
                        "test-labels-idx1-ubyte",
                        "t10k-labels.idx1-ubyte",
                    ],
                )?,
            ),
        };
        Self::from_files(&images, &labels)
    }

    /// Loads an image file and a label file, checking that they agree.
    pub fn from_files(images_path: &Path, labels_path: &Path) -> Result<Self> {
        let images = read_idx_images(images_path)?;
        let labels = read_idx_labels(labels_path)?;
        if images.count != labels.len() {
            return Err(CoreError::MalformedData {
                path: labels_path.to_path_buf(),
                reason: format!(
                    "{} labels for {} images in {}",
                    labels.len(),
                    images.count,
                    images_path.display()
                ),
            });
        }
        if images.rows == 0 || images.cols == 0 {
            return Err(CoreError::MalformedData {
                path: images_path.to_path_buf(),
                reason: format!(
                    "images of {}x{} pixels; rows and columns must be at least 1",
                    images.rows, images.cols
                ),
            });
        }
        if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| l > 9) {
            return Err(CoreError::MalformedData {
                path: labels_path.to_path_buf(),
                reason: format!("label {l} at index {i}; digits are 0 to 9"),
            });
        }
        Ok(MnistDataset { images, labels })
    }

    /// Rows and columns of every image.
    pub fn image_size(&self) -> (usize, usize) {
        (self.images.rows, self.images.cols)
    }

    /// Keeps only the first `n` items.
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.labels.len());
        self.labels.truncate(n);
        self.images.count = n;
        self.images
            .pixels
            .truncate(n * self.images.rows * self.images.cols);
    }
}

impl Dataset<MnistItem> for MnistDataset {
    fn get(&self, index: usize) -> Option<MnistItem> {
        let label = *self.labels.get(index)?;
        let size = self.images.rows * self.images.cols;
        let pixels = self
            .images
            .pixels
            .get(index * size..(index + 1) * size)?
            .to_vec();
        Some(MnistItem {
            pixels,
            rows: self.images.rows,
            cols: self.images.cols,
            label,
        })
    }

    fn len(&self) -> usize {
        self.labels.len()
    }
}

/// Turns MNIST items into a `[batch, 1, rows, cols]` float tensor, normalised with MNIST's
/// mean (0.1307) and standard deviation (0.3081), and integer targets.
#[derive(Debug, Clone, Copy, Default)]
pub struct MnistBatcher;

/// MNIST's pixel mean, on the 0..1 scale.
pub const MNIST_MEAN: f32 = 0.1307;
/// MNIST's pixel standard deviation, on the 0..1 scale.
pub const MNIST_STD: f32 = 0.3081;

impl<B: Backend> Batcher<B, MnistItem, ClassificationBatch<B, 4>> for MnistBatcher {
    fn batch(&self, items: Vec<MnistItem>, device: &B::Device) -> ClassificationBatch<B, 4> {
        let n = items.len();
        let (rows, cols) = items.first().map(|i| (i.rows, i.cols)).unwrap_or((28, 28));
        let mut pixels = Vec::with_capacity(n * rows * cols);
        let mut labels = Vec::with_capacity(n);
        for item in &items {
            pixels.extend(
                item.pixels
                    .iter()
                    .map(|&p| (p as f32 / 255.0 - MNIST_MEAN) / MNIST_STD),
            );
            labels.push(item.label as i64);
        }
        let inputs = Tensor::<B, 4>::from_data(TensorData::new(pixels, [n, 1, rows, cols]), device);
        let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(labels, [n]), device);
        ClassificationBatch::new(inputs, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    fn header(magic: u32, dims: &[u32]) -> Vec<u8> {
        let mut v = magic.to_be_bytes().to_vec();
        for d in dims {
            v.extend(d.to_be_bytes());
        }
        v
    }

    #[test]
    fn reads_raw_and_gzipped_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut img = header(IMAGES_MAGIC, &[2, 2, 3]);
        img.extend(0..12u8);
        let raw = write(dir.path(), "a", &img);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&img).unwrap();
        let gzp = write(dir.path(), "b", &gz.finish().unwrap());
        for p in [raw, gzp] {
            let i = read_idx_images(&p).unwrap();
            assert_eq!((i.count, i.rows, i.cols), (2, 2, 3));
            assert_eq!(i.pixels, (0..12).collect::<Vec<u8>>());
        }
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(bytes).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn a_gzip_bomb_is_refused_before_it_is_decompressed() {
        // 5.4 million blank 28x28 images: 4.2 GB of zeros in about 4 MB of gzip. The claim is
        // checked against the file's size, so nothing near 4 GB is ever allocated.
        let dir = tempfile::tempdir().unwrap();
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        enc.write_all(&header(IMAGES_MAGIC, &[5_400_000, 28, 28]))
            .unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..64 {
            enc.write_all(&zeros).unwrap(); // 64 MB of the promised 4.2 GB is enough to show it
        }
        let p = write(dir.path(), "bomb.gz", &enc.finish().unwrap());
        let msg = read_idx_images(&p).unwrap_err().to_string();
        assert!(
            msg.contains("bomb.gz") && msg.contains("refused before decompressing"),
            "{msg}"
        );
        // A raw file that cannot hold its claim is refused from its size alone.
        let mut raw = header(IMAGES_MAGIC, &[1_000_000, 28, 28]);
        raw.extend([0u8; 784]);
        let p = write(dir.path(), "short", &raw);
        let msg = read_idx_images(&p).unwrap_err().to_string();
        assert!(
            msg.contains("truncated") && msg.contains("784000000"),
            "{msg}"
        );
    }

    #[test]
    fn a_gzip_stream_damaged_mid_way_is_reported_as_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let mut img = header(IMAGES_MAGIC, &[200, 28, 28]);
        let mut x = 1u32;
        img.extend((0..200 * 784).map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 24) as u8
        }));
        let good = gzip(&img);
        let mut seen = Vec::new();
        // Flip one byte at a time across the middle of the compressed data.
        for k in 0..24 {
            let mut bad = good.clone();
            let i = good.len() / 4 + k * good.len() / 48;
            bad[i] ^= 0x5a;
            let p = write(dir.path(), &format!("damaged{k}.gz"), &bad);
            let err = read_idx_images(&p).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, CoreError::MalformedData { .. }), "{msg}");
            assert!(!msg.contains("trailing data"), "byte {i}: {msg}");
            seen.push(msg);
        }
        assert!(
            seen.iter()
                .all(|m| m.contains("corrupt gzip stream") || m.contains("truncated")),
            "{seen:?}"
        );
    }

    #[test]
    fn bad_files_are_errors_that_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut truncated = header(IMAGES_MAGIC, &[2, 28, 28]);
        truncated.extend([0u8; 100]);
        let mut trailing = header(LABELS_MAGIC, &[2]);
        trailing.extend([1, 2, 3]);
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            (
                "wrong_magic",
                header(0x0000_0802, &[1, 1, 1])
                    .into_iter()
                    .chain([0])
                    .collect(),
                "magic number 0x00000802",
            ),
            ("short_header", vec![0, 0, 8], "inside the 16-byte header"),
            ("truncated", truncated, "truncated"),
            (
                "huge",
                header(IMAGES_MAGIC, &[u32::MAX, u32::MAX, u32::MAX]),
                "more than any IDX file",
            ),
            ("empty", vec![], "inside the"),
        ];
        for (name, bytes, expect) in cases {
            let p = write(dir.path(), name, &bytes);
            let err = read_idx_images(&p).unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(err, CoreError::MalformedData { .. }),
                "{name}: {msg}"
            );
            assert!(msg.contains(name) && msg.contains(expect), "{name}: {msg}");
        }
        let p = write(dir.path(), "trailing", &trailing);
        assert!(read_idx_labels(&p)
            .unwrap_err()
            .to_string()
            .contains("trailing data"));
        let missing = read_idx_labels(&dir.path().join("nope")).unwrap_err();
        assert!(matches!(missing, CoreError::Io { .. }) && missing.to_string().contains("nope"));
    }

    #[test]
    fn missing_split_lists_the_names_tried() {
        let dir = tempfile::tempdir().unwrap();
        let err = MnistDataset::from_dir(dir.path(), MnistSplit::Test)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t10k-images-idx3-ubyte.gz") && err.contains("test-images-idx3-ubyte"),
            "{err}"
        );
    }

    #[test]
    fn labels_must_match_images_and_be_digits() {
        let dir = tempfile::tempdir().unwrap();
        let mut img = header(IMAGES_MAGIC, &[2, 1, 1]);
        img.extend([0, 255]);
        let i = write(dir.path(), "train-images-idx3-ubyte", &img);
        let mut lab = header(LABELS_MAGIC, &[3]);
        lab.extend([1, 2, 3]);
        let l = write(dir.path(), "train-labels-idx1-ubyte", &lab);
        assert!(MnistDataset::from_files(&i, &l)
            .unwrap_err()
            .to_string()
            .contains("3 labels for 2 images"));
        let mut lab = header(LABELS_MAGIC, &[2]);
        lab.extend([1, 12]);
        write(dir.path(), "train-labels-idx1-ubyte", &lab);
        assert!(MnistDataset::from_dir(dir.path(), MnistSplit::Train)
            .unwrap_err()
            .to_string()
            .contains("label 12 at index 1"));
    }
}
