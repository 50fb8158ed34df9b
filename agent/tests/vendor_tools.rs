//! Ascend sources (DCMI through the C double of libdcmi.so, npu-smi through a fake
//! script) and the exec source, including tools that hang, print garbage, print half
//! their output or exit non-zero.

mod common;

use std::time::Duration;

use common::*;

struct ToolDir {
    dir: tempfile::TempDir,
}

impl ToolDir {
    fn new() -> Self {
        ToolDir {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    fn p(&self) -> &str {
        self.dir.path().to_str().unwrap()
    }
    fn mode(&self, m: &str) {
        std::fs::write(self.dir.path().join("mode.tmp"), m).unwrap();
        std::fs::rename(
            self.dir.path().join("mode.tmp"),
            self.dir.path().join("mode"),
        )
        .unwrap();
    }
    fn file(&self, name: &str, content: &str) {
        std::fs::write(self.dir.path().join(name), content).unwrap();
    }
}

fn bin(name: &str) -> String {
    test_path(&format!("fixtures/bin/{name}"))
        .to_str()
        .unwrap()
        .to_string()
}

const FAST: &[&str] = &[
    "--interval",
    "100ms",
    "--timeout",
    "500ms",
    "--cache-ttl",
    "1500ms",
];

#[tokio::test]
async fn dcmi_reads_chips_and_the_vendor_verdict() {
    let state = StateFile::new(
        "card_count=2\nchips_per_card=1\n\
         card.0.chip.0.temp=61\ncard.0.chip.0.power_dw=2857\ncard.0.chip.0.ecc.single=4\n\
         card.1.chip.0.health=3\ncard.1.chip.0.errorcodes=0x80E01801,0x80E18402\n",
    );
    let lib = fake_dcmi().to_str().unwrap().to_string();
    let mut flags = vec!["--source", "dcmi", "--dcmi-lib", lib.as_str()];
    flags.extend_from_slice(FAST);
    let agent = spawn_agent(&flags, &[("FAKE_DCMI_STATE", state.p())]);
    let doc = wait_for(&agent, Duration::from_secs(10), "two chips", |d| {
        d.npus.len() == 2
    })
    .await;
    let n0 = device(&doc, "npu0");
    assert_eq!(n0.reading.temperature_c, Some(61.0));
    assert_eq!(n0.reading.power_w, Some(285.7), "power comes in 0.1 W");
    assert_eq!(n0.ecc_errors, Some(4));
    assert_eq!(n0.reading.pci_bus_id.as_deref(), Some("0000:c1:00.0"));
    assert_eq!(n0.status.as_str(), "healthy");
    let n1 = device(&doc, "npu1");
    // Graded by code as MindCluster does: 80E18402 is SeparateNPU (failed), 80E01801
    // RestartBusiness (degraded); the health level (critical) no longer decides.
    assert_eq!(
        (n1.status.as_str(), n1.reason.as_deref()),
        ("failed", Some("ascend-separate-npu"))
    );
    let vh = n1.reading.vendor_health.as_ref().unwrap();
    assert_eq!(vh.error_codes, vec!["80E01801", "80E18402"]);
    let levels: Vec<_> = vh
        .graded
        .iter()
        .map(|g| (g.code.as_str(), g.level.map(|l| l.as_str())))
        .collect();
    assert_eq!(
        levels,
        [
            ("80E18402", Some("SeparateNPU")),
            ("80E01801", Some("RestartBusiness"))
        ]
    );

    // A card that drops answers "not ready" (-8012): lost, a hard fault.
    state.set("card_count=2\ncard.0.error.dcmi_get_device_health=-8012\n");
    let doc = wait_for(&agent, Duration::from_secs(5), "npu0 lost", |d| {
        status_of(d, "npu0") == ("failed".into(), Some("gpu-lost".into()))
    })
    .await;
    assert_eq!(status_of(&doc, "npu1").0, "healthy");

    // A hung library: unknown after the TTL, never failed; then recovery once the hung
    // calls return (a call that never returns keeps the source at its abandoned bound).
    state.set("card_count=2\nhang_ms=3000\n");
    let doc = wait_for(&agent, Duration::from_secs(10), "unknown", |d| {
        d.summary.unknown == 2
    })
    .await;
    assert_eq!(doc.summary.failed, 0);
    state.set("card_count=2\n");
    wait_for(&agent, Duration::from_secs(10), "recovered", |d| {
        d.summary.healthy == 2
    })
    .await;
}

#[tokio::test]
async fn dcmi_without_the_library_keeps_serving() {
    let mut flags = vec!["--source", "dcmi", "--dcmi-lib", "/nonexistent/libdcmi.so"];
    flags.extend_from_slice(FAST);
    let agent = spawn_agent(&flags, &[]);
    let doc = wait_for(&agent, Duration::from_secs(5), "dcmi down", |d| {
        d.sources
            .iter()
            .any(|s| s.name == "dcmi" && !s.up && s.last_error.is_some())
    })
    .await;
    assert!(doc.npus.is_empty());
    assert_eq!(
        request("GET", &agent.url("/healthz"), None).await.status,
        200
    );
}

#[tokio::test]
async fn npu_smi_table_and_health_details() {
    let tools = ToolDir::new();
    let info =
        std::fs::read_to_string(test_path("data/npu-smi/info_910b_8_npu3_alarm.txt")).unwrap();
    tools.file("info.txt", &info);
    tools.file(
        "health_3_0.txt",
        &std::fs::read_to_string(test_path("data/npu-smi/health_alarm_80E01801.txt")).unwrap(),
    );
    tools.file(
        "ecc_5_0.txt",
        &std::fs::read_to_string(test_path("data/npu-smi/ecc_910b_errors.txt")).unwrap(),
    );
    let smi = bin("npu-smi");
    let mut flags = vec!["--source", "npu-smi", "--npu-smi", smi.as_str()];
    flags.extend_from_slice(FAST);
    let agent = spawn_agent(&flags, &[("FAKE_TOOL_DIR", tools.p())]);
    let doc = wait_for(&agent, Duration::from_secs(10), "eight NPUs", |d| {
        d.npus.len() == 8
    })
    .await;
    let n3 = device(&doc, "npu3");
    // npu-smi's codes graded with the same table: 80E01801 is RestartBusiness.
    assert_eq!(
        (n3.status.as_str(), n3.reason.as_deref()),
        ("degraded", Some("hbm-double-bit"))
    );
    assert_eq!(
        n3.reading.vendor_health.as_ref().unwrap().error_codes,
        vec!["80E01801"]
    );
    let n5 = device(&doc, "npu5");
    assert_eq!(n5.ecc_errors, Some(14));
    assert_eq!(n5.reading.ecc.unwrap().volatile_uncorrected, 2);
    assert_eq!(
        (n5.status.as_str(), n5.reason.as_deref()),
        ("degraded", Some("ecc-uncorrectable"))
    );
    assert_eq!(device(&doc, "npu0").reading.temperature_c, Some(54.0));
    assert_eq!(doc.summary.healthy, 6);
    // Only the chip that is not OK is asked for details every sample.
    let calls = std::fs::read_to_string(tools.dir.path().join("calls.log")).unwrap();
    assert!(calls.contains("info -t health -i 3 -c 0"));
    assert!(!calls.contains("info -t health -i 0 -c 0"), "{calls}");
}

#[tokio::test]
async fn npu_smi_misbehaving_turns_devices_unknown_then_recovers() {
    let tools = ToolDir::new();
    let smi = bin("npu-smi");
    let mut flags = vec!["--source", "npu-smi", "--npu-smi", smi.as_str()];
    flags.extend_from_slice(FAST);
    let agent = spawn_agent(&flags, &[("FAKE_TOOL_DIR", tools.p())]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 8
    })
    .await;

    for (mode, kind) in [("garbage", "parse"), ("fail", "call"), ("hang", "timeout")] {
        tools.mode(mode);
        let doc = wait_for(
            &agent,
            Duration::from_secs(10),
            &format!("{mode}: unknown"),
            |d| d.summary.unknown == 8 && d.sources.iter().all(|s| !s.up),
        )
        .await;
        assert_eq!(doc.summary.failed, 0, "{mode}");
        let src = doc.sources.iter().find(|s| s.name == "npu-smi").unwrap();
        assert!(!src.up, "{mode}: {src:?}");
        let metrics = request("GET", &agent.url("/metrics"), None).await.body;
        let line =
            format!("faultline_agent_source_errors_total{{source=\"npu-smi\",kind=\"{kind}\"}}");
        assert!(metrics.contains(&line), "{mode}: no {line} in\n{metrics}");
        tools.mode("ok");
        wait_for(
            &agent,
            Duration::from_secs(10),
            &format!("{mode}: recovered"),
            |d| d.summary.healthy == 8,
        )
        .await;
    }
    // Output cut after six chips: those six stay fresh, the two missing are unknown.
    tools.mode("partial");
    let doc = wait_for(
        &agent,
        Duration::from_secs(10),
        "partial: two unknown",
        |d| d.summary.unknown == 2,
    )
    .await;
    assert_eq!(
        status_of(&doc, "npu7"),
        ("unknown".into(), Some("missing".into()))
    );
    assert_eq!(status_of(&doc, "npu0").0, "healthy");
    tools.mode("ok");
    let metrics = request("GET", &agent.url("/metrics"), None).await.body;
    let killed: f64 = metrics
        .lines()
        .find(|l| l.starts_with("faultline_agent_killed_children_total "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no killed_children metric in\n{metrics}"));
    assert!(
        killed >= 1.0,
        "the hung npu-smi must have been killed: {killed}"
    );
}

#[tokio::test]
async fn exec_runs_a_site_tool_printing_the_seed_document() {
    let tools = ToolDir::new();
    let cmd = format!("{} --json", bin("fake-health-json"));
    let mut flags = vec!["--source", "exec", "--exec", cmd.as_str()];
    flags.extend_from_slice(FAST);
    let agent = spawn_agent(&flags, &[("FAKE_TOOL_DIR", tools.p())]);
    let doc = wait_for(&agent, Duration::from_secs(10), "two NPUs", |d| {
        d.npus.len() == 2
    })
    .await;
    assert_eq!(status_of(&doc, "npu0").0, "healthy");
    // The tool said degraded/high-temp, and 89.2 C is over 85 C anyway.
    assert_eq!(
        status_of(&doc, "npu1"),
        ("degraded".into(), Some("high-temp".into()))
    );

    tools.file(
        "health.json",
        r#"{"npus":[{"id":"npu0","status":"failed","reason":"npu-offline","pcie_link_status":"down","power_w":1.5},{"id":"npu1","status":"healthy","temperature_c":50}]}"#,
    );
    let doc = wait_for(&agent, Duration::from_secs(5), "npu0 failed", |d| {
        d.summary.failed == 1
    })
    .await;
    let n0 = device(&doc, "npu0");
    assert_eq!(n0.pcie_link_status.as_deref(), Some("down"));
    let codes: Vec<&str> = n0.findings.iter().map(|f| f.code.as_str()).collect();
    assert!(
        codes.contains(&"pcie-link-down") && codes.contains(&"npu-offline"),
        "{codes:?}"
    );

    tools.mode("partial");
    let doc = wait_for(
        &agent,
        Duration::from_secs(10),
        "unknown on truncated JSON",
        |d| d.summary.unknown == 2,
    )
    .await;
    let src = doc.sources.iter().find(|s| s.name == "exec").unwrap();
    assert!(
        src.last_error.as_deref().unwrap().contains("unparseable"),
        "{src:?}"
    );
}

/// `--retries` retries a failed call within one sample (and not
/// more), and a source that cannot start is retried with exponential backoff, not at
/// every interval.
#[tokio::test]
async fn retries_within_a_sample_and_backoff_when_a_source_cannot_start() {
    let calls = |tools: &ToolDir| {
        std::fs::read_to_string(tools.dir.path().join("calls.log"))
            .unwrap_or_default()
            .lines()
            .count()
    };
    for (retries, want) in [("2", 3), ("0", 1)] {
        let tools = ToolDir::new();
        tools.mode("fail");
        let cmd = format!("{} --json", bin("fake-health-json"));
        let agent = spawn_agent(
            &[
                "--source",
                "exec",
                "--exec",
                cmd.as_str(),
                "--interval",
                "30s",
                "--retries",
                retries,
            ],
            &[("FAKE_TOOL_DIR", tools.p())],
        );
        // The first sample's calls: each failed call is counted as it fails (the
        // source reports its error at the first one, without waiting for the retries,
        // so its status alone is no sign the sample ended). A sample's retries follow
        // each other at once and the next sample is 30 s away, so 10 s (a generous
        // bound, a third of the interval) tells the retries of one sample from later
        // samples.
        let errors = r#"faultline_agent_source_errors_total{source="exec",kind="call"}"#;
        reaches(&agent, errors, 1).await;
        let first = std::time::Instant::now();
        while metric(&agent, errors).await < want as u64
            && first.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            calls(&tools),
            want,
            "--retries {retries}: one sample, {want} calls"
        );
    }

    // A tool that is not there: Init errors, retried at 0.2, 0.6, 1.4, 3.0 s... (doubling
    // from --interval), not every 200 ms.
    let agent = spawn_agent(
        &[
            "--source",
            "exec",
            "--exec",
            "/nonexistent/site-tool --json",
            "--interval",
            "200ms",
        ],
        &[],
    );
    // Timed by the agent's own count, not a window of wall time: from the first init
    // error to the fourth, backoff waits 0.2 + 0.4 + 0.8 s (without it, 3 × 200 ms);
    // this reads the count every 50 ms, so it sees at least 1.35 s.
    let init = r#"faultline_agent_source_errors_total{source="exec",kind="init"}"#;
    reaches(&agent, init, 1).await;
    let t = std::time::Instant::now();
    reaches(&agent, init, 4).await;
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(1300),
        "4 init errors {took:?} after the first: backoff doubles from 200 ms"
    );
}
