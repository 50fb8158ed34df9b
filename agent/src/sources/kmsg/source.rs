//! The `kmsg` source itself: the kernel log (or a followed file) read line by line,
//! bounded, each kernel record handed to `parser`, the Xids pushed to the sink.

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use faultline_common::time::now_ms;
use faultline_common::xid::{class_of_message, XidClass};
use faultline_common::XidEvent;
use tokio_util::sync::CancellationToken;

use super::super::{EventSink, ProbeError};
pub use super::parser::unescape;
use super::parser::{Line, Parser};
use crate::metrics::{KmsgFrom, KmsgLine, Metrics};

/// The source's name in documents, events and metrics.
pub const SOURCE: &str = "kmsg";

/// A record whose kernel timestamp is this close to now is live: it gets the arrival
/// time, so it lines up with NVML's event for the same Xid (the boot time from
/// /proc/stat is only good to a second or so).
const LIVE_WINDOW_MS: u64 = 10_000;

/// Turns lines into events for the sink and counts them.
/// What a text log's lines (without the kernel's facility) may do (`--kmsg-trust-text`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextTrust {
    /// Their Xids degrade at most: a fatal Xid counts as a restart-app one
    /// (with rsyslog 8, `logger -t kernel` as `nobody` failed two GPUs).
    Degraded,
    /// Counted in full, like the kernel's records.
    Full,
}

impl TextTrust {
    /// From `--kmsg-trust-text`.
    pub fn from_flag(trust: bool) -> Self {
        if trust {
            TextTrust::Full
        } else {
            TextTrust::Degraded
        }
    }
}

pub struct LineHandler {
    parser: Parser,
    sink: Arc<dyn EventSink>,
    metrics: Arc<Metrics>,
    boot_ms: Option<u64>,
    /// What a text line may do.
    text: TextTrust,
}

/// A raw /dev/kmsg record: `prio,seq,usec,flags;message` (message with `\xNN` escapes).
pub struct Record<'a> {
    /// Syslog priority: facility << 3 | level. The kernel's own records have facility
    /// 0; anything written to /dev/kmsg from user space gets another (the kernel turns
    /// a user's facility 0 into LOG_USER: kernel/printk/printk.c `devkmsg_write`).
    pub prio: u32,
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
    let prio: u32 = f.next()?.parse().ok()?;
    let seq = f.next()?.parse().ok()?;
    let usec = f.next()?.parse().ok()?;
    Some(Record {
        prio,
        seq,
        usec,
        message,
    })
}

impl LineHandler {
    /// `boot_ms` (boot time, ms since the epoch) turns kmsg timestamps into wall time.
    /// Xid lines go to `sink` as events; every line is counted in `metrics`.
    pub fn new(sink: Arc<dyn EventSink>, metrics: Arc<Metrics>, boot_ms: Option<u64>) -> Self {
        LineHandler {
            parser: Parser::default(),
            sink,
            metrics,
            boot_ms,
            text: TextTrust::Degraded,
        }
    }

    /// One /dev/kmsg record: its message may hold several lines (escaped newlines).
    /// Only the kernel's own records (facility 0) are read; a record of another facility
    /// never reaches the parser, so the records around it are not consecutive there.
    pub fn record(&mut self, rec: &Record<'_>) {
        if rec.prio >> 3 != 0 {
            return self.metrics.count_kmsg_line(KmsgLine::NotKernel);
        }
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
        let message = unescape(rec.message);
        let parsed = self.parser.record(rec.seq, &message);
        self.handle(parsed, &message, at_ms, false);
    }

    /// What the lines of a text log may do (records always count in full).
    pub fn trust_text(mut self, trust: TextTrust) -> Self {
        self.text = trust;
        self
    }

    /// One line of a text log, seen now.
    pub fn line(&mut self, line: &str) {
        let capped = self.text == TextTrust::Degraded && !super::parser::carries_facility(line);
        let parsed = self.parser.parse(line);
        self.handle(parsed, line, now_ms(), capped);
    }

    fn handle(&mut self, parsed: Line, line: &str, at_ms: u64, capped: bool) {
        let (xid, bus, message, class, kind) = match parsed {
            Line::Xid {
                xid,
                bus,
                message,
                process,
            } => {
                // The class from the driver's text only, never from a process's name.
                let class = class_of_message(xid, &message);
                let message = match process {
                    Some(p) => format!("{p}, {message}"),
                    None => message,
                };
                (xid, bus, message, class, KmsgLine::Xid)
            }
            Line::FallenOffBus { bus, message } => {
                let class = class_of_message(79, &message);
                (79, bus, message, class, KmsgLine::FallenOffBus)
            }
            Line::OtherNvrm => return self.metrics.count_kmsg_line(KmsgLine::OtherNvrm),
            Line::Other => return self.metrics.count_kmsg_line(KmsgLine::Other),
            Line::Refused => return self.metrics.count_kmsg_line(KmsgLine::Refused),
            Line::Malformed => {
                tracing::warn!(line = %line.chars().take(200).collect::<String>(), "unreadable NVRM Xid line");
                return self.metrics.count_kmsg_line(KmsgLine::Malformed);
            }
        };
        self.metrics.count_kmsg_line(kind);
        let (class, message) = if capped && class == XidClass::Fatal {
            self.metrics.count_kmsg_line(KmsgLine::Capped);
            let note = "from a text log, degraded at most (--kmsg-trust-text)";
            (XidClass::RestartApp, format!("{note}: {message}"))
        } else {
            (class, message)
        };
        self.sink.event(XidEvent {
            xid,
            class,
            pci_bus_id: bus,
            at_ms,
            // An untrusted text line's Xid may only degrade, by time too.
            source: if capped {
                format!("{SOURCE}-{}", faultline_common::xid::TEXT_LOG)
            } else {
                SOURCE.into()
            },
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
    /// A file or FIFO: the line at the offset is too long and being discarded up to its
    /// newline (kept across a reopen, so its tail is never read as a line of its own).
    discarding: bool,
}

/// How [`read_line`] ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// A whole line, with its newline.
    Line,
    /// A line longer than [`super::parser::MAX_LINE`], discarded up to and with its newline.
    TooLong,
    /// The end of what is there, within a line (`line` holds it unless discarding).
    Partial,
    /// The end of what is there, at a line's start.
    Eof,
}

/// The next line of `reader` into `line` (cleared first): at most [`super::parser::MAX_LINE`]
/// bytes and its newline. A longer line is discarded as it is read, up to its newline,
/// and never held whole (a 50 MiB line without a newline took the agent to
/// 58 MB). `discarding` carries a long line's discard across calls (a line still being
/// written). Returns the bytes consumed and how the read ended.
fn read_line<R: BufRead>(
    reader: &mut R,
    line: &mut Vec<u8>,
    discarding: &mut bool,
) -> std::io::Result<(usize, Ended)> {
    line.clear();
    let mut consumed = 0;
    loop {
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            let ended = if consumed == 0 {
                Ended::Eof
            } else {
                Ended::Partial
            };
            return Ok((consumed, ended));
        }
        let (take, newline) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if !*discarding {
            if line.len() + take > super::parser::MAX_LINE + 1 {
                *discarding = true;
                line.clear();
            } else {
                line.extend_from_slice(&buf[..take]);
            }
        }
        reader.consume(take);
        consumed += take;
        if newline {
            if std::mem::take(discarding) {
                line.clear();
                return Ok((consumed, Ended::TooLong));
            }
            return Ok((consumed, Ended::Line));
        }
    }
}

/// Follow `path` on a thread of its own until `cancel` fires; reopen with backoff on
/// failure. Never returns an error: a kernel log we cannot read is reported to `sink`
/// as the source being down.
pub fn spawn(
    path: PathBuf,
    text: TextTrust,
    sink: Arc<dyn EventSink>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    sink.register_stream(SOURCE);
    let spawned = std::thread::Builder::new().name("kmsg".into()).spawn(move || {
        let mut backoff = Duration::from_millis(500);
        let mut pos = Position::default();
        while !cancel.is_cancelled() {
            match follow(&path, &mut pos, text, &sink, &metrics, &cancel) {
                Ok(()) => backoff = Duration::from_millis(500),
                Err(e) => {
                    metrics.count_error(SOURCE, e.kind());
                    sink.stream_down(SOURCE, &e);
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
    text: TextTrust,
    sink: &Arc<dyn EventSink>,
    metrics: &Arc<Metrics>,
    cancel: &CancellationToken,
) -> Result<(), ProbeError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| ProbeError::Init(format!("{}: {e}", path.display())))?;
    let ft = meta.file_type();
    let mut file =
        File::open(path).map_err(|e| ProbeError::Init(format!("{}: {e}", path.display())))?;
    sink.stream_up(SOURCE);
    if ft.is_char_device() {
        let mut h = LineHandler::new(sink.clone(), metrics.clone(), boot_time_ms());
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
                        None => metrics.count_kmsg_line(KmsgLine::MalformedRecord),
                    }
                }
                // The ring buffer overwrote records we had not read yet: carry on.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    metrics.count_kmsg_line(KmsgLine::Overrun)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(call_err(path, e)),
            }
        }
        return Ok(());
    }
    let mut h = LineHandler::new(sink.clone(), metrics.clone(), None).trust_text(text);
    if ft.is_fifo() {
        let mut reader = BufReader::new(file);
        let mut line = Vec::new();
        while !cancel.is_cancelled() {
            let (_, ended) = read_line(&mut reader, &mut line, &mut pos.discarding)
                .map_err(|e| call_err(path, e))?;
            match ended {
                // The writer left; reopen and wait for the next one.
                Ended::Eof => return Ok(()),
                Ended::TooLong => metrics.count_kmsg_line(KmsgLine::TooLong),
                // A last line without a newline is still a line (unless too long).
                Ended::Partial if pos.discarding => {
                    pos.discarding = false;
                    metrics.count_kmsg_line(KmsgLine::TooLong);
                    return Ok(());
                }
                Ended::Line | Ended::Partial => {
                    h.line(String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']))
                }
            }
        }
        return Ok(());
    }
    // A plain file: resume where we were if it is the same file and not truncated,
    // start at its beginning if it was replaced or truncated, at its end the first time.
    let ino = meta.ino();
    let (start, at) = match pos.file {
        Some((i, off)) if i == ino && meta.len() >= off => (off, KmsgFrom::Resume),
        Some(_) => {
            pos.discarding = false;
            (0, KmsgFrom::Start)
        }
        None => {
            pos.discarding = false;
            (meta.len(), KmsgFrom::End)
        }
    };
    file.seek(SeekFrom::Start(start))
        .map_err(|e| call_err(path, e))?;
    metrics.count_kmsg_open(at);
    let mut offset = start;
    pos.file = Some((ino, offset));
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    while !cancel.is_cancelled() {
        let (n, ended) = read_line(&mut reader, &mut line, &mut pos.discarding)
            .map_err(|e| call_err(path, e))?;
        match ended {
            Ended::Line | Ended::TooLong => {
                offset += n as u64;
                pos.file = Some((ino, offset));
                if ended == Ended::Line {
                    h.line(String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']));
                } else {
                    metrics.count_kmsg_line(KmsgLine::TooLong);
                }
                continue;
            }
            // A long line still being written: what is there is discarded already.
            Ended::Partial if pos.discarding => {
                offset += n as u64;
                pos.file = Some((ino, offset));
            }
            // A line still being written: read it again once it is whole.
            Ended::Partial => {
                reader
                    .seek(SeekFrom::Start(offset))
                    .map_err(|e| call_err(path, e))?;
            }
            Ended::Eof => {}
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
    use std::sync::Mutex;

    /// Records what kmsg reports, in order.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl Recorder {
        /// Until `what` is reported (the follower runs on its own thread), `within` at most.
        fn wait_for(&self, what: &str, within: Duration) {
            let t = std::time::Instant::now();
            while !self.0.lock().unwrap().iter().any(|l| l == what) {
                assert!(t.elapsed() < within, "no {what:?}: {:?}", self.0);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    impl EventSink for Recorder {
        fn register_stream(&self, source: &'static str) {
            self.0.lock().unwrap().push(format!("register {source}"));
        }
        fn event(&self, e: XidEvent) {
            let bus = e.pci_bus_id.unwrap_or_default();
            let line = format!("xid {} {bus} {}", e.xid, e.source);
            self.0.lock().unwrap().push(line);
        }
        fn stream_up(&self, source: &'static str) {
            self.0.lock().unwrap().push(format!("up {source}"));
        }
        fn stream_down(&self, source: &'static str, err: &ProbeError) {
            let line = format!("down {source} {}", err.kind());
            self.0.lock().unwrap().push(line);
        }
    }

    #[test]
    fn lines_become_events_on_the_sink() {
        let rec = Arc::new(Recorder::default());
        let metrics = Arc::new(Metrics::new());
        let mut h = LineHandler::new(rec.clone(), metrics.clone(), None);
        h.line("NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.");
        h.line("usb 1-1: new high-speed USB device");
        // A text line (no kernel facility), untrusted by default: its source says so.
        assert_eq!(
            *rec.0.lock().unwrap(),
            vec!["xid 79 0000:3b:00.0 kmsg-text-log"]
        );
        let m = metrics.encode();
        assert!(
            m.contains("faultline_agent_kmsg_lines_total{result=\"xid\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("faultline_agent_kmsg_lines_total{result=\"other\"} 1"),
            "{m}"
        );
    }

    /// A syslog line tagged `kernel:` can be logged by any process
    /// (`logger -t kernel` as `nobody`, rsyslog 8): by default its fatal Xid counts as a
    /// restart-app one (degraded at most), counted `capped`; a raw record of the kernel's
    /// facility kept in the same log counts in full, and `--kmsg-trust-text` restores
    /// the text's full weight.
    #[test]
    fn a_text_log_degrades_at_most_unless_trusted() {
        #[derive(Default)]
        struct Classes(Mutex<Vec<(u32, XidClass, String)>>);
        impl EventSink for Classes {
            fn register_stream(&self, _: &'static str) {}
            fn event(&self, e: XidEvent) {
                self.0.lock().unwrap().push((e.xid, e.class, e.source));
            }
            fn stream_up(&self, _: &'static str) {}
            fn stream_down(&self, _: &'static str, _: &ProbeError) {}
        }
        let syslog = "Dec  2 10:00:00 node-7 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.";
        let record = "4,5003,8123456791,-;NVRM: Xid (PCI:0000:3c:00): 48, pid=0, DBE";
        let seen = |trust: TextTrust| {
            let sink = Arc::new(Classes::default());
            let metrics = Arc::new(Metrics::new());
            let mut h = LineHandler::new(sink.clone(), metrics.clone(), None).trust_text(trust);
            h.line(syslog);
            h.line(record);
            let classes = sink.0.lock().unwrap().clone();
            (classes, metrics.encode())
        };
        let (classes, m) = seen(TextTrust::Degraded);
        // The text's Xid is marked for what it is: its reason (`xid-79-text-log`)
        // may only degrade, by time too.
        assert_eq!(
            classes,
            vec![
                (79, XidClass::RestartApp, "kmsg-text-log".into()),
                (48, XidClass::Fatal, "kmsg".into())
            ]
        );
        assert!(
            m.contains("faultline_agent_kmsg_lines_total{result=\"capped\"} 1"),
            "{m}"
        );
        let (classes, _) = seen(TextTrust::Full);
        assert_eq!(
            classes,
            vec![
                (79, XidClass::Fatal, "kmsg".into()),
                (48, XidClass::Fatal, "kmsg".into())
            ]
        );
    }

    #[test]
    fn a_missing_log_is_reported_down_then_up_once_it_appears() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kern.log");
        let rec = Arc::new(Recorder::default());
        let cancel = CancellationToken::new();
        spawn(
            path.clone(),
            TextTrust::Degraded,
            rec.clone(),
            Arc::new(Metrics::new()),
            cancel.clone(),
        );
        let wait_for = |what: &str| rec.wait_for(what, Duration::from_secs(5));
        wait_for("down kmsg init");
        std::fs::write(&path, "").unwrap();
        wait_for("up kmsg");
        cancel.cancel();
        assert_eq!(rec.0.lock().unwrap()[0], "register kmsg");
    }

    /// A line longer than the parser reads is discarded as it is read, never
    /// held whole, up to its newline; the line after it is read as usual, also when the
    /// long one arrives in parts.
    #[test]
    fn a_long_line_is_discarded_as_it_is_read() {
        use std::io::Read as _;
        let xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n";
        let long = std::io::repeat(b'x').take(50 << 20);
        let mut r = BufReader::new(long.chain(xid.as_bytes()));
        let (mut line, mut discarding) = (Vec::new(), false);
        let (n, ended) = read_line(&mut r, &mut line, &mut discarding).unwrap();
        assert_eq!((n, ended), ((50 << 20) + xid.len(), Ended::TooLong));
        assert!(line.is_empty(), "x...x and the Xid are one line, too long");
        assert!(!discarding);
        let mut r = BufReader::new(
            std::io::repeat(b'x')
                .take(50 << 20)
                .chain(&b"\n"[..])
                .chain(xid.as_bytes()),
        );
        let (n, ended) = read_line(&mut r, &mut line, &mut discarding).unwrap();
        assert_eq!((n, ended), ((50 << 20) + 1, Ended::TooLong));
        assert!(
            line.capacity() <= 2 * super::super::parser::MAX_LINE + 16 * 1024,
            "held {}",
            line.capacity()
        );
        assert_eq!(
            read_line(&mut r, &mut line, &mut discarding).unwrap().1,
            Ended::Line
        );
        assert_eq!(line, xid.as_bytes());
        assert_eq!(
            read_line(&mut r, &mut line, &mut discarding).unwrap().1,
            Ended::Eof
        );
        // In parts: the part there, then its rest and the next line.
        let first = vec![b'x'; 3 * super::super::parser::MAX_LINE];
        let mut r = BufReader::new(&first[..]);
        assert_eq!(
            read_line(&mut r, &mut line, &mut discarding).unwrap().1,
            Ended::Partial
        );
        assert!(discarding && line.is_empty());
        let rest = format!("NVRM: Xid (PCI:0000:3b:00): 79, x\n{xid}");
        let mut r = BufReader::new(rest.as_bytes());
        assert_eq!(
            read_line(&mut r, &mut line, &mut discarding).unwrap().1,
            Ended::TooLong
        );
        assert_eq!(
            read_line(&mut r, &mut line, &mut discarding).unwrap().1,
            Ended::Line
        );
        assert_eq!(line, xid.as_bytes());
        // A line of exactly the limit is a line.
        let at_limit = format!("{}\n", "y".repeat(super::super::parser::MAX_LINE));
        let mut r = BufReader::new(at_limit.as_bytes());
        assert_eq!(
            read_line(&mut r, &mut line, &mut discarding).unwrap().1,
            Ended::Line
        );
    }

    /// A followed log file with a long line still being written: the agent
    /// discards it as it grows (counted `too-long`), and the Xid line after it is an
    /// event; the long line's tail is not read as a line of its own.
    #[test]
    fn a_followed_file_discards_a_growing_long_line() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kern.log");
        std::fs::write(&path, "").unwrap();
        let rec = Arc::new(Recorder::default());
        let metrics = Arc::new(Metrics::new());
        let cancel = CancellationToken::new();
        spawn(
            path.clone(),
            TextTrust::Full,
            rec.clone(),
            metrics.clone(),
            cancel.clone(),
        );
        let wait_for = |what: &str| rec.wait_for(what, Duration::from_secs(10));
        wait_for("up kmsg");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..8 {
            f.write_all(&chunk).unwrap();
            f.flush().unwrap();
            std::thread::sleep(Duration::from_millis(60));
        }
        // The long line's tail would be an Xid line of its own if read from its middle.
        f.write_all(b" NVRM: Xid (PCI:0000:3c:00): 79, tail\n")
            .unwrap();
        f.write_all(b"NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n")
            .unwrap();
        f.flush().unwrap();
        wait_for("xid 79 0000:3b:00.0 kmsg");
        cancel.cancel();
        let events: Vec<String> = rec
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("xid"))
            .cloned()
            .collect();
        assert_eq!(events, vec!["xid 79 0000:3b:00.0 kmsg"]);
        let m = metrics.encode();
        assert!(
            m.contains("faultline_agent_kmsg_lines_total{result=\"too-long\"} 1"),
            "{m}"
        );
    }

    #[test]
    fn kmsg_records_and_escapes() {
        let r = parse_record("4,1234,5678901,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this system has\\x0aNVRM: fallen off the bus and is not responding to commands.\n SUBSYSTEM=pci").unwrap();
        assert_eq!((r.prio, r.seq, r.usec), (4, 1234, 5678901));
        // `logger` or `echo '<0>...' > /dev/kmsg` from user space: facility 1 (user).
        assert_eq!(
            parse_record("14,1235,5678902,-;NVRM: Xid (PCI:0000:3b:00): 79, x")
                .unwrap()
                .prio
                >> 3,
            1
        );
        let message = unescape(r.message);
        assert_eq!(message.lines().count(), 3);
        assert!(
            matches!(Parser::default().record(r.seq, &message), Line::FallenOffBus { bus: Some(b), .. } if b == "0000:b3:00.0"),
            "{message}"
        );
        assert!(parse_record("garbage").is_none());
        assert_eq!(unescape("a\\x5cb\\xZZ\\x4"), "a\\b\\xZZ\\x4");
    }

    /// The kernel's record of a process's segfault, with the process named
    /// `NVRM: x` and its file named after a bus, or with the driver's lines in the file's
    /// name (newlines and all), becomes no event; the driver's own records do.
    #[test]
    fn a_process_record_is_no_event() {
        let rec = Arc::new(Recorder::default());
        let metrics = Arc::new(Metrics::new());
        let mut h = LineHandler::new(rec.clone(), metrics.clone(), None);
        for raw in [
            "6,5001,8123456789,-;NVRM: x[10804]: segfault at 0 ip 00007f3c2a1b2c3d sp 00007ffd1e2f3a40 error 6 in 0001:1f:00.0 fallen off the bus[558712345000+1000]",
            "6,5002,8123456790,-;a.out[10805]: segfault at 0 ip 00007f3c2a1b2c3d sp 00007ffd1e2f3a40 error 6 in x\\x0aNVRM: GPU 0001:1f:00.0: GPU has fallen off the bus.\\x0a[558712345000+1000]",
        ] {
            h.record(&parse_record(raw).unwrap());
        }
        assert!(rec.0.lock().unwrap().is_empty(), "{:?}", rec.0);
        h.record(
            &parse_record(
                "4,5003,8123456791,-;NVRM: GPU 0001:1f:00.0: GPU has fallen off the bus.",
            )
            .unwrap(),
        );
        assert_eq!(*rec.0.lock().unwrap(), vec!["xid 79 0001:1f:00.0 kmsg"]);
        let m = metrics.encode();
        assert!(
            m.contains("faultline_agent_kmsg_lines_total{result=\"refused\"} 1"),
            "{m}"
        );
    }
}
