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
