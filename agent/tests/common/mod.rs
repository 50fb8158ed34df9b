//! Helpers shared by the agent's integration tests: build the C test doubles of the
//! vendor libraries, run the real `faultline-agent` binary with its own environment on
//! a loopback port, talk to it over HTTP, wait for conditions with a deadline. The
//! repository root and [`ChildGuard`] come from `faultline_common::testing`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[allow(unused_imports)]
pub use faultline_common::testing::{repo_root, ChildGuard};
use faultline_common::{DeviceHealth, NodeHealth};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Path of a file under the repository's `tests/`.
pub fn test_path(rel: &str) -> PathBuf {
    repo_root().join("tests").join(rel)
}

fn build_double(src: &str, name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("doubles");
    faultline_common::testing::build_c_double(src, name, &dir)
}

/// The C double of libnvidia-ml.so, built once per test binary.
pub fn fake_nvml() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| build_double("fixtures/nvml/fake_nvml.c", "libnvidia-ml.so.1"))
}

/// The C double of libdcmi.so.
pub fn fake_dcmi() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| build_double("fixtures/dcmi/fake_dcmi.c", "libdcmi.so"))
}

/// A running agent process.
pub struct AgentProc {
    child: Child,
    pub addr: SocketAddr,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl AgentProc {
    /// Base URL.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

/// Run the agent binary with `flags` and extra environment.
pub fn spawn_agent(flags: &[&str], env: &[(&str, &str)]) -> AgentProc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_faultline-agent"));
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--node-name",
        "test-node",
        "--log-format",
        "json",
    ])
    .args(flags)
    .env("RUST_LOG", "info")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn faultline-agent");
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if let Some(a) = v["fields"]["addr"].as_str() {
                        let _ = tx.send(a.parse::<SocketAddr>().unwrap());
                    }
                }
                log.lock().unwrap().push(line);
            }
        });
    }
    let addr = match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(a) => a,
        Err(_) => {
            let _ = child.kill();
            panic!("agent did not start: {}", log.lock().unwrap().join("\n"));
        }
    };
    AgentProc { child, addr, log }
}

/// A response: status and body.
pub struct Resp {
    pub status: u16,
    pub body: String,
}

impl Resp {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One HTTP request over loopback.
pub async fn request(method: &str, url: &str, body: Option<&str>) -> Resp {
    request_with(method, url, body, Some("application/json")).await
}

/// The longest any test request may take.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// One HTTP request with a chosen content type.
pub async fn request_with(
    method: &str,
    url: &str,
    body: Option<&str>,
    content_type: Option<&str>,
) -> Resp {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut b = hyper::Request::builder().method(method).uri(url);
    if let (Some(_), Some(ct)) = (body, content_type) {
        b = b.header("content-type", ct);
    }
    let req = b
        .body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
        .unwrap();
    // No request may hang a test: long-polls in these tests wait 20 s at most.
    let resp = tokio::time::timeout(REQUEST_DEADLINE, client.request(req))
        .await
        .unwrap_or_else(|_| panic!("{method} {url}: no answer within {REQUEST_DEADLINE:?}"))
        .expect("request");
    let status = resp.status().as_u16();
    let bytes = tokio::time::timeout(REQUEST_DEADLINE, resp.into_body().collect())
        .await
        .unwrap_or_else(|_| panic!("{method} {url}: body not done within {REQUEST_DEADLINE:?}"))
        .expect("body")
        .to_bytes();
    Resp {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// GET /v1/health, parsed.
pub async fn health(agent: &AgentProc) -> NodeHealth {
    let r = request("GET", &agent.url("/v1/health"), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("bad document ({e}): {}", r.body))
}

/// One device of the document.
pub fn device<'a>(doc: &'a NodeHealth, id: &str) -> &'a DeviceHealth {
    doc.npus
        .iter()
        .find(|d| d.reading.id == id)
        .unwrap_or_else(|| {
            panic!(
                "no device {id} in {:?}",
                doc.npus.iter().map(|d| &d.reading.id).collect::<Vec<_>>()
            )
        })
}

/// Poll the document until `pred` holds or `within` passes; returns that document.
pub async fn wait_for(
    agent: &AgentProc,
    within: Duration,
    what: &str,
    pred: impl Fn(&NodeHealth) -> bool,
) -> NodeHealth {
    let deadline = Instant::now() + within;
    loop {
        let doc = health(agent).await;
        if pred(&doc) {
            return doc;
        }
        if Instant::now() > deadline {
            panic!(
                "timed out after {within:?} waiting for: {what}\nlast document: {}\nagent log:\n{}",
                serde_json::to_string_pretty(&doc).unwrap(),
                agent.log_text()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status and reason of one device.
pub fn status_of(doc: &NodeHealth, id: &str) -> (String, Option<String>) {
    let d = device(doc, id);
    (d.status.as_str().to_string(), d.reason.clone())
}

/// A state file for a C double: replaced atomically so a call never sees half of it.
pub struct StateFile {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl StateFile {
    /// A new state file with `content`.
    pub fn new(content: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        let s = StateFile { path, _dir: dir };
        s.set(content);
        s
    }

    /// Replace the content.
    pub fn set(&self, content: &str) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }

    /// The path as a str.
    pub fn p(&self) -> &str {
        self.path.to_str().unwrap()
    }
}

/// The sum of every series of counter `name` the agent serves now.
pub async fn metric(agent: &AgentProc, name: &str) -> u64 {
    let text = request("GET", &agent.url("/metrics"), None).await.body;
    faultline_common::testing::metric_sum(&text, name) as u64
}

/// The agent's own progress instead of wall time: wait (60 s at most) until the sum of
/// every series of counter `name` is at least `at_least`; the text then.
pub async fn reaches(agent: &AgentProc, name: &str, at_least: u64) -> String {
    let start = Instant::now();
    loop {
        let text = request("GET", &agent.url("/metrics"), None).await.body;
        let v = faultline_common::testing::metric_sum(&text, name) as u64;
        if v >= at_least {
            return text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{name} is {v}, not {at_least}, after 60 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`reaches`] `n` more than now.
pub async fn grows(agent: &AgentProc, name: &str, n: u64) -> String {
    let base = metric(agent, name).await;
    reaches(agent, name, base + n).await
}

/// Wait (30 s at most) until the agent's log holds `needle`: a line the agent writes
/// for that purpose, instead of a sleep.
pub async fn logged(agent: &AgentProc, needle: &str) {
    let start = Instant::now();
    while !agent.log_text().contains(needle) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no {needle:?} logged in 30 s:\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
