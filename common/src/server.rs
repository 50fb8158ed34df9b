//! The HTTP server both binaries use, bounded against slow and idle clients:
//! `axum::serve` has no header-read timeout, no request timeout and no connection cap,
//! so a few hundred half-sent requests could hold a process's memory and sockets.
//!
//! - The listen backlog is [`Limits::backlog`] (1,024), not the default 128: a burst of
//!   connections from a fleet does not leave clients in SYN retries.
//! - At most [`Limits::max_connections`] connections are open; one more is accepted and
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
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceExt;

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

/// The last time bytes moved on a connection, and its requests in flight.
#[derive(Debug)]
struct Activity {
    start: Instant,
    /// Milliseconds since `start` at the last read or write.
    last_ms: AtomicU64,
    /// Requests being answered, their bodies included.
    in_flight: AtomicUsize,
    /// Milliseconds since `start` when the last answer ended (0: none yet).
    answered_ms: AtomicU64,
    /// A trusted request came on this connection.
    trusted: std::sync::atomic::AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            answered_ms: AtomicU64::new(0),
            trusted: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// How long the connection has waited for a request head: since its last answer
    /// ended, or since it opened (none while a request is in flight).
    fn waiting_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.answered_ms.load(Ordering::Relaxed));
        Some(self.start.elapsed().saturating_sub(since))
    }

    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// A TCP stream that records activity.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts a request in flight while it lives.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(a: &Arc<Activity>) -> Self {
        a.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(a.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0
            .answered_ms
            .store(self.0.start.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An answer's body, its request counted in flight until the body ends (a stream's
/// included).
struct Answering {
    inner: Body,
    _busy: InFlight,
}

impl hyper::body::Body for Answering {
    type Data = hyper::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
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
        // A general slot, or else a reserved one, whose requests must be trusted.
        let (slot, on_reserved) = match slots.clone().try_acquire_owned() {
            Ok(s) => (s, false),
            Err(_) => match reserved.clone().try_acquire_owned() {
                Ok(s) => (s, true),
                Err(_) => {
                    stats.refused.fetch_add(1, Ordering::Relaxed);
                    drop(stream);
                    continue;
                }
            },
        };
        let Some(peer_slot) = PeerSlot::take(&peers, peer.ip(), limits.max_per_peer) else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
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
            let (_slot, _peer) = (slot, peer_slot);
            stats.open.fetch_add(1, Ordering::Relaxed);
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
    stream: TcpStream,
    peer: std::net::SocketAddr,
    router: Router,
    limits: Limits,
    stats: &Stats,
    trust: Option<(Trust, bool)>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
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

/// A request body that fails once its deadline passes before it is whole.
struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl hyper::body::Body for TimedBody {
    type Data = hyper::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(r) => Poll::Ready(r.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    Poll::Ready(Some(Err("the request body did not arrive in time".into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(limits: Limits) -> (SocketAddr, Arc<Stats>) {
        let listener = bind("127.0.0.1:0".parse().unwrap(), limits.backlog).unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new()
            .route("/ok", axum::routing::get(|| async { "ok" }))
            .route(
                "/echo",
                axum::routing::post(|b: axum::body::Bytes| async move { b }),
            )
            .route(
                "/slow",
                axum::routing::get(|| async {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    "late"
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
        (addr, stats)
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

    /// Past the connection cap one more connection is closed at once (and counted);
    /// once the others go, the server answers again.
    #[tokio::test]
    async fn connections_beyond_the_cap_are_refused() {
        let limits = Limits {
            max_connections: 4,
            ..Limits::default()
        };
        let (addr, stats) = start(limits).await;
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut extra = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut extra, Duration::from_secs(2)).await);
        assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(get(addr, "/ok").await.ends_with("ok"));
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
        let mut beyond = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut beyond, Duration::from_secs(2)).await);
        assert!(stats.refused.load(Ordering::Relaxed) >= 1);
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
