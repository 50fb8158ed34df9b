//! The flags as clap reads them: the groups (agents, publishing, shards, remediation,
//! intake), their choices, and the value parsers that refuse a bad value at start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args as ClapArgs, Parser, ValueEnum};
pub use faultline_common::flags::positive_duration;
use faultline_common::flags::{duration_at_most, FlagError};
use faultline_common::names;

use crate::remediate::Mode;
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
    /// Kubernetes API calls a second at most, as client-go's QPS: a token bucket shared
    /// by this replica's calls and watches. 0: no limit of its own (API Priority and
    /// Fairness on the server still applies).
    #[arg(long, env = "FAULTLINE_KUBE_QPS", default_value_t = 0.0)]
    pub kube_qps: f64,
    /// Calls that may go at once above --kube-qps, as client-go's burst.
    #[arg(long, env = "FAULTLINE_KUBE_BURST", default_value_t = 10)]
    pub kube_burst: u32,
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
    /// Sign every delivery with this Ed25519 private key (PEM, as `openssl genpkey
    /// -algorithm ed25519` writes), whose public key the agents hold
    /// (--delivery-key-file): the token is every node's, the key only this. Read again
    /// when it changes.
    #[arg(
        long,
        env = "FAULTLINE_DELIVERY_SIGNING_KEY_FILE",
        requires = "delivery_token_file"
    )]
    pub delivery_signing_key_file: Option<PathBuf>,
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
