//! Logging: a [`Logger`] hands metrics, hyperparameters, text, images and files to every
//! [`LoggerDestination`] the user added. Destinations see events too (at `INIT` before anyone
//! else), but only the timestamp, never the model: a logger records, it does not steer.

use std::path::Path;

use derive_new::new;
use serde_json::Value;

use crate::error::{CoreError, Result};
use crate::event::Event;
use crate::time::{Progress, Timestamp};
use crate::world::{OnEveryRank, Ranks, World};

/// An image to log: 8-bit pixels, row by row, each pixel's channels together (grey, RGB or
/// RGBA: 1, 3 or 4 channels). Composer's `log_images` takes tensors; a destination here gets
/// pixels, so that each encodes them once in its own format (TensorBoard and MLflow PNG).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    width: u32,
    height: u32,
    channels: u8,
    pixels: Vec<u8>,
}

impl Image {
    /// An image of `width` x `height` pixels of `channels` (1, 3 or 4) bytes each; an error
    /// unless `pixels` holds exactly that many bytes and neither side is zero.
    pub fn new(width: u32, height: u32, channels: u8, pixels: Vec<u8>) -> Result<Self> {
        if !matches!(channels, 1 | 3 | 4) {
            return Err(CoreError::config(
                "image channels",
                channels,
                "1 (grey), 3 (RGB) or 4 (RGBA)",
            ));
        }
        if width == 0 || height == 0 {
            return Err(CoreError::config(
                "image size",
                format!("{width}x{height}"),
                "at least one pixel each way",
            ));
        }
        let want = width as u64 * height as u64 * channels as u64;
        if pixels.len() as u64 != want {
            return Err(CoreError::config(
                "image pixels",
                format!("{} bytes", pixels.len()),
                format!("{want} bytes ({width}x{height}, {channels} channel(s) of one byte)"),
            ));
        }
        Ok(Image {
            width,
            height,
            channels,
            pixels,
        })
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// Bytes per pixel: 1 (grey), 3 (RGB) or 4 (RGBA).
    pub fn channels(&self) -> u8 {
        self.channels
    }

    /// The pixels, row by row from the top, each pixel's channels together.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }
}

/// Where logged values go: a console, a file, a dashboard.
///
/// Every method defaults to doing nothing. An `Err` from any method stops training with that
/// error (a logger that cannot write is a failure, not something to hide).
pub trait LoggerDestination: Send {
    /// A name for error messages.
    fn name(&self) -> &str;

    /// Called once per run, at the first `FIT_START` (before any callback sees it), with the
    /// run's configuration.
    fn log_hyperparameters(&mut self, params: &serde_json::Map<String, Value>) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Called with named values at a point in time.
    fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        let _ = (timestamp, metrics);
        Ok(())
    }

    /// Called with a piece of text (a generated sample, a note) under `tag` at a point in
    /// time. Destinations that cannot show text ignore it (the default).
    fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        let _ = (timestamp, tag, text);
        Ok(())
    }

    /// Called with an image under `tag` at a point in time (Composer's `log_images`): a grid
    /// of inputs, a plot. Destinations that cannot show images ignore it (the default).
    fn log_image(&mut self, timestamp: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        let _ = (timestamp, tag, image);
        Ok(())
    }

    /// Called with a file to keep under `name` (a relative path with `/` separators; Composer's
    /// `upload_file`): final weights, a plot, a summary. The file exists when this is called
    /// and may be replaced or removed afterwards, so a destination that keeps it reads or
    /// links it before returning. Destinations that keep no files ignore it (the default).
    fn upload_file(&mut self, timestamp: &Timestamp, name: &str, path: &Path) -> Result<()> {
        let _ = (timestamp, name, path);
        Ok(())
    }

    /// What this destination must keep across a resumption (the remote run it writes to),
    /// saved in checkpoints under `logger/<name>` beside the callbacks' states (default:
    /// nothing).
    fn state_dict(&self) -> Value {
        Value::Null
    }

    /// Restores what `state_dict` returned, before the resumed run's first event.
    fn load_state_dict(&mut self, state: Value) -> Result<()> {
        let _ = state;
        Ok(())
    }

    /// Called at every event, after algorithms and callbacks (at `INIT`, before them), with
    /// where the run stands and how long it is to be (`progress.max_duration`).
    fn run_event(
        &mut self,
        event: Event,
        timestamp: &Timestamp,
        progress: &Progress,
    ) -> Result<()> {
        let _ = (event, timestamp, progress);
        Ok(())
    }

    /// The ranks of a data-parallel run on which this destination receives anything.
    /// Default: rank 0 only, since a logger writes; wrap it in
    /// [`OnEveryRank`] to log on every rank.
    fn ranks(&self) -> Ranks {
        Ranks::Main
    }
}

/// Fans logged values out to every destination (`Logger::new(destinations)`).
#[derive(Default, new)]
pub struct Logger {
    destinations: Vec<Box<dyn LoggerDestination>>,
}

impl Logger {
    /// Keeps only the destinations that act on this rank of `world` (see
    /// [`LoggerDestination::ranks`]); the others never see a value.
    pub fn for_rank(mut self, world: World) -> Self {
        self.destinations.retain(|d| world.runs(d.ranks()));
        self
    }

    /// Whether there is nowhere to log to (the trainer then skips building log records).
    pub fn is_empty(&self) -> bool {
        self.destinations.is_empty()
    }

    /// Logs named values to every destination.
    pub fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        for d in &mut self.destinations {
            d.log_metrics(timestamp, metrics)?;
        }
        Ok(())
    }

    /// Logs text under `tag` to every destination that shows text.
    pub fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        for d in &mut self.destinations {
            d.log_text(timestamp, tag, text)?;
        }
        Ok(())
    }

    /// Logs an image under `tag` to every destination that shows images.
    pub fn log_image(&mut self, timestamp: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        for d in &mut self.destinations {
            d.log_image(timestamp, tag, image)?;
        }
        Ok(())
    }

    /// Hands the file at `path` to every destination that keeps files, under `name`.
    pub fn upload_file(&mut self, timestamp: &Timestamp, name: &str, path: &Path) -> Result<()> {
        check_file_name(name)?;
        for d in &mut self.destinations {
            d.upload_file(timestamp, name, path)?;
        }
        Ok(())
    }

    /// Every destination's saved state, keyed `logger/<name>` (`Null` for those with nothing
    /// to save), in registration order.
    pub(crate) fn states(&self) -> Vec<(String, Value)> {
        self.destinations
            .iter()
            .map(|d| (format!("logger/{}", d.name()), d.state_dict()))
            .collect()
    }

    /// The destinations, to restore their states in registration order.
    pub(crate) fn destinations_mut(
        &mut self,
    ) -> impl Iterator<Item = &mut Box<dyn LoggerDestination>> {
        self.destinations.iter_mut()
    }

    /// Logs the run's configuration to every destination.
    pub fn log_hyperparameters(&mut self, params: &serde_json::Map<String, Value>) -> Result<()> {
        for d in &mut self.destinations {
            d.log_hyperparameters(params)?;
        }
        Ok(())
    }

    pub(crate) fn run_event(
        &mut self,
        event: Event,
        timestamp: &Timestamp,
        progress: &Progress,
    ) -> Result<()> {
        for d in &mut self.destinations {
            d.run_event(event, timestamp, progress)?;
        }
        Ok(())
    }
}

impl<T: LoggerDestination> LoggerDestination for OnEveryRank<T> {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn log_hyperparameters(
        &mut self,
        params: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        self.0.log_hyperparameters(params)
    }
    fn log_metrics(&mut self, timestamp: &Timestamp, metrics: &[(&str, f64)]) -> Result<()> {
        self.0.log_metrics(timestamp, metrics)
    }
    fn log_text(&mut self, timestamp: &Timestamp, tag: &str, text: &str) -> Result<()> {
        self.0.log_text(timestamp, tag, text)
    }
    fn log_image(&mut self, timestamp: &Timestamp, tag: &str, image: &Image) -> Result<()> {
        self.0.log_image(timestamp, tag, image)
    }
    fn upload_file(&mut self, timestamp: &Timestamp, name: &str, path: &Path) -> Result<()> {
        self.0.upload_file(timestamp, name, path)
    }
    fn state_dict(&self) -> Value {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, state: Value) -> Result<()> {
        self.0.load_state_dict(state)
    }
    fn run_event(
        &mut self,
        event: Event,
        timestamp: &Timestamp,
        progress: &Progress,
    ) -> Result<()> {
        self.0.run_event(event, timestamp, progress)
    }
    fn ranks(&self) -> Ranks {
        Ranks::Every
    }
}

/// Checks a name given to [`Logger::upload_file`]: a relative path of plain components
/// (no `..`, no leading `/`, no empty parts), which every destination can use as a file name
/// under its own folder or prefix.
pub fn check_file_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && !name.contains('\\')
        && name
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    if ok {
        Ok(())
    } else {
        Err(CoreError::config(
            "uploaded file name",
            name,
            "a relative path such as `checkpoints/ep1/model.safetensors` (parts separated by `/`, none empty, `.` or `..`)",
        ))
    }
}
