//! TensorBoard event files, written directly: TFRecord framing (length, masked CRC-32C of the
//! length, payload, masked CRC-32C of the payload) around `tensorflow.Event` protocol buffers,
//! encoded by hand (the few fields used are listed below). TensorBoard reads the folder with
//! `tensorboard --logdir <dir>`; the tests read it back with TensorBoard's own
//! `EventAccumulator`.
//!
//! Fields written (numbers from `tensorflow/core/util/event.proto` and `summary.proto`):
//! `Event { wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5 }`,
//! `Summary { value = 1 (repeated) }`, `Summary.Value { tag = 1, simple_value = 2 (float),
//! image = 4, tensor = 8, metadata = 9 }`, `Summary.Image { height = 1, width = 2,
//! colorspace = 3 (1 grey, 3 RGB, 4 RGBA), encoded_image_string = 4 (PNG) }`, `SummaryMetadata { plugin_data = 1 }`,
//! `PluginData { plugin_name = 1 }`, `TensorProto { dtype = 1 (DT_STRING = 7),
//! tensor_shape = 2, string_val = 8 }`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use flashover_core::error::Result;
use flashover_core::event::Event;
use flashover_core::logger::{Image, LoggerDestination};
use flashover_core::time::{Progress, Timestamp};
use serde_json::{Map, Value};

use crate::error::CallbackError;

/// CRC-32C (Castagnoli), the checksum TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: rotate right by 15 bits and add a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// Frames `payload` as one TFRecord.
pub fn tf_record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out
}

/// A minimal protocol-buffer writer: the wire types the event format needs.
#[derive(Default)]
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(((field as u64) << 3) | wire as u64);
    }
    fn double(&mut self, field: u32, v: f64) {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn float(&mut self, field: u32, v: f32) {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn int(&mut self, field: u32, v: i64) {
        self.key(field, 0);
        self.varint(v as u64);
    }
    fn bytes(&mut self, field: u32, v: &[u8]) {
        self.key(field, 2);
        self.varint(v.len() as u64);
        self.0.extend_from_slice(v);
    }
}

fn event(wall_time: f64, step: i64, body: impl FnOnce(&mut Proto)) -> Vec<u8> {
    let mut e = Proto::default();
    e.double(1, wall_time);
    e.int(2, step);
    body(&mut e);
    e.0
}

fn scalar_value(tag: &str, v: f64) -> Vec<u8> {
    let mut p = Proto::default();
    p.bytes(1, tag.as_bytes());
    p.float(2, v as f32);
    p.0
}

fn text_value(tag: &str, text: &str) -> Vec<u8> {
    let mut plugin = Proto::default();
    plugin.bytes(1, b"text");
    let mut meta = Proto::default();
    meta.bytes(1, &plugin.0);
    let mut tensor = Proto::default();
    tensor.int(1, 7); // DT_STRING
    tensor.bytes(2, &[]); // scalar shape
    tensor.bytes(8, text.as_bytes());
    let mut p = Proto::default();
    p.bytes(1, tag.as_bytes());
    p.bytes(8, &tensor.0);
    p.bytes(9, &meta.0);
    p.0
}

fn image_value(tag: &str, image: &Image) -> Vec<u8> {
    let mut img = Proto::default();
    img.int(1, image.height() as i64);
    img.int(2, image.width() as i64);
    img.int(3, image.channels() as i64);
    img.bytes(4, &crate::media::encode_png(image));
    let mut p = Proto::default();
    p.bytes(1, tag.as_bytes());
    p.bytes(4, &img.0);
    p.0
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Writes TensorBoard event files: every logged value as a scalar (tag = metric name, step =
/// batches done), texts in the Text tab, images in the Images tab (PNG), and the
/// hyperparameters once, as a Markdown table in the Text tab under `hyperparameters`. Values are stored as 32-bit floats, as TensorBoard's scalars are.
///
/// ```no_run
/// use flashover_callbacks::TensorBoardLogger;
/// let tb = TensorBoardLogger::create("runs/mnist/tensorboard")?; // .logger(tb)
/// // then: tensorboard --logdir runs/mnist/tensorboard
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct TensorBoardLogger {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardLogger {
    /// Creates `dir` if needed and a new event file in it
    /// (`events.out.tfevents.<seconds>.<host>.<pid>.flashover`).
    pub fn create(dir: impl AsRef<Path>) -> crate::error::Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| CallbackError::io("tensorboard", dir, e))?;
        let host = std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().replace(['/', '\\'], "_"))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let secs = now_seconds() as u64;
        let path = dir.join(format!(
            "events.out.tfevents.{secs:010}.{host}.{}.flashover",
            std::process::id()
        ));
        let file = File::create(&path).map_err(|e| CallbackError::io("tensorboard", &path, e))?;
        let mut logger = TensorBoardLogger {
            path,
            out: BufWriter::new(file),
        };
        let first = event(now_seconds(), 0, |e| e.bytes(3, b"brain.Event:2"));
        logger.write(&first)?;
        Ok(logger)
    }

    /// The event file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event at the step of `ts` holding a summary of `values` (`Summary.Value`s).
    fn write_summary(&mut self, ts: &Timestamp, values: &[Vec<u8>]) -> Result<()> {
        let e = event(now_seconds(), ts.batch as i64, |e| {
            let mut summary = Proto::default();
            for v in values {
                summary.bytes(1, v);
            }
            e.bytes(5, &summary.0);
        });
        self.write(&e)?;
        Ok(())
    }

    fn write(&mut self, payload: &[u8]) -> crate::error::Result<()> {
        self.out
            .write_all(&tf_record(payload))
            .map_err(|e| CallbackError::io("tensorboard", &self.path, e))
    }
}

impl LoggerDestination for TensorBoardLogger {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn log_hyperparameters(&mut self, params: &Map<String, Value>) -> Result<()> {
        let mut table = String::from("| hyperparameter | value |\n| --- | --- |\n");
        for (k, v) in params {
            table.push_str(&format!(
                "| {k} | {} |\n",
                v.to_string().replace('|', "\\|")
            ));
        }
        self.write_summary(
            &Timestamp::default(),
            &[text_value("hyperparameters", &table)],
        )
    }

    fn log_metrics(&mut self, ts: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let values: Vec<Vec<u8>> = metrics.iter().map(|(k, v)| scalar_value(k, *v)).collect();
        self.write_summary(ts, &values)
    }

    /// A text summary under `tag` (TensorBoard's Text tab) at the step of `ts`.
    fn log_text(&mut self, ts: &Timestamp, tag: &str, text: &str) -> Result<()> {
        self.write_summary(ts, &[text_value(tag, text)])
    }

    /// An image summary under `tag` (TensorBoard's Images tab) at the step of `ts`.
    fn log_image(&mut self, ts: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        self.write_summary(ts, &[image_value(tag, image)])
    }

    fn run_event(&mut self, event: Event, _ts: &Timestamp, _progress: &Progress) -> Result<()> {
        if crate::files::flushes_at(event) {
            self.out
                .flush()
                .map_err(|e| CallbackError::io("tensorboard", &self.path, e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_published_check_values() {
        // The standard check value of CRC-32C, and RFC 3720's 32 zero bytes / 32 0xff bytes.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b""), 0);
    }

    /// Reads the varint at `*i`.
    fn varint(b: &[u8], i: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[*i];
            *i += 1;
            v |= ((byte & 0x7f) as u64) << shift;
            if byte < 0x80 {
                return v;
            }
            shift += 7;
        }
    }

    /// Splits a message into (field, wire type, raw bytes of the value).
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let mut i = 0;
        let mut out = Vec::new();
        while i < b.len() {
            let key = varint(b, &mut i);
            let (field, wire) = (key >> 3, key & 7);
            let v = match wire {
                0 => varint(b, &mut i).to_le_bytes().to_vec(),
                1 => {
                    i += 8;
                    b[i - 8..i].to_vec()
                }
                5 => {
                    i += 4;
                    b[i - 4..i].to_vec()
                }
                2 => {
                    let n = varint(b, &mut i) as usize;
                    i += n;
                    b[i - n..i].to_vec()
                }
                w => panic!("wire type {w}"),
            };
            out.push((field, wire, v));
        }
        out
    }

    #[test]
    fn event_file_frames_and_fields_decode() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoardLogger::create(dir.path()).unwrap();
        let mut ts = Timestamp::default();
        for _ in 0..300 {
            ts.advance_batch(1, 0, std::time::Duration::ZERO);
        }
        tb.log_metrics(&ts, &[("train/loss", 0.25), ("train/lr", 1e-3)])
            .unwrap();
        let p = Progress {
            batches_per_epoch: 1,
            samples_per_epoch: 1,
            max_duration: flashover_core::time::Time::Epoch(1),
        };
        tb.run_event(Event::FitEnd, &ts, &p).unwrap();
        let bytes = std::fs::read(tb.path()).unwrap();
        let mut records = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let len_bytes = &bytes[i..i + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(len_bytes));
            let data = &bytes[i + 12..i + 12 + len];
            let crc = u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(data));
            records.push(data.to_vec());
            i += 16 + len;
        }
        assert_eq!(records.len(), 2);
        let first = fields(&records[0]);
        assert_eq!(first[2], (3, 2, b"brain.Event:2".to_vec()));
        let second = fields(&records[1]);
        assert_eq!(second[1].0, 2);
        assert_eq!(
            u64::from_le_bytes(second[1].2[..8].try_into().unwrap()),
            300
        );
        let summary = fields(&second[2].2);
        let values: Vec<(String, f32)> = summary
            .iter()
            .map(|(_, _, v)| {
                let f = fields(v);
                (
                    String::from_utf8(f[0].2.clone()).unwrap(),
                    f32::from_le_bytes(f[1].2[..4].try_into().unwrap()),
                )
            })
            .collect();
        assert_eq!(
            values,
            [
                ("train/loss".to_string(), 0.25),
                ("train/lr".to_string(), 1e-3)
            ]
        );
    }
}
