//! What the tests and benchmarks of every crate share (cargo feature `test-util`, off by
//! default: the workspace turns it on in dev-dependencies and in the benchmarks, never
//! in a release build of the binaries): agent documents built in one line instead of a
//! struct literal ([`node`], [`device`]), the repository root, and a child process that
//! is killed when a test lets go of it.
//!
//! ```
//! use faultline_common::testing::{device, node};
//! use faultline_common::DeviceStatus;
//!
//! let doc = node("n1")
//!     .generation(7)
//!     .devices(4)
//!     .device(device("gpu4").temperature(91.0).failed("xid-79"))
//!     .build();
//! assert_eq!((doc.npus.len(), doc.summary.failed), (5, 1));
//! assert_eq!(doc.npus[4].status, DeviceStatus::Failed);
//! ```

use std::path::{Path, PathBuf};

use crate::classify::Finding;
use crate::document::{DeviceHealth, NodeHealth, SourceStatus, Summary, SCHEMA_VERSION};
use crate::reading::{DeviceReading, DeviceStatus, Vendor};

/// The timestamp of a built document unless [`NodeDoc::timestamp`] says otherwise.
pub const TIMESTAMP: &str = "2026-12-01T00:00:00Z";

/// A node document named `name`: generation 1, agent version `test`, no devices, no
/// sources ([`NodeDoc`] adds them). Its summary counts its devices unless set.
pub fn node(name: &str) -> NodeDoc {
    NodeDoc {
        doc: NodeHealth {
            schema_version: SCHEMA_VERSION.into(),
            generation: 1,
            timestamp: TIMESTAMP.into(),
            node: name.into(),
            agent_version: "test".into(),
            npus: Vec::new(),
            summary: Summary::default(),
            sources: Vec::new(),
            unattributed_xids: Vec::new(),
            drain_acks: Vec::new(),
        },
        summary: None,
    }
}

/// A healthy NVIDIA device `id` read by the `sim` source, nothing else known
/// ([`Device`] fills in readings and verdicts).
pub fn device(id: impl Into<String>) -> Device {
    Device(DeviceHealth {
        reading: DeviceReading::new(id, Vendor::Nvidia, "sim"),
        status: DeviceStatus::Healthy,
        reason: None,
        findings: Vec::new(),
        ecc_errors: None,
        pcie_link_status: None,
        sampled_at: None,
        sample_age_ms: None,
        recent_xids: Vec::new(),
    })
}

/// Device `d` fails for `code` at once: status, reason and one finding, as the agent
/// writes a hard fault (an Xid 79 is `xid-79`).
pub fn mark_failed(d: &mut DeviceHealth, code: &str) {
    mark(d, DeviceStatus::Failed, code);
}

fn mark(d: &mut DeviceHealth, status: DeviceStatus, code: &str) {
    d.status = status;
    d.reason = Some(code.into());
    d.findings = vec![Finding {
        code: code.into(),
        status,
        detail: String::new(),
    }];
}

/// A [`NodeHealth`] being built; [`node`] starts one.
#[derive(Debug, Clone)]
pub struct NodeDoc {
    doc: NodeHealth,
    summary: Option<Summary>,
}

impl NodeDoc {
    /// The document's generation.
    pub fn generation(mut self, generation: u64) -> Self {
        self.doc.generation = generation;
        self
    }

    /// When it was rendered.
    pub fn timestamp(mut self, at: impl Into<String>) -> Self {
        self.doc.timestamp = at.into();
        self
    }

    /// The agent's version.
    pub fn agent_version(mut self, version: &str) -> Self {
        self.doc.agent_version = version.into();
        self
    }

    /// `n` more healthy devices, `gpu<i>` for i from 0 ([`device`]).
    pub fn devices(self, n: usize) -> Self {
        self.devices_with(n, |_, d| d)
    }

    /// `n` more devices `gpu<i>` for i from 0, each [`device`] as `f` makes it.
    pub fn devices_with(mut self, n: usize, mut f: impl FnMut(usize, Device) -> Device) -> Self {
        self.doc
            .npus
            .extend((0..n).map(|i| f(i, device(format!("gpu{i}"))).build()));
        self
    }

    /// One more device.
    pub fn device(mut self, d: impl Into<DeviceHealth>) -> Self {
        self.doc.npus.push(d.into());
        self
    }

    /// More devices.
    pub fn npus(mut self, devices: impl IntoIterator<Item = DeviceHealth>) -> Self {
        self.doc.npus.extend(devices);
        self
    }

    /// A source, `up` or not, that has never failed or hung.
    pub fn source(mut self, name: &str, up: bool) -> Self {
        self.doc.sources.push(SourceStatus {
            name: name.into(),
            up,
            last_success: None,
            last_error: None,
            consecutive_failures: 0,
            abandoned_calls: 0,
        });
        self
    }

    /// This summary instead of the devices' counts (a document that lies, or none).
    pub fn summary(mut self, summary: Summary) -> Self {
        self.summary = Some(summary);
        self
    }

    /// The document.
    pub fn build(mut self) -> NodeHealth {
        self.doc.summary = self.summary.unwrap_or_else(|| Summary::of(&self.doc.npus));
        self.doc
    }
}

impl From<NodeDoc> for NodeHealth {
    fn from(b: NodeDoc) -> Self {
        b.build()
    }
}

/// A [`DeviceHealth`] being built; [`device`] starts one.
#[derive(Debug, Clone)]
pub struct Device(DeviceHealth);

impl Device {
    /// GPU `i` as NVML reads it: id `gpu<i>`, a UUID and a PCI bus id of its own, ECC
    /// errors 0, the PCIe link up.
    pub fn nvml(i: u32) -> Self {
        device(format!("gpu{i}"))
            .source("nvml")
            .uuid(&format!("GPU-5157e000-0000-4000-8000-{i:012x}"))
            .bus_id(&format!("0000:{:02x}:00.0", 0x18 + i * 0x10))
            .ecc_errors(0)
            .pcie("up")
    }

    /// Who made it.
    pub fn vendor(mut self, vendor: Vendor) -> Self {
        self.0.reading.vendor = vendor;
        self
    }

    /// The source that read it.
    pub fn source(mut self, source: &str) -> Self {
        self.0.reading.source = source.into();
        self
    }

    /// Its UUID.
    pub fn uuid(mut self, uuid: &str) -> Self {
        self.0.reading.uuid = Some(uuid.into());
        self
    }

    /// Its PCI bus id.
    pub fn bus_id(mut self, bus_id: &str) -> Self {
        self.0.reading.pci_bus_id = Some(bus_id.into());
        self
    }

    /// Its temperature (°C), or none read.
    pub fn temperature(mut self, celsius: impl Into<Option<f64>>) -> Self {
        self.0.reading.temperature_c = celsius.into();
        self
    }

    /// Its power draw (W).
    pub fn power(mut self, watts: f64) -> Self {
        self.0.reading.power_w = Some(watts);
        self
    }

    /// ECC errors, the seed's single number.
    pub fn ecc_errors(mut self, n: u64) -> Self {
        self.0.ecc_errors = Some(n);
        self
    }

    /// The seed's link field (`up` or `down`).
    pub fn pcie(mut self, status: &str) -> Self {
        self.0.pcie_link_status = Some(status.into());
        self
    }

    /// The reading's age when the document was rendered.
    pub fn sample_age_ms(mut self, ms: u64) -> Self {
        self.0.sample_age_ms = Some(ms);
        self
    }

    /// Any other field of the reading.
    pub fn reading(mut self, f: impl FnOnce(&mut DeviceReading)) -> Self {
        f(&mut self.0.reading);
        self
    }

    /// Its status, reason and findings left as they are.
    pub fn status(mut self, status: DeviceStatus) -> Self {
        self.0.status = status;
        self
    }

    /// Its reason, status and findings left as they are.
    pub fn reason(mut self, reason: Option<String>) -> Self {
        self.0.reason = reason;
        self
    }

    /// Failed for `code` ([`mark_failed`]).
    pub fn failed(mut self, code: &str) -> Self {
        mark_failed(&mut self.0, code);
        self
    }

    /// Degraded for `code`: status, reason and one finding.
    pub fn degraded(mut self, code: &str) -> Self {
        mark(&mut self.0, DeviceStatus::Degraded, code);
        self
    }

    /// The device.
    pub fn build(self) -> DeviceHealth {
        self.0
    }
}

impl From<Device> for DeviceHealth {
    fn from(b: Device) -> Self {
        b.0
    }
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("common/ sits in the repository root")
        .to_path_buf()
}

/// Build the C test double `tests/<src>` as the shared library `name` in `out_dir`
/// (a test binary's `CARGO_TARGET_TMPDIR`): `cc -shared -fPIC`, into a private name
/// first and then renamed, since test binaries may race to build it. Its path.
pub fn build_c_double(src: &str, name: &str, out_dir: &Path) -> PathBuf {
    std::fs::create_dir_all(out_dir).unwrap();
    let out = out_dir.join(name);
    let tmp = out_dir.join(format!("{name}.{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-o"])
        .arg(&tmp)
        .arg(repo_root().join("tests").join(src))
        .arg("-lpthread")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} to build {src}: {e}"));
    assert!(status.success(), "{cc} failed to build {src}");
    std::fs::rename(&tmp, &out).unwrap();
    out
}

/// Whether `tool` runs (`tool args...` starts), for test `test`. Without it the test is
/// skipped with a printed reason, unless `CI` is set: there a missing tool fails the
/// test, because `.ci/run` installs `package`.
pub fn have_tool(test: &str, tool: &str, args: &[&str], package: &str) -> bool {
    let ran = std::process::Command::new(tool)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok();
    if !ran {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: no {tool} on PATH, and CI is set (.ci/run installs {package})"
        );
        eprintln!("SKIPPED {test}: no {tool} on PATH (.ci/run installs {package})");
    }
    ran
}

/// The sum of every series of metric `name` in Prometheus text `text` (its labels
/// aside; `name` whole, so `x` does not count `x_total`): 0 when there is none. What a
/// test waits on instead of a sleep: "two more rounds of polls" is `polls >= before + 2n`.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.as_bytes().first()? {
                b'{' => &rest[rest.rfind('}')? + 1..],
                b' ' => rest,
                _ => return None,
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum()
}

/// A child process killed (and reaped) when dropped: a test that fails half way does
/// not leave it running.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What the seed consumer harness (`tests/consumer/run_consumer.py` with
/// `CONSUMER_TRACE=trace`) did: documents read, and mtime checks since the last read.
/// A read followed by two checks means it judged that document and went on watching:
/// what a "the consumer keeps running" check waits for instead of a sleep.
pub fn consumer_trace(trace: &std::path::Path) -> (usize, usize) {
    let text = std::fs::read_to_string(trace).unwrap_or_default();
    let reads = text.lines().filter(|l| *l == "read").count();
    let since = text
        .lines()
        .rev()
        .take_while(|l| *l != "read")
        .filter(|l| *l == "check")
        .count();
    (reads, since)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metric_sums_its_series_and_no_other_metric() {
        let text = "# HELP x_total polls\n# TYPE x_total counter\n\
            x_total{node=\"a\",result=\"ok\"} 3\nx_total{node=\"b}\"} 4.5\n\
            x_total_other 100\nx 7\nx_total 1\n";
        assert_eq!(metric_sum(text, "x_total"), 8.5);
        assert_eq!(metric_sum(text, "x"), 7.0);
        assert_eq!(metric_sum(text, "y"), 0.0);
    }

    #[test]
    fn a_built_document_counts_its_devices_and_reads_back() {
        let doc = node("n1")
            .devices_with(3, |i, d| if i == 1 { d.degraded("high-temp") } else { d })
            .device(Device::nvml(3).failed("xid-79"))
            .source("nvml", true)
            .build();
        assert_eq!(
            doc.summary,
            Summary {
                total: 4,
                healthy: 2,
                degraded: 1,
                failed: 1,
                unknown: 0
            }
        );
        let gpu3 = &doc.npus[3];
        assert_eq!(gpu3.reading.id, "gpu3");
        assert_eq!(gpu3.reading.pci_bus_id.as_deref(), Some("0000:48:00.0"));
        assert_eq!(gpu3.findings[0].code, "xid-79");
        let back: NodeHealth = serde_json::from_slice(&serde_json::to_vec(&doc).unwrap()).unwrap();
        assert_eq!(back, doc);
        assert_eq!(
            node("n2")
                .devices(2)
                .summary(Summary::default())
                .build()
                .summary,
            Summary::default()
        );
    }
}
