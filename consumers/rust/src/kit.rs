//! The kit itself: reading and following a node's entry from a file, a directory or
//! the agent's pod port, the verdict's staleness, and a pod's acknowledgement of its
//! drain intent.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use notify::{RecursiveMode, Watcher};
use serde::Deserialize;

/// A device's status. Anything this version does not know reads as `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Every check passed.
    Healthy,
    /// Usable, needs attention.
    Degraded,
    /// Must not take work.
    Failed,
    /// No current evidence either way (never a synonym for broken).
    #[serde(other)]
    Unknown,
}

impl Status {
    /// `healthy`, `degraded`, `failed`, `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Healthy => "healthy",
            Status::Degraded => "degraded",
            Status::Failed => "failed",
            Status::Unknown => "unknown",
        }
    }
}

/// One device of the node.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Device {
    /// Its id on the node (`gpu3`, `npu0`).
    pub id: String,
    /// Its status.
    pub status: Status,
    /// Why it is not healthy.
    #[serde(default)]
    pub reason: Option<String>,
    /// UUID, where known.
    #[serde(default)]
    pub uuid: Option<String>,
    /// PCI bus id, where known.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
}

impl Device {
    /// Whether `name` is its id, UUID or bus id.
    pub fn is(&self, name: &str) -> bool {
        self.id == name
            || self.uuid.as_deref() == Some(name)
            || self.pci_bus_id.as_deref() == Some(name)
    }
}

#[derive(Debug, Clone, Deserialize)]
struct Reach {
    #[serde(default = "yes")]
    reachable: bool,
}

fn yes() -> bool {
    true
}

/// Why a node's verdict is not to be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// Not confirmed within its `stale_after_s` (`verdict-stale`).
    Unconfirmed,
    /// No verdict received yet (`no-verdict`).
    NoVerdict,
}

impl Stale {
    /// `verdict-stale`, `no-verdict`: the reason printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Stale::Unconfirmed => STALE_REASON,
            Stale::NoVerdict => "no-verdict",
        }
    }
}

/// The reason of a device whose healthy verdict is no longer confirmed.
pub const STALE_REASON: &str = "verdict-stale";

/// How long after the agent would have said so itself a verdict is judged stale by its
/// age: a running agent rewrites the file when its verdict turns stale.
pub const STALE_GRACE: Duration = Duration::from_secs(5);

/// One node's entry: the node's own `fault.json`, the aggregator's `<node>.json` or the
/// agent's `--health-file` (all list `npus`; other fields are ignored, so newer documents
/// still read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The node it describes.
    pub node: String,
    /// Its devices (those asked for, when the watch names some).
    pub devices: Vec<Device>,
    /// Whether the aggregator reached the agent (always true in the agent's own file).
    pub reachable: bool,
    /// `None`, or why the verdict is not to be trusted (only the node's own
    /// `fault.json` has a verdict; a shard ConfigMap's entry is never stale here).
    pub stale: Option<Stale>,
    /// Pods of the node asked to checkpoint before their eviction.
    pub drains: Vec<Drain>,
}

/// A pod asked to checkpoint before its eviction from a failed device: evicted at
/// `evict_after` at the latest, at once when it acknowledges.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Drain {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID (the downward API's `metadata.uid`).
    pub uid: String,
    /// The failed devices it uses.
    #[serde(default)]
    pub devices: Vec<String>,
    /// Why (`xid-79`).
    #[serde(default)]
    pub reason: Option<String>,
    /// When it is evicted at the latest (RFC 3339).
    pub evict_after: String,
    /// When faultline got its acknowledgement (RFC 3339).
    #[serde(default)]
    pub acknowledged: Option<String>,
}

impl Entry {
    /// The drain intent of pod `uid`, if the node's entry has one.
    pub fn drain_for(&self, uid: &str) -> Option<&Drain> {
        self.drains.iter().find(|d| !uid.is_empty() && d.uid == uid)
    }

    /// The failed devices.
    pub fn failed(&self) -> Vec<&Device> {
        self.devices
            .iter()
            .filter(|d| d.status == Status::Failed)
            .collect()
    }
}

#[derive(Debug, Deserialize)]
struct Doc {
    node: String,
    npus: Vec<Device>,
    #[serde(default)]
    agent: Option<Reach>,
    #[serde(default)]
    verdict: Option<Verdict>,
    #[serde(default)]
    drain: Vec<Drain>,
}

#[derive(Debug, Deserialize)]
struct Verdict {
    #[serde(default)]
    writer: Option<String>,
    #[serde(default)]
    confirmed: Option<String>,
    #[serde(default)]
    stale: bool,
    #[serde(default)]
    stale_after_s: Option<u64>,
}

impl Verdict {
    /// Stale at `now_ms`: as the agent says, or by the confirmation's age.
    fn stale(&self, now_ms: u64) -> Option<Stale> {
        let aged = || {
            let at = parse_rfc3339_ms(self.confirmed.as_deref()?)?;
            let holds = Duration::from_secs(self.stale_after_s?) + STALE_GRACE;
            Some(now_ms > at.saturating_add(holds.as_millis() as u64))
        };
        let why = match self.writer {
            Some(_) => Stale::Unconfirmed,
            None => Stale::NoVerdict,
        };
        (self.stale || aged() == Some(true)).then_some(why)
    }
}

/// Milliseconds since the epoch of an RFC 3339 time (`Z` or `+HH:MM`, any fraction of a
/// second); `None` when it does not parse, names a leap second (:60, which Go's
/// time.Parse refuses too) or is before 1970.
pub fn parse_rfc3339_ms(at: &str) -> Option<u64> {
    let b = at.as_bytes();
    let num = |r: std::ops::Range<usize>| num_of(at.get(r)?);
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days_in = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1..=12).contains(&mo)
        || d < 1
        || d > days_in[(mo - 1) as usize]
        || h > 23
        || mi > 59
        || sec > 59
    {
        return None;
    }
    let mut rest = &at[19..];
    let mut frac_ms = 0i64;
    if let Some(f) = rest.strip_prefix('.') {
        let digits = f.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let ms = format!("{:0<3}", &f[..digits.min(3)]);
        frac_ms = ms.parse().ok()?;
        rest = &f[digits..];
    }
    let offset_s = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6 && rest.as_bytes()[3] == b':' => {
            let sign = match rest.as_bytes()[0] {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let (oh, om) = (num_of(rest.get(1..3)?)?, num_of(rest.get(4..6)?)?);
            if oh > 23 || om > 59 {
                return None;
            }
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    // Days from 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset_s;
    u64::try_from(secs * 1000 + frac_ms).ok()
}

/// Digits only (no sign, no space), as a number.
fn num_of(t: &str) -> Option<i64> {
    t.bytes()
        .all(|c| c.is_ascii_digit())
        .then(|| t.parse().ok())?
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What can go wrong.
#[derive(Debug)]
pub enum Error {
    /// Reading the file or watching its directory.
    Io(std::io::Error),
    /// Not a node document, or another node's.
    Invalid(String),
    /// The directory watch could not start.
    Watch(notify::Error),
    /// The agent refused an acknowledgement (its status and answer).
    Refused(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(e) => write!(f, "{e}"),
            Error::Invalid(e) => write!(f, "not a node document: {e}"),
            Error::Watch(e) => write!(f, "cannot watch: {e}"),
            Error::Refused(e) => write!(f, "acknowledgement refused: {e}"),
        }
    }
}

impl std::error::Error for Error {}

/// Parse a node document; `node`: refuse another node's; `only`: keep these devices.
/// The verdict's age is judged on the clock ([`parse_at`] takes the time).
pub fn parse(text: &[u8], node: Option<&str>, only: &[String]) -> Result<Entry, Error> {
    parse_at(text, node, only, now_ms())
}

/// [`parse`], judging the verdict's age at `now_ms` (milliseconds since the epoch).
pub fn parse_at(
    text: &[u8],
    node: Option<&str>,
    only: &[String],
    now_ms: u64,
) -> Result<Entry, Error> {
    let doc: Doc = serde_json::from_slice(text).map_err(|e| Error::Invalid(e.to_string()))?;
    if let Some(n) = node.filter(|n| *n != doc.node) {
        return Err(Error::Invalid(format!(
            "document of node {:?}, not {n:?}",
            doc.node
        )));
    }
    let stale = doc.verdict.as_ref().and_then(|v| v.stale(now_ms));
    Ok(Entry {
        node: doc.node,
        devices: doc
            .npus
            .into_iter()
            .filter(|d| only.is_empty() || only.iter().any(|o| d.is(o)))
            .map(|mut d| {
                // As the agent writes a stale verdict (it may not be running to do so).
                if stale.is_some() && d.status == Status::Healthy {
                    d.status = Status::Unknown;
                    d.reason = Some(STALE_REASON.into());
                }
                d
            })
            .collect(),
        reachable: doc.agent.is_none_or(|a| a.reachable),
        stale,
        drains: doc.drain,
    })
}

/// Tell the node's agent (`http://HOST:PORT`, its `--fault-listen`) that pod `uid` has
/// checkpointed: it is evicted now instead of at its deadline. Must run in that pod
/// (the agent takes it only from the pod's own address). `Ok` when taken (again);
/// [`Error::Refused`] with the agent's answer (403: not from the pod's address; 404: no
/// intent for it); [`Error::Io`] when the agent cannot be reached in `timeout`.
pub fn acknowledge(agent: &str, uid: &str, timeout: Duration) -> Result<(), Error> {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let host = agent
        .strip_prefix("http://")
        .map(|h| h.trim_end_matches('/'))
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .ok_or_else(|| Error::Invalid(format!("{agent}: the agent's http://HOST:PORT")))?;
    let addr = host
        .to_socket_addrs()
        .map_err(Error::Io)?
        .next()
        .ok_or_else(|| Error::Invalid(format!("{host}: no address")))?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).map_err(Error::Io)?;
    s.set_read_timeout(Some(timeout)).map_err(Error::Io)?;
    s.set_write_timeout(Some(timeout)).map_err(Error::Io)?;
    let body = serde_json::json!({ "uid": uid }).to_string();
    write!(
        s,
        "POST /v1/drain/ack HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(Error::Io)?;
    let mut answer = Vec::new();
    s.take(64 * 1024)
        .read_to_end(&mut answer)
        .map_err(Error::Io)?;
    let answer = String::from_utf8_lossy(&answer);
    let status = answer.split(' ').nth(1).unwrap_or_default();
    match status {
        "200" | "202" => Ok(()),
        _ => Err(Error::Refused(format!(
            "HTTP {status}: {}",
            answer.rsplit("\r\n\r\n").next().unwrap_or_default()
        ))),
    }
}

/// The entry at `path` now; `None` when there is none (the node is not published).
pub fn read(path: &Path, node: Option<&str>, only: &[String]) -> Result<Option<Entry>, Error> {
    match std::fs::read(path) {
        Ok(text) => parse(&text, node, only).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Io(e)),
    }
}

/// A watch of one node's entry.
pub struct Watch {
    path: PathBuf,
    node: Option<String>,
    only: Vec<String>,
    events: mpsc::Receiver<()>,
    _watcher: notify::RecommendedWatcher,
    last: Option<Option<Entry>>,
    invalid: u64,
}

/// How often the path is re-read without an event (a missed event costs this much).
const RESCAN: Duration = Duration::from_secs(2);

impl Watch {
    /// `<dir>/<node>.json`: the projected shard ConfigMaps.
    pub fn entry(dir: impl AsRef<Path>, node: &str) -> Result<Self, Error> {
        Self::new(dir.as_ref().join(format!("{node}.json")), Some(node))
    }

    /// The node's own `fault.json` (or the agent's `--health-file`).
    pub fn file(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::new(path.as_ref().to_path_buf(), None)
    }

    fn new(path: PathBuf, node: Option<&str>) -> Result<Self, Error> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let (tx, events) = mpsc::channel();
        let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| {
            let _ = tx.send(());
        })
        .map_err(Error::Watch)?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(Error::Watch)?;
        Ok(Watch {
            path,
            node: node.map(str::to_string),
            only: Vec::new(),
            events,
            _watcher: watcher,
            last: None,
            invalid: 0,
        })
    }

    /// Only these devices (id, UUID or bus id), e.g. the ones the workload holds.
    pub fn only(mut self, devices: Vec<String>) -> Self {
        self.only = devices;
        self
    }

    /// Documents that did not parse so far (each was skipped; the last good one stands).
    pub fn invalid(&self) -> u64 {
        self.invalid
    }

    /// The entry now, the first time; afterwards the next entry that differs, waiting at
    /// most `timeout` (`Ok(None)` then). `Some(None)`: the node is not published.
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Option<Entry>>, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            match read(&self.path, self.node.as_deref(), &self.only) {
                Ok(now) if self.last.as_ref() != Some(&now) => {
                    self.last = Some(now.clone());
                    return Ok(Some(now));
                }
                Ok(_) => {}
                Err(Error::Invalid(_)) => self.invalid += 1,
                Err(e) => return Err(e),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // An event (any change in the directory), or the slow re-read.
            if self.events.recv_timeout(left.min(RESCAN)).is_ok() {
                while self.events.try_recv().is_ok() {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENTRY: &str = r#"{"version":"faultline.fault/v1","node":"n1","timestamp":"t",
        "agent":{"reachable":true,"sources":[{"name":"nvml","up":true}]},
        "npus":[{"id":"gpu0","status":"healthy","reason":null,"since":"t"},
                {"id":"gpu1","status":"failed","reason":"xid-79","since":"t","uuid":"GPU-1"},
                {"id":"gpu2","status":"rebooting","reason":null,"since":"t"}],
        "summary":{"total":3,"healthy":1,"degraded":0,"failed":1,"unknown":1}}"#;

    #[test]
    fn reads_the_aggregators_entry_and_keeps_what_it_does_not_know_unknown() {
        let e = parse(ENTRY.as_bytes(), Some("n1"), &[]).unwrap();
        assert_eq!(e.failed().len(), 1);
        assert_eq!(e.failed()[0].reason.as_deref(), Some("xid-79"));
        assert_eq!(e.devices[2].status, Status::Unknown);
        assert!(e.reachable);
    }

    #[test]
    fn refuses_another_nodes_document_and_garbage() {
        assert!(parse(ENTRY.as_bytes(), Some("n2"), &[]).is_err());
        assert!(parse(b"{\"npus\":", None, &[]).is_err());
        assert!(parse(b"[]", None, &[]).is_err());
    }

    #[test]
    fn keeps_only_the_devices_asked_for_by_id_or_uuid() {
        let e = parse(ENTRY.as_bytes(), None, &["GPU-1".to_string()]).unwrap();
        assert_eq!(e.devices.len(), 1);
        assert_eq!(e.devices[0].id, "gpu1");
        let e = parse(ENTRY.as_bytes(), None, &["gpu0".to_string()]).unwrap();
        assert!(e.failed().is_empty());
    }

    /// A node's own `fault.json` as its agent serves it, confirmed at `confirmed`.
    fn own(statuses: &[&str], stale: bool, writer: bool, confirmed: &str) -> String {
        let npus: Vec<String> = statuses
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let reason = if *s == "healthy" {
                    "null"
                } else {
                    "\"xid-79\""
                };
                format!(r#"{{"id":"gpu{i}","status":"{s}","reason":{reason},"since":"t"}}"#)
            })
            .collect();
        let writer = if writer { r#""writer":"agg-0","# } else { "" };
        format!(
            r#"{{"version":"faultline.fault/v1","node":"n1","timestamp":"t",
            "agent":{{"reachable":true}},"npus":[{}],"summary":{{}},
            "readings_at":"2026-01-01T00:00:00.000Z",
            "verdict":{{{writer}"sequence":4,"published":"{confirmed}","confirmed":"{confirmed}",
                       "stale":{stale},"stale_after_s":30}}}}"#,
            npus.join(",")
        )
    }

    fn statuses(e: &Entry) -> Vec<(&str, &str)> {
        e.devices
            .iter()
            .map(|d| (d.status.as_str(), d.reason.as_deref().unwrap_or("-")))
            .collect()
    }

    #[test]
    fn the_nodes_own_fault_json_reports_a_stale_verdict() {
        let at = "2026-01-01T00:00:00.000Z";
        let t = parse_rfc3339_ms(at).unwrap();
        let fresh = own(&["healthy", "failed"], false, true, at);
        let e = parse_at(fresh.as_bytes(), Some("n1"), &[], t + 1000).unwrap();
        assert_eq!(e.stale, None);
        assert_eq!(statuses(&e), [("healthy", "-"), ("failed", "xid-79")]);

        // The agent says stale: its healthy devices are already unknown.
        let said = own(&["unknown", "failed"], true, true, at).replace(
            r#""status":"unknown","reason":"xid-79""#,
            r#""status":"unknown","reason":"verdict-stale""#,
        );
        let e = parse_at(said.as_bytes(), None, &[], t + 1000).unwrap();
        assert_eq!(e.stale, Some(Stale::Unconfirmed));
        assert_eq!(
            statuses(&e),
            [("unknown", "verdict-stale"), ("failed", "xid-79")]
        );
        assert_eq!(e.failed().len(), 1, "failed stays failed");

        // Nobody rewrote the file: stale by its age, past stale_after_s and the grace.
        let holds = 30_000 + STALE_GRACE.as_millis() as u64;
        let e = parse_at(fresh.as_bytes(), None, &[], t + holds).unwrap();
        assert_eq!(e.stale, None);
        let e = parse_at(fresh.as_bytes(), None, &[], t + holds + 1).unwrap();
        assert_eq!(e.stale, Some(Stale::Unconfirmed));
        assert_eq!(
            statuses(&e),
            [("unknown", "verdict-stale"), ("failed", "xid-79")]
        );

        // No verdict yet.
        let none = own(&["unknown"], true, false, at);
        let e = parse_at(none.as_bytes(), None, &[], t).unwrap();
        assert_eq!(e.stale.map(Stale::as_str), Some("no-verdict"));

        // A shard ConfigMap's entry has no verdict: never stale.
        assert_eq!(parse(ENTRY.as_bytes(), None, &[]).unwrap().stale, None);
    }

    #[test]
    fn rfc3339_times() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:01.25Z"), Some(1250));
        assert_eq!(
            parse_rfc3339_ms("1970-01-01T00:00:01.123456789Z"),
            Some(1123)
        );
        assert_eq!(parse_rfc3339_ms("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2026-03-01T00:00:00.500-00:30"),
            Some((1_772_323_200 + 1800) * 1000 + 500)
        );
        assert_eq!(
            parse_rfc3339_ms("2024-02-29T12:00:00Z"),
            Some(1_709_208_000_000)
        );
        for bad in [
            "",
            "yesterday",
            "2026-01-01T00:00:00",
            "2026-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2026-01-01T00:00:00.Z",
            "2026-01-01T00:00:00+1:00",
            "1969-12-31T23:59:59Z",
            "2026-01-01T00:00:-1Z",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_watch_sees_a_renamed_file_and_skips_a_torn_one() {
        let d = std::env::temp_dir().join(format!("faultline-consumer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("fault.json");
        let mut w = Watch::file(&path).unwrap();
        assert_eq!(w.next(Duration::from_secs(1)).unwrap(), Some(None));
        let healthy = ENTRY.replace(
            "\"failed\",\"reason\":\"xid-79\"",
            "\"healthy\",\"reason\":null",
        );
        std::fs::write(d.join(".tmp"), &healthy).unwrap();
        std::fs::rename(d.join(".tmp"), &path).unwrap();
        let e = w.next(Duration::from_secs(5)).unwrap().unwrap().unwrap();
        assert!(e.failed().is_empty());
        std::fs::write(&path, "{\"node\":\"n1\",\"npus\":[").unwrap();
        assert_eq!(w.next(Duration::from_millis(300)).unwrap(), None);
        assert!(w.invalid() > 0, "a torn document is counted and skipped");
        std::fs::write(d.join(".tmp"), ENTRY).unwrap();
        std::fs::rename(d.join(".tmp"), &path).unwrap();
        let e = w.next(Duration::from_secs(5)).unwrap().unwrap().unwrap();
        assert_eq!(e.failed()[0].id, "gpu1");
        let _ = std::fs::remove_dir_all(&d);
    }
}
