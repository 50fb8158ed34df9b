//! Running a vendor tool as a child process, bounded: the whole process group is killed
//! when the timeout passes, and output is capped so a runaway tool cannot eat memory.
#![allow(unsafe_code)]

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::ProbeError;

/// Largest stdout we keep; anything past it is a parse error.
pub const MAX_STDOUT: usize = 4 << 20;
const MAX_STDERR: usize = 16 << 10;

/// Children killed because they ran past their timeout, since start.
pub static KILLED_CHILDREN: AtomicU64 = AtomicU64::new(0);

/// Run `argv` and return its stdout when it exits 0 within `timeout`.
pub fn run(argv: &[String], timeout: Duration) -> Result<String, ProbeError> {
    let (prog, args) = argv
        .split_first()
        .ok_or_else(|| ProbeError::Init("empty command".into()))?;
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout kills whatever it forked too.
        .process_group(0)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                ProbeError::Init(format!("{prog}: {e}"))
            }
            _ => ProbeError::Call(format!("{prog}: spawn: {e}")),
        })?;
    let pid = child.id() as i32;
    let out = reader(child.stdout.take(), MAX_STDOUT + 1);
    let err = reader(child.stderr.take(), MAX_STDERR);

    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => return Err(ProbeError::Call(format!("{prog}: wait: {e}"))),
        }
        let now = Instant::now();
        if now >= deadline {
            // SAFETY: killpg only sends a signal to the process group we created above
            // (pgid = the child's pid); no memory is touched.
            unsafe {
                libc::killpg(pid, libc::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
            KILLED_CHILDREN.fetch_add(1, Ordering::Relaxed);
            return Err(ProbeError::Timeout(timeout));
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if !status.success() {
        let msg = String::from_utf8_lossy(&stderr);
        let msg = msg.trim();
        let first = msg.lines().next().unwrap_or("");
        return Err(ProbeError::Call(format!(
            "{prog} exited with {status}: {first}"
        )));
    }
    if stdout.len() > MAX_STDOUT {
        return Err(ProbeError::Parse(format!(
            "{prog} printed more than {MAX_STDOUT} bytes"
        )));
    }
    String::from_utf8(stdout)
        .map_err(|_| ProbeError::Parse(format!("{prog} printed invalid UTF-8")))
}

fn reader<R: Read + Send + 'static>(
    pipe: Option<R>,
    cap: usize,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(p) = pipe {
            let _ = p.take(cap as u64).read_to_end(&mut buf);
        }
        buf
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn returns_stdout_of_a_good_command() {
        assert_eq!(
            run(&sh("echo hello"), Duration::from_secs(5)).unwrap(),
            "hello\n"
        );
    }

    #[test]
    fn a_hung_child_and_its_children_are_killed_at_the_timeout() {
        let start = Instant::now();
        let before = KILLED_CHILDREN.load(Ordering::Relaxed);
        let e = run(&sh("sleep 30 & sleep 30"), Duration::from_millis(200)).unwrap_err();
        assert_eq!(e, ProbeError::Timeout(Duration::from_millis(200)));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(KILLED_CHILDREN.load(Ordering::Relaxed) > before);
    }

    #[test]
    fn non_zero_exit_is_a_call_error_with_stderr() {
        let e = run(&sh("echo boom >&2; exit 3"), Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(&e, ProbeError::Call(m) if m.contains("boom")),
            "{e}"
        );
    }

    #[test]
    fn a_missing_tool_is_an_init_error() {
        let e = run(&["/nonexistent/npu-smi".into()], Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), "init");
    }
}
