//! The MLflow logger's thread: takes what the training thread hands over, opens (or finds)
//! the run, and sends everything in batches, retrying with backoff while the server is away.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::client::{Client, Failure};
use super::{MlflowReport, RUN_UID_TAG};

/// MLflow's limits per `log-batch` request, and on names and values (MLflow 2 and 3). A
/// request is also refused over 1 MB: params and tags go in separate requests of at most 50
/// (300 KB and 400 KB at the longest values).
const MAX_METRICS: usize = 1000;
const MAX_PARAMS: usize = 100;
const MAX_TAGS: usize = 100;
const MAX_KEY: usize = 250;
const MAX_PARAM_VALUE: usize = 6000;
const MAX_TAG_VALUE: usize = 8000;
/// Queued metric values beyond this are dropped, oldest first, with a warning (the local logs
/// keep them): about 100 MB of a server that never comes back.
const MAX_QUEUED_METRICS: usize = 1_000_000;

/// Where an artifact's bytes are.
pub enum Source {
    /// A file in the staging folder (removed once uploaded).
    Staged(PathBuf),
    /// The file itself, where it could not be linked into the staging folder (another file
    /// system): read when uploaded, so it must still be there then.
    Original(PathBuf),
    /// In memory.
    Bytes(Vec<u8>),
}

/// An artifact to upload under `name`.
pub struct Artifact {
    pub name: String,
    pub source: Source,
}

/// What the training thread hands over.
pub enum Msg {
    Open {
        uid: String,
        run_name: String,
        resumed: bool,
        start_ms: i64,
    },
    Params(Map<String, Value>),
    Metrics {
        time_ms: i64,
        step: i64,
        values: Vec<(String, f64)>,
    },
    Artifact(Artifact),
    FitStarted,
    FitEnded,
    Finish,
}

pub struct Config {
    pub client: Client,
    pub experiment: String,
    pub flush_interval: Duration,
    pub warn_after: u32,
    pub max_backoff: Duration,
    pub finish_timeout: Duration,
    pub base_tags: Vec<(String, String)>,
}

struct Metric {
    key: String,
    value: f64,
    time_ms: i64,
    step: i64,
}

struct OpenRun {
    id: String,
    experiment_id: String,
    artifact_uri: String,
    /// Params the run already has (a resumed run's).
    params: BTreeMap<String, String>,
}

struct Worker {
    cfg: Config,
    open: Option<(String, String, bool, i64)>,
    run: Option<OpenRun>,
    params: Vec<(String, String)>,
    tags: Vec<(String, String)>,
    metrics: VecDeque<Metric>,
    artifacts: VecDeque<Artifact>,
    keys: HashMap<String, String>,
    report: MlflowReport,
    failures_in_row: u32,
    warned: bool,
    retry_at: Option<Instant>,
    /// The server refused to open the run: nothing can be sent.
    dead: bool,
    fit_started: bool,
    fit_ended: bool,
    dropped: u64,
    /// The last failure, for the end's warning.
    last_error: Option<String>,
}

pub fn run(cfg: Config, rx: Receiver<Msg>) -> MlflowReport {
    let mut w = Worker {
        cfg,
        open: None,
        run: None,
        params: Vec::new(),
        tags: Vec::new(),
        metrics: VecDeque::new(),
        artifacts: VecDeque::new(),
        keys: HashMap::new(),
        report: MlflowReport::default(),
        failures_in_row: 0,
        warned: false,
        retry_at: None,
        dead: false,
        fit_started: false,
        fit_ended: false,
        dropped: 0,
        last_error: None,
    };
    let mut finishing: Option<Instant> = None;
    let mut last_flush = Instant::now();
    loop {
        let now = Instant::now();
        if let Some(deadline) = finishing {
            // Nothing more can come: wait only for a retry that is due before the deadline.
            if let Some(at) = w.retry_at.filter(|&at| at > now) {
                std::thread::sleep(at.min(deadline).saturating_duration_since(now));
            }
            while let Ok(m) = rx.try_recv() {
                w.take(m);
            }
        } else {
            // Idle (nothing queued, no retry due): sleep until a message comes.
            let got = if !w.has_work() {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                let mut until = later(last_flush, w.cfg.flush_interval);
                if let Some(at) = w.retry_at {
                    until = until.max(at);
                }
                rx.recv_timeout(until.saturating_duration_since(now))
            };
            match got {
                Ok(m) => {
                    let mut finish = matches!(m, Msg::Finish);
                    w.take(m);
                    while let Ok(m) = rx.try_recv() {
                        finish |= matches!(m, Msg::Finish);
                        w.take(m);
                    }
                    if finish {
                        finishing = Some(later(Instant::now(), w.cfg.finish_timeout));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    finishing = Some(later(Instant::now(), w.cfg.finish_timeout));
                }
            }
        }
        // Every request from now on ends by the deadline.
        w.cfg.client.set_deadline(finishing);
        let now = Instant::now();
        let ready = w.retry_at.is_none_or(|at| now >= at);
        let due = finishing.is_some()
            || now >= later(last_flush, w.cfg.flush_interval)
            || w.metrics.len() >= MAX_METRICS;
        if due {
            if ready && w.has_work() {
                w.send_all();
            }
            last_flush = Instant::now();
        }
        if let Some(deadline) = finishing {
            if !w.has_work() || w.dead || Instant::now() >= deadline {
                w.end();
                return w.report;
            }
        }
    }
}

/// `at + d`, or a year after `at` when that is out of range (a huge timeout means "wait").
fn later(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(at)
}

/// A metric value as MLflow's JSON takes it (NaN and infinities as strings).
fn json_value(v: f64) -> Value {
    if v.is_nan() {
        json!("NaN")
    } else if v.is_infinite() {
        json!(if v > 0.0 { "Infinity" } else { "-Infinity" })
    } else {
        json!(v)
    }
}

/// A name MLflow takes: letters, digits, `_ - . space : /`, no part that is empty, `.` or
/// `..` (MLflow stores names as paths), at most 250 characters.
pub fn mlflow_key(key: &str) -> String {
    let chars: String = key
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ' ' | ':' | '/') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let parts: Vec<String> = chars
        .split('/')
        .map(|p| match p {
            "" | "." | ".." => "_".repeat(p.len().max(1)),
            _ => p.to_string(),
        })
        .collect();
    let mut out = parts.join("/");
    if out.chars().count() > MAX_KEY {
        out = out.chars().take(MAX_KEY).collect();
    }
    out
}

impl Worker {
    /// Whether there is something to send, and a run to send it to (or to open): before the
    /// logger's first value (which opens the run) nothing can be sent.
    fn has_work(&self) -> bool {
        if self.dead || (self.open.is_none() && self.run.is_none()) {
            return false;
        }
        !self.params.is_empty()
            || !self.tags.is_empty()
            || !self.metrics.is_empty()
            || !self.artifacts.is_empty()
            || self.run.is_none()
    }

    fn key(&mut self, raw: &str) -> String {
        if let Some(k) = self.keys.get(raw) {
            return k.clone();
        }
        let k = mlflow_key(raw);
        if k != raw {
            tracing::warn!(name = raw, logged_as = %k, "MLflow does not take this name as it is; logged under another (the local logs keep the original)");
        }
        self.keys.insert(raw.to_string(), k.clone());
        k
    }

    fn take(&mut self, m: Msg) {
        if self.dead {
            // The server refused the run: what comes is counted, not queued.
            match m {
                Msg::Metrics { values, .. } => self.report.metrics_unsent += values.len() as u64,
                Msg::Artifact(a) => {
                    self.report.artifacts_unsent += 1;
                    if let Source::Staged(p) = a.source {
                        let _ = std::fs::remove_file(p);
                    }
                }
                _ => {}
            }
            return;
        }
        match m {
            Msg::Open {
                uid,
                run_name,
                resumed,
                start_ms,
            } => {
                if self.open.is_none() {
                    self.open = Some((uid, run_name, resumed, start_ms));
                }
            }
            Msg::Params(params) => {
                let resumed = self.open.as_ref().is_some_and(|o| o.2);
                for (k, v) in &params {
                    let key = self.key(k);
                    let value = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    self.params.push((key, value));
                }
                for tag in [
                    "backend",
                    "world_size",
                    "algorithms",
                    "precision",
                    "sharding",
                ] {
                    if let Some(v) = params.get(tag) {
                        let value = match v {
                            Value::String(s) => s.clone(),
                            Value::Array(items) => items
                                .iter()
                                .map(|i| i.as_str().map(str::to_string).unwrap_or(i.to_string()))
                                .collect::<Vec<_>>()
                                .join(","),
                            other => other.to_string(),
                        };
                        self.tags.push((format!("flashover.{tag}"), value));
                    }
                }
                let name = if resumed {
                    "hyperparameters.resumed.json"
                } else {
                    "hyperparameters.json"
                };
                self.artifacts.push_back(Artifact {
                    name: name.into(),
                    source: Source::Bytes(
                        serde_json::to_vec_pretty(&Value::Object(params)).unwrap_or_default(),
                    ),
                });
            }
            Msg::Metrics {
                time_ms,
                step,
                values,
            } => {
                for (k, value) in values {
                    let key = self.key(&k);
                    self.metrics.push_back(Metric {
                        key,
                        value,
                        time_ms,
                        step,
                    });
                }
                if self.metrics.len() > MAX_QUEUED_METRICS {
                    let over = self.metrics.len() - MAX_QUEUED_METRICS;
                    self.metrics.drain(..over);
                    if self.dropped == 0 {
                        tracing::warn!(uri = self.cfg.client.base(), "MLflow has been away so long that queued values are dropped, oldest first (the local logs keep every value)");
                    }
                    self.dropped += over as u64;
                    self.report.metrics_unsent += over as u64;
                }
            }
            Msg::Artifact(a) => self.artifacts.push_back(a),
            Msg::FitStarted => {
                self.fit_started = true;
                self.fit_ended = false;
            }
            Msg::FitEnded => self.fit_ended = true,
            Msg::Finish => {}
        }
    }

    /// Counts a failed request: a transient one schedules a retry (and warns after
    /// `warn_after` in a row); returns whether to stop sending for now.
    fn failed(&mut self, f: &Failure) {
        self.report.failed_requests += 1;
        self.failures_in_row += 1;
        self.last_error = Some(f.to_string());
        let exp = (self.failures_in_row - 1).min(16);
        let backoff = Duration::from_millis(500 * (1u64 << exp)).min(self.cfg.max_backoff);
        self.retry_at = Some(Instant::now() + backoff);
        if self.failures_in_row == self.cfg.warn_after {
            self.warned = true;
            tracing::warn!(
                uri = self.cfg.client.base(),
                attempts = self.failures_in_row,
                error = %f,
                queued_metrics = self.metrics.len(),
                queued_files = self.artifacts.len(),
                "MLflow does not answer; training goes on, the values stay queued and are retried (the local logs hold every value)"
            );
        }
    }

    fn succeeded(&mut self) {
        if self.warned {
            tracing::warn!(
                uri = self.cfg.client.base(),
                after_attempts = self.failures_in_row,
                "MLflow answers again; sending what was queued"
            );
        }
        self.warned = false;
        self.failures_in_row = 0;
        self.retry_at = None;
    }

    fn refused(&mut self, what: &str, f: &Failure) {
        self.last_error = Some(f.to_string());
        tracing::warn!(uri = self.cfg.client.base(), error = %f, "MLflow refused {what}; dropped (the local logs keep it)");
    }

    /// Sends everything queued, stopping at the first transient failure.
    fn send_all(&mut self) {
        if self.dead {
            return;
        }
        if self.run.is_none() {
            if self.open.is_none() {
                return;
            }
            match self.open_run() {
                Ok(run) => {
                    self.succeeded();
                    self.report.run_id = Some(run.id.clone());
                    self.report.experiment_id = Some(run.experiment_id.clone());
                    tracing::info!(
                        run = %format!("{}/#/experiments/{}/runs/{}", self.cfg.client.base(), run.experiment_id, run.id),
                        "MLflow run"
                    );
                    self.run = Some(run);
                }
                Err(f @ Failure::Transient(_)) => return self.failed(&f),
                Err(f) => {
                    tracing::warn!(uri = self.cfg.client.base(), error = %f, "MLflow refused to open the run; nothing is sent to it (the local logs hold every value)");
                    self.dead = true;
                    return;
                }
            }
        }
        let run_id = self.run.as_ref().map(|r| r.id.clone()).unwrap_or_default();
        // Params (checked against those the run has: MLflow refuses a changed one), then
        // tags, each in requests well under MLflow's 1 MB a request.
        self.resolve_params();
        for params in [true, false] {
            loop {
                let queue = if params { &self.params } else { &self.tags };
                if queue.is_empty() {
                    break;
                }
                let n = queue
                    .len()
                    .min(if params { MAX_PARAMS } else { MAX_TAGS } / 2);
                let pairs: Vec<Value> = queue[..n]
                    .iter()
                    .map(|(k, v)| json!({"key": k, "value": v}))
                    .collect();
                let field = if params { "params" } else { "tags" };
                let body = json!({"run_id": run_id, field: pairs});
                match self.cfg.client.post("runs/log-batch", &body) {
                    Ok(_) => {
                        self.succeeded();
                        if params {
                            let sent: Vec<(String, String)> = self.params[..n].to_vec();
                            if let Some(run) = &mut self.run {
                                run.params.extend(sent);
                            }
                        }
                    }
                    Err(f @ Failure::Transient(_)) => return self.failed(&f),
                    Err(f) => self.refused(field, &f),
                }
                if params {
                    self.params.drain(..n);
                } else {
                    self.tags.drain(..n);
                }
            }
        }
        // Metrics, a thousand a request.
        while !self.metrics.is_empty() {
            let n = self.metrics.len().min(MAX_METRICS);
            let metrics: Vec<Value> = self
                .metrics
                .iter()
                .take(n)
                .map(|m| {
                    json!({"key": m.key, "value": json_value(m.value), "timestamp": m.time_ms, "step": m.step})
                })
                .collect();
            let body = json!({"run_id": run_id, "metrics": metrics});
            match self.cfg.client.post("runs/log-batch", &body) {
                Ok(_) => {
                    self.succeeded();
                    self.report.metrics_sent += n as u64;
                }
                Err(f @ Failure::Transient(_)) => return self.failed(&f),
                Err(f) => {
                    self.refused(&format!("{n} metric values"), &f);
                    self.report.metrics_unsent += n as u64;
                }
            }
            self.metrics.drain(..n);
        }
        // Artifacts, one a request.
        while let Some(a) = self.artifacts.front() {
            match self.upload(a) {
                Ok(()) => {
                    self.succeeded();
                    self.report.artifacts_sent += 1;
                }
                Err(f @ Failure::Transient(_)) => return self.failed(&f),
                Err(f) => {
                    self.refused(&format!("the file {}", a.name), &f);
                    self.report.artifacts_unsent += 1;
                }
            }
            if let Some(Artifact {
                source: Source::Staged(p),
                ..
            }) = self.artifacts.pop_front()
            {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    /// Params the run already has with the same value are not sent again; one with another
    /// value (a resumed run with other settings), or too long for a param, becomes a tag
    /// `flashover.param.<key>` and is named in a warning. A key queued twice (two names that
    /// became one) keeps its last value.
    fn resolve_params(&mut self) {
        let Some(run) = &self.run else {
            return;
        };
        let mut changed = Vec::new();
        let mut keep: Vec<(String, String)> = Vec::new();
        let mut tags = Vec::new();
        for (k, v) in std::mem::take(&mut self.params) {
            keep.retain(|(kk, _)| *kk != k);
            match run.params.get(&k) {
                Some(old) if *old == v => {}
                Some(old) => {
                    changed.push(format!("{k}: {old} -> {v}"));
                    tags.push((k, v));
                }
                None if v.chars().count() > MAX_PARAM_VALUE => {
                    changed.push(format!("{k}: {} characters", v.chars().count()));
                    tags.push((k, v));
                }
                None => keep.push((k, v)),
            }
        }
        self.params = keep;
        for (k, v) in tags {
            let key = mlflow_key(&format!("flashover.param.{k}"));
            self.tags
                .push((key, v.chars().take(MAX_TAG_VALUE).collect()));
        }
        if !changed.is_empty() {
            tracing::warn!(
                params = %changed.join("; "),
                "MLflow params cannot change or exceed 6000 characters: these are tags `flashover.param.<key>` instead (the whole configuration is the artifact hyperparameters.json)"
            );
        }
    }

    fn experiment_id(&self) -> Result<String, Failure> {
        let name = self.cfg.experiment.as_str();
        match self
            .cfg
            .client
            .get("experiments/get-by-name", &[("experiment_name", name)])
        {
            Ok(v) => return Ok(string(&v["experiment"]["experiment_id"])),
            Err(Failure::Refused { code, .. }) if code == "RESOURCE_DOES_NOT_EXIST" => {}
            Err(f) => return Err(f),
        }
        match self
            .cfg
            .client
            .post("experiments/create", &json!({"name": name}))
        {
            Ok(v) => Ok(string(&v["experiment_id"])),
            // Created by someone else in between.
            Err(Failure::Refused { code, .. }) if code == "RESOURCE_ALREADY_EXISTS" => self
                .cfg
                .client
                .get("experiments/get-by-name", &[("experiment_name", name)])
                .map(|v| string(&v["experiment"]["experiment_id"])),
            Err(f) => Err(f),
        }
    }

    /// Finds the run tagged with this training run's uid (a resumed run, or a create whose
    /// answer was lost), or creates it.
    fn open_run(&self) -> Result<OpenRun, Failure> {
        let (uid, run_name, resumed, start_ms) = self.open.clone().unwrap_or_default();
        let experiment_id = self.experiment_id()?;
        let found = self.cfg.client.post(
            "runs/search",
            &json!({
                "experiment_ids": [experiment_id],
                "filter": format!("tags.{RUN_UID_TAG} = '{uid}'"),
                "max_results": 1,
            }),
        )?;
        if let Some(run) = found["runs"].as_array().and_then(|r| r.first()) {
            let id = string(&run["info"]["run_id"]);
            self.cfg
                .client
                .post("runs/update", &json!({"run_id": id, "status": "RUNNING"}))?;
            let params = run["data"]["params"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .map(|p| (string(&p["key"]), string(&p["value"])))
                        .collect()
                })
                .unwrap_or_default();
            return Ok(OpenRun {
                id,
                experiment_id,
                artifact_uri: string(&run["info"]["artifact_uri"]),
                params,
            });
        }
        if resumed {
            tracing::warn!(
                experiment = %self.cfg.experiment,
                uid = %uid,
                "the resumed run's MLflow run is not in this experiment; starting a new MLflow run"
            );
        }
        let mut tags = vec![json!({"key": RUN_UID_TAG, "value": uid})];
        tags.extend(
            self.cfg
                .base_tags
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v})),
        );
        let created = self.cfg.client.post(
            "runs/create",
            &json!({
                "experiment_id": experiment_id,
                "run_name": run_name,
                "start_time": start_ms,
                "tags": tags,
            }),
        )?;
        Ok(OpenRun {
            id: string(&created["run"]["info"]["run_id"]),
            experiment_id,
            artifact_uri: string(&created["run"]["info"]["artifact_uri"]),
            params: BTreeMap::new(),
        })
    }

    fn upload(&self, a: &Artifact) -> Result<(), Failure> {
        let uri = self
            .run
            .as_ref()
            .map(|r| r.artifact_uri.clone())
            .unwrap_or_default();
        let body = || -> Result<(reqwest::blocking::Body, u64), Failure> {
            Ok(match &a.source {
                Source::Bytes(b) => (reqwest::blocking::Body::from(b.clone()), b.len() as u64),
                Source::Staged(p) | Source::Original(p) => {
                    let file = std::fs::File::open(p)
                        .map_err(|e| refused_locally(format!("{}: {e}", p.display())))?;
                    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
                    (reqwest::blocking::Body::from(file), size)
                }
            })
        };
        if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
            // `mlflow-artifacts:/<path>` or `mlflow-artifacts://<host>/<path>`: through this
            // server's artifact proxy.
            let path = match rest.strip_prefix("//") {
                Some(with_host) => with_host.split_once('/').map(|x| x.1).unwrap_or(""),
                None => rest.trim_start_matches('/'),
            };
            let (body, size) = body()?;
            self.cfg.client.put_artifact(
                &format!("{}/{}", path.trim_end_matches('/'), a.name),
                body,
                size,
            )?;
            return Ok(());
        }
        let local = uri
            .strip_prefix("file://")
            .or_else(|| uri.starts_with('/').then_some(uri.as_str()));
        let Some(dir) = local else {
            return Err(refused_locally(format!(
                "the run's artifact store {uri} is not one this logger writes to (the server's artifact proxy, mlflow-artifacts:, or a local folder)"
            )));
        };
        let to = PathBuf::from(dir).join(&a.name);
        let write = || -> std::io::Result<()> {
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let tmp = to.with_extension("flashover-tmp");
            match &a.source {
                Source::Bytes(b) => std::fs::write(&tmp, b)?,
                Source::Staged(p) | Source::Original(p) => {
                    std::fs::copy(p, &tmp)?;
                }
            }
            std::fs::rename(&tmp, &to)
        };
        write().map_err(|e| refused_locally(format!("{}: {e}", to.display())))
    }

    /// Ends the run: `FAILED` when training started and never reached `FIT_END`.
    fn end(&mut self) {
        let unsent_metrics = self.metrics.len() as u64;
        let unsent_files = self.artifacts.len() as u64;
        self.report.metrics_unsent += unsent_metrics;
        self.report.artifacts_unsent += unsent_files;
        if self.open.is_none() && self.run.is_none() {
            // Nothing trained in this process (a run resumed from its last checkpoint): there
            // was no run to attach the files to.
            if unsent_files > 0 {
                tracing::info!(
                    files = unsent_files,
                    "MLflow: nothing was trained in this process, so no run was opened for its files"
                );
            }
        } else if unsent_metrics + unsent_files > 0 {
            tracing::warn!(
                uri = self.cfg.client.base(),
                metrics = unsent_metrics,
                files = unsent_files,
                last_error = self.last_error.as_deref().unwrap_or("none"),
                "MLflow did not take everything before the end of the run (the local logs hold every value)"
            );
        }
        for a in self.artifacts.drain(..) {
            if let Source::Staged(p) = a.source {
                let _ = std::fs::remove_file(p);
            }
        }
        let Some(run) = &self.run else {
            return;
        };
        // Ending the run gets 10 s of its own after the deadline.
        self.cfg
            .client
            .set_deadline(Some(later(Instant::now(), Duration::from_secs(10))));
        let status = if self.fit_started && !self.fit_ended {
            "FAILED"
        } else {
            "FINISHED"
        };
        let end_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        match self.cfg.client.post(
            "runs/update",
            &json!({"run_id": run.id, "status": status, "end_time": end_time}),
        ) {
            Ok(_) => self.report.ended_as = Some(status.into()),
            Err(f) => {
                tracing::warn!(uri = self.cfg.client.base(), error = %f, "MLflow: could not end the run (it stays RUNNING)")
            }
        }
    }
}

fn refused_locally(message: String) -> Failure {
    Failure::Refused {
        status: 0,
        code: "LOCAL".into(),
        message,
    }
}

fn string(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_ones_mlflow_takes() {
        assert_eq!(mlflow_key("train/loss"), "train/loss");
        assert_eq!(
            mlflow_key("l2_norm/grad/fc1.weight"),
            "l2_norm/grad/fc1.weight"
        );
        assert_eq!(mlflow_key("acc@top#2"), "acc_top_2");
        assert_eq!(mlflow_key("/x//../y"), "_/x/_/__/y");
        assert_eq!(mlflow_key(&"k".repeat(300)).len(), 250);
    }

    #[test]
    fn non_finite_values_are_strings() {
        assert_eq!(json_value(f64::NAN), json!("NaN"));
        assert_eq!(json_value(f64::INFINITY), json!("Infinity"));
        assert_eq!(json_value(f64::NEG_INFINITY), json!("-Infinity"));
        assert_eq!(json_value(0.25), json!(0.25));
    }
}
