//! Where checkpoints and logs go: a local folder or an object-store URI
//! (`s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`).
//!
//! Parsing is strict on purpose: the bucket follows the stores' naming rules and every prefix
//! segment is a plain name from a small alphabet, so that every key this crate builds stays
//! under the prefix the user gave (no `..`, no empty segments, no characters a store or a
//! shell would read differently). The same rule ([`check_segment`]) is applied to checkpoint
//! names and to file names before they become keys.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::CheckpointError;

/// The object stores a URI may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// Amazon S3 and S3-compatible stores (`s3://`), through the `s3` feature.
    S3,
    /// Google Cloud Storage (`gs://`), through the `gcs` feature.
    Gcs,
    /// Azure Blob Storage (`az://`), through the `azure` feature.
    Azure,
}

impl Scheme {
    /// The URI scheme (`s3`, `gs`, `az`).
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::S3 => "s3",
            Scheme::Gcs => "gs",
            Scheme::Azure => "az",
        }
    }

    /// The crate feature that compiles this store in.
    pub fn feature(self) -> &'static str {
        match self {
            Scheme::S3 => "s3",
            Scheme::Gcs => "gcs",
            Scheme::Azure => "azure",
        }
    }

    /// Every scheme, in the order error messages list them.
    pub const ALL: [Scheme; 3] = [Scheme::S3, Scheme::Gcs, Scheme::Azure];
}

/// A validated object-store location: scheme, bucket (or Azure container) and a prefix of
/// plain segments. Displays as the URI it was parsed from, normalised (no trailing `/`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteUri {
    scheme: Scheme,
    bucket: String,
    prefix: Vec<String>,
}

/// The characters a prefix segment, checkpoint name or file name may use in a key.
pub const SEGMENT_CHARS: &str = "ASCII letters, digits and - _ . = + @ ,";

/// Whether `segment` may be one component of a key: non-empty, at most 255 bytes, not `.` or
/// `..`, only [`SEGMENT_CHARS`].
pub fn check_segment(segment: &str) -> Result<(), String> {
    if segment.is_empty() {
        return Err("an empty segment (two '/' in a row)".into());
    }
    if segment == "." || segment == ".." {
        return Err(format!(
            "the segment {segment:?}, which would leave the prefix"
        ));
    }
    if segment.len() > 255 {
        return Err(format!(
            "a segment of {} bytes (at most 255)",
            segment.len()
        ));
    }
    if let Some(c) = segment
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-_.=+@,".contains(*c)))
    {
        return Err(format!(
            "the character {c:?} in {segment:?} (segments use {SEGMENT_CHARS})"
        ));
    }
    Ok(())
}

fn check_bucket(scheme: Scheme, bucket: &str) -> Result<(), String> {
    // The strictest common subset of S3's, GCS's and Azure's rules: 3 to 63 characters,
    // lowercase letters, digits, '-' and '.' (not Azure), starting and ending alphanumeric.
    // GCS also allows '_'.
    let ok_char = |c: char| {
        c.is_ascii_lowercase()
            || c.is_ascii_digit()
            || c == '-'
            || (c == '.' && scheme != Scheme::Azure)
            || (c == '_' && scheme == Scheme::Gcs)
    };
    let ends_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if (3..=63).contains(&bucket.len())
        && bucket.chars().all(ok_char)
        && ends_ok(bucket.chars().next())
        && ends_ok(bucket.chars().last())
        && !bucket.contains("..")
    {
        Ok(())
    } else {
        Err(format!(
            "the bucket {bucket:?}: a bucket name has 3 to 63 lowercase letters, digits, '-'{} and starts and ends with a letter or digit",
            if scheme == Scheme::Azure { "" } else { " or '.'" }
        ))
    }
}

impl RemoteUri {
    /// Parses `scheme://bucket/prefix/...`.
    pub fn parse(text: &str) -> Result<Self, CheckpointError> {
        let bad = |why: String| CheckpointError::Config {
            name: "uri",
            value: text.to_string(),
            expected: why,
        };
        // Never echo what may hold credentials (user:secret@ in the authority, a presigned
        // URL's query): the value in the error is cut down to the scheme.
        let redacted = |why: &str| CheckpointError::Config {
            name: "uri",
            value: format!("{}://…", text.split_once("://").map_or("", |(s, _)| s)),
            expected: why.to_string(),
        };
        if let Some((_, rest)) = text.split_once("://") {
            if rest.split('/').next().is_some_and(|a| a.contains('@')) {
                return Err(redacted(
                    "a URI without credentials (no user:secret@; credentials come from the environment)",
                ));
            }
            if rest.contains(['?', '#']) {
                return Err(redacted(
                    "no query or fragment ('?', '#'): a bucket and a prefix only (a presigned URL is not a location)",
                ));
            }
        }
        let (scheme, rest) = text.split_once("://").ok_or_else(|| {
            bad("an object-store URI such as s3://bucket/prefix (schemes: s3, gs, az)".into())
        })?;
        let scheme = Scheme::ALL
            .into_iter()
            .find(|s| s.as_str() == scheme)
            .ok_or_else(|| bad(format!("the scheme s3, gs or az, not {scheme:?}")))?;
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let mut parts = rest.split('/');
        let bucket = parts.next().unwrap_or_default();
        check_bucket(scheme, bucket).map_err(|e| bad(format!("a valid bucket, not {e}")))?;
        let mut prefix = Vec::new();
        for p in parts {
            check_segment(p).map_err(|e| bad(format!("a prefix of plain segments, not {e}")))?;
            prefix.push(p.to_string());
        }
        Ok(RemoteUri {
            scheme,
            bucket: bucket.to_string(),
            prefix,
        })
    }

    /// The store.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The bucket (or Azure container).
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The prefix's segments (empty: the bucket's root).
    pub fn prefix(&self) -> &[String] {
        &self.prefix
    }

    /// This URI with `segment` appended (checked with [`check_segment`]).
    pub fn join(&self, segment: &str) -> Result<RemoteUri, CheckpointError> {
        check_segment(segment).map_err(|e| CheckpointError::Config {
            name: "key",
            value: format!("{self}/{segment}"),
            expected: format!("a plain name, not {e}"),
        })?;
        let mut out = self.clone();
        out.prefix.push(segment.to_string());
        Ok(out)
    }

    /// The parent location and the last segment (`s3://b/runs/ck/latest` gives `s3://b/runs/ck`
    /// and `latest`); `None` for a bare bucket.
    pub fn split_last(&self) -> Option<(RemoteUri, &str)> {
        let last = self.prefix.last()?;
        let mut parent = self.clone();
        parent.prefix.pop();
        Some((parent, last.as_str()))
    }

    /// A relative local path for this location (`<scheme>/<bucket>/<prefix...>`), for caches.
    pub fn cache_path(&self) -> PathBuf {
        let mut p = PathBuf::from(self.scheme.as_str());
        p.push(&self.bucket);
        for s in &self.prefix {
            p.push(s);
        }
        p
    }
}

impl fmt::Display for RemoteUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme.as_str(), self.bucket)?;
        for s in &self.prefix {
            write!(f, "/{s}")?;
        }
        Ok(())
    }
}

impl FromStr for RemoteUri {
    type Err = CheckpointError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RemoteUri::parse(s)
    }
}

/// A place for checkpoints or logs: a local folder, or an object-store URI (anything with
/// `://`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A folder on this machine.
    Local(PathBuf),
    /// An object-store prefix.
    Remote(RemoteUri),
}

impl Location {
    /// A URI when the text has `://`, else a local path.
    pub fn parse(text: &str) -> Result<Self, CheckpointError> {
        if text.contains("://") {
            RemoteUri::parse(text).map(Location::Remote)
        } else if text.is_empty() {
            Err(CheckpointError::Config {
                name: "location",
                value: String::new(),
                expected: "a folder or an object-store URI such as s3://bucket/prefix".into(),
            })
        } else {
            Ok(Location::Local(PathBuf::from(text)))
        }
    }
}

impl FromStr for Location {
    type Err = CheckpointError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Location::parse(s)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Remote(u) => write!(f, "{u}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_and_print_back() {
        let u = RemoteUri::parse("s3://runs/mnist/ck/").unwrap();
        assert_eq!(u.scheme(), Scheme::S3);
        assert_eq!(u.bucket(), "runs");
        assert_eq!(u.prefix(), ["mnist", "ck"]);
        assert_eq!(u.to_string(), "s3://runs/mnist/ck");
        let (parent, last) = u.split_last().unwrap();
        assert_eq!(
            (parent.to_string().as_str(), last),
            ("s3://runs/mnist", "ck")
        );
        assert_eq!(
            RemoteUri::parse("gs://my-bucket").unwrap().prefix().len(),
            0
        );
        assert_eq!(
            RemoteUri::parse("az://container/a=1/b_2")
                .unwrap()
                .cache_path(),
            PathBuf::from("az/container/a=1/b_2")
        );
        assert!(matches!(
            Location::parse("ck").unwrap(),
            Location::Local(p) if p.as_path() == std::path::Path::new("ck")
        ));
    }

    #[test]
    fn bad_uris_name_the_problem() {
        for (text, needle) in [
            ("s3:/runs", "a folder"),
            ("http://runs/x", "\"http\""),
            ("s3://Runs/x", "\"Runs\""),
            ("s3://ab", "\"ab\""),
            ("s3://runs/../x", "\"..\""),
            ("s3://runs/a//b", "empty segment"),
            ("s3://runs/a b", "' '"),
            ("s3://runs/a?X-Amz-Signature=abc", "query"),
            ("s3://AKIA:s3cret@runs/x", "without credentials"),
            ("az://my.container/x", "\"my.container\""),
        ] {
            let err = match Location::parse(text) {
                Ok(Location::Local(_)) => "a folder".to_string(),
                Ok(other) => panic!("{text} parsed as {other}"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(needle), "{text}: {err}");
        }
        for leaky in [
            "s3://AKIA:s3cret@runs/x",
            "s3://runs/x?X-Amz-Signature=s3cret",
        ] {
            let err = RemoteUri::parse(leaky).unwrap_err().to_string();
            assert!(!err.contains("s3cret"), "{err}");
        }
        assert!(RemoteUri::parse("gs://my_bucket/x").is_ok());
        assert!(RemoteUri::parse("s3://my_bucket/x").is_err());
        assert!(RemoteUri::parse("s3://runs/x").unwrap().join("..").is_err());
        assert!(RemoteUri::parse("s3://runs/x")
            .unwrap()
            .join("ep1-ba2")
            .is_ok());
    }
}
