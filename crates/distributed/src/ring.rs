//! The ring all-reduce's plan: how a buffer is cut into one chunk per rank, and in which
//! order each step sends and receives them. Pure arithmetic, shared by the MPI transport and
//! its tests, so the summation order the crate documents is the one that runs.
//!
//! With `W` ranks and chunks `0..W`:
//! - reduce-scatter, steps `s = 0..W-1`: rank `r` sends chunk `(r - s) mod W` to rank `r+1`
//!   and receives chunk `(r - s - 1) mod W` from rank `r-1`, which it adds to its own (the
//!   received partial sum first, its own value second). After it, rank `r` holds the whole
//!   sum of chunk `(r + 1) mod W`, summed in the order `c, c+1, ..., c-1` (mod `W`) for chunk
//!   `c`.
//! - all-gather, steps `s = 0..W-1`: rank `r` sends chunk `(r + 1 - s) mod W` and receives
//!   chunk `(r - s) mod W`, which it copies. Every rank ends with the same bits.

/// The half-open element range of chunk `c` of a buffer of `len` elements cut into `parts`
/// nearly equal chunks (the first `len % parts` chunks one longer).
pub fn chunk_bounds(len: usize, parts: usize, c: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let base = len / parts;
    let extra = len % parts;
    let start = c * base + c.min(extra);
    let size = base + usize::from(c < extra);
    start..start + size
}

/// `(x - k) mod w` for ring arithmetic.
// Used by the MPI transport (feature `mpi`) and the in-process simulation (tests).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn back(x: usize, k: usize, w: usize) -> usize {
    (x + w * (k / w + 1) - k) % w
}

/// The chunks rank `rank` sends and receives at reduce-scatter step `step`.
// Used by the MPI transport (feature `mpi`) and the in-process simulation (tests).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn scatter_step(rank: usize, step: usize, world: usize) -> (usize, usize) {
    (back(rank, step, world), back(rank, step + 1, world))
}

/// The chunks rank `rank` sends and receives at all-gather step `step`.
// Used by the MPI transport (feature `mpi`) and the in-process simulation (tests).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn gather_step(rank: usize, step: usize, world: usize) -> (usize, usize) {
    (back(rank + 1, step, world), back(rank, step, world))
}

/// The whole ring all-reduce run in one process over `inputs` (one buffer per rank): what
/// the MPI transport computes, step for step, used to test its plan and order.
#[cfg(test)]
#[allow(clippy::needless_range_loop)] // ranks are indices into the per-rank buffers
pub(crate) fn simulate(inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let w = inputs.len();
    let len = inputs[0].len();
    let mut bufs = inputs.to_vec();
    for step in 0..w.saturating_sub(1) {
        let sent: Vec<Vec<f32>> = (0..w)
            .map(|r| bufs[r][chunk_bounds(len, w, scatter_step(r, step, w).0)].to_vec())
            .collect();
        for r in 0..w {
            let left = back(r, 1, w);
            let (_, recv) = scatter_step(r, step, w);
            assert_eq!(scatter_step(left, step, w).0, recv);
            for (mine, theirs) in bufs[r][chunk_bounds(len, w, recv)]
                .iter_mut()
                .zip(&sent[left])
            {
                // IEEE addition commutes: the order of the chunks' terms is what matters.
                *mine += *theirs;
            }
        }
    }
    for step in 0..w.saturating_sub(1) {
        let sent: Vec<Vec<f32>> = (0..w)
            .map(|r| bufs[r][chunk_bounds(len, w, gather_step(r, step, w).0)].to_vec())
            .collect();
        for r in 0..w {
            let left = back(r, 1, w);
            let (_, recv) = gather_step(r, step, w);
            assert_eq!(gather_step(left, step, w).0, recv);
            bufs[r][chunk_bounds(len, w, recv)].copy_from_slice(&sent[left]);
        }
    }
    bufs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for len in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for c in 0..parts {
                    let b = chunk_bounds(len, parts, c);
                    assert_eq!(b.start, next);
                    next = b.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn every_rank_gets_the_sum_in_the_documented_order() {
        // Values whose sum depends on the order in f32: 1e8 + 1 - 1e8 is 0 or 1.
        for w in 1..6 {
            let len = 13;
            let inputs: Vec<Vec<f32>> = (0..w)
                .map(|r| {
                    (0..len)
                        .map(|i| match (r + i) % 3 {
                            0 => 1e8,
                            1 => 1.0,
                            _ => -1e8,
                        } * (1.0 + i as f32 * 0.001))
                        .collect()
                })
                .collect();
            let out = simulate(&inputs);
            for c in 0..w {
                for i in chunk_bounds(len, w, c) {
                    // Chunk c is summed starting at rank c, then c+1, ... around the ring.
                    let mut acc = inputs[c][i];
                    for k in 1..w {
                        acc += inputs[(c + k) % w][i];
                    }
                    for (r, buf) in out.iter().enumerate() {
                        assert_eq!(
                            buf[i].to_bits(),
                            acc.to_bits(),
                            "world {w} rank {r} item {i}"
                        );
                    }
                }
            }
        }
    }
}
