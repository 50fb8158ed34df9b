//! The HTTP server both binaries use, bounded against slow and idle clients:
//! `axum::serve` has no header-read timeout, no request timeout and no connection cap,
//! so a few hundred half-sent requests could hold a process's memory and sockets.
//!
//! - The listen backlog is [`Limits::backlog`] (1,024), not the default 128: a burst of
//!   connections from a fleet does not leave clients in SYN retries.
//! - At most [`Limits::max_connections`] connections are open. One more takes the
//!   slot of the connection that has waited longest for a request head (not a trusted
//!   one), which is closed (counted: 400 slow heads from 20 addresses failed half of
//!   the pods' reads of the agent's pod port); where none waits, it is accepted and
//!   closed at once (counted), so the backlog keeps moving and the client fails fast.
//! - One peer address holds at most [`Limits::max_per_peer`] of them (~2,100
//!   sockets from anyone who could reach an agent's port shut its aggregator out).
//! - A request's head must arrive within [`Limits::header_timeout`] of the connection's
//!   start or of its last answer's end, a quarter of it while the server is over half
//!   full, and its head is at most [`Limits::max_head_bytes`]. A connection that has
//!   carried a trusted request ([`serve_trusted`]: the aggregator's) may wait for its
//!   next one up to [`Limits::idle_timeout`]: hyper's own `header_read_timeout`
//!   closed the aggregator's kept-alive delivery connection between two confirmations,
//!   so each confirmation needed a new connection, which a crowd of slow ones could
//!   take first.
//! - A request's body must arrive within [`Limits::body_timeout`] of its head
//!   (a token holder's slow body held its socket for the whole request timeout); past it
//!   the handler reads an error (a 4xx) and the connection closes.
//! - A request is answered within [`Limits::request_timeout`] (503 otherwise).
//! - A connection with no request in flight and no bytes either way for
//!   [`Limits::idle_timeout`] is closed.
//! - With a [`Trust`] ([`serve_trusted`]), [`Limits::reserved`] more connections are
//!   kept for requests it accepts (the agent's: the aggregator's, by the delivery
//!   token; ~2,100 sockets from anyone who could reach an agent's port shut
//!   its aggregator out, and the node turned Unknown). A connection that gets one of
//!   them because the others are taken must send its request head within a second,
//!   and is answered 503 and closed unless each of its requests is trusted. (A peer
//!   that opens connections faster than that can still take them; the NetworkPolicy
//!   that admits only the aggregator to the port is the fence against it.)

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::Semaphore;
use tower::ServiceExt;

mod conn;
use conn::{Activity, Answering, InFlight, TimedBody, Tracked};

/// The bounds of one server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// Open connections from one peer address at most.
    pub max_per_peer: usize,
    /// The listen backlog.
    pub backlog: u32,
    /// A request head must arrive within this.
    pub header_timeout: Duration,
    /// A request's body must arrive within this of its head.
    pub body_timeout: Duration,
    /// A request must be answered within this (long polls included).
    pub request_timeout: Duration,
    /// A connection idle this long (nothing in flight, no bytes) is closed.
    pub idle_timeout: Duration,
    /// Largest request head (request line and headers).
    pub max_head_bytes: usize,
    /// Connections beyond `max_connections` kept for trusted requests
    /// ([`serve_trusted`]; without a [`Trust`] none are).
    pub reserved: usize,
}

/// Which requests may use a reserved connection, by their headers.
pub type Trust = Arc<dyn Fn(&axum::http::HeaderMap) -> bool + Send + Sync>;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 2048,
            max_per_peer: 128,
            backlog: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            // Above the agent's longest long poll (60 s).
            request_timeout: Duration::from_secs(75),
            idle_timeout: Duration::from_secs(60),
            max_head_bytes: 64 << 10,
            reserved: 0,
        }
    }
}

/// What the server has done, for the binaries' metrics.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections closed at once because the cap was reached.
    pub refused: AtomicU64,
    /// Connections closed for idleness.
    pub idle_closed: AtomicU64,
    /// Connections waiting for a request head closed to make room for a newcomer.
    pub made_room: AtomicU64,
    /// Requests answered 503 for taking longer than the request timeout.
    pub timed_out: AtomicU64,
}

impl prometheus_client::collector::Collector for Stats {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let open = ConstGauge::new(self.open.load(Ordering::Relaxed) as i64);
        let e = encoder.encode_descriptor(
            "http_connections_open",
            "HTTP connections open now",
            None,
            open.metric_type(),
        )?;
        open.encode(e)?;
        for (name, help, v) in [
            (
                "http_connections_refused",
                "HTTP connections closed at once: the connection cap was reached",
                &self.refused,
            ),
            (
                "http_connections_idle_closed",
                "HTTP connections closed for idleness (or a request head that never came)",
                &self.idle_closed,
            ),
            (
                "http_connections_made_room",
                "HTTP connections waiting for a request head, closed to let a newcomer in: every slot was taken",
                &self.made_room,
            ),
            (
                "http_requests_timed_out",
                "HTTP requests answered 503 past the request timeout",
                &self.timed_out,
            ),
        ] {
            let c = ConstCounter::new(v.load(Ordering::Relaxed));
            let e = encoder.encode_descriptor(name, help, None, c.metric_type())?;
            c.encode(e)?;
        }
        Ok(())
    }
}

/// Bind `addr` with `backlog`.
pub fn bind(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Serve `router` on `listener` within `limits` until `shutdown` completes; then open
/// connections finish their requests (bounded by the request timeout).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stats: Arc<Stats>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_trusted(listener, router, limits, stats, None, shutdown).await;
}

/// [`serve`], with [`Limits::reserved`] connections kept for the requests `trust`
/// accepts once the others are taken.
pub async fn serve_trusted(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stats: Arc<Stats>,
    trust: Option<Trust>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let reserved = Arc::new(Semaphore::new(if trust.is_some() {
        limits.reserved
    } else {
        0
    }));
    let peers: Peers = Arc::default();
    let open: Open = Arc::default();
    let mut next_id = 0u64;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: wait a moment instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // The peer's share first: a peer at its cap makes no room.
        let Some(peer_slot) = PeerSlot::take(&peers, peer.ip(), limits.max_per_peer) else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        // A general slot, or else a reserved one, whose requests must be trusted, or
        // else the general slot of a connection waiting for its head, of a peer that
        // holds more than this one.
        let (general, reserved_slot) = match slots.clone().try_acquire_owned() {
            Ok(s) => (Some(s), None),
            Err(_) => match reserved.clone().try_acquire_owned() {
                Ok(s) => (None, Some(s)),
                Err(_) => match make_room(&open, &peers, peer.ip()) {
                    Some(s) => (Some(s), None),
                    None => {
                        stats.refused.fetch_add(1, Ordering::Relaxed);
                        drop(stream);
                        continue;
                    }
                },
            },
        };
        let on_reserved = reserved_slot.is_some();
        let activity = Arc::new(Activity::new());
        let listed = Listed::add(&open, next_id, peer.ip(), &activity, general);
        next_id += 1;
        // Over half full: a head must come four times sooner (a crowd of slow heads
        // cannot hold the rest of the room for long).
        let mut limits = limits;
        if slots.available_permits() < limits.max_connections / 2 {
            limits.header_timeout /= 4;
        }
        // A reserved connection must show it is trusted at once: an idle one holds
        // its slot a second at most.
        if on_reserved {
            limits.header_timeout = limits.header_timeout.min(Duration::from_secs(1));
        }
        let _ = stream.set_nodelay(true);
        let (router, stats, mut stop) = (router.clone(), stats.clone(), stop_rx.clone());
        let trust = trust.clone().map(|t| (t, on_reserved));
        tokio::spawn(async move {
            let _slot = (listed, reserved_slot);
            let _peer = peer_slot;
            stats.open.fetch_add(1, Ordering::Relaxed);
            let stream = Tracked {
                inner: stream,
                activity,
            };
            connection(stream, peer, router, limits, &stats, trust, &mut stop).await;
            stats.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
    let _ = stop_tx.send(true);
    // Let open connections finish what they are answering.
    let _ = tokio::time::timeout(
        limits.request_timeout,
        slots.acquire_many(limits.max_connections as u32),
    )
    .await;
}

/// An open connection, as [`make_room`] sees it: its peer, what it does, and its
/// general slot (none: a reserved one, or given to a newcomer).
struct Entry {
    ip: std::net::IpAddr,
    activity: Arc<Activity>,
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The open connections, by id.
type Open = Arc<std::sync::Mutex<std::collections::HashMap<u64, Entry>>>;

/// A connection listed in [`Open`] while it lives (its general slot with it).
struct Listed(Open, u64);

impl Listed {
    fn add(
        open: &Open,
        id: u64,
        ip: std::net::IpAddr,
        activity: &Arc<Activity>,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Self {
        let entry = Entry {
            ip,
            activity: activity.clone(),
            slot,
        };
        open.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, entry);
        Listed(open.clone(), id)
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.1);
    }
}

/// Every slot taken: the general slot of a connection waiting for a request head (none
/// in flight, not trusted) of the peer that holds the most connections, more than
/// `ip` (counted with the newcomer), its longest wait first. That connection is told
/// to close. So a crowd of slow heads from a few addresses cannot keep a client with
/// fewer connections out: 400 of them from 20 addresses, each under the per-peer cap,
/// failed half of the pods' reads of the agent's pod port. The crowd's own newcomers
/// take slots only from peers that hold more than they do. `None`: nobody to ask.
fn make_room(
    open: &Open,
    peers: &Peers,
    ip: std::net::IpAddr,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let counts = peers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let count = |ip: &std::net::IpAddr| counts.get(ip).copied().unwrap_or(0);
    let mut open = open
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (_, e) = open
        .values_mut()
        .filter(|e| e.slot.is_some() && !e.activity.trusted.load(Ordering::Relaxed))
        .filter(|e| count(&e.ip) > count(&ip))
        .filter_map(|e| Some(((count(&e.ip), e.activity.waiting_for()?), e)))
        .max_by_key(|(key, _)| *key)?;
    e.activity.leave.notify_one();
    e.slot.take()
}

/// Open connections per peer address.
type Peers = Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// One connection of a peer, counted while it lives.
struct PeerSlot {
    peers: Peers,
    ip: std::net::IpAddr,
}

impl PeerSlot {
    /// A slot for `ip`, if it holds fewer than `max`.
    fn take(peers: &Peers, ip: std::net::IpAddr, max: usize) -> Option<Self> {
        let mut p = peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = p.entry(ip).or_insert(0);
        if *n >= max.max(1) {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            peers: peers.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut p = self
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = p.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.ip);
            }
        }
    }
}

async fn connection(
    stream: Tracked,
    peer: std::net::SocketAddr,
    router: Router,
    limits: Limits,
    stats: &Stats,
    trust: Option<(Trust, bool)>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) {
    let activity = stream.activity.clone();
    let io = TokioIo::new(stream);
    let act = activity.clone();
    let (request_timeout, body_timeout) = (limits.request_timeout, limits.body_timeout);
    let timed_out = Arc::new(AtomicU64::new(0));
    let timed_out_in = timed_out.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (router, act, timed_out) = (router.clone(), act.clone(), timed_out_in.clone());
        // On a reserved connection, only trusted requests; the others are turned away
        // and the connection closed. A trusted request lets the connection wait longer
        // for its next one.
        let trusted = trust.as_ref().is_some_and(|(t, _)| t(req.headers()));
        if trusted {
            act.trusted.store(true, Ordering::Relaxed);
        }
        let untrusted = trust.as_ref().is_some_and(|(_, reserved)| *reserved) && !trusted;
        async move {
            if untrusted {
                let mut r = Response::new(Body::from(
                    "{\"error\":\"the server is full; the connections left are reserved\",\"status\":503}",
                ));
                *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                r.headers_mut().insert(
                    axum::http::header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
                return Ok::<Response<Body>, Infallible>(r);
            }
            let busy = InFlight::new(&act);
            // Who is asking (`ConnectInfo`): the agent takes a pod's drain
            // acknowledgement only from that pod's address.
            let mut req = req;
            req.extensions_mut()
                .insert(axum::extract::ConnectInfo(peer));
            let req = req.map(|b| {
                Body::new(TimedBody {
                    inner: b,
                    deadline: Box::pin(tokio::time::sleep(body_timeout)),
                })
            });
            match tokio::time::timeout(request_timeout, router.oneshot(req)).await {
                Ok(Ok(resp)) => Ok::<Response<Body>, Infallible>(
                    resp.map(|inner| Body::new(Answering { inner, _busy: busy })),
                ),
                Ok(Err(never)) => match never {},
                Err(_) => {
                    timed_out.fetch_add(1, Ordering::Relaxed);
                    let mut r = Response::new(Body::from(
                        "{\"error\":\"the request took too long\",\"status\":503}",
                    ));
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    Ok(r)
                }
            }
        }
    });
    // hyper's head timer only as a backstop: it runs from the end of each answer alike
    // for every connection; the loop below applies `header_timeout` (the trusted:
    // `idle_timeout`).
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout.max(limits.header_timeout))
        .max_buf_size(limits.max_head_bytes.max(8192))
        .keep_alive(true)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let check = (limits.idle_timeout.min(limits.header_timeout) / 4).max(Duration::from_millis(50));
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                // hyper's header_read_timeout: a head that never (fully) came.
                if r.is_err_and(|e| e.is_timeout()) {
                    stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
            _ = tokio::time::sleep(check), if !closing => {
                // A head that never (fully) came: closed at once (nothing in flight).
                let head_limit = if activity.trusted.load(Ordering::Relaxed) {
                    limits.idle_timeout
                } else {
                    limits.header_timeout
                };
                if activity.waiting_for().is_some_and(|w| w >= head_limit) {
                    stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                let idle = activity.in_flight.load(Ordering::Relaxed) == 0
                    && activity.idle_for() >= limits.idle_timeout;
                if idle {
                    stats.idle_closed.fetch_add(1, Ordering::Relaxed);
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
            // Its slot given to a newcomer (`make_room`): closed, unless a request came
            // since (then it ends with its answer, its socket over the cap till then).
            _ = activity.leave.notified(), if !closing => {
                if activity.in_flight.load(Ordering::Relaxed) == 0 {
                    stats.made_room.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
            _ = stop.changed(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
    stats
        .timed_out
        .fetch_add(timed_out.load(Ordering::Relaxed), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn start(limits: Limits) -> (SocketAddr, Arc<Stats>) {
        let (addr, stats, _) = start_counting(limits).await;
        (addr, stats)
    }

    /// [`start`], and how many `/slow` requests its handler has taken up.
    async fn start_counting(limits: Limits) -> (SocketAddr, Arc<Stats>, Arc<AtomicUsize>) {
        let listener = bind("127.0.0.1:0".parse().unwrap(), limits.backlog).unwrap();
        let addr = listener.local_addr().unwrap();
        let slow = Arc::new(AtomicUsize::new(0));
        let taken = slow.clone();
        let router = Router::new()
            .route("/ok", axum::routing::get(|| async { "ok" }))
            .route(
                "/echo",
                axum::routing::post(|b: axum::body::Bytes| async move { b }),
            )
            .route(
                "/slow",
                axum::routing::get(move || {
                    taken.fetch_add(1, Ordering::Relaxed);
                    async {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        "late"
                    }
                }),
            );
        let stats = Arc::new(Stats::default());
        tokio::spawn(serve(
            listener,
            router,
            limits,
            stats.clone(),
            std::future::pending(),
        ));
        (addr, stats, slow)
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        out
    }

    /// Closed by the server: a read returns end of file (or a reset) before `within`.
    async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        let mut b = [0u8; 1024];
        loop {
            match tokio::time::timeout(within, s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    /// A request head sent slowly (slowloris) and a connection that sends nothing are
    /// both closed; the server keeps answering others meanwhile.
    #[tokio::test]
    async fn slow_and_idle_connections_are_closed() {
        let limits = Limits {
            header_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(600),
            ..Limits::default()
        };
        let (addr, stats) = start(limits).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        let mut silent = TcpStream::connect(addr).await.unwrap();
        assert!(get(addr, "/ok").await.ends_with("ok"));
        assert!(
            closed_within(&mut slow, Duration::from_secs(5)).await,
            "slow head"
        );
        assert!(
            closed_within(&mut silent, Duration::from_secs(5)).await,
            "silent"
        );
        let _ = stats;
    }

    /// One peer holds at most `max_per_peer` connections; another peer is
    /// still served.
    #[tokio::test]
    async fn one_peer_cannot_take_every_connection() {
        let limits = Limits {
            max_per_peer: 3,
            ..Limits::default()
        };
        let (addr, stats) = start(limits).await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut extra = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut extra, Duration::from_secs(2)).await);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
        // Its connections gone, the peer is served again.
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(get(addr, "/ok").await.ends_with("ok"));
    }

    /// A connection from loopback address `127.0.0.<a>` to `addr`.
    async fn connect_from(a: u8, addr: SocketAddr) -> TcpStream {
        let s = TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::from(([127, 0, 0, a], 0))).unwrap();
        s.connect(addr).await.unwrap()
    }

    /// Past the connection cap, a newcomer of a peer holding fewer connections takes
    /// the slot of a connection waiting for its head of a peer holding more (before,
    /// it was refused); where every connection is busy answering, or the newcomer's
    /// peer holds as many, it is closed at once (and counted).
    #[tokio::test]
    async fn past_the_cap_a_lighter_peer_takes_the_slot_of_a_waiting_one() {
        let limits = Limits {
            max_connections: 4,
            ..Limits::default()
        };
        let (addr, stats, slow) = start_counting(limits).await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The same peer again: it holds as many as anyone, it is refused.
        let mut same = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut same, Duration::from_secs(2)).await);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
        // Another peer takes the slot of the one that waited longest for its head.
        let mut other = connect_from(2, addr).await;
        let answer = ask(&mut other, "").await.unwrap();
        assert!(answer.ends_with("ok"), "{answer}");
        assert!(closed_within(&mut held[0], Duration::from_secs(2)).await);
        assert_eq!(stats.made_room.load(Ordering::Relaxed), 1);
        drop(held);
        drop(other);
        // Every slot busy answering: nobody makes room, one more is closed at once.
        let mut busy = Vec::new();
        for _ in 0..4 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            busy.push(s);
        }
        // All four in flight (their handler has them): none waits for a head.
        while slow.load(Ordering::Relaxed) < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut extra = connect_from(3, addr).await;
        assert!(closed_within(&mut extra, Duration::from_secs(2)).await);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 2);
    }

    /// 400 slow connections from 20 addresses (each under the per-peer cap) keep every
    /// slot taken, again and again. A client that sends its request at once was
    /// refused about as often as the crowd held every slot; now it takes the slot of
    /// the longest wait, and each of its reads is answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crowd_of_slow_heads_does_not_keep_a_quick_client_out() {
        use std::sync::atomic::AtomicBool;
        let limits = Limits {
            max_connections: 32,
            header_timeout: Duration::from_secs(1),
            ..Limits::default()
        };
        let (addr, stats) = start(limits).await;
        let stop = Arc::new(AtomicBool::new(false));
        let mut crowd = Vec::new();
        for a in 2..22u8 {
            for _ in 0..20 {
                let stop = stop.clone();
                crowd.push(tokio::spawn(async move {
                    let from = SocketAddr::from(([127, 0, 0, a], 0));
                    while !stop.load(Ordering::Relaxed) {
                        let s = TcpSocket::new_v4().unwrap();
                        if s.bind(from).is_err() {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                        let Ok(mut c) = s.connect(addr).await else {
                            continue;
                        };
                        let _ = c.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\n").await;
                        let mut b = [0u8; 64];
                        let _ = tokio::time::timeout(Duration::from_secs(5), c.read(&mut b)).await;
                    }
                }));
            }
        }
        // The crowd holds the room.
        while stats.open.load(Ordering::Relaxed) < 32 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut answered = 0;
        for _ in 0..50 {
            let s = TcpSocket::new_v4().unwrap();
            s.bind(SocketAddr::from(([127, 0, 0, 99], 0))).unwrap();
            let mut c = s.connect(addr).await.unwrap();
            c.write_all(b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut out = String::new();
            let _ = tokio::time::timeout(Duration::from_secs(3), c.read_to_string(&mut out)).await;
            answered += usize::from(out.starts_with("HTTP/1.1 200"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.store(true, Ordering::Relaxed);
        for c in crowd {
            c.abort();
        }
        let made = stats.made_room.load(Ordering::Relaxed);
        assert_eq!(
            answered, 50,
            "{answered} of 50 reads answered ({made} made room)"
        );
    }

    /// One request on a kept-alive connection: the answer's first bytes.
    async fn ask(s: &mut TcpStream, extra: &str) -> std::io::Result<String> {
        let req = format!("GET /ok HTTP/1.1\r\nhost: x\r\n{extra}\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut out = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut out))
            .await
            .map_err(std::io::Error::other)??;
        Ok(String::from_utf8_lossy(&out[..n]).to_string())
    }

    /// A kept-alive connection waits for its next request head `header_timeout` at
    /// most; one that carried a trusted request (the aggregator's deliveries, a
    /// confirmation every 10 s) waits up to `idle_timeout`, so its next request needs
    /// no new connection, which a crowd could have taken.
    #[tokio::test]
    async fn a_trusted_connection_is_kept_between_its_requests() {
        let limits = Limits {
            header_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_secs(30),
            ..Limits::default()
        };
        let listener = bind("127.0.0.1:0".parse().unwrap(), limits.backlog).unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/ok", axum::routing::get(|| async { "ok" }));
        let trust: Trust =
            Arc::new(|h: &axum::http::HeaderMap| h.get("x-trusted").is_some_and(|v| v == "yes"));
        let stats = Arc::new(Stats::default());
        tokio::spawn(serve_trusted(
            listener,
            router,
            limits,
            stats,
            Some(trust),
            std::future::pending(),
        ));
        // The trusted one answered first: with one head timeout for both (hyper's, before),
        // it is closed by the time the plain one is.
        let mut trusted = TcpStream::connect(addr).await.unwrap();
        let mut plain = TcpStream::connect(addr).await.unwrap();
        assert!(ask(&mut trusted, "x-trusted: yes\r\n")
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200"));
        assert!(ask(&mut plain, "")
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200"));
        assert!(
            closed_within(&mut plain, Duration::from_secs(5)).await,
            "an untrusted connection waits header_timeout at most"
        );
        let again = ask(&mut trusted, "x-trusted: yes\r\n").await;
        assert!(
            again.as_ref().is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
            "the trusted connection was kept: {again:?}"
        );
    }

    /// With every connection taken, the reserved ones serve only
    /// trusted requests (here, a header `x-trusted: yes`); any other request on one is
    /// answered 503 and its connection closed; without a trust, nothing is reserved.
    #[tokio::test]
    async fn reserved_connections_serve_only_trusted_requests() {
        let limits = Limits {
            max_connections: 4,
            reserved: 2,
            ..Limits::default()
        };
        let listener = bind("127.0.0.1:0".parse().unwrap(), limits.backlog).unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/ok", axum::routing::get(|| async { "ok" }));
        let stats = Arc::new(Stats::default());
        let trust: Trust =
            Arc::new(|h: &axum::http::HeaderMap| h.get("x-trusted").is_some_and(|v| v == "yes"));
        tokio::spawn(serve_trusted(
            listener,
            router,
            limits,
            stats.clone(),
            Some(trust),
            std::future::pending(),
        ));
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ask = |trusted: bool| async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let extra = if trusted { "x-trusted: yes\r\n" } else { "" };
            s.write_all(format!("GET /ok HTTP/1.1\r\nhost: x\r\n{extra}\r\n").as_bytes())
                .await
                .unwrap();
            let mut out = vec![0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut out))
                .await
                .expect("an answer")
                .unwrap_or(0);
            (String::from_utf8_lossy(&out[..n]).to_string(), s)
        };
        let (untrusted, mut s) = ask(false).await;
        assert!(untrusted.starts_with("HTTP/1.1 503"), "{untrusted}");
        assert!(closed_within(&mut s, Duration::from_secs(2)).await);
        let (trusted, _kept) = ask(true).await;
        assert!(trusted.starts_with("HTTP/1.1 200"), "{trusted}");
        assert!(trusted.ends_with("ok"), "{trusted}");
        // The second reserved slot, then none: the next is closed at once.
        let (_, _second) = ask(true).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Another peer's next takes the slot of a general connection that waits for
        // its head, never a trusted one's.
        let mut beyond = connect_from(2, addr).await;
        let answer = super::tests::ask(&mut beyond, "").await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let mut closed = 0;
        for h in &mut held {
            closed += usize::from(closed_within(h, Duration::from_millis(500)).await);
        }
        assert_eq!(closed, 1);
        assert_eq!(stats.made_room.load(Ordering::Relaxed), 1);
    }

    /// A body sent slowly is given up at the body timeout, not the request
    /// timeout; a whole one is read as ever.
    #[tokio::test]
    async fn a_slow_body_is_given_up_at_the_body_timeout() {
        let limits = Limits {
            body_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let (addr, _) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123456789")
            .await
            .unwrap();
        let started = Instant::now();
        let mut out = Vec::new();
        let mut b = [0u8; 1024];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&b[..n]);
        }
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 4"), "{out}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        let mut whole = TcpStream::connect(addr).await.unwrap();
        whole
            .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello")
            .await
            .unwrap();
        let mut out = String::new();
        let _ = whole.read_to_string(&mut out).await;
        assert!(out.ends_with("hello"), "{out}");
    }

    /// A request that outlives the request timeout is answered 503.
    #[tokio::test]
    async fn a_request_past_its_deadline_is_a_503() {
        let limits = Limits {
            request_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        let (addr, _) = start(limits).await;
        let r = get(addr, "/slow").await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    }
}
