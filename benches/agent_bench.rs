//! Agent footprint and API benchmark. Run through `benches/run-agent-bench.sh`, which
//! builds the release binary and the NVML double first.
//!
//! Reports: stripped binary size; resident memory (current and peak) after sampling 8
//! devices and serving load; CPU per sample of 8 devices (NVML through the C double, and
//! the simulator); `/v1/health` latency p50/p99/max under an open-loop load of a fixed
//! request rate (latency counted from each request's scheduled time, so a stall is not
//! hidden), and the closed-loop throughput limit.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

// The agent process, killed when dropped.
use faultline_common::testing::ChildGuard as Proc;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start(agent: &str, args: &[&str], env: &[(&str, &str)]) -> Result<(Proc, SocketAddr)> {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let mut cmd = Command::new(agent);
    cmd.args(["--listen", &addr.to_string(), "--node-name", "bench"])
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = Proc(cmd.spawn().with_context(|| format!("spawn {agent}"))?);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            bail!("agent did not listen on {addr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((child, addr))
}

fn proc_status(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// User + system CPU seconds of a process.
fn cpu_secs(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    // USER_HZ (sysconf(_SC_CLK_TCK)) is 100 on the Linux kernels we run on.
    ticks / 100.0
}

async fn get(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
) -> Result<Bytes> {
    let resp = client.get(url.parse()?).await?;
    if !resp.status().is_success() {
        bail!("status {}", resp.status());
    }
    Ok(resp.into_body().collect().await?.to_bytes())
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// 1,000 stalled connections (half with a half-sent request head, half silent) held
/// open against an agent with the default HTTP limits: `/v1/health` latency over 200
/// sequential requests meanwhile, resident memory, and how long until the agent has
/// closed every stalled connection.
async fn stalled_connections(addr: SocketAddr, pid: u32) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let before = proc_status(pid, "VmRSS:").unwrap_or(0);
    let t0 = Instant::now();
    let mut stalled = Vec::new();
    for i in 0..1000 {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        if i % 2 == 0 {
            s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n")
                .await?;
        }
        stalled.push(s);
    }
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let url = format!("http://{addr}/v1/health");
    let mut lat = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        get(&client, &url).await?;
        lat.push(t.elapsed());
    }
    lat.sort();
    let rss = proc_status(pid, "VmRSS:").unwrap_or(0);
    let mut closed_after = Duration::ZERO;
    for mut s in stalled {
        let mut b = [0u8; 256];
        loop {
            match tokio::time::timeout(Duration::from_secs(120), s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => continue,
                Err(_) => bail!("a stalled connection was still open after 120 s"),
            }
        }
        closed_after = t0.elapsed();
    }
    println!(
        "| /v1/health with 1,000 stalled connections open (200 sequential requests) | p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms |",
        pct(&lat, 0.50).as_secs_f64() * 1e3,
        pct(&lat, 0.99).as_secs_f64() * 1e3,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    println!(
        "| resident memory with 1,000 stalled connections | {:.1} MiB (before {:.1} MiB); all closed by the agent {:.1} s after they opened |",
        rss as f64 / 1024.0,
        before as f64 / 1024.0,
        closed_after.as_secs_f64()
    );
    Ok(())
}

async fn cpu_per_sample(
    agent: &str,
    label: &str,
    args: &[&str],
    env: &[(&str, &str)],
    source: &str,
) -> Result<()> {
    let (p, addr) = start(agent, args, env)?;
    let client = Client::builder(TokioExecutor::new()).build_http();
    let murl = format!("http://{addr}/metrics");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let count_name =
        format!("faultline_agent_sample_duration_seconds_count{{source=\"{source}\"}}");
    let sum_name = format!("faultline_agent_sample_duration_seconds_sum{{source=\"{source}\"}}");
    let m0 = String::from_utf8_lossy(&get(&client, &murl).await?).into_owned();
    let c0 = cpu_secs(p.0.id());
    tokio::time::sleep(Duration::from_secs(10)).await;
    let c1 = cpu_secs(p.0.id());
    let m1 = String::from_utf8_lossy(&get(&client, &murl).await?).into_owned();
    let samples = metric(&m1, &count_name) - metric(&m0, &count_name);
    let wall = metric(&m1, &sum_name) - metric(&m0, &sum_name);
    if samples < 1.0 {
        bail!("{label}: no samples counted");
    }
    println!(
        "| CPU per sample, 8 devices, {label} | {:.3} ms CPU (process total / samples; {} samples in 10 s); sample wall time {:.3} ms |",
        (c1 - c0) * 1000.0 / samples,
        samples,
        wall * 1000.0 / samples
    );
    Ok(())
}

async fn load(addr: SocketAddr, rate: u32, secs: u64) -> Result<(Vec<Duration>, usize, Duration)> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();
    let url = format!("http://{addr}/v1/health");
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let n = rate as u64 * secs;
    let start = tokio::time::Instant::now();
    let mut handles = Vec::with_capacity(n as usize);
    for i in 0..n {
        let at = start + period * i as u32;
        tokio::time::sleep_until(at).await;
        let (client, url) = (client.clone(), url.clone());
        handles.push(tokio::spawn(async move {
            // Timed from the moment the request is issued: tokio's timer has 1 ms
            // granularity, so timing from the schedule would add up to 1 ms of the
            // generator's own lateness to every request.
            let sent = tokio::time::Instant::now();
            let r = get(&client, &url).await;
            (sent.elapsed(), r.is_ok(), sent.duration_since(at))
        }));
    }
    let mut lat = Vec::with_capacity(handles.len());
    let mut errors = 0;
    let mut late = Duration::ZERO;
    for h in handles {
        let (d, ok, lag) = h.await?;
        late = late.max(lag);
        if ok {
            lat.push(d);
        } else {
            errors += 1;
        }
    }
    lat.sort();
    Ok((lat, errors, late))
}

fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn throughput(addr: SocketAddr, conns: usize, secs: u64) -> Result<f64> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{addr}/v1/health");
    let end = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                if get(&client, &url).await.is_ok() {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await?;
    }
    Ok(total as f64 / secs as f64)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (agent, nvml) = match args.as_slice() {
        [_, a, n] => (a.clone(), n.clone()),
        _ => bail!("usage: agent-bench PATH/TO/faultline-agent PATH/TO/libnvidia-ml.so"),
    };
    let rate: u32 = std::env::var("BENCH_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let secs: u64 = std::env::var("BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);

    println!("| measure | result |\n|---|---|");
    let size = std::fs::metadata(&agent)?.len();
    println!(
        "| binary size (release, stripped) | {:.2} MiB ({size} bytes) |",
        size as f64 / 1048576.0
    );

    let state_dir = std::env::temp_dir().join(format!("faultline-bench-{}", std::process::id()));
    std::fs::create_dir_all(&state_dir)?;
    let state = state_dir.join("nvml.state");
    std::fs::write(&state, "device_count=8\ngpu.3.nvlink.count=18\n")?;
    let state_s = state.to_str().unwrap().to_string();
    let nvml_env = [("FAKE_NVML_STATE", state_s.as_str())];
    let nvml_args = [
        "--source",
        "nvml",
        "--nvml-lib",
        nvml.as_str(),
        "--interval",
        "100ms",
    ];
    cpu_per_sample(&agent, "NVML (C double)", &nvml_args, &nvml_env, "nvml").await?;
    let sim_args = [
        "--source",
        "sim",
        "--sim-devices",
        "8",
        "--interval",
        "100ms",
    ];
    cpu_per_sample(&agent, "sim", &sim_args, &[], "sim").await?;

    // Latency and memory under load: 8 NVML devices sampled every second (the default).
    let (p, addr) = start(
        &agent,
        &["--source", "nvml", "--nvml-lib", nvml.as_str()],
        &nvml_env,
    )?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = p.0.id();
    let idle_rss = proc_status(pid, "VmRSS:").unwrap_or(0);
    let (lat, errors, late) = load(addr, rate, secs).await?;
    println!(
        "| /v1/health latency at {rate} req/s for {secs} s (open loop) | p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms; {} ok, {errors} errors; generator at most {:.1} ms behind schedule |",
        pct(&lat, 0.50).as_secs_f64() * 1e3,
        pct(&lat, 0.99).as_secs_f64() * 1e3,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        lat.len(),
        late.as_secs_f64() * 1e3
    );
    let tput = throughput(addr, 16, 5).await?;
    println!("| /v1/health throughput (16 connections, closed loop, 5 s) | {tput:.0} req/s |");
    let rss = proc_status(pid, "VmRSS:").unwrap_or(0);
    let hwm = proc_status(pid, "VmHWM:").unwrap_or(0);
    println!(
        "| resident memory, 8 NVML devices | idle {:.1} MiB; after load {:.1} MiB; peak {:.1} MiB |",
        idle_rss as f64 / 1024.0,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    stalled_connections(addr, pid).await?;
    drop(p);
    let _ = std::fs::remove_dir_all(&state_dir);
    Ok(())
}
