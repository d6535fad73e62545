//! ColOut (MosaicML, Composer's method card): drop a random fraction of the rows and of the
//! columns of every image in a batch, which shrinks the images (cheaper forward and backward)
//! while keeping their content roughly in place. The same rows and columns are dropped for the
//! whole batch, so the result is still one tensor.
//!
//! Hyperparameters: `p_row` and `p_col` (default 0.15 each, Composer's defaults). Speeds up
//! convolutional models whose head pools over space; the model must accept the smaller
//! images.
//!
//! Hook: `AFTER_DATALOADER`.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use flashover_core::rng::Rng;

use crate::error::{check_range, Result};
use crate::image::{ImageAlgorithm, ImageTransform};
use crate::util::index_tensor;

/// The sorted indices kept when dropping `floor(p * n)` of `n` positions at random.
pub fn kept_indices(rng: &mut Rng, n: usize, p: f64) -> Vec<usize> {
    let drop = (p * n as f64).floor() as usize;
    let mut idx: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut idx);
    let mut keep = idx[drop.min(n.saturating_sub(1))..].to_vec();
    keep.sort_unstable();
    keep
}

/// Drops random rows and columns of `images` `[n, c, h, w]` (the functional form).
pub fn colout<B: Backend>(
    images: Tensor<B, 4>,
    rng: &mut Rng,
    p_row: f64,
    p_col: f64,
) -> Tensor<B, 4> {
    let [_, _, h, w] = images.dims();
    let device = images.device();
    let rows = kept_indices(rng, h, p_row);
    let cols = kept_indices(rng, w, p_col);
    images
        .select(2, index_tensor(&rows, &device))
        .select(3, index_tensor(&cols, &device))
}

/// ColOut's settings, the transform behind [`ColOut`].
#[derive(Debug, Clone)]
pub struct ColOutTransform {
    p_row: f64,
    p_col: f64,
}

/// The ColOut algorithm; see the module docs.
pub type ColOut = ImageAlgorithm<ColOutTransform>;

impl ColOut {
    /// Drop fractions in `[0, 1)`.
    pub fn new(p_row: f64, p_col: f64) -> Result<Self> {
        check_range("colout", "p_row", p_row, 0.0, 0.99)?;
        check_range("colout", "p_col", p_col, 0.0, 0.99)?;
        Ok(ImageAlgorithm(ColOutTransform { p_row, p_col }))
    }
}

impl ImageTransform for ColOutTransform {
    const NAME: &'static str = "colout";

    fn transform<B: Backend>(&self, images: Tensor<B, 4>, rng: &mut Rng, _: f64) -> Tensor<B, 4> {
        colout(images, rng, self.p_row, self.p_col)
    }
}

// By name (`--algorithms`; see `crate::spec`).
crate::spec::by_name! {name: "colout", params: ["p_row", "p_col"]}
crate::spec::by_name! {image |p, _norm| ColOut::new(p.f64("p_row", 0.15)?, p.f64("p_col", 0.15)?)?}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest};

    proptest! {
        #[test]
        fn kept_rows_are_sorted_unique_and_counted(seed: u64, n in 1usize..64, p in 0.0f64..0.95) {
            let k = kept_indices(&mut Rng::new(seed), n, p);
            let drop = ((p * n as f64).floor() as usize).min(n - 1);
            prop_assert_eq!(k.len(), n - drop);
            prop_assert!(k.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(k.iter().all(|&i| i < n));
            prop_assert_eq!(k, kept_indices(&mut Rng::new(seed), n, p));
        }
    }

    #[test]
    fn output_keeps_the_chosen_pixels_in_order() {
        // Pixel value = 10 * row + column, so every kept pixel says where it came from.
        let v: Vec<f32> = (0..10)
            .flat_map(|r| (0..10).map(move |c| (10 * r + c) as f32))
            .collect();
        let x =
            Tensor::<Flex, 4>::from_data(TensorData::new(v, [1, 1, 10, 10]), &Default::default());
        let mut rng = Rng::new(2);
        let out = colout(x, &mut rng, 0.2, 0.3);
        assert_eq!(out.dims(), [1, 1, 8, 7]);
        let mut rng = Rng::new(2);
        let rows = kept_indices(&mut rng, 10, 0.2);
        let cols = kept_indices(&mut rng, 10, 0.3);
        let got = out.into_data().to_vec::<f32>().unwrap();
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|r| cols.iter().map(move |c| (10 * r + c) as f32))
            .collect();
        assert_eq!(got, want);
    }
}
