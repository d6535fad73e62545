//! File loggers: [`JsonlLogger`] (one JSON object per line) and [`CsvLogger`] (one row per
//! value). Both write through a buffer that is flushed at the end of every epoch, after every
//! evaluation and at `FIT_END`; a write that fails stops the run with an error naming the file.
//! Images and files logged to them go to the folder `media/` beside the log file
//! (`images/<tag>/<batch>.png`, `files/<name>`; see [`crate::media`]); the JSONL file also
//! gets a line naming each.
//!
//! Numbers are written in Rust's shortest round-trip form, so reading a file back gives the
//! logged `f64` bit for bit. JSON has no NaN or infinity: those are written as the strings
//! `"NaN"`, `"inf"` and `"-inf"`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use flashover_core::error::Result;
use flashover_core::event::Event;
use flashover_core::logger::{Image, LoggerDestination};
use flashover_core::time::{Progress, Timestamp};
use serde_json::{Map, Value};

use crate::error::CallbackError;
use crate::media::MediaFolder;

/// Checks, before a run starts, that files can be written into directory `dir`: creates it
/// (and its parents) if missing, then creates and removes a probe file. Used for output
/// locations that are only written at the end (a plot, `--out`), so that a bad path fails
/// before the first batch rather than after the run.
pub fn check_writable_dir(dir: &Path) -> std::io::Result<()> {
    let fail = |what: &str, e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("cannot {what} {}: {e}", dir.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| fail("create directory", e))?;
    let probe = dir.join(format!(".flashover-probe-{}", std::process::id()));
    File::create(&probe).map_err(|e| fail("write a file into", e))?;
    std::fs::remove_file(&probe).map_err(|e| fail("remove a probe file from", e))
}

/// A buffered file that names itself in errors.
struct Sink {
    component: &'static str,
    path: PathBuf,
    out: BufWriter<File>,
    media: MediaFolder,
}

impl Sink {
    /// Opens `path` (and creates its folder), truncating it or appending to it.
    fn open(component: &'static str, path: &Path, append: bool) -> crate::error::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| CallbackError::io(component, dir, e))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| CallbackError::io(component, path, e))?;
        let media = path.parent().unwrap_or(Path::new("")).join(MEDIA_DIR);
        Ok(Sink {
            component,
            path: path.to_path_buf(),
            out: BufWriter::new(file),
            media: MediaFolder::new(component, media),
        })
    }

    fn write(&mut self, text: &str) -> crate::error::Result<()> {
        self.out
            .write_all(text.as_bytes())
            .map_err(|e| CallbackError::io(self.component, &self.path, e))
    }

    fn flush(&mut self) -> crate::error::Result<()> {
        self.out
            .flush()
            .map_err(|e| CallbackError::io(self.component, &self.path, e))
    }
}

/// The folder beside a log file that holds its images and files.
pub const MEDIA_DIR: &str = "media";

/// The events at which every file logger (JSONL, CSV, TensorBoard) flushes its buffer.
pub(crate) fn flushes_at(event: Event) -> bool {
    matches!(event, Event::EpochEnd | Event::EvalAfterAll | Event::FitEnd)
}

/// A number as JSON: the shortest round-trip decimal, or a string for NaN and infinities.
fn json_number(v: f64) -> Value {
    if v.is_finite() {
        // serde_json writes f64 with the shortest round-trip representation.
        Value::from(v)
    } else if v.is_nan() {
        Value::from("NaN")
    } else if v > 0.0 {
        Value::from("inf")
    } else {
        Value::from("-inf")
    }
}

/// Writes a JSON Lines file: one line `{"hyperparameters": {...}}` at fit start, then one line
/// per logged group of values:
///
/// ```text
/// {"epoch":0,"batch":50,"sample":3200,"token":0,"wall_seconds":2.41,"metrics":{"train/loss":0.31,"train/lr":0.003}}
/// ```
///
/// ```no_run
/// use flashover_callbacks::JsonlLogger;
/// let jsonl = JsonlLogger::create("runs/mnist/metrics.jsonl")?; // .logger(jsonl)
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct JsonlLogger {
    sink: Sink,
}

impl JsonlLogger {
    /// Creates (or truncates) the file at `path`, and its folder if needed.
    pub fn create(path: impl AsRef<Path>) -> crate::error::Result<Self> {
        Ok(JsonlLogger {
            sink: Sink::open("jsonl_logger", path.as_ref(), false)?,
        })
    }

    /// Appends to the file at `path` (created if missing): for a run resumed from a
    /// checkpoint, whose earlier lines stay. Lines after the checkpoint that the interrupted
    /// run wrote stay too; readers keep the last value per (batch, metric).
    pub fn append(path: impl AsRef<Path>) -> crate::error::Result<Self> {
        Ok(JsonlLogger {
            sink: Sink::open("jsonl_logger", path.as_ref(), true)?,
        })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.sink.path
    }

    /// The folder images and files go to (`media/` beside the file).
    pub fn media_dir(&self) -> &Path {
        self.sink.media.dir()
    }

    fn line_at(&mut self, ts: &Timestamp, key: &str, value: Value) -> Result<()> {
        let mut line = serde_json::json!({
            "epoch": ts.epoch,
            "batch": ts.batch,
            "sample": ts.sample,
            "token": ts.token,
            "wall_seconds": ts.total_wall_time.as_secs_f64(),
        });
        line[key] = value;
        self.sink.write(&format!("{line}\n"))?;
        Ok(())
    }
}

impl LoggerDestination for JsonlLogger {
    fn name(&self) -> &str {
        "jsonl_logger"
    }

    fn log_hyperparameters(&mut self, params: &Map<String, Value>) -> Result<()> {
        let mut line = Map::new();
        line.insert("hyperparameters".into(), Value::Object(params.clone()));
        self.sink.write(&format!("{}\n", Value::Object(line)))?;
        Ok(())
    }

    fn log_metrics(&mut self, ts: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let values: Map<String, Value> = metrics
            .iter()
            .map(|(k, v)| (k.to_string(), json_number(*v)))
            .collect();
        let line = serde_json::json!({
            "epoch": ts.epoch,
            "batch": ts.batch,
            "sample": ts.sample,
            "token": ts.token,
            "wall_seconds": ts.total_wall_time.as_secs_f64(),
            "metrics": values,
        });
        self.sink.write(&format!("{line}\n"))?;
        Ok(())
    }

    /// One line `{"epoch", "batch", "sample", "token", "wall_seconds", "text": {tag: text}}`.
    fn log_text(&mut self, ts: &Timestamp, tag: &str, text: &str) -> Result<()> {
        self.line_at(ts, "text", serde_json::json!({ tag: text }))
    }

    /// The image as `media/images/<tag>/<batch>.png`, and one line
    /// `{..., "image": {"tag", "path" (relative to the JSONL file's folder), "width", "height"}}`.
    fn log_image(&mut self, ts: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        let rel = self.sink.media.write_image(tag, ts.batch, image)?;
        let path = Path::new(MEDIA_DIR).join(rel);
        let value = serde_json::json!({
            "tag": tag,
            "path": path.to_string_lossy(),
            "width": image.width(),
            "height": image.height(),
        });
        self.line_at(ts, "image", value)
    }

    /// A copy as `media/files/<name>`, and one line `{..., "file": {"name", "path"}}`.
    fn upload_file(&mut self, ts: &Timestamp, name: &str, path: &Path) -> Result<()> {
        let rel = self.sink.media.copy_file(name, path)?;
        let path = Path::new(MEDIA_DIR).join(rel);
        let value = serde_json::json!({ "name": name, "path": path.to_string_lossy() });
        self.line_at(ts, "file", value)
    }

    fn run_event(&mut self, event: Event, _ts: &Timestamp, _progress: &Progress) -> Result<()> {
        if flushes_at(event) {
            self.sink.flush()?;
        }
        Ok(())
    }
}

/// Writes a CSV file in long form, one row per value, with the header
/// `epoch,batch,sample,token,wall_seconds,metric,value` (a long table takes metrics that
/// appear mid-run, such as evaluation results, without rewriting the header; pivot it by
/// `metric` for a wide one). Hyperparameters go to `<stem>.hyperparameters.json` beside it.
///
/// ```no_run
/// use flashover_callbacks::CsvLogger;
/// let csv = CsvLogger::create("runs/mnist/metrics.csv")?; // .logger(csv)
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct CsvLogger {
    sink: Sink,
}

/// The CSV header.
pub const CSV_HEADER: &str = "epoch,batch,sample,token,wall_seconds,metric,value";

impl CsvLogger {
    /// Creates (or truncates) the file at `path`, and its folder if needed, and writes the
    /// header.
    pub fn create(path: impl AsRef<Path>) -> crate::error::Result<Self> {
        let mut sink = Sink::open("csv_logger", path.as_ref(), false)?;
        sink.write(CSV_HEADER)?;
        sink.write("\n")?;
        Ok(CsvLogger { sink })
    }

    /// Appends to the file at `path` (for a resumed run), writing the header only if the
    /// file is new or empty. A file with another header is an error, not a mixed table.
    pub fn append(path: impl AsRef<Path>) -> crate::error::Result<Self> {
        let path = path.as_ref();
        let existing = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(CallbackError::io("csv_logger", path, e)),
        };
        let header = existing.split(|&b| b == b'\n').next().unwrap_or_default();
        if !existing.is_empty() && header != CSV_HEADER.as_bytes() {
            return Err(CallbackError::param(
                "csv_logger",
                "path",
                path.display(),
                format!("a CSV file written by this logger (header `{CSV_HEADER}`) or a new file"),
            ));
        }
        let mut sink = Sink::open("csv_logger", path, true)?;
        if existing.is_empty() {
            sink.write(CSV_HEADER)?;
            sink.write("\n")?;
        }
        Ok(CsvLogger { sink })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.sink.path
    }

    /// Where the hyperparameters go.
    pub fn hyperparameters_path(&self) -> PathBuf {
        let stem = self
            .sink
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "metrics".into());
        self.sink
            .path
            .with_file_name(format!("{stem}.hyperparameters.json"))
    }
}

/// A CSV field, quoted when it holds a comma, a quote or a line break (RFC 4180).
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

impl LoggerDestination for CsvLogger {
    fn name(&self) -> &str {
        "csv_logger"
    }

    fn log_hyperparameters(&mut self, params: &Map<String, Value>) -> Result<()> {
        let path = self.hyperparameters_path();
        let text = serde_json::to_string_pretty(&Value::Object(params.clone()))
            .unwrap_or_else(|_| "{}".into());
        std::fs::write(&path, text + "\n")
            .map_err(|e| CallbackError::io("csv_logger", &path, e))?;
        Ok(())
    }

    /// The image as `media/images/<tag>/<batch>.png` beside the file (the table itself holds
    /// numbers only).
    fn log_image(&mut self, ts: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        self.sink.media.write_image(tag, ts.batch, image)?;
        Ok(())
    }

    /// A copy as `media/files/<name>` beside the file.
    fn upload_file(&mut self, _ts: &Timestamp, name: &str, path: &Path) -> Result<()> {
        self.sink.media.copy_file(name, path)?;
        Ok(())
    }

    fn log_metrics(&mut self, ts: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let prefix = format!(
            "{},{},{},{},{}",
            ts.epoch,
            ts.batch,
            ts.sample,
            ts.token,
            ts.total_wall_time.as_secs_f64()
        );
        let mut text = String::with_capacity(metrics.len() * 48);
        for (k, v) in metrics {
            text.push_str(&prefix);
            text.push(',');
            text.push_str(&csv_field(k));
            text.push(',');
            text.push_str(&v.to_string());
            text.push('\n');
        }
        self.sink.write(&text)?;
        Ok(())
    }

    fn run_event(&mut self, event: Event, _ts: &Timestamp, _progress: &Progress) -> Result<()> {
        if flushes_at(event) {
            self.sink.flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn stamp(batch: u64) -> Timestamp {
        let mut ts = Timestamp::default();
        for _ in 0..batch {
            ts.advance_batch(32, 0, Duration::from_millis(7));
        }
        ts
    }

    fn progress() -> Progress {
        Progress {
            batches_per_epoch: 10,
            samples_per_epoch: 320,
            max_duration: flashover_core::time::Time::Epoch(1),
        }
    }

    const VALUES: &[(&str, f64)] = &[
        ("train/loss", 0.1 + 0.2),
        ("train/lr", 3.0e-3 / 7.0),
        ("odd, \"name\"", -1.0e-300),
        ("eval/test/accuracy", f64::NAN),
        ("big", f64::INFINITY),
    ];

    #[test]
    fn jsonl_round_trips_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/metrics.jsonl");
        let mut l = JsonlLogger::create(&path).unwrap();
        let mut hp = Map::new();
        hp.insert("lr".into(), Value::from(0.003));
        l.log_hyperparameters(&hp).unwrap();
        l.log_metrics(&stamp(3), VALUES).unwrap();
        l.run_event(Event::FitEnd, &stamp(3), &progress()).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["hyperparameters"]["lr"], 0.003);
        let rec = &lines[1];
        assert_eq!(rec["batch"], 3);
        assert_eq!(rec["sample"], 96);
        assert_eq!(rec["wall_seconds"].as_f64().unwrap(), 0.021);
        for (k, v) in VALUES {
            let back = &rec["metrics"][*k];
            let got = match back {
                Value::String(s) => s.parse::<f64>().unwrap(),
                n => n.as_f64().unwrap(),
            };
            assert!(
                got.to_bits() == v.to_bits() || (got.is_nan() && v.is_nan()),
                "{k}: {got} vs {v}"
            );
        }
    }

    #[test]
    fn csv_round_trips_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.csv");
        let mut l = CsvLogger::create(&path).unwrap();
        let mut hp = Map::new();
        hp.insert("seed".into(), Value::from(7));
        l.log_hyperparameters(&hp).unwrap();
        l.log_metrics(&stamp(2), VALUES).unwrap();
        l.run_event(Event::EpochEnd, &stamp(2), &progress())
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(CSV_HEADER));
        let rows: Vec<Vec<String>> = lines.map(parse_csv_line).collect();
        assert_eq!(rows.len(), VALUES.len());
        for (row, (k, v)) in rows.iter().zip(VALUES) {
            assert_eq!(row.len(), 7, "{row:?}");
            assert_eq!(row[1], "2");
            assert_eq!(row[2], "64");
            assert_eq!(&row[5], k);
            let got: f64 = row[6].parse().unwrap();
            assert!(
                got.to_bits() == v.to_bits() || (got.is_nan() && v.is_nan()),
                "{k}"
            );
        }
        let hp: Value =
            serde_json::from_str(&std::fs::read_to_string(l.hyperparameters_path()).unwrap())
                .unwrap();
        assert_eq!(hp["seed"], 7);
    }

    /// An RFC 4180 line parser, independent of the writer.
    fn parse_csv_line(line: &str) -> Vec<String> {
        let mut out = vec![String::new()];
        let mut quoted = false;
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match (c, quoted) {
                ('"', true) if chars.peek() == Some(&'"') => {
                    chars.next();
                    out.last_mut().unwrap().push('"');
                }
                ('"', _) => quoted = !quoted,
                (',', false) => out.push(String::new()),
                (c, _) => out.last_mut().unwrap().push(c),
            }
        }
        out
    }

    #[test]
    fn append_keeps_what_was_there() {
        let dir = tempfile::tempdir().unwrap();
        let (j, c) = (dir.path().join("m.jsonl"), dir.path().join("m.csv"));
        for round in 1..=2u64 {
            let mut jl = JsonlLogger::append(&j).unwrap();
            let mut cl = CsvLogger::append(&c).unwrap();
            jl.log_metrics(&stamp(round), &[("x", round as f64)])
                .unwrap();
            cl.log_metrics(&stamp(round), &[("x", round as f64)])
                .unwrap();
            jl.run_event(Event::FitEnd, &stamp(round), &progress())
                .unwrap();
            cl.run_event(Event::FitEnd, &stamp(round), &progress())
                .unwrap();
        }
        assert_eq!(std::fs::read_to_string(&j).unwrap().lines().count(), 2);
        let csv = std::fs::read_to_string(&c).unwrap();
        assert_eq!(csv.lines().filter(|l| *l == CSV_HEADER).count(), 1, "{csv}");
        assert_eq!(csv.lines().count(), 3);
        // `create` starts over.
        drop(JsonlLogger::create(&j).unwrap());
        assert_eq!(std::fs::read_to_string(&j).unwrap(), "");
        std::fs::write(&c, "a,b\n1,2\n").unwrap();
        let e = CsvLogger::append(&c).err().unwrap();
        assert!(e.to_string().contains("m.csv"), "{e}");
    }

    #[test]
    fn unwritable_path_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, "x").unwrap();
        let e = JsonlLogger::create(blocker.join("m.jsonl")).err().unwrap();
        assert!(e.to_string().contains("file"), "{e}");
        assert!(matches!(e, CallbackError::Io { .. }));
        let e = CsvLogger::create(blocker.join("m.csv")).err().unwrap();
        assert!(e.to_string().contains("csv_logger"), "{e}");
    }
}
