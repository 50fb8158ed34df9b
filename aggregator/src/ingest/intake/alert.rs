//! What an alert is on the wire: seed 000's GPUAlert (one object or a list) and
//! Alertmanager's webhook (version 4), read into one [`Alert`].

use serde::Deserialize;
use serde_json::Value;

/// Seed 000's alert.
#[derive(Debug, Deserialize)]
pub(super) struct GpuAlert {
    #[serde(default)]
    cluster: Option<String>,
    node_name: String,
    #[serde(default)]
    gpu_uuid: Option<String>,
    #[serde(default)]
    bus_id: Option<String>,
    metric: String,
    #[serde(default)]
    value: Option<Value>,
    #[serde(default)]
    time: Option<i64>,
    /// Set by a replica handing the alert over: its occurrence id.
    #[serde(default)]
    occurrence: Option<String>,
    /// "This many are enough" from the sender (also `?threshold=` on the URL).
    #[serde(default)]
    threshold: Option<usize>,
    /// The device as the node's agent names it (`gpu3`), when no UUID or bus id is given.
    #[serde(default)]
    device: Option<String>,
}

/// One alert, whatever format it came in.
#[derive(Debug, Clone)]
pub(super) struct Alert {
    pub(super) node: String,
    pub(super) uuid: Option<String>,
    pub(super) bus_id: Option<String>,
    pub(super) metric: String,
    pub(super) value: Option<String>,
    pub(super) firing: bool,
    /// What makes a re-sent copy the same occurrence (GPUAlert's `time`; Alertmanager's
    /// fingerprint and start within a 30 s slot): counted once within the window.
    pub(super) occurrence: Option<String>,
    /// The sender says this many alerts are enough (at most `--intake-threshold`): an
    /// alert a Prometheus rule already judged (`for:`) needs no second opinion. From
    /// the label `faultline_threshold` or `?threshold=` on the receiver URL.
    pub(super) threshold: Option<usize>,
    /// The device as the node's agent names it (the label `device` of faultline's own
    /// metrics), used when the alert carries no UUID or bus id.
    pub(super) device: Option<String>,
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Why a body is not alerts (a 400, its message the answer's).
#[derive(Debug, thiserror::Error)]
pub enum AlertError {
    /// Not JSON.
    #[error("malformed JSON: {0}")]
    Json(serde_json::Error),
    /// JSON, but not a GPUAlert.
    #[error("not a GPUAlert: {0}")]
    NotGpuAlert(serde_json::Error),
    /// A GPUAlert that names no node.
    #[error("node_name is empty")]
    NoNode,
    /// Neither a GPUAlert, a list of them, nor an Alertmanager webhook.
    #[error("expected a GPUAlert object, a list of them, or an Alertmanager webhook")]
    Shape,
}

/// The alerts of a body, or why it is not one.
pub(super) fn parse(body: &[u8]) -> Result<Vec<Alert>, AlertError> {
    let v: Value = serde_json::from_slice(body).map_err(AlertError::Json)?;
    let gpu = |v: Value| -> Result<Alert, AlertError> {
        let a: GpuAlert = serde_json::from_value(v).map_err(AlertError::NotGpuAlert)?;
        let _ = &a.cluster;
        if a.node_name.trim().is_empty() {
            return Err(AlertError::NoNode);
        }
        Ok(Alert {
            node: a.node_name,
            uuid: a.gpu_uuid.filter(|s| !s.is_empty()),
            bus_id: a.bus_id.filter(|s| !s.is_empty()),
            metric: a.metric,
            value: a.value.as_ref().map(text),
            firing: true,
            occurrence: a.occurrence.or_else(|| a.time.map(|t| t.to_string())),
            threshold: a.threshold,
            device: a.device.filter(|s| !s.is_empty()),
        })
    };
    match v {
        // Alertmanager's webhook (version 4).
        Value::Object(ref o) if o.get("alerts").is_some_and(Value::is_array) => {
            let mut out = Vec::new();
            for a in o["alerts"].as_array().into_iter().flatten() {
                let labels = &a["labels"];
                let label = |keys: &[&str]| {
                    keys.iter()
                        .find_map(|k| labels.get(*k).and_then(Value::as_str))
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                };
                // DCGM exporter's labels first (Hostname, UUID, pci_bus_id), then
                // common relabelings.
                let node = label(&[
                    "node",
                    "node_name",
                    "kubernetes_node",
                    "Hostname",
                    "instance",
                ])
                .map(|n| n.split(':').next().unwrap_or_default().to_string())
                .unwrap_or_default();
                out.push(Alert {
                    node,
                    uuid: label(&["UUID", "gpu_uuid", "uuid"]),
                    bus_id: label(&["pci_bus_id", "bus_id"]),
                    metric: label(&["alertname"]).unwrap_or_else(|| "alert".into()),
                    value: a["annotations"]
                        .get("value")
                        .map(text)
                        .or_else(|| a.get("value").map(text)),
                    firing: a["status"].as_str() != Some("resolved"),
                    // A webhook retry repeats the alert at once; Alertmanager's own
                    // re-sends (group_interval, repeat_interval) come later and say
                    // "still firing": those count (see REPLAY).
                    occurrence: Some(format!(
                        "{AM_PREFIX}{}@{}",
                        a["fingerprint"].as_str().unwrap_or_default(),
                        a["startsAt"].as_str().unwrap_or_default(),
                    )),
                    threshold: label(&["faultline_threshold"]).and_then(|t| t.parse().ok()),
                    device: label(&["device"]),
                });
            }
            Ok(out)
        }
        Value::Array(items) => items.into_iter().map(gpu).collect(),
        obj @ Value::Object(_) => Ok(vec![gpu(obj)?]),
        _ => Err(AlertError::Shape),
    }
}

/// Occurrence ids of Alertmanager alerts start with this.
pub(super) const AM_PREFIX: &str = "am:";
