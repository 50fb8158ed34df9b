//! What every source promises: the [`Source`] trait of polled sources, the
//! [`EventSink`] of streaming ones, and [`ProbeError`].

use std::time::Duration;

use faultline_common::{DeviceReading, XidEvent};

/// Why a sample failed. The kind is what callers and metrics branch on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The source cannot start: library missing, driver not loaded, tool not found.
    #[error("source cannot start: {0}")]
    Init(String),
    /// A call did not answer within the timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// A call answered with an error.
    #[error("call failed: {0}")]
    Call(String),
    /// The output could not be understood.
    #[error("unparseable output: {0}")]
    Parse(String),
    /// Too many earlier calls are still hung; no new call was issued.
    #[error("source hung: {0} abandoned call(s) still in flight")]
    Hung(u32),
    /// The call panicked.
    #[error("panicked: {0}")]
    Panic(String),
}

impl ProbeError {
    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ProbeError::Init(_) => "init",
            ProbeError::Timeout(_) => "timeout",
            ProbeError::Call(_) => "call",
            ProbeError::Parse(_) => "parse",
            ProbeError::Hung(_) => "hung",
            ProbeError::Panic(_) => "panic",
        }
    }
}

/// What one sample of a source produced.
#[derive(Debug, Clone, Default)]
pub struct SourceSample {
    /// One reading per device the source sees.
    pub devices: Vec<DeviceReading>,
    /// Xid events found during the sample (sim injects them this way).
    pub events: Vec<XidEvent>,
}

/// A polled source. `sample` is blocking and may hang: the sampler runs it on its own
/// thread, bounds it by the timeout and abandons it if it does not return.
pub trait Source: Send + Sync + 'static {
    /// Name in documents and metrics.
    fn name(&self) -> &'static str;
    /// Take one sample. `timeout` is the caller's bound, for sources that can enforce it
    /// themselves (child processes are killed when it passes).
    fn sample(&self, timeout: Duration) -> Result<SourceSample, ProbeError>;
    /// Whether the first successful reading after start must be discarded (vendor tools
    /// that return incomplete data right after the driver loads).
    fn needs_warm_up(&self) -> bool {
        false
    }
    /// Whether `sample` enforces `timeout` itself (child processes killed at it).
    fn enforces_timeout(&self) -> bool {
        false
    }
    /// Notified when the source wants a sample now, before its interval ends (a fault
    /// event from the vendor library).
    fn wake(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }
}

/// Where streaming sources deliver what they see and their own up/down status. The
/// store implements it; sources never write the store directly.
///
/// A streaming source with a poll of its own (NVML's event thread beside the `nvml`
/// source) only sends [`event`](EventSink::event)s: the sampler reports its status. One
/// without (kmsg) registers itself and reports [`stream_up`](EventSink::stream_up) and
/// [`stream_down`](EventSink::stream_down) as it opens and loses its input.
pub trait EventSink: Send + Sync + 'static {
    /// Declare a streaming source `source`: it appears in the document's `sources[]`,
    /// counts as up until it says otherwise, and does not gate readiness.
    fn register_stream(&self, source: &'static str);
    /// An Xid was seen (duplicates and ignored Xids are dropped by the receiver).
    fn event(&self, event: XidEvent);
    /// `source` is reading its input (again).
    fn stream_up(&self, source: &'static str);
    /// `source` cannot read its input: `err` says why.
    fn stream_down(&self, source: &'static str, err: &ProbeError);
}

/// What is graded across samples and chips, not one reading at a time: MindCluster's
/// escalation rules (`faultCustomization.json`: a code repeated or held too long) and
/// a 950's UB port down.
pub struct AcrossChips {
    rules: std::sync::Arc<faultline_common::ascend_escalation::Escalation>,
    state: std::sync::Mutex<faultline_common::ascend_escalation::Escalator>,
}

impl Default for AcrossChips {
    fn default() -> Self {
        Self::new(std::sync::Arc::new(
            faultline_common::ascend_escalation::Escalation::builtin().clone(),
        ))
    }
}

impl AcrossChips {
    /// With these escalation rules.
    pub fn new(rules: std::sync::Arc<faultline_common::ascend_escalation::Escalation>) -> Self {
        AcrossChips {
            rules,
            state: std::sync::Mutex::default(),
        }
    }

    /// Grade one sample's chips.
    pub(crate) fn apply(&self, chips: &mut [faultline_common::DeviceReading]) {
        use faultline_common::sync::Locked;
        let now_ms = faultline_common::time::now_ms();
        {
            let mut state = self.state.locked();
            for r in chips.iter_mut() {
                if let Some(v) = r.vendor_health.as_mut() {
                    state.apply(&self.rules, &r.id, &mut v.graded, now_ms);
                }
            }
        }
        let n = chips.len();
        let mut graded: Vec<&mut Vec<faultline_common::ascend::GradedCode>> = chips
            .iter_mut()
            .filter_map(|r| r.vendor_health.as_mut().map(|v| &mut v.graded))
            .collect();
        faultline_common::ascend::grade_ub_port_down(&mut graded, n);
    }
}
