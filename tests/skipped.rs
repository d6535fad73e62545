//! Runs right after the cross-crate suite (`tests.rs`) in the same `cargo test`, and ends its
//! output with one line that counts the tests that skipped for want of a program (OpenMPI,
//! s3s-fs, TensorBoard, network namespaces, the shard writers, MLflow), names what each group needs and how to enable
//! it; or says that none did. See `support/skip.rs`.

// The suite's record of skips, shared with it as source (the suite writes, this reads; the
// module's tests run in the suite).
#[allow(dead_code, unused_imports)]
#[path = "support/skip.rs"]
mod skip;

fn main() {
    let Some(file) = skip::record_file() else {
        return;
    };
    let record = std::fs::read_to_string(&file).unwrap_or_default();
    let _ = std::fs::remove_file(&file);
    match skip::summary_line(&record) {
        Some(line) => println!("{line}"),
        None => println!(
            "flashover-tests: no test skipped for want of OpenMPI, s3s-fs, TensorBoard, network namespaces, the Python shard writers or MLflow"
        ),
    }
}
