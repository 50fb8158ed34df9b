//! The NVML source through the real nvml-wrapper FFI, against the C double of
//! libnvidia-ml.so (tests/fixtures/nvml) driven by a state file.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn nvml_agent(state: &StateFile, extra: &[&str]) -> AgentProc {
    let lib = fake_nvml().to_str().unwrap().to_string();
    let mut flags = vec![
        "--source",
        "nvml",
        "--nvml-lib",
        lib.as_str(),
        "--interval",
        "100ms",
    ];
    flags.extend_from_slice(extra);
    spawn_agent(&flags, &[("FAKE_NVML_STATE", state.p())])
}

/// NVML field 230, the recovery action, read on every sample through
/// `nvmlDeviceGetFieldValues`, each documented value (0-7) to its action, status and
/// reason; a value this build does not know is a probe error, not a guess; a driver
/// without the field is no reading.
#[tokio::test]
async fn reads_the_recovery_action_of_each_nvml_value() {
    use faultline_common::RecoveryAction;
    let mut lines = String::from("device_count=10\n");
    for i in 0..=8 {
        lines.push_str(&format!("gpu.{i}.recovery_action={i}\n"));
    }
    let state = StateFile::new(&lines);
    let agent = nvml_agent(&state, &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "ten GPUs", |d| {
        d.npus.len() == 10
    })
    .await;
    let want = [
        ("none", "healthy", None),
        ("gpu-reset", "failed", Some("recovery-gpu-reset")),
        ("node-reboot", "failed", Some("recovery-node-reboot")),
        ("drain-p2p", "failed", Some("recovery-drain-p2p")),
        (
            "drain-and-reset",
            "failed",
            Some("recovery-drain-and-reset"),
        ),
        (
            "recover-imex-domain",
            "degraded",
            Some("recovery-recover-imex-domain"),
        ),
        ("bus-reset", "failed", Some("recovery-bus-reset")),
        ("system-reboot", "failed", Some("recovery-system-reboot")),
    ];
    for (i, (action, status, reason)) in want.into_iter().enumerate() {
        let g = device(&doc, &format!("gpu{i}"));
        let got = g.reading.recovery_action.expect("read");
        assert_eq!(Some(got), RecoveryAction::from_nvml(i as u64));
        assert_eq!(got.as_str(), action);
        // Its name on the wire.
        let wire = serde_json::to_value(&g.reading).unwrap();
        assert_eq!(wire["recovery_action"], action, "gpu{i}");
        assert_eq!(g.status.as_str(), status, "gpu{i}: {:?}", g.findings);
        assert_eq!(g.reason.as_deref(), reason, "gpu{i}");
    }
    let unknown = device(&doc, "gpu8");
    assert_eq!(unknown.reading.recovery_action, None);
    assert!(
        unknown
            .reading
            .probe_errors
            .iter()
            .any(|e| e == "recovery_action: value 8 unknown to this build"),
        "{:?}",
        unknown.reading.probe_errors
    );
    assert_eq!(unknown.status.as_str(), "healthy");
    let unsupported = device(&doc, "gpu9");
    assert_eq!(unsupported.reading.recovery_action, None);
    assert!(unsupported.reading.probe_errors.is_empty());
    assert_eq!(unsupported.status.as_str(), "healthy");
}

#[tokio::test]
async fn reads_every_metric_through_nvml() {
    let state = StateFile::new(
        "device_count=2\n\
         gpu.0.temp=51\ngpu.0.power_mw=250500\n\
         gpu.0.ecc.volatile.corrected=7\ngpu.0.ecc.aggregate.corrected=40\ngpu.0.ecc.aggregate.uncorrected=1\n\
         gpu.0.retired.sbe=2\n\
         gpu.0.remap.correctable=3\n\
         gpu.0.pcie.gen=3\n\
         gpu.1.nvlink.count=4\ngpu.1.nvlink.2.active=0\n\
         gpu.1.throttle=0x88\n\
         gpu.1.pcie.width=8\n",
    );
    let agent = nvml_agent(&state, &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "two GPUs", |d| {
        d.npus.len() == 2
    })
    .await;
    let g0 = device(&doc, "gpu0");
    let r = &g0.reading;
    assert_eq!(
        r.uuid.as_deref(),
        Some("GPU-00000000-0000-0000-0000-000000000000")
    );
    assert_eq!(r.pci_bus_id.as_deref(), Some("0000:18:00.0"));
    assert_eq!(r.name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(r.temperature_c, Some(51.0));
    assert_eq!(r.power_w, Some(250.5));
    let ecc = r.ecc.unwrap();
    assert_eq!(
        (
            ecc.volatile_corrected,
            ecc.aggregate_corrected,
            ecc.aggregate_uncorrected
        ),
        (7, 40, 1)
    );
    assert_eq!(g0.ecc_errors, Some(7));
    assert_eq!(r.retired_pages.unwrap().single_bit, 2);
    assert_eq!(r.remapped_rows.unwrap().correctable, 3);
    // A lower PCIe generation is idle power saving, not a fault.
    assert_eq!(r.pcie.unwrap().gen, Some(3));
    assert_eq!(g0.pcie_link_status.as_deref(), Some("up"));
    assert_eq!(g0.status.as_str(), "healthy", "{:?}", g0.findings);

    let g1 = device(&doc, "gpu1");
    let nv = g1.reading.nvlink.as_ref().unwrap();
    assert_eq!((nv.total, nv.active, nv.down.clone()), (4, 3, vec![2]));
    let th = g1.reading.throttle.unwrap();
    assert!(th.hw_slowdown && th.hw_power_brake && !th.sw_thermal);
    assert_eq!(g1.status.as_str(), "degraded");
    let codes: Vec<&str> = g1.findings.iter().map(|f| f.code.as_str()).collect();
    for want in ["pcie-width-degraded", "power-brake", "nvlink-down"] {
        assert!(codes.contains(&want), "{want} missing from {codes:?}");
    }
}

#[tokio::test]
async fn a_lost_gpu_is_a_hard_fault_not_a_probe_error() {
    let state = StateFile::new("device_count=2\n");
    let agent = nvml_agent(&state, &[]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 2
    })
    .await;
    state.set("device_count=2\ngpu.1.lost=1\n");
    let doc = wait_for(&agent, Duration::from_secs(5), "gpu1 failed", |d| {
        d.summary.failed == 1
    })
    .await;
    assert_eq!(
        status_of(&doc, "gpu1"),
        ("failed".into(), Some("gpu-lost".into()))
    );
    // The lost GPU keeps the identity it had, so an operator knows which board it is.
    assert_eq!(
        device(&doc, "gpu1").reading.uuid.as_deref(),
        Some("GPU-00000000-0000-0000-0000-000000000001")
    );
    assert_eq!(status_of(&doc, "gpu0").0, "healthy");

    state.set("device_count=2\n");
    wait_for(&agent, Duration::from_secs(5), "recovered", |d| {
        d.summary.healthy == 2
    })
    .await;
}

#[tokio::test]
async fn a_metric_error_is_noted_and_an_unsupported_one_left_out() {
    // 999 is NVML_ERROR_UNKNOWN, 3 is NVML_ERROR_NOT_SUPPORTED.
    let state = StateFile::new("device_count=1\ngpu.0.error.nvmlDeviceGetPowerUsage=999\ngpu.0.error.nvmlDeviceGetNvLinkState=3\n");
    let agent = nvml_agent(&state, &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "one GPU", |d| {
        d.npus.len() == 1
    })
    .await;
    let g = device(&doc, "gpu0");
    assert_eq!(g.reading.power_w, None);
    assert!(
        g.reading
            .probe_errors
            .iter()
            .any(|e| e.starts_with("power:")),
        "{:?}",
        g.reading.probe_errors
    );
    assert!(g.reading.nvlink.is_none());
    assert_eq!(
        g.status.as_str(),
        "healthy",
        "one unreadable metric is not a fault"
    );
}

#[tokio::test]
async fn critical_xid_events_arrive_through_the_event_set() {
    let state = StateFile::new("device_count=2\n");
    let agent = nvml_agent(&state, &[]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 2
    })
    .await;
    state.set("device_count=2\nevent.1=1:79\n");
    let doc = wait_for(&agent, Duration::from_secs(10), "xid 79 on gpu1", |d| {
        d.summary.failed == 1
    })
    .await;
    let g = device(&doc, "gpu1");
    assert_eq!(g.reason.as_deref(), Some("xid-79"));
    assert_eq!(g.recent_xids.len(), 1);
    assert_eq!(g.recent_xids[0].source, "nvml-event");
    assert_eq!(g.recent_xids[0].pci_bus_id.as_deref(), Some("0000:28:00.0"));
    // An event wait error must not touch any device (NVIDIA's plugin marks all unhealthy).
    state.set("device_count=2\nevent.1=1:79\nevent_wait_error=999\n");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = request("GET", &agent.url("/metrics"), None).await.body;
        if m.contains("faultline_agent_source_errors_total{source=\"nvml\",kind=\"event-wait\"}") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the wait error was not counted:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let doc = health(&agent).await;
    assert_eq!(status_of(&doc, "gpu0").0, "healthy");
    assert_eq!(doc.summary.failed, 1, "only the Xid 79 device");
}

/// After a driver reset the agent starts NVML over, and its Xid
/// event thread with it. The old handle's event set answers only errors
/// (`sets_die_on_reinit`): events after the reset arrive only through the new one.
#[tokio::test]
async fn the_event_thread_restarts_with_the_handle() {
    let base = "device_count=2\nsets_die_on_reinit=1\n";
    let state = StateFile::new(base);
    let agent = nvml_agent(&state, &[]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 2
    })
    .await;
    // The driver loses its state: the device count fails (999 = NVML_ERROR_UNKNOWN),
    // the handle is dropped, and the next sample initialises NVML again.
    state.set(&format!("{base}error.nvmlDeviceGetCount_v2=999\n"));
    wait_for(&agent, Duration::from_secs(10), "the count failed", |d| {
        d.sources.iter().any(|s| s.name == "nvml" && !s.up)
    })
    .await;
    state.set(base);
    wait_for(&agent, Duration::from_secs(10), "back", |d| {
        d.sources.iter().any(|s| s.name == "nvml" && s.up) && d.summary.healthy == 2
    })
    .await;
    state.set(&format!("{base}event.1=1:79\n"));
    let doc = wait_for(
        &agent,
        Duration::from_secs(15),
        "xid 79 after the reset",
        |d| d.summary.failed == 1,
    )
    .await;
    assert_eq!(device(&doc, "gpu1").reason.as_deref(), Some("xid-79"));
    let starts = agent
        .log_text()
        .matches("NVML event thread started")
        .count();
    assert!(starts >= 2, "{}", agent.log_text());
}

#[tokio::test]
async fn a_broken_gpu_does_not_cost_the_others_their_xid_events() {
    // gpu1 refuses event registration (999 = NVML_ERROR_UNKNOWN); nvml-wrapper then
    // frees the whole event set, which the agent must rebuild without gpu1.
    let base = "device_count=3\ngpu.1.error.nvmlDeviceRegisterEvents=999\n";
    let state = StateFile::new(base);
    let agent = nvml_agent(&state, &[]);
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 3
    })
    .await;
    // The event set is rebuilt without gpu1 and armed.
    logged(&agent, "NVML Xid events armed").await;
    state.set(&format!("{base}event.1=2:48\nevent.2=0:79\n"));
    let doc = wait_for(
        &agent,
        Duration::from_secs(10),
        "xids on gpu0 and gpu2",
        |d| d.summary.failed == 2,
    )
    .await;
    assert_eq!(
        status_of(&doc, "gpu2"),
        ("failed".into(), Some("xid-48".into()))
    );
    assert_eq!(
        status_of(&doc, "gpu0"),
        ("failed".into(), Some("xid-79".into()))
    );
}

#[tokio::test]
async fn without_a_driver_the_agent_serves_unknown_and_recovers() {
    // 9 = NVML_ERROR_DRIVER_NOT_LOADED.
    let state = StateFile::new("init_error=9\n");
    let agent = nvml_agent(&state, &[]);
    let doc = wait_for(&agent, Duration::from_secs(5), "nvml reported down", |d| {
        d.sources
            .iter()
            .any(|s| s.name == "nvml" && !s.up && s.last_error.is_some())
    })
    .await;
    let src = doc.sources.iter().find(|s| s.name == "nvml").unwrap();
    assert!(
        src.last_error.as_deref().unwrap().contains("cannot start"),
        "{src:?}"
    );
    assert!(doc.npus.is_empty());
    assert_eq!(
        request("GET", &agent.url("/readyz"), None).await.status,
        200
    );
    let metrics = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        metrics.contains("faultline_agent_source_up{source=\"nvml\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("faultline_agent_source_errors_total{source=\"nvml\",kind=\"init\"}"),
        "{metrics}"
    );

    state.set("device_count=2\n");
    wait_for(&agent, Duration::from_secs(10), "driver back", |d| {
        d.summary.healthy == 2
    })
    .await;
}

#[tokio::test]
async fn fail_on_init_error_exits_instead() {
    let state = StateFile::new("init_error=9\n");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_faultline-agent"))
        .args([
            "--source",
            "nvml",
            "--nvml-lib",
            fake_nvml().to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--fail-on-init-error")
        .env("FAKE_NVML_STATE", state.p())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot start"), "{err}");
}

#[tokio::test]
async fn a_hung_driver_never_blocks_the_api_and_turns_devices_unknown() {
    let state = StateFile::new("device_count=2\n");
    let agent = nvml_agent(
        &state,
        &[
            "--timeout",
            "300ms",
            "--cache-ttl",
            "1s",
            "--max-abandoned",
            "2",
        ],
    );
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 2
    })
    .await;

    state.set("device_count=2\nhang_ms=600000\n");
    // While every NVML call hangs the API keeps answering, and within the TTL it still
    // serves the last good reading with its age.
    let hung_at = Instant::now();
    let mut slowest = Duration::ZERO;
    let doc = loop {
        let t = Instant::now();
        let doc = health(&agent).await;
        slowest = slowest.max(t.elapsed());
        if doc.summary.unknown == 2 {
            break doc;
        }
        if doc.summary.healthy == 2 {
            // Judged on the agent's own clock: the reading it serves is within the TTL.
            let at = |s: &str| humantime::parse_rfc3339(s).unwrap();
            let sampled = at(device(&doc, "gpu0").sampled_at.as_deref().unwrap());
            let age = at(&doc.timestamp)
                .duration_since(sampled)
                .unwrap_or_default();
            assert!(
                age <= Duration::from_secs(2),
                "served healthy {age:?} after its sample: the TTL is 1 s (and one sample of 300 ms)"
            );
        }
        assert!(
            hung_at.elapsed() < Duration::from_secs(10),
            "never turned unknown: {doc:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        slowest < Duration::from_secs(5),
        "a request took {slowest:?} while NVML hung"
    );
    let (status, reason) = status_of(&doc, "gpu0");
    assert_eq!(status, "unknown", "a hung probe is unknown, never failed");
    assert_eq!(reason.as_deref(), Some("probe-error"));
    assert!(device(&doc, "gpu0").sample_age_ms.unwrap() >= 1000);
    assert_eq!(doc.summary.failed, 0);

    // Abandoned calls are bounded.
    let doc = wait_for(
        &agent,
        Duration::from_secs(5),
        "abandoned calls reported",
        |d| {
            d.sources
                .iter()
                .any(|s| s.name == "nvml" && s.abandoned_calls == 2)
        },
    )
    .await;
    let src = doc.sources.iter().find(|s| s.name == "nvml").unwrap();
    assert!(
        src.last_error.as_deref().unwrap().contains("hung"),
        "{src:?}"
    );
    let metrics = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        metrics.contains("faultline_agent_abandoned_calls{source=\"nvml\"} 2"),
        "{metrics}"
    );

    // The driver answers again: the hung calls return, the devices recover.
    state.set("device_count=2\n");
    let doc = wait_for(&agent, Duration::from_secs(10), "recovered", |d| {
        d.summary.healthy == 2
    })
    .await;
    let src = doc.sources.iter().find(|s| s.name == "nvml").unwrap();
    assert!(src.up);
}
