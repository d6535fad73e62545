//! Low-rank factors of a weight matrix from its truncated singular value decomposition, for
//! Factorize's surgery: `W ≈ P Q` with `P = U_r sqrt(S_r)` and `Q = sqrt(S_r) V_r^T`, the
//! best rank-`r` approximation of `W` in the Frobenius norm (Eckart-Young), its singular
//! values split evenly between the two factors so that they start at the same scale. The
//! decomposition is nalgebra's (in `f64`); only the split and the layout are ours.

use nalgebra::DMatrix;

/// The factors of the row-major `rows x cols` matrix `w` at rank `rank` (at most
/// `min(rows, cols)`): `P` (`rows x rank`, row-major) and `Q` (`rank x cols`, row-major),
/// with `P Q` the matrix of `w`'s `rank` largest singular values and their vectors.
pub fn truncated_svd(w: &[f32], rows: usize, cols: usize, rank: usize) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(w.len(), rows * cols, "a {rows} x {cols} matrix");
    assert!(
        rank >= 1 && rank <= rows.min(cols),
        "rank {rank} of a {rows} x {cols} matrix"
    );
    let m = DMatrix::from_row_iterator(rows, cols, w.iter().map(|&v| v as f64));
    let svd = m.svd(true, true);
    // Invariant: both were asked for.
    let u = svd.u.expect("left singular vectors");
    // Invariant: as above.
    let v_t = svd.v_t.expect("right singular vectors");
    // The largest `rank` singular values, whatever order the decomposition returned.
    let mut order: Vec<usize> = (0..svd.singular_values.len()).collect();
    order.sort_by(|&a, &b| svd.singular_values[b].total_cmp(&svd.singular_values[a]));
    let mut p = vec![0.0f32; rows * rank];
    let mut q = vec![0.0f32; rank * cols];
    for (k, &j) in order.iter().take(rank).enumerate() {
        let root = svd.singular_values[j].max(0.0).sqrt();
        for r in 0..rows {
            p[r * rank + k] = (u[(r, j)] * root) as f32;
        }
        for c in 0..cols {
            q[k * cols + c] = (v_t[(j, c)] * root) as f32;
        }
    }
    (p, q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn product(p: &[f32], q: &[f32], rows: usize, rank: usize, cols: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                out[r * cols + c] = (0..rank)
                    .map(|k| p[r * rank + k] as f64 * q[k * cols + c] as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn a_matrix_of_that_rank_is_reproduced() {
        // The outer product of [1, 2, 3] and [1, -1] plus that of [0, 1, 0] and [2, 2]: rank 2.
        let w = [1.0, -1.0, 2.0 + 2.0, -2.0 + 2.0, 3.0, -3.0];
        let (p, q) = truncated_svd(&w, 3, 2, 2);
        let got = product(&p, &q, 3, 2, 2);
        for (g, want) in got.iter().zip(w) {
            assert!((g - want as f64).abs() < 1e-5, "{got:?}");
        }
    }

    #[test]
    fn rank_one_keeps_the_largest_singular_value_split_evenly() {
        // diag(3, 1): the best rank-1 approximation is diag(3, 0), P = [sqrt 3, 0]^T,
        // Q = [sqrt 3, 0] (up to a shared sign).
        let (p, q) = truncated_svd(&[3.0, 0.0, 0.0, 1.0], 2, 2, 1);
        let got = product(&p, &q, 2, 1, 2);
        let want = [3.0, 0.0, 0.0, 0.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
        assert!((p[0].abs() - 3f32.sqrt()).abs() < 1e-6 && (q[0].abs() - 3f32.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn the_error_is_the_dropped_singular_values() {
        // Eckart-Young: ||W - W_r||_F^2 = sum of the dropped squared singular values, here
        // checked against the full decomposition's own values on a random 7 x 5 matrix.
        let mut state = 12345u64;
        let w: Vec<f32> = (0..35)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        let m = DMatrix::from_row_iterator(7, 5, w.iter().map(|&v| v as f64));
        let mut s: Vec<f64> = m.singular_values().iter().copied().collect();
        s.sort_by(|a, b| b.total_cmp(a));
        for rank in 1..=5 {
            let (p, q) = truncated_svd(&w, 7, 5, rank);
            let approx = product(&p, &q, 7, rank, 5);
            let err: f64 = approx
                .iter()
                .zip(&w)
                .map(|(a, b)| (a - *b as f64).powi(2))
                .sum();
            let want: f64 = s[rank..].iter().map(|v| v * v).sum();
            assert!((err - want).abs() < 1e-5, "rank {rank}: {err} vs {want}");
        }
    }
}
