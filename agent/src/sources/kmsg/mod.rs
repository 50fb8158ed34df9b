//! `kmsg`: follow the kernel log for NVRM Xid lines.
//!
//! `/dev/kmsg` (a character device) is read record by record from the start of the
//! kernel's ring buffer, with each record's own timestamp, so an Xid printed shortly
//! before the agent (re)started still counts within its window. A plain file is
//! followed from its end like `tail -F` (an old syslog must not replay as new faults),
//! a FIFO from whatever is written to it.

pub mod parser;

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use faultline_common::xid::class_of_message;
use faultline_common::XidEvent;
use tokio_util::sync::CancellationToken;

use self::parser::{kmsg_timestamp_us, Line, Parser};
use super::{now_ms, ProbeError};
use crate::metrics::Metrics;
use crate::store::Store;

/// Turns lines into events and counts them.
pub struct LineHandler {
    parser: Parser,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    boot_ms: Option<u64>,
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

    /// Handle one line.
    pub fn line(&mut self, line: &str) {
        let at_ms = match (self.boot_ms, kmsg_timestamp_us(line)) {
            (Some(boot), Some(us)) => boot + us / 1000,
            _ => now_ms(),
        };
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

/// Follow `path` on a thread of its own until `cancel` fires; reopen with backoff on
/// failure. Never returns an error: a kernel log we cannot read is reported as the
/// source being down.
pub fn spawn(path: PathBuf, store: Arc<Store>, metrics: Arc<Metrics>, cancel: CancellationToken) {
    store.register_source("kmsg", false);
    let spawned = std::thread::Builder::new().name("kmsg".into()).spawn(move || {
        let mut backoff = Duration::from_millis(500);
        // A plain file is followed from its end at start, and from its start after it
        // was rotated or truncated (everything in it then is new).
        let mut from_start = false;
        while !cancel.is_cancelled() {
            match follow(&path, from_start, &store, &metrics, &cancel) {
                Ok(()) => {
                    backoff = Duration::from_millis(500);
                    from_start = true;
                }
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

fn follow(
    path: &Path,
    from_start: bool,
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
                    let rec = String::from_utf8_lossy(&buf[..n]);
                    // A record is one line plus optional " KEY=value" continuation lines.
                    if let Some(first) = rec.lines().next() {
                        h.line(first);
                    }
                }
                // The ring buffer overwrote records we had not read yet: carry on.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    metrics.count_kmsg_line("overrun");
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(ProbeError::Call(format!("{}: {e}", path.display()))),
            }
        }
        return Ok(());
    }
    let mut h = LineHandler::new(store.clone(), metrics.clone(), None);
    let fifo = ft.is_fifo();
    let mut pos = if fifo || from_start {
        0
    } else {
        file.seek(SeekFrom::End(0))
            .map_err(|e| ProbeError::Call(e.to_string()))?
    };
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    while !cancel.is_cancelled() {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| ProbeError::Call(format!("{}: {e}", path.display())))?;
        if n == 0 || line.last() != Some(&b'\n') {
            // At the end (or mid-line): a FIFO whose writer left is reopened; a file is
            // polled for appends and reopened from the start if it was truncated or
            // replaced (log rotation).
            if fifo && n == 0 {
                return Ok(());
            }
            if n > 0 {
                // Put the partial line back by seeking to its start.
                let back = reader
                    .seek(SeekFrom::Current(-(n as i64)))
                    .map_err(|e| ProbeError::Call(e.to_string()))?;
                pos = back;
            }
            std::thread::sleep(Duration::from_millis(50));
            match std::fs::metadata(path) {
                Ok(m) if m.len() < pos || m_ino(&m) != m_ino(&meta) => return Ok(()),
                Ok(_) => continue,
                Err(e) => return Err(ProbeError::Call(format!("{}: {e}", path.display()))),
            }
        }
        pos += n as u64;
        h.line(String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']));
    }
    Ok(())
}

fn m_ino(m: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    m.ino()
}
