//! The control plane itself: the pinned releases and their gates, the options, the
//! binaries (built when missing), starting the four components, the clients, kubectl,
//! the audit log and the components' memory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::procs::Proc;

/// A pinned release of the control plane: its folder `tests/controlplane/k8s-<minor>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Kubernetes 1.37: DeviceTaintRule `resource.k8s.io/v1`, on by default.
    V1_37,
    /// Kubernetes 1.36: DeviceTaintRule `v1beta2`, off by default (the
    /// `DRADeviceTaintRules` gate plus runtime-config).
    V1_36,
    /// Kubernetes 1.35: DeviceTaintRule `v1alpha3`, alpha (the `DRADeviceTaints` and
    /// `DRADeviceTaintRules` gates plus runtime-config); effect `None` is new.
    V1_35,
}

impl Release {
    /// Every pinned release, newest first.
    pub const ALL: [Release; 3] = [Release::V1_37, Release::V1_36, Release::V1_35];

    /// `1.37`.
    pub fn minor(self) -> &'static str {
        match self {
            Release::V1_37 => "1.37",
            Release::V1_36 => "1.36",
            Release::V1_35 => "1.35",
        }
    }

    /// What a cluster of this release needs for DRA device taints: feature gates
    /// (`kube_features.go`) and the API versions to serve. `None` leaves the release's
    /// defaults (1.36 without DeviceTaintRule).
    pub fn device_taints(self) -> (Vec<&'static str>, Vec<&'static str>) {
        match self {
            Release::V1_37 => (vec![], vec![]),
            Release::V1_36 => (
                vec!["DRADeviceTaintRules=true"],
                vec!["resource.k8s.io/v1beta2=true"],
            ),
            Release::V1_35 => (
                vec!["DRADeviceTaints=true", "DRADeviceTaintRules=true"],
                vec!["resource.k8s.io/v1alpha3=true"],
            ),
        }
    }
}

/// How to start a control plane.
#[derive(Debug, Clone)]
pub struct Options {
    /// The release.
    pub release: Release,
    /// `--feature-gates` of every component.
    pub feature_gates: Vec<String>,
    /// The apiserver's `--runtime-config`.
    pub runtime_config: Vec<String>,
    /// Whether to start kube-controller-manager and kube-scheduler (the differential
    /// check needs the apiserver alone).
    pub controllers: bool,
    /// Priority classes whose pods the ResourceQuota admission admits only where a
    /// ResourceQuota of the pod's namespace matches the class (its `limitedResources`),
    /// as GKE limits `system-node-critical` and `system-cluster-critical`.
    pub limited_priority_classes: Vec<String>,
}

impl Options {
    /// `release` with its device-taint gates on, every controller started.
    pub fn new(release: Release) -> Self {
        let (gates, rc) = release.device_taints();
        Options {
            release,
            feature_gates: gates.into_iter().map(String::from).collect(),
            runtime_config: rc.into_iter().map(String::from).collect(),
            controllers: true,
            limited_priority_classes: Vec::new(),
        }
    }

    /// `release` as it comes: no gate, no runtime-config of ours.
    pub fn defaults(release: Release) -> Self {
        Options {
            release,
            feature_gates: Vec::new(),
            runtime_config: Vec::new(),
            controllers: true,
            limited_priority_classes: Vec::new(),
        }
    }

    /// Without the controller manager and the scheduler.
    pub fn apiserver_only(mut self) -> Self {
        self.controllers = false;
        self
    }

    /// Pods of the system priority classes admitted only with a ResourceQuota matching
    /// their class in their namespace, as on GKE.
    pub fn like_gke(mut self) -> Self {
        self.limited_priority_classes = vec![
            "system-node-critical".into(),
            "system-cluster-critical".into(),
        ];
        self
    }
}

/// The binaries of `release`: built by `tests/controlplane/build.sh` when the cache
/// lacks them (minutes the first time), else at once. `None`, with the reason printed,
/// where Go is missing and `CI` is unset; under `CI` a missing Go fails.
pub fn binaries(test: &str, release: Release) -> Option<PathBuf> {
    let build = "tests/controlplane/build.sh";
    super::gobuild::go_built(test, build, &[release.minor()], "the real control plane")
}

/// One audited request.
#[derive(Debug, Clone)]
pub struct AuditEvent {
    pub user: String,
    pub verb: String,
    pub uri: String,
    pub code: u16,
    /// When the apiserver received it (`requestReceivedTimestamp`), Unix ms.
    pub received_ms: u64,
}

/// A running control plane.
pub struct ControlPlane {
    /// Its release.
    pub release: Release,
    /// `https://127.0.0.1:PORT`.
    pub server: String,
    /// A kubeconfig of `system:masters` (the test's own rights).
    pub admin_kubeconfig: PathBuf,
    /// etcd's client URL, `http://127.0.0.1:PORT` (its `/metrics` too).
    pub etcd: String,
    dir: tempfile::TempDir,
    ca: PathBuf,
    procs: Vec<Proc>,
    /// Start-up: until `/readyz` answered, and until the controllers were up.
    pub started_in: Duration,
}

/// The bearer tokens of the static token file: the test's admin, the controller
/// manager and the scheduler (each as its own user, as kubeadm's certificates name
/// them; RBAC's bootstrap policy binds their roles).
const TOKENS: [(&str, &str, &str); 3] = [
    ("admin", "faultline-test-admin", "system:masters"),
    (
        "kube-controller-manager",
        "system:kube-controller-manager",
        "",
    ),
    ("kube-scheduler", "system:kube-scheduler", ""),
];

impl ControlPlane {
    /// Start one as `opts` says, for `test`; `None` where it cannot be built and the
    /// test is skipped (the reason printed; never under `CI`).
    pub async fn start(test: &str, opts: Options) -> Option<ControlPlane> {
        let bin = binaries(test, opts.release)?;
        Some(
            Self::start_from(&bin, opts)
                .await
                .unwrap_or_else(|e| panic!("{test}: the control plane did not start: {e:#}")),
        )
    }

    async fn start_from(bin: &Path, opts: Options) -> anyhow::Result<ControlPlane> {
        let begun = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("faultline-controlplane-")
            .tempdir()?;
        let d = dir.path();
        let pki = super::certs::generate(&d.join("pki"))?;
        let mut tokens = String::new();
        for (i, (name, user, groups)) in TOKENS.iter().enumerate() {
            tokens.push_str(&format!("{},{user},uid-{i},\"{groups}\"\n", token(name)));
        }
        std::fs::write(d.join("tokens.csv"), tokens)?;
        let logs = d.join("logs");
        std::fs::create_dir_all(&logs)?;

        let (etcd_client, etcd_peer, secure) = (free_port()?, free_port()?, free_port()?);
        let server = format!("https://127.0.0.1:{secure}");
        for (name, _, _) in TOKENS {
            std::fs::write(
                d.join(format!("{name}.kubeconfig")),
                kubeconfig(&server, &pki.ca, &token(name)),
            )?;
        }
        let mut procs = Vec::new();
        let etcd = Proc::spawn(
            "etcd",
            &bin.join("etcd"),
            &[
                "--name=faultline-test".into(),
                format!("--data-dir={}", d.join("etcd").display()),
                format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
                format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-cluster=faultline-test=http://127.0.0.1:{etcd_peer}"),
                // The test cluster's data is thrown away: no fsync per write.
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
            &logs,
        )?;
        procs.push(etcd);

        let gates = opts.feature_gates.join(",");
        let mut args = vec![
            format!("--etcd-servers=http://127.0.0.1:{etcd_client}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={secure}"),
            "--advertise-address=127.0.0.1".into(),
            // The `kubernetes` Service's Endpoints would name a loopback address, which
            // validation refuses: nothing here reaches the apiserver through it.
            "--endpoint-reconciler-type=none".into(),
            format!("--cert-dir={}", d.join("pki").display()),
            format!("--tls-cert-file={}", pki.apiserver_cert.display()),
            format!("--tls-private-key-file={}", pki.apiserver_key.display()),
            format!("--client-ca-file={}", pki.ca.display()),
            format!("--token-auth-file={}", d.join("tokens.csv").display()),
            "--authorization-mode=Node,RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", pki.sa_pub.display()),
            format!(
                "--service-account-signing-key-file={}",
                pki.sa_key.display()
            ),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            // Every request of the audited users (faultline's ServiceAccounts), so a
            // test can assert that none was refused ([`ControlPlane::refused`]).
            format!(
                "--audit-policy-file={}",
                d.join("audit-policy.yaml").display()
            ),
            format!("--audit-log-path={}", d.join("audit.log").display()),
            "--audit-log-format=json".into(),
            "--audit-log-mode=blocking".into(),
            "--v=1".into(),
        ];
        std::fs::write(d.join("audit-policy.yaml"), AUDIT_POLICY)?;
        if !gates.is_empty() {
            args.push(format!("--feature-gates={gates}"));
        }
        if !opts.limited_priority_classes.is_empty() {
            let path = d.join("admission.yaml");
            std::fs::write(
                &path,
                super::admission::limited_resources(&opts.limited_priority_classes),
            )?;
            args.push(format!(
                "--admission-control-config-file={}",
                path.display()
            ));
        }
        if !opts.runtime_config.is_empty() {
            args.push(format!(
                "--runtime-config={}",
                opts.runtime_config.join(",")
            ));
        }
        procs.push(Proc::spawn(
            "kube-apiserver",
            &bin.join("kube-apiserver"),
            &args,
            &logs,
        )?);
        let mut cp = ControlPlane {
            release: opts.release,
            server,
            admin_kubeconfig: d.join("admin.kubeconfig"),
            etcd: format!("http://127.0.0.1:{etcd_client}"),
            ca: pki.ca.clone(),
            dir,
            procs,
            started_in: Duration::ZERO,
        };
        cp.wait_ready(Duration::from_secs(120)).await?;
        if opts.controllers {
            cp.start_controllers(bin, &gates, &pki)?;
            cp.wait_controllers(Duration::from_secs(120)).await?;
        }
        cp.started_in = begun.elapsed();
        Ok(cp)
    }

    fn start_controllers(
        &mut self,
        bin: &Path,
        gates: &str,
        pki: &super::certs::Pki,
    ) -> anyhow::Result<()> {
        let d = self.dir.path().to_path_buf();
        let logs = d.join("logs");
        let kcm = d.join("kube-controller-manager.kubeconfig");
        let mut args = vec![
            format!("--kubeconfig={}", kcm.display()),
            format!("--authentication-kubeconfig={}", kcm.display()),
            format!("--authorization-kubeconfig={}", kcm.display()),
            // No request-header CA to look up in kube-system (no front proxy here).
            "--authentication-skip-lookup=true".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            format!(
                "--service-account-private-key-file={}",
                pki.sa_key.display()
            ),
            format!("--root-ca-file={}", pki.ca.display()),
            // Each controller under its own ServiceAccount, with the bootstrap policy's
            // role for it, as kubeadm runs them: a controller lacking a right fails here
            // as it would on a cluster.
            "--use-service-account-credentials=true".into(),
            // Every controller that is on by default, and those off by default that
            // faultline's behaviour depends on (none today; the list is explicit so a
            // release that drops one shows).
            "--controllers=*".into(),
            "--leader-elect=false".into(),
            "--v=1".into(),
        ];
        if !gates.is_empty() {
            args.push(format!("--feature-gates={gates}"));
        }
        self.procs.push(Proc::spawn(
            "kube-controller-manager",
            &bin.join("kube-controller-manager"),
            &args,
            &logs,
        )?);
        let sched = d.join("kube-scheduler.kubeconfig");
        let mut args = vec![
            format!("--kubeconfig={}", sched.display()),
            format!("--authentication-kubeconfig={}", sched.display()),
            format!("--authorization-kubeconfig={}", sched.display()),
            "--authentication-skip-lookup=true".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            "--leader-elect=false".into(),
            "--v=1".into(),
        ];
        if !gates.is_empty() {
            args.push(format!("--feature-gates={gates}"));
        }
        self.procs.push(Proc::spawn(
            "kube-scheduler",
            &bin.join("kube-scheduler"),
            &args,
            &logs,
        )?);
        Ok(())
    }

    /// The test's own client (`system:masters`).
    pub async fn admin(&self) -> kube::Client {
        self.client(&self.admin_kubeconfig).await
    }

    /// A client from `kubeconfig`.
    pub async fn client(&self, kubeconfig: &Path) -> kube::Client {
        let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        // Answers as they come: no retries of 429 and 503 behind the caller's back.
        cfg.default_retry = false;
        kube::Client::try_from(cfg).unwrap()
    }

    /// A kubeconfig that authenticates as ServiceAccount `ns/name` with a token the
    /// apiserver issued (`kubectl create token`, one hour), as a pod of that account
    /// would; its path.
    pub fn service_account_kubeconfig(&self, ns: &str, name: &str) -> PathBuf {
        let out = self.kubectl(&["-n", ns, "create", "token", name, "--duration=1h"]);
        let path = self.dir.path().join(format!("sa-{ns}-{name}.kubeconfig"));
        std::fs::write(&path, kubeconfig(&self.server, &self.ca, out.trim())).unwrap();
        path
    }

    /// `kubectl` as the admin; its stdout. Panics, with stderr, when it fails.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let out = self.kubectl_output(args);
        assert!(
            out.status.success(),
            "kubectl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The discovery cache of this control plane's clients (kubectl, helm). Never the
    /// user's `~/.kube/cache`: it is keyed by host and port only, and a port this
    /// plane reuses may have served another release's API there (kubectl then asks
    /// for DeviceTaintRule at a version this release does not serve: 404).
    pub fn kube_cache(&self) -> PathBuf {
        self.dir.path().join("kube-cache")
    }

    /// `kubectl` as the admin, whatever it answers.
    pub fn kubectl_output(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new("kubectl")
            .arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .arg(format!("--cache-dir={}", self.kube_cache().display()))
            .args(args)
            .output()
            .expect("kubectl (Debian: kubernetes-client)")
    }

    /// The log of component `name` (`kube-apiserver`, ...).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("logs").join(format!("{name}.log")))
            .unwrap_or_default()
    }

    /// The audited requests (faultline's ServiceAccounts') so far: each event's user,
    /// verb, URI and answer's code.
    pub fn audit(&self) -> Vec<AuditEvent> {
        let text = std::fs::read_to_string(self.dir.path().join("audit.log")).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["stage"] == "ResponseComplete")
            .map(|e| AuditEvent {
                user: e["user"]["username"].as_str().unwrap_or("").into(),
                verb: e["verb"].as_str().unwrap_or("").into(),
                uri: e["requestURI"].as_str().unwrap_or("").into(),
                code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
                received_ms: e["requestReceivedTimestamp"]
                    .as_str()
                    .and_then(faultline_common::time::parse_rfc3339_ms)
                    .unwrap_or(0),
            })
            .collect()
    }

    /// The audited requests refused by authentication or RBAC (401, 403), as
    /// `CODE VERB URI (USER)`.
    pub fn refused(&self) -> Vec<String> {
        self.audit()
            .into_iter()
            .filter(|e| e.code == 401 || e.code == 403)
            .map(|e| format!("{} {} {} ({})", e.code, e.verb, e.uri, e.user))
            .collect()
    }

    /// Each component's process id.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        self.procs.iter().map(|p| (p.name, p.pid())).collect()
    }

    /// Resident memory of each component now (`VmRSS`, KiB).
    pub fn memory_kib(&self) -> Vec<(&'static str, u64)> {
        self.procs.iter().map(|p| (p.name, p.rss_kib())).collect()
    }

    async fn wait_ready(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            self.assert_alive()?;
            let out = self.kubectl_output(&["get", "--raw", "/readyz"]);
            if out.status.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver not ready within {within:?}: {}\n{}",
                    String::from_utf8_lossy(&out.stderr),
                    tail(&self.log("kube-apiserver"), 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Until the controller manager has made the `default` ServiceAccount of
    /// `default` (its serviceaccount controller runs) and the scheduler answers healthy.
    async fn wait_controllers(&mut self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            self.assert_alive()?;
            let sa = self.kubectl_output(&["-n", "default", "get", "serviceaccount", "default"]);
            if sa.status.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-controller-manager made no ServiceAccount within {within:?}:\n{}",
                    tail(&self.log("kube-controller-manager"), 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An error, with its log's tail, for each component that has exited.
    pub fn assert_alive(&mut self) -> anyhow::Result<()> {
        for p in &mut self.procs {
            if let Some(status) = p.exited() {
                bail!("{} exited ({status}):\n{}", p.name, tail(&p.log_text(), 40));
            }
        }
        Ok(())
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in &self.procs {
                eprintln!(
                    "--- {} (the last 20 lines of its log):\n{}",
                    p.name,
                    tail(&p.log_text(), 20)
                );
            }
        }
        // The newest first: the scheduler and controllers before the apiserver, it
        // before etcd.
        while let Some(p) = self.procs.pop() {
            drop(p);
        }
    }
}

/// Requests of every ServiceAccount of the namespace `faultline` at `Metadata` (who,
/// what, the answer's code), nothing else.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: [\"system:serviceaccounts:faultline\"]
  - level: None
";

/// The bearer token of static user `name` (a test cluster's: fixed, never a secret).
fn token(name: &str) -> String {
    format!("faultline-test-token-{name}")
}

fn kubeconfig(server: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: test\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test}}\ncurrent-context: test\n",
        ca.display()
    )
}

/// A free loopback port (bound, then let go: the component binds it a moment later).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("a free port")?;
    Ok(l.local_addr()?.port())
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
