//! The aggregator binary in a process of its own: it binds a port of its choosing (no
//! window between a probe and its bind for another socket to take the port), and its
//! log goes to a file whose last lines a failing test prints, with the process's exit
//! status if it had ended: a wait that times out says what the replica did meanwhile.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use faultline_common::testing::ChildGuard;

use super::Launch;

/// A running aggregator process and its log.
pub struct AggregatorProcess {
    child: ChildGuard,
    log: PathBuf,
}

impl AggregatorProcess {
    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.0.id()
    }

    /// Panics, with its log, if the process has ended.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.0.try_wait() {
            panic!("the aggregator process ended ({status})");
        }
    }

    /// Stop it as Kubernetes does (SIGTERM) and wait for its exit, at most `within`.
    pub async fn stop(mut self, within: std::time::Duration) -> std::process::ExitStatus {
        let pid = self.id().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "still running {within:?} after SIGTERM"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    fn tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for AggregatorProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let status = match self.child.0.try_wait() {
                Ok(Some(s)) => format!("ended: {s}"),
                _ => "still running".to_string(),
            };
            eprintln!(
                "--- the aggregator process ({status}), the last 60 lines of {}:\n{}\n---",
                self.log.display(),
                self.tail(60)
            );
        }
    }
}

/// The aggregator binary, launched as `launch` says on a loopback port it picks: the
/// process, and its API's base URL (read from its "running" log line).
pub async fn aggregator_process(launch: Launch) -> (AggregatorProcess, String) {
    aggregator_process_env(launch, &[]).await
}

/// [`aggregator_process`], with these environment variables too.
pub async fn aggregator_process_env(
    launch: Launch,
    env: &[(&str, String)],
) -> (AggregatorProcess, String) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("aggregator-logs");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join(format!(
        "{}-{}.log",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let args = launch.set("--listen", "127.0.0.1:0").into_args();
    let child = Command::new(env!("CARGO_BIN_EXE_faultline-aggregator"))
        .args(&args)
        .env("NO_COLOR", "1")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut p = AggregatorProcess {
        child: ChildGuard(child),
        log,
    };
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(&p.log).unwrap_or_default();
        if let Some(addr) = text
            .lines()
            .filter(|l| l.contains("faultline aggregator running"))
            .find_map(listen_addr)
        {
            return (p, format!("http://{addr}"));
        }
        p.assert_running();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the aggregator did not say where it listens within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `addr=` of a log line (`NO_COLOR` set: no ANSI sequences).
fn listen_addr(line: &str) -> Option<String> {
    let at = line.find("addr=")? + "addr=".len();
    let addr = line[at..].split_whitespace().next()?;
    addr.parse::<std::net::SocketAddr>()
        .ok()
        .map(|a| a.to_string())
}
