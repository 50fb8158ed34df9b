//! A shard ConfigMap page's body: the index on page 0 and each node's entry, keys the
//! API would refuse left out, and a stable hash of what the page says (readings
//! aside) so that a page whose meaning did not change is not written again.

use faultline_common::fault::{page_of, FaultDocument, NodeFaults, ShardIndex};

use kube::api::ObjectMeta;

use super::file::valid_key;

/// A value of a shard's ConfigMap.
pub(super) enum Value<'a> {
    Index(ShardIndex),
    Node(&'a NodeFaults),
}

impl serde::Serialize for Value<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Index(i) => i.serialize(s),
            Value::Node(n) => n.serialize(s),
        }
    }
}

/// Each key of page `page` of `pages` of a shard with its value, handed to `each`:
/// `fault.json` (the whole shard's index) on page 0, as of `sequence`, and
/// `<node>.json` for each node of the page. The nodes left out: a node whose key the API
/// would refuse (`IsConfigMapKey`:
/// staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go; one bad key fails
/// the whole shard's write with 422).
pub(super) fn page_entries(
    doc: &FaultDocument,
    page: u32,
    pages: u32,
    sequence: u64,
    mut each: impl FnMut(&str, Value<'_>) -> Result<(), serde_json::Error>,
) -> Result<Vec<String>, serde_json::Error> {
    let mut skipped = Vec::new();
    if page == 0 {
        let mut index = ShardIndex::of(doc);
        index.sequence = sequence;
        each("fault.json", Value::Index(index))?;
    }
    for (node, n) in &doc.nodes {
        if page_of(node, doc.shards, pages) != page {
            continue;
        }
        let key = format!("{node}.json");
        if valid_key(&key) {
            each(&key, Value::Node(n))?;
        } else {
            skipped.push(node.clone());
        }
    }
    Ok(skipped)
}

/// A page's ConfigMap as encoded by [`page_body`].
#[derive(Debug)]
pub struct PageBody {
    /// The ConfigMap's JSON.
    pub body: Vec<u8>,
    /// The bytes of its keys and values as the API counts them (unescaped).
    pub bytes: usize,
    /// The nodes left out (their key is not a valid ConfigMap key).
    pub skipped: Vec<String>,
    /// What the page says, without when it was written or its sequence (a
    /// page whose content did not change is not written again): FNV-1a over each key
    /// and value, the index taken without its `timestamp` and `sequence`, each node's
    /// entry without what moves on nearly every document ([`stable_entry`]).
    pub content: u64,
    /// The same over every byte of each node's entry, readings and `last_seen`
    /// included: a page whose `content` is unchanged but whose `full` moved is rewritten
    /// only at the shard's `--refresh`.
    pub full: u64,
}

/// What a node's entry says, for [`PageBody::content`]: its statuses, reasons,
/// counters, links, identities and reachability, not the readings (temperature, power)
/// or when its agent was last heard from. Those move on nearly every document of a
/// real fleet (at 20,000 nodes a status change on one node rewrote every
/// page of its shard, 1.6 MB, for readings nobody asked to see refreshed).
fn stable_entry(n: &NodeFaults, w: &mut Fnv) -> Result<(), serde_json::Error> {
    serde_json::to_writer(
        &mut *w,
        &(
            &n.version,
            &n.timestamp,
            &n.node,
            n.agent.reachable,
            &n.agent.error,
            &n.agent.sources,
            &n.summary,
        ),
    )?;
    for d in &n.npus {
        serde_json::to_writer(
            &mut *w,
            &(
                &d.id,
                &d.status,
                &d.reason,
                &d.since,
                d.ecc_errors,
                &d.pcie_link_status,
                &d.uuid,
                &d.pci_bus_id,
            ),
        )?;
    }
    Ok(())
}

/// FNV-1a folded over what is written through it.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

impl std::io::Write for Fnv {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.add(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The JSON of a `ConfigMap` with `meta` and the keys of page `page` of `pages` of a
/// shard, encoded in one pass: each value is serialized straight into its escaped form
/// in the body (a value serialized to a string, kept in a map and escaped
/// again by the ConfigMap's encoding was two passes over, and a copy of, every byte of
/// a write), with the page's content fingerprint.
pub fn page_body(
    meta: &ObjectMeta,
    doc: &FaultDocument,
    page: u32,
    pages: u32,
    sequence: u64,
) -> Result<PageBody, serde_json::Error> {
    let mut out = Vec::with_capacity(64 << 10);
    out.extend_from_slice(br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":"#);
    serde_json::to_writer(&mut out, meta)?;
    out.extend_from_slice(br#","data":{"#);
    let mut bytes = 0;
    let mut first = true;
    let mut content = Fnv::new();
    let mut full = Fnv::new();
    let skipped = page_entries(doc, page, pages, sequence, |key, value| {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, key)?;
        out.extend_from_slice(b":\"");
        let start = out.len();
        let mut added = 0;
        let formatter = InString { added: &mut added };
        let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
        serde::Serialize::serialize(&value, &mut ser)?;
        bytes += key.len() + out.len() - start - added;
        content.add(key.as_bytes());
        full.add(key.as_bytes());
        match &value {
            // The index without its timestamp and sequence: what it says of the shard.
            Value::Index(i) => {
                serde_json::to_writer(&mut content, &(&i.writer, i.shards, &i.summary, &i.nodes))?;
                full.add(&content.0.to_le_bytes());
            }
            Value::Node(n) => {
                stable_entry(n, &mut content)?;
                full.add(&out[start..]);
            }
        }
        out.push(b'"');
        Ok(())
    })?;
    out.extend_from_slice(b"}}");
    Ok(PageBody {
        body: out,
        bytes,
        skipped,
        content: content.0,
        full: full.0,
    })
}

/// A JSON formatter whose output is already escaped as the content of a JSON string
/// (RFC 8259 §7): its quotation marks and escapes carry one more escape each, and
/// nothing else of JSON's output needs one (serde_json escapes every quotation mark,
/// reverse solidus and control character inside a string; its compact form has no
/// whitespace). So a value is written once, straight into the string, with no second
/// scan. `added` counts the escaping bytes it added.
struct InString<'a> {
    added: &'a mut usize,
}

impl serde_json::ser::Formatter for InString<'_> {
    fn begin_string<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        *self.added += 1;
        w.write_all(b"\\\"")
    }

    fn end_string<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        *self.added += 1;
        w.write_all(b"\\\"")
    }

    fn write_char_escape<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        escape: serde_json::ser::CharEscape,
    ) -> std::io::Result<()> {
        use serde_json::ser::CharEscape::*;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let c = match escape {
            // `\"` and `\\` inside the JSON: each of their two characters escaped.
            Quote => {
                *self.added += 2;
                return w.write_all(b"\\\\\\\"");
            }
            ReverseSolidus => {
                *self.added += 2;
                return w.write_all(b"\\\\\\\\");
            }
            Solidus => b'/',
            Backspace => b'b',
            FormFeed => b'f',
            LineFeed => b'n',
            CarriageReturn => b'r',
            Tab => b't',
            AsciiControl(byte) => {
                *self.added += 1;
                return w.write_all(&[
                    b'\\',
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(byte >> 4)],
                    HEX[usize::from(byte & 0xf)],
                ]);
            }
        };
        *self.added += 1;
        w.write_all(&[b'\\', b'\\', c])
    }
}
