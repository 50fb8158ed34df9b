//! Prometheus metrics of the agent, on one prefixed registry.

use std::sync::atomic::{AtomicU64, Ordering};

use faultline_common::{DeviceHealth, DeviceStatus, XidClass, XidEvent};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    source: String,
    /// An error's `kind()` or `label()`: a name the code gives, never input.
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
    uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    device: String,
    status: DeviceStatus,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    /// The number of an Xid the catalog knows, or `other`.
    xid: String,
    class: &'static str,
    source: &'static str,
    ignored: bool,
}

faultline_common::label_values!(
    /// What a kernel log line was (`result` of `kmsg_lines_total`).
    KmsgLine {
        Xid => "xid",
        FallenOffBus => "fallen-off-bus",
        OtherNvrm => "other-nvrm",
        Other => "other",
        /// A line that claims to be the kernel's and is not (a text log).
        Refused => "refused",
        Malformed => "malformed",
        /// A fatal Xid from a text log, degraded at most (`--kmsg-trust-text`).
        Capped => "capped",
        MalformedRecord => "malformed-record",
        /// The ring buffer overwrote records not read yet.
        Overrun => "overrun",
        TooLong => "too-long",
        NotKernel => "not-kernel",
    }
);

faultline_common::label_values!(
    /// Where a followed kernel log file was read from when opened (`from` of
    /// `kmsg_opens_total`).
    KmsgFrom {
        End => "end",
        Start => "start",
        Resume => "resume",
    }
);

faultline_common::label_values!(
    /// What a vendor fault event says (`assertion` of `fault_events_total`).
    FaultAssertion {
        Recover => "recover",
        Occur => "occur",
        OneOff => "one-off",
        Other => "other",
    }
);

faultline_common::label_values!(
    /// How a source learns of faults (`mode` of `fault_event_mode`).
    FaultEventMode {
        Events => "events",
        Polling => "polling",
    }
);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LineLabels {
    result: KmsgLine,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpenLabels {
    from: KmsgFrom,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    /// The route, or `other`.
    path: &'static str,
    code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultEventLabels {
    source: &'static str,
    assertion: FaultAssertion,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultModeLabels {
    source: &'static str,
    mode: FaultEventMode,
}

/// Every metric the agent exports.
pub struct Metrics {
    registry: Registry,
    /// The HTTP server's connection counts, served with the rest.
    pub server: std::sync::Arc<faultline_common::server::Stats>,
    source_up: Family<SourceLabel, Gauge>,
    sample_seconds: Family<SourceLabel, Histogram>,
    errors: Family<ErrorLabels, Counter>,
    abandoned: Family<SourceLabel, Gauge>,
    abandoned_total: Family<SourceLabel, Counter>,
    temperature: Family<DeviceLabels, Gauge<f64, AtomicU64>>,
    power: Family<DeviceLabels, Gauge<f64, AtomicU64>>,
    ecc: Family<DeviceLabels, Gauge>,
    status: Family<StatusLabels, Gauge>,
    xids: Family<XidLabels, Counter>,
    kmsg_lines: Family<LineLabels, Counter>,
    kmsg_opens: Family<OpenLabels, Counter>,
    fault_events: Family<FaultEventLabels, Counter>,
    fault_event_mode: Family<FaultModeLabels, Gauge>,
    http: Family<HttpLabels, Counter>,
    killed_children: Counter,
    long_polls_shortened: Counter,
    drain_acks: Counter,
    killed_seen: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered under `faultline_agent_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("faultline_agent");
        let server = std::sync::Arc::new(faultline_common::server::Stats::default());
        registry.register_collector(Box::new(server.clone()));
        let m = Metrics {
            server,
            source_up: Family::default(),
            sample_seconds: Family::new_with_constructor(|| {
                Histogram::new([
                    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 3.0, 10.0,
                ])
            }),
            errors: Family::default(),
            abandoned: Family::default(),
            abandoned_total: Family::default(),
            temperature: Family::default(),
            power: Family::default(),
            ecc: Family::default(),
            status: Family::default(),
            xids: Family::default(),
            kmsg_lines: Family::default(),
            kmsg_opens: Family::default(),
            fault_events: Family::default(),
            fault_event_mode: Family::default(),
            http: Family::default(),
            killed_children: Counter::default(),
            long_polls_shortened: Counter::default(),
            drain_acks: Counter::default(),
            killed_seen: AtomicU64::new(0),
            registry: Registry::default(),
        };
        registry.register(
            "source_up",
            "1 when the source's last attempt succeeded",
            m.source_up.clone(),
        );
        registry.register(
            "sample_duration_seconds",
            "Time one successful sample of a source took",
            m.sample_seconds.clone(),
        );
        registry.register(
            "source_errors",
            "Failed samples by source and kind",
            m.errors.clone(),
        );
        registry.register(
            "abandoned_calls",
            "Calls that timed out and have not returned yet",
            m.abandoned.clone(),
        );
        registry.register(
            "abandoned_calls_started",
            "Calls abandoned after their timeout, since start",
            m.abandoned_total.clone(),
        );
        registry.register(
            "long_polls_shortened",
            "Long polls that waited at most a second: too many were open",
            m.long_polls_shortened.clone(),
        );
        registry.register(
            "drain_acks",
            "Drain intents acknowledged by their pods through this agent (refusals: errors_total{source=\"drain-ack\"})",
            m.drain_acks.clone(),
        );
        registry.register(
            "killed_children",
            "Child processes killed at their timeout",
            m.killed_children.clone(),
        );
        registry.register(
            "device_temperature_celsius",
            "Device temperature",
            m.temperature.clone(),
        );
        registry.register("device_power_watts", "Device power draw", m.power.clone());
        registry.register(
            "device_ecc_errors",
            "ECC errors since driver load (corrected + uncorrected)",
            m.ecc.clone(),
        );
        registry.register(
            "device_status",
            "1 for the device's current status, 0 for the others",
            m.status.clone(),
        );
        registry.register("xid_events", "Xid events seen", m.xids.clone());
        registry.register(
            "kmsg_lines",
            "Kernel log lines read, by parse result",
            m.kmsg_lines.clone(),
        );
        registry.register(
            "kmsg_opens",
            "Followed kernel log files opened, by where reading starts (from): end (the first open), start (rotated or truncated), resume",
            m.kmsg_opens.clone(),
        );
        registry.register(
            "fault_events",
            "Vendor fault events received (Ascend DCMI subscription), by assertion",
            m.fault_events.clone(),
        );
        registry.register(
            "fault_event_mode",
            "1 for how a source learns of faults: events (subscribed) or polling (the fallback)",
            m.fault_event_mode.clone(),
        );
        registry.register(
            "http_requests",
            "HTTP requests by path and code",
            m.http.clone(),
        );
        Metrics { registry, ..m }
    }

    /// A vendor fault event arrived (`assertion`: occur, recover, one-off).
    pub fn count_fault_event(&self, source: &'static str, assertion: FaultAssertion) {
        self.fault_events
            .get_or_create(&FaultEventLabels { source, assertion })
            .inc();
    }

    /// How `source` learns of faults now: `events` or `polling`.
    ///
    /// The other mode is zeroed first, so a scrape that sees the new mode at 1 sees the
    /// old one at 0: never both at 1, and never the 1 without its 0 beside it.
    pub fn set_fault_event_mode(&self, source: &'static str, mode: FaultEventMode) {
        let other = match mode {
            FaultEventMode::Events => FaultEventMode::Polling,
            FaultEventMode::Polling => FaultEventMode::Events,
        };
        for (m, v) in [(other, 0), (mode, 1)] {
            self.fault_event_mode
                .get_or_create(&FaultModeLabels { source, mode: m })
                .set(v);
        }
    }

    /// Source up or down.
    pub fn set_source_up(&self, source: &str, up: bool) {
        self.source_up
            .get_or_create(&SourceLabel {
                source: source.into(),
            })
            .set(up as i64);
    }

    /// A successful sample took `secs`.
    pub fn observe_sample(&self, source: &str, secs: f64) {
        self.sample_seconds
            .get_or_create(&SourceLabel {
                source: source.into(),
            })
            .observe(secs);
    }

    /// A failed sample or call.
    pub fn count_error(&self, source: &str, kind: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels {
                source: source.into(),
                kind,
            })
            .inc();
    }

    /// A call was abandoned; `in_flight` are still hung.
    pub fn abandoned(&self, source: &str, started: bool, in_flight: u32) {
        let l = SourceLabel {
            source: source.into(),
        };
        if started {
            self.abandoned_total.get_or_create(&l).inc();
        }
        self.abandoned.get_or_create(&l).set(in_flight as i64);
    }

    /// An Xid was seen. The labels are bucketed: an Xid the catalog knows is
    /// its number, any other is `other`; a source outside the agent's own is `other`,
    /// so no input can grow the metric without bound.
    pub fn count_xid(&self, e: &XidEvent, ignored: bool) {
        let xid = if faultline_common::xid::name_of(e.xid).is_some() {
            e.xid.to_string()
        } else {
            "other".into()
        };
        let source = [
            "kmsg",
            "nvml-event",
            "nvml",
            "dcmi",
            "npu-smi",
            "exec",
            "sim",
        ]
        .into_iter()
        .find(|s| *s == e.source)
        .unwrap_or("other");
        self.xids
            .get_or_create(&XidLabels {
                xid,
                class: match e.class {
                    XidClass::Fatal => "fatal",
                    XidClass::RestartApp => "restartapp",
                    XidClass::Informational => "informational",
                    XidClass::Unknown => "unknown",
                },
                source,
                ignored,
            })
            .inc();
    }

    /// A kernel log line was read: `xid`, `fallen-off-bus`, `other`, `unparsed-nvrm`.
    pub fn count_kmsg_line(&self, result: KmsgLine) {
        self.kmsg_lines.get_or_create(&LineLabels { result }).inc();
    }

    /// A followed kernel log file was opened, reading from `at`: `end`, `start`, `resume`.
    pub fn count_kmsg_open(&self, from: KmsgFrom) {
        self.kmsg_opens.get_or_create(&OpenLabels { from }).inc();
    }

    /// An HTTP request was answered.
    pub fn count_http(&self, path: &'static str, code: u16) {
        self.http.get_or_create(&HttpLabels { path, code }).inc();
    }

    /// Refresh per-device gauges from a rendered document.
    pub fn observe_devices(&self, devices: &[DeviceHealth]) {
        for d in devices {
            let l = DeviceLabels {
                device: d.reading.id.clone(),
                uuid: d.reading.uuid.clone().unwrap_or_default(),
            };
            if let Some(t) = d.reading.temperature_c {
                self.temperature.get_or_create(&l).set(t);
            }
            if let Some(p) = d.reading.power_w {
                self.power.get_or_create(&l).set(p);
            }
            if let Some(e) = d.ecc_errors {
                self.ecc.get_or_create(&l).set(e as i64);
            }
            for s in [
                DeviceStatus::Healthy,
                DeviceStatus::Degraded,
                DeviceStatus::Failed,
                DeviceStatus::Unknown,
            ] {
                self.status
                    .get_or_create(&StatusLabels {
                        device: d.reading.id.clone(),
                        status: s,
                    })
                    .set((d.status == s) as i64);
            }
        }
    }

    /// A long poll past the waiter cap: it waits at most a second.
    pub fn long_poll_shortened(&self) {
        self.long_polls_shortened.inc();
    }

    /// A pod acknowledged its drain intent.
    pub fn drain_acked(&self) {
        self.drain_acks.inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let killed = crate::reaper::KILLED_CHILDREN.load(Ordering::Relaxed);
        let seen = self.killed_seen.swap(killed, Ordering::Relaxed);
        if killed > seen {
            self.killed_children.inc_by(killed - seen);
        }
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::xid::{class_of, XidEvent};

    /// Xid metric labels are bucketed, whatever a line or a tool says.
    #[test]
    fn xid_labels_are_bucketed() {
        let m = Metrics::new();
        for (xid, source) in [
            (79, "kmsg"),
            (4_000_000_000, "kmsg"),
            (79, "made-up"),
            (123_456, "x"),
        ] {
            m.count_xid(
                &XidEvent {
                    xid,
                    class: class_of(xid),
                    pci_bus_id: None,
                    at_ms: 0,
                    source: source.into(),
                    message: String::new(),
                },
                false,
            );
        }
        let text = m.encode();
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("faultline_agent_xid_events_total{"))
            .collect();
        assert!(
            series
                .iter()
                .all(|l| !l.contains("4000000000") && !l.contains("made-up")),
            "{series:?}"
        );
        assert!(text.contains("xid=\"79\""), "{text}");
        assert!(text.contains("xid=\"other\""), "{text}");
        assert!(series.len() <= 4, "{series:?}");
    }
}
