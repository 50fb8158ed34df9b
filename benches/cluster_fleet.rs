//! cluster-bench's agents: the simulated fleet of `fleet.rs`, each node at an address of
//! its own as EndpointSlices name it (an IP and a port, no path), sending what a real
//! agent with the default deadband sends, and taking the aggregator's node-local
//! deliveries (`PUT /v1/fault`).
//!
//! Addresses: Linux routes all of 127.0.0.0/8 to `lo`, so a fleet process listens on
//! `0.0.0.0:PORT` and tells its nodes apart by the local address of each accepted
//! connection. Node `i` is at `127.(1 + a / 256).(a % 256).(1 + i % 254)` with
//! `a = i / 254` (no `.0` or `.255` host part).
//!
//! Readings: every node is sampled once a second (the agent's `--interval`). Each
//! device's power is its load's draw times `1 + N(0, BENCH_POWER_NOISE)` (default 3%,
//! in milliwatts as NVML reads it); its temperature (whole degrees, as NVML reads it)
//! follows the draw with a time constant of 40 s and a noise of 0.1 C per sample. Each
//! node's load alternates between training (600 W per GPU, give or take 5% per device;
//! phases of 15 min on average) and pauses such as checkpoints (150 W; 1 min on
//! average). A new document goes out when `faultline_agent::deadband::Deadband::default()`
//! says a device moved (2 C, 10% of power) or, for the drift within the band, a minute
//! after the last one: exactly the real agent's rule (agent/src/store.rs), applied to
//! the same readings.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use faultline_agent::deadband::Deadband;
use faultline_common::fault::Delivery;
use faultline_common::{DeviceReading, DeviceStatus, Thresholds, Vendor};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::fleet::{self, Fleet};

/// Devices per node.
pub const DEVICES: usize = 8;
/// A GPU's draw while training, and during a pause (W).
const BUSY_W: f64 = 600.0;
const PAUSE_W: f64 = 150.0;
/// Mean length of a training phase and of a pause (s).
const BUSY_MEAN_S: f64 = 900.0;
const PAUSE_MEAN_S: f64 = 60.0;
/// Temperature: equilibrium `T0 + K * W`, reached with this time constant (samples).
const T0: f64 = 28.0;
const K: f64 = 0.065;
const TAU: f64 = 40.0;
const TEMP_NOISE: f64 = 0.1;
/// How long a real agent keeps a watch stream open (`WATCH_MIN_LIFE`, times 1-2).
const WATCH_LIFE: Duration = Duration::from_secs(300);

/// The first two octets of the nodes' addresses: `127.1` (loopback aliases), or
/// `BENCH_NODE_NET` (e.g. `10.244`: a range made local in a network namespace, for a
/// real kube-apiserver, which refuses loopback endpoints).
fn net() -> (u8, u8) {
    static NET: std::sync::OnceLock<(u8, u8)> = std::sync::OnceLock::new();
    *NET.get_or_init(|| {
        let v = std::env::var("BENCH_NODE_NET").unwrap_or_else(|_| "127.1".into());
        let mut o = v.split('.').map(|x| x.parse::<u8>());
        match (o.next(), o.next()) {
            (Some(Ok(a)), Some(Ok(b))) if b > 0 => (a, b),
            _ => panic!("BENCH_NODE_NET={v}: two octets, e.g. 10.244"),
        }
    })
}

/// Node `i`'s address.
pub fn node_ip(i: usize) -> Ipv4Addr {
    let a = i / 254;
    let (x, y) = net();
    Ipv4Addr::new(x, y + (a / 256) as u8, (a % 256) as u8, (1 + i % 254) as u8)
}

/// The node at `ip`, if it is one of [`node_ip`]'s.
pub fn node_at(ip: Ipv4Addr) -> Option<usize> {
    let [a, b, c, d] = ip.octets();
    let (x, y) = net();
    if a != x || b < y || d == 0 || d == 255 {
        return None;
    }
    Some(((b - y) as usize * 256 + c as usize) * 254 + d as usize - 1)
}

/// The local address of an accepted connection: which node the client asked for.
#[derive(Clone, Copy)]
pub struct Local(pub SocketAddr);

impl Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>> for Local {
    fn connect_info(s: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Local(
            s.io()
                .local_addr()
                .unwrap_or_else(|_| ([0, 0, 0, 0], 0).into()),
        )
    }
}

/// What a fleet process counted since it started.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct FleetStats {
    /// New documents (generations) announced past the deadband or at the drift refresh.
    pub docs: u64,
    /// Their bytes (one copy each).
    pub doc_bytes: u64,
    /// Deliveries with an entry, answered 200.
    pub entries: u64,
    /// Confirmations answered 200.
    pub confirms: u64,
    /// Deliveries answered 409 (a confirmation of an entry not held, an older entry).
    pub conflicts: u64,
    /// Deliveries refused otherwise (token, node, body).
    pub refused: u64,
    /// Delivery requests' bytes (request line, headers as received, body).
    pub req_bytes: u64,
    /// Of which bodies.
    pub req_body_bytes: u64,
    /// Delivery answers' bytes (status line, headers as hyper writes them, body).
    pub resp_bytes: u64,
}

impl FleetStats {
    #[allow(dead_code)] // cluster-bench's
    pub fn add(&mut self, o: &FleetStats) {
        self.docs += o.docs;
        self.doc_bytes += o.doc_bytes;
        self.entries += o.entries;
        self.confirms += o.confirms;
        self.conflicts += o.conflicts;
        self.refused += o.refused;
        self.req_bytes += o.req_bytes;
        self.req_body_bytes += o.req_body_bytes;
        self.resp_bytes += o.resp_bytes;
    }

    #[allow(dead_code)] // cluster-bench's
    pub fn minus(&self, o: &FleetStats) -> FleetStats {
        FleetStats {
            docs: self.docs - o.docs,
            doc_bytes: self.doc_bytes - o.doc_bytes,
            entries: self.entries - o.entries,
            confirms: self.confirms - o.confirms,
            conflicts: self.conflicts - o.conflicts,
            refused: self.refused - o.refused,
            req_bytes: self.req_bytes - o.req_bytes,
            req_body_bytes: self.req_body_bytes - o.req_body_bytes,
            resp_bytes: self.resp_bytes - o.resp_bytes,
        }
    }
}

#[derive(Default)]
struct Counters {
    docs: AtomicU64,
    doc_bytes: AtomicU64,
    entries: AtomicU64,
    confirms: AtomicU64,
    conflicts: AtomicU64,
    refused: AtomicU64,
    req_bytes: AtomicU64,
    req_body_bytes: AtomicU64,
    resp_bytes: AtomicU64,
}

/// The delivery a node's agent holds.
#[derive(Default)]
struct Held {
    entry: Option<(String, u64)>,
    /// When the first delivered entry naming a failed device arrived (µs since the
    /// epoch).
    first_failed_us: Option<u64>,
}

/// A fleet process's agents.
pub struct Agents {
    pub fleet: Arc<Fleet>,
    bearer: String,
    held: Vec<Mutex<Held>>,
    counters: Counters,
}

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The first document of node `i`: 8 healthy H100s as NVML reads them, source up.
pub fn first_doc(i: usize) -> faultline_common::NodeHealth {
    faultline_common::testing::node(&fleet::node_name(i))
        .agent_version("0.1.0")
        .source("nvml", true)
        .npus((0..DEVICES as u32).map(|d| {
            faultline_common::testing::Device::nvml(d)
                .uuid(&fleet::gpu_uuid(i, d))
                .temperature(66.0)
                .power(600.0)
                .sample_age_ms(140)
                .reading(|r| r.name = Some("NVIDIA H100 80GB HBM3".into()))
                .build()
        }))
        .build()
}

impl Agents {
    pub fn new(first: usize, count: usize, token: &str) -> Arc<Self> {
        let fleet = Fleet::with_docs(first, count, first_doc);
        Arc::new(Agents {
            fleet,
            bearer: format!("Bearer {token}"),
            held: (0..count).map(|_| Mutex::default()).collect(),
            counters: Counters::default(),
        })
    }

    fn local(&self, addr: SocketAddr) -> Option<usize> {
        let SocketAddr::V4(a) = addr else {
            return None;
        };
        node_at(*a.ip())?
            .checked_sub(self.fleet.first)
            .filter(|i| *i < self.fleet.nodes.len())
    }

    pub fn stats(&self) -> FleetStats {
        let c = &self.counters;
        FleetStats {
            docs: c.docs.load(Relaxed),
            doc_bytes: c.doc_bytes.load(Relaxed),
            entries: c.entries.load(Relaxed),
            confirms: c.confirms.load(Relaxed),
            conflicts: c.conflicts.load(Relaxed),
            refused: c.refused.load(Relaxed),
            req_bytes: c.req_bytes.load(Relaxed),
            req_body_bytes: c.req_body_bytes.load(Relaxed),
            resp_bytes: c.resp_bytes.load(Relaxed),
        }
    }

    /// (global node index, µs since the epoch) of every first failed entry delivered.
    pub fn arrivals(&self) -> Vec<(usize, u64)> {
        self.held
            .iter()
            .enumerate()
            .filter_map(|(i, h)| Some((self.fleet.first + i, h.lock().unwrap().first_failed_us?)))
            .collect()
    }

    /// A hard fault (Xid 79) on device `d` of node `i` (global), announced at once.
    pub fn fail(&self, i: usize, d: usize) -> bool {
        let Some(local) = i
            .checked_sub(self.fleet.first)
            .filter(|l| *l < self.fleet.nodes.len())
        else {
            return false;
        };
        self.fleet.change(local, |doc| fleet::hard_fault(doc, d));
        self.counted_doc(local);
        true
    }

    fn counted_doc(&self, local: usize) {
        self.counters.docs.fetch_add(1, Relaxed);
        self.counters
            .doc_bytes
            .fetch_add(self.fleet.doc_len(local) as u64, Relaxed);
    }

    /// The agent's `PUT /v1/fault` (agent/src/fault_api.rs, agent/src/verdict.rs): the
    /// status and body of the answer.
    fn take(&self, local: usize, headers: &HeaderMap, body: &[u8]) -> (StatusCode, String) {
        let c = &self.counters;
        let auth = headers
            .get("authorization")
            .is_some_and(|v| v.as_bytes() == self.bearer.as_bytes());
        if !auth {
            c.refused.fetch_add(1, Relaxed);
            return (StatusCode::UNAUTHORIZED, r#"{"error":"token"}"#.into());
        }
        let Ok(d) = serde_json::from_slice::<Delivery>(body) else {
            c.refused.fetch_add(1, Relaxed);
            return (StatusCode::BAD_REQUEST, r#"{"error":"body"}"#.into());
        };
        let mut held = self.held[local].lock().unwrap();
        match d.entry {
            None => {
                if held.entry.as_ref() != Some(&(d.writer, d.sequence)) {
                    c.conflicts.fetch_add(1, Relaxed);
                    return (StatusCode::CONFLICT, r#"{"error":"not held"}"#.into());
                }
                c.confirms.fetch_add(1, Relaxed);
            }
            Some(entry) => {
                if entry.node != fleet::node_name(self.fleet.first + local) {
                    c.refused.fetch_add(1, Relaxed);
                    return (StatusCode::BAD_REQUEST, r#"{"error":"node"}"#.into());
                }
                if let Some((w, s)) = &held.entry {
                    if *w == d.writer && d.sequence < *s {
                        c.conflicts.fetch_add(1, Relaxed);
                        return (StatusCode::CONFLICT, r#"{"error":"older"}"#.into());
                    }
                }
                if held.first_failed_us.is_none()
                    && entry.npus.iter().any(|n| n.status == DeviceStatus::Failed)
                {
                    held.first_failed_us = Some(now_us());
                }
                held.entry = Some((d.writer, d.sequence));
                c.entries.fetch_add(1, Relaxed);
            }
        }
        (StatusCode::OK, format!(r#"{{"sequence":{}}}"#, d.sequence))
    }
}

/// The bytes of a request's line and headers as hyper read them.
fn request_head_len(path: &str, headers: &HeaderMap) -> usize {
    let line = "PUT  HTTP/1.1\r\n".len() + path.len();
    line + headers
        .iter()
        .map(|(k, v)| k.as_str().len() + 2 + v.len() + 2)
        .sum::<usize>()
        + 2
}

/// The bytes of an answer's status line and headers (`content-type`, `content-length`,
/// `date`) as hyper writes them.
fn response_head_len(status: StatusCode, body: usize) -> usize {
    let reason = status.canonical_reason().unwrap_or("").len();
    "HTTP/1.1 000 \r\n".len()
        + reason
        + "content-type: application/json\r\n".len()
        + "content-length: \r\n".len()
        + body.to_string().len()
        + "date: Wed, 02 Dec 2026 09:00:00 GMT\r\n".len()
        + 2
}

async fn health(
    State(a): State<Arc<Agents>>,
    ConnectInfo(Local(addr)): ConnectInfo<Local>,
    Query(q): Query<fleet::Q>,
) -> Response {
    let Some(local) = a.local(addr) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let life = WATCH_LIFE.mul_f64(rand::random_range(1.0..2.0));
    fleet::health_of(a.fleet.clone(), local, q, Some(life)).await
}

async fn deliver(
    State(a): State<Arc<Agents>>,
    ConnectInfo(Local(addr)): ConnectInfo<Local>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let c = &a.counters;
    c.req_bytes.fetch_add(
        (request_head_len("/v1/fault", &headers) + body.len()) as u64,
        Relaxed,
    );
    c.req_body_bytes.fetch_add(body.len() as u64, Relaxed);
    let (status, answer) = match a.local(addr) {
        Some(local) => a.take(local, &headers, &body),
        None => (StatusCode::NOT_FOUND, r#"{"error":"no node"}"#.into()),
    };
    c.resp_bytes.fetch_add(
        (response_head_len(status, answer.len()) + answer.len()) as u64,
        Relaxed,
    );
    (
        status,
        [("content-type", "application/json")],
        Bytes::from(answer),
    )
        .into_response()
}

/// Serve the agents on `0.0.0.0:0`; the port.
pub async fn serve(agents: Arc<Agents>) -> std::io::Result<u16> {
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await?;
    let port = listener.local_addr()?.port();
    let app = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/fault", axum::routing::put(deliver))
        .with_state(agents);
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<Local>()).await
    });
    Ok(port)
}

/// One device's simulated state.
struct Dev {
    /// Its draw while training (W).
    busy_w: f64,
    /// Its temperature, continuous (C).
    temp: f64,
    current: DeviceReading,
    announced: DeviceReading,
}

/// One node's simulated state.
struct NodeSim {
    busy: bool,
    /// Samples left in this phase.
    left: u32,
    devs: Vec<Dev>,
    announced_at: Instant,
}

fn gauss(rng: &mut impl Rng) -> f64 {
    let (u, v): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

fn phase_len(rng: &mut impl Rng, busy: bool) -> u32 {
    let mean = if busy { BUSY_MEAN_S } else { PAUSE_MEAN_S };
    (-mean * rng.random::<f64>().max(1e-12).ln()).ceil() as u32
}

impl NodeSim {
    fn new(rng: &mut impl Rng) -> Self {
        let busy = rng.random_bool(BUSY_MEAN_S / (BUSY_MEAN_S + PAUSE_MEAN_S));
        // Somewhere in its phase.
        let left = phase_len(rng, busy);
        let devs = (0..DEVICES)
            .map(|d| {
                let busy_w = BUSY_W * (1.0 + 0.05 * (2.0 * rng.random::<f64>() - 1.0));
                let w = if busy { busy_w } else { PAUSE_W };
                let temp = T0 + K * w + 0.5 * gauss(rng);
                let mut r = DeviceReading::new(format!("gpu{d}"), Vendor::Nvidia, "nvml");
                r.temperature_c = Some(temp.round());
                r.power_w = Some(w);
                Dev {
                    busy_w,
                    temp,
                    current: r.clone(),
                    announced: r,
                }
            })
            .collect();
        NodeSim {
            busy,
            left,
            devs,
            announced_at: Instant::now(),
        }
    }

    /// One sample of every device; whether a new document goes out.
    fn sample(
        &mut self,
        rng: &mut impl Rng,
        noise: f64,
        band: &Deadband,
        t: &Thresholds,
        now: Instant,
    ) -> bool {
        if self.left == 0 {
            self.busy = !self.busy;
            self.left = phase_len(rng, self.busy);
        }
        self.left -= 1;
        let mut moved = false;
        for d in &mut self.devs {
            let w = if self.busy { d.busy_w } else { PAUSE_W };
            let power = (w * (1.0 + noise * gauss(rng))).max(0.0);
            d.temp += (T0 + K * w - d.temp) / TAU + TEMP_NOISE * gauss(rng);
            d.current.power_w = Some((power * 1000.0).round() / 1000.0);
            d.current.temperature_c = Some(d.temp.round());
            moved |= band.moved(&d.announced, &d.current, t);
        }
        let drifted = now.duration_since(self.announced_at) >= band.refresh
            && self.devs.iter().any(|d| d.announced != d.current);
        if moved || drifted {
            self.announced_at = now;
            for d in &mut self.devs {
                d.announced.clone_from(&d.current);
            }
        }
        moved || drifted
    }
}

/// Sample every node once a second (each node at its own tenth of the second) and
/// announce what the deadband lets through.
pub fn noise(agents: Arc<Agents>, power_noise: f64) {
    tokio::spawn(async move {
        let n = agents.fleet.nodes.len();
        let mut rng = rand::rngs::StdRng::seed_from_u64(agents.fleet.first as u64 + 1);
        let mut sims: Vec<NodeSim> = (0..n).map(|_| NodeSim::new(&mut rng)).collect();
        let (band, t) = (Deadband::default(), Thresholds::default());
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for k in 0usize.. {
            tick.tick().await;
            let now = Instant::now();
            for (i, sim) in sims.iter_mut().enumerate().skip(k % 10).step_by(10) {
                if sim.sample(&mut rng, power_noise, &band, &t, now) {
                    let devs = &sim.devs;
                    agents.fleet.change(i, |doc| {
                        for (npu, d) in doc.npus.iter_mut().zip(devs) {
                            npu.reading.temperature_c = d.current.temperature_c;
                            npu.reading.power_w = d.current.power_w;
                        }
                        doc.timestamp = faultline_common::time::now_rfc3339();
                    });
                    agents.counted_doc(i);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        for i in [0, 1, 253, 254, 255, 65_000, 20_000, 1_000_000] {
            let ip = node_ip(i);
            assert_ne!(ip.octets()[3], 0);
            assert_ne!(ip.octets()[3], 255);
            assert_eq!(node_at(ip), Some(i), "{ip}");
        }
        assert_eq!(node_at(Ipv4Addr::new(127, 0, 0, 1)), None);
    }
}
