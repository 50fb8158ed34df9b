//! Parsing NVRM kernel log lines: Xid lines in every common prefix format (raw
//! /dev/kmsg records, dmesg with or without -T, syslog, journal) and the Xid-less
//! "has fallen off the bus" messages, single- and multi-line.

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

/// The NVRM message of a line, whatever the prefix: everything after `NVRM: `.
fn nvrm_message(line: &str) -> Option<&str> {
    let i = line.find("NVRM: ")?;
    Some(line[i + 6..].trim_end())
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
