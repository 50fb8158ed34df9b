//! Helpers shared by the aggregator's integration tests: the Kubernetes API test
//! server and a client of it, one aggregator launcher ([`Launch`]), Node and Pod
//! fixtures ([`NodeFixture`], [`PodFixture`]), simulated agents in-process, HTTP calls
//! on loopback, waiting with a deadline.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

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
    /// the clock past a window instead of sleeping through it (issue 14).
    #[allow(dead_code)]
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

/// A Node for the test API server, built like controller-rs's fixtures.
pub struct NodeFixture(Value);

impl NodeFixture {
    /// A Node named `name`, with no labels, taints or status.
    pub fn new(name: &str) -> Self {
        NodeFixture(json!({"metadata": {"name": name}}))
    }

    /// A label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.0["metadata"]["labels"][key] = json!(value);
        self
    }

    /// A NoSchedule taint someone else put there.
    pub fn taint(mut self, key: &str, value: &str) -> Self {
        let t = json!({"key": key, "value": value, "effect": "NoSchedule"});
        match self.0["spec"]["taints"].as_array_mut() {
            Some(list) => list.push(t),
            None => self.0["spec"]["taints"] = json!([t]),
        }
        self
    }

    /// The Ready condition.
    pub fn ready(mut self, ready: bool) -> Self {
        self.0["status"]["conditions"] =
            json!([{"type": "Ready", "status": if ready { "True" } else { "False" }}]);
        self
    }

    /// The Node's InternalIP (where discovery finds its agent).
    pub fn address(mut self, ip: &str) -> Self {
        self.0["status"]["addresses"] = json!([{"type": "InternalIP", "address": ip}]);
        self
    }

    /// The object.
    pub fn build(self) -> Value {
        self.0
    }
}

/// A Pod for the test API server, built like controller-rs's fixtures.
pub struct PodFixture(Value);

impl PodFixture {
    /// A running, Ready pod `name` in `default` on `node`, one container, labelled
    /// `app=name` (what its kubelet would have reported).
    pub fn new(name: &str, node: &str) -> Self {
        PodFixture(json!({
            "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
    }

    /// Not Ready (a crash-looping or starting container).
    pub fn unready(mut self) -> Self {
        self.0["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
        self
    }

    /// It asks for one `nvidia.com/gpu`.
    pub fn gpu(mut self) -> Self {
        self.0["spec"]["containers"][0]["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
        self
    }

    /// The kubelet says it holds device `id` with `health` (KEP-4680).
    pub fn holds(mut self, id: &str, health: &str) -> Self {
        self.0["status"]["containerStatuses"] = json!([{"name": "c", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
            "allocatedResourcesStatus": [{"name": "nvidia.com/gpu", "resources": [{"resourceID": id, "health": health}]}]}]);
        self
    }

    /// Owned by a controller of `kind`.
    pub fn owner(mut self, kind: &str) -> Self {
        self.0["metadata"]["ownerReferences"] =
            json!([{"apiVersion": "apps/v1", "kind": kind, "name": "owner", "uid": "owner-uid"}]);
        self
    }

    /// Its phase.
    pub fn phase(mut self, phase: &str) -> Self {
        self.0["status"]["phase"] = json!(phase);
        self
    }

    /// The object.
    pub fn build(self) -> Value {
        self.0
    }
}

/// A kube client of the API server at `url` as the aggregator's ServiceAccount, with
/// kube's own retries off.
pub fn kube_client(url: &str) -> kube::Client {
    let mut kc = kube::Config::new(url.parse().unwrap());
    kc.auth_info.token_file = Some(aggregator_token_file().display().to_string());
    kc.default_retry = false;
    kube::Client::try_from(kc).unwrap()
}

use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

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
/// exactly the permissions its manifest grants (issue 9). Its URL.
pub async fn api_server() -> (faultline_test_apiserver::ApiServer, String) {
    api_server_for(&[
        ("aggregator-token", AGGREGATOR_USER),
        (ADMIN_TOKEN, faultline_test_apiserver::rbac::ADMIN),
    ])
    .await
}

/// [`api_server`] with these users by bearer token.
pub async fn api_server_for(
    tokens: &[(&str, &str)],
) -> (faultline_test_apiserver::ApiServer, String) {
    let server = faultline_test_apiserver::ApiServer::new();
    server
        .create(
            "namespaces",
            "",
            serde_json::json!({"metadata": {"name": "faultline"}}),
        )
        .unwrap();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/aggregator.yaml");
    let loaded = server
        .load_manifests(&std::fs::read_to_string(manifest).unwrap())
        .unwrap();
    assert!(
        loaded >= 4,
        "the RBAC objects of deploy/base/aggregator.yaml"
    );
    server.enforce_rbac(tokens);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(faultline_test_apiserver::serve(
        listener,
        server.clone(),
        tokio_util::sync::CancellationToken::new(),
    ));
    (server, url)
}

/// A simulated agent with 4 GPUs sampling every 100 ms, serving `node`.
pub async fn agent(node: &str) -> faultline_agent::Agent {
    agent_with(node, &[]).await
}

/// [`agent`], with more flags.
#[allow(dead_code)]
pub async fn agent_with(node: &str, extra: &[&str]) -> faultline_agent::Agent {
    let mut args = vec![
        "faultline-agent",
        "--source",
        "sim",
        "--sim-devices",
        "4",
        "--interval",
        "100ms",
        "--listen",
        "127.0.0.1:0",
        "--node-name",
        node,
    ];
    args.extend_from_slice(extra);
    let cfg = faultline_agent::config::Config::parse_from(args).unwrap();
    faultline_agent::start(cfg).await.unwrap()
}

/// POST a JSON body; the status.
pub async fn post(addr: SocketAddr, path: &str, body: &str) -> u16 {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    client.request(req).await.unwrap().status().as_u16()
}

/// GET a text body.
pub async fn get_text(url: &str) -> String {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// Poll `f` until it gives a value or `within` passes; the value and the time it took.
pub async fn until<T>(
    within: Duration,
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
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A child process killed (and reaped) when dropped: a test that fails half way does
/// not leave it running.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Nothing the aggregator asked was refused by RBAC: the shipped manifest grants every
/// call the code made (a missing verb in deploy/base/aggregator.yaml fails here).
pub fn assert_no_forbidden(server: &faultline_test_apiserver::ApiServer) {
    let refused: Vec<String> = server
        .calls()
        .into_iter()
        .filter(|c| c.status == 401 || c.status == 403)
        .map(|c| format!("{} {} {}", c.status, c.method, c.uri))
        .collect();
    assert!(refused.is_empty(), "refused by RBAC: {refused:?}");
}
