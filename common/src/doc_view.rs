//! The agent's document read in place, for the aggregator's hot path: borrowed views of
//! the fields it judges (no copy of a string it does not keep), and the bounds every
//! document must keep before anything reads it further.

use std::borrow::Cow;

use serde::Deserialize;

use crate::reading::DeviceStatus;

/// The devices of a document, read into one allocation: serde's `Vec` grows from
/// nothing (JSON gives no length), and a device entry is over 600 bytes, so a node of 8
/// was three allocations and two copies per document. For [`NodeHealth`](crate::NodeHealth)'s
/// owned devices and [`DocView`]'s borrowed ones alike.
pub(crate) fn devices<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Devices<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Devices<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of devices")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(8).min(limits::DEVICES));
            while let Some(x) = seq.next_element()? {
                v.push(x);
            }
            Ok(v)
        }
    }
    d.deserialize_seq(Devices(std::marker::PhantomData))
}

/// An optional text, borrowed from the bytes wherever it needs no unescaping. serde's
/// `borrow` reaches a `Cow<str>` field but not one inside an `Option`: there it always
/// copies (three allocations and frees per device of every document).
fn opt_text<'de, D>(d: D) -> Result<Option<Cow<'de, str>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    /// One string, borrowed when it can be.
    struct Text;
    impl<'de> serde::de::Visitor<'de> for Text {
        type Value = Cow<'de, str>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Cow::Borrowed(v))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Cow::Owned(v.to_owned()))
        }
        fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok(Cow::Owned(v))
        }
    }
    /// The string, or none for null.
    struct OptText;
    impl<'de> serde::de::Visitor<'de> for OptText {
        type Value = Option<Cow<'de, str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string or null")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_str(Text).map(Some)
        }
    }
    d.deserialize_option(OptText)
}

/// A node document as the aggregator reads it: what it judges and publishes, the texts
/// borrowed from the bytes received wherever they need no unescaping (reading
/// the whole [`NodeHealth`] into owned values, and freeing them, was the larger part of
/// a replica's CPU per document). The fields a [`NodeHealth`] must have are required
/// here too; what the aggregator does not read is skipped unread (the document as a
/// whole is bounded by the reader).
#[derive(Debug, Deserialize)]
pub struct DocView<'a> {
    #[serde(rename = "schema_version")]
    _schema_version: serde::de::IgnoredAny,
    /// [`NodeHealth::generation`].
    pub generation: u64,
    #[serde(rename = "timestamp")]
    _timestamp: serde::de::IgnoredAny,
    /// [`NodeHealth::node`].
    #[serde(borrow)]
    pub node: Cow<'a, str>,
    #[serde(rename = "agent_version")]
    _agent_version: serde::de::IgnoredAny,
    /// [`NodeHealth::npus`].
    #[serde(borrow, deserialize_with = "devices")]
    pub npus: Vec<DeviceView<'a>>,
    #[serde(rename = "summary")]
    _summary: serde::de::IgnoredAny,
    /// [`NodeHealth::sources`].
    #[serde(borrow)]
    pub sources: Vec<SourceView<'a>>,
    /// [`NodeHealth::drain_acks`]: the UIDs only.
    #[serde(borrow, default)]
    pub drain_acks: Vec<AckView<'a>>,
}

/// An acknowledgement as the aggregator reads it.
#[derive(Debug, Deserialize)]
pub struct AckView<'a> {
    /// The pod's UID.
    #[serde(borrow)]
    pub uid: Cow<'a, str>,
    /// The acknowledged intent's `requested`.
    #[serde(borrow)]
    pub requested: Cow<'a, str>,
    #[serde(rename = "at")]
    _at: serde::de::IgnoredAny,
}

/// A device entry as the aggregator reads it ([`DeviceHealth`]'s fields of the same
/// names).
#[derive(Debug, Deserialize)]
pub struct DeviceView<'a> {
    /// Device id on the node.
    #[serde(borrow)]
    pub id: Cow<'a, str>,
    /// Who made it.
    pub vendor: crate::reading::Vendor,
    /// The source that read it.
    #[serde(borrow)]
    pub source: Cow<'a, str>,
    /// Device UUID.
    #[serde(borrow, default, deserialize_with = "opt_text")]
    pub uuid: Option<Cow<'a, str>>,
    /// PCI bus id.
    #[serde(borrow, default, deserialize_with = "opt_text")]
    pub pci_bus_id: Option<Cow<'a, str>>,
    /// Temperature (C).
    #[serde(default)]
    pub temperature_c: Option<f64>,
    /// Power (W).
    #[serde(default)]
    pub power_w: Option<f64>,
    /// ECC counters.
    #[serde(default)]
    pub ecc: Option<crate::reading::EccCounts>,
    /// The agent's instantaneous status.
    pub status: DeviceStatus,
    /// The findings behind it.
    #[serde(borrow, default)]
    pub findings: Vec<FindingView<'a>>,
    /// ECC errors since driver load.
    #[serde(default)]
    pub ecc_errors: Option<u64>,
    /// `up` or `down`.
    #[serde(borrow, default, deserialize_with = "opt_text")]
    pub pcie_link_status: Option<Cow<'a, str>>,
    /// NVML's recovery action; a name this build does not know reads as none (a newer
    /// agent's: the document is not refused for it).
    #[serde(default, deserialize_with = "known_action")]
    pub recovery_action: Option<crate::reading::RecoveryAction>,
    /// An Ascend chip's physical id (`ascend.phy_id`), where the agent learned it: only
    /// then is the number in its id (`npu<physical id>`) known to be that id (npu-smi
    /// names a chip by its card until then). Anything else reads as none.
    #[serde(default, rename = "ascend", deserialize_with = "ascend_phy_id")]
    pub ascend_phy_id: Option<u32>,
}

/// `ascend.phy_id` of a device entry, `None` when absent or not a chip number.
fn ascend_phy_id<'de, D>(d: D) -> Result<Option<u32>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let v: Option<serde_json::Value> = serde::Deserialize::deserialize(d)?;
    Ok(v.as_ref()
        .and_then(|v| v.get("phy_id"))
        .and_then(serde_json::Value::as_u64)
        .and_then(|p| u32::try_from(p).ok()))
}

/// A recovery action by its name; `None` for null or a name this build does not know.
fn known_action<'de, D>(d: D) -> Result<Option<crate::reading::RecoveryAction>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let name = opt_text(d)?;
    Ok(name.and_then(|n| crate::reading::RecoveryAction::named(&n)))
}

/// A finding as the aggregator reads it.
#[derive(Debug, Deserialize)]
pub struct FindingView<'a> {
    /// Its code.
    #[serde(borrow)]
    pub code: Cow<'a, str>,
    /// What it makes of the device.
    pub status: DeviceStatus,
    /// Its detail.
    #[serde(borrow)]
    pub detail: Cow<'a, str>,
}

/// A source as the aggregator reads it.
#[derive(Debug, Deserialize)]
pub struct SourceView<'a> {
    /// Its name.
    #[serde(borrow)]
    pub name: Cow<'a, str>,
    /// Its last attempt succeeded.
    pub up: bool,
    #[serde(rename = "consecutive_failures")]
    _consecutive_failures: u32,
    #[serde(rename = "abandoned_calls")]
    _abandoned_calls: u32,
}

/// Why an agent's document was refused, with the label its count carries.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DocError {
    /// Not UTF-8, or not a node document.
    #[error("{0}")]
    Malformed(String),
    /// No node name.
    #[error("no node name")]
    NoNode,
    /// A text longer than its limit.
    #[error("{what} is {len} bytes (at most {max})")]
    TooLong {
        /// Which text.
        what: &'static str,
        /// Its length.
        len: usize,
        /// Its limit.
        max: usize,
    },
    /// A reading outside what a device could report.
    #[error("{what} {value} is outside [{lo}, {hi}]")]
    OutOfRange {
        /// Which reading.
        what: &'static str,
        /// The value sent.
        value: f64,
        /// The lowest taken.
        lo: f64,
        /// The highest taken.
        hi: f64,
    },
    /// More items than the limit.
    #[error("{n} {what} (at most {max})")]
    TooMany {
        /// Which items.
        what: &'static str,
        /// How many.
        n: usize,
        /// The limit.
        max: usize,
    },
}

impl DocError {
    /// The metric label of this refusal.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DocError::Malformed(_) => "malformed",
            DocError::NoNode => "no-node",
            DocError::TooLong { .. } => "too-long",
            DocError::OutOfRange { .. } => "out-of-range",
            DocError::TooMany { .. } => "too-many",
        }
    }
}

impl<'a> DocView<'a> {
    /// Read a document's bytes.
    pub fn parse(body: &'a [u8]) -> Result<Self, DocError> {
        // One UTF-8 check of the whole body, not one per string.
        let text = std::str::from_utf8(body).map_err(|e| DocError::Malformed(e.to_string()))?;
        serde_json::from_str(text).map_err(|e| DocError::Malformed(e.to_string()))
    }

    /// Whether what is read is within [`limits`]; the first limit it breaks (the same
    /// the one check of an agent's document: the aggregator's gate, `admit_raw`, calls it;
    /// what the aggregator does not read is skipped unread, within the reader's bound on
    /// the whole document).
    pub fn check_bounds(&self) -> Result<(), DocError> {
        if self.node.is_empty() {
            return Err(DocError::NoNode);
        }
        len("node", &self.node, limits::NODE_NAME)?;
        count("devices", self.npus.len(), limits::DEVICES)?;
        count("sources", self.sources.len(), limits::SOURCES)?;
        for s in &self.sources {
            len("source name", &s.name, limits::ID)?;
        }
        count(
            "drain acknowledgements",
            self.drain_acks.len(),
            limits::DRAIN_ACKS,
        )?;
        for a in &self.drain_acks {
            len("acknowledged pod uid", &a.uid, limits::ID)?;
            len("acknowledged intent time", &a.requested, limits::ID)?;
        }
        for d in &self.npus {
            len("device id", &d.id, limits::ID)?;
            len("device uuid", d.uuid.as_deref().unwrap_or(""), limits::ID)?;
            len(
                "device bus id",
                d.pci_bus_id.as_deref().unwrap_or(""),
                limits::ID,
            )?;
            len("device source", &d.source, limits::ID)?;
            len(
                "device link status",
                d.pcie_link_status.as_deref().unwrap_or(""),
                limits::ID,
            )?;
            within("temperature_c", d.temperature_c, limits::TEMPERATURE_C)?;
            within("power_w", d.power_w, limits::POWER_W)?;
            count("findings", d.findings.len(), limits::FINDINGS)?;
            for f in &d.findings {
                len("finding code", &f.code, limits::ID)?;
                len("finding detail", &f.detail, limits::TEXT)?;
            }
        }
        Ok(())
    }
}

/// A text within `max` bytes, or what breaks the limit.
fn len(what: &'static str, v: &str, max: usize) -> Result<(), DocError> {
    if v.len() > max {
        Err(DocError::TooLong {
            what,
            len: v.len(),
            max,
        })
    } else {
        Ok(())
    }
}

/// A reading within `range` (or absent), or what breaks it (values were
/// published as sent, ±1e300 C included).
fn within(what: &'static str, v: Option<f64>, range: (f64, f64)) -> Result<(), DocError> {
    match v {
        Some(x) if !(range.0..=range.1).contains(&x) => Err(DocError::OutOfRange {
            what,
            value: x,
            lo: range.0,
            hi: range.1,
        }),
        _ => Ok(()),
    }
}

/// At most `max` items, or what breaks the limit.
fn count(what: &'static str, n: usize, max: usize) -> Result<(), DocError> {
    if n > max {
        Err(DocError::TooMany { what, n, max })
    } else {
        Ok(())
    }
}

/// What an aggregator accepts from an agent. A real agent is far inside every limit;
/// a document outside one comes from a broken or hostile sender and is refused whole.
pub mod limits {
    /// Devices on one node.
    pub const DEVICES: usize = 512;
    /// A node name (a DNS-1123 subdomain).
    pub const NODE_NAME: usize = 253;
    /// A device id, UUID, bus id, source or reason code.
    pub const ID: usize = 128;
    /// Free text: a finding's detail, a source's error, a device's name.
    pub const TEXT: usize = 4096;
    /// Findings of one device.
    pub const FINDINGS: usize = 64;
    /// Xid events of one device, or unattributed on the node.
    pub const XIDS: usize = 256;
    /// Sources of one agent.
    pub const SOURCES: usize = 32;
    /// Vendor error codes of one device (DCMI returns at most 128).
    pub const CODES: usize = 128;
    /// Drain acknowledgements of one node (the agent keeps 64).
    pub const DRAIN_ACKS: usize = 64;
    /// A device temperature in C: no sensor of a working or dying accelerator reads
    /// outside this (a die past ~125 C shuts down; cold plates stay above freezing).
    pub const TEMPERATURE_C: (f64, f64) = (-40.0, 200.0);
    /// A device's power draw in W (an NVL72 tray is ~1.2 kW per GPU at most).
    pub const POWER_W: (f64, f64) = (0.0, 5_000.0);
}
