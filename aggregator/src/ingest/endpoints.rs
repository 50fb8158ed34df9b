//! Discovery from the EndpointSlices of the agents' headless Service (`--discovery
//! endpoints`, issue 25), as Prometheus' endpoints discovery finds its targets: a slice
//! lists up to 100 endpoints, each a node name and an address, about 200 bytes, where a
//! real GPU Node is 15-40 KB (labels, images, managedFields) and changes with every
//! status update. A slice changes only when an agent pod does, so following them costs
//! next to nothing in steady state.
//!
//! Each ready endpoint with a `nodeName` is that node's agent, at its first address and
//! the slice's port named `http` (else `--agent-port`); the endpointslice controller
//! (pkg/controller/endpointslice) sets `nodeName` from the pod's `spec.nodeName`, so the
//! node it names is where the pod runs, and the agent's document must name the same node
//! (the identity check of every document). A node with several ready endpoints (an agent
//! being replaced) is followed at the lowest address, so every replica picks the same.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;

use super::discover::Followers;

/// The label the endpointslice controller puts on a Service's slices.
pub const SERVICE_LABEL: &str = "kubernetes.io/service-name";

/// The agents a slice names: node -> URL.
pub fn agents(slice: &EndpointSlice, default_port: u16) -> BTreeMap<String, String> {
    let port = slice
        .ports
        .as_ref()
        .and_then(|ps| {
            ps.iter()
                .find(|p| p.name.as_deref() == Some("http"))
                .or_else(|| ps.first())
        })
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(default_port);
    let v6 = slice.address_type == "IPv6";
    if slice.address_type != "IPv4" && !v6 {
        // FQDN slices name no address to connect to.
        return BTreeMap::new();
    }
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for e in &slice.endpoints {
        // `ready` unset means ready (discovery/v1 types.go: "nil should be interpreted
        // as true").
        let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
        let (Some(node), Some(addr), true) = (e.node_name.as_ref(), e.addresses.first(), ready)
        else {
            continue;
        };
        let url = if v6 {
            format!("http://[{addr}]:{port}")
        } else {
            format!("http://{addr}:{port}")
        };
        out.entry(node.clone())
            .and_modify(|u| {
                if url < *u {
                    u.clone_from(&url);
                }
            })
            .or_insert(url);
    }
    out
}

/// Every node's agent over all slices (the lowest URL where several name one node).
fn merged(slices: &BTreeMap<String, BTreeMap<String, String>>) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for agents in slices.values() {
        for (node, url) in agents {
            out.entry(node.clone())
                .and_modify(|u| {
                    if url < u {
                        u.clone_from(url);
                    }
                })
                .or_insert_with(|| url.clone());
        }
    }
    out
}

/// Follow the agents the slices of `service` name until cancelled, from a
/// `kube::runtime::watcher` (the watch cache: `resourceVersion=0`; relists after a 410,
/// backs off after errors). A node no slice names any more is forgotten.
pub async fn run(api: Api<EndpointSlice>, service: String, port: u16, mut f: Followers) {
    let (metrics, cancel) = (f.metrics(), f.cancel_token());
    let mut held = f.held();
    let mut cfg = watcher::Config::default()
        .any_semantic()
        .labels(&format!("{SERVICE_LABEL}={service}"));
    cfg.page_size = None;
    let stream = watcher(api, cfg).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut slices: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    // The slices seen since the last (re)list began.
    let mut listing: Option<BTreeSet<String>> = None;
    loop {
        let ev = tokio::select! {
            _ = cancel.cancelled() => return,
            r = async {
                match held.as_mut() {
                    Some(h) => h.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                if r.is_ok() {
                    f.reconcile().await;
                } else {
                    held = None;
                }
                continue;
            }
            ev = stream.next() => ev,
        };
        let name = |s: &EndpointSlice| s.metadata.name.clone().unwrap_or_default();
        match ev {
            Some(Ok(Event::Apply(s))) => {
                slices.insert(name(&s), agents(&s, port));
            }
            Some(Ok(Event::Delete(s))) => {
                slices.remove(&name(&s));
            }
            Some(Ok(Event::Init)) => {
                listing = Some(BTreeSet::new());
                continue;
            }
            Some(Ok(Event::InitApply(s))) => {
                if let Some(seen) = listing.as_mut() {
                    seen.insert(name(&s));
                }
                slices.insert(name(&s), agents(&s, port));
                // Applied once the list is whole.
                continue;
            }
            Some(Ok(Event::InitDone)) => {
                let seen = listing.take().unwrap_or_default();
                slices.retain(|k, _| seen.contains(k));
            }
            Some(Err(e)) => {
                metrics.discovery_error();
                tracing::warn!(error = %e, "endpointslice watch failed; retrying with backoff, keeping the agents we follow");
                continue;
            }
            None => return,
        }
        f.follow_exactly(merged(&slices)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn endpoint(node: &str, ip: &str, ready: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                ..Default::default()
            }),
            node_name: Some(node.into()),
            ..Default::default()
        }
    }

    fn slice(ty: &str, port: Option<(&str, i32)>, endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: ty.into(),
            endpoints,
            ports: port.map(|(n, p)| {
                vec![EndpointPort {
                    name: Some(n.into()),
                    port: Some(p),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }
    }

    #[test]
    fn ready_endpoints_with_a_node_are_agents() {
        let s = slice(
            "IPv4",
            Some(("http", 9000)),
            vec![
                endpoint("gpu-1", "10.0.0.1", Some(true)),
                endpoint("gpu-2", "10.0.0.2", None),
                endpoint("gpu-3", "10.0.0.3", Some(false)),
                // An agent being replaced: the lower address, whatever the order.
                endpoint("gpu-4", "10.0.0.9", Some(true)),
                endpoint("gpu-4", "10.0.0.10", Some(true)),
                Endpoint {
                    node_name: None,
                    ..endpoint("x", "10.0.0.5", Some(true))
                },
            ],
        );
        let a = agents(&s, 8081);
        assert_eq!(
            a.into_iter().collect::<Vec<_>>(),
            vec![
                ("gpu-1".into(), "http://10.0.0.1:9000".into()),
                ("gpu-2".into(), "http://10.0.0.2:9000".into()),
                ("gpu-4".into(), "http://10.0.0.10:9000".into()),
            ]
        );
        let v6 = slice("IPv6", None, vec![endpoint("gpu-1", "fd00::1", None)]);
        assert_eq!(agents(&v6, 8081)["gpu-1"], "http://[fd00::1]:8081");
        let fqdn = slice("FQDN", None, vec![endpoint("gpu-1", "a.example", None)]);
        assert!(agents(&fqdn, 8081).is_empty());
        // Over slices: one URL per node.
        let mut all = BTreeMap::new();
        all.insert("a".to_string(), agents(&s, 8081));
        all.insert(
            "b".to_string(),
            agents(
                &slice("IPv4", None, vec![endpoint("gpu-1", "10.0.0.0", None)]),
                8081,
            ),
        );
        assert_eq!(merged(&all)["gpu-1"], "http://10.0.0.0:8081");
    }
}
