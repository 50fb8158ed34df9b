//! The server's connections, as the limits see them: when bytes last moved, what is in
//! flight, and bodies bounded in time.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use hyper::body::Incoming;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The last time bytes moved on a connection, and its requests in flight.
#[derive(Debug)]
pub(super) struct Activity {
    pub(super) start: Instant,
    /// Milliseconds since `start` at the last read or write.
    pub(super) last_ms: AtomicU64,
    /// Requests being answered, their bodies included.
    pub(super) in_flight: AtomicUsize,
    /// Milliseconds since `start` when the last answer ended (0: none yet).
    pub(super) answered_ms: AtomicU64,
    /// A trusted request came on this connection.
    pub(super) trusted: std::sync::atomic::AtomicBool,
    /// Told to close: its slot was given to a newcomer.
    pub(super) leave: tokio::sync::Notify,
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            answered_ms: AtomicU64::new(0),
            trusted: std::sync::atomic::AtomicBool::new(false),
            leave: tokio::sync::Notify::new(),
        }
    }

    /// How long the connection has waited for a request head: since its last answer
    /// ended, or since it opened (none while a request is in flight).
    pub(super) fn waiting_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.answered_ms.load(Ordering::Relaxed));
        Some(self.start.elapsed().saturating_sub(since))
    }

    pub(super) fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    pub(super) fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// A TCP stream that records activity.
pub(super) struct Tracked {
    pub(super) inner: TcpStream,
    pub(super) activity: Arc<Activity>,
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
pub(super) struct InFlight(Arc<Activity>);

impl InFlight {
    pub(super) fn new(a: &Arc<Activity>) -> Self {
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
pub(super) struct Answering {
    pub(super) inner: Body,
    pub(super) _busy: InFlight,
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

/// A request body that fails once its deadline passes before it is whole.
pub(super) struct TimedBody {
    pub(super) inner: Incoming,
    pub(super) deadline: Pin<Box<tokio::time::Sleep>>,
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
