//! Keep-N: which checkpoints to delete so that the newest remain. A pure policy over names
//! and batch counts, shared by the saver (the local folder) and the remote uploader (the
//! object-store prefix), in a module of its own so that neither imports the other for it.

/// Which checkpoints to delete so that the newest `keep` remain. `existing` pairs each
/// checkpoint's name with its batch count; newer means more batches (then a later name).
/// `keep` of 0 keeps everything.
pub fn retention(existing: &[(String, u64)], keep: usize) -> Vec<String> {
    if keep == 0 || existing.len() <= keep {
        return Vec::new();
    }
    let mut sorted: Vec<&(String, u64)> = existing.iter().collect();
    sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| b.0.cmp(&a.0)));
    sorted[keep..].iter().map(|(n, _)| n.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn retention_keeps_exactly_the_newest(batches in prop::collection::vec(0u64..1000, 0..30), keep in 0usize..10) {
            let existing: Vec<(String, u64)> = batches.iter().enumerate().map(|(i, b)| (format!("ck{i:02}"), *b)).collect();
            let delete = retention(&existing, keep);
            let kept: Vec<&(String, u64)> = existing.iter().filter(|(n, _)| !delete.contains(n)).collect();
            if keep == 0 {
                prop_assert!(delete.is_empty());
            } else {
                prop_assert_eq!(kept.len(), existing.len().min(keep));
                let oldest_kept = kept.iter().map(|(_, b)| *b).min().unwrap_or(u64::MAX);
                for d in &delete {
                    let b = existing.iter().find(|(n, _)| n == d).unwrap().1;
                    prop_assert!(b <= oldest_kept);
                }
            }
        }
    }
}
