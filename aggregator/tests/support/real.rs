//! faultline on a real control plane: `deploy/overlays/nvidia` applied with
//! `kubectl apply -k --server-side` to a real kube-apiserver
//! ([`faultline_controlplane`]), the agent DaemonSet's pods made by the real DaemonSet
//! controller, bound by the real scheduler and run by the test's kubelet as in-process
//! agents on their pod addresses (so the real endpointslice controller lists them), and
//! the aggregator binary run as the Deployment's container would be: its arguments read
//! from the applied Deployment, under a token of its ServiceAccount, with exactly the
//! RBAC deploy/ grants (the apiserver's audit log shows any refusal).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::fault::{page_name, shard_of, NodeFaults};
use faultline_controlplane::{ControlPlane, Delays, FakeNode, Kubelet, Options, PodHook, PodPhase};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};

use super::process::aggregator_process_env;
use super::{repo_root, AggregatorProcess, Launch};

/// The namespace deploy/ installs into.
pub const NS: &str = "faultline";
/// The label of the agents' pods.
const AGENT: &str = "app.kubernetes.io/name=faultline-agent";

/// The in-process agents of the agent pods now running, by pod uid: (node, agent).
type Agents = Arc<Mutex<HashMap<String, (String, faultline_agent::Agent)>>>;

/// A real control plane with faultline installed from deploy/.
pub struct RealCluster {
    pub cp: ControlPlane,
    pub kubelet: Kubelet,
    pub agents: Agents,
    pub client: kube::Client,
    /// The pinned helm, where the chart installed faultline.
    pub helm: Option<PathBuf>,
    dir: tempfile::TempDir,
}

/// How faultline is installed, as a user installs it.
pub enum Install<'a> {
    /// `kubectl apply -k --server-side` of an overlay (a path from the repository root).
    Kustomize(&'a str),
    /// `helm install faultline <chart> --namespace faultline --create-namespace` with
    /// `args` (`--set`, `-f`); `chart` from the repository root (a folder or a packaged
    /// chart).
    Helm { chart: &'a str, args: &'a [&'a str] },
}

impl RealCluster {
    /// `release` with its device-taint gates on, `nodes` GPU nodes (n1, n2, ...), the
    /// agents' pods living as `delays` say; `None` where the control plane cannot be
    /// built (skipped, the reason printed; never under CI).
    pub async fn start(
        test: &str,
        release: faultline_controlplane::Release,
        nodes: usize,
        delays: Delays,
    ) -> Option<Self> {
        Self::start_with(test, release, nodes, delays, "deploy/overlays/nvidia").await
    }

    /// [`RealCluster::start`] with `deploy/overlays/nvidia-enforce` (remediation on),
    /// the pods living as [`Delays::default`] says.
    pub async fn enforcing(
        test: &str,
        release: faultline_controlplane::Release,
        nodes: usize,
    ) -> Option<Self> {
        let overlay = "deploy/overlays/nvidia-enforce";
        Self::start_with(test, release, nodes, Delays::default(), overlay).await
    }

    /// [`RealCluster::start`] with `overlay` applied (a path from the repository root).
    pub async fn start_with(
        test: &str,
        release: faultline_controlplane::Release,
        nodes: usize,
        delays: Delays,
        overlay: &str,
    ) -> Option<Self> {
        Self::start_as(test, Options::new(release), nodes, delays, overlay).await
    }

    /// [`RealCluster::start_with`], the control plane started as `opts` says.
    pub async fn start_as(
        test: &str,
        opts: Options,
        nodes: usize,
        delays: Delays,
        overlay: &str,
    ) -> Option<Self> {
        Self::installed(test, opts, nodes, delays, Install::Kustomize(overlay)).await
    }

    /// [`RealCluster::start_as`], faultline installed as `install` says.
    pub async fn installed(
        test: &str,
        opts: Options,
        nodes: usize,
        delays: Delays,
        install: Install<'_>,
    ) -> Option<Self> {
        let helm = match install {
            Install::Helm { .. } => Some(faultline_controlplane::helm(test)?),
            Install::Kustomize(_) => None,
        };
        let cp = ControlPlane::start(test, opts).await?;
        let client = cp.admin().await;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("delivery-token"), "faultline-test-delivery").unwrap();
        std::fs::write(dir.path().join("intake-token"), "faultline-test-intake").unwrap();
        // The key deliveries are signed with, and its public half, as docs/deploying.md
        // makes them: a Secret for the aggregator, a ConfigMap for the agents.
        let (private, public) = faultline_common::seal::SigningKey::generate_pem().unwrap();
        std::fs::write(dir.path().join("delivery-signing.pem"), private).unwrap();
        std::fs::write(dir.path().join("delivery-key.pem"), public).unwrap();

        match (install, &helm) {
            (Install::Kustomize(overlay), _) => {
                let deploy = repo_root().join(overlay);
                cp.kubectl(&["apply", "--server-side", "-k", deploy.to_str().unwrap()]);
            }
            (
                Install::Helm {
                    chart,
                    args: values,
                },
                Some(helm),
            ) => {
                let chart = repo_root().join(chart);
                let mut args = vec!["install", "faultline", chart.to_str().unwrap()];
                args.extend(["--namespace", NS, "--create-namespace"]);
                // The test runs the aggregator itself (below), as the Deployment's container.
                args.extend(["--set", "aggregator.replicas=0"]);
                args.extend(values);
                let out = helm_on(&cp, helm, &args);
                assert!(
                    out.status.success(),
                    "helm {}: {}",
                    args.join(" "),
                    text(&out)
                );
            }
            (Install::Helm { .. }, None) => unreachable!("helm is found above"),
        }
        for (secret, file) in [
            ("faultline-delivery", "delivery-token"),
            ("faultline-intake-token", "intake-token"),
        ] {
            let from = format!("--from-file=token={}", dir.path().join(file).display());
            cp.kubectl(&["-n", NS, "create", "secret", "generic", secret, &from]);
        }
        let signing = format!(
            "--from-file=key.pem={}",
            dir.path().join("delivery-signing.pem").display()
        );
        let public = format!(
            "--from-file=key.pem={}",
            dir.path().join("delivery-key.pem").display()
        );
        cp.kubectl(&[
            "-n",
            NS,
            "create",
            "secret",
            "generic",
            "faultline-delivery-signing",
            &signing,
        ]);
        cp.kubectl(&[
            "-n",
            NS,
            "create",
            "configmap",
            "faultline-delivery-key",
            &public,
        ]);
        // The test runs the aggregator itself (below), as the Deployment's container.
        if helm.is_none() {
            cp.kubectl(&[
                "-n",
                NS,
                "scale",
                "deployment/faultline-aggregator",
                "--replicas=0",
            ]);
        }

        let agents: Agents = Arc::default();
        let hook = agent_hook(
            agents.clone(),
            (
                dir.path().join("delivery-token"),
                dir.path().join("delivery-key.pem"),
            ),
            dir.path().join("nodes"),
        );
        let fake: Vec<FakeNode> = (0..nodes)
            .map(|i| FakeNode::gpu(&format!("n{}", i + 1), i as u8))
            .collect();
        let kubelet = Kubelet::start(client.clone(), fake, delays, Some(hook))
            .await
            .unwrap();
        let c = RealCluster {
            cp,
            kubelet,
            agents,
            client,
            helm,
            dir,
        };
        c.until_agents_ready(nodes, Duration::from_secs(120)).await;
        Some(c)
    }

    /// Wait until `n` agent endpoints are ready in the agents' EndpointSlices.
    pub async fn until_agents_ready(&self, n: usize, within: Duration) {
        let start = std::time::Instant::now();
        loop {
            let ready = self.ready_agent_endpoints().await;
            if ready.len() == n {
                return;
            }
            assert!(
                start.elapsed() < within,
                "{n} agent endpoints not ready within {within:?}: {ready:?}; pods {:?}",
                self.agent_pods().await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The nodes of the agents' ready endpoints.
    pub async fn ready_agent_endpoints(&self) -> Vec<String> {
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), NS);
        let lp = ListParams::default().labels("kubernetes.io/service-name=faultline-agent");
        let mut out = Vec::new();
        for s in api.list(&lp).await.map(|l| l.items).unwrap_or_default() {
            for e in s.endpoints {
                if e.conditions.and_then(|c| c.ready).unwrap_or(true) {
                    out.extend(e.node_name);
                }
            }
        }
        out.sort();
        out
    }

    /// The agent pods (name, uid, node, terminating).
    pub async fn agent_pods(&self) -> Vec<(String, String, String, bool)> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        api.list(&ListParams::default().labels(AGENT))
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|p| {
                (
                    p.metadata.name.clone().unwrap_or_default(),
                    p.metadata.uid.clone().unwrap_or_default(),
                    p.spec.and_then(|s| s.node_name).unwrap_or_default(),
                    p.metadata.deletion_timestamp.is_some(),
                )
            })
            .collect()
    }

    /// The aggregator binary as replica `replica`, with the Deployment's arguments (its
    /// secrets' files here), each `--flag=value` of `extra` in place of the Deployment's
    /// own, under a token of its ServiceAccount.
    pub async fn aggregator(&self, replica: &str, extra: &[&str]) -> (AggregatorProcess, String) {
        let args = self.cp.kubectl(&[
            "-n",
            NS,
            "get",
            "deployment/faultline-aggregator",
            "-o",
            "jsonpath={.spec.template.spec.containers[0].args}",
        ]);
        let args: Vec<String> = serde_json::from_str(&args).unwrap();
        let mut argv = vec!["faultline-aggregator".to_string()];
        for a in args {
            let a = match a.split_once('=') {
                Some(("--delivery-token-file", _)) => format!(
                    "--delivery-token-file={}",
                    self.dir.path().join("delivery-token").display()
                ),
                Some(("--delivery-signing-key-file", _)) => format!(
                    "--delivery-signing-key-file={}",
                    self.dir.path().join("delivery-signing.pem").display()
                ),
                Some(("--intake-token-file", _)) => format!(
                    "--intake-token-file={}",
                    self.dir.path().join("intake-token").display()
                ),
                _ => a,
            };
            argv.push(a);
        }
        // `--flag=value` in `extra` replaces the Deployment's `--flag`.
        for e in extra {
            let flag = e.split_once('=').map_or(*e, |(f, _)| f);
            argv.retain(|a| a.split_once('=').map_or(a.as_str(), |(f, _)| f) != flag);
            argv.push(e.to_string());
        }
        let kubeconfig = self
            .cp
            .service_account_kubeconfig(NS, "faultline-aggregator");
        aggregator_process_env(
            Launch(argv),
            &[
                ("KUBECONFIG", kubeconfig.display().to_string()),
                ("POD_NAME", replica.to_string()),
                ("POD_IP", "127.0.0.1".to_string()),
            ],
        )
        .await
    }

    /// Node `node`'s published entry in the shards of `faultline` (`shards` of them), if
    /// any, read as its pods' kubelet would.
    pub async fn node_entry(&self, shards: u32, node: &str) -> Option<NodeFaults> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), NS);
        let name = page_name("faultline", shard_of(node, shards), 0);
        let cm = api.get_opt(&name).await.ok()??;
        let text = cm.data?.get(&format!("{node}.json"))?.clone();
        serde_json::from_str(&text).ok()
    }

    /// `node`'s own fault.json, as its agent keeps it (the DaemonSet's `--fault-dir`).
    pub fn node_file(&self, node: &str) -> Option<NodeFaults> {
        let path = self.dir.path().join("nodes").join(node).join("fault.json");
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    /// [`RealCluster::node_entry`], read with kubectl (for a synchronous look).
    pub fn published(&self, shards: u32, node: &str) -> Option<NodeFaults> {
        let name = page_name("faultline", shard_of(node, shards), 0);
        let field = format!("metadata.name={name}");
        let cm = self
            .items(&["-n", NS, "configmaps", "--field-selector", &field])
            .pop()?;
        serde_json::from_str(cm["data"][format!("{node}.json")].as_str()?).ok()
    }

    /// The in-process agent of `node`'s running agent pod.
    pub fn agent_addr(&self, node: &str) -> std::net::SocketAddr {
        self.agents
            .lock()
            .unwrap()
            .values()
            .find(|(n, _)| n == node)
            .map(|(_, a)| a.addr)
            .unwrap_or_else(|| panic!("no agent runs on {node}"))
    }

    /// Where `node`'s running agent serves the node's pods (the DaemonSet's
    /// `--fault-listen`: `GET /v1/fault`, `POST /v1/drain/ack`).
    pub fn fault_addr(&self, node: &str) -> std::net::SocketAddr {
        self.agents
            .lock()
            .unwrap()
            .values()
            .find(|(n, _)| n == node)
            .and_then(|(_, a)| a.fault_addr)
            .unwrap_or_else(|| panic!("no agent serves {node}'s pods"))
    }

    /// The taints of Node `node`, as JSON.
    pub fn taints(&self, node: &str) -> Vec<serde_json::Value> {
        let field = format!("metadata.name={node}");
        self.items(&["nodes", "--field-selector", &field])
            .first()
            .and_then(|n| n["spec"]["taints"].as_array().cloned())
            .unwrap_or_default()
    }

    /// How many of `taints` are faultline's (its taint key).
    pub fn ours(taints: &[serde_json::Value]) -> usize {
        taints.iter().filter(|t| t["key"] == super::TAINT).count()
    }

    /// The pinned helm as the admin, with these arguments; its output, whatever it
    /// answers.
    pub fn helm(&self, args: &[&str]) -> std::process::Output {
        let helm = self.helm.as_ref().expect("installed with Install::Helm");
        helm_on(&self.cp, helm, args)
    }

    /// `kubectl apply --server-side` of one object.
    pub fn apply(&self, obj: &serde_json::Value) {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), obj.to_string()).unwrap();
        self.cp
            .kubectl(&["apply", "--server-side", "-f", f.path().to_str().unwrap()]);
    }

    /// `kubectl get` of a kind as JSON: its items.
    pub fn items(&self, args: &[&str]) -> Vec<serde_json::Value> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend(["-o", "json"]);
        let v: serde_json::Value = serde_json::from_str(&self.cp.kubectl(&a)).unwrap();
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// Publish `node`'s agent's GPUs as NVIDIA's DRA driver does: the DeviceClass
    /// `gpu.nvidia.com` (its chart's) and one ResourceSlice, device `gpu-<i>` for the
    /// agent's i-th GPU under its UUID. The agent's device ids, by slice device.
    pub async fn publish_gpus(&self, node: &str) -> Vec<(String, String)> {
        let url = format!("http://{}/v1/health", self.agent_addr(node));
        let mut gpus: Vec<(String, String)> = Vec::new();
        for _ in 0..500 {
            let (_, health) = super::call("GET", &url, None, String::new()).await;
            gpus = health["npus"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|d| {
                    Some((
                        d["id"].as_str()?.to_string(),
                        d["uuid"].as_str()?.to_string(),
                    ))
                })
                .collect();
            if !gpus.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!gpus.is_empty(), "{node}'s agent reports no GPU");
        self.apply(&serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "gpu.nvidia.com"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
        }));
        let devices: Vec<serde_json::Value> = gpus
            .iter()
            .enumerate()
            .map(|(i, (_, uuid))| {
                serde_json::json!({"name": format!("gpu-{i}"),
                    "attributes": {"uuid": {"string": uuid}, "productName": {"string": "NVIDIA H200"},
                                   "type": {"string": "gpu"}, "index": {"int": i}},
                    "capacity": {"memory": {"value": "143771Mi"}}})
            })
            .collect();
        self.apply(&serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("{node}-gpu.nvidia.com")},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices},
        }));
        gpus.iter()
            .enumerate()
            .map(|(i, (id, _))| (format!("gpu-{i}"), id.clone()))
            .collect()
    }

    /// A pod `name` in `default` on `node` holding one GPU through its own claim
    /// (`<name>-gpu`, with these device `tolerations`), allocated and bound by the real
    /// scheduler, run by the test's kubelet; the device it got, once it runs.
    pub async fn gpu_pod(&self, name: &str, node: &str, tolerations: serde_json::Value) -> String {
        let claim = format!("{name}-gpu");
        let (c, p) = gpu_pod_objects(name, node, tolerations);
        self.apply(&c);
        self.apply(&p);
        let start = std::time::Instant::now();
        loop {
            let running = self
                .items(&[
                    "-n",
                    "default",
                    "pods",
                    "--field-selector",
                    &format!("metadata.name={name}"),
                ])
                .first()
                .is_some_and(|p| p["status"]["phase"] == "Running");
            let device = self
                .items(&[
                    "-n",
                    "default",
                    "resourceclaims",
                    "--field-selector",
                    &format!("metadata.name={claim}"),
                ])
                .first()
                .and_then(|c| {
                    c.pointer("/status/allocation/devices/results/0/device")?
                        .as_str()
                        .map(String::from)
                });
            if let (true, Some(d)) = (running, device) {
                return d;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{name} not running with an allocated GPU within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The DeviceTaintRules, as JSON.
    pub fn rules(&self) -> Vec<serde_json::Value> {
        self.items(&["devicetaintrules"])
    }

    /// Nothing faultline's ServiceAccounts asked was refused (the audit log).
    pub fn assert_no_forbidden(&self) {
        let refused = self.cp.refused();
        assert!(refused.is_empty(), "refused by RBAC: {refused:#?}");
    }

    /// The control plane's resident memory, one line.
    pub fn memory(&self) -> String {
        self.cp
            .memory_kib()
            .iter()
            .map(|(n, k)| format!("{n} {} MiB", k / 1024))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `helm` with `args` against `cp` as its admin.
fn helm_on(cp: &ControlPlane, helm: &std::path::Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(helm)
        .arg(format!("--kubeconfig={}", cp.admin_kubeconfig.display()))
        .env("KUBECACHEDIR", cp.kube_cache())
        .args(args)
        .output()
        .expect("the pinned helm (tests/helm/build.sh)")
}

/// A command's stdout and stderr, for a failure's message.
pub fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Pod `name` in `default` on `node` asking for one GPU through its own claim
/// (`<name>-gpu`, with these device `tolerations`): the claim and the pod.
pub fn gpu_pod_objects(
    name: &str,
    node: &str,
    tolerations: serde_json::Value,
) -> (serde_json::Value, serde_json::Value) {
    let claim = format!("{name}-gpu");
    let c = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": claim, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "tolerations": tolerations}}]}},
    });
    let p = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "train"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{"name": "train", "image": "train:1",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
    });
    (c, p)
}

/// Each agent pod runs an agent in this process on the pod's address, port 8081, with
/// four simulated GPUs, as the DaemonSet's container does: its node's own fault.json in
/// `nodes/<node>` (the hostPath), served to pods on port 8082, deliveries taken with the
/// token. A Job's pod (a canary) succeeds; other pods just run.
fn agent_hook(agents: Agents, (token, key): (PathBuf, PathBuf), nodes: PathBuf) -> PodHook {
    Arc::new(move |pod: Pod, ip: Option<String>| {
        let (agents, token, key, nodes) =
            (agents.clone(), token.clone(), key.clone(), nodes.clone());
        Box::pin(async move {
            let is_agent = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("app.kubernetes.io/name"))
                .is_some_and(|v| v == "faultline-agent");
            let is_job = pod
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("batch.kubernetes.io/job-name"));
            if is_job {
                return PodPhase::Succeeded;
            }
            if !is_agent {
                return PodPhase::Running;
            }
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            match ip {
                Some(ip) => {
                    let listen = format!("{ip}:8081");
                    let fault_listen = format!("{ip}:8082");
                    let fault_dir = nodes.join(&node);
                    std::fs::create_dir_all(&fault_dir).unwrap();
                    let args = [
                        "faultline-agent",
                        "--listen",
                        &listen,
                        "--node-name",
                        &node,
                        "--source",
                        "sim",
                        "--sim-devices",
                        "4",
                        "--interval",
                        "100ms",
                        "--delivery-token-file",
                        token.to_str().unwrap(),
                        "--delivery-key-file",
                        key.to_str().unwrap(),
                        "--fault-dir",
                        fault_dir.to_str().unwrap(),
                        "--fault-listen",
                        &fault_listen,
                    ];
                    let cfg = faultline_agent::config::Config::parse_from(args).unwrap();
                    let agent = faultline_agent::start(cfg).await.unwrap();
                    agents.lock().unwrap().insert(uid, (node, agent));
                }
                None => {
                    let gone = agents.lock().unwrap().remove(&uid);
                    if let Some((_, a)) = gone {
                        a.shutdown().await;
                    }
                }
            }
            PodPhase::Running
        })
    })
}

/// `POST path` with a JSON `body` to `addr` from the address `from` (a pod's own: the
/// pod range is local in the test's network namespace), as that pod would send it; the
/// status code.
pub async fn post_from(from: &str, addr: std::net::SocketAddr, path: &str, body: &str) -> u16 {
    request_from(from, "POST", addr, path, body).await.0
}

/// `method path` with `body`, from address `from` (a pod's): the status and the body.
pub async fn request_from(
    from: &str,
    method: &str,
    addr: std::net::SocketAddr,
    path: &str,
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(format!("{from}:0").parse().unwrap())
        .unwrap_or_else(|e| panic!("bind {from}: {e}"));
    let mut stream = socket.connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let code = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line from {addr}{path}: {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (code, body)
}
