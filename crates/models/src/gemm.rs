//! A checked, safe matrix product over the `gemm` crate (the GEMM that Burn's flex backend,
//! candle and faer use). `gemm::gemm` takes raw pointers and strides; this module checks that
//! every element the product reads or writes lies inside the slices it was given, and that
//! the destination's strides never map two elements to one place, then makes the one call.
//! With `zeroed_chunks` (and its helpers `zeroed_chunks2`, `fill_default`) in `kernels.rs`, it
//! is the crate's only `unsafe`.
//!
//! The product always runs on the calling thread (`Parallelism::None`): the kernels split
//! their work into pieces fixed by the shapes alone and run the pieces on rayon, so that a
//! result never depends on how many threads there are.

/// A read-only matrix view: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// A writable matrix view with the same addressing as [`MatRef`].
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// Offset one past the last element a `rows x cols` view with these strides touches.
fn extent(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * row_stride + (cols - 1) * col_stride + 1
    }
}

/// Panics, naming the view, if it reaches past a slice of `len` elements.
fn check_extent(len: usize, rows: usize, cols: usize, row_stride: usize, col_stride: usize) {
    let need = extent(rows, cols, row_stride, col_stride);
    assert!(
        need <= len,
        "a {rows}x{cols} view with strides ({row_stride}, {col_stride}) needs {need} \
         elements; the slice has {len}"
    );
}

impl<'a> MatRef<'a> {
    /// A view of `data`; panics if an element of the view lies outside it.
    pub fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        check_extent(data.len(), rows, cols, row_stride, col_stride);
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// A row-major `rows x cols` view of `data` (row stride `cols`).
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }
}

impl<'a> MatMut<'a> {
    /// A writable view of `data`; panics if an element lies outside it or if two elements
    /// share a place (the product's writes would race).
    pub fn new(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        check_extent(data.len(), rows, cols, row_stride, col_stride);
        let distinct = match (rows <= 1, cols <= 1) {
            (true, true) => true,
            (true, false) => col_stride >= 1,
            (false, true) => row_stride >= 1,
            (false, false) => {
                row_stride >= 1
                    && col_stride >= 1
                    && (row_stride >= cols * col_stride || col_stride >= rows * row_stride)
            }
        };
        assert!(
            distinct,
            "a writable {rows}x{cols} view with strides ({row_stride}, {col_stride}) maps two \
             elements to one place"
        );
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// A row-major `rows x cols` view of `data` (row stride `cols`).
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }
}

/// `dst = lhs * rhs` (what `dst` held is never read). Panics if the shapes disagree.
pub fn matmul(dst: MatMut<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>) {
    assert!(
        lhs.cols == rhs.rows && dst.rows == lhs.rows && dst.cols == rhs.cols,
        "matrix product of {}x{} by {}x{} into {}x{}",
        lhs.rows,
        lhs.cols,
        rhs.rows,
        rhs.cols,
        dst.rows,
        dst.cols
    );
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if lhs.cols == 0 {
        for i in 0..dst.rows {
            for j in 0..dst.cols {
                dst.data[i * dst.row_stride + j * dst.col_stride] = 0.0;
            }
        }
        return;
    }
    // SAFETY: the constructors checked that every element of the three views, addressed
    // with their strides, lies inside the slices; the shapes agree (asserted above), so the
    // product reads only `lhs` and `rhs` elements (i < rows, j < cols) and writes only `dst`
    // elements, which are distinct places (checked in `MatMut::new`). `dst` is borrowed
    // mutably, so it aliases neither input. Strides fit in `isize` because they address
    // elements of an allocated slice.
    #[allow(unsafe_code)]
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.cols,
            lhs.cols,
            dst.data.as_mut_ptr(),
            dst.col_stride as isize,
            dst.row_stride as isize,
            false,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    s += a[i * k + p] as f64 * b[p * n + j] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn products_match_a_naive_loop_with_strides_and_overwrite_the_destination() {
        let (m, k, n) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        // NaN in the destination: a product that read it would give NaN.
        let mut c = vec![f32::NAN; m * n];
        matmul(
            MatMut::row_major(&mut c, m, n),
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&b, k, n),
        );
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
        // b transposed in memory, read through strides, into a destination that held the
        // first result: overwritten, not added to.
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        matmul(
            MatMut::row_major(&mut c, m, n),
            MatRef::row_major(&a, m, k),
            MatRef::new(&bt, k, n, 1, k),
        );
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }

    #[test]
    #[should_panic(expected = "needs")]
    fn a_view_past_its_slice_is_refused() {
        let a = [0.0f32; 5];
        let _ = MatRef::row_major(&a, 2, 3);
    }

    #[test]
    #[should_panic(expected = "maps two")]
    fn an_overlapping_destination_is_refused() {
        let mut a = [0.0f32; 8];
        let _ = MatMut::new(&mut a, 3, 3, 1, 1);
    }
}
