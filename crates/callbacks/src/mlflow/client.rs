//! The REST calls the MLflow logger makes, and how their failures are sorted: worth retrying
//! (the connection, a timeout, 5xx, 429) or not (any other 4xx: the server refuses).

use std::time::Duration;

use serde_json::Value;

use crate::error::CallbackError;

/// Credentials for the tracking server. `Debug` shows which kind, never the secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum Credentials {
    /// None.
    #[default]
    None,
    /// `Authorization: Bearer <token>`.
    Token(String),
    /// `Authorization: Basic ...`.
    Basic {
        /// The user name.
        user: String,
        /// The password.
        password: String,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::None => f.write_str("None"),
            Credentials::Token(_) => f.write_str("Token(<hidden>)"),
            Credentials::Basic { user, .. } => write!(f, "Basic({user}, <hidden>)"),
        }
    }
}

impl Credentials {
    /// As MLflow's own client reads them: `MLFLOW_TRACKING_TOKEN`, else
    /// `MLFLOW_TRACKING_USERNAME` with `MLFLOW_TRACKING_PASSWORD`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let Some(token) = var("MLFLOW_TRACKING_TOKEN") {
            return Credentials::Token(token);
        }
        match (
            var("MLFLOW_TRACKING_USERNAME"),
            var("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(user), Some(password)) => Credentials::Basic { user, password },
            _ => Credentials::None,
        }
    }
}

/// `uri` without a `user:password@` part (found by hand, so that a URI no parser takes is
/// redacted too).
pub fn redact_uri(uri: &str) -> String {
    let start = uri.find("://").map(|i| i + 3).unwrap_or(0);
    let authority_end = uri[start..]
        .find(['/', '?', '#'])
        .map(|i| start + i)
        .unwrap_or(uri.len());
    match uri[start..authority_end].rfind('@') {
        Some(at) => format!("{}{}", &uri[..start], &uri[start + at + 1..]),
        None => uri.to_string(),
    }
}

/// The server's base URL (no credentials, no trailing `/`), and the credentials to use (those
/// given, else a `user:password@` in the URI).
pub fn parse_uri(uri: &str, given: &Credentials) -> Result<(String, Credentials), CallbackError> {
    let bad = |why: &str| {
        CallbackError::param(
            "mlflow_logger",
            "tracking_uri",
            format!("{:?}", redact_uri(uri)),
            format!("an MLflow tracking server's address, http://host:port or https://host[/prefix] ({why})"),
        )
    };
    let mut url = reqwest::Url::parse(uri.trim()).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(
            "file stores, databricks and other schemes are not supported: start `mlflow server` and give its address",
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("no query or fragment"));
    }
    let mut credentials = given.clone();
    if !url.username().is_empty() {
        if credentials == Credentials::None {
            credentials = Credentials::Basic {
                user: percent_decode(url.username()),
                password: percent_decode(url.password().unwrap_or_default()),
            };
        }
        let _ = url.set_username("");
        let _ = url.set_password(None);
    }
    let base = url.to_string().trim_end_matches('/').to_string();
    Ok((base, credentials))
}

/// A URI's percent-encoded user or password as text (`%40` is `@`).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).and_then(|&b| hex(b)),
            bytes.get(i + 2).and_then(|&b| hex(b)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Why a request failed.
#[derive(Debug)]
pub enum Failure {
    /// Worth another try: no connection, a timeout, 5xx, 429.
    Transient(String),
    /// The server refuses it (400, 403, 404...): retrying would not help.
    Refused {
        /// The HTTP status.
        status: u16,
        /// MLflow's `error_code` when it sent one.
        code: String,
        /// The server's message.
        message: String,
    },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Transient(m) => f.write_str(m),
            Failure::Refused {
                status,
                code,
                message,
            } => write!(f, "HTTP {status} {code}: {message}"),
        }
    }
}

/// A blocking client for one server.
pub struct Client {
    http: reqwest::blocking::Client,
    base: String,
    credentials: Credentials,
    timeout: Duration,
    /// When set, every request ends by then (the end of the run's wait).
    deadline: Option<std::time::Instant>,
}

impl Client {
    /// A client for `base` (from [`parse_uri`]).
    pub fn new(
        base: String,
        credentials: Credentials,
        timeout: Duration,
    ) -> Result<Self, CallbackError> {
        let http = reqwest::blocking::Client::builder()
            .timeout(None)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| {
                CallbackError::param(
                    "mlflow_logger",
                    "tracking_uri",
                    &base,
                    format!("a server an HTTP client can be built for ({e})"),
                )
            })?;
        Ok(Client {
            http,
            base,
            credentials,
            timeout,
            deadline: None,
        })
    }

    /// Every request from now on ends by `deadline` (`None`: each has its own time limit).
    pub fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.deadline = deadline;
    }

    /// The time a request of `bytes` may take: the time limit, plus a second a MiB for an
    /// upload, within the deadline.
    fn limit(&self, bytes: u64) -> Result<Duration, Failure> {
        let mut limit = self.timeout + Duration::from_secs(bytes >> 20);
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(Failure::Transient(
                    "the end of the run's wait for MLflow".into(),
                ));
            }
            limit = limit.min(left);
        }
        Ok(limit)
    }

    /// The server's address, as shown in messages.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn auth(
        &self,
        req: reqwest::blocking::RequestBuilder,
        bytes: u64,
    ) -> Result<reqwest::blocking::RequestBuilder, Failure> {
        let req = req.timeout(self.limit(bytes)?);
        Ok(match &self.credentials {
            Credentials::None => req,
            Credentials::Token(t) => req.bearer_auth(t),
            Credentials::Basic { user, password } => req.basic_auth(user, Some(password)),
        })
    }

    fn finish(
        &self,
        what: &str,
        sent: reqwest::Result<reqwest::blocking::Response>,
    ) -> Result<Value, Failure> {
        let response = sent.map_err(|e| {
            // reqwest's errors name the URL, which holds no credentials (they go in a header).
            Failure::Transient(format!("{what}: {}", error_chain(&e)))
        })?;
        let status = response.status();
        let body = response.text().unwrap_or_default();
        if status.is_success() {
            return Ok(serde_json::from_str(&body).unwrap_or(Value::Null));
        }
        let parsed: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        let code = parsed["error_code"].as_str().unwrap_or("").to_string();
        let message = parsed["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| body.chars().take(300).collect());
        if status.is_server_error() || status.as_u16() == 429 || status.as_u16() == 408 {
            Err(Failure::Transient(format!(
                "{what}: HTTP {} {code} {message}",
                status.as_u16()
            )))
        } else {
            Err(Failure::Refused {
                status: status.as_u16(),
                code,
                message: format!("{what}: {message}"),
            })
        }
    }

    /// `GET /api/2.0/mlflow/<endpoint>?<query>`.
    pub fn get(&self, endpoint: &str, query: &[(&str, &str)]) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.base);
        let sent = self.auth(self.http.get(&url).query(query), 0)?.send();
        self.finish(endpoint, sent)
    }

    /// `POST /api/2.0/mlflow/<endpoint>` with a JSON body.
    pub fn post(&self, endpoint: &str, body: &Value) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.base);
        let sent = self
            .auth(self.http.post(&url), 0)?
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send();
        self.finish(endpoint, sent)
    }

    /// `PUT /api/2.0/mlflow-artifacts/artifacts/<path>` with the bytes of `body`.
    pub fn put_artifact(
        &self,
        path: &str,
        body: reqwest::blocking::Body,
        bytes: u64,
    ) -> Result<Value, Failure> {
        let encoded: Vec<String> = path
            .split('/')
            .map(|p| {
                p.bytes()
                    .map(|b| {
                        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                            (b as char).to_string()
                        } else {
                            format!("%{b:02X}")
                        }
                    })
                    .collect()
            })
            .collect();
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{}",
            self.base,
            encoded.join("/")
        );
        let sent = self
            .auth(self.http.put(&url), bytes)?
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .send();
        self.finish("artifact upload", sent)
    }
}

/// An error and its causes on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_are_checked_and_their_credentials_taken_out() {
        let (base, c) = parse_uri("http://127.0.0.1:5000/", &Credentials::None).unwrap();
        assert_eq!(
            (base.as_str(), c),
            ("http://127.0.0.1:5000", Credentials::None)
        );
        let (base, c) = parse_uri(
            "https://alice:s3cret@mlflow.example/prefix",
            &Credentials::None,
        )
        .unwrap();
        assert_eq!(base, "https://mlflow.example/prefix");
        assert_eq!(
            c,
            Credentials::Basic {
                user: "alice".into(),
                password: "s3cret".into()
            }
        );
        for bad in [
            "file:///tmp/mlruns",
            "databricks",
            "http://",
            "ftp://x",
            "http://h/?a=1",
        ] {
            let e = parse_uri(bad, &Credentials::None).unwrap_err().to_string();
            assert!(
                e.contains("tracking_uri") && e.contains("http://host:port"),
                "{bad}: {e}"
            );
        }
        let e = parse_uri("file://alice:s3cret@x/y", &Credentials::None)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }

    /// Serves one HTTP request on a socket of 127.0.0.1 with `status` and `body`, and
    /// returns the request's text.
    fn serve_once(status: &str, body: &'static str) -> (String, std::thread::JoinHandle<String>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let status = status.to_string();
        let handle = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = vec![0u8; 65536];
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            write!(
                s,
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            String::from_utf8_lossy(&got).into_owned()
        });
        (base, handle)
    }

    #[test]
    fn a_token_goes_in_the_authorization_header() {
        let (base, server) = serve_once("200 OK", "{\"ok\": 1}");
        let client = Client::new(
            base,
            Credentials::Token("tok-abc".into()),
            Duration::from_secs(10),
        )
        .unwrap();
        let v = client
            .get("experiments/get-by-name", &[("experiment_name", "a b")])
            .unwrap();
        assert_eq!(v["ok"], 1);
        let request = server.join().unwrap().to_lowercase();
        assert!(
            request.starts_with("get /api/2.0/mlflow/experiments/get-by-name?experiment_name=a+b "),
            "{request}"
        );
        assert!(
            request.contains("authorization: bearer tok-abc"),
            "{request}"
        );
    }

    #[test]
    fn failures_are_sorted_into_retried_and_refused() {
        for (status, retried) in [
            ("503 Service Unavailable", true),
            ("500 Internal Server Error", true),
            ("429 Too Many Requests", true),
            ("400 Bad Request", false),
            ("401 Unauthorized", false),
        ] {
            let (base, server) = serve_once(status, "{\"error_code\": \"X\", \"message\": \"m\"}");
            let client = Client::new(base, Credentials::None, Duration::from_secs(10)).unwrap();
            let f = client
                .post("runs/log-batch", &serde_json::json!({}))
                .unwrap_err();
            server.join().unwrap();
            assert_eq!(matches!(f, Failure::Transient(_)), retried, "{status}: {f}");
            assert!(f.to_string().contains(&status[..3]), "{f}");
        }
        // Nothing listening: retried.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = Client::new(
            format!("http://127.0.0.1:{port}"),
            Credentials::None,
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(matches!(client.get("x", &[]), Err(Failure::Transient(_))));
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let shown = format!(
            "{:?} {:?}",
            Credentials::Token("tok-123".into()),
            Credentials::Basic {
                user: "alice".into(),
                password: "pw-456".into()
            }
        );
        assert!(
            !shown.contains("tok-123") && !shown.contains("pw-456"),
            "{shown}"
        );
        assert_eq!(redact_uri("http://a:b@h:1/x"), "http://h:1/x");
        assert_eq!(redact_uri("alice:pw@host:5000"), "host:5000");
        let (_, c) = parse_uri("http://al%40ce:p%2Fw%3A@h:1", &Credentials::None).unwrap();
        assert_eq!(
            c,
            Credentials::Basic {
                user: "al@ce".into(),
                password: "p/w:".into()
            }
        );
    }
}
