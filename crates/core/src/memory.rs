//! Running out of device memory, for automatic microbatching
//! ([`TrainerBuilder::auto_microbatching`](crate::trainer::TrainerBuilder::auto_microbatching)).
//!
//! How Burn 0.21's CubeCL backends (wgpu, CUDA) fail when memory runs out: device memory is
//! reserved lazily on CubeCL's device thread, and both servers `unwrap()` the reservation
//! there. A reservation that fails (CubeCL's own `can't allocate buffer of size: N`, which the
//! CUDA storage also returns for `CUDA_ERROR_OUT_OF_MEMORY`; or wgpu's uncaptured
//! `Out of Memory` error, which wgpu turns into a panic) is therefore a panic on the device
//! thread, which CubeCL catches and only logs. The tensor's handle stays unbound; every later
//! kernel that touches it records an error, reads of such tensors return *whatever the buffer
//! slot held* (zeros, in practice: silently wrong numbers), and the next `Backend::sync`
//! returns an error (and clears the errors, after which the device works again). No call
//! returns the out-of-memory error itself.
//!
//! So the trainer detects it in two parts, at the narrowest points that are sound:
//! - a panic hook counts, while a [`DeviceMemoryWatch`] lives (a trainer on a CubeCL backend
//!   or with automatic microbatching holds one; `TrainerBuilder::watch_device_memory` turns it
//!   on or off), panics whose message is one of the allocation
//!   failures above ([`allocation_failures`]); it prints a one-line warning for them instead of
//!   the panic report (they are expected and handled), and passes every other panic on (but
//!   for the assertion CubeCL fails when a kernel meets the unbound handle of such a failure
//!   in a memory slot another tensor holds, after a failure: a consequence, not news). The
//!   hook is chained in front of the program's when the first watch starts, once per process,
//!   and hands every panic to that one while no watch lives: a library cannot take a hook back
//!   out once other code may have chained its own in front of it, so it is made inert instead;
//!   a program on the CPU backends never has it installed;
//! - the trainer synchronises the device before a batch's forward passes and after its loss
//!   read (so that every queued allocation has run): a count that moved during the batch is
//!   an out-of-memory in the batch, retried with smaller microbatches (the sync itself may
//!   succeed then: see `Trainer::ran_out_of_memory`); a count that moved before it (the
//!   previous optimizer step, the batch's data) is [`CoreError::OutOfMemory`], since smaller
//!   microbatches do not help there; a sync error without a failure is [`CoreError::Device`].
//!   Without automatic microbatching there is no sync: a count that moved by the batch's loss
//!   read is [`CoreError::OutOfMemory`] naming the microbatch size (a failure in the last
//!   backward pass, still queued at the read, is caught at the next batch's read).
//!
//! The count is per device, told apart by the name CubeCL gives each device's thread (which
//! carries the device id); two devices of different CubeCL runtimes with the same id in one
//! process (a wgpu and a CUDA device 0) would share it. The CPU backends have no such failure mode (a failed host allocation aborts the
//! process), so automatic microbatching never retries there.
//!
//! [`CoreError::Device`]: crate::CoreError::Device
//! [`CoreError::OutOfMemory`]: crate::CoreError::OutOfMemory
//!
//! [`RunningStats`] snapshots what a forward pass changes besides its outputs (the running
//! statistics of batch normalisation), so that a retried batch starts from the same model.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{Backend, DeviceId};
use burn::tensor::{Tensor, TensorPrimitive};

/// What CubeCL's memory management says when no pool can hold a reservation (its
/// `IoError::BufferTooBig`, which the CUDA storage also returns on out-of-memory).
const CUBECL_TOO_BIG: &str = "can't allocate buffer of size";
/// wgpu's out-of-memory error (`wgpu::Error::OutOfMemory`), as its default handler panics.
const WGPU_OUT_OF_MEMORY: &str = "Out of Memory";

/// In CubeCL's assertion that a handle's memory slot is the handle's own.
const UNBOUND_HANDLE: &str = "ManagedMemoryDescriptor";

/// Failed allocations by the device they failed on: CubeCL runs each device's work on a
/// thread named `DS{U|D}-{type_id}-{index_id}` after the device's id, which is where the
/// failure panics. `None`: a panic on another thread, counted against every device.
static FAILURES: Mutex<BTreeMap<Option<(u16, u16)>, u64>> = Mutex::new(BTreeMap::new());
static HOOK: Once = Once::new();
/// Live [`DeviceMemoryWatch`]es: the hook acts only while there is one.
static WATCHES: AtomicUsize = AtomicUsize::new(0);

/// Whether a panic message is one of the device allocation failures above.
pub fn is_allocation_failure(message: &str) -> bool {
    message.contains(CUBECL_TOO_BIG) || message.contains(WGPU_OUT_OF_MEMORY)
}

/// The device id in the name of a CubeCL device thread (`DSD-3-0` -> `(3, 0)`).
fn device_of_thread(name: &str) -> Option<(u16, u16)> {
    let rest = name.strip_prefix("DS")?;
    let mut parts = rest.splitn(3, '-');
    let _stage = parts.next()?;
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn failures() -> std::sync::MutexGuard<'static, BTreeMap<Option<(u16, u16)>, u64>> {
    // A panic while the lock is held cannot leave the map half-written (one insert).
    FAILURES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a backend's device memory fails the way this module watches for: the CubeCL
/// backends (wgpu, CUDA; `Backend::name` says `cubecl<...>`, also under fusion and autodiff).
/// The CPU backends abort on a failed host allocation instead, so nothing is watched there.
pub fn fails_by_panicking(backend_name: &str) -> bool {
    backend_name.contains("cubecl")
}

/// While it lives, device allocation failures are counted ([`allocation_failures`]) and their
/// panic report is replaced by a one-line warning. The trainer holds one for its lifetime when
/// its backend's memory fails that way ([`fails_by_panicking`]; see
/// `TrainerBuilder::watch_device_memory`).
///
/// The scope is the watch's, not the process's: the panic hook this needs is chained in front
/// of the program's hook when the first watch starts (once per process: a hook cannot be
/// taken back out safely once other code may have chained its own in front of it), and while
/// no watch lives it hands every panic, allocation failures included, to the hook that was
/// there before, untouched.
#[must_use = "allocation failures are counted only while the watch lives"]
pub struct DeviceMemoryWatch(());

impl DeviceMemoryWatch {
    /// Starts watching (installing the hook at the first watch of the process).
    pub fn start() -> Self {
        install_allocation_failure_hook();
        WATCHES.fetch_add(1, Ordering::SeqCst);
        DeviceMemoryWatch(())
    }

    /// Whether any watch is live in this process.
    pub fn is_active() -> bool {
        WATCHES.load(Ordering::SeqCst) > 0
    }
}

impl Drop for DeviceMemoryWatch {
    fn drop(&mut self) {
        WATCHES.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Installs (once per process) the panic hook that counts device allocation failures while a
/// [`DeviceMemoryWatch`] lives; every other panic, and every panic while none lives, goes to
/// the hook that was there before.
fn install_allocation_failure_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !DeviceMemoryWatch::is_active() {
                return previous(info);
            }
            let payload = info.payload();
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied());
            let device = std::thread::current().name().and_then(device_of_thread);
            match message {
                Some(m) if is_allocation_failure(m) => {
                    *failures().entry(device).or_default() += 1;
                    let first = m
                        .lines()
                        .find(|l| l.contains(CUBECL_TOO_BIG) || l.contains(WGPU_OUT_OF_MEMORY));
                    tracing::warn!(
                        failure = first.unwrap_or(m).trim(),
                        device = ?device,
                        "device allocation failed"
                    );
                }
                // What a kernel meeting the unbound handle of a failed allocation panics with
                // when another tensor holds the handle's memory slot: a consequence of a
                // failure counted above on the same device, not news.
                Some(m) if m.contains(UNBOUND_HANDLE) && failures().contains_key(&device) => {
                    tracing::debug!(panic = m, "kernel on the handle of a failed allocation");
                }
                _ => previous(info),
            }
        }));
    });
}

/// How many device allocation failures the hook has counted in this process on the device
/// `id` (`DeviceOps::id`), plus any on threads that are not a device's.
pub fn allocation_failures(id: DeviceId) -> u64 {
    let f = failures();
    f.get(&Some((id.type_id, id.index_id)))
        .copied()
        .unwrap_or(0)
        + f.get(&None).copied().unwrap_or(0)
}

/// The tensors of a model that are not trained parameters (the running statistics of batch
/// normalisation, and frozen parameters), by id: what a forward pass may change in place.
/// [`restore`](Self::restore) puts them back. Holding them copies nothing (tensors are
/// immutable handles).
pub struct RunningStats<B: Backend> {
    saved: HashMap<ParamId, TensorPrimitive<B>>,
}

impl<B: Backend> RunningStats<B> {
    /// The model's running state now.
    pub fn take<M: Module<B>>(model: &M) -> Self {
        struct Collect<B: Backend>(HashMap<ParamId, TensorPrimitive<B>>);
        impl<B: Backend> ModuleVisitor<B> for Collect<B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let t = param.val();
                if !t.is_require_grad() {
                    self.0.insert(param.id, t.into_primitive());
                }
            }
        }
        let mut c = Collect(HashMap::new());
        model.visit(&mut c);
        Self { saved: c.0 }
    }

    /// How many tensors the snapshot holds.
    pub fn len(&self) -> usize {
        self.saved.len()
    }

    /// Whether the model had no such tensors.
    pub fn is_empty(&self) -> bool {
        self.saved.is_empty()
    }

    /// `model` with the snapshot's tensors put back (Burn's running state is shared between
    /// clones of a module, so a clone taken before the batch would not have kept them).
    pub fn restore<M: Module<B>>(&self, model: M) -> M {
        struct Put<'a, B: Backend>(&'a HashMap<ParamId, TensorPrimitive<B>>);
        impl<B: Backend> ModuleMapper<B> for Put<'_, B> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                match self.0.get(&param.id) {
                    Some(saved) => {
                        let saved = Tensor::<B, D>::from_primitive(saved.clone());
                        param.map(|_| saved)
                    }
                    None => param,
                }
            }
        }
        if self.saved.is_empty() {
            return model;
        }
        model.map(&mut Put(&self.saved))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_failures_are_told_from_other_panics() {
        assert!(is_allocation_failure(
            "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 4194304\nNo backtrace"
        ));
        assert!(is_allocation_failure("wgpu error: Out of Memory\n"));
        assert!(!is_allocation_failure(
            "index out of bounds: the len is 3 but the index is 7"
        ));
        assert!(!is_allocation_failure(
            "couldn't find resource for that handle"
        ));
    }

    #[test]
    fn device_threads_are_told_apart_by_name() {
        assert_eq!(device_of_thread("DSD-3-0"), Some((3, 0)));
        assert_eq!(device_of_thread("DSU-5-12"), Some((5, 12)));
        assert_eq!(device_of_thread("main"), None);
        assert_eq!(device_of_thread("DSD-x-0"), None);
    }

    #[test]
    fn the_hook_counts_allocation_failures_by_device_and_passes_other_panics_on() {
        let _watch = DeviceMemoryWatch::start();
        let ours = DeviceId::new(2, 9);
        let other = DeviceId::new(2, 10);
        let (before, before_other) = (allocation_failures(ours), allocation_failures(other));
        // As on CubeCL's thread for the device of type 2, index 9 (wgpu's `VirtualGpu(9)`).
        let r = std::thread::Builder::new()
            .name("DSD-2-9".into())
            .spawn(|| {
                panic!("called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 64")
            })
            .unwrap()
            .join();
        assert!(r.is_err());
        assert_eq!(allocation_failures(ours), before + 1);
        assert_eq!(allocation_failures(other), before_other);
        let r = std::panic::catch_unwind(|| panic!("something else"));
        assert!(r.is_err());
        assert_eq!(allocation_failures(ours), before + 1);
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;

    /// A panic like CubeCL's on the device thread of `(type_id, index_id)`.
    fn fail_on_device(type_id: u16, index_id: u16) {
        let _ = std::thread::Builder::new()
            .name(format!("DSD-{type_id}-{index_id}"))
            .spawn(|| panic!("can't allocate buffer of size: 1024"))
            .unwrap()
            .join();
    }

    #[test]
    fn failures_are_counted_only_while_a_watch_lives() {
        // A device id no other test uses (tests share the process and its hook).
        let id = DeviceId {
            type_id: 977,
            index_id: 5,
        };
        let watch = DeviceMemoryWatch::start();
        fail_on_device(977, 5);
        assert_eq!(allocation_failures(id), 1);
        drop(watch);
        // Another test's watch may be live meanwhile; only when none is does the panic pass
        // through uncounted.
        if !DeviceMemoryWatch::is_active() {
            fail_on_device(977, 5);
            if !DeviceMemoryWatch::is_active() {
                assert_eq!(allocation_failures(id), 1);
            }
        }
        assert!(fails_by_panicking("autodiff<fusion<cubecl<wgpu>>>"));
        assert!(!fails_by_panicking("autodiff<flex>"));
        assert!(!fails_by_panicking("ndarray"));
    }
}
