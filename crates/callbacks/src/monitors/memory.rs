//! The memory monitor.

use flashover_core::callback::{Callback, Control};
use flashover_core::error::Result;
use flashover_core::setup::Setup;
use flashover_core::state::State;
use flashover_core::time::Time;

use super::{batch_interval, due};

/// Device memory as a backend reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes held by live tensors.
    pub in_use: u64,
    /// Bytes the backend has reserved from the device (in use or pooled).
    pub reserved: u64,
}

type DeviceReader = Box<dyn Fn() -> Option<DeviceMemory> + Send>;

/// Logs memory every `interval`: the process's resident set `memory/rss_bytes` and its peak
/// `memory/peak_rss_bytes` (from `/proc/self/status` on Linux; not logged elsewhere), and,
/// when given a reader for the device, `memory/device_in_use_bytes` and
/// `memory/device_reserved_bytes`.
///
/// Burn 0.21's generic `Backend` has no memory query, so the device reader comes from the
/// program, which knows its backend (the CubeCL backends, wgpu and CUDA, report through their
/// compute client's `memory_usage`); on the CPU backends the resident set is the figure.
///
/// ```
/// use flashover_callbacks::monitors::MemoryMonitor;
/// use flashover_core::time::Time;
/// let memory = MemoryMonitor::new(Time::Batch(10))?;
/// # let _ = memory;
/// # Ok::<(), flashover_callbacks::CallbackError>(())
/// ```
pub struct MemoryMonitor {
    every: Time,
    device: Option<DeviceReader>,
}

impl MemoryMonitor {
    /// Logs every `every` (batches or epochs, greater than zero).
    pub fn new(every: Time) -> crate::error::Result<Self> {
        Ok(MemoryMonitor {
            every: batch_interval("memory_monitor", every)?,
            device: None,
        })
    }

    /// Also logs the device memory that `read` reports (`None` when it cannot tell).
    pub fn with_device_reader(
        mut self,
        read: impl Fn() -> Option<DeviceMemory> + Send + 'static,
    ) -> Self {
        self.device = Some(Box::new(read));
        self
    }
}

/// The process's resident set and its peak, in bytes, where the system reports them
/// (Linux: `VmRSS` and `VmHWM` in `/proc/self/status`).
pub fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

impl<S: Setup> Callback<S> for MemoryMonitor {
    fn name(&self) -> &str {
        "memory_monitor"
    }

    fn batch_end(&mut self, state: &State<S>, ctl: &mut Control<'_>) -> Result<()> {
        let ts = state.timestamp();
        if !due(
            self.every,
            ts.batch,
            ts.epoch,
            ts.batch_in_epoch,
            state.batches_per_epoch(),
        ) {
            return Ok(());
        }
        let mut values = Vec::with_capacity(4);
        if let Some((rss, peak)) = process_memory() {
            values.push(("memory/rss_bytes", rss as f64));
            values.push(("memory/peak_rss_bytes", peak as f64));
        }
        if let Some(m) = self.device.as_ref().and_then(|read| read()) {
            values.push(("memory/device_in_use_bytes", m.in_use as f64));
            values.push(("memory/device_reserved_bytes", m.reserved as f64));
        }
        if values.is_empty() {
            return Ok(());
        }
        ctl.logger().log_metrics(ts, &values)
    }
}
