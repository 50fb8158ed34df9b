//! The quarantine benchmark: one failed GPU quarantined alone, at fleet scale. Run through
//! `benches/run-quarantine-bench.sh`; docs/benchmarks.md, "One device, not the node",
//! has the figures and what they leave out.
//!
//! The real path from the isolation pass on, on this machine:
//!
//! - the Kubernetes API test server (in this process) at 1.37 (DeviceTaintRule at
//!   `resource.k8s.io/v1`), the RBAC of deploy/base/aggregator.yaml enforced, with
//!   `BENCH_NODES` realistic GPU Nodes (~26 KB each), each with a ResourceSlice of 8
//!   GPUs as NVIDIA's DRA driver publishes it and one training pod per GPU holding it
//!   through its ResourceClaim (allocated, reserved); its device-taint eviction
//!   controller reports each `None` rule's prediction;
//! - faultline's `Remediator` with the device path on, over HTTP through the real `kube`
//!   client, as the aggregator's dispatcher calls it: for each of `BENCH_FAULTS` GPUs
//!   on distinct nodes (one at a time), the isolation pass (the node's slices, the
//!   claims of its pods, the rule at `None`, the controller's prediction against
//!   faultline's count, `NoSchedule`, the record), then the eviction pass.
//!
//! Not included (said next to the figures): the agent's sample, the aggregator's
//! pipeline and dispatch before the isolation pass (measured by the aggregator and
//! cluster benches), and a real kube-controller-manager's reaction time (the test
//! server's controller looks every 10 ms).
//!
//! `BENCH_TRACE=1` prints each isolation pass's API calls with their arrival times.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use faultline_aggregator::device_taint::{discover, DeviceQuarantine};
use faultline_aggregator::model::RecordDevice;
use faultline_aggregator::remediate::{record_of, Mode, Outcome, Remediator};
use faultline_aggregator::shard::Fence;
use faultline_common::rules::Rules;
use faultline_test_apiserver::{fixtures, Bootstrap, Release};
use rand::{Rng, SeedableRng};
use serde_json::json;

const GPUS: usize = 8;
const NS: &str = "train";
const TAINT: &str = "nvidia.com/gpu-fault";
const AGG_TOKEN: &str = "aggregator-token";
const AGG_USER: &str = "system:serviceaccount:faultline:faultline-aggregator";

fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v}")),
        Err(_) => Ok(default),
    }
}

fn node_name(i: usize) -> String {
    format!("gpu-node-{i:05}")
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let nodes = env_usize("BENCH_NODES", 1000)?;
    let faults = env_usize("BENCH_FAULTS", 50)?;
    let seed = env_usize("BENCH_SEED", 28)? as u64;
    if faults > nodes {
        bail!("BENCH_FAULTS ({faults}) must not exceed BENCH_NODES ({nodes}): one fault per node");
    }
    let (server, url) = cluster(nodes).await?;

    let dir = tempfile_dir()?;
    let token = dir.join("token");
    std::fs::write(&token, AGG_TOKEN)?;
    let mut kc = kube::Config::new(url.parse()?);
    kc.auth_info.token_file = Some(token.display().to_string());
    let client = kube::Client::try_from(kc)?;
    let rules = tokio::sync::watch::channel(Arc::new(Rules::default())).1;
    let q = DeviceQuarantine::new(rules);
    *q.api.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = discover(&client).await?;
    let r =
        Remediator::new(client, Mode::Enforce, TAINT, "default", "bench-0").with_devices(Some(q));

    // BENCH_FAULTS GPUs on distinct nodes, chosen by the seed.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut picked = BTreeSet::new();
    while picked.len() < faults {
        picked.insert(rng.random_range(0..nodes));
    }
    let targets: Vec<(String, usize)> = picked
        .into_iter()
        .map(|n| (node_name(n), rng.random_range(0..GPUS)))
        .collect();
    let fence = Fence::unfenced();
    let server_calls_before = server.calls().len();
    let mut to_rule = Vec::new();
    let mut to_created = Vec::new();
    let mut to_pass = Vec::new();
    let mut to_evicted = Vec::new();
    let mut evicted = BTreeSet::new();
    for (node, g) in &targets {
        let dev = RecordDevice {
            uuid: Some(fixtures::gpu_uuid(node, *g)),
            ..RecordDevice::new(format!("gpu{g}"), "row-remap-failure")
        };
        let t0 = Instant::now();
        // As the dispatcher does: a pass that left the rule at None (the controller's
        // prediction not in yet) is followed by another.
        let mut passes = 0;
        loop {
            passes += 1;
            match r.isolate(node, vec![dev.clone()], &fence).await? {
                Outcome::Isolated => break,
                Outcome::Waiting(_) if passes < 5 => continue,
                out => {
                    let events: Vec<String> = server
                        .list("events", "default")
                        .iter()
                        .map(|e| format!("{}: {}", e["reason"], e["message"]))
                        .collect();
                    let rule = server.list("devicetaintrules", "");
                    bail!("{node} gpu{g}: isolation came to {out:?} after {passes} passes; events {events:#?}; rules {rule:#?}")
                }
            }
        }
        if passes > 1 {
            eprintln!("{node} gpu{g}: {passes} isolation passes");
        }
        to_pass.push(t0.elapsed().as_secs_f64() * 1000.0);
        // When the rule was created (effect None) and enforced (NoSchedule), as the API
        // server carried the calls out.
        let start_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis() as u64
            - t0.elapsed().as_millis() as u64;
        let calls = server.calls();
        let at = |method: &str| {
            calls
                .iter()
                .rev()
                .find(|c| {
                    c.method == method && c.uri.contains("/devicetaintrules") && c.status < 300
                })
                .map(|c| c.at_ms.saturating_sub(start_ms) as f64)
        };
        to_created.push(at("POST").context("no rule created")?);
        to_rule.push(at("PATCH").context("no rule enforced")?);
        if std::env::var_os("BENCH_TRACE").is_some() {
            trace(&server, start_ms);
        }
        let e = r.evict(node, &[], &fence).await?;
        to_evicted.push(t0.elapsed().as_secs_f64() * 1000.0);
        evicted.extend(e.evicted.iter().map(|k| {
            // namespace/name/uid: the pod's name
            k.split('/').nth(1).unwrap_or_default().to_string()
        }));
    }
    let calls = server.calls().len() - server_calls_before;

    let expected: BTreeSet<String> = targets
        .iter()
        .map(|(node, g)| format!("{node}-p{g}"))
        .collect();
    let allocatable = server.allocatable_devices_all();
    let allocatable_total: usize = allocatable.values().sum();
    let tainted = server
        .list("nodes", "")
        .iter()
        .filter(|n| {
            n["spec"]["taints"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["key"] == TAINT))
        })
        .count();
    let mut predicted = 0;
    for (node, _) in &targets {
        let n: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(server.get("nodes", "", node).context("node")?)?;
        let rec = record_of(&n)?.context("record")?;
        predicted += rec.rules().iter().filter_map(|r| r.predicted).sum::<u64>();
    }
    let rules = server.list("devicetaintrules", "");
    to_rule.sort_by(f64::total_cmp);
    to_created.sort_by(f64::total_cmp);
    to_pass.sort_by(f64::total_cmp);
    to_evicted.sort_by(f64::total_cmp);
    println!("== device quarantine: {nodes} nodes x {GPUS} GPUs (DRA, 1.37), {faults} faults on distinct nodes, one at a time");
    println!(
        "devices allocatable: {allocatable_total} of {} (want {})",
        nodes * GPUS,
        nodes * GPUS - faults
    );
    println!("node taints: {tainted} (want 0)");
    println!(
        "DeviceTaintRules: {} ({} NoSchedule)",
        rules.len(),
        rules
            .iter()
            .filter(|r| r["spec"]["taint"]["effect"] == "NoSchedule")
            .count()
    );
    println!(
        "evicted pods: {} (want exactly the {} holders: {})",
        evicted.len(),
        expected.len(),
        if evicted == expected {
            "equal"
        } else {
            "DIFFERENT"
        }
    );
    println!(
        "controller's dry-run prediction: {predicted} pods (evicted {})",
        evicted.len()
    );
    let line = |what: &str, v: &[f64]| {
        println!(
            "{what} (ms): p50 {:.0} p90 {:.0} p99 {:.0} max {:.0}",
            percentile(v, 50.0),
            percentile(v, 90.0),
            percentile(v, 99.0),
            percentile(v, 100.0)
        )
    };
    line("fault -> rule created (effect None)", &to_created);
    line("fault -> rule enforced (NoSchedule)", &to_rule);
    line(
        "fault -> isolation pass done (record, condition, Event)",
        &to_pass,
    );
    line(
        "fault -> pod evicted (isolation and eviction passes)",
        &to_evicted,
    );
    println!(
        "API requests for {faults} faults: {calls} ({:.1} per fault)",
        calls as f64 / faults as f64
    );
    println!(
        "command: {}",
        std::env::var("BENCH_COMMAND").unwrap_or_default()
    );
    let ok = allocatable_total == nodes * GPUS - faults
        && tainted == 0
        && evicted == expected
        && predicted == evicted.len() as u64;
    if !ok {
        bail!("a check failed (above)");
    }
    Ok(())
}

/// The test API server with `nodes` GPU nodes, their slices, pods and claims; its URL.
async fn cluster(nodes: usize) -> Result<(faultline_test_apiserver::ApiServer, String)> {
    let manifest = std::fs::read_to_string("deploy/base/aggregator.yaml")
        .context("run from the repository root (benches/run-quarantine-bench.sh)")?;
    let t_seed = Instant::now();
    let (server, url) = Bootstrap::new()
        .release(Release::parse("1.37").map_err(anyhow::Error::msg)?)
        .namespace("faultline")
        .namespace(NS)
        .manifests(manifest)
        .rbac(&[(AGG_TOKEN, AGG_USER)])
        .spawn()
        .await;
    let seeded = |r: Result<serde_json::Value, faultline_test_apiserver::ApiError>| {
        r.map_err(|e| anyhow::anyhow!("seeding: {e:?}"))
    };
    for n in 0..nodes {
        let name = node_name(n);
        let ip = format!("10.{}.{}.{}", n / 65536, (n / 256) % 256, n % 256);
        seeded(server.create("nodes", "", fixtures::realistic_node(&name, &ip)))?;
        seeded(server.create("resourceslices", "", fixtures::nvidia_slice(&name, GPUS)))?;
        for g in 0..GPUS {
            let p = seeded(server.create(
                "pods",
                NS,
                fixtures::dra_pod(&format!("{name}-p{g}"), &name),
            ))?;
            let claim = fixtures::claim_for(&p, &format!("gpu-{g}"), json!([]));
            seeded(server.create("resourceclaims", NS, claim))?;
        }
    }
    eprintln!(
        "seeded {nodes} nodes x {GPUS} GPUs ({} pods, {} claims) in {:.1}s",
        nodes * GPUS,
        nodes * GPUS,
        t_seed.elapsed().as_secs_f64()
    );

    Ok((server, url))
}

/// Each API call since `start_ms`: when it arrived (ms after it), how long the server
/// took.
fn trace(server: &faultline_test_apiserver::ApiServer, start_ms: u64) {
    for c in server.calls().iter().filter(|c| c.received_ms >= start_ms) {
        eprintln!(
            "  +{:4} ms {:3} ms {} {} {}",
            c.received_ms - start_ms,
            c.at_ms.saturating_sub(c.received_ms),
            c.method,
            c.uri,
            c.status
        );
    }
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("quarantine-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
