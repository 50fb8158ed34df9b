//! Devices in words and in a label: the devices label's value, a message's list of
//! devices, and the devices a request names.

use crate::model::RecordDevice;

/// The devices label's value: the ids joined by dots when that is a valid label value
/// (63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends), else the count and
/// a hash (a bus id has colons, two UUIDs are too long); the record has the details.
pub fn label_value<S: AsRef<str>>(ids: &[S]) -> String {
    let joined = ids.iter().map(|s| s.as_ref()).collect::<Vec<_>>().join(".");
    let valid = !joined.is_empty()
        && joined.len() <= 63
        && joined
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        && joined.starts_with(|c: char| c.is_ascii_alphanumeric())
        && joined.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        joined
    } else {
        format!(
            "{}-devices-{:08x}",
            ids.len(),
            faultline_common::fault::fnv1a64(joined.as_bytes()) & 0xffff_ffff
        )
    }
}

/// Devices for a message: id, UUID, bus id, reason, source and metric=value.
pub fn describe(devices: &[RecordDevice]) -> String {
    devices
        .iter()
        .map(|d| {
            let ids: Vec<&str> = [d.uuid.as_deref(), d.pci_bus_id.as_deref()]
                .into_iter()
                .flatten()
                .collect();
            let mut s = d.id.clone();
            if !ids.is_empty() {
                s.push_str(&format!(" ({})", ids.join(", ")));
            }
            s.push_str(&format!(" {}", d.reason));
            if let Some(src) = &d.source {
                s.push_str(&format!(" via {src}"));
            }
            if let (Some(m), Some(v)) = (&d.metric, &d.value) {
                s.push_str(&format!(" [{m}={v}]"));
            }
            s
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `named` when a request named devices, else `all`.
pub fn named_or_all(named: &[RecordDevice], all: &[RecordDevice]) -> Vec<RecordDevice> {
    if named.is_empty() {
        all.to_vec()
    } else {
        named.to_vec()
    }
}
