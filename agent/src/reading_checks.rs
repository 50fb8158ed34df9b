//! What the store refuses of a reading before it keeps it: values no sensor reads, and
//! a reading that carries nothing at all.

use faultline_common::DeviceReading;

/// Drop a temperature or power no sensor reads (a driver's "invalid" marker such as
/// 0xFFFF, or garbage): the aggregator refuses a document carrying one, so it
/// would cost the node its every reading. Whether anything was dropped.
pub(crate) fn out_of_range(r: &mut DeviceReading) -> bool {
    use faultline_common::document::limits::{POWER_W, TEMPERATURE_C};
    let mut dropped = false;
    for (v, (lo, hi)) in [
        (&mut r.temperature_c, TEMPERATURE_C),
        (&mut r.power_w, POWER_W),
    ] {
        if v.is_some_and(|x| !(lo..=hi).contains(&x)) {
            *v = None;
            dropped = true;
        }
    }
    dropped
}

/// Whether a reading carries nothing: the store keeps the last good one instead.
pub(crate) fn empty(r: &DeviceReading) -> bool {
    r.temperature_c.is_none()
        && r.power_w.is_none()
        && r.ecc.is_none()
        && r.pcie.is_none()
        && r.vendor_health.is_none()
        && r.reported_status.is_none()
        && !r.lost
}
