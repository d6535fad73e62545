//! A blocking handle on one object-store prefix, through Apache Arrow's `object_store` crate
//! (no hand-written S3 client): the store is built from the standard environment variables,
//! each request is retried by the crate on transient errors (bounded, logged by it at info
//! level), and every key is built from validated segments under the prefix.
//!
//! The training code is synchronous, so the store owns a single-threaded tokio runtime and
//! blocks on it; it is only ever called from plain threads (the training thread, the
//! uploader), never from inside an async task.
//!
//! Credentials come from the environment only and never leave the store: the builder (whose
//! `Debug` prints the secret) is never formatted, and this type's `Debug` shows the URI.

use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path as KeyPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
    WriteMultipart,
};

use super::uri::{check_segment, RemoteUri, Scheme};
use crate::error::CheckpointError;

/// Files up to this size go up in one PUT; larger ones as a multipart upload.
pub const MULTIPART_THRESHOLD: usize = 16 << 20;
/// The part size of multipart uploads (S3 requires at least 5 MiB for every part but the
/// last).
pub const PART_BYTES: usize = 8 << 20;

/// How hard the store's client tries before an operation fails: the crate's own retries of
/// transient errors (5xx, throttling, dropped connections, timeouts), with exponential
/// backoff, and its time limits.
#[derive(Debug, Clone)]
pub struct RemoteSettings {
    /// Retries of one request.
    pub max_retries: usize,
    /// No retry starts this long after the first attempt.
    pub retry_timeout: Duration,
    /// The first backoff (doubling up to `max_backoff`).
    pub init_backoff: Duration,
    /// The longest backoff.
    pub max_backoff: Duration,
    /// Connecting to the server.
    pub connect_timeout: Duration,
    /// One whole request (a part of a multipart upload counts as one).
    pub request_timeout: Duration,
}

impl Default for RemoteSettings {
    fn default() -> Self {
        RemoteSettings {
            max_retries: 3,
            retry_timeout: Duration::from_secs(30),
            init_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(4),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
        }
    }
}

/// One object-store prefix, ready for blocking calls.
pub struct RemoteStore {
    uri: RemoteUri,
    store: Arc<dyn ObjectStore>,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteStore({})", self.uri)
    }
}

#[cfg(feature = "s3")]
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn config_error(uri: &RemoteUri, reason: String) -> CheckpointError {
    CheckpointError::Remote {
        action: "connect to",
        uri: uri.to_string(),
        reason,
    }
}

#[cfg(feature = "s3")]
fn build_s3(
    uri: &RemoteUri,
    retry: RetryConfig,
    client: ClientOptions,
    config: Vec<(String, String)>,
) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    use std::collections::BTreeMap;
    // The environment's AWS_* variables, then the explicit settings over them (by their
    // lowercase names, as the crate's own `from_env` reads them).
    let mut vars: BTreeMap<String, String> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, v)| k.starts_with("AWS_") && !v.is_empty())
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    for (k, v) in config {
        let k = k.to_ascii_lowercase();
        if k.parse::<AmazonS3ConfigKey>().is_err() {
            // The key only: a value may be a secret.
            return Err(config_error(uri, format!("unknown S3 setting {k:?}")));
        }
        vars.insert(k, v);
    }
    let set = |k: &str| vars.get(k).is_some_and(|v| !v.is_empty());
    let on = |k: &str| vars.get(k).is_some_and(|v| v == "true");
    // Without keys, a token file or container credentials, the crate falls back to the EC2
    // instance metadata service, which outside EC2 hangs until a timeout: ask for it
    // explicitly instead.
    let keys = set("aws_access_key_id") && set("aws_secret_access_key");
    let other = set("aws_web_identity_token_file")
        || set("aws_container_credentials_relative_uri")
        || set("aws_container_credentials_full_uri")
        || on("aws_skip_signature")
        || env("FLASHOVER_S3_INSTANCE_CREDENTIALS").is_some_and(|v| v == "1");
    if !keys && !other {
        return Err(config_error(
            uri,
            "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or AWS_WEB_IDENTITY_TOKEN_FILE, or FLASHOVER_S3_INSTANCE_CREDENTIALS=1 on an EC2 instance".into(),
        ));
    }
    // An endpoint the user wrote as http:// is an explicit choice (a local or in-cluster
    // S3-compatible server); the crate refuses plain HTTP unless told.
    let endpoint = ["aws_endpoint_url_s3", "aws_endpoint_url", "aws_endpoint"]
        .iter()
        .find_map(|k| vars.get(*k).cloned());
    let http = endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"));
    let mut builder = AmazonS3Builder::new();
    for (k, v) in &vars {
        if let Ok(key) = k.parse::<AmazonS3ConfigKey>() {
            builder = builder.with_config(key, v);
        }
    }
    let mut builder = builder
        .with_bucket_name(uri.bucket())
        .with_retry(retry)
        .with_client_options(client.with_allow_http(http));
    if let Some(e) = endpoint {
        // Path-style addressing (the crate's default) for custom endpoints.
        builder = builder.with_endpoint(e);
    }
    let store = builder
        .build()
        .map_err(|e| config_error(uri, format!("the S3 settings are unusable: {e}")))?;
    Ok(Arc::new(store))
}

#[cfg(feature = "gcs")]
fn build_gcs(
    uri: &RemoteUri,
    retry: RetryConfig,
    client: ClientOptions,
) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    let store = object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(uri.bucket())
        .with_retry(retry)
        .with_client_options(client)
        .build()
        .map_err(|e| config_error(uri, format!("the GCS settings are unusable (GOOGLE_SERVICE_ACCOUNT, GOOGLE_APPLICATION_CREDENTIALS): {e}")))?;
    Ok(Arc::new(store))
}

#[cfg(feature = "azure")]
fn build_azure(
    uri: &RemoteUri,
    retry: RetryConfig,
    client: ClientOptions,
) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    let store = object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_container_name(uri.bucket())
        .with_retry(retry)
        .with_client_options(client)
        .build()
        .map_err(|e| config_error(uri, format!("the Azure settings are unusable (AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY...): {e}")))?;
    Ok(Arc::new(store))
}

/// An error text with the server's XML answer cut down to its `Code` and `Message`: some
/// answers (S3's SignatureDoesNotMatch) echo the canonical request, whose headers can carry
/// a session token.
fn without_body(text: &str) -> String {
    let Some(start) = text.find("<?xml").or_else(|| text.find("<Error>")) else {
        return text.to_string();
    };
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let close = format!("</{name}>");
        let from = text[start..].find(&open)? + start + open.len();
        let to = text[from..].find(&close)? + from;
        Some(text[from..to].to_string())
    };
    let mut out = text[..start].trim_end().to_string();
    if let Some(code) = tag("Code") {
        out.push_str(&format!(" {code}"));
    }
    if let Some(message) = tag("Message") {
        out.push_str(&format!(": {message}"));
    }
    out
}

impl RemoteStore {
    /// The store for `uri`, with credentials from the environment and default settings. Makes
    /// no request; [`RemoteStore::check`] does.
    pub fn connect(uri: &RemoteUri) -> Result<Self, CheckpointError> {
        Self::connect_with(uri, &RemoteSettings::default())
    }

    /// [`RemoteStore::connect`] with explicit retry and timeout settings.
    pub fn connect_with(
        uri: &RemoteUri,
        settings: &RemoteSettings,
    ) -> Result<Self, CheckpointError> {
        Self::connect_with_config(uri, settings, Vec::new())
    }

    /// [`RemoteStore::connect_with`] with store settings given in code, over the
    /// environment's: for S3 the `object_store` configuration keys (`aws_access_key_id`,
    /// `aws_secret_access_key`, `aws_endpoint`, `aws_region`, ...), for credentials from a
    /// secrets manager or a test. An unknown key is an error naming the key (never the value).
    /// Only S3 takes settings this way; GCS and Azure read the environment.
    ///
    /// Not from inside an async runtime (an error there): the store blocks on its own.
    pub fn connect_with_config(
        uri: &RemoteUri,
        settings: &RemoteSettings,
        config: Vec<(String, String)>,
    ) -> Result<Self, CheckpointError> {
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: settings.init_backoff,
                max_backoff: settings.max_backoff,
                base: 2.0,
            },
            max_retries: settings.max_retries,
            retry_timeout: settings.retry_timeout,
        };
        let client = ClientOptions::new()
            .with_connect_timeout(settings.connect_timeout)
            .with_timeout(settings.request_timeout);
        let missing = |s: Scheme| {
            config_error(
                uri,
                format!(
                    "this build has no {} support: enable the `{}` feature of flashover-checkpoint (or of flashover)",
                    s.as_str(),
                    s.feature()
                ),
            )
        };
        if !config.is_empty() && uri.scheme() != Scheme::S3 {
            return Err(config_error(
                uri,
                format!(
                    "settings in code are for S3 only; {} reads its settings from the environment",
                    uri.scheme().as_str()
                ),
            ));
        }
        let store: Arc<dyn ObjectStore> = match uri.scheme() {
            #[cfg(feature = "s3")]
            Scheme::S3 => build_s3(uri, retry, client, config)?,
            #[cfg(feature = "gcs")]
            Scheme::Gcs => build_gcs(uri, retry, client)?,
            #[cfg(feature = "azure")]
            Scheme::Azure => build_azure(uri, retry, client)?,
            #[allow(unreachable_patterns)]
            s => {
                let _ = (retry, client, config);
                return Err(missing(s));
            }
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Its blocking calls would panic inside a runtime.
            return Err(config_error(
                uri,
                "called from inside an async runtime: use the store from a plain thread (for example tokio's spawn_blocking)".into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| config_error(uri, format!("cannot start the I/O runtime: {e}")))?;
        Ok(RemoteStore {
            uri: uri.clone(),
            store,
            runtime,
        })
    }

    /// The prefix this store works under.
    pub fn uri(&self) -> &RemoteUri {
        &self.uri
    }

    /// The URI of `parts` under the prefix, for messages.
    pub fn describe(&self, parts: &[&str]) -> String {
        let mut s = self.uri.to_string();
        for p in parts {
            s.push('/');
            s.push_str(p);
        }
        s
    }

    fn key(&self, parts: &[&str]) -> Result<KeyPath, CheckpointError> {
        for p in parts {
            check_segment(p).map_err(|e| CheckpointError::Config {
                name: "key",
                value: self.describe(parts),
                expected: format!("plain names under the prefix, not {e}"),
            })?;
        }
        Ok(KeyPath::from_iter(
            self.uri
                .prefix()
                .iter()
                .map(String::as_str)
                .chain(parts.iter().copied()),
        ))
    }

    fn fail(
        &self,
        action: &'static str,
        parts: &[&str],
        e: object_store::Error,
    ) -> CheckpointError {
        // The crate maps some statuses to variants and wraps others (a refused listing is a
        // "Generic" error with the server's 403 answer), so the answer's code is read too.
        let text = without_body(&e.to_string());
        let said = |codes: &[&str]| codes.iter().any(|c| text.contains(c));
        let reason = if said(&["NoSuchBucket"]) {
            format!(
                "the bucket {:?} does not exist (create it first): {text}",
                self.uri.bucket()
            )
        } else if matches!(
            e,
            object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }
        ) || said(&[
            "SignatureDoesNotMatch",
            "InvalidAccessKeyId",
            "AccessDenied",
            "403 Forbidden",
            "401 Unauthorized",
        ]) {
            format!(
                "the store refused the request: check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for S3) and their permissions on the bucket: {text}"
            )
        } else if matches!(e, object_store::Error::NotFound { .. }) {
            format!(
                "not found (is the bucket {:?} there?): {text}",
                self.uri.bucket()
            )
        } else {
            text
        };
        CheckpointError::Remote {
            action,
            uri: self.describe(parts),
            reason,
        }
    }

    /// One listing of the prefix: the bucket exists, the credentials are accepted and the
    /// server answers. Called before training so that a wrong setting fails at once.
    pub fn check(&self) -> Result<(), CheckpointError> {
        let key = self.key(&[])?;
        self.runtime
            .block_on(self.store.list_with_delimiter(Some(&key)))
            .map(|_| ())
            .map_err(|e| self.fail("list", &[], e))
    }

    /// Writes `bytes` to `parts` (one PUT, or a multipart upload above
    /// [`MULTIPART_THRESHOLD`]); the object appears whole or not at all.
    pub fn put(&self, parts: &[&str], bytes: Vec<u8>) -> Result<(), CheckpointError> {
        let key = self.key(parts)?;
        let store = &self.store;
        let result = self.runtime.block_on(async {
            if bytes.len() <= MULTIPART_THRESHOLD {
                store.put(&key, PutPayload::from(bytes)).await.map(|_| ())
            } else {
                // S3 allows 10,000 parts: larger parts for objects over about 78 GiB.
                let part = PART_BYTES.max(bytes.len().div_ceil(10_000));
                let upload = store.put_multipart(&key).await?;
                let mut writer = WriteMultipart::new_with_chunk_size(upload, part);
                let mut sent = Ok(());
                for chunk in bytes.chunks(part) {
                    sent = writer.wait_for_capacity(4).await;
                    if sent.is_err() {
                        break;
                    }
                    writer.write(chunk);
                }
                if sent.is_ok() {
                    sent = writer.wait_for_capacity(0).await;
                }
                match sent {
                    // A failed part aborts the upload, so that the store keeps no orphaned
                    // parts (which S3 bills until a lifecycle rule removes them).
                    Err(e) => {
                        let _ = writer.abort().await;
                        Err(e)
                    }
                    Ok(()) => writer.finish().await.map(|_| ()),
                }
            }
        });
        result.map_err(|e| self.fail("upload", parts, e))
    }

    /// Whether there is an object at `parts` (a HEAD request: no body comes back).
    pub fn exists(&self, parts: &[&str]) -> Result<bool, CheckpointError> {
        let key = self.key(parts)?;
        match self.runtime.block_on(self.store.head(&key)) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.fail("look up", parts, e)),
        }
    }

    /// The object at `parts`, or `None` if there is none.
    pub fn get(&self, parts: &[&str]) -> Result<Option<Vec<u8>>, CheckpointError> {
        let key = self.key(parts)?;
        let store = &self.store;
        let result = self.runtime.block_on(async {
            match store.get(&key).await {
                Ok(r) => r.bytes().await.map(|b| Some(b.to_vec())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        });
        result.map_err(|e| self.fail("download", parts, e))
    }

    /// The names one level below `parts` that hold objects (the "directories").
    pub fn list_dirs(&self, parts: &[&str]) -> Result<Vec<String>, CheckpointError> {
        let key = self.key(parts)?;
        let listing = self
            .runtime
            .block_on(self.store.list_with_delimiter(Some(&key)))
            .map_err(|e| self.fail("list", parts, e))?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// Every object below `parts` (recursively), as its path relative to `parts` (segments
    /// joined by `/`) and its size, sorted by path.
    pub fn list_files(&self, parts: &[&str]) -> Result<Vec<(String, u64)>, CheckpointError> {
        let key = self.key(parts)?;
        let base: Vec<String> = key.parts().map(|p| p.as_ref().to_string()).collect();
        let metas: Vec<object_store::ObjectMeta> = self
            .runtime
            .block_on(self.store.list(Some(&key)).try_collect())
            .map_err(|e| self.fail("list", parts, e))?;
        let mut out: Vec<(String, u64)> = metas
            .into_iter()
            .filter_map(|m| {
                let segs: Vec<String> =
                    m.location.parts().map(|p| p.as_ref().to_string()).collect();
                segs.starts_with(&base)
                    .then(|| (segs[base.len()..].join("/"), m.size))
            })
            .filter(|(rel, _)| !rel.is_empty())
            .collect();
        out.sort();
        Ok(out)
    }

    /// Removes the object at `parts` (no error if there is none).
    pub fn delete(&self, parts: &[&str]) -> Result<(), CheckpointError> {
        let key = self.key(parts)?;
        match self.runtime.block_on(self.store.delete(&key)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.fail("delete", parts, e)),
        }
    }
}
