//! Ascend depth, through the real agent binary and the C double of libdcmi
//! (`tests/fixtures/dcmi/fake_dcmi.c`): a 950 host (dcmiv2 only), codes graded whatever
//! the health level, fault events that arrive at once, RoCE health bounded by 1 s,
//! booting chips, ECC switched off, and one stable id per chip. The behaviour each test
//! follows is cited from Ascend/mind-cluster and the driver (MINDCLUSTER.md).

mod common;

use std::time::{Duration, Instant};

use common::*;

fn dcmi_agent(state: &StateFile, extra: &[&str], env: &[(&str, &str)]) -> AgentProc {
    let lib = fake_dcmi().to_str().unwrap().to_string();
    let mut flags = vec![
        "--source",
        "dcmi",
        "--dcmi-lib",
        lib.as_str(),
        "--interval",
        "100ms",
        "--timeout",
        "3s",
        "--cache-ttl",
        "5s",
    ];
    flags.extend_from_slice(extra);
    let mut all = vec![("FAKE_DCMI_STATE", state.p())];
    all.extend_from_slice(env);
    spawn_agent(&flags, &all)
}

/// The agent with the fake npu-smi serving the files in `tools`.
fn smi_agent(tools: &std::path::Path, extra: &[&str]) -> AgentProc {
    let smi = test_path("fixtures/bin/npu-smi");
    let mut flags = vec![
        "--source",
        "npu-smi",
        "--npu-smi",
        smi.to_str().unwrap(),
        "--interval",
        "100ms",
        "--timeout",
        "3s",
    ];
    flags.extend_from_slice(extra);
    spawn_agent(&flags, &[("FAKE_TOOL_DIR", tools.to_str().unwrap())])
}

/// `DetectDcmiApiVersion` (devmanager_common.go): dcmi_init refused (-8255 on a 950
/// host), dcmiv2_init works; chips are listed list-first by dcmiv2_get_device_list and
/// named by their physical id (dcmiv2_get_chip_phy_id_by_dev_id).
#[tokio::test]
async fn a_950_host_is_served_through_the_v2_api() {
    let state = StateFile::new(
        "api=v2\ncard_count=2\n\
         card.0.chip.0.logic_id=0\ncard.0.chip.0.phy_id=4\ncard.0.chip.0.temp=52\n\
         card.1.chip.0.logic_id=1\ncard.1.chip.0.phy_id=5\ncard.1.chip.0.health=0\n\
         card.1.chip.0.errorcodes=8C03A000\n",
    );
    let agent = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "two chips", |d| {
        d.npus.len() == 2 && d.summary.unknown == 0
    })
    .await;
    let ids: Vec<&str> = doc.npus.iter().map(|d| d.reading.id.as_str()).collect();
    assert_eq!(ids, ["npu4", "npu5"]);
    let n4 = device(&doc, "npu4");
    assert_eq!(n4.reading.temperature_c, Some(52.0));
    assert_eq!(n4.status.as_str(), "healthy");
    let ids4 = n4.reading.ascend.unwrap();
    assert_eq!(
        (ids4.phy_id, ids4.logic_id, ids4.card),
        (Some(4), Some(0), None)
    );
    // Health OK, a RestartNPU code: graded by the code, not the level.
    assert_eq!(
        status_of(&doc, "npu5"),
        ("failed".into(), Some("ascend-restart-npu".into()))
    );
}

/// The chip's code is asserted (degraded), cleared, then asserted again.
async fn flap(state: &StateFile, agent: &AgentProc, codes: &str, clear: &str) {
    wait_for(agent, Duration::from_secs(10), "degraded", |d| {
        d.summary.degraded == 1
    })
    .await;
    state.set(clear);
    wait_for(agent, Duration::from_secs(10), "cleared", |d| {
        d.summary.degraded == 0
    })
    .await;
    state.set(codes);
}

/// MindCluster's frequency rule, through the DCMI double: an HBM
/// double-bit error (80E01801, RestartBusiness) that comes back within 24 h separates
/// the chip for good (ManuallySeparateNPU), and it stays so once the code is gone. A
/// site's own rules file replaces the built-in one (here: three times, so two leave
/// the chip degraded).
#[tokio::test]
async fn a_code_that_comes_back_separates_the_chip_for_good() {
    let with = |codes: &str| format!("card_count=1\ncard.0.chip.0.errorcodes={codes}\n");
    let state = StateFile::new(&with("80E01801"));
    let agent = dcmi_agent(&state, &[], &[]);
    flap(&state, &agent, &with("80E01801"), &with("")).await;
    let doc = wait_for(&agent, Duration::from_secs(10), "separated", |d| {
        d.summary.failed == 1
    })
    .await;
    assert_eq!(
        status_of(&doc, "npu0"),
        ("failed".into(), Some("ascend-manually-separate-npu".into()))
    );
    state.set(&with(""));
    let after = faultline_common::time::rfc3339_ms(faultline_common::time::now_ms() + 200);
    let doc = wait_for(&agent, Duration::from_secs(5), "a later sample", |d| {
        d.sources.iter().any(|s| {
            s.last_success
                .as_deref()
                .is_some_and(|t| t > after.as_str())
        })
    })
    .await;
    assert_eq!(
        status_of(&doc, "npu0"),
        ("failed".into(), Some("ascend-manually-separate-npu".into())),
        "no release window: it stays separated"
    );
    drop(agent);

    let rules = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        rules.path(),
        r#"{"FaultFrequency": [{"EventId": ["80E01801"], "TimeWindow": 86400, "Times": 3, "FaultHandling": "ManuallySeparateNPU"}]}"#,
    )
    .unwrap();
    state.set(&with("80E01801"));
    let path = rules.path().to_str().unwrap().to_string();
    let agent = dcmi_agent(&state, &["--ascend-fault-customization", &path], &[]);
    flap(&state, &agent, &with("80E01801"), &with("")).await;
    let doc = wait_for(&agent, Duration::from_secs(10), "back", |d| {
        d.summary.degraded == 1
    })
    .await;
    assert_eq!(doc.summary.failed, 0, "two of three");
}

/// On a 950 (the v2 API), a UB port down (81B18603, NotHandleFault
/// in faultCode.json) separates the chip, as the device plugin's
/// `a950HyperPlaneFaultOccur` does with its synthetic SeparateNPU code, unless every
/// chip has the port down (`a950HyperPlaneNewOverallFaultModify`: sub-health, the
/// plane's fault).
#[tokio::test]
async fn a_950_ub_port_down_separates_its_chip_unless_every_chip_has_it() {
    let chips = |codes: [&str; 2]| {
        format!(
            "api=v2\ncard_count=2\n\
             card.0.chip.0.logic_id=0\ncard.0.chip.0.phy_id=0\ncard.0.chip.0.errorcodes={}\n\
             card.1.chip.0.logic_id=1\ncard.1.chip.0.phy_id=1\ncard.1.chip.0.errorcodes={}\n",
            codes[0], codes[1]
        )
    };
    let state = StateFile::new(&chips(["81B18603", ""]));
    let agent = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "npu0 failed", |d| {
        d.npus.len() == 2 && d.summary.failed == 1
    })
    .await;
    assert_eq!(
        status_of(&doc, "npu0"),
        ("failed".into(), Some("ub-port-down".into()))
    );
    assert_eq!(status_of(&doc, "npu1"), ("healthy".into(), None));
    state.set(&chips(["81B18603", "81B18603"]));
    let doc = wait_for(&agent, Duration::from_secs(10), "both degraded", |d| {
        d.summary.degraded == 2
    })
    .await;
    for chip in ["npu0", "npu1"] {
        assert_eq!(
            status_of(&doc, chip),
            ("degraded".into(), Some("ub-port-down-every-chip".into()))
        );
    }
}

/// MindCluster reads codes whatever the health level (fault_code.go grades by code):
/// an OK chip with a SeparateNPU code is failed, with a NotHandleFault code healthy
/// (a finding, no reason), with a code in no table degraded, never failed.
#[tokio::test]
async fn codes_are_graded_on_every_sample_whatever_the_health_level() {
    let state = StateFile::new(
        "card_count=3\n\
         card.0.chip.0.errorcodes=80E18402\n\
         card.1.chip.0.errorcodes=A4025021\n\
         card.2.chip.0.errorcodes=12345678\n",
    );
    let overrides = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(overrides.path(), "# site\nA4025021 SubHealthFault\n").unwrap();
    let agent = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "three chips", |d| {
        d.npus.len() == 3 && d.summary.unknown == 0
    })
    .await;
    assert_eq!(
        status_of(&doc, "npu0"),
        ("failed".into(), Some("ascend-separate-npu".into()))
    );
    assert_eq!(status_of(&doc, "npu1"), ("healthy".into(), None));
    assert_eq!(device(&doc, "npu1").findings[0].code, "ascend-not-handle");
    assert_eq!(
        status_of(&doc, "npu2"),
        ("degraded".into(), Some("ascend-unknown-fault-code".into()))
    );
    drop(agent);
    // A site's table raises A4025021 to SubHealthFault.
    let path = overrides.path().to_str().unwrap().to_string();
    let agent = dcmi_agent(&state, &["--ascend-fault-codes", &path], &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "three chips", |d| {
        d.npus.len() == 3 && d.summary.unknown == 0
    })
    .await;
    assert_eq!(
        status_of(&doc, "npu1"),
        ("degraded".into(), Some("ascend-subhealth".into()))
    );
}

/// dcmi_subscribe_fault_event (manager.go subscribeNpuFaultEvent): an event wakes the
/// sampler at once; with a 30 s interval the chip is failed within a second of the
/// event. A refused subscription falls back to polling, and says so in the metrics.
#[tokio::test]
async fn a_fault_event_arrives_at_once_and_a_refused_subscription_polls() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events");
    std::fs::write(&events, "").unwrap();
    let state = StateFile::new(&format!("card_count=2\nevents_file={}\n", events.display()));
    let lib = fake_dcmi().to_str().unwrap().to_string();
    let flags = [
        "--source",
        "dcmi",
        "--dcmi-lib",
        lib.as_str(),
        "--interval",
        "30s",
        "--cache-ttl",
        "120s",
    ];
    let agent = spawn_agent(&flags, &[("FAKE_DCMI_STATE", state.p())]);
    // The first reading is discarded (warm-up); the second comes when the event wakes
    // the sampler, so wait for readiness only through the event below.
    let m = wait_metrics(
        &agent,
        "faultline_agent_fault_event_mode{source=\"dcmi\",mode=\"events\"} 1",
    )
    .await;
    assert!(m.contains("mode=\"polling\"} 0"), "{m}");
    let t0 = Instant::now();
    std::fs::write(&events, "1 80E18402 2 1\n").unwrap();
    let doc = wait_for(
        &agent,
        Duration::from_secs(5),
        "npu1 failed by the event",
        |d| device_opt(d, "npu1").is_some_and(|n| n.status.as_str() == "failed"),
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the event woke the sampler (interval 30 s)"
    );
    assert_eq!(
        status_of(&doc, "npu1").1.as_deref(),
        Some("ascend-separate-npu")
    );
    assert_eq!(status_of(&doc, "npu0").0, "healthy");
    let m = request("GET", &agent.url("/metrics"), None).await.body;
    assert!(
        m.contains("faultline_agent_fault_events_total{source=\"dcmi\",assertion=\"occur\"} 1"),
        "{m}"
    );
    drop(agent);

    state.set("card_count=2\nsubscribe_error=-8255\n");
    let agent = spawn_agent(&flags, &[("FAKE_DCMI_STATE", state.p())]);
    wait_metrics(
        &agent,
        "faultline_agent_fault_event_mode{source=\"dcmi\",mode=\"polling\"} 1",
    )
    .await;
}

async fn wait_metrics(agent: &AgentProc, line: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = request("GET", &agent.url("/metrics"), None).await.body;
        if m.contains(line) {
            return m;
        }
        assert!(Instant::now() < deadline, "no {line} in {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// dcmi_get_device_network_health: 0 and 6 are up (collector_for_npu.go
/// getNetworkHealthy); a down link degrades the chip (reason roce-link-down), or fails
/// it with --roce-link-down failed; a call that blocks is given up after 1 s
/// (dcmi.go DcGetDeviceNetWorkHealth) and the chip keeps its other readings.
#[tokio::test]
async fn roce_link_health_is_bounded_and_graded_by_policy() {
    let state = StateFile::new(
        "card_count=3\ncard.0.chip.0.net_health=6\ncard.1.chip.0.net_health=3\n\
         card.2.chip.0.net_health_hang_ms=20000\n",
    );
    let agent = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(
        &agent,
        Duration::from_secs(15),
        "the hung probe noted",
        |d| {
            d.npus.len() == 3
                && d.summary.unknown == 0
                && device(d, "npu2")
                    .reading
                    .probe_errors
                    .iter()
                    .any(|e| e.contains("network health"))
        },
    )
    .await;
    assert_eq!(
        status_of(&doc, "npu0").0,
        "healthy",
        "6: the probe is starting"
    );
    assert_eq!(device(&doc, "npu0").reading.roce.unwrap().result, 6);
    assert_eq!(
        status_of(&doc, "npu1"),
        ("degraded".into(), Some("roce-link-down".into()))
    );
    let n2 = device(&doc, "npu2");
    assert_eq!(
        n2.status.as_str(),
        "healthy",
        "a blocked probe is no verdict"
    );
    assert!(n2.reading.temperature_c.is_some());
    drop(agent);
    let agent = dcmi_agent(&state, &["--roce-link-down", "failed"], &[]);
    let doc = wait_for(&agent, Duration::from_secs(15), "npu1 graded", |d| {
        d.npus.len() == 3 && status_of(d, "npu1").1.as_deref() == Some("roce-link-down")
    })
    .await;
    assert_eq!(status_of(&doc, "npu1").0, "failed");
}

/// dcmi_get_device_boot_status below 16 (DCMI_SYSTEM_START_FINISH, the value Huawei's
/// plugin waits for after a reset): the chip is booting, unknown, never failed, even
/// when it also reports critical health.
#[tokio::test]
async fn a_booting_chip_is_unknown_until_it_has_started() {
    let state =
        StateFile::new("card_count=2\ncard.1.chip.0.boot_status=2\ncard.1.chip.0.health=3\n");
    let agent = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "npu1 booting", |d| {
        d.npus.len() == 2 && status_of(d, "npu1").1.as_deref() == Some("booting")
    })
    .await;
    assert_eq!(status_of(&doc, "npu1").0, "unknown");
    assert!(device(&doc, "npu1").reading.booting);
    state.set("card_count=2\n");
    wait_for(&agent, Duration::from_secs(10), "npu1 started", |d| {
        status_of(d, "npu1").0 == "healthy"
    })
    .await;
}

/// ECC switched off (enable_flag 0) is no reading, not zero errors; an HBM read error
/// other than -8255 is reported, not hidden by asking DDR (the library's support
/// matrix: dcmi_inner_info_get.c).
#[tokio::test]
async fn ecc_switched_off_is_no_reading_and_an_hbm_error_is_not_hidden() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("calls.log");
    let state = StateFile::new(
        "card_count=2\ncard.0.chip.0.ecc.enable=0\ncard.0.chip.0.ecc.double=7\n\
         card.1.chip.0.error.dcmi_get_device_ecc_info=-8005\n",
    );
    let agent = dcmi_agent(&state, &[], &[("FAKE_DCMI_LOG", log.to_str().unwrap())]);
    let doc = wait_for(&agent, Duration::from_secs(10), "two chips", |d| {
        d.npus.len() == 2 && d.summary.unknown == 0
    })
    .await;
    let n0 = device(&doc, "npu0");
    assert_eq!(n0.reading.ecc, None, "switched off: no counters");
    assert_eq!(n0.status.as_str(), "healthy");
    let n1 = device(&doc, "npu1");
    assert!(
        n1.reading
            .probe_errors
            .iter()
            .any(|e| e == "ecc (hbm): dcmi error -8005"),
        "{:?}",
        n1.reading.probe_errors
    );
    // Only HBM was asked (the fake logs the card; the type is not logged, so count).
    let calls = std::fs::read_to_string(&log).unwrap();
    let ecc_calls_chip1 = calls
        .lines()
        .filter(|l| *l == "dcmi_get_device_ecc_info 1 0")
        .count();
    let health_calls_chip1 = calls
        .lines()
        .filter(|l| *l == "dcmi_get_device_health 1 0")
        .count();
    assert!(
        ecc_calls_chip1 <= health_calls_chip1,
        "one ECC call per sample: {ecc_calls_chip1} for {health_calls_chip1} samples"
    );
}

/// One id per chip, its physical id (npu-exporter keys chips by it), learned once:
/// a later failed lookup does not rename the chip; logic id, card and chip are kept.
#[tokio::test]
async fn a_chip_keeps_its_physical_id_through_a_failed_lookup() {
    let state = StateFile::new(
        "card_count=2\ncard.0.chip.0.logic_id=1\ncard.0.chip.0.phy_id=6\n\
         card.1.chip.0.logic_id=0\ncard.1.chip.0.phy_id=7\n",
    );
    let agent = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(&agent, Duration::from_secs(10), "two chips", |d| {
        d.npus.len() == 2 && d.summary.unknown == 0
    })
    .await;
    let ids: Vec<&str> = doc.npus.iter().map(|d| d.reading.id.as_str()).collect();
    assert_eq!(ids, ["npu6", "npu7"]);
    let a = device(&doc, "npu6").reading.ascend.unwrap();
    assert_eq!((a.logic_id, a.card, a.chip), (Some(1), Some(0), Some(0)));
    state.set(
        "card_count=2\ncard.0.chip.0.logic_id=1\ncard.0.chip.0.phy_id=6\n\
         card.1.chip.0.logic_id=0\ncard.1.chip.0.phy_id=7\n\
         error.dcmi_get_device_logic_id=-8005\nerror.dcmi_get_device_phyid_from_logicid=-8005\n\
         card.0.chip.0.temp=71\n",
    );
    let doc = wait_for(&agent, Duration::from_secs(10), "a new sample", |d| {
        device_opt(d, "npu6").is_some_and(|n| n.reading.temperature_c == Some(71.0))
    })
    .await;
    let ids: Vec<&str> = doc.npus.iter().map(|d| d.reading.id.as_str()).collect();
    assert_eq!(ids, ["npu6", "npu7"], "the lookups failed; the ids stay");
}

fn device_opt<'a>(
    doc: &'a faultline_common::NodeHealth,
    id: &str,
) -> Option<&'a faultline_common::DeviceHealth> {
    doc.npus.iter().find(|d| d.reading.id == id)
}

/// The `dcmi` and `npu-smi` sources name a chip alike: `npu<physical id>`. DCMI asks
/// dcmi_get_device_phyid_from_logicid; npu-smi asks `info -t phyid-remap -p N` for each
/// /dev/davinciN (npu_chip_info.c; the node index is the physical id).
#[tokio::test]
async fn the_dcmi_and_npu_smi_sources_name_a_chip_alike() {
    let state = StateFile::new(
        "card_count=2\ncard.0.chip.0.logic_id=0\ncard.0.chip.0.phy_id=4\n\
         card.1.chip.0.logic_id=1\ncard.1.chip.0.phy_id=5\n",
    );
    let by_dcmi = dcmi_agent(&state, &[], &[]);
    let doc = wait_for(&by_dcmi, Duration::from_secs(10), "two chips", |d| {
        d.npus.len() == 2
    })
    .await;
    let dcmi_ids: Vec<String> = doc.npus.iter().map(|d| d.reading.id.clone()).collect();

    // The same host through npu-smi: NPU 0 and 1 in the table, davinci4 and davinci5.
    let tools = tempfile::tempdir().unwrap();
    let table: String = std::fs::read_to_string(test_path("data/npu-smi/info_910b_8.txt"))
        .unwrap()
        .lines()
        .take(12)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(tools.path().join("info.txt"), table).unwrap();
    let dev = tools.path().join("dev");
    std::fs::create_dir(&dev).unwrap();
    for (phy, npu) in [(4, 0), (5, 1)] {
        std::fs::write(dev.join(format!("davinci{phy}")), "").unwrap();
        std::fs::write(
            tools.path().join(format!("phyid-remap_{phy}.txt")),
            format!(
                "\t{:<30}:{phy}\n\t{:<30}:{npu}\n\t{:<30}:{npu}\n\t{:<30}:0\n",
                "Chip Physical ID", "Chip Logic ID", "NPU ID", "Chip ID"
            ),
        )
        .unwrap();
    }
    std::fs::write(dev.join("davinci_manager"), "").unwrap();
    let by_smi = smi_agent(tools.path(), &["--davinci-dir", dev.to_str().unwrap()]);
    let doc = wait_for(&by_smi, Duration::from_secs(15), "two chips", |d| {
        d.npus.len() == 2
    })
    .await;
    let smi_ids: Vec<String> = doc.npus.iter().map(|d| d.reading.id.clone()).collect();
    assert_eq!(dcmi_ids, ["npu4", "npu5"]);
    assert_eq!(
        smi_ids, dcmi_ids,
        "one name per chip, whichever source reads it"
    );
    let a = device(&doc, "npu5").reading.ascend.unwrap();
    assert_eq!((a.phy_id, a.card, a.chip), (Some(5), Some(1), Some(0)));
}

/// A real `-t health` output with three codes (mind-cluster's faultdiag test data,
/// tests/data/npu-smi/SOURCES.md), graded by the npu-smi source with the same table:
/// RestartNPU (8C03A000) wins over FreeRestartNPU and NotHandleFault.
#[tokio::test]
async fn npu_smi_grades_a_real_health_output_like_dcmi() {
    let tools = tempfile::tempdir().unwrap();
    let info =
        std::fs::read_to_string(test_path("data/npu-smi/info_910b_8_npu3_alarm.txt")).unwrap();
    std::fs::write(tools.path().join("info.txt"), info).unwrap();
    std::fs::write(
        tools.path().join("health_3_0.txt"),
        std::fs::read_to_string(test_path("data/npu-smi/health_alarm_three_codes_910.txt"))
            .unwrap(),
    )
    .unwrap();
    let agent = smi_agent(tools.path(), &[]);
    let doc = wait_for(&agent, Duration::from_secs(15), "npu3 graded", |d| {
        device_opt(d, "npu3").is_some_and(|n| n.reading.vendor_health.is_some())
    })
    .await;
    assert_eq!(
        status_of(&doc, "npu3"),
        ("failed".into(), Some("ascend-restart-npu".into()))
    );
    let g = &device(&doc, "npu3")
        .reading
        .vendor_health
        .as_ref()
        .unwrap()
        .graded;
    let levels: Vec<_> = g.iter().map(|g| g.level.map(|l| l.as_str())).collect();
    assert_eq!(
        levels,
        [
            Some("RestartNPU"),
            Some("FreeRestartNPU"),
            Some("NotHandleFault")
        ]
    );
}
