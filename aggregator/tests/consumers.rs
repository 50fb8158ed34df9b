//! The consumer kit (`consumers/`) against the real file sink, laid out as kubelet lays
//! out a ConfigMap volume (`..data` swapped by rename, `atomic_writer.go`), while the
//! documents change under it; and against the agent's node file, replaced by rename as
//! on a hostPath. Each consumer (Python, shell/jq, the Rust crate, the Go module's
//! command, the example Job) ignores other nodes' faults and reacts to its own node's
//! failed device. Then the node's own `fault.json`, delivered by the aggregator to the
//! agent: read from the agent's `--fault-dir` (the hostPath way) and from the copy the
//! Python kit's follow mode keeps from `--fault-listen` (the sidecar way), fresh, failed
//! and stale.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use support::*;

fn need(tool: &str) {
    let found = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(found, "{tool} is needed (.ci/run installs it)");
}

/// A consumer's process and the lines it has printed, read as they come.
struct Consumer {
    child: ChildGuard,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

fn spawn(cmd: &mut Command) -> Consumer {
    let mut child = ChildGuard(
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let out = child.0.stdout.take().unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let seen = lines.clone();
    let reader = std::thread::spawn(move || {
        for l in std::io::BufRead::lines(std::io::BufReader::new(out)).map_while(Result::ok) {
            seen.lock().unwrap().push(l);
        }
    });
    Consumer {
        child,
        lines,
        reader: Some(reader),
    }
}

impl Consumer {
    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Wait (at most `within`) until the consumer printed `line`: it has read a
    /// document that says so.
    async fn printed(&self, line: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.lines().iter().any(|l| l == line) {
            assert!(
                Instant::now() < deadline,
                "no {line:?} within {within:?}: {:?}",
                self.lines()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn python(args: &[&str]) -> Consumer {
    spawn(
        Command::new("python3")
            .arg(repo_root().join("consumers/python/faultline_consumer.py"))
            .args(args),
    )
}

fn shell(args: &[&str]) -> Consumer {
    spawn(Command::new(repo_root().join("consumers/shell/faultline-watch.sh")).args(args))
}

/// The Go consumer's `faultline-watch` (`consumers/go`), built once per test process.
/// `None` where `go` is missing and `CI` is unset: then `test` skips its Go consumer.
fn go_binary(test: &str) -> Option<&'static Path> {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let what = format!("{test}, its Go consumer");
    if !faultline_common::testing::have_tool(&what, "go", &["version"], "Go 1.26") {
        return None;
    }
    let bin = BUILT.get_or_init(|| {
        let bin = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-consumer/faultline-watch");
        // No VCS stamp: it would run git on the checkout, which a CI container may
        // refuse (another owner), and the binary needs none.
        let status = Command::new("go")
            .args(["build", "-buildvcs=false", "-o"])
            .arg(&bin)
            .arg("./cmd/faultline-watch")
            .current_dir(repo_root().join("consumers/go"))
            .status()
            .unwrap();
        assert!(status.success(), "go build in consumers/go: {status}");
        bin
    });
    Some(bin.as_path())
}

/// The Go consumer with `args`, when it was built.
fn go(bin: Option<&Path>, args: &[&str]) -> Option<Consumer> {
    bin.map(|bin| spawn(Command::new(bin).args(args)))
}

fn train(dir: &Path, ckpt: &Path) -> Consumer {
    spawn(
        Command::new("python3")
            .arg(repo_root().join("consumers/job/train.py"))
            .env("NODE_NAME", "n2")
            .env("FAULTLINE_DIR", dir)
            .env("CHECKPOINT_DIR", ckpt)
            .env("STEP_SECONDS", "0.01")
            .env("CHECKPOINT_EVERY", "10"),
    )
}

/// Wait (at most `within`) for the child to exit; its exit code and standard output.
async fn exited(c: &mut Consumer, what: &str, within: Duration) -> (Option<i32>, String) {
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(s) = c.child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not exit within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Exited: its output ends; every line is in.
    if let Some(r) = c.reader.take() {
        r.join().unwrap();
    }
    let out: String = c.lines().iter().map(|l| format!("{l}\n")).collect();
    (status.code(), out)
}

fn running(c: &mut Consumer) -> bool {
    c.child.0.try_wait().unwrap().is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_consumer_reacts_to_its_own_nodes_failed_device_while_documents_change() {
    need("python3");
    need("jq");
    // Built before the cluster starts: a cold build takes a while.
    let go_bin =
        go_binary("every_consumer_reacts_to_its_own_nodes_failed_device_while_documents_change");
    let host = tempfile::tempdir().unwrap();
    let health_file = host.path().join("health.json");
    let (a1, a2) = (agent("n1").await, agent("n2").await);
    let a3 = agent_with("n3", &["--health-file", health_file.to_str().unwrap()]).await;
    let out = tempfile::tempdir().unwrap();
    let dir = out.path();
    let _agg = Launch::file(&[&a1, &a2, &a3], dir).start().await;
    until(
        Duration::from_secs(20),
        "n2 and n3 published healthy",
        || {
            let t = std::fs::read_to_string(dir.join("n2.json")).ok()?;
            let t: serde_json::Value = serde_json::from_str(&t).ok()?;
            let f = std::fs::read_to_string(&health_file).ok()?;
            (t["summary"]["healthy"] == 4 && f.contains("\"n3\"")).then_some(())
        },
    )
    .await;
    let d = dir.to_str().unwrap();
    let f = health_file.to_str().unwrap();
    let on_n2 = ["--node", "n2", "--exit-on-failed", "--interval", "0.1"];
    let mut py = python(&[&["--dir", d][..], &on_n2].concat());
    let mut sh = shell(&[&["--dir", d][..], &on_n2].concat());
    let mut py_file = python(&["--file", f, "--exit-on-failed", "--interval", "0.1"]);
    let mut sh_file = shell(&["--file", f, "--exit-on-failed", "--interval", "0.1"]);
    let mut go_dir = go(go_bin, &[&["--dir", d][..], &on_n2].concat());
    let mut go_file = go(
        go_bin,
        &["--file", f, "--exit-on-failed", "--interval", "0.1"],
    );
    let ckpt = tempfile::tempdir().unwrap();
    let mut job = train(dir, ckpt.path());
    let rust_dir = dir.to_path_buf();
    let rust = tokio::task::spawn_blocking(move || {
        let mut w = faultline_consumer::Watch::entry(&rust_dir, "n2").unwrap();
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(40);
        while Instant::now() < deadline {
            if let Some(Some(e)) = w.next(Duration::from_secs(1)).unwrap() {
                let failed: Vec<String> = e.failed().iter().map(|d| d.id.clone()).collect();
                seen.push(failed.clone());
                if !failed.is_empty() {
                    return (seen, e);
                }
            }
        }
        panic!("the Rust consumer saw no failed device: {seen:?}");
    });

    // Another node's device fails: the shard's documents are rewritten (..data swapped)
    // and no consumer of n2 or n3 reacts.
    let data_before = std::fs::read_link(dir.join("..data")).unwrap();
    fail(&a1, "gpu3").await;
    until(Duration::from_secs(10), "n1's failure published", || {
        let t = std::fs::read_to_string(dir.join("n1.json")).ok()?;
        let t: serde_json::Value = serde_json::from_str(&t).ok()?;
        (t["summary"]["failed"] == 1).then_some(())
    })
    .await;
    assert_ne!(
        std::fs::read_link(dir.join("..data")).unwrap(),
        data_before,
        "the file sink swapped ..data while the consumers watched"
    );
    // Whether a consumer reacted to n1's fault is judged when each exits below: from
    // now on every document holds n1's failed device, so the one each exits on does
    // too, and each must name only its own node's device, printed last.

    // n2's gpu1 and n3's gpu2 fail.
    fail(&a2, "gpu1").await;
    fail(&a3, "gpu2").await;
    let within = Duration::from_secs(15);
    let go_ones = [
        go_dir.as_mut().map(|c| (c, "go", "n2", "gpu1")),
        go_file.as_mut().map(|c| (c, "go --file", "n3", "gpu2")),
    ];
    for (c, what, node, dev) in [
        (&mut py, "python", "n2", "gpu1"),
        (&mut sh, "shell", "n2", "gpu1"),
        (&mut py_file, "python --file", "n3", "gpu2"),
        (&mut sh_file, "shell --file", "n3", "gpu2"),
    ]
    .into_iter()
    .chain(go_ones.into_iter().flatten())
    {
        let (code, text) = exited(c, what, within).await;
        assert_eq!(code, Some(3), "{what}: {text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], format!("{node} gpu0 healthy -"), "{what}: {text}");
        assert_eq!(
            *lines.last().unwrap(),
            format!("FAILED {node} {dev} row-remap-failure"),
            "{what}: {text}"
        );
        assert!(
            !text.contains("n1 "),
            "{what} printed another node's devices: {text}"
        );
    }
    let (seen, entry) = tokio::time::timeout(within, rust).await.unwrap().unwrap();
    assert_eq!(seen[0], Vec::<String>::new(), "first: all healthy");
    assert_eq!(entry.node, "n2");
    assert_eq!(entry.failed()[0].id, "gpu1");
    assert_eq!(
        entry.failed()[0].reason.as_deref(),
        Some("row-remap-failure")
    );

    // The example Job: checkpoint, exit 42; the next pod resumes from the checkpoint.
    let (code, text) = exited(&mut job, "train.py", within).await;
    assert_eq!(code, Some(42), "{text}");
    assert!(
        text.contains("device failed on n2: gpu1 (row-remap-failure)"),
        "{text}"
    );
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.path().join("ckpt.json")).unwrap()).unwrap();
    let step = saved["step"].as_u64().unwrap();
    assert!(step > 0, "it trained before the fault: {saved}");
    let mut again = train(dir, ckpt.path());
    let (code, text) = exited(&mut again, "train.py again", within).await;
    assert_eq!(code, Some(42), "{text}");
    assert!(
        text.starts_with(&format!("resumed from step {step}\n")),
        "{text}"
    );
}

/// The first `n` lines the consumer prints (at most `within`).
async fn first_lines(c: &Consumer, n: usize, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    while c.lines().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.lines().into_iter().take(n).collect()
}

fn own_file(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kit_reads_the_nodes_own_fault_json_from_the_host_and_through_the_sidecar() {
    need("python3");
    need("jq");
    // Built before the agent starts: a cold build takes a while.
    let go_bin =
        go_binary("the_kit_reads_the_nodes_own_fault_json_from_the_host_and_through_the_sidecar");
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    std::fs::write(&token, "kit-delivery-token\n").unwrap();
    // The host's /run/faultline/node, and the emptyDir the sidecar writes.
    let (host, empty) = (tmp.path().join("node"), tmp.path().join("config"));
    std::fs::create_dir(&host).unwrap();
    std::fs::create_dir(&empty).unwrap();
    let agent = agent_with(
        "n1",
        &[
            "--fault-dir",
            host.to_str().unwrap(),
            "--fault-listen",
            "127.0.0.1:0",
            "--delivery-token-file",
            token.to_str().unwrap(),
        ],
    )
    .await;
    let pod_port = agent.fault_addr.expect("--fault-listen bound");
    let out = tempfile::tempdir().unwrap();
    let agg = Launch::file_following(&format!("n1=http://{}", agent.addr), out.path())
        .args(&[
            "--delivery-token-file",
            token.to_str().unwrap(),
            "--delivery-confirm",
            "500ms",
        ])
        .start()
        .await;
    let (hosted, copied) = (host.join("fault.json"), empty.join("fault.json"));
    let fresh_and_healthy = |p: &Path| {
        own_file(p).filter(|d| d["verdict"]["stale"] == false && d["summary"]["healthy"] == 4)
    };
    until(
        Duration::from_secs(20),
        "a fresh verdict on the host",
        || fresh_and_healthy(&hosted),
    )
    .await;

    // The sidecar: the follow mode keeps the emptyDir's copy.
    let url = format!("http://{pod_port}/v1/fault");
    let e = empty.to_str().unwrap().to_string();
    let sidecar = ChildGuard(
        Command::new("python3")
            .arg(repo_root().join("consumers/python/faultline_consumer.py"))
            .args(["--url", &url, "--write", &format!("{e}/fault.json")])
            .env("NODE_NAME", "n1")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    until(Duration::from_secs(10), "the sidecar's copy, fresh", || {
        fresh_and_healthy(&copied)
    })
    .await;

    let (h, c) = (hosted.to_str().unwrap(), copied.to_str().unwrap());
    let flags = ["--exit-on-failed", "--interval", "0.1"];
    let mut py = python(&[&["--file", h][..], &flags].concat());
    let mut sh = shell(&[&["--file", h][..], &flags].concat());
    let mut py_copy = python(&[&["--file", c][..], &flags].concat());
    let mut go_host = go(go_bin, &[&["--file", h][..], &flags].concat());
    let mut seed = spawn(
        Command::new("python3")
            .arg(repo_root().join("tests/consumer/run_consumer.py"))
            .arg(&hosted)
            .env("NODE_NAME", "n1"),
    );
    let rust_copy = copied.clone();
    let (read_healthy, healthy_read) = std::sync::mpsc::channel();
    let rust = tokio::task::spawn_blocking(move || {
        let mut w = faultline_consumer::Watch::file(&rust_copy).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(Some(e)) = w.next(Duration::from_secs(1)).unwrap() {
                if !e.failed().is_empty() {
                    return e;
                }
                let _ = read_healthy.send(());
            }
        }
        panic!("the Rust consumer saw no failed device in the sidecar's copy");
    });
    // Each has read the healthy document before the fault (seed 003's prints nothing
    // then; what it prints on exit is judged below).
    let within = Duration::from_secs(15);
    for (c, what) in [
        (&py, "python"),
        (&sh, "shell"),
        (&py_copy, "python, the copy"),
    ]
    .into_iter()
    .chain(go_host.as_ref().map(|c| (c, "go")))
    {
        c.printed("n1 gpu3 healthy -", within).await;
        eprintln!("{what} read the healthy document");
    }
    healthy_read
        .recv_timeout(within)
        .expect("the Rust consumer read the healthy document");
    for (c, what) in [
        (&mut py, "python"),
        (&mut sh, "shell"),
        (&mut py_copy, "python, the copy"),
        (&mut seed, "seed 003"),
    ]
    .into_iter()
    .chain(go_host.as_mut().map(|c| (c, "go")))
    {
        assert!(running(c), "{what} exited while all was healthy");
    }

    // n1's gpu1 fails: every consumer of the host's file and of the copy exits on it.
    fail(&agent, "gpu1").await;
    for (c, what) in [
        (&mut py, "python"),
        (&mut sh, "shell"),
        (&mut py_copy, "python, the copy"),
    ]
    .into_iter()
    .chain(go_host.as_mut().map(|c| (c, "go")))
    {
        let (code, text) = exited(c, what, within).await;
        assert_eq!(code, Some(3), "{what}: {text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "n1 gpu0 healthy -", "{what}: {text}");
        assert_eq!(
            *lines.last().unwrap(),
            "FAILED n1 gpu1 row-remap-failure",
            "{what}: {text}"
        );
    }
    let (code, text) = exited(&mut seed, "seed 003", within).await;
    assert_eq!(code, Some(1), "{text}");
    assert_eq!(
        text.trim(),
        "CRITICAL: NPU gpu1 failed, reason: row-remap-failure"
    );
    let e = tokio::time::timeout(within, rust).await.unwrap().unwrap();
    assert_eq!((e.node.as_str(), e.stale), ("n1", None));
    assert_eq!(e.failed()[0].id, "gpu1");

    // The aggregator goes: the agent turns the verdict stale, the sidecar copies it, and
    // the kit says so; the failed device stays failed, no device reads healthy.
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
    for (p, what) in [(&hosted, "the host's file"), (&copied, "the copy")] {
        until(Duration::from_secs(10), &format!("{what} stale"), || {
            own_file(p).filter(|d| d["verdict"]["stale"] == true)
        })
        .await;
    }
    let want = [
        "n1 - unknown verdict-stale",
        "n1 gpu0 unknown verdict-stale",
        "n1 gpu1 failed row-remap-failure",
        "n1 gpu2 unknown verdict-stale",
        "n1 gpu3 unknown verdict-stale",
    ];
    for (c, what) in [
        (python(&["--file", h]), "python"),
        (shell(&["--file", h]), "shell"),
        (python(&["--file", c]), "python, the copy"),
    ]
    .into_iter()
    .chain(go(go_bin, &["--file", h]).map(|c| (c, "go")))
    {
        assert_eq!(first_lines(&c, want.len(), within).await, want, "{what}");
    }
    let e = faultline_consumer::read(&copied, Some("n1"), &[])
        .unwrap()
        .unwrap();
    assert_eq!(e.stale, Some(faultline_consumer::Stale::Unconfirmed));
    drop(sidecar);
    agent.shutdown().await;
}
