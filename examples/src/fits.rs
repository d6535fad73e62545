//! Checks, before anything is allocated, that a model's shape can be trained on this machine
//! at all: a shape such as `--width 4000000000` otherwise fails at its first allocation
//! with "memory allocation of N bytes failed" and an abort (Rust's allocator does not return
//! an error a program could report).
//!
//! Only what training certainly needs is counted, so a refusal is never wrong: the
//! parameters, their gradients and the optimizer's state (`copies` of the parameters in all,
//! in `f32`), plus the one batch's logits. What else a run holds (activations, scratch) is
//! left to the run: a shape that passes may still be too large, and then fails as before.
//! Against host memory on the CPU backends (MemAvailable plus free swap, read from Linux's
//! `/proc/meminfo`; not checked where that file is absent); against 2^64 bytes (more than
//! any machine addresses) on the GPU backends, whose device memory Burn does not report.

/// Bytes of host memory this process can still take: `MemAvailable` plus `SwapFree`, or
/// `None` where `/proc/meminfo` cannot be read.
pub fn available_host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    Some(field("MemAvailable:")? + field("SwapFree:").unwrap_or(0))
}

/// A byte count for people: `23.4 GiB`, `1.0e22 bytes`.
pub fn human_bytes(bytes: u128) -> String {
    const UNITS: [&str; 7] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} bytes")
    } else if v >= 1024.0 {
        format!("{:.1e} bytes", bytes as f64)
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// The least memory training a model of `params` parameters needs: `copies` `f32` copies of
/// them (weights, gradients and the optimizer's state) and `logits` `f32` values.
pub fn least_training_bytes(params: u128, copies: u32, logits: u128) -> u128 {
    params
        .saturating_mul(4 * copies as u128)
        .saturating_add(logits.saturating_mul(4))
}

/// Refuses a model that cannot fit: `needed` bytes (from [`least_training_bytes`]) against
/// `available` (host memory on a CPU backend, `None` on a GPU backend, where only the 2^64
/// bound applies). `shape` names the flags and values that set the size, `what` what the
/// bytes hold; the error says what would be accepted.
pub fn check_fits(
    shape: &str,
    what: &str,
    needed: u128,
    available: Option<u64>,
) -> anyhow::Result<()> {
    let limit = available.map_or(u64::MAX as u128, |a| a as u128);
    if needed <= limit {
        return Ok(());
    }
    let room = match available {
        Some(a) => format!(
            "the {} of memory this machine has available",
            human_bytes(a as u128)
        ),
        None => "what any machine addresses (2^64 bytes)".to_string(),
    };
    anyhow::bail!(
        "{shape}: {what} need at least {}, more than {room}; accepted: a shape whose parameters and optimizer state fit in memory (a smaller --width, --layers or vocabulary)",
        human_bytes(needed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_memory_counts_every_copy_and_the_logits() {
        // 1,000 parameters x 4 copies x 4 bytes, plus 10 logits x 4 bytes.
        assert_eq!(least_training_bytes(1000, 4, 10), 16_040);
        assert_eq!(least_training_bytes(u128::MAX, 4, 1), u128::MAX);
        assert_eq!(human_bytes(512), "512 bytes");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(1u128 << 80), "1.2e24 bytes");
    }

    #[test]
    fn a_shape_that_cannot_fit_is_named_with_what_would_be_accepted() {
        assert!(check_fits("--width 8", "x", 1 << 20, Some(1 << 30)).is_ok());
        let e = check_fits(
            "--width 4000000000",
            "its parameters",
            1 << 40,
            Some(1 << 30),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--width 4000000000")
                && e.contains("1.0 TiB")
                && e.contains("1.0 GiB")
                && e.contains("smaller --width"),
            "{e}"
        );
        // Without a host limit (a GPU backend) only what no machine has is refused.
        assert!(check_fits("s", "x", 1 << 60, None).is_ok());
        assert!(check_fits("s", "x", 1 << 70, None).is_err());
    }

    #[test]
    fn this_machine_reports_its_memory() {
        if std::path::Path::new("/proc/meminfo").exists() {
            let a = available_host_memory().unwrap();
            assert!(a > 1 << 20, "{a}");
        }
    }
}
