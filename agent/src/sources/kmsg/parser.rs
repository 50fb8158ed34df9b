//! Parsing the NVIDIA driver's kernel log messages: Xid lines and the "fallen off the
//! bus" messages, in every common prefix format (raw /dev/kmsg records, dmesg with or
//! without -T, syslog, journal).
//!
//! An Xid can fail a GPU and evict its work, so a message counts only when it is one of
//! the driver's own templates, matched whole: its fixed text where the driver's format
//! string has it, its bus id from the template's bus field and nowhere else, nothing
//! after its last field except the driver's free text (an Xid's message). A line that
//! only contains "fallen off the bus" somewhere is not a fall-off, and a bus-like word
//! elsewhere in a line is never a bus id.
//!
//! # The templates
//!
//! Read in NVIDIA/open-gpu-kernel-modules at tag 595.45.04 (commit
//! df1c9a3de2be4b130f4fc7680f7198193d8ac6ad); every tag from 515.43.04 (commit
//! 1739a20efc4acb55fd1dc53dcc66057b70c2613c) on prints the same texts, except where the
//! table says. `portDbgPrintf` is `nv_printf(0xFFFFFFFF, ...)`
//! (`src/nvidia/inc/libraries/nvport/inline/debug_unix_kernel_os.h`), and `nv_printf`
//! (`kernel-open/nvidia/os-interface.c`) is one `vprintk(KERN_CONT fmt, ...)`: one call,
//! one kernel record (unless it continues an unfinished line of the same caller), at the
//! default level (4) of the kernel's facility (0).
//!
//! | message | format string | source file, function |
//! |---|---|---|
//! | Xid, since 570.123.01 | `"NVRM: Xid (" attr "): %d, pid=%s, name=%s, %s%s\n"`; with no process known `"NVRM: Xid (" attr "): %d, %s%s\n"` (the second `%s`: `" caused by previous Xid %d"` or empty) | `src/nvidia/src/kernel/gpu/rc/kernel_rc.c`, `krcReportXid_IMPL` (macro `XID_PRINT_WITH_ATTR`) |
//! | Xid, 570.86.15 | the same, ending `%s\n` | same |
//! | Xid, 515.43.04 to 565.77 | `"NVRM: Xid (" attr "): %d, pid=%s, name=%s, %s\n"`, always with a process: `pid='<unknown>'`, `name=<unknown>` when none is known | same |
//! | the Xid's `attr` | `"PCI:%04x:%02x:%02x"`, `"PCI:%04x:%02x:%02x GPU-I:%02u"` (MIG GPU instance), `"PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u"` (and compute instance): domain, bus, device | same |
//! | Xid, legacy bus field | `Xid (%04x:%02x:%02x): ...` without `PCI:`: NVIDIA's Xid documentation (docs.nvidia.com/deploy/xid-errors, "Viewing the Xid messages"); not in open-gpu-kernel-modules | closed driver (older releases) |
//! | GPU lost (single line) | `NV_DEV_PRINTF(NV_DBG_ERRORS, nv, "GPU has fallen off the bus.\n")`, which is `nv_printf(level, "NVRM: GPU " NV_PCI_DEV_FMT ": " format, ...)` with `NV_PCI_DEV_FMT` `"%04x:%02x:%02x.%x"`: `NVRM: GPU %04x:%02x:%02x.%x: GPU has fallen off the bus.` | `src/nvidia/arch/nvalloc/unix/src/osinit.c`, `osHandleGpuLost` (macro in `src/nvidia/arch/nvalloc/unix/include/os-interface.h`, format in `.../include/nv.h`); the same function logs the Xid 79 through `nvErrorLog_va(..., ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS, "GPU has fallen off the bus.")` |
//! | GPU lost at probe (three lines, one call) | `"NVRM: The NVIDIA GPU %04x:%02x:%02x.%x\n"` `"NVRM: (PCI ID: %04x:%04x) installed in this system has\n"` `"NVRM: fallen off the bus and is not responding to commands.\n"` (domain, bus, slot, function; vendor, device) | `src/nvidia/arch/nvalloc/unix/src/osapi.c`, `rm_is_supported_device` |
//! | GPU lost, legacy | `NVRM: GPU at %04x:%02x:%02x.%x has fallen off the bus.`, as captured from the closed 33x drivers (Bumblebee-Project/Bumblebee#554, 2014); no open-gpu-kernel-modules tag prints it | closed driver (old releases) |
//!
//! Not templates: `NVRM: GPU at PCI:%04x:%02x:%02x: %s` (`_krcLogUuidOnce`, kernel_rc.c:
//! the GPU's UUID, printed once before its first Xid) and every other NVRM line; they
//! are counted as other NVRM lines and fail nothing.
//!
//! Hex digits are lowercase (`%x`); the domain has 4 to 8 digits (`%04x` of 32 bits),
//! bus and device 2, the function 1, MIG instance ids at least 2 decimal digits.
//!
//! # Records, not lines
//!
//! The kernel keeps one record per `printk` call; a record of several lines keeps them
//! together (/dev/kmsg escapes the newlines as `\x0a`; dmesg and journalctl print the
//! later lines indented, without a timestamp). Whatever a process can name (its `comm`,
//! set with `prctl(PR_SET_NAME)`, 15 bytes; a file's name, 255 bytes) may hold newlines
//! and reaches the kernel log inside the kernel's own records: x86's `show_signal_msg`
//! prints `comm[pid]: segfault at ... in <file name>[...]` at the kernel's facility. So:
//!
//! * a record is read by its first line only: the kernel wrote the start of the
//!   record, a process may have written any later line. The one exception is the probe
//!   message above, whose three lines are one `nv_printf` call: a record that is exactly
//!   those three lines, nothing before, after or between them;
//! * the three lines are also taken as three records in a row: consecutive sequence
//!   numbers for /dev/kmsg records (no record between, not even someone else's), or
//!   consecutive lines of a text log (syslog via `imklog` prints each line of a record
//!   as a line of its own);
//! * a message shaped like a process's (`comm[pid]: ` or `comm[pid] ` near its start,
//!   as the kernel prints segfaults, traps and the like) is refused, even when it starts
//!   with `NVRM: `;
//! * in a text log, an indented line (a later line of the record above, whatever it
//!   says) is never read on its own, and a line with the same `[secs.usecs]`
//!   timestamp as the process-shaped line just before it is refused as part of that
//!   record.
//!
//! A text log without timestamps or indentation (`dmesg -t`, a syslog file without the
//! kernel's timestamps) cannot show where a record ends: there a process's file name can
//! still pass for the driver's line. /dev/kmsg, the default, always can.
//!
//! Only the kernel's own messages count: a /dev/kmsg record of another facility than
//! the kernel's is not read (user space cannot write facility 0: the kernel turns it
//! into LOG_USER); in syslog and journal text the first tag must be `kernel:` (anything
//! a user logs, e.g. `logger 'NVRM: Xid ...'`, carries the user's tag); `NVRM: ` must
//! start the message, after at most the kernel's timestamp; and a line or record longer
//! than [`MAX_LINE`] is not read.

use faultline_common::normalize_bus_id;

/// What one line (or record) says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., text`
    Xid {
        xid: u32,
        /// The template's bus field, normalised (`None` when out of range).
        bus: Option<String>,
        /// The driver's text after the process, if any.
        message: String,
        /// `pid=..., name=...` (or `pid=...`) as printed, when the line names one.
        process: Option<String>,
    },
    /// A "fallen off the bus" template with no Xid number.
    FallenOffBus {
        bus: Option<String>,
        message: String,
    },
    /// Another NVRM line (kept for the metric, otherwise ignored).
    OtherNvrm,
    /// Not an NVRM line at all.
    Other,
    /// An NVRM Xid line we could not read (counted, never guessed at).
    Malformed,
    /// A kernel message that starts like the driver's but is a process's: shaped
    /// `comm[pid]: ...`, or a later line of such a record. Counted, never read.
    Refused,
}

/// Longest line (or record) read; longer ones are not kernel NVRM messages (counted,
/// dropped).
pub const MAX_LINE: usize = 4096;

/// Stateful, because the probe-time fall-off message may come as three records or
/// lines in a row, and because a text log's record may span lines.
#[derive(Debug, Default)]
pub struct Parser {
    /// The first one or two lines of the three-line message, seen last.
    pending: Option<Pending>,
    /// The `[secs.usecs]` of the process-shaped text line read last, while the lines
    /// after it carry the same timestamp.
    process_ts: Option<String>,
    /// The last text record start was a process's (its indented lines are refused).
    in_process_record: bool,
}

#[derive(Debug)]
struct Pending {
    /// The GPU as printed (`0000:b3:00.0`).
    gpu: String,
    /// `vvvv:dddd` once the second line was seen.
    pci_id: Option<String>,
    /// What the next line must follow.
    after: After,
}

#[derive(Debug, Clone, Copy)]
enum After {
    /// The /dev/kmsg record with this sequence number.
    Seq(u64),
    /// The previous line of a text log.
    Text,
}

const NVRM: &str = "NVRM: ";
const PROBE_LAST: &str = "NVRM: fallen off the bus and is not responding to commands.";
/// `TASK_COMM_LEN - 1` bytes of name, plus a prefix such as `traps: `.
const PROCESS_HEAD: usize = 15 + 9;

impl Parser {
    /// Parse one line of a text log (or a raw /dev/kmsg record kept in a file).
    pub fn parse(&mut self, line: &str) -> Line {
        if line.len() > MAX_LINE {
            self.pending = None;
            return Line::Other;
        }
        match frame(line) {
            Frame::Record { seq, message } => self.record(seq, &unescape(message)),
            Frame::NotKernel => {
                self.pending = None;
                Line::Other
            }
            Frame::Start { ts, msg } => self.text_start(ts, msg.trim_end()),
            // A raw record's dictionary (` KEY=value`) is no record between records.
            Frame::Continuation(_)
                if is_dictionary(line)
                    && matches!(
                        self.pending,
                        Some(Pending {
                            after: After::Seq(_),
                            ..
                        })
                    ) =>
            {
                Line::Other
            }
            Frame::Continuation(msg) => self.text_continuation(msg.trim_end()),
        }
    }

    /// Parse one /dev/kmsg record of the kernel's facility: its sequence number and
    /// its message, unescaped (lines separated by `\n`).
    pub fn record(&mut self, seq: u64, message: &str) -> Line {
        self.process_ts = None;
        self.in_process_record = false;
        if message.len() > MAX_LINE {
            self.pending = None;
            return Line::Other;
        }
        let message = message.strip_suffix('\n').unwrap_or(message);
        let mut lines = message.split('\n').map(str::trim_end);
        let first = lines.next().unwrap_or_default();
        let (second, third, more) = (lines.next(), lines.next(), lines.next().is_some());
        if second.is_none() {
            if process_shaped(first) {
                self.pending = None;
                return refused(first);
            }
            if let Some(line) = self.continue_pending(first, After::Seq(seq)) {
                return line;
            }
            return self.first_line(first, Some(After::Seq(seq)));
        }
        self.pending = None;
        if process_shaped(first) {
            return refused(first);
        }
        // The probe message as the kernel records it: one call, one record, exactly
        // its three lines.
        if let (Some(gpu), Some(second), Some(third), false) =
            (probe_first(first), second, third, more)
        {
            if let (Some(pci_id), true) = (probe_second(second), third == PROBE_LAST) {
                return fallen_at_probe(gpu, &pci_id);
            }
        }
        // Any other record of several lines: its first line only.
        self.first_line(first, None)
    }

    /// A text line that starts a record: `msg` after its timestamp `ts`, if any.
    fn text_start(&mut self, ts: Option<&str>, msg: &str) -> Line {
        let ts = ts.filter(|t| is_numeric_timestamp(t));
        // A later line of the process's record (syslog prints every line of a record
        // with the record's timestamp).
        if ts.is_some() && ts == self.process_ts.as_deref() {
            self.pending = None;
            self.in_process_record = true;
            return refused(msg);
        }
        self.process_ts = None;
        self.in_process_record = false;
        if process_shaped(msg) {
            self.pending = None;
            self.process_ts = ts.map(String::from);
            self.in_process_record = true;
            return refused(msg);
        }
        if let Some(line) = self.continue_pending(msg, After::Text) {
            return line;
        }
        self.first_line(msg, Some(After::Text))
    }

    /// An indented text line without timestamp or tag: a later line of the record
    /// above. Read only as the next line of the probe message; never on its own.
    fn text_continuation(&mut self, msg: &str) -> Line {
        if !self.in_process_record {
            if let Some(line) = self.continue_pending(msg, After::Text) {
                return line;
            }
        }
        self.pending = None;
        if self.in_process_record {
            refused(msg)
        } else if msg.starts_with(NVRM) {
            Line::OtherNvrm
        } else {
            Line::Other
        }
    }

    /// The second or third line of the probe message, right after the line or record
    /// before it; anything else drops what was pending.
    fn continue_pending(&mut self, msg: &str, now: After) -> Option<Line> {
        let p = self.pending.take()?;
        let next = match (p.after, now) {
            (After::Seq(s), After::Seq(n)) => s.checked_add(1) == Some(n),
            (After::Text, After::Text) => true,
            _ => false,
        };
        if !next {
            return None;
        }
        match p.pci_id {
            None => {
                let pci_id = probe_second(msg)?;
                self.pending = Some(Pending {
                    gpu: p.gpu,
                    pci_id: Some(pci_id),
                    after: now,
                });
                Some(Line::OtherNvrm)
            }
            Some(pci_id) => (msg == PROBE_LAST).then(|| fallen_at_probe(p.gpu, &pci_id)),
        }
    }

    /// The first line of a record (or a text line): one of the single-line templates,
    /// or the probe message's first line (remembered when `opens` says where it is).
    fn first_line(&mut self, msg: &str, opens: Option<After>) -> Line {
        if !msg.starts_with(NVRM) {
            return Line::Other;
        }
        if let Some(line) = xid_line(msg) {
            return line;
        }
        if let Some(gpu) = fallen_single(msg) {
            return Line::FallenOffBus {
                bus: normalize_bus_id(gpu),
                message: msg[NVRM.len()..].to_string(),
            };
        }
        if let (Some(gpu), Some(after)) = (probe_first(msg), opens) {
            self.pending = Some(Pending {
                gpu: gpu.to_string(),
                pci_id: None,
                after,
            });
        }
        Line::OtherNvrm
    }
}

fn refused(msg: &str) -> Line {
    if msg.starts_with(NVRM) {
        Line::Refused
    } else {
        Line::Other
    }
}

fn fallen_at_probe(gpu: impl AsRef<str>, pci_id: &str) -> Line {
    let gpu = gpu.as_ref();
    Line::FallenOffBus {
        bus: normalize_bus_id(gpu),
        message: format!(
            "The NVIDIA GPU {gpu} (PCI ID: {pci_id}) installed in this system has fallen off the bus and is not responding to commands."
        ),
    }
}

/// How a text line sits in the kernel log.
enum Frame<'a> {
    /// A raw /dev/kmsg record kept in a file (`prio,seq,usec,flags;message`, the
    /// message still escaped), of the kernel's facility.
    Record { seq: u64, message: &'a str },
    /// Someone else's: a record of another facility, a line with another tag.
    NotKernel,
    /// The first line of a kernel record: its message after the timestamp, if any.
    Start { ts: Option<&'a str>, msg: &'a str },
    /// An indented line: a later line of the record above, as dmesg and journalctl
    /// print a record of several lines (whatever it says, even `[secs.usecs] ...`).
    Continuation(&'a str),
}

/// Whether a line of a text log is a raw /dev/kmsg record of the kernel's facility
/// (`prio,seq,usec,flags;message`), so that it carries its facility: a syslog line's
/// `kernel:` tag does not (any process can log one, e.g. `logger -t kernel`).
pub fn carries_facility(line: &str) -> bool {
    matches!(frame(line), Frame::Record { .. })
}

fn frame(line: &str) -> Frame<'_> {
    if line.starts_with(char::is_whitespace) {
        return Frame::Continuation(line.trim_start());
    }
    let s = line;
    // `prio,seq,usec,flags;message`: the kernel's only when its facility (prio >> 3)
    // is 0.
    if let Some((head, msg)) = s.split_once(';') {
        let mut f = head.split(',');
        let prio = f.next().and_then(|p| p.parse::<u32>().ok());
        let seq = f.next().and_then(|x| x.parse::<u64>().ok());
        let usec = f.next().is_some_and(|x| x.parse::<u64>().is_ok());
        if let (Some(prio), Some(seq), true) = (prio, seq, usec) {
            return if prio >> 3 == 0 {
                Frame::Record { seq, message: msg }
            } else {
                Frame::NotKernel
            };
        }
    }
    if s.starts_with(NVRM) {
        return Frame::Start { ts: None, msg: s };
    }
    if s.starts_with('[') {
        let (ts, msg) = split_timestamp(s);
        return Frame::Start { ts, msg };
    }
    // `Jun 15 08:23:45 host kernel: ...`, `2024-06-15T08:23:45+0000 host kernel: ...`:
    // the words before the tag (date, time, host) never end in ':'.
    let mut rest = s;
    loop {
        let word_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let word = &rest[..word_end];
        if word.ends_with(':') {
            if word != "kernel:" {
                return Frame::NotKernel;
            }
            let (ts, msg) = split_timestamp(&rest[word_end..]);
            return Frame::Start { ts, msg };
        }
        if word_end == rest.len() {
            return Frame::NotKernel;
        }
        rest = rest[word_end..].trim_start();
    }
}

/// One leading `[...]` (a dmesg timestamp, relative or `-T`) and what follows it.
fn split_timestamp(s: &str) -> (Option<&str>, &str) {
    let s = s.trim_start();
    match s.strip_prefix('[').and_then(|r| r.split_once(']')) {
        Some((ts, rest)) => (Some(ts.trim()), rest.trim_start()),
        None => (None, s),
    }
}

/// `secs.usecs`: precise enough that two records rarely share it.
fn is_numeric_timestamp(ts: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    ts.split_once('.')
        .is_some_and(|(s, us)| digits(s) && digits(us))
}

/// A record's dictionary line, as /dev/kmsg prints it after the message: ` KEY=value`.
fn is_dictionary(line: &str) -> bool {
    line.strip_prefix(' ')
        .and_then(|l| l.split_once('='))
        .is_some_and(|(key, _)| {
            !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        })
}

/// A process's message as the kernel prints it: `comm[pid]: ...` (segfaults, and most
/// others) or `comm[pid] ...` (`traps: comm[pid] general protection ...`), the task's
/// name (at most 15 bytes, anything in them) first.
fn process_shaped(msg: &str) -> bool {
    msg.char_indices()
        .take(PROCESS_HEAD)
        .filter(|&(_, c)| c == '[')
        .any(|(i, _)| {
            let rest = &msg[i + 1..];
            let n = rest.bytes().take_while(u8::is_ascii_digit).count();
            (1..=10).contains(&n)
                && rest[n..]
                    .strip_prefix(']')
                    .is_some_and(|r| r.is_empty() || r.starts_with([':', ' ']))
        })
}

/// `min..=max` characters of `class` at the start of `s`, and the rest.
fn take(s: &str, min: usize, max: usize, class: fn(&u8) -> bool) -> Option<(&str, &str)> {
    let n = s.bytes().take_while(class).count();
    (min..=max).contains(&n).then(|| s.split_at(n))
}

fn lower_hex(b: &u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(b)
}

/// `%04x:%02x:%02x` (domain, bus, device) and the rest.
fn pci_location(s: &str) -> Option<(&str, &str)> {
    let (_, r) = take(s, 4, 8, lower_hex)?;
    let (_, r) = take(r.strip_prefix(':')?, 2, 2, lower_hex)?;
    let (_, r) = take(r.strip_prefix(':')?, 2, 2, lower_hex)?;
    Some(s.split_at(s.len() - r.len()))
}

/// `%04x:%02x:%02x.%x` (domain, bus, device, function) and the rest.
fn pci_function(s: &str) -> Option<(&str, &str)> {
    let (_, r) = pci_location(s)?;
    let (_, r) = take(r.strip_prefix('.')?, 1, 1, lower_hex)?;
    Some(s.split_at(s.len() - r.len()))
}

/// `NVRM: GPU %04x:%02x:%02x.%x: GPU has fallen off the bus.`, or the closed driver's
/// old `NVRM: GPU at %04x:%02x:%02x.%x has fallen off the bus.`: the GPU.
fn fallen_single(msg: &str) -> Option<&str> {
    let rest = msg.strip_prefix("NVRM: GPU ")?;
    if let Some((gpu, tail)) = pci_function(rest) {
        return (tail == ": GPU has fallen off the bus.").then_some(gpu);
    }
    let (gpu, tail) = pci_function(rest.strip_prefix("at ")?)?;
    (tail == " has fallen off the bus.").then_some(gpu)
}

/// `NVRM: The NVIDIA GPU %04x:%02x:%02x.%x`, the whole line: the GPU.
fn probe_first(msg: &str) -> Option<&str> {
    let (gpu, tail) = pci_function(msg.strip_prefix("NVRM: The NVIDIA GPU ")?)?;
    tail.is_empty().then_some(gpu)
}

/// `NVRM: (PCI ID: %04x:%04x) installed in this system has`: the vendor and device.
fn probe_second(msg: &str) -> Option<String> {
    let rest = msg.strip_prefix("NVRM: (PCI ID: ")?;
    let (vendor, r) = take(rest, 4, 4, lower_hex)?;
    let (device, r) = take(r.strip_prefix(':')?, 4, 4, lower_hex)?;
    (r == ") installed in this system has").then(|| format!("{vendor}:{device}"))
}

/// `None`: not an Xid line. Otherwise the Xid, or [`Line::Malformed`] when the line
/// starts like one but is not the template.
fn xid_line(msg: &str) -> Option<Line> {
    let rest = msg.strip_prefix("NVRM: Xid")?;
    if !(rest.is_empty() || rest.starts_with(' ')) {
        return None;
    }
    Some(parse_xid(rest).unwrap_or(Line::Malformed))
}

/// ` (attr): %d, text` after `NVRM: Xid`.
fn parse_xid(rest: &str) -> Option<Line> {
    let (field, after) = rest.strip_prefix(" (")?.split_once(')')?;
    let bus = xid_bus(field)?;
    let (digits, tail) = take(after.strip_prefix(": ")?, 1, 10, u8::is_ascii_digit)?;
    let xid: u32 = digits.parse().ok()?;
    // `, %s`: the rest is the driver's (and the process's) text; the line was trimmed
    // at its end, so an empty text leaves the comma alone.
    let text = match tail {
        "," => "",
        t => t.strip_prefix(", ")?,
    };
    let (process, message) = split_process(text);
    Some(Line::Xid {
        xid,
        bus,
        message: message.to_string(),
        process: process.map(String::from),
    })
}

/// The Xid's bus field, whole: `PCI:%04x:%02x:%02x`, optionally ` GPU-I:%02u` and then
/// ` GPU-CI:%02u`; or the legacy `%04x:%02x:%02x`. `Some(None)`: the template, but a
/// location we cannot name (a domain past 16 bits).
fn xid_bus(field: &str) -> Option<Option<String>> {
    let (location, rest) = match field.strip_prefix("PCI:") {
        Some(pci) => {
            let (location, mut rest) = pci_location(pci)?;
            if let Some(r) = rest.strip_prefix(" GPU-I:") {
                rest = take(r, 2, 5, u8::is_ascii_digit)?.1;
                if let Some(r) = rest.strip_prefix(" GPU-CI:") {
                    rest = take(r, 2, 5, u8::is_ascii_digit)?.1;
                }
            }
            (location, rest)
        }
        None => pci_location(field)?,
    };
    rest.is_empty().then(|| normalize_bus_id(location))
}

/// `pid=%s, name=%s, ` (or the older `pid=%s, `) at the start of an Xid's text: the
/// process as printed, and the driver's text after it. A name is the task's, cut at
/// the first `, ` (a name holding one spills into the text).
fn split_process(text: &str) -> (Option<&str>, &str) {
    let Some(rest) = text.strip_prefix("pid=") else {
        return (None, text);
    };
    let pid = if rest.starts_with("'<unknown>'") {
        "'<unknown>'".len()
    } else {
        rest.bytes().take_while(u8::is_ascii_digit).count()
    };
    let Some(after_pid) = rest[pid..].strip_prefix(", ").filter(|_| pid > 0) else {
        return (None, text);
    };
    let mut end = text.len() - after_pid.len() - 2;
    let mut message = after_pid;
    if let Some(name) = after_pid.strip_prefix("name=") {
        let n = name.find(", ").unwrap_or(name.len());
        end = text.len() - name.len() + n;
        message = name[n..].strip_prefix(", ").unwrap_or_default();
    }
    (Some(&text[..end]), message)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(line: &str) -> (u32, Option<String>) {
        match Parser::default().parse(line) {
            Line::Xid { xid, bus, .. } => (xid, bus),
            other => panic!("{line}: {other:?}"),
        }
    }

    fn bus(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    /// Lines a fresh parser reads one after the other; what the last one says.
    fn last_of(lines: &[&str]) -> Line {
        let mut p = Parser::default();
        let mut last = Line::Other;
        for l in lines {
            last = p.parse(l);
        }
        last
    }

    #[test]
    fn every_prefix_format() {
        let want = (79, bus("0000:3b:00.0"));
        for line in [
            "6,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
            "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            "[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "Jun 15 08:23:45 node-42 kernel: [ 1234.5] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "2024-06-15T08:23:45+0000 node-42 kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "NVRM: Xid (0000:3b:00): 79, GPU has fallen off the bus.",
        ] {
            assert_eq!(xid(line), want, "{line}");
        }
    }

    /// Each Xid format string of `krcReportXid_IMPL`, filled in as the driver does.
    #[test]
    fn the_xid_template_in_each_driver_form() {
        let cases: &[(&str, u32, &str, Option<&str>, &str)] = &[
            // 515.43.04 to 565.77: always a process, '<unknown>' when none.
            (
                "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                79,
                "0000:91:00.0",
                Some("pid='<unknown>', name=<unknown>"),
                "GPU has fallen off the bus.",
            ),
            // 570 and later, with a process and without one.
            (
                "NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).",
                119,
                "0000:9b:00.0",
                Some("pid=2024380, name=nvidia-smi"),
                "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) (0x2081 0x4).",
            ),
            (
                "NVRM: Xid (PCI:0000:06:00): 79, GPU has fallen off the bus.",
                79,
                "0000:06:00.0",
                None,
                "GPU has fallen off the bus.",
            ),
            // The root cause suffix (570.123.01 on).
            (
                "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
                45,
                "0000:dc:00.0",
                Some("pid=1818990, name=python3"),
                "Ch 00000001 caused by previous Xid 149",
            ),
            // MIG: GPU instance, and GPU and compute instance.
            (
                "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
                94,
                "0000:01:00.0",
                Some("pid=7194"),
                "Contained: CE User Channel (0x9). RST: No, D-RST: No",
            ),
            (
                "NVRM: Xid (PCI:0000:01:00 GPU-I:05 GPU-CI:01): 43, pid=5, name=x, Ch 00000008",
                43,
                "0000:01:00.0",
                Some("pid=5, name=x"),
                "Ch 00000008",
            ),
            // A non-zero domain; a device other than 00.
            (
                "NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
                149,
                "0009:01:00.0",
                None,
                "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
            ),
            // An empty text (`%s` of "").
            ("NVRM: Xid (PCI:0000:10:1c): 63, ", 63, "0000:10:1c.0", None, ""),
        ];
        for &(line, want_xid, want_bus, want_process, want_message) in cases {
            assert_eq!(
                Parser::default().parse(line),
                Line::Xid {
                    xid: want_xid,
                    bus: bus(want_bus),
                    message: want_message.to_string(),
                    process: want_process.map(String::from),
                },
                "{line}"
            );
        }
    }

    #[test]
    fn the_single_line_fall_off_templates() {
        for (line, want) in [
            // osHandleGpuLost's NV_DEV_PRINTF.
            (
                "[1843.308155] NVRM: GPU 0000:28:00.0: GPU has fallen off the bus.",
                "0000:28:00.0",
            ),
            (
                "Jun 15 08:23:45 n kernel: NVRM: GPU 0001:1f:00.0: GPU has fallen off the bus.",
                "0001:1f:00.0",
            ),
            // The closed 33x driver's wording (Bumblebee-Project/Bumblebee#554).
            (
                "[   49.261458] NVRM: GPU at 0000:01:00.0 has fallen off the bus.",
                "0000:01:00.0",
            ),
        ] {
            match Parser::default().parse(line) {
                Line::FallenOffBus { bus, .. } => assert_eq!(bus.as_deref(), Some(want), "{line}"),
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    #[test]
    fn multi_line_fallen_off_the_bus_names_its_gpu() {
        let mut p = Parser::default();
        assert_eq!(
            p.parse("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0"),
            Line::OtherNvrm
        );
        assert_eq!(
            p.parse("               NVRM: (PCI ID: 10de:26b5) installed in this system has"),
            Line::OtherNvrm
        );
        match p.parse("               NVRM: fallen off the bus and is not responding to commands.")
        {
            Line::FallenOffBus { bus, message } => {
                assert_eq!(bus.as_deref(), Some("0000:b3:00.0"));
                assert!(message.contains("(PCI ID: 10de:26b5)"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// The probe message as /dev/kmsg holds it: one record, three lines; and as three
    /// records in a row.
    #[test]
    fn the_probe_message_as_records() {
        let one = "NVRM: The NVIDIA GPU 0000:18:00.0\nNVRM: (PCI ID: 10de:2901) installed in this system has\nNVRM: fallen off the bus and is not responding to commands.";
        assert!(matches!(
            Parser::default().record(10, one),
            Line::FallenOffBus { bus: Some(b), .. } if b == "0000:18:00.0"
        ));
        // As a raw record kept in a file, newlines escaped.
        let raw = format!("4,10,5,-;{}", one.replace('\n', "\\x0a"));
        assert!(matches!(
            Parser::default().parse(&raw),
            Line::FallenOffBus { bus: Some(b), .. } if b == "0000:18:00.0"
        ));
        let mut p = Parser::default();
        let lines: Vec<&str> = one.lines().collect();
        assert_eq!(p.record(10, lines[0]), Line::OtherNvrm);
        assert_eq!(p.record(11, lines[1]), Line::OtherNvrm);
        assert!(matches!(
            p.record(12, lines[2]),
            Line::FallenOffBus { bus: Some(b), .. } if b == "0000:18:00.0"
        ));
    }

    /// Any process could name itself `NVRM: x` and crash in a file named
    /// `0001:1f:00.0 fallen off the bus`; the kernel's segfault record failed that GPU.
    #[test]
    fn a_process_cannot_fail_a_gpu() {
        let segfault = "6,5001,8123456789,-;NVRM: x[10804]: segfault at 0 ip 00007f3c2a1b2c3d sp 00007ffd1e2f3a40 error 6 in 0001:1f:00.0 fallen off the bus[558712345000+1000]";
        let not_read = |p: &mut Parser, what: &str, l: &str| {
            let got = p.parse(l);
            assert!(
                !matches!(got, Line::Xid { .. } | Line::FallenOffBus { .. }),
                "{what}: {l}\nread as {got:?}"
            );
        };
        // Each forged form alone.
        for (what, l) in [
            ("the issue's record", segfault),
            ("the same in dmesg", "[ 8123.456789] NVRM: x[10804]: segfault at 0 ip 00007f3c2a1b2c3d sp 00007ffd1e2f3a40 error 6 in 0001:1f:00.0 fallen off the bus[558712345000+1000]"),
            ("the same in syslog", "Jun 15 08:23:45 n kernel: [ 8123.456789] NVRM: x[10804]: segfault at 0 ip 00007f3c2a1b2c3d sp 00007ffd1e2f3a40 error 6 in 0001:1f:00.0 fallen off the bus[558712345000+1000]"),
            ("a process-shaped message", "NVRM: x[1]: GPU 0000:3b:00.0: GPU has fallen off the bus."),
            ("a trap", "traps: NVRM: x[1] trap int3 ip:4011 sp:7ffd error:0 in 0000:3b:00.0 fallen off the bus[4010+1000]"),
            ("fallen off the bus elsewhere in a line", "NVRM: foo fallen off the bus 0000:3b:00.0"),
            ("a bus elsewhere in a line", "NVRM: GPU has fallen off the bus. 0000:3b:00.0"),
            ("trailing text after the template", "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus. (really)"),
            ("the template inside another message", "NVRM: note: NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."),
            ("uppercase hex", "NVRM: GPU 0000:3B:00.0: GPU has fallen off the bus."),
            ("the probe's last line alone", "NVRM: fallen off the bus and is not responding to commands."),
            ("the unsupported-GPU message's first line", "NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:1234)"),
        ] {
            not_read(&mut Parser::default(), what, l);
        }
        // The Xid template's bus field is the whole parenthesis, nothing else.
        for l in [
            "NVRM: Xid (PCI:0000:3b:00garbage): 79, GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:3b:00 x): 79, GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:3b:00.0): 79, GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:3b:00): 79 GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:3b:00):79, x",
        ] {
            assert_eq!(Parser::default().parse(l), Line::Malformed, "{l}");
        }
        assert_eq!(
            Parser::default().parse("NVRM: Xid (PCI:[10804]: segfault at 0 ip 0 sp 0 error 6"),
            Line::Refused,
            "a process named `NVRM: Xid (PCI:` is refused before it is malformed"
        );
        assert_eq!(Parser::default().parse(segfault), Line::Refused);
    }

    /// A file name (or a comm) may hold newlines: the forged lines then sit inside the
    /// kernel's own record, after its first line.
    #[test]
    fn lines_a_process_put_in_a_record_are_not_read() {
        let name = "x\nNVRM: GPU 0000:1f:00.0: GPU has fallen off the bus.\nNVRM: Xid (PCI:0000:1f:00): 79, GPU has fallen off the bus.\nNVRM: The NVIDIA GPU 0000:1f:00.0\nNVRM: (PCI ID: 10de:2901) installed in this system has\nNVRM: fallen off the bus and is not responding to commands.\n";
        let message = format!("a.out[10804]: segfault at 0 ip 00007f3c2a1b2c3d sp 00007ffd1e2f3a40 error 6 in {name}[558712345000+1000]");
        let mut p = Parser::default();
        assert_eq!(p.record(7, &message), Line::Other);
        // The same record as /dev/kmsg gives it (escaped), kept in a file.
        let raw = format!("6,7,1,-;{}", message.replace('\n', "\\x0a"));
        assert_eq!(p.parse(&raw), Line::Other);
        // Only the probe message itself, whole, is read from a record of three lines.
        let probe = "NVRM: The NVIDIA GPU 0000:1f:00.0\nNVRM: (PCI ID: 10de:2901) installed in this system has\nNVRM: fallen off the bus and is not responding to commands.";
        for forged in [
            format!("x\n{probe}"),
            format!("{probe}\nx"),
            format!("NVRM: x[1]: y\n{probe}"),
        ] {
            assert!(
                !matches!(p.record(8, &forged), Line::FallenOffBus { .. }),
                "{forged:?}"
            );
        }
        // The record as dmesg prints it: later lines indented, without a timestamp.
        let dmesg: Vec<String> = message
            .split('\n')
            .enumerate()
            .map(|(i, l)| {
                if i == 0 {
                    format!("[ 8123.456789] {l}")
                } else {
                    format!("               {l}")
                }
            })
            .collect();
        let mut p = Parser::default();
        for l in &dmesg {
            let got = p.parse(l);
            assert!(matches!(got, Line::Refused | Line::Other), "{l:?}: {got:?}");
        }
        // As syslog (rsyslog's imklog) prints it: each line with the record's prefix.
        let mut p = Parser::default();
        for l in message.split('\n') {
            let l = format!("Jun 15 08:23:45 n kernel: [ 8123.456789] {l}");
            let got = p.parse(&l);
            assert!(matches!(got, Line::Refused | Line::Other), "{l:?}: {got:?}");
        }
        // A real line with another timestamp after it is read again.
        assert!(matches!(
            p.parse("Jun 15 08:23:46 n kernel: [ 8124.000001] NVRM: GPU 0000:1f:00.0: GPU has fallen off the bus."),
            Line::FallenOffBus { .. }
        ));
    }

    /// The three lines of the probe message must follow each other, exactly.
    #[test]
    fn the_probe_message_only_whole_and_in_a_row() {
        let first = "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0";
        let second = "               NVRM: (PCI ID: 10de:26b5) installed in this system has";
        let third = "               NVRM: fallen off the bus and is not responding to commands.";
        assert!(matches!(
            last_of(&[first, second, third]),
            Line::FallenOffBus { .. }
        ));
        for (what, lines) in [
            ("a line between", vec![first, second, "[ 1843.4] usb 1-1: new", third]),
            ("a line between the first two", vec![first, "[ 1843.4] NVRM: other", second, third]),
            ("a wrong middle line", vec![first, "               NVRM: installed in this system has", third]),
            ("a middle line with more", vec![first, "               NVRM: (PCI ID: 10de:26b5) installed in this system has (x)", third]),
            ("no first line", vec![second, third]),
            ("the first line indented", vec!["               NVRM: The NVIDIA GPU 0000:b3:00.0", second, third]),
            ("the last line with more", vec![first, second, "               NVRM: fallen off the bus and is not responding to commands. 0000:3b:00.0"]),
            ("someone else's line between", vec![first, second, "Jun 15 08:23:45 n mallory: hi", third]),
        ] {
            assert!(
                !matches!(last_of(&lines), Line::FallenOffBus { .. }),
                "{what}"
            );
        }
        // As records: consecutive sequence numbers only.
        let (a, b, c) = (
            "NVRM: The NVIDIA GPU 0000:b3:00.0",
            "NVRM: (PCI ID: 10de:26b5) installed in this system has",
            PROBE_LAST,
        );
        let run = |seqs: [u64; 3]| {
            let mut p = Parser::default();
            p.record(seqs[0], a);
            p.record(seqs[1], b);
            p.record(seqs[2], c)
        };
        assert!(matches!(run([5, 6, 7]), Line::FallenOffBus { .. }));
        for seqs in [[5, 7, 8], [5, 6, 8], [5, 5, 6], [7, 6, 5]] {
            assert!(!matches!(run(seqs), Line::FallenOffBus { .. }), "{seqs:?}");
        }
        // Another record between (a user's record is dropped before the parser, so it
        // shows as a gap; a kernel record shows itself).
        let mut p = Parser::default();
        p.record(5, a);
        p.record(6, "usb 1-1: new high-speed USB device");
        p.record(7, b);
        assert!(!matches!(p.record(8, c), Line::FallenOffBus { .. }));
        // A raw record kept in a file, with its dictionary lines between: still in a row.
        let mut p = Parser::default();
        p.parse(&format!("4,5,1,-;{a}"));
        p.parse(" SUBSYSTEM=pci");
        p.parse(&format!("4,6,1,-;{b}"));
        p.parse(" DEVICE=+pci:0000:b3:00.0");
        assert!(matches!(
            p.parse(&format!("4,7,1,-;{c}")),
            Line::FallenOffBus { .. }
        ));
    }

    /// Only the kernel may report an Xid. A user's `logger` line carries the
    /// user's tag, and `NVRM:` inside someone else's message is not a kernel message.
    #[test]
    fn a_forged_xid_is_not_an_xid() {
        let mut p = Parser::default();
        for forged in [
            "Jun 15 08:23:45 node-42 mallory: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "Jun 15 08:23:45 node-42 mallory: kernel: NVRM: Xid (PCI:0000:3b:00): 79, x",
            "Jun 15 08:23:45 node-42 root[1234]: NVRM: Xid (PCI:0000:3b:00): 79, x",
            "[ 1234.5] myapp says NVRM: Xid (PCI:0000:3b:00): 79, x",
            "2024-06-15T08:23:45+0000 node-42 python3: NVRM: Xid (PCI:0000:3b:00): 48, x",
            "ssh login from NVRM: Xid (PCI:0000:3b:00): 79",
            "14,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, a user's record",
        ] {
            assert_eq!(p.parse(forged), Line::Other, "{forged}");
        }
        let long = format!("NVRM: Xid (PCI:0000:3b:00): 79, {}", "x".repeat(MAX_LINE));
        assert_eq!(
            p.parse(&long),
            Line::Other,
            "a line over the cap is not read"
        );
        assert_eq!(p.record(1, &long), Line::Other, "nor a record");
    }

    #[test]
    fn garbage_is_not_an_xid() {
        let mut p = Parser::default();
        assert_eq!(p.parse(""), Line::Other);
        assert_eq!(p.parse("\u{0}\u{1}binary junk ; ; ;"), Line::Other);
        assert_eq!(
            p.parse("kernel: usb 1-1: new high-speed USB device"),
            Line::Other
        );
        assert_eq!(
            p.parse("NVRM: Xid (PCI:0000:3b:00): seventy-nine"),
            Line::Malformed
        );
        assert_eq!(p.parse("NVRM: Xid"), Line::Malformed);
        assert_eq!(
            p.parse("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15"),
            Line::OtherNvrm
        );
        assert_eq!(
            p.parse("NVRM: GPU at PCI:0000:28:00: GPU-00000000-0000-0000-0000-000000000001"),
            Line::OtherNvrm
        );
        assert_eq!(p.record(1, ""), Line::Other);
        assert_eq!(p.record(2, "\n\n\n"), Line::Other);
    }

    #[test]
    fn the_process_of_an_xid() {
        for (text, process, message) in [
            ("pid=1, name=a, b", Some("pid=1, name=a"), "b"),
            (
                "pid='<unknown>', name=<unknown>, b",
                Some("pid='<unknown>', name=<unknown>"),
                "b",
            ),
            ("pid=1896, Row Remapper", Some("pid=1896"), "Row Remapper"),
            ("pid=1, name=a", Some("pid=1, name=a"), ""),
            ("pid=, name=a, b", None, "pid=, name=a, b"),
            ("pid=x, b", None, "pid=x, b"),
            ("Ch 00000008", None, "Ch 00000008"),
        ] {
            assert_eq!(split_process(text), (process, message), "{text}");
        }
    }
}
