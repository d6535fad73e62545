//! Shard compression and verification, as `mosaicml-streaming` writes them: a compressed
//! shard is the whole raw shard compressed with one of Streaming's five codecs (`zstd`, `gz`,
//! `bz2`, `snappy` (raw, unframed), `br`; an optional `:level` is the writer's business), and
//! the index lists hex digests of the raw and the compressed file under the names of
//! Python's `hashlib` and `xxhash`. The codecs and hashes are the crates' (zstd, flate2,
//! bzip2, snap, brotli-decompressor, sha1/sha2/md-5, xxhash-rust); only the mapping from
//! Streaming's names is ours.

use std::io::Read;

/// The codecs this crate decompresses, by Streaming's names.
pub const CODECS: [&str; 5] = ["zstd", "gz", "bz2", "snappy", "br"];

/// The hashes this crate checks, by Streaming's names; others in an index are not checked
/// (sizes always are).
pub const HASHES: [&str; 11] = [
    "md5", "sha1", "sha224", "sha256", "sha384", "sha512", "xxh32", "xxh64", "xxh128", "xxh3_64",
    "xxh3_128",
];

/// The codec part of a compression setting (`"zstd:7"` -> `"zstd"`), if this crate
/// decompresses it.
pub fn codec_name(compression: &str) -> Option<&'static str> {
    let name = compression.split(':').next().unwrap_or("");
    CODECS.iter().copied().find(|c| *c == name)
}

/// Decompresses `data` written with `compression` (`"zstd"`, `"gz:9"`, ...).
pub fn decompress(compression: &str, data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    match codec_name(compression) {
        Some("zstd") => {
            out = zstd::stream::decode_all(data).map_err(|e| format!("zstd: {e}"))?;
        }
        Some("gz") => {
            flate2::read::GzDecoder::new(data)
                .read_to_end(&mut out)
                .map_err(|e| format!("gzip: {e}"))?;
        }
        Some("bz2") => {
            bzip2::read::BzDecoder::new(data)
                .read_to_end(&mut out)
                .map_err(|e| format!("bzip2: {e}"))?;
        }
        Some("snappy") => {
            out = snap::raw::Decoder::new()
                .decompress_vec(data)
                .map_err(|e| format!("snappy: {e}"))?;
        }
        Some("br") => {
            brotli_decompressor::Decompressor::new(data, 1 << 16)
                .read_to_end(&mut out)
                .map_err(|e| format!("brotli: {e}"))?;
        }
        _ => {
            return Err(format!(
                "compression {compression:?} is not one of {CODECS:?} (with an optional :level)"
            ))
        }
    }
    Ok(out)
}

/// Compresses with zstd at `level` (the converter's one codec).
pub fn compress_zstd(data: &[u8], level: i32) -> Result<Vec<u8>, String> {
    zstd::stream::encode_all(data, level).map_err(|e| format!("zstd: {e}"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hex digest of `data` under Streaming's name `algo`, or `None` for a hash this crate
/// does not compute. xxhash digests are written big-endian, as Python's `hexdigest` does.
pub fn digest(algo: &str, data: &[u8]) -> Option<String> {
    use sha2::Digest;
    Some(match algo {
        "md5" => hex(&md5::Md5::digest(data)),
        "sha1" => hex(&sha1::Sha1::digest(data)),
        "sha224" => hex(&sha2::Sha224::digest(data)),
        "sha256" => hex(&sha2::Sha256::digest(data)),
        "sha384" => hex(&sha2::Sha384::digest(data)),
        "sha512" => hex(&sha2::Sha512::digest(data)),
        "xxh32" => format!("{:08x}", xxhash_rust::xxh32::xxh32(data, 0)),
        "xxh64" => format!("{:016x}", xxhash_rust::xxh64::xxh64(data, 0)),
        "xxh3_64" => format!("{:016x}", xxhash_rust::xxh3::xxh3_64(data)),
        "xxh128" | "xxh3_128" => format!("{:032x}", xxhash_rust::xxh3::xxh3_128(data)),
        _ => return None,
    })
}

/// Checks `data` against an index's size and hashes; the error says what differs.
pub fn verify(
    data: &[u8],
    bytes: Option<u64>,
    hashes: &std::collections::BTreeMap<String, String>,
) -> Result<(), String> {
    if let Some(n) = bytes {
        if data.len() as u64 != n {
            return Err(format!("{} bytes where the index says {n}", data.len()));
        }
    }
    for (algo, want) in hashes {
        if let Some(got) = digest(algo, data) {
            if !got.eq_ignore_ascii_case(want) {
                return Err(format!("{algo} is {got} where the index says {want}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_match_published_test_vectors() {
        // RFC 1321, FIPS 180-2 ("abc"), and xxHash's reference values for the empty input.
        assert_eq!(
            digest("md5", b"abc").unwrap(),
            "900150983cd24fb0d6963f7d28e17f72"
        );
        assert_eq!(
            digest("sha1", b"abc").unwrap(),
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        );
        assert_eq!(
            digest("sha256", b"abc").unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(digest("xxh32", b"").unwrap(), "02cc5d05");
        assert_eq!(digest("xxh64", b"").unwrap(), "ef46db3751d8e999");
        assert_eq!(digest("xxh3_64", b"").unwrap(), "2d06800538d394c2");
        assert_eq!(digest("blake2b", b""), None);
    }

    #[test]
    fn every_codec_round_trips_or_names_itself() {
        let raw: Vec<u8> = (0..5000u32).flat_map(|i| (i % 97).to_le_bytes()).collect();
        let z = compress_zstd(&raw, 3).unwrap();
        assert_eq!(decompress("zstd:3", &z).unwrap(), raw);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(9));
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        assert_eq!(decompress("gz", &gz.finish().unwrap()).unwrap(), raw);
        let mut bz = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::new(9));
        std::io::Write::write_all(&mut bz, &raw).unwrap();
        assert_eq!(decompress("bz2:9", &bz.finish().unwrap()).unwrap(), raw);
        let sn = snap::raw::Encoder::new().compress_vec(&raw).unwrap();
        assert_eq!(decompress("snappy", &sn).unwrap(), raw);
        let err = decompress("lzma", &raw).unwrap_err();
        assert!(err.contains("lzma") && err.contains("zstd"), "{err}");
        assert!(decompress("zstd", b"not zstd").is_err());
    }

    #[test]
    fn verification_names_what_differs() {
        let mut h = std::collections::BTreeMap::new();
        h.insert("sha1".to_string(), digest("sha1", b"abc").unwrap());
        h.insert("blake2b".to_string(), "unchecked".to_string());
        assert!(verify(b"abc", Some(3), &h).is_ok());
        let e = verify(b"abd", Some(3), &h).unwrap_err();
        assert!(e.contains("sha1"), "{e}");
        let e = verify(b"abcd", Some(3), &h).unwrap_err();
        assert!(e.contains("4 bytes") && e.contains('3'), "{e}");
    }
}
