//! The HTTP API over loopback: the document, long-poll on the generation, probes,
//! metrics, fault injection, bad requests, the node file, and flags from the environment.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn sim_agent(extra: &[&str]) -> AgentProc {
    let mut flags = vec![
        "--source",
        "sim",
        "--sim-devices",
        "8",
        "--interval",
        "200ms",
        "--sim-seed",
        "1",
    ];
    flags.extend_from_slice(extra);
    spawn_agent(&flags, &[])
}

#[tokio::test]
async fn the_document_has_the_seed_fields_and_more() {
    let agent = sim_agent(&[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "eight devices", |d| {
        d.npus.len() == 8
    })
    .await;
    let raw = request("GET", &agent.url("/v1/health"), None).await.json();
    assert_eq!(raw["node"], "test-node");
    assert_eq!(raw["schema_version"], "faultline.node-health/v1");
    for k in ["total", "healthy", "degraded", "failed", "unknown"] {
        assert!(raw["summary"][k].is_u64(), "summary.{k}");
    }
    for k in [
        "id",
        "status",
        "temperature_c",
        "power_w",
        "ecc_errors",
        "pcie_link_status",
        "reason",
        "sample_age_ms",
        "uuid",
        "pci_bus_id",
    ] {
        assert!(
            raw["npus"][0].get(k).is_some(),
            "npus[0].{k} missing: {}",
            raw["npus"][0]
        );
    }
    assert_eq!(doc.summary.total, 8);
    assert_eq!(doc.summary.healthy, 8);
    let one = request("GET", &agent.url("/v1/health/gpu3"), None).await;
    assert_eq!((one.status, one.json()["id"].as_str()), (200, Some("gpu3")));
    let none = request("GET", &agent.url("/v1/health/gpu99"), None).await;
    assert_eq!(none.status, 404);
    assert!(none.json()["error"].as_str().unwrap().contains("gpu99"));
}

#[tokio::test]
async fn a_long_poll_hears_of_a_change_at_once() {
    let agent = spawn_agent(
        &["--source", "sim", "--sim-devices", "8", "--interval", "1s"],
        &[],
    );
    let doc = wait_for(&agent, Duration::from_secs(10), "first sample", |d| {
        d.npus.len() == 8
    })
    .await;
    let gen = doc.generation;
    let url = agent.url(&format!(
        "/v1/health?wait_generation={gen}&timeout_ms=20000"
    ));
    let waiter = tokio::spawn(async move { request("GET", &url, None).await });
    // Fault injection reaches the document with the next sample (up to 1 s away).
    let r = request(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some(r#"{"device":"gpu2","fault":"lost"}"#),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let resp = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .unwrap()
        .unwrap();
    let mut d: faultline_common::NodeHealth = serde_json::from_str(&resp.body).unwrap();
    assert!(d.generation > gen);
    // Noise may move the generation before the fault lands; follow until it does.
    let deadline = Instant::now() + Duration::from_secs(15);
    while status_of(&d, "gpu2").0 != "failed" {
        assert!(
            Instant::now() < deadline,
            "gpu2 never failed: {:?}",
            status_of(&d, "gpu2")
        );
        let url = agent.url(&format!(
            "/v1/health?wait_generation={}&timeout_ms=5000",
            d.generation
        ));
        d = serde_json::from_str(&request("GET", &url, None).await.body).unwrap();
    }
    // The document that answered was rendered right after the sample that changed it.
    let at = |s: &str| humantime::parse_rfc3339(s).unwrap();
    let sampled = at(device(&d, "gpu2").sampled_at.as_deref().unwrap());
    let lag = at(&d.timestamp).duration_since(sampled).unwrap_or_default();
    assert!(
        lag < Duration::from_secs(3),
        "the poll answered {lag:?} after the change"
    );

    // A generation the agent never had (it restarted and counts again) answers at once.
    let t = Instant::now();
    let g = d.generation + 1000;
    let url = agent.url(&format!("/v1/health?wait_generation={g}&timeout_ms=20000"));
    assert_eq!(request("GET", &url, None).await.status, 200);
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A tool whose answer never changes keeps the generation still, so a poll on it must
/// wait out its `timeout_ms` and answer the same generation (the simulator's sensor
/// noise would move it and let a broken timeout pass).
#[tokio::test]
async fn a_poll_without_a_change_returns_at_its_timeout() {
    let tool = format!(
        "{} --json",
        test_path("fixtures/bin/fake-health-json").display()
    );
    let agent = spawn_agent(
        &["--source", "exec", "--exec", &tool, "--interval", "100ms"],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "two NPUs", |d| {
        d.npus.len() == 2
    })
    .await;
    // A few samples pass: the same readings move nothing.
    grows(&agent, "faultline_agent_sample_duration_seconds_count", 3).await;
    let now = health(&agent).await.generation;
    let t = Instant::now();
    let url = agent.url(&format!("/v1/health?wait_generation={now}&timeout_ms=700"));
    let r = request("GET", &url, None).await;
    let waited = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["generation"].as_u64(),
        Some(now),
        "nothing changed"
    );
    assert!(
        waited >= Duration::from_millis(700),
        "answered after {waited:?}, before its timeout"
    );
    assert!(
        waited < Duration::from_secs(10),
        "answered after {waited:?}, long past its timeout"
    );
}

/// A watch stream as its reader sees it, frame by frame.
struct Watch {
    body: hyper::body::Incoming,
    buf: Vec<u8>,
}

impl Watch {
    async fn open(url: &str) -> (u16, String, Watch) {
        let client: hyper_util::client::legacy::Client<
            _,
            http_body_util::Empty<hyper::body::Bytes>,
        > = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.get(url.parse().unwrap()))
            .await
            .expect("an answer within 10 s")
            .unwrap();
        let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
        (
            resp.status().as_u16(),
            ct,
            Watch {
                body: resp.into_body(),
                buf: Vec::new(),
            },
        )
    }

    /// The next line (empty: a heartbeat), and when it came; `None`: the stream ended.
    async fn line(&mut self, within: Duration) -> Option<String> {
        use http_body_util::BodyExt;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Some(String::from_utf8(line[..i].to_vec()).unwrap());
            }
            let frame = tokio::time::timeout_at(deadline, self.body.frame())
                .await
                .unwrap_or_else(|_| panic!("no line within {within:?}"));
            match frame {
                None => return None,
                Some(f) => {
                    if let Ok(data) = f.unwrap().into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// `?watch=true` streams the document as NDJSON on one connection: the
/// current one at once, each new generation as it comes, a blank line as the
/// heartbeat when nothing changes; `wait_generation` holds the first line back until
/// the generation moves; a bad `watch` or `format=pretty` is refused.
#[tokio::test]
async fn a_watch_streams_each_change_and_a_heartbeat() {
    let tool = format!(
        "{} --json",
        test_path("fixtures/bin/fake-health-json").display()
    );
    let agent = spawn_agent(
        &["--source", "exec", "--exec", &tool, "--interval", "100ms"],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "two NPUs", |d| {
        d.npus.len() == 2
    })
    .await;
    grows(&agent, "faultline_agent_sample_duration_seconds_count", 3).await;
    let now = health(&agent).await.generation;
    let (status, ct, mut w) =
        Watch::open(&agent.url("/v1/health?watch=true&timeout_ms=1000")).await;
    assert_eq!((status, ct.as_str()), (200, "application/x-ndjson"));
    let first: faultline_common::NodeHealth =
        serde_json::from_str(&w.line(Duration::from_secs(5)).await.unwrap()).unwrap();
    assert_eq!((first.generation, first.npus.len()), (now, 2));
    // Nothing changes: heartbeats, about a second apart.
    let t = Instant::now();
    for _ in 0..2 {
        assert_eq!(w.line(Duration::from_secs(5)).await.as_deref(), Some(""));
    }
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(5),
        "two heartbeats in {waited:?}"
    );
    // Held back while the generation is the one the client has.
    let (_, _, mut held) = Watch::open(&agent.url(&format!(
        "/v1/health?watch=1&timeout_ms=1000&wait_generation={now}"
    )))
    .await;
    assert_eq!(held.line(Duration::from_secs(5)).await.as_deref(), Some(""));

    // A change comes as its own line, at once.
    let sim = spawn_agent(
        &[
            "--source",
            "sim",
            "--sim-devices",
            "8",
            "--interval",
            "200ms",
            "--sim-seed",
            "1",
        ],
        &[],
    );
    wait_for(&sim, Duration::from_secs(10), "eight devices", |d| {
        d.npus.len() == 8
    })
    .await;
    let (_, _, mut w) = Watch::open(&sim.url("/v1/health?watch=true")).await;
    let mut d: faultline_common::NodeHealth =
        serde_json::from_str(&w.line(Duration::from_secs(5)).await.unwrap()).unwrap();
    let r = request(
        "POST",
        &sim.url("/v1/sim/faults"),
        Some(r#"{"device":"gpu2","fault":"lost"}"#),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(15);
    while status_of(&d, "gpu2").0 != "failed" {
        assert!(Instant::now() < deadline, "gpu2 never failed on the stream");
        let line = w.line(Duration::from_secs(15)).await.unwrap();
        if line.is_empty() {
            continue;
        }
        let next: faultline_common::NodeHealth = serde_json::from_str(&line).unwrap();
        assert!(
            next.generation > d.generation,
            "each line is a new generation"
        );
        d = next;
    }

    for bad in [
        "/v1/health?watch=maybe",
        "/v1/health?watch=true&format=pretty",
    ] {
        let r = request("GET", &sim.url(bad), None).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert!(r.json()["error"].is_string());
    }
}

#[tokio::test]
async fn bad_requests_get_json_errors() {
    let agent = sim_agent(&[]);
    for (method, path, body, want) in [
        ("GET", "/v1/health?bogus=1", None, 400),
        ("GET", "/v1/health?wait_generation=abc", None, 400),
        ("GET", "/v1/health?timeout_ms=5", None, 400),
        ("GET", "/v1/health?format=xml", None, 400),
        ("GET", "/nope", None, 404),
        ("POST", "/v1/health", Some("{}"), 405),
        ("POST", "/v1/sim/faults", Some("{not json"), 400),
        (
            "POST",
            "/v1/sim/faults",
            Some(r#"{"device":"gpu0","fault":"melt"}"#),
            400,
        ),
        (
            "POST",
            "/v1/sim/faults",
            Some(r#"{"device":"gpu0","fault":"lost","extra":1}"#),
            400,
        ),
        (
            "POST",
            "/v1/sim/faults",
            Some(r#"{"device":"gpu42","fault":"lost"}"#),
            422,
        ),
        (
            "POST",
            "/v1/sim/faults",
            Some(r#"{"device":"gpu0","fault":"xid"}"#),
            422,
        ),
    ] {
        let r = request(method, &agent.url(path), body).await;
        assert_eq!(r.status, want, "{method} {path} {body:?}: {}", r.body);
        let v = r.json();
        assert!(
            v["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{method} {path}: {v}"
        );
        assert_eq!(v["status"], want);
    }
    // Bad bytes in a path, a body far past any limit, a duration that would overflow.
    let r = request("GET", &agent.url("/v1/health/%FF"), None).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"].is_string());
    let huge = format!(r#"{{"pad":"{}"}}"#, "x".repeat(3 << 20));
    let r = request("POST", &agent.url("/v1/sim/faults"), Some(&huge)).await;
    assert_eq!(r.status, 413);
    assert!(r.json()["error"].is_string(), "{}", r.body);
    let r = request(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some(r#"{"device":"gpu0","fault":"lost","duration_s":1e30}"#),
    )
    .await;
    assert_eq!(r.status, 422, "{}", r.body);
    let big = format!(
        r#"{{"device":"gpu0","fault":"lost","pad":"{}"}}"#,
        "x".repeat(100_000)
    );
    assert_eq!(
        request("POST", &agent.url("/v1/sim/faults"), Some(&big))
            .await
            .status,
        413
    );
    let r = request_with(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some("device=gpu0"),
        Some("text/plain"),
    )
    .await;
    assert_eq!(r.status, 415);
    // Still serving after all that, and the 4xx were counted.
    assert_eq!(health(&agent).await.npus.len(), 8);
    let m = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        m.contains("faultline_agent_http_requests_total{path=\"/v1/sim/faults\",code=\"400\"} 3"),
        "{m}"
    );
}

#[tokio::test]
async fn injection_is_read_only_without_the_simulator() {
    let agent = spawn_agent(&["--source", "kmsg", "--kmsg", "/nonexistent"], &[]);
    let r = request(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some(r#"{"device":"gpu0","fault":"lost"}"#),
    )
    .await;
    assert_eq!(r.status, 404);
    assert!(r.body.contains("only available when the sim source runs"));
}

#[tokio::test]
async fn faults_injected_show_and_clear() {
    let agent = sim_agent(&[]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 8
    })
    .await;
    for (body, dev, status, reason) in [
        (
            r#"{"device":"gpu1","fault":"high-temp","value":93}"#,
            "gpu1",
            "degraded",
            "high-temp",
        ),
        (
            r#"{"device":"2","fault":"pcie-down"}"#,
            "gpu2",
            "failed",
            "pcie-link-down",
        ),
        (
            r#"{"device":"gpu3","fault":"xid","xid":48}"#,
            "gpu3",
            "failed",
            "xid-48",
        ),
        (
            r#"{"device":"gpu4","fault":"row-remap-pending"}"#,
            "gpu4",
            "degraded",
            "row-remap-pending",
        ),
    ] {
        assert_eq!(
            request("POST", &agent.url("/v1/sim/faults"), Some(body))
                .await
                .status,
            201
        );
        wait_for(&agent, Duration::from_secs(5), body, |d| {
            status_of(d, dev) == (status.to_string(), Some(reason.to_string()))
        })
        .await;
    }
    let listed = request("GET", &agent.url("/v1/sim/faults"), None)
        .await
        .json();
    assert_eq!(
        listed.as_array().unwrap().len(),
        3,
        "the Xid was delivered once and is gone: {listed}"
    );
    let cleared = request("DELETE", &agent.url("/v1/sim/faults"), None)
        .await
        .json();
    assert_eq!(cleared["cleared"], 3);
    // The Xid 48 stays in the device's history (fatal, one hour window).
    let doc = wait_for(&agent, Duration::from_secs(5), "others healthy", |d| {
        d.summary.healthy == 7
    })
    .await;
    assert_eq!(status_of(&doc, "gpu3").1.as_deref(), Some("xid-48"));
}

#[tokio::test]
async fn a_hung_source_leaves_the_api_answering() {
    let agent = sim_agent(&["--timeout", "200ms", "--cache-ttl", "1s"]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 8
    })
    .await;
    let r = request(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some(r#"{"fault":"hang"}"#),
    )
    .await;
    assert_eq!(r.status, 201);
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    loop {
        let t = Instant::now();
        let doc = health(&agent).await;
        slowest = slowest.max(t.elapsed());
        if doc.summary.unknown == 8 {
            assert_eq!(doc.summary.failed, 0);
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10));
    }
    // Blocked, it would answer only at the client's timeout.
    assert!(slowest < Duration::from_secs(5), "{slowest:?}");
    assert_eq!(
        request("GET", &agent.url("/healthz"), None).await.status,
        200
    );
    request("DELETE", &agent.url("/v1/sim/faults"), None).await;
    wait_for(&agent, Duration::from_secs(10), "recovered", |d| {
        d.summary.healthy == 8
    })
    .await;
}

#[tokio::test]
async fn readiness_waits_for_the_first_sample() {
    // The exec tool sleeps before answering, so the first sample takes a while.
    let agent = spawn_agent(
        &[
            "--source",
            "exec",
            "--exec",
            "sh -c 'sleep 1; echo []'",
            "--interval",
            "100ms",
        ],
        &[],
    );
    let r = request("GET", &agent.url("/readyz"), None).await;
    assert_eq!(r.status, 503, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(10);
    while request("GET", &agent.url("/readyz"), None).await.status != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_health_file_is_written_atomically_on_change() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node.json");
    let agent = sim_agent(&["--health-file", file.to_str().unwrap()]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 8
    })
    .await;
    request(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some(r#"{"device":"gpu5","fault":"lost"}"#),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // Every read sees a whole document, never a half-written one.
        let text = std::fs::read_to_string(&file).unwrap();
        let doc: faultline_common::NodeHealth =
            serde_json::from_str(&text).expect("whole document");
        if doc.summary.failed == 1 {
            assert_eq!(status_of(&doc, "gpu5").0, "failed");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node file never showed the fault"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "no temp files left behind");
}

#[tokio::test]
async fn every_flag_reads_its_environment_variable() {
    let agent = spawn_agent(
        &[],
        &[
            ("FAULTLINE_SOURCE", "sim"),
            ("FAULTLINE_SIM_DEVICES", "3"),
            ("FAULTLINE_SIM_VENDOR", "ascend"),
            ("FAULTLINE_TEMP_THRESHOLD", "20"),
        ],
    );
    let doc = wait_for(&agent, Duration::from_secs(10), "three NPUs", |d| {
        d.npus.len() == 3
    })
    .await;
    assert_eq!(doc.npus[0].reading.id, "npu0");
    // Every simulated temperature is over 20 C.
    assert_eq!(doc.summary.degraded, 3);
}

/// 1,000 stalled connections (500 half-sent request heads, 500
/// that send nothing) neither stop the agent answering `/v1/health` nor stay open: the
/// header and idle timeouts close them all. (Latency and memory under this load are
/// measured in benches/agent_bench.rs, not asserted here.)
#[tokio::test]
async fn stalled_connections_are_closed_and_the_agent_keeps_answering() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let agent = sim_agent(&["--http-header-timeout", "2s", "--http-idle-timeout", "3s"]);
    wait_for(&agent, Duration::from_secs(10), "eight devices", |d| {
        d.npus.len() == 8
    })
    .await;
    // The stalled connections come from one peer (127.0.0.2), the request that must be
    // answered from another (one peer holds at most 128 connections, the
    // rest are closed at once).
    let mut stalled = Vec::new();
    for i in 0..1000 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut s = sock.connect(agent.addr).await.unwrap();
        if i % 2 == 0 {
            s.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
        }
        stalled.push(s);
    }
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        request("GET", &agent.url("/v1/health"), None),
    )
    .await
    .expect("answered while 1,000 connections stall");
    assert_eq!(r.status, 200);
    let m = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(m.contains("faultline_agent_http_connections_open"), "{m}");
    // Every stalled connection is closed by the agent (end of file or a reset).
    let t = Instant::now();
    for mut s in stalled {
        let mut b = [0u8; 512];
        loop {
            let left = Duration::from_secs(30).saturating_sub(t.elapsed());
            match tokio::time::timeout(left, s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(_)) => continue,
                Err(_) => panic!("a stalled connection was still open after 30 s"),
            }
        }
    }
    let m = request("GET", &agent.url("/metrics"), None).await.body;
    let count = |name: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let closed = count("faultline_agent_http_connections_idle_closed_total ");
    let refused = count("faultline_agent_http_connections_refused_total ");
    assert!(
        refused >= 1000 - 128,
        "{refused} refused past the peer's cap\n{m}"
    );
    assert!(
        closed + refused >= 1000,
        "{closed} closed, {refused} refused\n{m}"
    );
}

/// Past `--http-max-connections`, an agent with a delivery token
/// keeps connections for requests that carry it (the aggregator's); a request without
/// it on one of them is answered 503.
#[tokio::test]
async fn connections_past_the_cap_are_kept_for_the_aggregator() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let agent = sim_agent(&[
        "--http-max-connections",
        "4",
        "--delivery-token-file",
        token.to_str().unwrap(),
    ]);
    wait_for(&agent, Duration::from_secs(10), "eight devices", |d| {
        d.npus.len() == 8
    })
    .await;
    let mut crowd = Vec::new();
    for _ in 0..4 {
        crowd.push(tokio::net::TcpStream::connect(agent.addr).await.unwrap());
    }
    let ask = |auth: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(agent.addr).await.unwrap();
        s.write_all(
            format!("GET /v1/health HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out)).await;
        out
    };
    // Until the crowd holds every ordinary connection (one the readiness check left
    // open may close after the crowd came): a stranger is turned away.
    let mut stranger = ask("").await;
    while stranger.starts_with("HTTP/1.1 200") && crowd.len() < 8 {
        crowd.push(tokio::net::TcpStream::connect(agent.addr).await.unwrap());
        stranger = ask("").await;
    }
    assert!(
        stranger.starts_with("HTTP/1.1 503"),
        "{}",
        &stranger[..stranger.len().min(300)]
    );
    let aggregator = ask("Authorization: Bearer s3cret\r\n").await;
    assert!(aggregator.starts_with("HTTP/1.1 200"), "{aggregator}");
    drop(crowd);
}
