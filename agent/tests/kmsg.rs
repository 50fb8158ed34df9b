//! Kernel log Xid parsing over real lines from public bug reports (each line's source is
//! cited beside it in tests/data/xid/), forged records and lines that must fail no GPU
//! and the kmsg source end to end.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::*;
use faultline_agent::sources::kmsg::parser::{Line, Parser};
use faultline_common::normalize_bus_id;

/// `(comment, line)` pairs of a data file: each data line follows its `# source:` line.
fn cited_lines(rel: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(test_path(rel)).unwrap();
    let mut out = Vec::new();
    let mut source: Option<String> = None;
    for line in text.lines() {
        if line.starts_with("# source:") {
            source = Some(line.to_string());
        } else if line.starts_with('#') || line.trim().is_empty() {
            continue;
        } else if let Some(s) = source.take() {
            out.push((s, line.to_string()));
        }
    }
    out
}

fn field<'a>(comment: &'a str, key: &str) -> Option<&'a str> {
    comment
        .split(", ")
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
}

/// Parse every cited line of a data file as its `# source:` comment says; the counts
/// of Xid lines, Xid-less fall-offs and negatives.
fn check_cited(rel: &str) -> (usize, usize, usize) {
    let lines = cited_lines(rel);
    let (mut xids, mut implied, mut negatives) = (0, 0, 0);
    for (comment, line) in &lines {
        let got = Parser::default().parse(line);
        let want_bus = field(comment, "bus")
            .and_then(|b| b.split_whitespace().next())
            .and_then(normalize_bus_id);
        match (field(comment, "xid"), field(comment, "implied")) {
            (Some("none"), Some(x)) => {
                assert_eq!(x, "79");
                implied += 1;
                match &got {
                    Line::FallenOffBus { bus, .. } => assert_eq!(bus, &want_bus, "{line}"),
                    other => panic!("{line}\nwant fallen-off-bus, got {other:?}\n{comment}"),
                }
            }
            (Some("none"), None) => {
                negatives += 1;
                assert!(
                    !matches!(got, Line::Xid { .. } | Line::FallenOffBus { .. }),
                    "{line}\nis not an Xid but parsed as {got:?}\n{comment}"
                );
            }
            (Some(n), _) => {
                xids += 1;
                let n: u32 = n.parse().unwrap();
                match &got {
                    Line::Xid { xid, bus, .. } => {
                        assert_eq!(*xid, n, "{line}");
                        assert_eq!(bus, &want_bus, "{line}\n{comment}");
                    }
                    other => panic!("{line}\nwant Xid {n}, got {other:?}\n{comment}"),
                }
            }
            (None, _) => panic!("no xid= in {comment}"),
        }
    }
    (xids, implied, negatives)
}

#[test]
fn every_real_line_parses_as_its_source_says() {
    let (xids, implied, negatives) = check_cited("data/xid/real_lines.txt");
    assert!(
        xids + implied + negatives >= 40,
        "only {} cited lines",
        xids + implied + negatives
    );
    assert!(
        xids >= 30 && implied >= 2 && negatives >= 10,
        "{xids} {implied} {negatives}"
    );
}

/// Verbatim messages in the /dev/kmsg framing, among them the three-line fall-off as
/// the one record the kernel makes of it.
#[test]
fn every_constructed_record_parses_as_its_source_says() {
    let (xids, implied, negatives) = check_cited("data/xid/kmsg_constructed.txt");
    assert_eq!((xids, implied, negatives), (6, 2, 2));
}

/// The blocks of tests/data/xid/forged.txt: `(what, data lines)`.
fn forged_blocks() -> Vec<(String, Vec<String>)> {
    let text = std::fs::read_to_string(test_path("data/xid/forged.txt")).unwrap();
    let mut blocks: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines() {
        if let Some(what) = line.strip_prefix("# === ") {
            blocks.push((what.to_string(), Vec::new()));
        } else if line.starts_with('#') || line.trim().is_empty() {
            continue;
        } else {
            let (_, lines) = blocks.last_mut().expect("a data line before any block");
            lines.push(line.to_string());
        }
    }
    blocks
}

/// A process's records (a segfault of a task named `NVRM: x` in a file named
/// `0001:1f:00.0 fallen off the bus`, the driver's lines in a file name after newlines),
/// the templates with more around them, the three-line message broken up: no Xid, no
/// fall-off, in any framing.
#[test]
fn forged_records_and_lines_fail_no_gpu() {
    let blocks = forged_blocks();
    assert!(blocks.len() >= 20, "only {} blocks", blocks.len());
    for (what, lines) in &blocks {
        assert!(!lines.is_empty(), "{what}: no data");
        let mut p = Parser::default();
        for line in lines {
            let got = p.parse(line);
            assert!(
                !matches!(got, Line::Xid { .. } | Line::FallenOffBus { .. }),
                "{what}\n{line}\nread as {got:?}"
            );
        }
    }
}

#[test]
fn each_fallen_off_the_bus_sequence_names_one_gpu() {
    let text = std::fs::read_to_string(test_path("data/xid/fallen_off_bus.log")).unwrap();
    let mut seqs = 0;
    for seq in text.split("\n# === sequence").skip(1) {
        seqs += 1;
        let comment = seq.lines().find(|l| l.starts_with("# source:")).unwrap();
        let want = normalize_bus_id(field(comment, "bus").unwrap())
            .unwrap_or_else(|| panic!("no bus in {comment}"));
        let mut p = Parser::default();
        let mut buses = std::collections::BTreeSet::new();
        for line in seq.lines().filter(|l| !l.starts_with('#')) {
            match p.parse(line) {
                Line::Xid { xid: 79, bus, .. } | Line::FallenOffBus { bus, .. } => {
                    buses.insert(bus.clone().unwrap_or_else(|| panic!("no bus in {line}")));
                }
                _ => {}
            }
        }
        assert_eq!(
            buses.into_iter().collect::<Vec<_>>(),
            vec![want],
            "sequence {seqs}"
        );
    }
    assert_eq!(seqs, 6);
}

#[test]
fn gsp_timeout_log_has_five_xid_119() {
    let text = std::fs::read_to_string(test_path("data/xid/gsp_timeout_119.log")).unwrap();
    let mut p = Parser::default();
    let n = text
        .lines()
        .filter(|l| matches!(p.parse(l), Line::Xid { xid: 119, .. }))
        .count();
    assert_eq!(n, 5);
}

fn append(path: &std::path::Path, lines: &[&str]) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
}

#[tokio::test]
async fn xid_lines_appended_to_a_log_fail_the_matching_gpu() {
    let state = StateFile::new("device_count=2\n");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("kern.log");
    // Old content is history: a followed file starts at its end.
    std::fs::write(
        &log,
        "Jun 15 08:00:00 n kernel: NVRM: Xid (PCI:0000:28:00): 79, old news\n",
    )
    .unwrap();
    let lib = fake_nvml().to_str().unwrap().to_string();
    let agent = spawn_agent(
        &[
            "--source",
            "nvml,kmsg",
            "--nvml-lib",
            &lib,
            "--kmsg",
            log.to_str().unwrap(),
            // Syslog text fails a GPU only when trusted.
            "--kmsg-trust-text",
            "--interval",
            "100ms",
            "--xid-threshold",
            "13=2/1m",
        ],
        &[("FAKE_NVML_STATE", state.p())],
    );
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 2
    })
    .await;
    append(
        &log,
        &[
            "garbage \u{1} line with no meaning",
            "Jun 15 08:23:45 node-42 kernel: [ 1234.5] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python, Graphics Exception",
            "Jun 15 08:23:46 node-42 kernel: NVRM: Xid (PCI:0000:ff:00): 48, a GPU this node does not have",
        ],
    );
    let doc = wait_for(&agent, Duration::from_secs(5), "xid 13 seen", |d| {
        !device(d, "gpu0").recent_xids.is_empty()
    })
    .await;
    // One Xid 13 is below its "2 in 1m" threshold.
    assert_eq!(status_of(&doc, "gpu0").0, "healthy");
    assert_eq!(doc.unattributed_xids.len(), 1);
    assert_eq!(doc.unattributed_xids[0].xid, 48);
    // Lines of one Xid within a second are one event; this one comes later.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    append(
        &log,
        &["[ 1235.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python, Graphics Exception"],
    );
    wait_for(
        &agent,
        Duration::from_secs(5),
        "gpu0 degraded by two Xid 13",
        |d| status_of(d, "gpu0") == ("degraded".into(), Some("xid-13".into())),
    )
    .await;

    // The multi-line fallen-off-the-bus message, with the Xid 79 line and without.
    append(
        &log,
        &[
            "[ 1843.308145] NVRM: GPU at PCI:0000:28:00: GPU-00000000-0000-0000-0000-000000000001",
            "[ 1843.308150] NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            "[ 1843.308155] NVRM: GPU 0000:28:00.0: GPU has fallen off the bus.",
        ],
    );
    let doc = wait_for(&agent, Duration::from_secs(5), "gpu1 failed", |d| {
        d.summary.failed == 1
    })
    .await;
    let g1 = device(&doc, "gpu1");
    assert_eq!(g1.reason.as_deref(), Some("xid-79"));
    assert_eq!(
        g1.recent_xids.len(),
        1,
        "the two fallen-off lines are one event: {:?}",
        g1.recent_xids
    );
    assert_eq!(g1.recent_xids[0].source, "kmsg");
    let metrics = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        metrics.contains("faultline_agent_kmsg_lines_total{result=\"other\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("faultline_agent_xid_events_total{xid=\"79\",class=\"fatal\""),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_fifo_and_an_unreadable_log() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg.fifo");
    let ok = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(ok.success());
    let agent = spawn_agent(
        &[
            "--source",
            "sim,kmsg",
            "--sim-devices",
            "2",
            "--kmsg",
            fifo.to_str().unwrap(),
            "--kmsg-trust-text",
            "--interval",
            "100ms",
        ],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "two sim GPUs", |d| {
        d.npus.len() == 2
    })
    .await;
    let mut writer = fifo_writer(&fifo).await;
    writeln!(
        writer,
        "6,1234,5678901,-;NVRM: Xid (PCI:0000:19:00): 95, pid=1, name=x, Uncontained: SM"
    )
    .unwrap();
    drop(writer);
    // The sim's gpu1 sits at 0000:19:00.0.
    let doc = wait_for(&agent, Duration::from_secs(5), "gpu1 failed", |d| {
        d.summary.failed == 1
    })
    .await;
    assert_eq!(
        status_of(&doc, "gpu1"),
        ("failed".into(), Some("xid-95".into()))
    );

    let missing = spawn_agent(
        &["--source", "sim,kmsg", "--kmsg", "/nonexistent/kmsg"],
        &[],
    );
    let doc = wait_for(&missing, Duration::from_secs(5), "kmsg down", |d| {
        d.sources.iter().any(|s| s.name == "kmsg" && !s.up)
    })
    .await;
    let src = doc.sources.iter().find(|s| s.name == "kmsg").unwrap();
    assert!(
        src.last_error
            .as_deref()
            .unwrap()
            .contains("/nonexistent/kmsg"),
        "{src:?}"
    );
    // The other source goes on.
    wait_for(
        &missing,
        Duration::from_secs(10),
        "sim devices served",
        |d| d.summary.healthy == 8,
    )
    .await;
}

/// Open `fifo` for writing once the agent has opened it for reading. A blocking open
/// would wait forever if the agent never did; a non-blocking one fails (ENXIO) until it
/// has, so retry with a deadline.
async fn fifo_writer(fifo: &std::path::Path) -> std::fs::File {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo)
        {
            Ok(f) => return f,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the agent never opened the FIFO for reading: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// End to end: every forged record and line of tests/data/xid/forged.txt,
/// written to a running agent's kernel log as the kernel would record them, fails no
/// GPU and reports no Xid at all (most name 0000:1f:00.0, the simulated gpu7); the
/// driver's own records then fail the GPUs they name.
#[tokio::test]
async fn a_process_cannot_fail_a_gpu_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kmsg.fifo");
    let ok = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(ok.success());
    let agent = spawn_agent(
        &[
            "--source",
            "sim,kmsg",
            "--sim-devices",
            "8",
            "--kmsg",
            fifo.to_str().unwrap(),
            "--interval",
            "100ms",
        ],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "eight healthy GPUs", |d| {
        d.summary.healthy == 8
    })
    .await;
    let mut writer = fifo_writer(&fifo).await;
    let forged: Vec<String> = forged_blocks()
        .into_iter()
        .flat_map(|(_, lines)| lines)
        .collect();
    for line in &forged {
        writeln!(writer, "{line}").unwrap();
    }
    // The driver's Xid for gpu1 (0000:19:00.0) marks the end of the forged lines: the
    // agent reads the log in order, one line after the other.
    writeln!(
        writer,
        "4,9001,8200000000,-;NVRM: Xid (PCI:0000:19:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    )
    .unwrap();
    let doc = wait_for(&agent, Duration::from_secs(5), "gpu1 failed", |d| {
        status_of(d, "gpu1").0 == "failed"
    })
    .await;
    assert_eq!(status_of(&doc, "gpu7").0, "healthy");
    assert!(
        device(&doc, "gpu7").recent_xids.is_empty(),
        "{:?}",
        device(&doc, "gpu7").recent_xids
    );
    assert!(
        doc.unattributed_xids.is_empty(),
        "a forged line was read as an Xid: {:?}",
        doc.unattributed_xids
    );
    assert_eq!(
        (doc.summary.failed, doc.summary.healthy),
        (1, 7),
        "only gpu1 failed"
    );
    let metrics = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        metrics.contains("faultline_agent_kmsg_lines_total{result=\"refused\"}"),
        "{metrics}"
    );

    // The driver's own messages: the single-line template for gpu7 (0000:1f:00.0), the
    // probe message, one record of three lines, for gpu6 (0000:1e:00.0).
    writeln!(
        writer,
        "4,9002,8200000001,-;NVRM: GPU 0000:1f:00.0: GPU has fallen off the bus."
    )
    .unwrap();
    writeln!(
        writer,
        "4,9003,8200000002,-;NVRM: The NVIDIA GPU 0000:1e:00.0\\x0aNVRM: (PCI ID: 10de:2330) installed in this system has\\x0aNVRM: fallen off the bus and is not responding to commands."
    )
    .unwrap();
    let doc = wait_for(
        &agent,
        Duration::from_secs(5),
        "gpu7 and gpu6 failed",
        |d| d.summary.failed == 3,
    )
    .await;
    for gpu in ["gpu1", "gpu6", "gpu7"] {
        assert_eq!(
            status_of(&doc, gpu),
            ("failed".into(), Some("xid-79".into())),
            "{gpu}"
        );
    }
    drop(writer);
}

/// A followed kernel log that is rotated (renamed, a new file
/// created) is read again from the new file's start, and one that is truncated in
/// place is read again from its start; nothing written after either is missed.
#[tokio::test]
async fn a_rotated_or_truncated_log_is_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("kern.log");
    std::fs::write(&log, "Jun 15 08:00:00 n kernel: NVRM: loading driver\n").unwrap();
    let agent = spawn_agent(
        &[
            "--source",
            "sim,kmsg",
            "--sim-devices",
            "3",
            "--kmsg",
            log.to_str().unwrap(),
            "--kmsg-trust-text",
            "--interval",
            "100ms",
        ],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "three sim GPUs", |d| {
        d.npus.len() == 3
    })
    .await;
    let xid = |bus: &str| {
        format!("Jun 15 08:23:45 node-42 kernel: NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=x, GPU has fallen off the bus.")
    };
    // The follower has opened the file at its end.
    reaches(&agent, "faultline_agent_kmsg_opens_total", 1).await;
    append(&log, &[&xid("18")]);
    wait_for(&agent, Duration::from_secs(5), "gpu0 failed", |d| {
        status_of(d, "gpu0").0 == "failed"
    })
    .await;
    // Rotation: the old file moves away, a new one starts with an Xid of its own. The
    // new file is whole when it appears (written aside, renamed in) and longer than
    // the old one, so only the inode tells the follower it is another file.
    let old_len = std::fs::metadata(&log).unwrap().len() as usize;
    let mut fresh = String::new();
    while fresh.len() <= old_len {
        fresh.push_str("Jun 15 08:30:00 n kernel: NVRM: loading driver\n");
    }
    fresh.push_str(&format!("{}\n", xid("19")));
    let aside = dir.path().join("kern.log.new");
    std::fs::write(&aside, fresh).unwrap();
    std::fs::rename(&log, dir.path().join("kern.log.1")).unwrap();
    std::fs::rename(&aside, &log).unwrap();
    wait_for(&agent, Duration::from_secs(5), "gpu1 failed", |d| {
        status_of(d, "gpu1").0 == "failed"
    })
    .await;
    // Truncation in place (copytruncate): read from the start again, once the
    // follower has seen it (it reopens the file from its start).
    let from_start = r#"faultline_agent_kmsg_opens_total{from="start"}"#;
    let reopened = metric(&agent, from_start).await;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log)
        .unwrap()
        .set_len(0)
        .unwrap();
    reaches(&agent, from_start, reopened + 1).await;
    append(&log, &[&xid("1a")]);
    let doc = wait_for(&agent, Duration::from_secs(5), "gpu2 failed", |d| {
        status_of(d, "gpu2").0 == "failed"
    })
    .await;
    assert_eq!(doc.summary.failed, 3);
}

/// Any process can log a line tagged `kernel:` to syslog
/// (`logger -t kernel`, rsyslog 8). Followed without `--kmsg-trust-text`, such a line
/// in the driver's exact template degrades the GPU at most (a fatal Xid counts as a
/// restart-app one, here at a threshold of one), and never fails it.
#[tokio::test]
async fn a_syslog_kernel_tag_degrades_at_most() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("syslog");
    std::fs::write(&log, "").unwrap();
    let agent = spawn_agent(
        &[
            "--source",
            "sim,kmsg",
            "--sim-devices",
            "2",
            "--kmsg",
            log.to_str().unwrap(),
            "--xid-restart-app",
            "1/10m",
            "--interval",
            "100ms",
        ],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "two healthy GPUs", |d| {
        d.summary.healthy == 2
    })
    .await;
    // gpu1 of the sim is 0000:19:00.0.
    append(
        &log,
        &["Dec  2 10:00:00 node-7 kernel: NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=x, GPU has fallen off the bus."],
    );
    let doc = wait_for(&agent, Duration::from_secs(5), "gpu1 degraded", |d| {
        status_of(d, "gpu1").0 == "degraded"
    })
    .await;
    // Its reason says where it came from: the aggregator never fails it by time.
    assert_eq!(
        status_of(&doc, "gpu1"),
        ("degraded".into(), Some("xid-79-text-log".into()))
    );
    assert_eq!(doc.summary.failed, 0, "text never fails a GPU by default");
    let metrics = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        metrics.contains("faultline_agent_kmsg_lines_total{result=\"capped\"} 1"),
        "{metrics}"
    );
}
