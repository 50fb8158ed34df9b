//! A device's status: the one scale every reading, document, window and verdict is
//! judged on. Its own module so that the readings ([`crate::reading`]) and the vendor
//! catalogs ([`crate::ascend`]) both build on it without importing each other.

use serde::{Deserialize, Serialize};

/// The health of one device, as the agent (instantaneous) or the aggregator (smoothed)
/// judges it.
///
/// `Unknown` means "we could not look" (stale reading, probe error, source down). It is
/// never a synonym for broken: remediation must not act on it alone.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceStatus {
    /// Every check we could make passed.
    Healthy,
    /// Usable, but something needs attention (hot, throttled, correctable errors).
    Degraded,
    /// The device must not take work: lost, link down, fatal Xid, uncorrectable memory.
    Failed,
    /// No current evidence either way.
    Unknown,
}

impl DeviceStatus {
    /// The lowercase name used in documents and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceStatus::Healthy => "healthy",
            DeviceStatus::Degraded => "degraded",
            DeviceStatus::Failed => "failed",
            DeviceStatus::Unknown => "unknown",
        }
    }

    /// How bad: healthy 0, unknown 1, degraded 2, failed 3 (the worst decides).
    pub fn severity(self) -> u8 {
        match self {
            DeviceStatus::Healthy => 0,
            DeviceStatus::Unknown => 1,
            DeviceStatus::Degraded => 2,
            DeviceStatus::Failed => 3,
        }
    }
}

/// A status is a metric label (`state`, `status`, `to`) with its four values.
#[cfg(feature = "server")]
impl prometheus_client::encoding::EncodeLabelValue for DeviceStatus {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}
