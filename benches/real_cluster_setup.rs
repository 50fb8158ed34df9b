//! real-cluster-bench's cluster: the kubelets' Leases, deploy/base's RBAC, the agents'
//! Service and EndpointSlices, the replicas and what they published.

use super::*;

// The kubelets' Leases.

/// Renew every node's Lease every [`RENEW`], spread evenly, as its kubelet would; the
/// renewals made and refused.
pub(crate) fn heartbeats(client: kube::Client, nodes: usize) -> Arc<(AtomicU64, AtomicU64)> {
    let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let out = counts.clone();
    tokio::spawn(async move {
        let api: Api<Lease> = Api::namespaced(client, "kube-node-lease");
        let mut held: Vec<Option<Lease>> = vec![None; nodes];
        // Ticks of 100 ms, each renewing its share of the nodes.
        let per_tick = nodes.div_ceil((RENEW.as_millis() / 100) as usize).max(1);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut next = 0;
        loop {
            tick.tick().await;
            let batch: Vec<usize> = (0..per_tick).map(|k| (next + k) % nodes).collect();
            next = (next + per_tick) % nodes;
            let done: Vec<(usize, Option<Lease>)> = stream::iter(batch)
                .map(|i| {
                    let (api, old) = (api.clone(), held[i].clone());
                    async move { (i, renew(&api, i, old).await) }
                })
                .buffer_unordered(16)
                .collect()
                .await;
            for (i, l) in done {
                let ok = l.is_some();
                held[i] = l;
                if ok { &counts.0 } else { &counts.1 }.fetch_add(1, Relaxed);
            }
        }
    });
    out
}

/// Node `i`'s Lease renewed now (made the first time): the stored object, or `None`
/// when the write failed (read again next time).
pub(crate) async fn renew(api: &Api<Lease>, i: usize, old: Option<Lease>) -> Option<Lease> {
    let name = node_name(i);
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    );
    let mut lease = match old {
        Some(l) => l,
        None => match api.get_opt(&name).await.ok()? {
            Some(l) => l,
            None => {
                let l: Lease = serde_json::from_value(json!({
                    "metadata": {"name": name, "namespace": "kube-node-lease"},
                    "spec": {"holderIdentity": name, "leaseDurationSeconds": 40},
                }))
                .ok()?;
                api.create(&PostParams::default(), &l).await.ok()?
            }
        },
    };
    lease.spec.get_or_insert_with(Default::default).renew_time = Some(now);
    api.replace(&name, &PostParams::default(), &lease)
        .await
        .ok()
}

// ---------------------------------------------------------------------------------
// Seeding.

/// deploy/base's RBAC, namespace and ServiceAccounts (not its workloads or Services:
/// the agents here are the fleet's), applied with kubectl.
pub(crate) fn apply_base(cp: &ControlPlane) -> Result<()> {
    let out = Command::new("kubectl")
        .args(["kustomize", "deploy/base"])
        .output()
        .context("kubectl kustomize deploy/base")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let keep = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ];
    let text = String::from_utf8(out.stdout)?;
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|d| {
            d.lines()
                .find_map(|l| l.strip_prefix("kind: "))
                .is_some_and(|k| keep.contains(&k.trim()))
        })
        .collect();
    let f = std::env::temp_dir().join(format!("real-cluster-bench-{}.yaml", std::process::id()));
    std::fs::write(&f, docs.join("\n---\n"))?;
    cp.kubectl(&["apply", "--server-side", "-f", f.to_str().unwrap()]);
    Ok(())
}

/// `objs` created through the admin client, 16 at a time; their bytes.
pub(crate) async fn create_all(
    client: &kube::Client,
    objs: Vec<(&'static str, Value)>,
) -> Result<u64> {
    let bytes = AtomicU64::new(0);
    let results: Vec<Result<()>> = stream::iter(objs)
        .map(|(what, v)| {
            let (client, bytes) = (client.clone(), &bytes);
            async move {
                bytes.fetch_add(serde_json::to_vec(&v)?.len() as u64, Relaxed);
                let ns = v["metadata"]["namespace"].as_str().map(String::from);
                let api: Api<kube::api::DynamicObject> = match what {
                    "nodes" => Api::all_with(client, &ar("", "v1", "Node", "nodes")),
                    _ => Api::namespaced_with(
                        client,
                        ns.as_deref().unwrap_or(NS),
                        &ar("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"),
                    ),
                };
                let obj: kube::api::DynamicObject = serde_json::from_value(v)?;
                api.create(&PostParams::default(), &obj)
                    .await
                    .with_context(|| format!("create {what}"))?;
                Ok(())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(bytes.into_inner())
}

pub(crate) fn ar(group: &str, version: &str, kind: &str, plural: &str) -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.into(),
        plural: plural.into(),
    }
}

// ---------------------------------------------------------------------------------
// The replicas.

pub(crate) struct Replica {
    pub(crate) proc: Proc,
    pub(crate) name: String,
}

pub(crate) fn start_replica(
    agg: &str,
    kubeconfig: &Path,
    name: &str,
    cfg: &Cfg,
    dir: &Path,
) -> Result<Replica> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(agg)
        .args(["--sink", "configmap", "--namespace", NS, "--name", BASE])
        .args(["--replica", name, "--shards", &cfg.shards.to_string()])
        .args(["--pages", &cfg.pages.to_string()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--delivery-token-file")
        .arg(dir.join("delivery-token"))
        .env("KUBECONFIG", kubeconfig)
        .env(
            "RUST_LOG",
            std::env::var("BENCH_RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log")))?)
        .spawn()?;
    Ok(Replica {
        proc: Proc(child),
        name: name.into(),
    })
}

/// Every shard page's node entries, parsed: (nodes published, nodes with 8 healthy
/// devices).
pub(crate) async fn published(client: &kube::Client) -> Result<(usize, usize)> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let (mut all, mut healthy) = (0, 0);
    for cm in api.list(&Default::default()).await?.items {
        if !cm
            .metadata
            .name
            .as_deref()
            .unwrap_or("")
            .starts_with(&format!("{BASE}-shard-"))
        {
            continue;
        }
        for (k, v) in cm.data.unwrap_or_default() {
            if k == "fault.json" {
                continue;
            }
            all += 1;
            let ok = serde_json::from_str::<NodeFaults>(&v).is_ok_and(|n| {
                n.npus.len() == cluster_fleet::DEVICES
                    && n.npus.iter().all(|d| d.status == DeviceStatus::Healthy)
            });
            healthy += usize::from(ok);
        }
    }
    Ok((all, healthy))
}

/// Whether node `i`'s entry in its shard page shows device `dev` failed.
pub(crate) async fn published_failed(
    client: &kube::Client,
    cfg: &Cfg,
    i: usize,
    dev: usize,
) -> bool {
    let name = node_name(i);
    let page = page_name(
        BASE,
        shard_of(&name, cfg.shards),
        page_of(&name, cfg.shards, cfg.pages),
    );
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let Ok(Some(cm)) = api.get_opt(&page).await else {
        return false;
    };
    let id = format!("gpu{dev}");
    cm.data
        .as_ref()
        .and_then(|d| d.get(&format!("{name}.json")))
        .and_then(|v| serde_json::from_str::<NodeFaults>(v).ok())
        .is_some_and(|e| {
            e.npus
                .iter()
                .any(|d| d.id == id && d.status == DeviceStatus::Failed)
        })
}
