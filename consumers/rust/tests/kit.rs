//! The consumer kit in `cargo test`: the Python kit's own tests
//! (`consumers/python/test_faultline_consumer.py`: its follow mode against a small
//! HTTP server that streams NDJSON, staleness), and the three command-line consumers
//! (Python, shell/jq, `faultline-watch`) printing the same lines for the same node's own
//! `fault.json`, fresh, stale, aged and before any verdict. The kit against a real agent
//! and aggregator: `aggregator/tests/consumers.rs`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn need(tool: &str) {
    let found = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(found, "{tool} is needed (.ci/run installs it)");
}

#[test]
fn the_python_kits_own_tests_pass() {
    need("python3");
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(repo().join("consumers/python"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    // The follow mode's test ran (and, with the status, passed).
    assert!(
        text.lines().any(
            |l| l.starts_with("test_the_written_file_is_the_last_documents_line ")
                && l.ends_with(" ok")
        ),
        "{text}"
    );
}

/// Kills the child when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Run `cmd` until it printed `n` lines (at most `within`); its lines and, if it exits
/// within `linger` after them, its exit status.
fn lines_of(
    cmd: &mut Command,
    n: usize,
    within: Duration,
    linger: Duration,
) -> (Vec<String>, Option<i32>) {
    let mut child = Running(
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let (tx, rx) = mpsc::channel();
    let out = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let deadline = Instant::now() + within;
    let mut lines = Vec::new();
    while lines.len() < n {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(l) => lines.push(l),
            Err(_) => break,
        }
    }
    let end = Instant::now() + linger;
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s.code();
        }
        if Instant::now() > end {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (lines, status)
}

/// A node's own `fault.json` as its agent serves it.
fn own(devices: &[(&str, Option<&str>)], verdict: &str) -> String {
    let npus: Vec<String> = devices
        .iter()
        .enumerate()
        .map(|(i, (s, r))| {
            let r = r.map_or("null".to_string(), |r| format!("{r:?}"));
            format!(r#"{{"id":"gpu{i}","status":"{s}","reason":{r},"since":"2026-01-01T00:00:00.000Z","uuid":"GPU-{i}"}}"#)
        })
        .collect();
    format!(
        r#"{{"version":"faultline.fault/v1","timestamp":"2026-01-01T00:00:00.000Z","node":"n1",
        "agent":{{"reachable":true}},"npus":[{}],
        "summary":{{"total":0,"healthy":0,"degraded":0,"failed":0,"unknown":0}},
        "readings_at":"2026-01-01T00:00:00.000Z","verdict":{verdict}}}"#,
        npus.join(",")
    )
}

/// `doc` with a drain intent for pod `pod` (UID `uid`) of namespace `ml`.
fn with_drain(doc: String, uid: &str, pod: &str) -> String {
    doc.replace(
        r#""verdict":"#,
        &format!(
            r#""drain":[{{"namespace":"ml","pod":"{pod}","uid":"{uid}","devices":["gpu0"],"reason":"xid-79","requested":"2026-01-01T00:00:00.000Z","evict_after":"2026-01-01T00:05:00.000Z"}}],"verdict":"#
        ),
    )
}

#[test]
fn every_consumer_prints_the_same_lines_for_the_nodes_own_fault_json() {
    need("python3");
    need("jq");
    // Confirmed far ahead (fresh for the test's life) or long ago (aged: nobody rewrote it).
    let fresh = r#"{"writer":"agg-0","sequence":3,"published":"2026-01-01T00:00:00.000Z","confirmed":"2999-01-01T00:00:00.000Z","stale":false,"stale_after_s":30}"#;
    let aged = fresh.replace("2999", "2000");
    let said = fresh.replace("\"stale\":false", "\"stale\":true");
    let none = r#"{"sequence":0,"stale":true,"stale_after_s":60}"#;
    let cases: Vec<(&str, String, Vec<&str>, Option<i32>)> = vec![
        (
            "fresh",
            own(&[("healthy", None), ("degraded", Some("thermal"))], fresh),
            vec!["n1 gpu0 healthy -", "n1 gpu1 degraded thermal"],
            None,
        ),
        (
            "stale, as the agent says",
            own(
                &[
                    ("unknown", Some("verdict-stale")),
                    ("failed", Some("xid-79")),
                ],
                &said,
            ),
            vec![
                "n1 - unknown verdict-stale",
                "n1 gpu0 unknown verdict-stale",
                "n1 gpu1 failed xid-79",
                "FAILED n1 gpu1 xid-79",
            ],
            Some(3),
        ),
        (
            "stale by its age",
            own(&[("healthy", None), ("degraded", Some("thermal"))], &aged),
            vec![
                "n1 - unknown verdict-stale",
                "n1 gpu0 unknown verdict-stale",
                "n1 gpu1 degraded thermal",
            ],
            None,
        ),
        (
            "no verdict yet",
            own(&[("unknown", Some("no-verdict"))], none),
            vec!["n1 - unknown no-verdict", "n1 gpu0 unknown no-verdict"],
            None,
        ),
        (
            "another pod's drain intent",
            with_drain(own(&[("degraded", Some("thermal"))], fresh), "u-1", "t1"),
            vec![
                "n1 gpu0 degraded thermal",
                "n1 - drain ml/t1 2026-01-01T00:05:00.000Z xid-79",
            ],
            None,
        ),
        (
            "this pod's drain intent",
            with_drain(own(&[("degraded", Some("thermal"))], fresh), "u-9", "t9"),
            vec![
                "n1 gpu0 degraded thermal",
                "n1 - drain ml/t9 2026-01-01T00:05:00.000Z xid-79",
                "DRAIN ml/t9 evict_after=2026-01-01T00:05:00.000Z xid-79",
            ],
            Some(4),
        ),
    ];
    let dir = std::env::temp_dir().join(format!("faultline-kit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("fault.json");
    let file = path.to_str().unwrap();
    let args = [
        "--file",
        file,
        "--exit-on-failed",
        "--pod-uid",
        "u-9",
        "--exit-on-drain",
    ];
    for (what, doc, want, exit) in &cases {
        std::fs::write(&path, doc).unwrap();
        let consumers: [(&str, Command); 3] = [
            ("python", {
                let mut c = Command::new("python3");
                c.arg(repo().join("consumers/python/faultline_consumer.py"))
                    .args(args);
                c
            }),
            ("shell", {
                let mut c = Command::new(repo().join("consumers/shell/faultline-watch.sh"));
                c.args(args);
                c
            }),
            ("rust", {
                let mut c = Command::new(env!("CARGO_BIN_EXE_faultline-watch"));
                c.args(args);
                c
            }),
        ];
        for (who, mut cmd) in consumers {
            // One that must exit gets 5 s for it; one that must keep watching, 0.3 s.
            let linger = Duration::from_millis(if exit.is_some() { 5000 } else { 300 });
            let (lines, status) = lines_of(
                cmd.env_remove("NODE_NAME"),
                want.len(),
                Duration::from_secs(10),
                linger,
            );
            assert_eq!(lines, *want, "{who}, {what}");
            assert_eq!(status, *exit, "{who}, {what}: exit status");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
