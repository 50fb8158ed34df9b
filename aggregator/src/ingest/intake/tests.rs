//! The intake's unit tests.

use std::path::PathBuf;

use super::*;

/// An intake of `threshold` alerts within `window`, dedup `dedup`; its verdicts and
/// metrics (the token file is never read by these tests).
fn intake(
    threshold: usize,
    window: Duration,
    dedup: Duration,
) -> (Intake, mpsc::Receiver<Verdict>, Arc<Metrics>) {
    let (tx, rx) = mpsc::channel(16);
    let metrics = Arc::new(Metrics::new());
    let cfg = IntakeConfig {
        token_file: PathBuf::from("/nonexistent/token"),
        max_bytes: 1 << 20,
        threshold,
        window,
        dedup,
    };
    (Intake::new(cfg, metrics.clone(), tx), rx, metrics)
}

fn bearer(t: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        header::AUTHORIZATION,
        format!("Bearer {t}").parse().unwrap(),
    );
    h
}

/// The token is compared without an early exit (a prefix, a
/// longer or an empty token all fail), read from its file once, and read again when
/// the file changes (a rotated Secret): the old token is refused from then on.
#[test]
fn the_token_is_compared_in_full_and_follows_its_file() {
    assert!(same(b"s3cret", b"s3cret"));
    for wrong in [&b"s3cre"[..], b"s3crets", b"", b"S3cret", b"s3cret\0"] {
        assert!(!same(wrong, b"s3cret"), "{wrong:?}");
    }
    assert!(!same(b"", b""), "an empty secret matches nothing");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, "first-token\n").unwrap();
    let (mut i, _rx, _m) = intake(1, Duration::from_secs(60), Duration::from_secs(60));
    i.cfg.token_file = file.clone();
    assert!(i.authorize(&bearer("first-token")).is_ok());
    // The scheme is case-insensitive (RFC 9110).
    let mut lower = HeaderMap::new();
    lower.insert(header::AUTHORIZATION, "bearer first-token".parse().unwrap());
    assert!(i.authorize(&lower).is_ok());
    assert!(matches!(
        i.authorize(&bearer("nope")),
        Err(IntakeError::Unauthorized(_))
    ));
    std::fs::write(&file, "rotated-token-2\n").unwrap();
    assert!(i.authorize(&bearer("rotated-token-2")).is_ok());
    assert!(i.authorize(&bearer("first-token")).is_err());
    std::fs::remove_file(&file).unwrap();
    assert!(matches!(
        i.authorize(&bearer("rotated-token-2")),
        Err(IntakeError::Unavailable(..))
    ));
}

/// A firing alert of metric `xid` for `GPU-1` on `node`.
fn alert_on(node: &str) -> Alert {
    Alert {
        node: node.into(),
        uuid: Some("GPU-1".into()),
        bus_id: None,
        metric: "xid".into(),
        value: Some("79".into()),
        firing: true,
        occurrence: None,
        threshold: None,
        device: None,
    }
}

/// A sender may say one alert is enough (Alertmanager's label
/// `faultline_threshold`, or `?threshold=` on the URL), never more than configured;
/// re-sends of that one firing alert still count once.
#[tokio::test]
async fn a_sender_may_lower_the_threshold() {
    let (intake, mut rx, _) = intake(3, Duration::from_secs(300), Duration::from_secs(900));
    let am = br#"{"version":"4","status":"firing","alerts":[{"status":"firing","labels":{"alertname":"FaultlineDeviceFailed","node":"n1","gpu_uuid":"GPU-1","faultline_threshold":"1"},"annotations":{},"startsAt":"2026-12-01T00:00:00Z","fingerprint":"abc"}]}"#;
    let a = parse(am).unwrap().remove(0);
    assert_eq!(a.threshold, Some(1));
    // faultline's own rules name the device as the agent does (`device="gpu3"`).
    let own = br#"{"version":"4","status":"firing","alerts":[{"status":"firing","labels":{"alertname":"FaultlineDeviceFailed","node":"n9","device":"gpu3","faultline_threshold":"1"},"annotations":{},"startsAt":"2026-12-01T00:00:00Z","fingerprint":"def"}]}"#;
    let o = parse(own).unwrap().remove(0);
    assert_eq!(intake.one(o).await, AlertOutcome::Acted);
    assert_eq!(rx.try_recv().unwrap().device.id, "gpu3");
    assert_eq!(intake.one(a.clone()).await, AlertOutcome::Acted);
    assert_eq!(rx.try_recv().unwrap().node, "n1");
    assert_eq!(intake.one(a).await, AlertOutcome::Duplicate, "a re-send");
    // Asking for more than configured does not raise it; without it, 3 are needed.
    let mut high = alert_on("n2");
    high.threshold = Some(10);
    for want in [
        AlertOutcome::Counted,
        AlertOutcome::Counted,
        AlertOutcome::Acted,
    ] {
        assert_eq!(intake.one(high.clone()).await, want);
    }
    let mut zero = alert_on("n3");
    zero.threshold = Some(0);
    assert_eq!(intake.one(zero).await, AlertOutcome::Acted, "0 means 1");
}

#[test]
fn seeds_example_and_alertmanager_parse() {
    let seed = br#"{"cluster":"prod","node_name":"gpu-node-01","gpu_uuid":"GPU-123456","bus_id":"00000000:3B:00.0","metric":"xid_error","value":"Xid 79","time":1699999999}"#;
    let a = parse(seed).unwrap();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].node, "gpu-node-01");
    assert_eq!(a[0].uuid.as_deref(), Some("GPU-123456"));
    assert_eq!(a[0].value.as_deref(), Some("Xid 79"));
    let am = br#"{"version":"4","status":"firing","receiver":"faultline","groupKey":"{}:{}","alerts":[
        {"status":"firing","labels":{"alertname":"GpuXid","Hostname":"gpu-node-02","UUID":"GPU-abc","pci_bus_id":"00000000:18:00.0","gpu":"3"},"annotations":{"value":"79"},"startsAt":"2026-11-29T12:00:00Z","endsAt":"0001-01-01T00:00:00Z","fingerprint":"f1"},
        {"status":"resolved","labels":{"alertname":"GpuXid","node":"gpu-node-03","UUID":"GPU-def"},"annotations":{}}]}"#;
    let a = parse(am).unwrap();
    assert_eq!(a.len(), 2);
    assert_eq!(a[0].node, "gpu-node-02");
    assert_eq!(a[0].metric, "GpuXid");
    assert_eq!(a[0].value.as_deref(), Some("79"));
    assert!(a[0].firing && !a[1].firing);
    // The same Alertmanager alert parsed again is the same occurrence.
    let again = parse(am).unwrap();
    assert_eq!(a[0].occurrence, again[0].occurrence);
    assert!(a[0].occurrence.as_deref().unwrap().starts_with(AM_PREFIX));
    assert!(parse(b"{not json")
        .unwrap_err()
        .to_string()
        .contains("malformed JSON"));
    assert!(parse(br#"{"node_name":"x"}"#)
        .unwrap_err()
        .to_string()
        .contains("GPUAlert"));
    assert!(parse(b"42").is_err());
}

#[tokio::test]
async fn n_within_w_then_duplicates() {
    let (intake, mut rx, _) = intake(3, Duration::from_secs(60), Duration::from_secs(900));
    let alert = || alert_on("n1");
    assert_eq!(intake.one(alert()).await, AlertOutcome::Counted);
    assert_eq!(intake.one(alert()).await, AlertOutcome::Counted);
    assert_eq!(intake.one(alert()).await, AlertOutcome::Acted);
    for _ in 0..20 {
        assert_eq!(intake.one(alert()).await, AlertOutcome::Duplicate);
    }
    let v = rx.try_recv().unwrap();
    assert_eq!(v.node, "n1");
    assert_eq!(v.device.uuid.as_deref(), Some("GPU-1"));
    assert_eq!(v.device.reason, "alert:xid");
    assert!(rx.try_recv().is_err(), "one verdict for the burst");
    // Another device on the node counts on its own.
    let mut other = alert();
    other.uuid = Some("GPU-2".into());
    assert_eq!(intake.one(other).await, AlertOutcome::Counted);
    let mut none = alert();
    none.uuid = None;
    assert_eq!(intake.one(none).await, AlertOutcome::Unattributed);
    // A retried copy of the same occurrence counts once.
    let mut third = alert();
    third.uuid = Some("GPU-3".into());
    third.occurrence = Some("1699999999".into());
    assert_eq!(intake.one(third.clone()).await, AlertOutcome::Counted);
    assert_eq!(intake.one(third.clone()).await, AlertOutcome::Duplicate);
    assert_eq!(intake.one(third).await, AlertOutcome::Duplicate);
}

/// The N-within-W window and the dedup window run out.
#[tokio::test]
async fn the_counting_window_and_the_dedup_window_expire() {
    let (mut intake, mut rx, _) = intake(2, Duration::from_millis(300), Duration::from_millis(600));
    let clock = faultline_common::time::Clock::default();
    intake.clock = clock.clone();
    let alert = || alert_on("n1");
    assert_eq!(intake.one(alert()).await, AlertOutcome::Counted);
    clock.advance(Duration::from_millis(400));
    // The first one left the window: this one is the first again.
    assert_eq!(intake.one(alert()).await, AlertOutcome::Counted);
    assert!(rx.try_recv().is_err());
    assert_eq!(intake.one(alert()).await, AlertOutcome::Acted);
    assert_eq!(intake.one(alert()).await, AlertOutcome::Duplicate);
    clock.advance(Duration::from_millis(700));
    // Past the dedup window the key counts afresh.
    assert_eq!(intake.one(alert()).await, AlertOutcome::Counted);
    assert_eq!(intake.one(alert()).await, AlertOutcome::Acted);
    assert_eq!(rx.try_recv().unwrap().node, "n1");
    assert_eq!(rx.try_recv().unwrap().node, "n1");
}

/// A token holder cannot grow the intake's memory without bound:
/// past MAX_KEYS the oldest keys go (counted), and over-long names are not keys.
#[tokio::test]
async fn the_intakes_memory_is_bounded() {
    let (intake, _rx, metrics) = intake(3, Duration::from_secs(600), Duration::from_secs(900));
    let alert = |i: usize| alert_on(&format!("n{i}"));
    for i in 0..MAX_KEYS + 500 {
        assert_eq!(intake.one(alert(i)).await, AlertOutcome::Counted);
    }
    assert_eq!(intake.counts.lock().unwrap().len(), MAX_KEYS);
    assert!(metrics
        .encode()
        .contains("faultline_aggregator_intake_alerts_total{result=\"evicted\"} 500"));
    // The newest keys are the ones kept.
    assert!(intake.counts.lock().unwrap().contains_key(&(
        "n10499".to_string(),
        "GPU-1".to_string(),
        "xid".to_string()
    )));
    let mut long = alert(0);
    long.node = "n".repeat(MAX_NAME + 1);
    assert_eq!(intake.one(long).await, AlertOutcome::Unattributed);
}

/// Bodies that look like the intake's two formats, with odd values in every field.
fn body() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let v = || {
        prop_oneof![
            Just(Value::Null),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            ".{0,300}".prop_map(Value::from),
            Just(json!({"nested": [1, 2]})),
        ]
    };
    (v(), v(), v(), v(), v(), any::<bool>()).prop_map(|(node, uuid, metric, value, time, am)| {
        if am {
            json!({"version": "4", "status": "firing", "alerts": [{"status": "firing",
                "labels": {"node": node, "gpu_uuid": uuid, "alertname": metric},
                "annotations": {"value": value}, "startsAt": time, "fingerprint": "f"}]})
            .to_string()
        } else {
            json!([{"node_name": node, "gpu_uuid": uuid, "metric": metric, "value": value, "time": time}])
                .to_string()
        }
    })
}

proptest::proptest! {
    /// The intake's parser never panics, on any bytes or on either
    /// format with odd values; an alert comes out only for a body's own entries.
    #[test]
    fn the_intake_parser_never_panics(raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400), b in body()) {
        let _ = parse(&raw);
        if let Ok(alerts) = parse(b.as_bytes()) {
            proptest::prop_assert!(alerts.len() <= 1);
        }
    }
}

/// The keys' cap drops the least recently touched key, a touch
/// keeps a key, expiry drops what was last touched long ago; each in O(1) amortized
/// (the queue of touches stays within twice the keys).
#[test]
fn aged_keys_go_oldest_first() {
    let key = |i: usize| (format!("n{i}"), "gpu0".to_string(), "xid".to_string());
    let t0 = Instant::now();
    let mut a: Aged<Key, u32> = Aged::default();
    for i in 0..MAX_KEYS {
        *a.touch(key(i), t0 + Duration::from_millis(i as u64), || 0) += 1;
    }
    // Key 0 touched again: now the newest.
    a.touch(key(0), t0 + Duration::from_secs(100), || 0);
    assert_eq!(a.make_room(MAX_KEYS), 1);
    assert!(a.contains_key(&key(0)) && !a.contains_key(&key(1)));
    assert_eq!(a.len(), MAX_KEYS - 1);
    // Many touches of a few keys do not grow the queue without bound.
    for j in 0..100_000u64 {
        a.touch(
            key(5),
            t0 + Duration::from_secs(100) + Duration::from_micros(j),
            || 0,
        );
    }
    assert!(a.order.len() <= 2 * a.len() + 65, "{}", a.order.len());
    // Everything last touched over 50 s before t0 + 110 s goes; key 0 and key 5 stay.
    a.expire(t0 + Duration::from_secs(110), Duration::from_secs(50));
    assert_eq!(a.len(), 2);
    assert!(a.contains_key(&key(0)) && a.contains_key(&key(5)));
}

/// At most MAX_ALERTS alerts in one request.
#[tokio::test]
async fn a_request_of_too_many_alerts_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, "t0k\n").unwrap();
    let (mut i, _rx, _m) = intake(1, Duration::from_secs(60), Duration::from_secs(60));
    i.cfg.token_file = file;
    i.cfg.max_bytes = 8 << 20;
    let one = r#"{"node_name":"n1","gpu_uuid":"GPU-1","metric":"xid_error","value":"79"}"#;
    let body = format!("[{}]", vec![one; MAX_ALERTS + 1].join(","));
    let r = i.handle(&bearer("t0k"), None, Body::from(body)).await;
    assert!(
        matches!(r, Err(IntakeError::BadRequest(ref e)) if e.contains("max_alerts")),
        "{r:?}"
    );
}

/// The lines of alerts that reached the threshold: 20 per 10 s at most, the ones left
/// out counted into the next line written.
#[test]
fn threshold_lines_are_throttled_and_the_rest_counted() {
    let mut t = Throttle::default();
    let start = std::time::Instant::now();
    let written: Vec<Option<u64>> = (0..100).map(|_| t.allow(start)).collect();
    assert_eq!(written.iter().filter(|w| w.is_some()).count(), 20);
    assert!(written[..20].iter().all(|w| *w == Some(0)));
    assert_eq!(t.allow(start + LOG_PERIOD), Some(80));
}
