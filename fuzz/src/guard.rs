//! The allocation guard: a global allocator that passes every request to the system allocator
//! and records the largest single request since the last reset. A parser that allocates far
//! more than its input could justify (a header that claims gigabytes) is a finding even when
//! the machine has the memory. Requests above [`HARD_LIMIT`] are refused (the process aborts
//! with "memory allocation failed"), so a hostile input cannot take the machine down.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Requests above this are refused outright.
pub const HARD_LIMIT: usize = 8 << 30;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, watched. Install it with
/// `#[global_allocator] static A: Guard = Guard;` in a binary.
#[derive(Debug, Default)]
pub struct Guard;

/// The largest single allocation since the last [`reset_largest`].
pub fn largest() -> usize {
    LARGEST.load(Ordering::Relaxed)
}

/// Starts a new measurement.
pub fn reset_largest() {
    LARGEST.store(0, Ordering::Relaxed);
}

fn note(size: usize) -> bool {
    LARGEST.fetch_max(size, Ordering::Relaxed);
    size <= HARD_LIMIT
}

// SAFETY: every method forwards to `System` with the caller's own arguments (whose contracts
// `GlobalAlloc` already imposes on the caller) or returns null, which `GlobalAlloc` allows to
// signal failure; recording a size in an atomic neither allocates nor unwinds.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if note(layout.size()) {
            // SAFETY: forwarded unchanged.
            unsafe { System.alloc(layout) }
        } else {
            std::ptr::null_mut()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if note(layout.size()) {
            // SAFETY: forwarded unchanged.
            unsafe { System.alloc_zeroed(layout) }
        } else {
            std::ptr::null_mut()
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` came from `System` through this allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if note(new_size) {
            // SAFETY: forwarded unchanged.
            unsafe { System.realloc(ptr, layout, new_size) }
        } else {
            std::ptr::null_mut()
        }
    }
}
