//! Helpers shared by the aggregator's integration tests: the Kubernetes API test server
//! as the aggregator meets it in a cluster ([`api_server`]), a scenario of Nodes, Pods
//! and simulated agents on it ([`Scenario`]), one aggregator launcher ([`Launch`]),
//! Node and Pod fixtures ([`NodeFixture`], [`PodFixture`]), what the tests read back
//! from the cluster ([`cluster`]), faults injected at agents, HTTP calls on loopback,
//! waiting with a deadline.
#![allow(dead_code, unused_imports)]

pub mod cluster;
mod fixtures;
pub mod hostile_agents;
mod process;
pub mod real;
mod scenario;

pub use cluster::*;
pub use faultline_common::testing::{repo_root, ChildGuard};
pub use fixtures::{NodeFixture, PodFixture};
pub use hostile_agents::churning_agent;
pub use process::{aggregator_process, AggregatorProcess};
pub use scenario::{Scenario, World, NO_AGENT};

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use faultline_test_apiserver::{ApiServer, Bootstrap};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The namespace of the aggregator's Leases and ConfigMaps in the tests.
pub const NS: &str = "faultline";

/// An aggregator's command line, built from a base per sink; [`Launch::start`] runs it
/// in-process.
pub struct Launch(Vec<String>);

impl Launch {
    fn base() -> Vec<String> {
        vec![
            "faultline-aggregator".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--kube-token-file".into(),
            aggregator_token_file().display().to_string(),
        ]
    }

    /// The file sink into `out`, following `agents`, as replica `r1`.
    pub fn file(agents: &[&faultline_agent::Agent], out: &Path) -> Self {
        let urls: Vec<String> = agents
            .iter()
            .map(|a| format!("http://{}", a.addr))
            .collect();
        Self::file_following(&urls.join(","), out)
    }

    /// The file sink into `out`, following `--agents agents` (`[NODE=]URL,...`).
    pub fn file_following(agents: &str, out: &Path) -> Self {
        let mut a = Self::base();
        a.extend(
            [
                "--agents",
                agents,
                "--out",
                out.to_str().unwrap(),
                "--replica",
                "r1",
            ]
            .map(String::from),
        );
        Launch(a)
    }

    /// The ConfigMap sink against the API server at `kube`, as `replica`, with `shards`
    /// shards and short Leases (3 s, renewed every 500 ms).
    pub fn configmap(kube: &str, replica: &str, shards: u32) -> Self {
        let mut a = Self::base();
        a.extend(
            [
                "--sink",
                "configmap",
                "--kube-server",
                kube,
                "--namespace",
                NS,
                "--shards",
                &shards.to_string(),
                "--replica",
                replica,
                "--lease-duration",
                "3s",
                "--lease-retry",
                "500ms",
            ]
            .map(String::from),
        );
        Launch(a)
    }

    /// [`Launch::configmap`] with one shard and remediation enforced: no share budget,
    /// a reconcile every 500 ms.
    pub fn healing(kube: &str, replica: &str) -> Self {
        Self::configmap(kube, replica, 1).args(&[
            "--remediation",
            "enforce",
            "--max-quarantined-percent",
            "100",
            "--reconcile-interval",
            "500ms",
        ])
    }

    /// `flag` set to `value`, in place of the value the base gave it if it gave one.
    pub fn set(mut self, flag: &str, value: &str) -> Self {
        match self.0.iter().position(|a| a == flag) {
            Some(i) if i + 1 < self.0.len() => self.0[i + 1] = value.into(),
            _ => self.0.extend([flag.to_string(), value.to_string()]),
        }
        self
    }

    /// More flags.
    pub fn args<S: AsRef<str>>(mut self, extra: &[S]) -> Self {
        self.0.extend(extra.iter().map(|s| s.as_ref().to_string()));
        self
    }

    /// A rules file, if any.
    pub fn rules(self, rules: Option<&Path>) -> Self {
        match rules {
            Some(r) => self.args(&["--rules", r.to_str().unwrap()]),
            None => self,
        }
    }

    /// The command line, for the real binary.
    pub fn into_args(self) -> Vec<String> {
        self.0.into_iter().skip(1).collect()
    }

    /// Start it.
    pub async fn start(self) -> faultline_aggregator::Aggregator {
        let cfg = faultline_aggregator::config::Config::parse_from(self.0).unwrap();
        faultline_aggregator::start(cfg).await.unwrap()
    }

    /// Start it with remediation and the intake judging time by `clock`: a test moves
    /// the clock past a window instead of sleeping through it.
    pub async fn start_on(
        self,
        clock: &faultline_common::time::Clock,
    ) -> faultline_aggregator::Aggregator {
        let cfg = faultline_aggregator::config::Config::parse_from(self.0).unwrap();
        faultline_aggregator::start_with_clock(cfg, clock.clone())
            .await
            .unwrap()
    }
}

/// A process's peak resident memory (`VmHWM`, KiB; 0 if it cannot be read).
pub fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A kube client of the API server at `url` as the aggregator's ServiceAccount, with
/// kube's own retries off.
pub fn kube_client(url: &str) -> kube::Client {
    let mut kc = kube::Config::new(url.parse().unwrap());
    kc.auth_info.token_file = Some(aggregator_token_file().display().to_string());
    kc.default_retry = false;
    kube::Client::try_from(kc).unwrap()
}

/// The user the aggregator runs as in a cluster (deploy/base/aggregator.yaml).
pub const AGGREGATOR_USER: &str = "system:serviceaccount:faultline:faultline-aggregator";

/// Files holding the bearer tokens of the test API server's users: the aggregator's
/// ServiceAccount and an administrator (people running `faultline` and kubectl).
fn token_files() -> &'static (std::path::PathBuf, std::path::PathBuf) {
    static FILES: std::sync::OnceLock<(std::path::PathBuf, std::path::PathBuf)> =
        std::sync::OnceLock::new();
    FILES.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tokens");
        std::fs::create_dir_all(&dir).unwrap();
        let (agg, admin) = (dir.join("aggregator"), dir.join("admin"));
        std::fs::write(&agg, "aggregator-token").unwrap();
        std::fs::write(&admin, "admin-token").unwrap();
        (agg, admin)
    })
}

/// The aggregator's token file.
pub fn aggregator_token_file() -> &'static Path {
    &token_files().0
}

/// An administrator's token file (for `faultline` and kubectl).
pub fn admin_token_file() -> &'static Path {
    &token_files().1
}

/// An administrator's token (kubectl's `--token`).
pub const ADMIN_TOKEN: &str = "admin-token";

/// The Kubernetes API test server on loopback, with the namespace `faultline`, the RBAC
/// objects of deploy/base/aggregator.yaml and RBAC enforced: the aggregator runs with
/// exactly the permissions its manifest grants. Its URL.
pub async fn api_server() -> (ApiServer, String) {
    api_server_with(&USERS, &[]).await
}

/// The aggregator's ServiceAccount and an administrator, by bearer token.
pub const USERS: [(&str, &str); 2] = [
    ("aggregator-token", AGGREGATOR_USER),
    (ADMIN_TOKEN, faultline_test_apiserver::rbac::ADMIN),
];

/// [`api_server`] with these users by bearer token.
pub async fn api_server_for(tokens: &[(&str, &str)]) -> (ApiServer, String) {
    api_server_with(tokens, &[]).await
}

/// [`api_server_for`], with the RBAC of these kustomize components too
/// (`deploy/components/<c>/rbac.yaml`: a feature's flag and its permission come
/// together, so only a test that turns the feature on loads them).
pub async fn api_server_with(tokens: &[(&str, &str)], components: &[&str]) -> (ApiServer, String) {
    api_server_on(tokens, components, None).await
}

/// [`api_server_for`] on a virtual clock from `epoch_ms` ([`Bootstrap::virtual_time`]):
/// call it on a current-thread runtime with a paused clock.
pub async fn api_server_virtual(tokens: &[(&str, &str)], epoch_ms: u64) -> (ApiServer, String) {
    api_server_on(tokens, &[], Some(epoch_ms)).await
}

async fn api_server_on(
    tokens: &[(&str, &str)],
    components: &[&str],
    epoch_ms: Option<u64>,
) -> (ApiServer, String) {
    let manifest = repo_root().join("deploy/base/aggregator.yaml");
    let mut boot = Bootstrap::new()
        .namespace(NS)
        .manifests(std::fs::read_to_string(manifest).unwrap());
    if let Some(at) = epoch_ms {
        boot = boot.virtual_time(at);
    }
    for c in components {
        let rbac = repo_root().join(format!("deploy/components/{c}/rbac.yaml"));
        boot = boot.manifests(std::fs::read_to_string(rbac).unwrap());
    }
    let running = boot.rbac(tokens).start().await.unwrap();
    assert!(
        running.loaded >= 4,
        "the RBAC objects of deploy/base/aggregator.yaml"
    );
    (running.server, running.url)
}

/// A simulated agent with 4 GPUs sampling every 100 ms, serving `node`.
pub async fn agent(node: &str) -> faultline_agent::Agent {
    agent_with(node, &[]).await
}

/// [`agent`], with more flags.
pub async fn agent_with(node: &str, extra: &[&str]) -> faultline_agent::Agent {
    let mut flags = vec![
        "--source",
        "sim",
        "--sim-devices",
        "4",
        "--interval",
        "100ms",
    ];
    flags.extend_from_slice(extra);
    agent_from(node, &flags).await
}

/// An agent in this process with `flags` (source and all), serving `node` on a free
/// loopback port.
pub async fn agent_from(node: &str, flags: &[&str]) -> faultline_agent::Agent {
    let mut args = vec![
        "faultline-agent",
        "--listen",
        "127.0.0.1:0",
        "--node-name",
        node,
    ];
    args.extend_from_slice(flags);
    let cfg = faultline_agent::config::Config::parse_from(args).unwrap();
    faultline_agent::start(cfg).await.unwrap()
}

/// The C double of libdcmi.so (`tests/fixtures/dcmi/fake_dcmi.c`), built once per test
/// binary, copied into `dir` as `libdcmi.so`: the copy reads its state from
/// `libdcmi.so.state` beside it, so agents in one process each have their own chips.
/// The copy's path, and its state file's.
pub fn fake_dcmi_in(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let built = BUILT.get_or_init(|| {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("doubles");
        faultline_common::testing::build_c_double("fixtures/dcmi/fake_dcmi.c", "libdcmi.so", &dir)
    });
    let lib = dir.join("libdcmi.so");
    std::fs::copy(built, &lib).unwrap();
    let state = dir.join("libdcmi.so.state");
    (lib, state)
}

/// One request: status and JSON body (null if none or not JSON).
pub async fn call(method: &str, url: &str, token: Option<&str>, body: String) -> (u16, Value) {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = bearer
        .iter()
        .map(|b| ("authorization", b.as_str()))
        .collect();
    call_with(method, url, &headers, body).await
}

/// [`call`] with these headers.
pub async fn call_with(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: String,
) -> (u16, Value) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// POST a JSON body; the status.
pub async fn post(addr: SocketAddr, path: &str, body: &str) -> u16 {
    call("POST", &format!("http://{addr}{path}"), None, body.into())
        .await
        .0
}

/// Inject a fault at a simulated agent (`POST /v1/sim/faults`, e.g.
/// `{"device":"gpu1","fault":"xid","xid":79}`); it must be taken.
pub async fn inject(agent: &faultline_agent::Agent, fault: &str) {
    assert_eq!(
        post(agent.addr, "/v1/sim/faults", fault).await,
        201,
        "{fault}"
    );
}

/// `device` on the agent's node fails for good (a row remap failure).
pub async fn fail(agent: &faultline_agent::Agent, device: &str) {
    inject(
        agent,
        &format!(r#"{{"device":"{device}","fault":"row-remap-failure"}}"#),
    )
    .await;
}

/// GET a text body.
pub async fn get_text(url: &str) -> String {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// The Prometheus text of the process listening at `addr`.
pub async fn metrics(addr: SocketAddr) -> String {
    get_text(&format!("http://{addr}/metrics")).await
}

/// Poll the metrics at `addr` (every 20 ms, `within` at most) until they contain
/// `needle`; the text.
pub async fn metric_until(addr: SocketAddr, needle: &str, within: Duration) -> String {
    let start = Instant::now();
    loop {
        let text = metrics(addr).await;
        if text.contains(needle) {
            return text;
        }
        assert!(
            start.elapsed() < within,
            "no {needle} within {within:?} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait on the product's own progress instead of wall time: the aggregator at `addr`
/// has started 3 more reconciles and completed 2 more node passes than when this was
/// called (both counters it serves). A "nothing happened" check comes after this, so a
/// slow machine waits longer instead of passing vacuously. Nodes no pass looks at (an
/// Unknown one, a guess) use [`reconciles`].
pub async fn passes(addr: SocketAddr) {
    progress(addr, 3, 2).await
}

/// 3 more reconciles started at `addr` than now: every node looked at again twice over.
pub async fn reconciles(addr: SocketAddr) {
    progress(addr, 3, 0).await
}

async fn progress(addr: SocketAddr, reconciles: u64, passes: u64) {
    grows(
        addr,
        &[
            ("faultline_aggregator_reconciles_total", reconciles),
            ("faultline_aggregator_remediation_passes_total", passes),
        ],
    )
    .await
}

/// Wait until each counter `(name, n)` the process at `addr` serves has grown by `n`
/// from when this was called (every series of the name summed).
pub async fn grows(addr: SocketAddr, counters: &[(&str, u64)]) {
    use faultline_common::testing::metric_sum;
    let read = |text: &str| -> Vec<u64> {
        counters
            .iter()
            .map(|(name, _)| metric_sum(text, name) as u64)
            .collect()
    };
    let base = read(&metrics(addr).await);
    // 60 s, and a second more for each count waited for (a quiet minute is 120 Lease
    // passes): generous, since a slow machine only makes this wait longer.
    let most = counters.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let within = Duration::from_secs(60 + most);
    let start = Instant::now();
    loop {
        let now = read(&metrics(addr).await);
        if now
            .iter()
            .zip(&base)
            .zip(counters)
            .all(|((v, b), (_, n))| *v >= b + n)
        {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{counters:?} did not grow within {within:?}: from {base:?} to {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Poll `f` until it gives a value or `within` passes; the value and the time it took.
pub async fn until<T>(within: Duration, what: &str, f: impl FnMut() -> Option<T>) -> (T, Duration) {
    until_every(within, Duration::from_millis(5), what, f).await
}

/// [`until`], asking every `every`: for a check that costs (parsing every shard's
/// page), so that asking does not take the CPU the product needs to get there.
pub async fn until_every<T>(
    within: Duration,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> (T, Duration) {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return (v, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(every).await;
    }
}
