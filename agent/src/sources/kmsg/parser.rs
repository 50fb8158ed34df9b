//! Parsing NVRM kernel log lines: Xid lines in every common prefix format (raw
//! /dev/kmsg records, dmesg with or without -T, syslog, journal) and the Xid-less
//! "has fallen off the bus" messages, single- and multi-line.
//!
//! Only the kernel's own messages count, since an Xid can fail a GPU and evict its
//! work: `NVRM: ` must start the message, after at most the kernel's timestamp; in
//! syslog and journal text the first tag must be `kernel:` (anything a user logs, e.g.
//! `logger 'NVRM: Xid ...'`, carries the user's tag); and a line longer than
//! [`MAX_LINE`] is not read. (/dev/kmsg records of another facility than the kernel's
//! are dropped before they get here.)

use faultline_common::normalize_bus_id;

/// What one line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...`
    Xid {
        xid: u32,
        bus: Option<String>,
        message: String,
    },
    /// A "fallen off the bus" message with no Xid number.
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
}

/// Stateful, because the fallen-off-the-bus message may span lines:
/// `NVRM: The NVIDIA GPU 0000:b3:00.0` / `NVRM: (PCI ID: ...) installed in this system has`
/// / `NVRM: fallen off the bus and is not responding to commands.`
#[derive(Debug, Default)]
pub struct Parser {
    pending_bus: Option<(String, u8)>,
}

/// Longest line read; longer ones are not kernel NVRM messages (counted, dropped).
pub const MAX_LINE: usize = 4096;

/// Strip one leading `[...]` (a dmesg timestamp, relative or `-T`).
fn strip_timestamp(s: &str) -> &str {
    let s = s.trim_start();
    match s.strip_prefix('[').and_then(|r| r.split_once(']')) {
        Some((_, rest)) => rest.trim_start(),
        None => s,
    }
}

/// The kernel message of a line: the line itself (a /dev/kmsg record's text, dmesg
/// with its timestamp), or what follows the `kernel:` tag of a syslog or journal line.
/// `None` when the line is someone else's: its first tag (the first word ending in
/// `:`) is not `kernel:`.
fn kernel_message(line: &str) -> Option<&str> {
    let s = line.trim_start();
    // A raw /dev/kmsg record kept in a file: `prio,seq,usec,flags;message`, the
    // kernel's only when its facility (prio >> 3) is 0.
    if let Some((head, msg)) = s.split_once(';') {
        let mut f = head.split(',');
        let prio = f.next().and_then(|p| p.parse::<u32>().ok());
        let numeric = f.next().is_some_and(|x| x.parse::<u64>().is_ok())
            && f.next().is_some_and(|x| x.parse::<u64>().is_ok());
        if let (Some(prio), true) = (prio, numeric) {
            return (prio >> 3 == 0).then_some(msg);
        }
    }
    if s.starts_with('[') || s.starts_with("NVRM: ") {
        return Some(strip_timestamp(s));
    }
    // `Jun 15 08:23:45 host kernel: ...`, `2024-06-15T08:23:45+0000 host kernel: ...`:
    // the words before the tag (date, time, host) never end in ':'.
    let mut rest = s;
    loop {
        let word_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let word = &rest[..word_end];
        if word.ends_with(':') {
            return (word == "kernel:").then(|| strip_timestamp(&rest[word_end..]));
        }
        if word_end == rest.len() {
            return None;
        }
        rest = rest[word_end..].trim_start();
    }
}

/// The NVRM message of a kernel line: everything after a leading `NVRM: `.
fn nvrm_message(line: &str) -> Option<&str> {
    if line.len() > MAX_LINE {
        return None;
    }
    kernel_message(line)?
        .strip_prefix("NVRM: ")
        .map(str::trim_end)
}

fn bus_in(text: &str) -> Option<String> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ')')
        .filter(|w| w.contains(':'))
        .find_map(|w| normalize_bus_id(w.trim_end_matches(['.', ':'])))
}

impl Parser {
    /// Parse one line.
    pub fn parse(&mut self, line: &str) -> Line {
        let Some(msg) = nvrm_message(line) else {
            return Line::Other;
        };
        if let Some((bus, left)) = self.pending_bus.take() {
            if left > 0 {
                self.pending_bus = Some((bus, left - 1));
            }
        }
        if let Some(rest) = msg.strip_prefix("Xid") {
            if rest.is_empty() || rest.starts_with(' ') {
                return parse_xid(rest.trim_start()).unwrap_or(Line::Malformed);
            }
        }
        if msg.contains("fallen off the bus") {
            let bus = bus_in(msg).or_else(|| self.pending_bus.take().map(|(b, _)| b));
            return Line::FallenOffBus {
                bus,
                message: msg.to_string(),
            };
        }
        // Remember the GPU a multi-line message starts with.
        if let Some(rest) = msg
            .strip_prefix("The NVIDIA GPU ")
            .or_else(|| msg.strip_prefix("GPU at "))
        {
            if let Some(bus) = bus_in(rest) {
                self.pending_bus = Some((bus, 3));
            }
        }
        Line::OtherNvrm
    }
}

/// `(PCI:0000:3b:00): 79, pid=..., name=..., text` after `Xid `.
fn parse_xid(rest: &str) -> Option<Line> {
    let rest = rest.strip_prefix('(')?;
    let (inside, after) = rest.split_once(')')?;
    // The parenthesis holds the bus id, sometimes with a MIG or other suffix after a
    // space: take the first word.
    let bus_word = inside.split_whitespace().next().unwrap_or("");
    let bus = normalize_bus_id(bus_word.trim_end_matches(','));
    let after = after.strip_prefix(':')?.trim_start();
    let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
    let xid: u32 = digits.parse().ok()?;
    let message = after[digits.len()..]
        .trim_start_matches([',', ' '])
        .to_string();
    Some(Line::Xid { xid, bus, message })
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

    #[test]
    fn every_prefix_format() {
        let want = (79, Some("0000:3b:00.0".to_string()));
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
            Line::FallenOffBus { bus, .. } => assert_eq!(bus.as_deref(), Some("0000:b3:00.0")),
            other => panic!("{other:?}"),
        }
    }

    /// Issue 10: only the kernel may report an Xid. A user's `logger` line carries the
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
    }
}
