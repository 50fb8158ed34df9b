//! One way to start the server, for the tests of every crate, the benchmarks and the
//! binary: [`spawn`] for an empty cluster on loopback, [`Bootstrap`] for one with
//! namespaces, objects, manifests, RBAC or faults in place before the first request.
//!
//! Start-up only, no API behaviour of its own: the namespaces a server starts with are
//! those kube-apiserver's system-namespaces controller makes
//! (`pkg/controlplane/controller/systemnamespaces/system_namespaces_controller.go`,
//! `default` and `kube-system`), and every namespace and object seeded here goes through
//! the same create path, validation and admission a request does (nothing is written
//! past them), so a seeded object kube-apiserver would refuse is refused here too.

use std::net::SocketAddr;

use anyhow::Context;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::{serve, ApiServer, Faults};

/// An empty cluster (the `default` and `kube-system` namespaces) served on loopback:
/// the server, to seed and inspect, and its URL. It serves until the runtime ends.
pub async fn spawn() -> (ApiServer, String) {
    Bootstrap::new().spawn().await
}

/// What a server holds and who may call it before it starts serving.
#[derive(Default)]
pub struct Bootstrap {
    listen: Option<SocketAddr>,
    namespaces: Vec<String>,
    objects: Vec<(String, String, Value)>,
    manifests: Vec<String>,
    tokens: Option<Vec<(String, String)>>,
    faults: Option<Faults>,
    release: Option<crate::Release>,
    virtual_epoch_ms: Option<u64>,
}

impl Bootstrap {
    /// An empty cluster on a free loopback port.
    pub fn new() -> Self {
        Self::default()
    }

    /// Listen here instead.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    /// A namespace.
    pub fn namespace(mut self, name: &str) -> Self {
        self.namespaces.push(name.into());
        self
    }

    /// An object, created as [`ApiServer::create`] does (a kubelet's or a controller's
    /// part played by the test).
    pub fn object(mut self, plural: &str, ns: &str, obj: Value) -> Self {
        self.objects.push((plural.into(), ns.into(), obj));
        self
    }

    /// The objects of a multi-document YAML manifest that the server serves (RBAC
    /// objects among them; [`ApiServer::load_manifests`]).
    pub fn manifests(mut self, yaml: impl Into<String>) -> Self {
        self.manifests.push(yaml.into());
        self
    }

    /// RBAC enforced, with these users by bearer token ([`ApiServer::enforce_rbac`]).
    pub fn rbac(mut self, tokens: &[(&str, &str)]) -> Self {
        self.tokens = Some(
            tokens
                .iter()
                .map(|(t, u)| (t.to_string(), u.to_string()))
                .collect(),
        );
        self
    }

    /// Faults injected from the first request on.
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = Some(faults);
        self
    }

    /// A virtual clock starting at `epoch_ms` ([`ApiServer::new_virtual`]): start it on
    /// a current-thread runtime with a paused clock.
    pub fn virtual_time(mut self, epoch_ms: u64) -> Self {
        self.virtual_epoch_ms = Some(epoch_ms);
        self
    }

    /// The Kubernetes release played (`release.rs`; 1.34 by default): set before the
    /// objects are seeded, so a kind the release does not serve cannot be seeded.
    pub fn release(mut self, release: crate::Release) -> Self {
        self.release = Some(release);
        self
    }

    /// Seed the server, bind and serve in a task.
    pub async fn start(self) -> anyhow::Result<Running> {
        let server = match self.virtual_epoch_ms {
            Some(at) => ApiServer::new_virtual(at),
            None => ApiServer::new(),
        };
        if let Some(r) = self.release {
            server.set_release(r);
        }
        for ns in &self.namespaces {
            server
                .create("namespaces", "", json!({"metadata": {"name": ns}}))
                .map_err(|e| anyhow::anyhow!("namespace {ns}: {}", e.message))?;
        }
        for (plural, ns, obj) in self.objects {
            server
                .create(&plural, &ns, obj)
                .map_err(|e| anyhow::anyhow!("{plural} in {ns:?}: {}", e.message))?;
        }
        let mut loaded = 0;
        for yaml in &self.manifests {
            loaded += server
                .load_manifests(yaml)
                .map_err(|e| anyhow::anyhow!("manifests: {e}"))?;
        }
        if let Some(tokens) = &self.tokens {
            let tokens: Vec<(&str, &str)> = tokens
                .iter()
                .map(|(t, u)| (t.as_str(), u.as_str()))
                .collect();
            server.enforce_rbac(&tokens);
        }
        if let Some(f) = self.faults {
            server.set_faults(f);
        }
        let at = self.listen.unwrap_or_else(|| ([127, 0, 0, 1], 0).into());
        let listener = tokio::net::TcpListener::bind(at)
            .await
            .with_context(|| format!("listen on {at}"))?;
        let addr = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(listener, server.clone(), cancel.clone()));
        Ok(Running {
            server,
            url: format!("http://{addr}"),
            addr,
            loaded,
            cancel,
            task,
        })
    }

    /// [`Bootstrap::start`] for a test: it panics on an error; the server and its URL.
    pub async fn spawn(self) -> (ApiServer, String) {
        let running = self.start().await.expect("the test API server starts");
        (running.server, running.url)
    }
}

/// A server serving in a task.
pub struct Running {
    /// The server, to seed and inspect.
    pub server: ApiServer,
    /// `http://ADDR`.
    pub url: String,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Objects created from [`Bootstrap::manifests`].
    pub loaded: usize,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Cancel this to stop serving.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Serve until cancelled.
    pub async fn wait(self) -> anyhow::Result<()> {
        Ok(self.task.await??)
    }
}
