//! The flags checked into one [`Config`]: defaults resolved, names checked as the API
//! server checks them, and every combination that cannot work refused at start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use faultline_common::flags::comma_list;
use faultline_common::names;
use faultline_common::seal::{Reloaded, SigningKey};
use std::sync::Arc;

use crate::ingest::IntakeConfig;
use crate::notify::Target;
use crate::remediate::{Budget, CanarySpec, Mode, ReleasePolicy};
use crate::targets;

use super::args::{
    AgentTarget, Args, Discovery, LogFormat, ReleaseMode, RemediationArgs, SinkKind,
};

/// The checked configuration.
/// Node-local delivery's settings.
#[derive(Clone)]
pub struct DeliveryConfig {
    /// The bearer token (read again when it changes).
    pub token: Arc<Reloaded<String>>,
    /// The key each delivery is signed with (read again when it changes).
    pub signer: Option<Arc<Reloaded<SigningKey>>>,
    /// How often a delivered entry is confirmed.
    pub confirm: Duration,
}

/// A token file's one word (what [`names::read_token`] checked at start).
fn one_word(text: &str) -> Result<String, faultline_common::seal::KeyError> {
    let t = text.trim();
    if t.is_empty() || t.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return Err(faultline_common::seal::KeyError::Invalid(
            "a token file holds one word".into(),
        ));
    }
    Ok(t.to_string())
}

impl std::fmt::Debug for DeliveryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryConfig")
            .field("token", &"<secret>")
            .field(
                "signer",
                &self.signer.as_ref().map(|s| s.path().to_path_buf()),
            )
            .field("confirm", &self.confirm)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub agents: Vec<AgentTarget>,
    pub sink: SinkKind,
    pub kube_server: Option<String>,
    pub kube_token_file: Option<PathBuf>,
    pub namespace: String,
    /// Namespaces the shard ConfigMaps are written to (`namespace` first).
    pub publish_namespaces: Vec<String>,
    pub name: String,
    pub shards: u32,
    pub pages: u32,
    pub lease_duration: Duration,
    pub lease_retry: Duration,
    pub node_selector: String,
    pub discovery: Discovery,
    pub agent_service: String,
    pub agent_gone_check: Duration,
    pub agent_port: u16,
    pub nudge_rate: f64,
    pub nudge_selector: String,
    pub remediation: Mode,
    pub taint_key: String,
    pub event_namespace: String,
    pub resource_names: Vec<String>,
    pub eviction_deadline: Duration,
    pub budget: Budget,
    pub breaker_nodes: usize,
    pub breaker_window: Duration,
    pub unknown_tolerance: Duration,
    pub unknown_standdown_share: f64,
    pub device_forget: Duration,
    pub max_evictions_per_minute: f64,
    pub rules: Option<PathBuf>,
    pub out: PathBuf,
    pub listen: SocketAddr,
    pub write_interval: Duration,
    pub urgent_spacing: Duration,
    pub refresh: Duration,
    /// Node-local delivery: the token (read at start), the signing key and the
    /// confirmation period.
    pub delivery: Option<DeliveryConfig>,
    pub replica: String,
    pub log_json: bool,
    /// `--runtime-threads`.
    pub runtime_threads: u16,
    pub release: ReleasePolicy,
    pub reconcile_interval: Duration,
    pub advertise_url: Option<String>,
    pub kube_timeout: Duration,
    /// `--kube-qps` and `--kube-burst`, where a rate is set.
    pub kube_rate: Option<(f64, u32)>,
    pub notify: Vec<Target>,
    pub intake: Option<IntakeConfig>,
    pub watch_pod_health: bool,
    pub shutdown_timeout: Duration,
    pub force_delete_after_deadline: bool,
    pub max_checkpoint_grace: Duration,
    /// The device path.
    pub devices: crate::device_taint::settings::DeviceArgs,
}

/// The mode: the default follows the sink; acting needs the shard Leases.
fn mode(asked: Option<Mode>, sink: SinkKind) -> anyhow::Result<Mode> {
    Ok(match (asked, sink) {
        (None, SinkKind::File) | (Some(Mode::Off), _) => Mode::Off,
        (None, SinkKind::ConfigMap) => Mode::DryRun,
        (Some(m), SinkKind::ConfigMap) => m,
        (Some(_), SinkKind::File) => {
            bail!("--remediation needs --sink configmap: only the holder of a node's shard Lease may act")
        }
    })
}

/// The canary of `--canary-job`, if any.
fn canary(r: &RemediationArgs, namespace: &str) -> anyhow::Result<Option<CanarySpec>> {
    let Some(p) = &r.canary_job else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(p).with_context(|| format!("--canary-job {}", p.display()))?;
    let template: k8s_openapi::api::batch::v1::Job = serde_yaml_ng::from_str(&text)
        .with_context(|| format!("--canary-job {}: not a Job manifest", p.display()))?;
    Ok(Some(CanarySpec {
        template,
        namespace: r
            .canary_namespace
            .clone()
            .unwrap_or_else(|| namespace.to_string()),
        timeout: r.canary_timeout,
    }))
}

/// `--kube-qps` and `--kube-burst`: none at 0, else a finite positive rate and a burst
/// of at least one call.
fn kube_rate(qps: f64, burst: u32) -> anyhow::Result<Option<(f64, u32)>> {
    if qps == 0.0 {
        return Ok(None);
    }
    anyhow::ensure!(
        qps.is_finite() && qps > 0.0,
        "--kube-qps {qps}: a number of calls a second, above 0 (0: no limit)"
    );
    anyhow::ensure!(burst >= 1, "--kube-burst 0: at least one call must go");
    Ok(Some((qps, burst)))
}

fn replica(asked: Option<String>) -> String {
    asked.filter(|s| !s.is_empty()).unwrap_or_else(|| {
        std::env::var("POD_NAME")
            .ok()
            .filter(|s| !s.is_empty())
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .map(|s| names::as_subdomain(&s))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "aggregator".into())
    })
}

/// The names `name` and `replica` make (the member Lease, the last shard's last page),
/// each checked as the API server checks object names.
fn check_names(name: &str, replica: &str, shards: u32, pages: u32) -> anyhow::Result<()> {
    let member = format!("{name}-member-{replica}");
    names::dns_subdomain(&member).map_err(|e| {
        anyhow::anyhow!("--name and --replica make the member Lease name {e}; set --replica")
    })?;
    let page = faultline_common::fault::page_name(name, shards - 1, pages - 1);
    names::dns_subdomain(&page)
        .map_err(|e| anyhow::anyhow!("--name makes the ConfigMap name {e}"))?;
    Ok(())
}

impl Config {
    /// Check the flags.
    pub fn from_args(a: Args) -> anyhow::Result<Self> {
        let (p, s, r, i) = (a.publish, a.shards, a.remediation, a.intake);
        if s.shards == 0 || s.shards > 1024 {
            bail!("--shards must be between 1 and 1024");
        }
        if s.pages == 0 || s.pages > 16 {
            bail!("--pages must be between 1 and 16");
        }
        let replica = replica(s.replica);
        check_names(&p.name, &replica, s.shards, s.pages)?;
        if p.sink == SinkKind::File && s.shards != 1 {
            bail!("--shards applies to --sink configmap; the file sink is one directory");
        }
        if !(0.0..=10_000.0).contains(&p.nudge_rate) {
            bail!("--nudge-rate must be between 0 and 10000 per second");
        }
        let remediation = mode(r.remediation, p.sink)?;
        let delivery = match &a.agents.delivery_token_file {
            Some(path) => Some(DeliveryConfig {
                token: Arc::new({
                    names::read_token(path)
                        .map_err(|e| anyhow::anyhow!("--delivery-token-file {e}"))?;
                    Reloaded::load(path, one_word)
                        .map_err(|e| anyhow::anyhow!("--delivery-token-file {e}"))?
                }),
                signer: match &a.agents.delivery_signing_key_file {
                    Some(p) => Some(Arc::new(
                        Reloaded::load(p, SigningKey::from_pem)
                            .map_err(|e| anyhow::anyhow!("--delivery-signing-key-file {e}"))?,
                    )),
                    None => None,
                },
                confirm: a.agents.delivery_confirm,
            }),
            None => None,
        };
        if i.intake_token_file.is_some() && remediation == Mode::Off {
            bail!("--intake-token-file needs --sink configmap and --remediation dry-run or enforce: alerts are acted on by remediation");
        }
        if r.taint_key.is_empty() || r.taint_key.contains(char::is_whitespace) {
            bail!("--taint-key {:?} is not a taint key", r.taint_key);
        }
        if r.event_namespace != "default" {
            bail!(
                "--event-namespace {:?}: Events about Nodes (cluster-scoped) must live in \"default\"; the API refuses any other namespace with 422",
                r.event_namespace
            );
        }
        if s.lease_retry * 2 >= s.lease_duration {
            bail!("--lease-retry must be well under half of --lease-duration");
        }
        // A write under a budget place goes within half the place's life and lasts at
        // most a hold: the rest must cover the hold and the clocks' skew.
        let most = crate::remediate::policy::PLACE_TTL / 4;
        if s.lease_duration > most {
            bail!("--lease-duration must be at most {most:?}: a budget place outlives the writes made under it");
        }
        if p.urgent_spacing > p.write_interval {
            bail!("--urgent-spacing must not exceed --write-interval");
        }
        let mut publish_namespaces = vec![p.namespace.clone()];
        for ns in comma_list(&p.publish_namespaces) {
            if !publish_namespaces.iter().any(|x| x == ns) {
                publish_namespaces.push(ns.to_string());
            }
        }
        Ok(Config {
            agents: targets::agents(
                &a.agents.agents,
                a.agents.agents_file.as_deref(),
                remediation == Mode::Enforce,
            )?,
            sink: p.sink,
            kube_server: a.kube_server,
            kube_token_file: a.kube_token_file,
            publish_namespaces,
            name: p.name,
            shards: s.shards,
            pages: s.pages,
            lease_duration: s.lease_duration,
            lease_retry: s.lease_retry,
            discovery: a.agents.discovery,
            agent_service: a.agents.agent_service.clone(),
            agent_gone_check: a.agents.agent_gone_check,
            node_selector: a.agents.node_selector.clone(),
            agent_port: a.agents.agent_port,
            nudge_rate: p.nudge_rate,
            nudge_selector: p.nudge_selector,
            remediation,
            resource_names: comma_list(&r.resource_names).map(String::from).collect(),
            eviction_deadline: r.eviction_deadline,
            unknown_tolerance: r.unknown_tolerance,
            unknown_standdown_share: r.unknown_standdown_share.clamp(0.0, 1.0),
            device_forget: r.device_forget,
            breaker_nodes: r.breaker_nodes,
            breaker_window: r.breaker_window,
            max_evictions_per_minute: r.max_evictions_per_minute.max(0.0),
            budget: Budget {
                max_nodes: r.max_quarantined,
                max_percent: r.max_quarantined_percent,
                per_domain: (!r.failure_domain_label.is_empty())
                    .then(|| (r.failure_domain_label.clone(), r.max_quarantined_per_domain)),
                node_selector: a.agents.node_selector.clone(),
                max_unknown: r.max_unknown_tainted,
            },
            rules: a.agents.rules,
            out: p.out,
            listen: a.listen,
            write_interval: p.write_interval,
            urgent_spacing: p.urgent_spacing,
            refresh: p.refresh,
            delivery,
            replica,
            log_json: a.log_format == LogFormat::Json,
            runtime_threads: a.runtime_threads,
            release: ReleasePolicy {
                auto: r.release == ReleaseMode::Auto,
                healthy_samples: r.release_healthy_samples.max(1),
                cooldown: r.release_cooldown,
                canary: canary(&r, &p.namespace)?,
                dedup_window: r.dedup_window,
                expiry: r.quarantine_expiry,
            },
            reconcile_interval: r.reconcile_interval,
            advertise_url: s.advertise_url.filter(|u| !u.is_empty()),
            kube_timeout: a.kube_timeout,
            kube_rate: kube_rate(a.kube_qps, a.kube_burst)?,
            notify: r
                .notify
                .iter()
                .map(|s| s.trim())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().map_err(|e: String| anyhow::anyhow!(e)))
                .collect::<anyhow::Result<_>>()?,
            intake: i.intake_token_file.map(|token_file| IntakeConfig {
                token_file,
                max_bytes: i.intake_max_bytes.max(1024),
                threshold: i.intake_threshold.max(1),
                window: i.intake_window,
                dedup: r.dedup_window,
            }),
            watch_pod_health: r.watch_pod_health,
            force_delete_after_deadline: r.force_delete_after_deadline,
            max_checkpoint_grace: r.max_checkpoint_grace,
            devices: a.devices,
            shutdown_timeout: r.shutdown_timeout,
            taint_key: r.taint_key,
            event_namespace: r.event_namespace,
            namespace: p.namespace,
        })
    }

    /// Parse a command line.
    pub fn parse_from<I, T>(args: I) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Config::from_args(Args::try_parse_from(args)?)
    }
}
