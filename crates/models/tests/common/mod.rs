//! Helpers shared by the models crate's test files.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Values uniform in [-1, 1) from `seed` alone (a SplitMix64 stream), so that tests running
/// in parallel never share a generator (the backend's is global).
pub fn random<Bk: Backend, const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Bk, D> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}
