//! Command-line flags (each also read from `FAULTLINE_<FLAG>`), checked into one
//! [`Config`] in one place. Every value is parsed by clap (`ValueEnum` for choices,
//! value parsers for durations, lists and thresholds), so a bad flag fails at start
//! with clap's message naming it; [`Config::from_args`] only checks flags against each
//! other and reads the fault-code file.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
pub use faultline_common::flags::{comma_list, positive_duration};
use faultline_common::xid::{XidPolicy, XidThreshold};
use faultline_common::Thresholds;

/// Why a flag's value was refused; clap prints it after the flag's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// What both binaries' flags refuse alike (a duration, a name).
    #[error(transparent)]
    Common(#[from] faultline_common::flags::FlagError),
    /// A `--source` entry that names no source.
    #[error("unknown source {0:?} (expected nvml, dcmi, npu-smi, exec, kmsg, sim)")]
    UnknownSource(String),
    /// `--source` with nothing in it.
    #[error("names no source")]
    NoSource,
    /// Not an Xid number.
    #[error("{0:?} is not an Xid")]
    NotAnXid(String),
    /// A `--xid-threshold` entry without `=`.
    #[error("{0:?}: expected XID=N/WINDOW")]
    NotXidThreshold(String),
    /// An `N/WINDOW` threshold refused ([`XidThreshold`]'s own words).
    #[error("{0}")]
    Threshold(String),
    /// Not a temperature a chip could have.
    #[error("{0:?}: expected a temperature from 0 to 200 (C)")]
    Temperature(String),
    /// A quote opened and never closed.
    #[error("unterminated quote in command {0:?}")]
    UnterminatedQuote(String),
    /// Only whitespace.
    #[error("empty command")]
    EmptyCommand,
}

/// The sources the agent can read, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum)]
pub enum SourceKind {
    /// NVIDIA NVML through nvml-wrapper.
    Nvml,
    /// Huawei DCMI (`libdcmi.so`).
    Dcmi,
    /// Huawei `npu-smi` CLI.
    #[value(alias = "npusmi", alias = "npu_smi")]
    NpuSmi,
    /// Any command printing the `npus[]` JSON document.
    Exec,
    /// Kernel log Xid lines.
    Kmsg,
    /// Simulated devices.
    Sim,
}

impl SourceKind {
    /// The name used in flags, documents and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Nvml => "nvml",
            SourceKind::Dcmi => "dcmi",
            SourceKind::NpuSmi => "npu-smi",
            SourceKind::Exec => "exec",
            SourceKind::Kmsg => "kmsg",
            SourceKind::Sim => "sim",
        }
    }
}

/// `--source`: the sources to read, each once, in the order first named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceList(pub Vec<SourceKind>);

/// `--exec`: the program and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecCommand(pub Vec<String>);

/// `--xid-ignore`: the Xids dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XidList(pub BTreeSet<u32>);

/// `--xid-threshold`: per-Xid thresholds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XidThresholds(pub BTreeMap<u32, XidThreshold>);

/// What the simulated devices pretend to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SimVendor {
    /// NVIDIA GPUs.
    Nvidia,
    /// Huawei Ascend NPUs.
    Ascend,
}

/// Log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// What a RoCE link that is down makes of an Ascend chip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoceLinkDown {
    /// Usable, needs attention.
    Degraded,
    /// Takes no work.
    Failed,
}

/// `--source`: comma separated, blanks and repeats skipped, at least one.
pub fn source_list(s: &str) -> Result<SourceList, FlagError> {
    let mut sources = Vec::new();
    for name in comma_list(s) {
        let k = <SourceKind as ValueEnum>::from_str(name, false)
            .map_err(|_| FlagError::UnknownSource(name.into()))?;
        if !sources.contains(&k) {
            sources.push(k);
        }
    }
    if sources.is_empty() {
        return Err(FlagError::NoSource);
    }
    Ok(SourceList(sources))
}

/// `--exec`: split like a shell would, quotes and all.
pub fn exec_command(s: &str) -> Result<ExecCommand, FlagError> {
    split_command(s).map(ExecCommand)
}

/// `--xid-ignore`: comma separated Xids (none when empty).
pub fn xid_list(s: &str) -> Result<XidList, FlagError> {
    comma_list(s)
        .map(|x| x.parse().map_err(|_| FlagError::NotAnXid(x.into())))
        .collect::<Result<_, _>>()
        .map(XidList)
}

/// `--xid-threshold`: comma separated `XID=N/WINDOW` (none when empty).
pub fn xid_thresholds(s: &str) -> Result<XidThresholds, FlagError> {
    let mut out = BTreeMap::new();
    for item in comma_list(s) {
        let (x, t) = item
            .split_once('=')
            .ok_or_else(|| FlagError::NotXidThreshold(item.into()))?;
        let x: u32 = x
            .trim()
            .parse()
            .map_err(|_| FlagError::NotAnXid(x.trim().into()))?;
        out.insert(x, xid_threshold(t)?);
    }
    Ok(XidThresholds(out))
}

/// `N/WINDOW`, e.g. `3/10m`.
pub fn xid_threshold(s: &str) -> Result<XidThreshold, FlagError> {
    s.parse().map_err(FlagError::Threshold)
}

/// A temperature in C a chip could have (0 to 200).
pub fn temperature(s: &str) -> Result<f64, FlagError> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|t| (0.0..=200.0).contains(t))
        .ok_or_else(|| FlagError::Temperature(s.into()))
}

/// faultline node agent: reads accelerator health and serves it at /v1/health.
#[derive(Debug, Parser)]
#[command(name = "faultline-agent", version, about)]
pub struct Args {
    /// Sources to read, comma separated: nvml, dcmi, npu-smi, exec, kmsg, sim.
    #[arg(long, env = "FAULTLINE_SOURCE", default_value = "nvml,kmsg", value_parser = source_list)]
    pub source: SourceList,
    /// Path of libnvidia-ml.so (default: the loader's search for libnvidia-ml.so.1).
    #[arg(long, env = "FAULTLINE_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// Path of Huawei's libdcmi.so.
    #[arg(
        long,
        env = "FAULTLINE_DCMI_LIB",
        default_value = "/usr/local/dcmi/libdcmi.so"
    )]
    pub dcmi_lib: PathBuf,
    /// Path (or name on PATH) of npu-smi.
    #[arg(long, env = "FAULTLINE_NPU_SMI", default_value = "npu-smi")]
    pub npu_smi: String,
    /// Command that prints the npus[] JSON document, e.g. "/opt/site/health --json".
    #[arg(long, env = "FAULTLINE_EXEC", value_parser = exec_command)]
    pub exec: Option<ExecCommand>,
    /// Kernel log to follow for Xid lines: /dev/kmsg, a plain file or a FIFO.
    #[arg(long, env = "FAULTLINE_KMSG", default_value = "/dev/kmsg")]
    pub kmsg: PathBuf,
    /// Let a text log's lines (a syslog file or FIFO, without the kernel's facility) fail
    /// a GPU. Off: their Xids degrade at most, since any process can log a line tagged
    /// `kernel:` to syslog; /dev/kmsg records (and raw records kept in a file) carry
    /// their facility and count in full.
    #[arg(long, env = "FAULTLINE_KMSG_TRUST_TEXT")]
    pub kmsg_trust_text: bool,
    /// Number of simulated devices (source sim), 1 to 1024.
    #[arg(long, env = "FAULTLINE_SIM_DEVICES", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub sim_devices: u32,
    /// Vendor the simulated devices pretend to be: nvidia or ascend.
    #[arg(
        long,
        env = "FAULTLINE_SIM_VENDOR",
        value_enum,
        default_value = "nvidia"
    )]
    pub sim_vendor: SimVendor,
    /// Scenario file: a JSON list of timed fault injections for the sim source.
    #[arg(long, env = "FAULTLINE_SIM_SCENARIO")]
    pub sim_scenario: Option<PathBuf>,
    /// Seed of the simulator's noise (default: from the clock).
    #[arg(long, env = "FAULTLINE_SIM_SEED")]
    pub sim_seed: Option<u64>,
    /// Time between samples of each source.
    #[arg(long, env = "FAULTLINE_INTERVAL", default_value = "1s", value_parser = positive_duration)]
    pub interval: Duration,
    /// Bound on each call into a source (FFI call or child process).
    #[arg(long, env = "FAULTLINE_TIMEOUT", default_value = "3s", value_parser = positive_duration)]
    pub timeout: Duration,
    /// Retries of a failed call within one sample.
    #[arg(long, env = "FAULTLINE_RETRIES", default_value_t = 2)]
    pub retries: u32,
    /// How long the last good reading is served before the device turns unknown.
    #[arg(long, env = "FAULTLINE_CACHE_TTL", default_value = "30s", value_parser = positive_duration)]
    pub cache_ttl: Duration,
    /// Hung calls allowed in flight per source before it stops issuing new ones.
    #[arg(long, env = "FAULTLINE_MAX_ABANDONED", default_value_t = 2)]
    pub max_abandoned: u32,
    /// Address of the HTTP API.
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = "0.0.0.0:8081")]
    pub listen: SocketAddr,
    /// HTTP connections open at most; one more is closed at once.
    #[arg(long, env = "FAULTLINE_HTTP_MAX_CONNECTIONS", default_value_t = 2048)]
    pub http_max_connections: usize,
    /// A request's head must arrive within this of the connection's start or its last
    /// answer; a connection that carried the delivery token waits up to
    /// --http-idle-timeout for its next one.
    #[arg(long, env = "FAULTLINE_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub http_header_timeout: Duration,
    /// A connection with nothing in flight and no bytes for this long is closed.
    #[arg(long, env = "FAULTLINE_HTTP_IDLE_TIMEOUT", default_value = "60s", value_parser = positive_duration)]
    pub http_idle_timeout: Duration,
    /// Node name (default: $NODE_NAME from the downward API, then the hostname).
    #[arg(long, env = "FAULTLINE_NODE_NAME")]
    pub node_name: Option<String>,
    /// Also write the node's health document (what `/v1/health` serves, not the
    /// aggregator's verdict) here, atomically, on every change. (`--node-file`, its
    /// old name, still works.)
    #[arg(long, alias = "node-file", env = "FAULTLINE_HEALTH_FILE")]
    pub health_file: Option<PathBuf>,
    /// Keep the node's own fault.json (the aggregator's verdict with this agent's
    /// readings) in this directory, atomically, for pods that mount it from the host.
    #[arg(long, env = "FAULTLINE_FAULT_DIR")]
    pub fault_dir: Option<PathBuf>,
    /// Also serve GET /v1/fault (and /healthz, nothing else) here, for the node's pods.
    #[arg(long, env = "FAULTLINE_FAULT_LISTEN")]
    pub fault_listen: Option<SocketAddr>,
    /// The token the aggregator presents to set this node's verdict (PUT /v1/fault);
    /// without it no verdict can be set. Read again when it changes.
    #[arg(long, env = "FAULTLINE_DELIVERY_TOKEN_FILE")]
    pub delivery_token_file: Option<PathBuf>,
    /// The aggregator's Ed25519 public key(s) (PEM, as `openssl pkey -pubout` writes;
    /// two during a rotation): every delivery must carry its signature, so that another
    /// node's token cannot set this node's verdict. Read again when it changes.
    #[arg(
        long,
        env = "FAULTLINE_DELIVERY_KEY_FILE",
        requires = "delivery_token_file"
    )]
    pub delivery_key_file: Option<PathBuf>,
    /// Longest a verdict holds without a confirmation from the aggregator; past it the
    /// node's fault.json says stale and its healthy devices unknown.
    #[arg(long, env = "FAULTLINE_VERDICT_STALE_AFTER", default_value = "60s", value_parser = positive_duration)]
    pub verdict_stale_after: Duration,
    /// Exit when a source cannot start instead of serving unknown and retrying.
    #[arg(long, env = "FAULTLINE_FAIL_ON_INIT_ERROR")]
    pub fail_on_init_error: bool,
    /// A temperature change (C) smaller than this is not announced as a new document
    /// (the API and metrics still show it; it goes out with the next refresh).
    #[arg(long, env = "FAULTLINE_TEMP_DEADBAND", default_value_t = 2.0, value_parser = temperature)]
    pub temp_deadband: f64,
    /// A power change smaller than this share (0-1) of the last announced power (and a
    /// watt) is not announced as a new document.
    #[arg(long, env = "FAULTLINE_POWER_DEADBAND", default_value_t = 0.1)]
    pub power_deadband: f64,
    /// Readings that drifted within the deadbands are announced at most this often.
    #[arg(long, env = "FAULTLINE_READINGS_REFRESH", default_value = "60s", value_parser = positive_duration)]
    pub readings_refresh: Duration,
    /// Temperature (C) at or above which a device is degraded.
    #[arg(long, env = "FAULTLINE_TEMP_THRESHOLD", default_value_t = 85.0, value_parser = temperature)]
    pub temp_threshold: f64,
    /// Xids to ignore entirely, comma separated (NVIDIA's device plugin ignores 13,31,43,45,68,109).
    #[arg(long, env = "FAULTLINE_XID_IGNORE", default_value = "", value_parser = xid_list)]
    pub xid_ignore: XidList,
    /// Per-Xid thresholds XID=N/WINDOW, comma separated, e.g. "94=2/10m,13=5/1m".
    #[arg(long, env = "FAULTLINE_XID_THRESHOLD", default_value = "", value_parser = xid_thresholds)]
    pub xid_threshold: XidThresholds,
    /// How many fatal Xids within which window fail a device.
    #[arg(long, env = "FAULTLINE_XID_FATAL", default_value = "1/1h", value_parser = xid_threshold)]
    pub xid_fatal: XidThreshold,
    /// How many restart-app Xids within which window degrade a device.
    #[arg(long, env = "FAULTLINE_XID_RESTART_APP", default_value = "3/10m", value_parser = xid_threshold)]
    pub xid_restart_app: XidThreshold,
    /// Log format: text or json.
    #[arg(long, env = "FAULTLINE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Ascend fault codes graded by the site: lines `CODE LEVEL [STATUS [REASON]]` over
    /// the built-in MindCluster table (common/src/ascend_fault_codes.tsv), and
    /// `LEVEL STATUS [REASON]` lines for every code of a level.
    #[arg(long, env = "FAULTLINE_ASCEND_FAULT_CODES")]
    pub ascend_fault_codes: Option<PathBuf>,
    /// MindCluster's escalation rules as a site writes them (a `faultCustomization.json`:
    /// FaultFrequency, FaultDuration) in place of the device plugin's built-in file.
    #[arg(long, env = "FAULTLINE_ASCEND_FAULT_CUSTOMIZATION")]
    pub ascend_fault_customization: Option<PathBuf>,
    /// Where the Ascend `davinciN` device nodes are (npu-smi names chips by their
    /// physical id, the N).
    #[arg(long, env = "FAULTLINE_DAVINCI_DIR", default_value = "/dev")]
    pub davinci_dir: PathBuf,
    /// What a RoCE link that is down makes of an Ascend chip: degraded or failed.
    #[arg(
        long,
        env = "FAULTLINE_ROCE_LINK_DOWN",
        value_enum,
        default_value = "degraded"
    )]
    pub roce_link_down: RoceLinkDown,
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub sources: Vec<SourceKind>,
    pub nvml_lib: Option<PathBuf>,
    pub dcmi_lib: PathBuf,
    pub npu_smi: String,
    pub exec: Option<Vec<String>>,
    pub kmsg: PathBuf,
    pub kmsg_trust_text: bool,
    pub sim_devices: u32,
    pub sim_vendor: faultline_common::Vendor,
    pub sim_scenario: Option<PathBuf>,
    pub sim_seed: Option<u64>,
    pub interval: Duration,
    pub timeout: Duration,
    pub retries: u32,
    pub cache_ttl: Duration,
    pub max_abandoned: u32,
    pub listen: SocketAddr,
    pub http: faultline_common::server::Limits,
    pub node_name: String,
    pub health_file: Option<PathBuf>,
    pub fault_dir: Option<PathBuf>,
    pub fault_listen: Option<SocketAddr>,
    pub delivery_token_file: Option<PathBuf>,
    pub delivery_key_file: Option<PathBuf>,
    pub verdict_stale_after: Duration,
    pub fail_on_init_error: bool,
    pub thresholds: Thresholds,
    pub deadband: crate::deadband::Deadband,
    pub xid_policy: XidPolicy,
    pub log_json: bool,
    /// The Ascend fault-code table in force (built-in, with the site's overrides).
    pub fault_codes: std::sync::Arc<faultline_common::ascend::Catalog>,
    pub escalation: std::sync::Arc<faultline_common::ascend_escalation::Escalation>,
    pub davinci_dir: PathBuf,
}

/// Split a command line on whitespace, honouring single and double quotes.
pub fn split_command(s: &str) -> Result<Vec<String>, FlagError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut has = false;
    for c in s.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                has = true;
            }
            (None, c) if c.is_whitespace() => {
                if has || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            (None, c) => cur.push(c),
        }
    }
    if quote.is_some() {
        return Err(FlagError::UnterminatedQuote(s.into()));
    }
    if has || !cur.is_empty() {
        out.push(cur);
    }
    if out.is_empty() {
        return Err(FlagError::EmptyCommand);
    }
    Ok(out)
}

impl Config {
    /// Check the flags against each other and build the configuration.
    pub fn from_args(a: Args) -> anyhow::Result<Self> {
        let SourceList(sources) = a.source;
        let exec = match (a.exec, sources.contains(&SourceKind::Exec)) {
            (Some(ExecCommand(argv)), _) => Some(argv),
            (None, true) => bail!("--source exec needs --exec \"CMD ARGS\""),
            (None, false) => None,
        };
        let mut xid_policy = XidPolicy {
            ignore: a.xid_ignore.0,
            thresholds: a.xid_threshold.0,
            fatal: a.xid_fatal,
            restart_app: a.xid_restart_app,
            ..XidPolicy::default()
        };
        // Keep events at least as long as the longest window that counts them.
        let longest = xid_policy
            .thresholds
            .values()
            .map(|t| t.window)
            .chain([xid_policy.fatal.window, xid_policy.restart_app.window])
            .max()
            .unwrap_or_default();
        xid_policy.retention = xid_policy.retention.max(longest);

        if a.cache_ttl < a.interval {
            bail!(
                "--cache-ttl ({:?}) must be at least --interval ({:?})",
                a.cache_ttl,
                a.interval
            );
        }
        let node_name = a
            .node_name
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|s| !s.is_empty()))
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_else(|| "unknown-node".into());
        Ok(Config {
            sources,
            nvml_lib: a.nvml_lib,
            dcmi_lib: a.dcmi_lib,
            npu_smi: a.npu_smi,
            exec,
            kmsg: a.kmsg,
            kmsg_trust_text: a.kmsg_trust_text,
            sim_devices: a.sim_devices,
            sim_vendor: match a.sim_vendor {
                SimVendor::Nvidia => faultline_common::Vendor::Nvidia,
                SimVendor::Ascend => faultline_common::Vendor::Ascend,
            },
            sim_scenario: a.sim_scenario,
            sim_seed: a.sim_seed,
            interval: a.interval,
            timeout: a.timeout,
            retries: a.retries.min(10),
            cache_ttl: a.cache_ttl,
            max_abandoned: a.max_abandoned.max(1),
            listen: a.listen,
            http: faultline_common::server::Limits {
                max_connections: a.http_max_connections.max(1),
                header_timeout: a.http_header_timeout,
                idle_timeout: a.http_idle_timeout,
                ..Default::default()
            },
            node_name,
            health_file: a.health_file,
            fault_dir: a.fault_dir,
            fault_listen: a.fault_listen,
            delivery_token_file: a.delivery_token_file,
            delivery_key_file: a.delivery_key_file,
            verdict_stale_after: a.verdict_stale_after,
            fail_on_init_error: a.fail_on_init_error,
            thresholds: Thresholds {
                temp_degraded_c: a.temp_threshold,
                roce_down_failed: a.roce_link_down == RoceLinkDown::Failed,
            },
            deadband: crate::deadband::Deadband {
                temperature_c: a.temp_deadband.max(0.0),
                power_share: a.power_deadband.clamp(0.0, 1.0),
                refresh: a.readings_refresh,
            },
            davinci_dir: a.davinci_dir,
            fault_codes: std::sync::Arc::new(fault_codes(a.ascend_fault_codes.as_deref())?),
            escalation: std::sync::Arc::new(escalation(a.ascend_fault_customization.as_deref())?),
            xid_policy,
            log_json: a.log_format == LogFormat::Json,
        })
    }

    /// Parse a command line (used by tests and the binary alike).
    pub fn parse_from<I, T>(args: I) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Config::from_args(Args::try_parse_from(args)?)
    }
}

/// The built-in Ascend fault-code table, with the site's file over it.
fn fault_codes(
    path: Option<&std::path::Path>,
) -> anyhow::Result<faultline_common::ascend::Catalog> {
    let Some(p) = path else {
        return Ok(faultline_common::ascend::Catalog::builtin().clone());
    };
    let text = std::fs::read_to_string(p)
        .with_context(|| format!("--ascend-fault-codes {}", p.display()))?;
    faultline_common::ascend::Catalog::with_overrides(&text)
        .map_err(|e| anyhow::anyhow!("--ascend-fault-codes {}: {e}", p.display()))
}

/// MindCluster's escalation rules: the site's file, or the device plugin's.
fn escalation(
    path: Option<&std::path::Path>,
) -> anyhow::Result<faultline_common::ascend_escalation::Escalation> {
    use faultline_common::ascend_escalation::Escalation;
    let Some(p) = path else {
        return Ok(Escalation::builtin().clone());
    };
    let text = std::fs::read_to_string(p)
        .with_context(|| format!("--ascend-fault-customization {}", p.display()))?;
    Escalation::parse(&text)
        .map_err(|e| anyhow::anyhow!("--ascend-fault-customization {}: {e}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> anyhow::Result<Config> {
        Config::parse_from(std::iter::once("faultline-agent").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_are_runnable() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.sources, vec![SourceKind::Nvml, SourceKind::Kmsg]);
        assert_eq!(c.interval, Duration::from_secs(1));
        assert_eq!(c.timeout, Duration::from_secs(3));
        assert_eq!(c.retries, 2);
        assert_eq!(c.cache_ttl, Duration::from_secs(30));
        assert_eq!(c.listen.port(), 8081);
        assert_eq!(c.http.header_timeout, Duration::from_secs(10));
        assert_eq!(c.http.idle_timeout, Duration::from_secs(60));
        assert_eq!(c.http.max_connections, 2048);
        assert_eq!(c.exec, None);
        assert_eq!(c.sim_devices, 8);
        assert_eq!(c.sim_vendor, faultline_common::Vendor::Nvidia);
        assert!(!c.log_json);
        assert_eq!(c.thresholds, Thresholds::default());
        assert_eq!(c.xid_policy, XidPolicy::default());
        assert_eq!(c.dcmi_lib, PathBuf::from("/usr/local/dcmi/libdcmi.so"));
        assert_eq!(c.davinci_dir, PathBuf::from("/dev"));
    }

    #[test]
    fn bad_flags_say_what_is_wrong() {
        for (args, needle) in [
            (vec!["--source", "gpu"], "unknown source"),
            (vec!["--source", "exec"], "--exec"),
            (vec!["--interval", "fast"], "--interval"),
            (vec!["--interval", "2s", "--cache-ttl", "1s"], "--cache-ttl"),
            (vec!["--xid-threshold", "79"], "XID=N/WINDOW"),
            (vec!["--xid-threshold", "79=0/1m"], "at least 1"),
        ] {
            let err = format!("{:#}", parse(&args).unwrap_err());
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    /// A bad value is clap's error, naming the flag and the value, before anything runs.
    #[test]
    fn bad_values_fail_in_clap_naming_the_flag() {
        for (flag, bad, why) in [
            ("--source", "gpu", "unknown source \"gpu\""),
            ("--source", " , ", "names no source"),
            ("--interval", "0s", "must be more than zero"),
            ("--timeout", "0", "must be more than zero"),
            ("--cache-ttl", "soon", "expected a duration"),
            ("--http-header-timeout", "1.5s", "expected a duration"),
            ("--http-idle-timeout", "0ms", "must be more than zero"),
            ("--sim-devices", "0", "1..=1024"),
            ("--sim-devices", "1025", "1..=1024"),
            ("--sim-vendor", "amd", "possible values: nvidia, ascend"),
            ("--log-format", "xml", "possible values: text, json"),
            (
                "--roce-link-down",
                "maybe",
                "possible values: degraded, failed",
            ),
            ("--temp-threshold", "201", "from 0 to 200"),
            ("--temp-threshold", "NaN", "from 0 to 200"),
            ("--xid-ignore", "13,x", "\"x\" is not an Xid"),
            ("--xid-threshold", "x=1/1m", "\"x\" is not an Xid"),
            ("--xid-fatal", "1/1y", "is not a duration"),
            ("--xid-restart-app", "3", "expected N/WINDOW"),
            ("--exec", "\"open", "unterminated quote"),
            ("--exec", "  ", "empty command"),
        ] {
            let err = parse(&[flag, bad]).unwrap_err();
            let clap = err
                .downcast_ref::<clap::Error>()
                .unwrap_or_else(|| panic!("{flag} {bad:?}: not clap's error: {err:#}"));
            use clap::error::ErrorKind::{InvalidValue, ValueValidation};
            assert!(
                matches!(clap.kind(), InvalidValue | ValueValidation),
                "{flag}: {:?}",
                clap.kind()
            );
            let text = clap.to_string();
            assert!(text.contains(flag), "{flag} {bad:?}: {text}");
            assert!(text.contains(why), "{flag} {bad:?}: {text}");
        }
    }

    #[test]
    fn choices_and_lists_parse_as_before() {
        let c = parse(&[
            "--source",
            " sim, npusmi,sim,,npu_smi ,exec",
            "--exec",
            "/opt/x --json 'a b'",
            "--sim-vendor",
            "ascend",
            "--log-format",
            "json",
            "--roce-link-down",
            "failed",
            "--temp-threshold",
            "90.5",
            "--retries",
            "50",
            "--max-abandoned",
            "0",
            "--http-max-connections",
            "0",
        ])
        .unwrap();
        assert_eq!(
            c.sources,
            [SourceKind::Sim, SourceKind::NpuSmi, SourceKind::Exec],
            "blanks skipped, each source once, in the order first named"
        );
        assert_eq!(c.exec.unwrap(), ["/opt/x", "--json", "a b"]);
        assert_eq!(c.sim_vendor, faultline_common::Vendor::Ascend);
        assert!(c.log_json);
        assert_eq!(
            c.thresholds,
            Thresholds {
                temp_degraded_c: 90.5,
                roce_down_failed: true
            }
        );
        assert_eq!(c.retries, 10, "retries are capped");
        assert_eq!(c.max_abandoned, 1, "at least one call may hang");
        assert_eq!(c.http.max_connections, 1);
        let c = parse(&["--interval", "250ms", "--cache-ttl", "2m", "--timeout", "1"]).unwrap();
        assert_eq!(
            (c.interval, c.cache_ttl, c.timeout),
            (
                Duration::from_millis(250),
                Duration::from_secs(120),
                Duration::from_secs(1)
            )
        );
    }

    #[test]
    fn source_names_are_the_flag_names() {
        for k in SourceKind::value_variants() {
            let v = k.to_possible_value().unwrap();
            assert_eq!(v.get_name(), k.as_str());
            assert_eq!(source_list(k.as_str()), Ok(SourceList(vec![*k])));
        }
    }

    #[test]
    fn an_ascend_fault_code_file_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("codes");
        std::fs::write(&good, "8C084E00 SeparateNPU\n").unwrap();
        let c = parse(&["--ascend-fault-codes", good.to_str().unwrap()]).unwrap();
        assert_eq!(
            c.fault_codes.grade(0x8C08_4E00).status,
            faultline_common::DeviceStatus::Failed
        );
        let bad = dir.path().join("bad");
        std::fs::write(&bad, "8C084E00 Broken\n").unwrap();
        let e = format!(
            "{:#}",
            parse(&["--ascend-fault-codes", bad.to_str().unwrap()]).unwrap_err()
        );
        assert!(e.contains("--ascend-fault-codes"), "{e}");
        let missing = dir.path().join("missing");
        assert!(parse(&["--ascend-fault-codes", missing.to_str().unwrap()]).is_err());
    }

    #[test]
    fn xid_flags_build_the_policy() {
        let c = Config::parse_from([
            "a",
            "--xid-ignore",
            "13, 31",
            "--xid-threshold",
            "94=2/10m,79=1/2h",
        ])
        .unwrap();
        assert!(c.xid_policy.ignores(13) && c.xid_policy.ignores(31));
        assert_eq!(c.xid_policy.thresholds[&94].count, 2);
        assert_eq!(c.xid_policy.retention, Duration::from_secs(7200));
    }

    #[test]
    fn commands_split_like_a_shell() {
        assert_eq!(
            split_command(r#"/opt/x --json "a b" 'c'"#).unwrap(),
            vec!["/opt/x", "--json", "a b", "c"]
        );
        assert_eq!(
            split_command("\"open"),
            Err(FlagError::UnterminatedQuote("\"open".into()))
        );
        assert_eq!(split_command("   "), Err(FlagError::EmptyCommand));
        assert_eq!(split_command("a ''"), Ok(vec!["a".into(), String::new()]));
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
        assert!(n >= 8, "only {n} flags seen");
    }
}
