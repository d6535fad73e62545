//! The programs' allocator: mimalloc (see [`crate::use_mimalloc`]), watched for failure.
//!
//! When a process reaches its memory limit (`prlimit --data`, a container's), an allocation
//! fails and the standard library prints `memory allocation of N bytes failed` and aborts,
//! which tells a user neither that a limit was reached nor what to change. The hook the
//! standard library has for that moment (`std::alloc::set_alloc_error_hook`) is unstable, so
//! this module wraps the allocator instead: every request goes to mimalloc unchanged, and
//! the first one it refuses is reported on standard error, in plain words, before the
//! standard library aborts the process as it always does. The report names the request, the
//! bytes the program held, the process's data limit and the flags that lower a process's
//! memory.
//!
//! It also keeps freed memory for reuse instead of handing it back to the kernel after
//! mimalloc's default second ([`PURGE_DELAY_MS`]), set once at the first allocation unless
//! the user set `MIMALLOC_PURGE_DELAY`.
//!
//! Hand-written because it has to be: the report is written from inside the allocator, so it
//! may not allocate (it formats into a buffer on the stack and writes it with one system
//! call), and counting the bytes held means wrapping every method. The `unsafe` here is the
//! `GlobalAlloc` impl and the calls it forwards unchanged, plus `getrlimit`, `write`,
//! `getenv` and `mi_option_set`.

use std::alloc::{GlobalAlloc, Layout};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use mimalloc::MiMalloc;

/// Bytes the program holds through [`Allocator`] (requested sizes).
static HELD: AtomicUsize = AtomicUsize::new(0);
/// Whether a failure was reported already (one report per process).
static REPORTED: AtomicBool = AtomicBool::new(false);
/// Whether [`configure`] ran.
static CONFIGURED: AtomicBool = AtomicBool::new(false);

/// How long freed memory stays with the allocator before it is handed back to the kernel,
/// in milliseconds: never (mimalloc's `purge_delay` of -1; its default is 1 second). A
/// training step frees and allocates tens of megabytes of activations and gradients, and
/// mimalloc does not hand out the most recently freed memory first: with the default,
/// about a gigabyte a minute went back to the kernel and came back as fresh pages, whose
/// page faults and zeroing were 4% of the GPT's step on one thread and 6% of its tokens per
/// second on two, and with 10 seconds the faults started again after 10 seconds of
/// training. Kept memory is reused, so the process's resident memory stays near its high
/// point (330 MiB against 312 MiB for 120 batches of the GPT, with 5 s less time in the
/// kernel).
pub const PURGE_DELAY_MS: i64 = -1;

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_e`, the same in mimalloc 2
/// and 3; `libmimalloc-sys` names no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Sets [`PURGE_DELAY_MS`] the first time it runs, unless `MIMALLOC_PURGE_DELAY` is set (the
/// user's choice stands). Runs at the program's first allocation, before `main`, while
/// the process has one thread; never allocates.
fn configure() {
    if CONFIGURED.load(Ordering::Relaxed) || CONFIGURED.swap(true, Ordering::Relaxed) {
        return;
    }
    // SAFETY: `getenv` reads the environment with a NUL-terminated name; nothing changes the
    // environment concurrently (this runs at the first allocation, before `main` starts any
    // thread). `mi_option_set` takes an option index of mimalloc's and a value.
    #[allow(unsafe_code)]
    unsafe {
        if libc::getenv(c"MIMALLOC_PURGE_DELAY".as_ptr()).is_null() {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as _);
        }
    }
}

/// mimalloc, with a plain-words report of the first allocation it refuses.
#[derive(Debug, Default, Clone, Copy)]
pub struct Allocator;

/// Bytes the program holds through the allocator now (what it asked for, not what the
/// allocator keeps from the system).
pub fn held_bytes() -> usize {
    HELD.load(Ordering::Relaxed)
}

/// The report for a refused request of `requested` bytes while the program held `held`,
/// under a data limit of `limit` bytes (`None`: no limit set), written into `out`; returns
/// the bytes written. Writes into a fixed buffer: the caller is the allocator.
pub fn out_of_memory_report(
    requested: usize,
    held: usize,
    limit: Option<u64>,
    out: &mut [u8],
) -> usize {
    const MIB: f64 = 1024.0 * 1024.0;
    let capacity = out.len();
    let mut w: &mut [u8] = out;
    let _ = write!(
        w,
        "error: out of memory: this process could not allocate {requested} more bytes ({:.1} MiB) while holding {:.1} MiB; ",
        requested as f64 / MIB,
        held as f64 / MIB,
    );
    let _ = match limit {
        Some(l) => write!(
            w,
            "its data limit (RLIMIT_DATA, as `prlimit --data` sets it) is {l} bytes ({:.1} MiB). ",
            l as f64 / MIB
        ),
        None => write!(
            w,
            "it has no data limit (RLIMIT_DATA), so the machine's or a container's memory ran out. "
        ),
    };
    let _ = writeln!(
        w,
        "Each process must hold the model's weights, gradients and optimizer state and the batch's activations: `--sharding shard_grad_op` over several `--processes` divides the gradients and optimizer state among the processes; a smaller `--batch-size` or `--microbatch-size`, or `--activation-checkpointing` (the GPT example), lowers the activations."
    );
    capacity - w.len()
}

/// The process's data limit (`RLIMIT_DATA`), `None` when unlimited.
fn data_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into the valid, exclusively borrowed `limit`.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_DATA, &mut limit) };
    (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Reports the first refused request; never allocates.
fn report(requested: usize) {
    if REPORTED.swap(true, Ordering::Relaxed) {
        return;
    }
    let mut buf = [0u8; 1024];
    let n = out_of_memory_report(requested, held_bytes(), data_limit(), &mut buf);
    // SAFETY: writes the first `n` initialised bytes of `buf` to standard error; a failed
    // write is ignored (the process aborts next either way).
    #[allow(unsafe_code)]
    let _ = unsafe { libc::write(2, buf.as_ptr().cast(), n) };
}

fn note(p: *mut u8, size: usize) -> *mut u8 {
    if p.is_null() {
        report(size);
    } else {
        HELD.fetch_add(size, Ordering::Relaxed);
    }
    p
}

// SAFETY: every method forwards to `MiMalloc` with the caller's own arguments (whose
// contracts `GlobalAlloc` already imposes on the caller) and returns what it returns;
// counting in an atomic and reporting (which writes to a stack buffer and makes one system
// call) neither allocate nor unwind.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        configure();
        // SAFETY: forwarded unchanged.
        note(unsafe { MiMalloc.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        note(unsafe { MiMalloc.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged; `ptr` came from `MiMalloc` through this allocator.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; `ptr` came from `MiMalloc` through this allocator.
        let p = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if p.is_null() {
            report(new_size);
        } else {
            HELD.fetch_sub(layout.size(), Ordering::Relaxed);
            HELD.fetch_add(new_size, Ordering::Relaxed);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(requested: usize, held: usize, limit: Option<u64>) -> String {
        let mut buf = [0u8; 1024];
        let n = out_of_memory_report(requested, held, limit, &mut buf);
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn the_report_names_the_request_the_limit_and_what_lowers_memory() {
        let t = text(16 << 20, 900 << 20, Some(1_000_000_000));
        assert!(t.starts_with("error: out of memory: "), "{t}");
        assert!(t.contains("16777216 more bytes (16.0 MiB)"), "{t}");
        assert!(t.contains("holding 900.0 MiB"), "{t}");
        assert!(t.contains("1000000000 bytes (953.7 MiB)"), "{t}");
        assert!(t.contains("RLIMIT_DATA"), "{t}");
        for flag in ["--sharding shard_grad_op", "--processes", "--batch-size"] {
            assert!(t.contains(flag), "{t}");
        }
        assert!(t.ends_with('\n') && t.len() < 1024, "{t}");
        let t = text(1, 0, None);
        assert!(t.contains("no data limit"), "{t}");
    }

    /// The option index is the one `MIMALLOC_PURGE_DELAY` sets (checked in a child process
    /// of this test binary, started with that variable), and `configure` sets it unless the
    /// variable is set.
    #[test]
    fn the_purge_delay_option_is_mimallocs() {
        const CHILD: &str = "FLASHOVER_TEST_PURGE_DELAY_CHILD";
        // SAFETY: reads an option of mimalloc's by its index.
        #[allow(unsafe_code)]
        let current = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) } as i64;
        if std::env::var_os(CHILD).is_some() {
            // Nothing in this process set the option: mimalloc read it from the environment.
            assert_eq!(current(), 1234);
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "allocator::tests::the_purge_delay_option_is_mimallocs",
            ])
            .env(CHILD, "1")
            .env("MIMALLOC_PURGE_DELAY", "1234")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "the child: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        configure();
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(current(), PURGE_DELAY_MS);
        }
    }

    #[test]
    fn the_allocator_counts_what_it_hands_out() {
        let before = held_bytes();
        let layout = Layout::from_size_align(1 << 20, 8).unwrap();
        // SAFETY: a non-zero layout; the block is freed with the same layout.
        #[allow(unsafe_code)]
        unsafe {
            let p = Allocator.alloc(layout);
            assert!(!p.is_null());
            assert!(held_bytes() >= before + (1 << 20));
            Allocator.dealloc(p, layout);
        }
    }
}
