//! The replicas of the scale benchmark: each the release `faultline-aggregator` in a
//! process of its own, read through its metrics and its connections to the agents.

use super::*;

/// A replica: the release binary, killed (SIGKILL) when dropped.
pub(crate) struct Replica {
    pub(crate) proc: Proc,
    pub(crate) name: String,
    pub(crate) port: u16,
}

pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub(crate) fn replica(
    agg: &str,
    kube: &str,
    name: &str,
    base: &str,
    shards: u32,
    agents: &std::path::Path,
) -> Result<Replica> {
    let port = free_port()?;
    let child = Command::new(agg)
        .args(["--sink", "configmap", "--kube-server", kube])
        .args(["--namespace", NS, "--name", base, "--replica", name])
        .args(["--shards", &shards.to_string()])
        .args(["--pages", &pages().to_string()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--nudge-rate", "0", "--remediation", "off"])
        .arg("--agents-file")
        .arg(agents)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?;
    Ok(Replica {
        proc: Proc(child),
        name: name.to_string(),
        port,
    })
}

impl Replica {
    pub(crate) fn pid(&self) -> u32 {
        self.proc.0.id()
    }

    /// The replica's metrics, if it answers.
    pub(crate) async fn metrics(&self) -> Option<String> {
        let client: hyper_util::client::legacy::Client<
            _,
            http_body_util::Empty<hyper::body::Bytes>,
        > = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
        let url = format!("http://127.0.0.1:{}/metrics", self.port);
        let resp = tokio::time::timeout(Duration::from_secs(5), client.get(url.parse().ok()?))
            .await
            .ok()?
            .ok()?;
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .ok()?
            .to_bytes();
        Some(String::from_utf8_lossy(&body).into_owned())
    }

    /// One sample of the replica's metrics, `faultline_aggregator_<name>` (labels
    /// included in `name`).
    pub(crate) async fn metric(&self, name: &str) -> Option<f64> {
        let text = self.metrics().await?;
        let prefix = format!("faultline_aggregator_{name} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
    }

    pub(crate) async fn held(&self) -> i64 {
        self.metric("shards_held").await.map_or(-1, |v| v as i64)
    }

    pub(crate) async fn followed(&self) -> i64 {
        self.metric("nodes_followed").await.map_or(-1, |v| v as i64)
    }

    pub(crate) async fn docs(&self) -> f64 {
        self.metric("agent_polls_total{result=\"ok\"}")
            .await
            .unwrap_or(0.0)
    }
}

/// Established TCP connections of `pid` to any of `ports` (the agents).
pub(crate) fn connections(pid: u32, ports: &HashSet<u16>) -> usize {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    let mut n = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(rem), Some(st), Some(inode)) = (f.get(2), f.get(3), f.get(9)) else {
                continue;
            };
            let port = rem
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if *st == "01" && port.is_some_and(|p| ports.contains(&p)) && inodes.contains(*inode) {
                n += 1;
            }
        }
    }
    n
}
