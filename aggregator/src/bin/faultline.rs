//! `faultline`: what an SRE runs against the cluster.
//!
//! - `faultline status`: the quarantined nodes, their devices and why, the breaker.
//! - `faultline release --node N [--device D]...`: ask for a release. It writes the
//!   request on the Node (`faultline.io/release`, `-by`, `-reason`); the replica that
//!   holds the node's shard carries it out (one actor, the Lease checked, the record kept
//!   as history) and the command waits until it is done.
//! - `faultline breaker close`: close the circuit breaker after a look at the cause.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use faultline_aggregator::remediate::{
    history_of, record_of, DEVICES_LABEL, RELEASE_ANNOTATION, RELEASE_BY_ANNOTATION,
    RELEASE_REASON_ANNOTATION,
};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, ListParams, Patch, PatchParams};

#[derive(Debug, Parser)]
#[command(
    name = "faultline",
    version,
    about = "faultline: quarantines, releases and the breaker"
)]
struct Cli {
    /// API server URL (plain HTTP, e.g. the local test server); default: in-cluster or
    /// $KUBECONFIG.
    #[arg(long, global = true, env = "FAULTLINE_KUBE_SERVER")]
    kube_server: Option<String>,
    /// A file with the bearer token for --kube-server.
    #[arg(long, global = true, env = "FAULTLINE_KUBE_TOKEN_FILE")]
    kube_token_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// List quarantined nodes (and the breaker's state).
    Status {
        /// Namespace of the aggregator (for the breaker).
        #[arg(long, default_value = "faultline")]
        namespace: String,
        /// The aggregator's --name.
        #[arg(long, default_value = "faultline")]
        name: String,
    },
    /// Release a node, or some of its devices.
    Release {
        /// The node.
        #[arg(long)]
        node: String,
        /// Devices (id, UUID or bus id) to release; none: all.
        #[arg(long)]
        device: Vec<String>,
        /// Who releases (default: $USER).
        #[arg(long)]
        by: Option<String>,
        /// Why (kept in the record's history).
        #[arg(long, default_value = "released by a person")]
        reason: String,
        /// How long to wait for the aggregator to carry it out (0: do not wait).
        #[arg(long, default_value = "60s")]
        wait: String,
    },
    /// The circuit breaker.
    Breaker {
        /// `close` (resume remediation) or `open` (stop it).
        action: String,
        /// Namespace of the aggregator.
        #[arg(long, default_value = "faultline")]
        namespace: String,
        /// The aggregator's --name.
        #[arg(long, default_value = "faultline")]
        name: String,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if let Err(e) = run(Cli::parse()).await {
        eprintln!("faultline: {e:#}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let client = faultline_aggregator::connect(
        cli.kube_server.as_deref(),
        cli.kube_token_file.as_deref(),
        Some(Duration::from_secs(15)),
    )
    .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    match cli.cmd {
        Cmd::Status { namespace, name } => {
            let cms: Api<ConfigMap> = Api::namespaced(client, &namespace);
            let breaker = cms
                .get_opt(&format!("{name}-breaker"))
                .await
                .ok()
                .flatten()
                .and_then(|c| c.data)
                .unwrap_or_default();
            println!(
                "breaker: {}{}",
                breaker.get("state").map(String::as_str).unwrap_or("closed"),
                breaker
                    .get("reason")
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            );
            let list = nodes
                .list(&ListParams::default().labels(DEVICES_LABEL))
                .await?;
            println!(
                "{:<28} {:<24} {:<22} {:<10} REASON",
                "NODE", "DEVICES", "SINCE", "BY"
            );
            for n in &list.items {
                let Some(r) = record_of(n)? else {
                    continue;
                };
                let ids: Vec<&str> = r.devices.iter().map(|d| d.id.as_str()).collect();
                let reasons: Vec<&str> = r.devices.iter().map(|d| d.reason.as_str()).collect();
                println!(
                    "{:<28} {:<24} {:<22} {:<10} {}{}",
                    r.node,
                    ids.join(","),
                    r.first_seen.get(..19).unwrap_or(&r.first_seen),
                    r.actor,
                    reasons.join(","),
                    if r.unknown_only {
                        " (unknown only)"
                    } else {
                        ""
                    }
                );
            }
            Ok(())
        }
        Cmd::Release {
            node,
            device,
            by,
            reason,
            wait,
        } => {
            let live = nodes
                .get(&node)
                .await
                .with_context(|| format!("node {node}"))?;
            let Some(record) = record_of(&live)? else {
                bail!("{node} is not quarantined by faultline");
            };
            let who = by
                .or_else(|| std::env::var("USER").ok())
                .unwrap_or_else(|| "unknown".into());
            let value = if device.is_empty() {
                "all".to_string()
            } else {
                device.join(",")
            };
            let patch = serde_json::json!({"metadata": {"annotations": {
                RELEASE_ANNOTATION: value,
                RELEASE_BY_ANNOTATION: who,
                RELEASE_REASON_ANNOTATION: reason,
            }}});
            nodes
                .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            println!("release of {node} ({value}) requested by {who}");
            let wait = faultline_common::xid::parse_duration(&wait)
                .with_context(|| format!("--wait {wait:?}"))?;
            if wait.is_zero() {
                return Ok(());
            }
            let deadline = Instant::now() + wait;
            loop {
                let live = nodes.get(&node).await?;
                let pending = live
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(RELEASE_ANNOTATION));
                if !pending {
                    match record_of(&live)? {
                        None => {
                            let last = history_of(&live).pop();
                            println!(
                                "released: {node}{}",
                                last.and_then(|r| r.released)
                                    .map(|r| format!(" at {} by {}", r.at, r.actor))
                                    .unwrap_or_default()
                            );
                        }
                        Some(r) if r.devices.len() < record.devices.len() => {
                            let ids: Vec<&str> = r.devices.iter().map(|d| d.id.as_str()).collect();
                            println!("released {value}; still quarantined: {}", ids.join(","));
                        }
                        Some(_) => {
                            println!("the aggregator ignored the request (see the node's Events)")
                        }
                    }
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    bail!("the request is on {node} but no aggregator carried it out within {wait:?} (is one running with --remediation enforce?)");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Cmd::Breaker {
            action,
            namespace,
            name,
        } => {
            let state = match action.as_str() {
                "close" => "closed",
                "open" => "open",
                a => bail!("breaker {a:?}: expected close or open"),
            };
            let cms: Api<ConfigMap> = Api::namespaced(client, &namespace);
            // Closing also clears the failures counted (kept in the same ConfigMap).
            let by = std::env::var("USER").unwrap_or_else(|_| "a person".into());
            let patch = serde_json::json!({"data": {
                "state": state,
                "reason": format!("set {state} by {by}"),
                "since": faultline_common::time::now_rfc3339(),
                "failures": "{}",
            }});
            cms.patch(
                &format!("{name}-breaker"),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .with_context(|| format!("breaker ConfigMap {namespace}/{name}-breaker"))?;
            println!("breaker {state}");
            Ok(())
        }
    }
}
