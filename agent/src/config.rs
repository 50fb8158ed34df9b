//! Command-line flags (each also read from `FAULTLINE_<FLAG>`), checked into one
//! [`Config`] in one place.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use faultline_common::xid::{parse_duration, XidPolicy, XidThreshold};
use faultline_common::Thresholds;

/// The sources the agent can read, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SourceKind {
    /// NVIDIA NVML through nvml-wrapper.
    Nvml,
    /// Huawei DCMI (`libdcmi.so`).
    Dcmi,
    /// Huawei `npu-smi` CLI.
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

    fn parse(s: &str) -> anyhow::Result<Self> {
        Ok(match s.trim() {
            "nvml" => SourceKind::Nvml,
            "dcmi" => SourceKind::Dcmi,
            "npu-smi" | "npusmi" | "npu_smi" => SourceKind::NpuSmi,
            "exec" => SourceKind::Exec,
            "kmsg" => SourceKind::Kmsg,
            "sim" => SourceKind::Sim,
            other => {
                bail!("unknown source {other:?} (expected nvml, dcmi, npu-smi, exec, kmsg, sim)")
            }
        })
    }
}

/// faultline node agent: reads accelerator health and serves it at /v1/health.
#[derive(Debug, Parser)]
#[command(name = "faultline-agent", version, about)]
pub struct Args {
    /// Sources to read, comma separated: nvml, dcmi, npu-smi, exec, kmsg, sim.
    #[arg(long, env = "FAULTLINE_SOURCE", default_value = "nvml,kmsg")]
    pub source: String,
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
    #[arg(long, env = "FAULTLINE_EXEC")]
    pub exec: Option<String>,
    /// Kernel log to follow for Xid lines: /dev/kmsg, a plain file or a FIFO.
    #[arg(long, env = "FAULTLINE_KMSG", default_value = "/dev/kmsg")]
    pub kmsg: PathBuf,
    /// Number of simulated devices (source sim).
    #[arg(long, env = "FAULTLINE_SIM_DEVICES", default_value_t = 8)]
    pub sim_devices: u32,
    /// Vendor the simulated devices pretend to be: nvidia or ascend.
    #[arg(long, env = "FAULTLINE_SIM_VENDOR", default_value = "nvidia")]
    pub sim_vendor: String,
    /// Scenario file: a JSON list of timed fault injections for the sim source.
    #[arg(long, env = "FAULTLINE_SIM_SCENARIO")]
    pub sim_scenario: Option<PathBuf>,
    /// Seed of the simulator's noise (default: from the clock).
    #[arg(long, env = "FAULTLINE_SIM_SEED")]
    pub sim_seed: Option<u64>,
    /// Time between samples of each source.
    #[arg(long, env = "FAULTLINE_INTERVAL", default_value = "1s")]
    pub interval: String,
    /// Bound on each call into a source (FFI call or child process).
    #[arg(long, env = "FAULTLINE_TIMEOUT", default_value = "3s")]
    pub timeout: String,
    /// Retries of a failed call within one sample.
    #[arg(long, env = "FAULTLINE_RETRIES", default_value_t = 2)]
    pub retries: u32,
    /// How long the last good reading is served before the device turns unknown.
    #[arg(long, env = "FAULTLINE_CACHE_TTL", default_value = "30s")]
    pub cache_ttl: String,
    /// Hung calls allowed in flight per source before it stops issuing new ones.
    #[arg(long, env = "FAULTLINE_MAX_ABANDONED", default_value_t = 2)]
    pub max_abandoned: u32,
    /// Address of the HTTP API.
    #[arg(long, env = "FAULTLINE_LISTEN", default_value = "0.0.0.0:8081")]
    pub listen: SocketAddr,
    /// HTTP connections open at most; one more is closed at once.
    #[arg(long, env = "FAULTLINE_HTTP_MAX_CONNECTIONS", default_value_t = 2048)]
    pub http_max_connections: usize,
    /// A request's head must arrive within this.
    #[arg(long, env = "FAULTLINE_HTTP_HEADER_TIMEOUT", default_value = "10s")]
    pub http_header_timeout: String,
    /// A connection with nothing in flight and no bytes for this long is closed.
    #[arg(long, env = "FAULTLINE_HTTP_IDLE_TIMEOUT", default_value = "60s")]
    pub http_idle_timeout: String,
    /// Node name (default: $NODE_NAME from the downward API, then the hostname).
    #[arg(long, env = "FAULTLINE_NODE_NAME")]
    pub node_name: Option<String>,
    /// Also write the node document here, atomically, on every change.
    #[arg(long, env = "FAULTLINE_NODE_FILE")]
    pub node_file: Option<PathBuf>,
    /// Exit when a source cannot start instead of serving unknown and retrying.
    #[arg(long, env = "FAULTLINE_FAIL_ON_INIT_ERROR")]
    pub fail_on_init_error: bool,
    /// Temperature (C) at or above which a device is degraded.
    #[arg(long, env = "FAULTLINE_TEMP_THRESHOLD", default_value_t = 85.0)]
    pub temp_threshold: f64,
    /// Xids to ignore entirely, comma separated (NVIDIA's device plugin ignores 13,31,43,45,68,109).
    #[arg(long, env = "FAULTLINE_XID_IGNORE", default_value = "")]
    pub xid_ignore: String,
    /// Per-Xid thresholds XID=N/WINDOW, comma separated, e.g. "94=2/10m,13=5/1m".
    #[arg(long, env = "FAULTLINE_XID_THRESHOLD", default_value = "")]
    pub xid_threshold: String,
    /// How many fatal Xids within which window fail a device.
    #[arg(long, env = "FAULTLINE_XID_FATAL", default_value = "1/1h")]
    pub xid_fatal: String,
    /// How many restart-app Xids within which window degrade a device.
    #[arg(long, env = "FAULTLINE_XID_RESTART_APP", default_value = "3/10m")]
    pub xid_restart_app: String,
    /// Log format: text or json.
    #[arg(long, env = "FAULTLINE_LOG_FORMAT", default_value = "text")]
    pub log_format: String,
    /// Ascend fault codes graded by the site: lines `CODE LEVEL [STATUS [REASON]]` over
    /// the built-in MindCluster table (common/src/ascend_fault_codes.tsv).
    #[arg(long, env = "FAULTLINE_ASCEND_FAULT_CODES")]
    pub ascend_fault_codes: Option<PathBuf>,
    /// Where the Ascend `davinciN` device nodes are (npu-smi names chips by their
    /// physical id, the N).
    #[arg(long, env = "FAULTLINE_DAVINCI_DIR", default_value = "/dev")]
    pub davinci_dir: PathBuf,
    /// What a RoCE link that is down makes of an Ascend chip: degraded or failed.
    #[arg(long, env = "FAULTLINE_ROCE_LINK_DOWN", default_value = "degraded")]
    pub roce_link_down: String,
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
    pub node_file: Option<PathBuf>,
    pub fail_on_init_error: bool,
    pub thresholds: Thresholds,
    pub xid_policy: XidPolicy,
    pub log_json: bool,
    /// The Ascend fault-code table in force (built-in, with the site's overrides).
    pub fault_codes: std::sync::Arc<faultline_common::ascend::Catalog>,
    pub davinci_dir: PathBuf,
}

fn duration(flag: &str, v: &str) -> anyhow::Result<Duration> {
    match parse_duration(v) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => bail!("--{flag} {v:?}: expected a positive duration such as 500ms, 3s, 1m"),
    }
}

/// Split a command line on whitespace, honouring single and double quotes.
pub fn split_command(s: &str) -> anyhow::Result<Vec<String>> {
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
        bail!("unterminated quote in command {s:?}");
    }
    if has || !cur.is_empty() {
        out.push(cur);
    }
    if out.is_empty() {
        bail!("empty command");
    }
    Ok(out)
}

impl Config {
    /// Check the flags and build the configuration.
    pub fn from_args(a: Args) -> anyhow::Result<Self> {
        let mut sources = Vec::new();
        for s in a.source.split(',').filter(|s| !s.trim().is_empty()) {
            let k = SourceKind::parse(s)?;
            if !sources.contains(&k) {
                sources.push(k);
            }
        }
        if sources.is_empty() {
            bail!("--source names no source");
        }
        let exec = match (&a.exec, sources.contains(&SourceKind::Exec)) {
            (Some(cmd), _) => Some(split_command(cmd).context("--exec")?),
            (None, true) => bail!("--source exec needs --exec \"CMD ARGS\""),
            (None, false) => None,
        };
        let sim_vendor = match a.sim_vendor.as_str() {
            "nvidia" => faultline_common::Vendor::Nvidia,
            "ascend" => faultline_common::Vendor::Ascend,
            v => bail!("--sim-vendor {v:?}: expected nvidia or ascend"),
        };
        if sources.contains(&SourceKind::Sim) && (a.sim_devices == 0 || a.sim_devices > 1024) {
            bail!("--sim-devices must be between 1 and 1024");
        }
        let mut xid_policy = XidPolicy::default();
        for x in a
            .xid_ignore
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            xid_policy.ignore.insert(
                x.parse()
                    .with_context(|| format!("--xid-ignore: {x:?} is not an Xid"))?,
            );
        }
        for item in a
            .xid_threshold
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let (x, t) = item
                .split_once('=')
                .with_context(|| format!("--xid-threshold {item:?}: expected XID=N/WINDOW"))?;
            let x: u32 = x
                .trim()
                .parse()
                .with_context(|| format!("--xid-threshold: {x:?} is not an Xid"))?;
            let t: XidThreshold = t.parse().map_err(anyhow::Error::msg)?;
            xid_policy.thresholds.insert(x, t);
        }
        xid_policy.fatal = a
            .xid_fatal
            .parse()
            .map_err(|e| anyhow::anyhow!("--xid-fatal: {e}"))?;
        xid_policy.restart_app = a
            .xid_restart_app
            .parse()
            .map_err(|e| anyhow::anyhow!("--xid-restart-app: {e}"))?;
        // Keep events at least as long as the longest window that counts them.
        let longest = xid_policy
            .thresholds
            .values()
            .map(|t| t.window)
            .chain([xid_policy.fatal.window, xid_policy.restart_app.window])
            .max()
            .unwrap_or_default();
        xid_policy.retention = xid_policy.retention.max(longest);

        let interval = duration("interval", &a.interval)?;
        let timeout = duration("timeout", &a.timeout)?;
        let cache_ttl = duration("cache-ttl", &a.cache_ttl)?;
        if cache_ttl < interval {
            bail!("--cache-ttl ({cache_ttl:?}) must be at least --interval ({interval:?})");
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
        let log_json = match a.log_format.as_str() {
            "text" => false,
            "json" => true,
            v => bail!("--log-format {v:?}: expected text or json"),
        };
        if !(0.0..=200.0).contains(&a.temp_threshold) {
            bail!(
                "--temp-threshold {} is not a plausible temperature",
                a.temp_threshold
            );
        }
        Ok(Config {
            sources,
            nvml_lib: a.nvml_lib,
            dcmi_lib: a.dcmi_lib,
            npu_smi: a.npu_smi,
            exec,
            kmsg: a.kmsg,
            sim_devices: a.sim_devices,
            sim_vendor,
            sim_scenario: a.sim_scenario,
            sim_seed: a.sim_seed,
            interval,
            timeout,
            retries: a.retries.min(10),
            cache_ttl,
            max_abandoned: a.max_abandoned.max(1),
            listen: a.listen,
            http: faultline_common::server::Limits {
                max_connections: a.http_max_connections.max(1),
                header_timeout: duration("http-header-timeout", &a.http_header_timeout)?,
                idle_timeout: duration("http-idle-timeout", &a.http_idle_timeout)?,
                ..Default::default()
            },
            node_name,
            node_file: a.node_file,
            fail_on_init_error: a.fail_on_init_error,
            thresholds: Thresholds {
                temp_degraded_c: a.temp_threshold,
                roce_down_failed: match a.roce_link_down.as_str() {
                    "degraded" => false,
                    "failed" => true,
                    v => bail!("--roce-link-down {v:?}: expected degraded or failed"),
                },
            },
            davinci_dir: a.davinci_dir.clone(),
            fault_codes: std::sync::Arc::new(match &a.ascend_fault_codes {
                Some(p) => {
                    let text = std::fs::read_to_string(p)
                        .with_context(|| format!("--ascend-fault-codes {}", p.display()))?;
                    faultline_common::ascend::Catalog::with_overrides(&text)
                        .map_err(|e| anyhow::anyhow!("--ascend-fault-codes {}: {e}", p.display()))?
                }
                None => faultline_common::ascend::Catalog::builtin().clone(),
            }),
            xid_policy,
            log_json,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_runnable() {
        let c = Config::parse_from(["faultline-agent"]).unwrap();
        assert_eq!(c.sources, vec![SourceKind::Nvml, SourceKind::Kmsg]);
        assert_eq!(c.interval, Duration::from_secs(1));
        assert_eq!(c.timeout, Duration::from_secs(3));
        assert_eq!(c.retries, 2);
        assert_eq!(c.cache_ttl, Duration::from_secs(30));
        assert_eq!(c.listen.port(), 8081);
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
            let mut full = vec!["faultline-agent"];
            full.extend(args.iter().copied());
            let err = format!("{:#}", Config::parse_from(full).unwrap_err());
            assert!(err.contains(needle), "{args:?}: {err}");
        }
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
        assert!(split_command("\"open").is_err());
        assert!(split_command("   ").is_err());
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
