//! A checked, safe matrix product over the `gemm` crate (the GEMM that Burn's flex backend,
//! candle and faer use). `gemm::gemm` takes raw pointers and strides; this module checks that
//! every element the product reads or writes lies inside the slices it was given, and that
//! the destination's strides never map two elements to one place, then makes the one call.
//! [`matmul_into`] writes a fresh output's uninitialised slots and hands them back as
//! values. With `written_chunks`, `written_chunks2` and `write_each` in `kernels.rs`, these
//! two are the crate's only `unsafe`.
//!
//! The product always runs on the calling thread (`Parallelism::None`): the kernels split
//! their work into pieces fixed by the shapes alone and run the pieces on rayon, so that a
//! result never depends on how many threads there are.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

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
    let MatMut {
        data,
        rows,
        cols,
        row_stride,
        col_stride,
    } = dst;
    product(
        Dst {
            ptr: data.as_mut_ptr(),
            rows,
            cols,
            row_stride,
            col_stride,
            _borrow: PhantomData,
        },
        lhs,
        rhs,
    );
}

/// `lhs * rhs` written into `dst`, a row-major `lhs.rows x rhs.cols` destination not yet
/// initialised (a fresh output's chunk: no zero fill before the product overwrites it);
/// returns `dst` as the initialised values. Panics if the shapes disagree.
pub fn matmul_into<'a>(
    dst: &'a mut [MaybeUninit<f32>],
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
) -> &'a mut [f32] {
    let (rows, cols) = (lhs.rows, rhs.cols);
    assert_eq!(
        dst.len(),
        rows * cols,
        "a {rows}x{cols} product into {} values",
        dst.len()
    );
    product(
        Dst {
            ptr: dst.as_mut_ptr().cast::<f32>(),
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
            _borrow: PhantomData,
        },
        lhs,
        rhs,
    );
    // SAFETY: `product` wrote every element of the `rows x cols` row-major view, which with
    // row stride `cols` covers the `rows * cols` slots of `dst` (asserted above) one each;
    // `MaybeUninit<f32>` has the layout of `f32`.
    #[allow(unsafe_code)]
    unsafe {
        &mut *(dst as *mut [MaybeUninit<f32>] as *mut [f32])
    }
}

/// A product's destination: distinct places inside memory borrowed mutably for `'a`
/// (a [`MatMut`]'s, or a slice of uninitialised slots), written and never read.
struct Dst<'a> {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

/// Writes `lhs * rhs` to every element of `dst`. Panics if the shapes disagree.
fn product(dst: Dst<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>) {
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
    // SAFETY: `Dst` is built only from a `MatMut` (whose constructor checked that its
    // elements lie inside its slice and are distinct places) or from a `rows * cols` slice
    // of slots viewed row-major (`matmul_into` asserted the length), in both cases borrowed
    // mutably for the call, so it aliases neither input; the constructors of `MatRef`
    // checked that every element of `lhs` and `rhs` lies inside their slices; the shapes
    // agree (asserted above), so the product reads only those elements and writes only
    // `dst`'s. It never reads `dst` (`read_dst` false): uninitialised slots are only
    // written. With an empty inner dimension it writes zeros. Strides fit in `isize`
    // because they address elements of an allocated slice.
    #[allow(unsafe_code)]
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.cols,
            lhs.cols,
            dst.ptr,
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
