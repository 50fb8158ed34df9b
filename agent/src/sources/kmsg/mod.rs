//! `kmsg`: follow the kernel log for NVRM Xid lines.
//!
//! `/dev/kmsg` (a character device) is read record by record from the start of the
//! kernel's ring buffer, with each record's own timestamp, so an Xid printed shortly
//! before the agent (re)started still counts within its window; a reopen skips records
//! already seen (by sequence number). A plain file is followed from its end like
//! `tail -F` (an old syslog must not replay as new faults) and resumed where it was
//! after an error; after rotation or truncation the new file is read from its start.
//! A FIFO is read as written.

pub mod parser;

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use faultline_common::xid::class_of_message;
use faultline_common::XidEvent;
use tokio_util::sync::CancellationToken;

use self::parser::{Line, Parser};
use super::{now_ms, ProbeError};
use crate::metrics::Metrics;
use crate::store::Store;

/// A record whose kernel timestamp is this close to now is live: it gets the arrival
/// time, so it lines up with NVML's event for the same Xid (the boot time from
/// /proc/stat is only good to a second or so).
const LIVE_WINDOW_MS: u64 = 10_000;

/// Turns lines into events and counts them.
pub struct LineHandler {
    parser: Parser,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    boot_ms: Option<u64>,
}

/// A raw /dev/kmsg record: `prio,seq,usec,flags;message` (message with `\xNN` escapes).
pub struct Record<'a> {
    /// Sequence number.
    pub seq: u64,
    /// Microseconds since boot.
    pub usec: u64,
    /// The message, still escaped.
    pub message: &'a str,
}

/// Split a /dev/kmsg record into header and message.
pub fn parse_record(rec: &str) -> Option<Record<'_>> {
    let first = rec.lines().next()?;
    let (head, message) = first.split_once(';')?;
    let mut f = head.split(',');
    let _prio: u32 = f.next()?.parse().ok()?;
    let seq = f.next()?.parse().ok()?;
    let usec = f.next()?.parse().ok()?;
    Some(Record { seq, usec, message })
}

/// Undo /dev/kmsg's `\xNN` escaping (non-printable bytes, embedded newlines).
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1] == b'x' {
            let hex = std::str::from_utf8(&b[i + 2..i + 4]).ok();
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl LineHandler {
    /// `boot_ms` (boot time, ms since the epoch) turns kmsg timestamps into wall time.
    pub fn new(store: Arc<Store>, metrics: Arc<Metrics>, boot_ms: Option<u64>) -> Self {
        LineHandler {
            parser: Parser::default(),
            store,
            metrics,
            boot_ms,
        }
    }

    /// One /dev/kmsg record: its message may hold several lines (escaped newlines).
    pub fn record(&mut self, rec: &Record<'_>) {
        let now = now_ms();
        let at_ms = match self.boot_ms {
            Some(boot) => {
                let t = boot + rec.usec / 1000;
                if now.abs_diff(t) <= LIVE_WINDOW_MS {
                    now
                } else {
                    t
                }
            }
            None => now,
        };
        for line in unescape(rec.message).lines() {
            self.line_at(line, at_ms);
        }
    }

    /// One line of a text log, seen now.
    pub fn line(&mut self, line: &str) {
        self.line_at(line, now_ms());
    }

    fn line_at(&mut self, line: &str, at_ms: u64) {
        let (xid, bus, message, kind) = match self.parser.parse(line) {
            Line::Xid { xid, bus, message } => (xid, bus, message, "xid"),
            Line::FallenOffBus { bus, message } => (79, bus, message, "fallen-off-bus"),
            Line::OtherNvrm => return self.metrics.count_kmsg_line("other-nvrm"),
            Line::Other => return self.metrics.count_kmsg_line("other"),
            Line::Malformed => {
                tracing::warn!(line = %line.chars().take(200).collect::<String>(), "unreadable NVRM Xid line");
                return self.metrics.count_kmsg_line("malformed");
            }
        };
        self.metrics.count_kmsg_line(kind);
        self.store.add_event(XidEvent {
            xid,
            class: class_of_message(xid, &message),
            pci_bus_id: bus,
            at_ms,
            source: "kmsg".into(),
            message: message.chars().take(300).collect(),
        });
    }
}

/// Boot time in ms since the epoch, from /proc/stat's `btime`.
pub fn boot_time_ms() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("btime "))?;
    Some(line[6..].trim().parse::<u64>().ok()? * 1000)
}

/// Where reading stopped, to resume after an error without replaying or skipping.
#[derive(Debug, Default, Clone, Copy)]
struct Position {
    /// Plain file: inode and offset.
    file: Option<(u64, u64)>,
    /// /dev/kmsg: the last sequence number handled.
    seq: Option<u64>,
}

/// Follow `path` on a thread of its own until `cancel` fires; reopen with backoff on
/// failure. Never returns an error: a kernel log we cannot read is reported as the
/// source being down.
pub fn spawn(path: PathBuf, store: Arc<Store>, metrics: Arc<Metrics>, cancel: CancellationToken) {
    store.register_source("kmsg", false);
    let spawned = std::thread::Builder::new().name("kmsg".into()).spawn(move || {
        let mut backoff = Duration::from_millis(500);
        let mut pos = Position::default();
        while !cancel.is_cancelled() {
            match follow(&path, &mut pos, &store, &metrics, &cancel) {
                Ok(()) => backoff = Duration::from_millis(500),
                Err(e) => {
                    metrics.count_error("kmsg", e.kind());
                    store.record_failure("kmsg", &e, 0);
                    tracing::warn!(path = %path.display(), error = %e, "kernel log unreadable; retrying");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the kmsg thread");
    }
}

fn call_err(path: &Path, e: std::io::Error) -> ProbeError {
    ProbeError::Call(format!("{}: {e}", path.display()))
}

fn follow(
    path: &Path,
    pos: &mut Position,
    store: &Arc<Store>,
    metrics: &Arc<Metrics>,
    cancel: &CancellationToken,
) -> Result<(), ProbeError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| ProbeError::Init(format!("{}: {e}", path.display())))?;
    let ft = meta.file_type();
    let mut file =
        File::open(path).map_err(|e| ProbeError::Init(format!("{}: {e}", path.display())))?;
    // Mark the source up.
    store.apply_sample("kmsg", Default::default());
    if ft.is_char_device() {
        let mut h = LineHandler::new(store.clone(), metrics.clone(), boot_time_ms());
        let mut buf = vec![0u8; 16 * 1024];
        while !cancel.is_cancelled() {
            match file.read(&mut buf) {
                Ok(0) => std::thread::sleep(Duration::from_millis(100)),
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    match parse_record(&text) {
                        // Seen before a reopen: the ring buffer starts over on open.
                        Some(r) if pos.seq.is_some_and(|s| r.seq <= s) => {}
                        Some(r) => {
                            pos.seq = Some(r.seq);
                            h.record(&r);
                        }
                        None => metrics.count_kmsg_line("malformed-record"),
                    }
                }
                // The ring buffer overwrote records we had not read yet: carry on.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    metrics.count_kmsg_line("overrun")
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(call_err(path, e)),
            }
        }
        return Ok(());
    }
    let mut h = LineHandler::new(store.clone(), metrics.clone(), None);
    if ft.is_fifo() {
        let mut reader = BufReader::new(file);
        let mut line = Vec::new();
        while !cancel.is_cancelled() {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|e| call_err(path, e))?;
            if n == 0 {
                // The writer left; reopen and wait for the next one.
                return Ok(());
            }
            // A last line without a newline is still a line.
            h.line(String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']));
        }
        return Ok(());
    }
    // A plain file: resume where we were if it is the same file and not truncated,
    // start at its beginning if it was replaced or truncated, at its end the first time.
    let ino = meta.ino();
    let start = match pos.file {
        Some((i, off)) if i == ino && meta.len() >= off => off,
        Some(_) => 0,
        None => meta.len(),
    };
    file.seek(SeekFrom::Start(start))
        .map_err(|e| call_err(path, e))?;
    let mut offset = start;
    pos.file = Some((ino, offset));
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    while !cancel.is_cancelled() {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| call_err(path, e))?;
        if n > 0 && line.last() == Some(&b'\n') {
            offset += n as u64;
            pos.file = Some((ino, offset));
            h.line(String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']));
            continue;
        }
        if n > 0 {
            // A line still being written: read it again once it is whole.
            reader
                .seek(SeekFrom::Start(offset))
                .map_err(|e| call_err(path, e))?;
        }
        std::thread::sleep(Duration::from_millis(50));
        match std::fs::metadata(path) {
            // Rotated (a new inode) or truncated: reopen.
            Ok(m) if m.ino() != ino || m.len() < offset => return Ok(()),
            Ok(_) => {}
            // Between a rename and the new file's creation: reopen when it is there.
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(call_err(path, e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kmsg_records_and_escapes() {
        let r = parse_record("4,1234,5678901,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: fallen off the bus.\n SUBSYSTEM=pci").unwrap();
        assert_eq!((r.seq, r.usec), (1234, 5678901));
        let lines: Vec<String> = unescape(r.message).lines().map(String::from).collect();
        assert_eq!(
            lines,
            vec![
                "NVRM: The NVIDIA GPU 0000:b3:00.0",
                "NVRM: fallen off the bus."
            ]
        );
        let mut p = Parser::default();
        let parsed: Vec<Line> = lines.iter().map(|l| p.parse(l)).collect();
        assert!(
            matches!(&parsed[1], Line::FallenOffBus { bus: Some(b), .. } if b == "0000:b3:00.0"),
            "{parsed:?}"
        );
        assert!(parse_record("garbage").is_none());
        assert_eq!(unescape("a\\x5cb\\xZZ\\x4"), "a\\b\\xZZ\\x4");
    }
}
