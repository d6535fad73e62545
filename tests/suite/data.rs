//! Data loading against the real bundled files.

use std::io::{Read, Write};

use flashover::core::data::{Dataset, MnistDataset, MnistSplit};
use flashover_examples::bundled_mnist_dir;

#[test]
fn a_folder_of_raw_files_with_standard_names_loads_like_the_bundle() {
    // The bundle is gzipped with `test-*` names; the same digits raw, with `t10k-*` names.
    let dir = tempfile::tempdir().unwrap();
    for (from, to) in [
        ("test-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte"),
        ("test-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte"),
    ] {
        let gz = std::fs::File::open(bundled_mnist_dir().join(from)).unwrap();
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(gz)
            .read_to_end(&mut raw)
            .unwrap();
        std::fs::File::create(dir.path().join(to))
            .unwrap()
            .write_all(&raw)
            .unwrap();
    }
    let bundled = MnistDataset::from_dir(&bundled_mnist_dir(), MnistSplit::Test).unwrap();
    let raw = MnistDataset::from_dir(dir.path(), MnistSplit::Test).unwrap();
    assert_eq!(raw.len(), 2000);
    assert_eq!(bundled.len(), 2000);
    for i in [0, 1, 999, 1999] {
        assert_eq!(raw.get(i), bundled.get(i));
    }
    let train = MnistDataset::from_dir(&bundled_mnist_dir(), MnistSplit::Train).unwrap();
    assert_eq!(train.len(), 8000);
    let item = train.get(0).unwrap();
    assert_eq!((item.rows, item.cols, item.pixels.len()), (28, 28, 784));
    assert!(item.label <= 9 && item.pixels.iter().any(|&p| p > 128));
}

#[test]
fn a_truncated_copy_of_a_real_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let gz = std::fs::File::open(bundled_mnist_dir().join("train-images-idx3-ubyte.gz")).unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut raw)
        .unwrap();
    raw.truncate(raw.len() / 2);
    let path = dir.path().join("train-images-idx3-ubyte");
    std::fs::write(&path, &raw).unwrap();
    std::fs::copy(
        bundled_mnist_dir().join("train-labels-idx1-ubyte.gz"),
        dir.path().join("train-labels-idx1-ubyte.gz"),
    )
    .unwrap();
    let err = MnistDataset::from_dir(dir.path(), MnistSplit::Train)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train-images-idx3-ubyte") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn a_real_gzip_file_damaged_mid_stream_is_reported_as_corrupt() {
    // One byte flipped at several places inside the real compressed labels: each is reported
    // as a corrupt gzip stream (or, when the damage shortens the data, as truncated), never as
    // "trailing data", which used to be the report when the damage lengthened it.
    let real = std::fs::read(bundled_mnist_dir().join("train-labels-idx1-ubyte.gz")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut corrupt = 0;
    for k in 1..16 {
        let mut bad = real.clone();
        let i = k * real.len() / 16;
        bad[i] ^= 0x21;
        let path = dir.path().join(format!("labels-{k}.gz"));
        std::fs::write(&path, &bad).unwrap();
        let err = flashover::core::data::read_idx_labels(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("labels-{k}.gz")), "{err}");
        assert!(!err.contains("trailing data"), "byte {i}: {err}");
        assert!(
            err.contains("corrupt gzip stream") || err.contains("truncated"),
            "byte {i}: {err}"
        );
        corrupt += err.contains("corrupt gzip stream") as usize;
    }
    assert!(corrupt >= 10, "only {corrupt} of 15 reported as corrupt");
}
