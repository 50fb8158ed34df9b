//! Flags (each also read from `FAULTLINE_<FLAG>`), in groups (agents, publishing,
//! shards, remediation, intake), checked into one [`Config`] in one place. Durations and
//! choices are parsed by clap (`ValueEnum`, [`positive_duration`]), so a bad flag fails
//! at start with a clear message.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args as ClapArgs, Parser, ValueEnum};
pub use faultline_common::flags::positive_duration;
use faultline_common::flags::{comma_list, duration_at_most, FlagError};
use faultline_common::names;

use crate::ingest::IntakeConfig;
use crate::notify::Target;
use crate::remediate::{Budget, CanarySpec, Mode, ReleasePolicy};
use crate::targets;
pub use crate::targets::AgentTarget;

/// `--max-checkpoint-grace`: a duration such as `0` (none), `300s`, `10m`, at most 7 days.
fn grace_duration(v: &str) -> Result<Duration, FlagError> {
    duration_at_most(v, Duration::from_secs(7 * 86_400), "7d")
}

/// `--name`: a DNS-1123 label, since it is both part of object names and the value of
/// the member label (`faultline_common::names`).
fn base_name(v: &str) -> Result<String, FlagError> {
    names::dns_label(v)?;
    Ok(v.to_string())
}

/// `--replica`: a DNS-1123 subdomain (it is part of the member Lease's name).
fn replica_name(v: &str) -> Result<String, FlagError> {
    names::dns_subdomain(v)?;
    Ok(v.to_string())
}

/// Where documents go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SinkKind {
    /// A directory laid out like a ConfigMap volume.
    File,
    /// One ConfigMap per shard, written by the shard's Lease holder.
    #[value(name = "configmap")]
    ConfigMap,
}

/// How quarantines end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReleaseMode {
    /// A person runs `faultline release` (the default, as seed 000 advises for hardware).
    Manual,
    /// Health, cool-down and the canary.
    Auto,
}

/// Where the agents are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Discovery {
    /// The EndpointSlices of the agents' headless Service.
    Endpoints,
    /// Nodes matching --node-selector, at their InternalIP.
    Nodes,
}

/// Log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// faultline aggregator: denoises agents' readings and publishes fault.json.
#[derive(Debug, Parser)]
#[command(name = "faultline-aggregator", version, about)]
pub struct Args {
    #[command(flatten)]
    pub agents: AgentArgs,
    #[command(flatten)]
    pub publish: PublishArgs,
    #[command(flatten)]
    pub shards: ShardArgs,
    #[command(flatten)]
    pub remediation: RemediationArgs,
    #[command(flatten)]
    pub devices: crate::device_taint::settings::DeviceArgs,
    #[command(flatten)]
    pub intake: IntakeArgs,
    /// Kubernetes API server URL (default: in-cluster config, then $KUBECONFIG).
    #[arg(long, env = "FAULTLINE_KUBE_SERVER")]
    pub kube_server: Option<String>,
    /// A file with the bearer token for --kube-server (re-read as it changes; in a cluster
    /// the ServiceAccount's token is used).
    #[arg(long, env = "FAULTLINE_KUBE_TOKEN_FILE")]
    pub kube_token_file: Option<PathBuf>,
    /// Deadline of one Kubernetes API request.
    #[arg(long, env = "FAULTLINE_KUBE_TIMEOUT", default_value = "15s", value_parser = positive_duration)]
    pub kube_timeout: Duration,
    /// Address of the API (health, metrics, /v1/faults).
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = "0.0.0.0:8082")]
    pub listen: SocketAddr,
    /// Log format.
    #[arg(long, env = "FAULTLINE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Threads that run the aggregator's tasks. 1: every task on one thread (tokio's
    /// current-thread scheduler, without work stealing or wake-ups across threads;
    /// 49-57 µs of CPU per agent document, where two workers took 64-71 µs, run
    /// for run on one machine). More: a multi-thread runtime with that many workers,
    /// for a replica given more than one core. Blocking work (files) has its own
    /// threads either way.
    #[arg(long, env = "FAULTLINE_RUNTIME_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub runtime_threads: u16,
}

/// Which agents are followed, and the rules their readings are judged by.
#[derive(Debug, ClapArgs)]
#[command(next_help_heading = "Agents")]
pub struct AgentArgs {
    /// Agents to follow, comma separated: `NODE=URL` (gpu-7=http://10.0.0.7:8081). A bare
    /// URL takes its node from the agent's first answer: the agent says whom it speaks
    /// for, so it is refused with --remediation enforce, and may name no node listed
    /// with its address.
    #[arg(long, env = "FAULTLINE_AGENTS", default_value = "")]
    pub agents: String,
    /// A file listing agents' base URLs, one per line (`#` comments), for lists too long
    /// for a flag.
    #[arg(long, env = "FAULTLINE_AGENTS_FILE")]
    pub agents_file: Option<PathBuf>,
    /// Nodes to follow when no --agents are given (seed: node-role.kubernetes.io/atlas=true).
    #[arg(long, env = "FAULTLINE_NODE_SELECTOR", default_value = "")]
    pub node_selector: String,
    /// Deliver each followed node's published entry to its agent (PUT /v1/fault), which
    /// keeps it as the node's own fault.json; this file holds the token the agents
    /// expect (their --delivery-token-file). Unset: no delivery.
    #[arg(long, env = "FAULTLINE_DELIVERY_TOKEN_FILE")]
    pub delivery_token_file: Option<PathBuf>,
    /// A delivered entry is confirmed this often; an agent not confirmed for three times
    /// this calls its node's verdict stale.
    #[arg(long, env = "FAULTLINE_DELIVERY_CONFIRM", default_value = "10s", value_parser = positive_duration)]
    pub delivery_confirm: Duration,
    /// Where the agents are found when none are listed: `endpoints`, the EndpointSlices
    /// of the agents' headless Service (--agent-service in --namespace; slim, and quiet
    /// in steady state), or `nodes`, every Node matching --node-selector at its
    /// InternalIP (whole Node objects: for small clusters).
    #[arg(
        long,
        env = "FAULTLINE_DISCOVERY",
        value_enum,
        default_value = "endpoints"
    )]
    pub discovery: Discovery,
    /// The agents' headless Service (--discovery endpoints).
    #[arg(
        long,
        env = "FAULTLINE_AGENT_SERVICE",
        default_value = "faultline-agent"
    )]
    pub agent_service: String,
    /// With --discovery endpoints: how long after a node's agent left the agents'
    /// Service (a rollout, a node that stopped answering) its Node is first looked up.
    /// The node stays published, unreachable, meanwhile; it is forgotten once its Node
    /// is gone or no longer matches --node-selector (looked up again every minute).
    #[arg(long, env = "FAULTLINE_AGENT_GONE_CHECK", default_value = "30s", value_parser = positive_duration)]
    pub agent_gone_check: Duration,
    /// Port of the agents on the nodes.
    #[arg(long, env = "FAULTLINE_AGENT_PORT", default_value_t = 8081)]
    pub agent_port: u16,
    /// Rules file (YAML, TOML or JSON), reloaded on change. Default: the seed's rules.
    #[arg(long, env = "FAULTLINE_RULES")]
    pub rules: Option<PathBuf>,
}

/// Where fault.json goes and how often.
#[derive(Debug, ClapArgs)]
#[command(next_help_heading = "Publishing")]
pub struct PublishArgs {
    /// Where fault.json goes: `file` (a directory) or `configmap` (one per shard).
    #[arg(long, env = "FAULTLINE_SINK", value_enum, default_value = "file")]
    pub sink: SinkKind,
    /// Directory of the file sink, laid out like a ConfigMap volume.
    #[arg(long, env = "FAULTLINE_OUT", default_value = "./fault-out")]
    pub out: PathBuf,
    /// Namespace of the shard Leases and ConfigMaps.
    #[arg(long, env = "FAULTLINE_NAMESPACE", default_value = "faultline")]
    pub namespace: String,
    /// Also write the shard ConfigMaps into these namespaces, comma separated: a pod can
    /// only mount ConfigMaps of its own namespace, so list the workloads' namespaces.
    #[arg(long, env = "FAULTLINE_PUBLISH_NAMESPACES", default_value = "")]
    pub publish_namespaces: String,
    /// Base name of Leases and ConfigMaps: `<name>-shard-<i>`; also a label value (a
    /// DNS-1123 label, at most 63 characters).
    #[arg(long, env = "FAULTLINE_NAME", default_value = "faultline", value_parser = base_name)]
    pub name: String,
    /// Least time between two writes of a document (jittered up to +20%).
    #[arg(long, env = "FAULTLINE_WRITE_INTERVAL", default_value = "1s", value_parser = positive_duration)]
    pub write_interval: Duration,
    /// A transition to failed is written this soon after the previous write of its shard
    /// (beside a write of other shards in flight; the file sink: of its one document).
    #[arg(long, env = "FAULTLINE_URGENT_SPACING", default_value = "200ms", value_parser = positive_duration)]
    pub urgent_spacing: Duration,
    /// Each shard's refresh, spread over the period: its pages whose entries moved
    /// without a change of status (readings, an agent's last contact) are rewritten then,
    /// and only then, however often its statuses change; a page whose content did not
    /// change is never rewritten. Liveness is the shard's Lease, not a rewrite.
    #[arg(long, alias = "heartbeat", env = "FAULTLINE_REFRESH", default_value = "30m", value_parser = positive_duration)]
    pub refresh: Duration,
    /// Pods nudged per second after a device on their node turns degraded or failed, so
    /// kubelet refreshes their mounted fault.json at once (0: off).
    #[arg(long, env = "FAULTLINE_NUDGE_RATE", default_value_t = 20.0)]
    pub nudge_rate: f64,
    /// Only nudge pods matching this label selector (default: every running pod).
    #[arg(long, env = "FAULTLINE_NUDGE_SELECTOR", default_value = "")]
    pub nudge_selector: String,
}

/// Shard ownership.
#[derive(Debug, ClapArgs)]
#[command(next_help_heading = "Shards")]
pub struct ShardArgs {
    /// Number of shards (Leases and ConfigMaps); nodes map to shards by a stable hash.
    #[arg(long, env = "FAULTLINE_SHARDS", default_value_t = 1)]
    pub shards: u32,
    /// ConfigMaps per shard (`<name>-shard-<i>`, then `<name>-shard-<i>-page-<p>`): a
    /// ConfigMap holds at most 1 MiB, about 450 nodes of 8 devices; give a shard of more
    /// nodes as many pages as it needs.
    #[arg(long, env = "FAULTLINE_PAGES", default_value_t = 1)]
    pub pages: u32,
    /// How long a shard Lease lasts without renewal.
    #[arg(long, env = "FAULTLINE_LEASE_DURATION", default_value = "15s", value_parser = positive_duration)]
    pub lease_duration: Duration,
    /// How often Leases are renewed or tried.
    #[arg(long, env = "FAULTLINE_LEASE_RETRY", default_value = "2s", value_parser = positive_duration)]
    pub lease_retry: Duration,
    /// This replica's name (default: $POD_NAME, then the hostname); a DNS-1123
    /// subdomain, as it names the member Lease `<name>-member-<replica>`.
    #[arg(long, env = "FAULTLINE_REPLICA", value_parser = replica_name)]
    pub replica: Option<String>,
    /// This replica's API as other replicas reach it (annotated on the shard Leases it
    /// holds, for alert hand-over); default http://$POD_IP:<listen port>, or the listen
    /// address when it is not 0.0.0.0.
    #[arg(long, env = "FAULTLINE_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
}

/// What remediation may do, within which limits, and how it ends.
#[derive(Debug, ClapArgs)]
#[command(next_help_heading = "Remediation")]
pub struct RemediationArgs {
    /// Remediation: off, dry-run (announce what would be done) or enforce. Default:
    /// dry-run with --sink configmap (it needs the shard Leases), off with the file sink.
    #[arg(long, env = "FAULTLINE_REMEDIATION", value_enum)]
    pub remediation: Option<Mode>,
    /// The taint put on a node with a failed accelerator (NoSchedule).
    #[arg(
        long,
        env = "FAULTLINE_TAINT_KEY",
        default_value = "nvidia.com/gpu-fault"
    )]
    pub taint_key: String,
    /// Extended resources that are accelerators, comma separated (default: nvidia.com/gpu
    /// and the Ascend 910/910B/310P/950 resources).
    #[arg(long, env = "FAULTLINE_RESOURCE_NAMES", default_value = "")]
    pub resource_names: String,
    /// How long a PodDisruptionBudget may refuse an eviction before faultline announces it
    /// and leaves the pod.
    #[arg(long, env = "FAULTLINE_EVICTION_DEADLINE", default_value = "10m", value_parser = positive_duration)]
    pub eviction_deadline: Duration,
    /// Past --eviction-deadline, delete a pod whose disruption budget still refuses its
    /// eviction (default: announce it and leave it).
    #[arg(long, env = "FAULTLINE_FORCE_DELETE_AFTER_DEADLINE", default_value = "false", action = clap::ArgAction::Set)]
    pub force_delete_after_deadline: bool,
    /// Nodes quarantined at most at once, cluster-wide.
    #[arg(long, env = "FAULTLINE_MAX_QUARANTINED", default_value_t = 5)]
    pub max_quarantined: usize,
    /// The longest a pod on a failed device may ask to checkpoint before its eviction
    /// (its `faultline.io/checkpoint-grace` annotation, or its namespace's): it is warned
    /// in fault.json and evicted at its acknowledgement or deadline. 0: none is warned.
    #[arg(long, env = "FAULTLINE_MAX_CHECKPOINT_GRACE", default_value = "10m", value_parser = grace_duration)]
    pub max_checkpoint_grace: Duration,
    /// Share of accelerator nodes quarantined at most, in percent (one node always may be).
    #[arg(
        long,
        env = "FAULTLINE_MAX_QUARANTINED_PERCENT",
        default_value_t = 10.0
    )]
    pub max_quarantined_percent: f64,
    /// Node label naming the failure domain (rack, zone) for a per-domain budget.
    #[arg(long, env = "FAULTLINE_FAILURE_DOMAIN_LABEL", default_value = "")]
    pub failure_domain_label: String,
    /// Nodes of one failure domain quarantined at most at once.
    #[arg(
        long,
        env = "FAULTLINE_MAX_QUARANTINED_PER_DOMAIN",
        default_value_t = 2
    )]
    pub max_quarantined_per_domain: usize,
    /// Devices unknown this long may get the node a NoSchedule taint (never an eviction).
    #[arg(long, env = "FAULTLINE_UNKNOWN_TOLERANCE", default_value = "5m", value_parser = positive_duration)]
    pub unknown_tolerance: Duration,
    /// The unknown guard stands down while more than this share (0-1) of the followed
    /// agents are unreachable: then the aggregator is the one cut off, not the nodes.
    #[arg(long, env = "FAULTLINE_UNKNOWN_STANDDOWN_SHARE", default_value_t = 0.2)]
    pub unknown_standdown_share: f64,
    /// Nodes the unknown guard taints at most at once (its own budget, apart from the
    /// quarantine budget).
    #[arg(long, env = "FAULTLINE_MAX_UNKNOWN_TAINTED", default_value_t = 2)]
    pub max_unknown_tainted: usize,
    /// A device its reachable agent has not reported for this long is forgotten: it
    /// left the node (or its id changed), and never counts as unknown.
    #[arg(long, env = "FAULTLINE_DEVICE_FORGET", default_value = "1h", value_parser = positive_duration)]
    pub device_forget: Duration,
    /// Circuit breaker: this many nodes failing within --breaker-window stop all
    /// remediation until a person closes the breaker (0: no breaker).
    #[arg(long, env = "FAULTLINE_BREAKER_NODES", default_value_t = 10)]
    pub breaker_nodes: usize,
    /// The breaker's window.
    #[arg(long, env = "FAULTLINE_BREAKER_WINDOW", default_value = "5m", value_parser = positive_duration)]
    pub breaker_window: Duration,
    /// Evictions per minute at most, cluster-wide per replica (0: no limit).
    #[arg(
        long,
        env = "FAULTLINE_MAX_EVICTIONS_PER_MINUTE",
        default_value_t = 30.0
    )]
    pub max_evictions_per_minute: f64,
    /// Namespace of the Events about Nodes: `default`, the only one the API accepts for a
    /// core/v1 Event about a cluster-scoped object (pkg/apis/core/validation/events.go).
    #[arg(long, env = "FAULTLINE_EVENT_NAMESPACE", default_value = "default")]
    pub event_namespace: String,
    /// How quarantines end: manual (a person runs `faultline release`; the default, as
    /// seed 000 advises for hardware) or auto (health, cool-down, canary).
    #[arg(long, env = "FAULTLINE_RELEASE", value_enum, default_value = "manual")]
    pub release: ReleaseMode,
    /// Auto release: clean samples in a row every device needs.
    #[arg(long, env = "FAULTLINE_RELEASE_HEALTHY_SAMPLES", default_value_t = 30)]
    pub release_healthy_samples: u32,
    /// Auto release: how long every device must have been healthy.
    #[arg(long, env = "FAULTLINE_RELEASE_COOLDOWN", default_value = "10m", value_parser = positive_duration)]
    pub release_cooldown: Duration,
    /// Auto release: a Job manifest (YAML or JSON) run pinned to the node that must
    /// succeed before the release.
    #[arg(long, env = "FAULTLINE_CANARY_JOB")]
    pub canary_job: Option<PathBuf>,
    /// Namespace of the canary Jobs (default: --namespace).
    #[arg(long, env = "FAULTLINE_CANARY_NAMESPACE")]
    pub canary_namespace: Option<String>,
    /// A canary not done by then has failed.
    #[arg(long, env = "FAULTLINE_CANARY_TIMEOUT", default_value = "10m", value_parser = positive_duration)]
    pub canary_timeout: Duration,
    /// The same (node, device, fault) is not acted on twice within it: the intake's
    /// dedup, and how long a person's release holds against a still-failed reading.
    #[arg(long, env = "FAULTLINE_DEDUP_WINDOW", default_value = "15m", value_parser = positive_duration)]
    pub dedup_window: Duration,
    /// A quarantine's expiry: when it is due for review. One that cannot be released
    /// then (still failed, or --release manual) is extended by as much and announced.
    #[arg(long, env = "FAULTLINE_QUARANTINE_EXPIRY", default_value = "24h", value_parser = positive_duration)]
    pub quarantine_expiry: Duration,
    /// How often every quarantined and failed node is looked at again.
    #[arg(long, env = "FAULTLINE_RECONCILE_INTERVAL", default_value = "10s", value_parser = positive_duration)]
    pub reconcile_interval: Duration,
    /// Webhooks told of every action: URL (faultline's JSON) or FORMAT=URL with
    /// FORMAT slack, wecom, dingtalk or feishu; comma separated or repeated.
    #[arg(long, env = "FAULTLINE_NOTIFY", value_delimiter = ',')]
    pub notify: Vec<String>,
    /// Watch every pod's allocatedResourcesStatus (KEP-4680) for Unhealthy devices. Off by
    /// default: it needs the ResourceHealthStatus feature gate (alpha, off by default
    /// through 1.32) and costs a cluster-wide Pod watch.
    #[arg(long, env = "FAULTLINE_WATCH_POD_HEALTH", default_value = "false", action = clap::ArgAction::Set)]
    pub watch_pod_health: bool,
    /// On SIGTERM: how long in-flight remediation may take before the Leases are
    /// released anyway (the next holder finishes from the record).
    #[arg(long, env = "FAULTLINE_SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = positive_duration)]
    pub shutdown_timeout: Duration,
}

/// The alert intake (`POST /v1/alerts`).
#[derive(Debug, ClapArgs)]
#[command(next_help_heading = "Alert intake")]
pub struct IntakeArgs {
    /// Enables POST /v1/alerts: the file with its bearer token (a mounted Secret).
    #[arg(long, env = "FAULTLINE_INTAKE_TOKEN_FILE")]
    pub intake_token_file: Option<PathBuf>,
    /// Largest alert body accepted (bytes).
    #[arg(long, env = "FAULTLINE_INTAKE_MAX_BYTES", default_value_t = 1 << 20)]
    pub intake_max_bytes: usize,
    /// Firing alerts for the same node, device and metric within --intake-window
    /// before the device is judged failed (seed 000, 9.1).
    #[arg(long, env = "FAULTLINE_INTAKE_THRESHOLD", default_value_t = 3)]
    pub intake_threshold: usize,
    /// The intake's counting window.
    #[arg(long, env = "FAULTLINE_INTAKE_WINDOW", default_value = "5m", value_parser = positive_duration)]
    pub intake_window: Duration,
}

/// The checked configuration.
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
    /// Node-local delivery: the token (read at start) and the confirmation period.
    pub delivery: Option<(String, Duration)>,
    pub replica: String,
    pub log_json: bool,
    /// `--runtime-threads`.
    pub runtime_threads: u16,
    pub release: ReleasePolicy,
    pub reconcile_interval: Duration,
    pub advertise_url: Option<String>,
    pub kube_timeout: Duration,
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
            Some(path) => Some((
                names::read_token(path)
                    .map_err(|e| anyhow::anyhow!("--delivery-token-file {e}"))?,
                a.agents.delivery_confirm,
            )),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `--name` and `--replica` become object names and a label value; one the
    /// API server would refuse fails at start, naming the flag.
    #[test]
    fn names_are_checked_as_the_api_server_checks_them() {
        for bad in ["Faultline", "fault_line", "-x", &"a".repeat(64)] {
            assert!(
                Config::parse_from(["a", "--name", bad]).is_err(),
                "--name {bad}"
            );
        }
        for bad in ["R1", "r_1", "r1.", ""] {
            let r = Config::parse_from(["a", "--replica", bad]);
            assert!(bad.is_empty() || r.is_err(), "--replica {bad}");
        }
        let long = "r".repeat(240);
        let err = Config::parse_from(["a", "--replica", &long]).unwrap_err();
        assert!(err.to_string().contains("member Lease"), "{err}");
        let c = Config::parse_from([
            "a",
            "--name",
            "gpu-health",
            "--replica",
            "gpu-health-7d9f.x",
        ])
        .unwrap();
        assert_eq!(
            (c.name.as_str(), c.replica.as_str()),
            ("gpu-health", "gpu-health-7d9f.x")
        );
        // A name not given by flag is made one.
        assert_eq!(names::as_subdomain("My_Host.Example."), "my-host.example");
        assert_eq!(names::as_subdomain("--x--"), "x");
        assert_eq!(
            names::as_subdomain("a._b..c"),
            "a.b.c",
            "no part starts with '-'"
        );
    }

    #[test]
    fn agents_must_be_http_urls() {
        let c = Config::parse_from([
            "a",
            "--agents",
            "http://10.0.0.7:8081/, gpu-2=http://n2:8081",
        ])
        .unwrap();
        let urls: Vec<&str> = c.agents.iter().map(|a| a.url.as_str()).collect();
        assert_eq!(urls, vec!["http://10.0.0.7:8081", "http://n2:8081"]);
        assert_eq!(c.agents[0].node, None);
        assert_eq!(c.agents[1].node.as_deref(), Some("gpu-2"));
        assert!(Config::parse_from(["a", "--agents", "Bad_Name=http://n2:8081"]).is_err());
        for bad in ["10.0.0.7:8081", "https://x:1", "http://"] {
            assert!(Config::parse_from(["a", "--agents", bad]).is_err(), "{bad}");
        }
        // An agent that acts is told whom it follows.
        let enforce = |agents: &str| {
            Config::parse_from([
                "a",
                "--sink",
                "configmap",
                "--remediation",
                "enforce",
                "--agents",
                agents,
            ])
        };
        let e = enforce("gpu-2=http://n2:8081,http://10.0.0.7:8081").unwrap_err();
        assert!(e.to_string().contains("NODE=URL"), "{e}");
        assert!(enforce("gpu-2=http://n2:8081").is_ok());
    }

    #[test]
    fn every_flag_reads_faultline_flag_from_the_environment() {
        use clap::CommandFactory;
        let mut n = 0;
        for arg in Args::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if long == "help" || long == "version" {
                continue;
            }
            let want = format!("FAULTLINE_{}", long.to_uppercase().replace('-', "_"));
            assert_eq!(
                arg.get_env().and_then(|e| e.to_str()),
                Some(want.as_str()),
                "--{long}"
            );
            n += 1;
        }
        assert!(n >= 40, "only {n} flags seen");
    }

    #[test]
    fn durations_and_choices_are_checked_at_start() {
        for (flag, bad) in [
            ("--release-cooldown", "0s"),
            ("--lease-duration", "0"),
            ("--write-interval", "soon"),
            ("--sink", "s3"),
            ("--remediation", "maybe"),
            ("--release", "sometimes"),
            ("--log-format", "xml"),
            ("--runtime-threads", "0"),
        ] {
            let e = Config::parse_from(["a", flag, bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad), "{flag} {bad}: {e}");
        }
        let c = Config::parse_from([
            "a",
            "--sink",
            "configmap",
            "--release",
            "auto",
            "--release-cooldown",
            "90s",
        ])
        .unwrap();
        assert_eq!(
            c.remediation,
            Mode::DryRun,
            "dry-run by default with the ConfigMap sink"
        );
        assert!(c.release.auto);
        assert_eq!(c.release.cooldown, Duration::from_secs(90));
        assert_eq!(Config::parse_from(["a"]).unwrap().remediation, Mode::Off);
        assert!(
            Config::parse_from(["a", "--remediation", "enforce"]).is_err(),
            "acting needs the Leases"
        );
        assert!(Config::parse_from([
            "a",
            "--sink",
            "configmap",
            "--lease-duration",
            "4s",
            "--lease-retry",
            "2s"
        ])
        .is_err());
        // A Node's Events are refused (422) in any other namespace.
        let e = Config::parse_from(["a", "--event-namespace", "faultline"]).unwrap_err();
        assert!(e.to_string().contains("\"default\""), "{e}");
    }
}
