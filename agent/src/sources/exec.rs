//! `exec`: run any command that prints the `npus[]` JSON document.
//!
//! This is where seed 003's `hdc health -j` idea lives, as a documented contract for
//! site-specific tools (there is no such `hdc` command on Ascend). The command prints
//! either `{"node": "...", "npus": [...]}` or a bare `[...]`; each entry needs `id` and
//! may carry `status` (healthy|degraded|failed|unknown), `reason`, `temperature_c`,
//! `power_w`, `ecc_errors`, `pcie_link_status` (up|down), `uuid`, `pci_bus_id`, `name`,
//! `vendor` (nvidia|ascend). Unknown fields are ignored so tools can add their own.

use std::time::Duration;

use faultline_common::{
    normalize_bus_id, DeviceReading, DeviceStatus, EccCounts, PcieLink, Vendor,
};
use serde::Deserialize;

use super::{process, ProbeError, Source, SourceSample};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Document {
    Wrapped { npus: Vec<Entry> },
    Bare(Vec<Entry>),
}

#[derive(Debug, Deserialize)]
struct Entry {
    id: serde_json::Value,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    temperature_c: Option<f64>,
    #[serde(default)]
    power_w: Option<f64>,
    #[serde(default)]
    ecc_errors: Option<u64>,
    #[serde(default)]
    pcie_link_status: Option<String>,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    pci_bus_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    vendor: Option<String>,
}

/// Parse the tool's output into readings.
pub fn parse(text: &str) -> Result<Vec<DeviceReading>, ProbeError> {
    let doc: Document = serde_json::from_str(text.trim())
        .map_err(|e| ProbeError::Parse(format!("not an npus[] document: {e}")))?;
    let entries = match doc {
        Document::Wrapped { npus } => npus,
        Document::Bare(v) => v,
    };
    let mut out = Vec::with_capacity(entries.len());
    for (i, e) in entries.into_iter().enumerate() {
        let id = match &e.id {
            serde_json::Value::String(s) if !s.trim().is_empty() => s.trim().to_string(),
            serde_json::Value::Number(n) => format!("npu{n}"),
            other => {
                return Err(ProbeError::Parse(format!(
                    "npus[{i}].id: expected a name, got {other}"
                )))
            }
        };
        if out.iter().any(|r: &DeviceReading| r.id == id) {
            return Err(ProbeError::Parse(format!(
                "npus[{i}].id {id:?} appears twice"
            )));
        }
        let vendor = match e.vendor.as_deref() {
            Some("nvidia") => Vendor::Nvidia,
            Some("ascend") => Vendor::Ascend,
            _ => Vendor::Other,
        };
        let mut r = DeviceReading::new(id, vendor, "exec");
        r.reported_status = match e.status.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None => None,
            Some("healthy" | "ok") => Some(DeviceStatus::Healthy),
            Some("degraded" | "warning") => Some(DeviceStatus::Degraded),
            Some("failed" | "critical") => Some(DeviceStatus::Failed),
            Some("unknown") => Some(DeviceStatus::Unknown),
            Some(s) => {
                return Err(ProbeError::Parse(format!(
                    "npus[{i}].status {s:?} is not a status"
                )))
            }
        };
        r.reported_reason = e.reason.filter(|s| !s.is_empty());
        r.temperature_c = e.temperature_c.filter(|t| t.is_finite());
        r.power_w = e.power_w.filter(|p| p.is_finite());
        // The contract has one ECC number; we count it as corrected errors since the
        // tool does not say which kind (an uncorrectable one would come with a status).
        r.ecc = e.ecc_errors.map(|n| EccCounts {
            volatile_corrected: n,
            ..Default::default()
        });
        r.pcie = match e.pcie_link_status.as_deref() {
            None => None,
            Some("up") => Some(PcieLink {
                up: true,
                ..Default::default()
            }),
            Some("down") => Some(PcieLink {
                up: false,
                ..Default::default()
            }),
            Some(s) => {
                return Err(ProbeError::Parse(format!(
                    "npus[{i}].pcie_link_status {s:?}: expected up or down"
                )))
            }
        };
        r.uuid = e.uuid;
        r.pci_bus_id = e.pci_bus_id.as_deref().and_then(normalize_bus_id);
        r.name = e.name;
        out.push(r);
    }
    Ok(out)
}

/// Runs the configured command every sample.
pub struct ExecSource {
    argv: Vec<String>,
}

impl ExecSource {
    /// `argv[0]` is the program.
    pub fn new(argv: Vec<String>) -> Self {
        ExecSource { argv }
    }
}

impl Source for ExecSource {
    fn name(&self) -> &'static str {
        "exec"
    }

    fn sample(&self, timeout: Duration) -> Result<SourceSample, ProbeError> {
        let out = process::run(&self.argv, timeout)?;
        Ok(SourceSample {
            devices: parse(&out)?,
            events: vec![],
        })
    }

    fn enforces_timeout(&self) -> bool {
        true
    }

    fn needs_warm_up(&self) -> bool {
        // Vendor tools can return incomplete data right after the driver loads (seed
        // 003, 5.2); the first reading is thrown away.
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED_DOC: &str = r#"{"version":"2.1","timestamp":"2024-06-15T08:23:45.123Z","node":"atlas900-node-042",
      "npus":[{"id":"npu0","status":"healthy","temperature_c":62.4,"power_w":285.7,"ecc_errors":0,"pcie_link_status":"up"},
              {"id":"npu1","status":"degraded","temperature_c":89.2,"power_w":312.5,"ecc_errors":3,"pcie_link_status":"up","reason":"high-temp"}],
      "summary":{"total":8,"healthy":6,"degraded":1,"failed":1}}"#;

    #[test]
    fn parses_the_seed_document() {
        let r = parse(SEED_DOC).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].id, "npu1");
        assert_eq!(r[1].reported_status, Some(DeviceStatus::Degraded));
        assert_eq!(r[1].reported_reason.as_deref(), Some("high-temp"));
        assert_eq!(r[1].temperature_c, Some(89.2));
        assert_eq!(r[1].ecc.unwrap().volatile_total(), 3);
        assert!(r[0].pcie.unwrap().up);
    }

    #[test]
    fn a_bare_array_and_numeric_ids_work() {
        let r = parse(r#"[{"id": 3, "pcie_link_status": "down", "pci_bus_id": "0000:C1:00.0"}]"#)
            .unwrap();
        assert_eq!(r[0].id, "npu3");
        assert!(!r[0].pcie.unwrap().up);
        assert_eq!(r[0].pci_bus_id.as_deref(), Some("0000:c1:00.0"));
    }

    #[test]
    fn malformed_documents_are_parse_errors() {
        for bad in [
            "",
            "not json",
            r#"{"npus": [{"id": "npu0"}"#,
            r#"{"devices": []}"#,
            r#"[{"status": "healthy"}]"#,
            r#"[{"id": "npu0", "status": "on fire"}]"#,
            r#"[{"id": "npu0"}, {"id": "npu0"}]"#,
            r#"[{"id": "npu0", "pcie_link_status": "sideways"}]"#,
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.kind(), "parse", "{bad}: {e}");
        }
    }
}
