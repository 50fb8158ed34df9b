//! The client side's rate of Kubernetes API calls (`--kube-qps`, `--kube-burst`), as
//! client-go's QPS and burst: a token bucket shared by every client of this replica
//! (calls and watches), holding `burst` tokens and refilled at `qps` a second. A call
//! waits for its token before it is sent; a watch takes one when it opens. The server's
//! API Priority and Fairness still decides what it serves: this keeps a replica's own
//! bursts (a relist, a wave of quarantines) inside what the operator granted it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

/// Tokens: at most `burst`, refilled at `qps` a second.
#[derive(Debug)]
pub struct Bucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Full: a burst may go at once.
    pub fn new(qps: f64, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Bucket {
            qps,
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// Take a token at `now`, or say how long until one is there.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * self.qps;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        Err(Duration::from_secs_f64((1.0 - self.tokens) / self.qps))
    }
}

/// The layer every client of a replica is built with: one bucket for all.
#[derive(Debug, Clone)]
pub struct KubeRate {
    bucket: Arc<Mutex<Bucket>>,
}

impl KubeRate {
    pub fn new(qps: f64, burst: u32) -> Self {
        KubeRate {
            bucket: Arc::new(Mutex::new(Bucket::new(qps, burst, Instant::now()))),
        }
    }
}

impl<S> tower::Layer<S> for KubeRate {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            bucket: self.bucket.clone(),
            wait: None,
            token: false,
        }
    }
}

/// A service whose calls each wait for a token. The client's buffer calls it from one
/// task: `poll_ready` takes the token (sleeping until there is one), `call` spends it.
pub struct Limited<S> {
    inner: S,
    bucket: Arc<Mutex<Bucket>>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    token: bool,
}

impl<S, R> tower::Service<R> for Limited<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        while !self.token {
            if let Some(wait) = self.wait.as_mut() {
                if wait.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.wait = None;
            }
            let took = self
                .bucket
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(Instant::now());
            match took {
                Ok(()) => self.token = true,
                Err(after) => self.wait = Some(Box::pin(tokio::time::sleep(after))),
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        self.token = false;
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_goes_at_once_then_tokens_come_at_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(2.0, 3, t0);
        for _ in 0..3 {
            assert_eq!(b.take(t0), Ok(()));
        }
        assert_eq!(b.take(t0), Err(Duration::from_millis(500)));
        assert_eq!(
            b.take(t0 + Duration::from_millis(250)),
            Err(Duration::from_millis(250))
        );
        assert_eq!(b.take(t0 + Duration::from_millis(500)), Ok(()));
        // Idle for long: never more than the burst.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(b.take(later), Ok(()));
        }
        assert!(b.take(later).is_err());
    }

    #[test]
    fn a_burst_of_zero_is_one() {
        let t0 = Instant::now();
        let mut b = Bucket::new(1.0, 0, t0);
        assert_eq!(b.take(t0), Ok(()));
        assert_eq!(b.take(t0), Err(Duration::from_secs(1)));
    }
}
