//! Property tests for the agent's parsers: the kernel log, npu-smi's text
//! and the exec source's JSON. None panics on any input; output is bounded; and an Xid
//! is found only where `NVRM:` starts a kernel message.

use faultline_agent::sources::kmsg::parser::{Line, Parser, MAX_LINE};
use faultline_agent::sources::kmsg::{parse_record, unescape};
use faultline_agent::sources::{exec, npu_smi::parser as smi};
use proptest::prelude::*;

/// Lines that look like the kernel's, a syslog file's, a journal's or a user's.
fn line() -> impl Strategy<Value = String> {
    let prefix = prop::sample::select(vec![
        "",
        "[12345.678901] ",
        "Jun 15 08:23:45 host kernel: ",
        "Jun 15 08:23:45 host myapp: ",
        "2024-06-15T08:23:45+0000 host kernel: ",
        "4,123,456,-;",
        "12,123,456,-;",
        "14,1,2,-;",
        "x,y,z;",
    ]);
    let body = prop::sample::select(vec![
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error",
        "NVRM: Xid 13",
        "NVRM: Xid (PCI:zz): x",
        "user says NVRM: Xid (PCI:0000:3b:00): 79, forged",
        "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus.",
        "NVRM: os_schedule: Attempted to yield",
        "usb 1-1: new device",
    ]);
    (prefix, body, ".{0,40}").prop_map(|(p, b, tail)| format!("{p}{b}{tail}"))
}

/// The message a kernel-log line carries, if the kernel wrote it (the parser's own
/// rule, restated): a kmsg record of facility 0, a `kernel:` tag, or a bare line.
fn is_kernel_nvrm(line: &str) -> bool {
    let s = line.trim_start();
    // A kmsg record (`prio,seq,usec,...;message`): the kernel's only at facility 0.
    if let Some((head, msg)) = s.split_once(';') {
        let f: Vec<&str> = head.split(',').collect();
        if f.len() >= 3 && f[1].parse::<u64>().is_ok() && f[2].parse::<u64>().is_ok() {
            if let Ok(p) = f[0].parse::<u32>() {
                return p >> 3 == 0 && nvrm_xid(msg);
            }
        }
    }
    // A bare kernel line, or the kernel's tag in syslog or journal text.
    if s.starts_with('[') || s.starts_with("NVRM: ") {
        return nvrm_xid(s);
    }
    match s.split_once(" kernel: ") {
        Some((before, msg)) if !before.split_whitespace().any(|w| w.ends_with(':')) => {
            nvrm_xid(msg)
        }
        _ => false,
    }
}

/// `NVRM: Xid` starts the message (after a `[timestamp]`, if any).
fn nvrm_xid(msg: &str) -> bool {
    let msg = msg.trim_start();
    let msg = match msg.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or(msg, |(_, m)| m.trim_start()),
        None => msg,
    };
    msg.starts_with("NVRM: Xid")
}

proptest! {
    /// Any text: no panic.
    #[test]
    fn kmsg_never_panics(raw in ".{0,300}") {
        let _ = Parser::default().parse(&raw);
        let _ = parse_record(&raw);
        let _ = unescape(&raw);
    }

    /// An Xid only where `NVRM: Xid` starts a kernel message; its message is bounded.
    #[test]
    fn xids_only_from_the_kernel(l in line()) {
        if let Line::Xid { message, .. } = Parser::default().parse(&l) {
            prop_assert!(is_kernel_nvrm(&l), "an Xid from {l:?}");
            prop_assert!(message.len() <= MAX_LINE);
        }
    }

    /// A line over the cap is never read, whatever it says.
    #[test]
    fn long_lines_are_not_read(pad in MAX_LINE..MAX_LINE + 200) {
        let l = format!("NVRM: Xid (PCI:0000:3b:00): 79, {}", "x".repeat(pad));
        prop_assert!(matches!(Parser::default().parse(&l), Line::Other));
    }

    /// npu-smi's text: no panic; at most one chip per line.
    #[test]
    fn npu_smi_never_panics(raw in "(.{0,60}\n){0,20}") {
        if let Ok(chips) = smi::parse_info(&raw) {
            prop_assert!(chips.len() <= raw.lines().count());
        }
        let _ = smi::parse_health(&raw);
        let _ = smi::parse_common(&raw);
        let _ = smi::parse_ecc(&raw);
    }

    /// The exec source's JSON: no panic on any text, and at most one reading per JSON
    /// object in it.
    #[test]
    fn exec_json_never_panics(raw in ".{0,200}") {
        if let Ok(r) = exec::parse(&raw) {
            let objects = raw.matches('{').count();
            prop_assert!(r.len() <= objects, "{} readings from {:?}", r.len(), raw);
        }
    }

    /// JSON shaped like the exec source's, with odd values: no panic.
    #[test]
    fn exec_json_shapes(id in ".{0,20}", t in any::<f64>(), status in ".{0,10}") {
        let doc = serde_json::json!({"devices": [{"id": id, "temperature_c": if t.is_finite() { serde_json::json!(t) } else { serde_json::Value::Null }, "status": status}]});
        let _ = exec::parse(&doc.to_string());
        let _ = exec::parse(&serde_json::json!([{"id": id}]).to_string());
    }
}
