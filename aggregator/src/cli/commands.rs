//! The CLI's commands and flags, and how each one reads the cluster and prints.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use super::render::Output;
use super::view::Scope;
use crate::remediate::{
    history_of, record_of, RELEASE_ANNOTATION, RELEASE_BY_ANNOTATION, RELEASE_REASON_ANNOTATION,
};

#[derive(Debug, Parser)]
#[command(
    name = "faultline",
    version,
    about = "faultline: quarantined nodes, devices, agents, releases and the breaker"
)]
struct Cli {
    /// API server URL (plain HTTP, e.g. the local test server); default: the kubeconfig
    /// (--kubeconfig, $KUBECONFIG, ~/.kube/config) or in-cluster.
    #[arg(long, global = true, env = "FAULTLINE_KUBE_SERVER")]
    kube_server: Option<String>,
    /// A file with the bearer token for --kube-server.
    #[arg(long, global = true, env = "FAULTLINE_KUBE_TOKEN_FILE")]
    kube_token_file: Option<PathBuf>,
    /// The kubeconfig file (as kubectl's --kubeconfig).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (as kubectl's --context).
    #[arg(long, global = true)]
    context: Option<String>,
    /// faultline's namespace (the aggregator's; its ConfigMaps and Leases live there).
    #[arg(
        short = 'n',
        long,
        global = true,
        default_value = "faultline",
        env = "FAULTLINE_NAMESPACE"
    )]
    namespace: String,
    /// The aggregator's --name.
    #[arg(long, global = true, default_value = "faultline")]
    name: String,
    /// Output format: a table (default), wide, json or yaml.
    #[arg(short = 'o', long, global = true, value_enum)]
    output: Option<Output>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// List quarantined nodes (and the breaker's state).
    Status,
    /// One node: its devices as published, faultline's taints, its quarantine record
    /// and history.
    Describe {
        /// The node.
        node: String,
    },
    /// Every agent the aggregator follows: reachable or not, its sources.
    Agents,
    /// Release a node, or some of its devices.
    Release {
        /// The node (or --node).
        #[arg(required_unless_present = "node")]
        target: Option<String>,
        /// The node.
        #[arg(long, conflicts_with = "target")]
        node: Option<String>,
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
    },
}

/// The entry point of both binaries; `bin` is how the user called it (for help).
pub async fn main(bin: &str) {
    let matches = Cli::command().bin_name(bin).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    if let Err(e) = run(cli).await {
        eprintln!("{bin}: {e:#}");
        std::process::exit(1);
    }
}

/// The client: `--kube-server` as the aggregator takes it, else the kubeconfig with
/// `--context` (kube's `KubeConfigOptions`), else in-cluster.
async fn client(cli: &Cli) -> anyhow::Result<kube::Client> {
    let timeout = Some(Duration::from_secs(15));
    if cli.kube_server.is_some() || (cli.kubeconfig.is_none() && cli.context.is_none()) {
        return crate::connect(
            cli.kube_server.as_deref(),
            cli.kube_token_file.as_deref(),
            timeout,
        )
        .await;
    }
    let opts = KubeConfigOptions {
        context: cli.context.clone(),
        ..Default::default()
    };
    let mut kc = match &cli.kubeconfig {
        Some(p) => {
            let file = Kubeconfig::read_from(p)
                .with_context(|| format!("--kubeconfig {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(file, &opts).await
        }
        None => kube::Config::from_kubeconfig(&opts).await,
    }
    .with_context(|| match &cli.context {
        Some(c) => format!("kubeconfig context {c:?}"),
        None => "kubeconfig".to_string(),
    })?;
    if let Some(f) = &cli.kube_token_file {
        kc.auth_info.token_file = Some(f.display().to_string());
    }
    kc.read_timeout = timeout;
    kc.write_timeout = timeout;
    kube::Client::try_from(kc).context("Kubernetes client")
}

fn print(s: &str) {
    print!("{s}");
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let client = client(&cli).await?;
    let scope = Scope {
        namespace: cli.namespace.clone(),
        name: cli.name.clone(),
    };
    let wide = cli.output == Some(Output::Wide);
    match cli.cmd {
        Cmd::Status => {
            let v = super::view::status(&client, &scope).await?;
            match super::render::structured(&v, cli.output)? {
                Some(s) => print(&s),
                None => print(&super::render::status(&v, wide)),
            }
        }
        Cmd::Describe { node } => {
            let v = super::view::describe(&client, &scope, &node).await?;
            match super::render::structured(&v, cli.output)? {
                Some(s) => print(&s),
                None => print(&super::render::describe(&v)),
            }
        }
        Cmd::Agents => {
            let v = super::view::agents(&client, &scope).await?;
            match super::render::structured(&v, cli.output)? {
                Some(s) => print(&s),
                None if v.is_empty() => println!(
                    "no agents published in {} (is the aggregator running with --sink configmap?)",
                    scope.namespace
                ),
                None => print(&super::render::agents(&v, wide)),
            }
        }
        Cmd::Release {
            target,
            node,
            device,
            by,
            reason,
            wait,
        } => {
            let node = target.or(node).context("which node?")?;
            release(&client, &node, device, by, reason, &wait).await?;
        }
        Cmd::Breaker { action } => breaker(&client, &scope, &action).await?,
    }
    Ok(())
}

async fn release(
    client: &kube::Client,
    node: &str,
    device: Vec<String>,
    by: Option<String>,
    reason: String,
    wait: &str,
) -> anyhow::Result<()> {
    // Parsed before anything is written: a bad --wait must not leave a request behind.
    let wait =
        faultline_common::time::parse_duration(wait).with_context(|| format!("--wait {wait:?}"))?;
    let nodes: Api<Node> = Api::all(client.clone());
    let live = nodes
        .get(node)
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
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    println!("release of {node} ({value}) requested by {who}");
    if wait.is_zero() {
        return Ok(());
    }
    let deadline = Instant::now() + wait;
    loop {
        let live = nodes.get(node).await?;
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

async fn breaker(client: &kube::Client, scope: &Scope, action: &str) -> anyhow::Result<()> {
    let state = match action {
        "close" => "closed",
        "open" => "open",
        a => bail!("breaker {a:?}: expected close or open"),
    };
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &scope.namespace);
    // Closing also clears the failures counted (kept in the same ConfigMap).
    let by = std::env::var("USER").unwrap_or_else(|_| "a person".into());
    let patch = serde_json::json!({"data": {
        "state": state,
        "reason": format!("set {state} by {by}"),
        "since": faultline_common::time::now_rfc3339(),
        "failures": "{}",
    }});
    let name = format!("{}-breaker", scope.name);
    cms.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("breaker ConfigMap {}/{name}", scope.namespace))?;
    println!("breaker {state}");
    Ok(())
}
