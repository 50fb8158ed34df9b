//! Runs each polled source on its own schedule. Every call runs on a thread of its own
//! and is bounded by the timeout; a call that does not return is abandoned (counted,
//! and its thread left to finish or hang), so neither the API nor later samples wait.
//! At most `max_abandoned` hung calls per source are allowed before the sampler stops
//! issuing new ones and reports the source as hung.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::sources::{ProbeError, Source, SourceSample};
use crate::store::Store;

/// How a sampler behaves.
#[derive(Debug, Clone, Copy)]
pub struct SamplerConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub retries: u32,
    pub max_abandoned: u32,
}

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const ABANDONED: u8 = 2;

/// One source's calls, with the count of those still hung.
pub struct Caller {
    source: Arc<dyn Source>,
    in_flight_abandoned: Arc<AtomicU32>,
    metrics: Arc<Metrics>,
}

impl Caller {
    /// Wrap a source.
    pub fn new(source: Arc<dyn Source>, metrics: Arc<Metrics>) -> Self {
        Caller {
            source,
            in_flight_abandoned: Arc::new(AtomicU32::new(0)),
            metrics,
        }
    }

    /// Hung calls still in flight.
    pub fn abandoned(&self) -> u32 {
        self.in_flight_abandoned.load(Ordering::Acquire)
    }

    /// One bounded call.
    pub async fn call(
        &self,
        timeout: Duration,
        max_abandoned: u32,
    ) -> Result<SourceSample, ProbeError> {
        let hung = self.abandoned();
        if hung >= max_abandoned {
            return Err(ProbeError::Hung(hung));
        }
        let (tx, rx) = oneshot::channel();
        let state = Arc::new(AtomicU8::new(RUNNING));
        let source = self.source.clone();
        let name = source.name();
        let (st, counter, metrics) = (
            state.clone(),
            self.in_flight_abandoned.clone(),
            self.metrics.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("probe-{name}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    source.sample(timeout)
                }))
                .unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    Err(ProbeError::Panic(msg))
                });
                if st
                    .compare_exchange(RUNNING, DONE, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    // The sampler gave up on us (and counted us first): no longer in flight.
                    counter.fetch_sub(1, Ordering::AcqRel);
                    metrics.abandoned(name, false, counter.load(Ordering::Acquire));
                    tracing::info!(source = name, "an abandoned call returned at last");
                }
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            return Err(ProbeError::Call(format!("cannot start probe thread: {e}")));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ProbeError::Panic("probe thread vanished".into())),
            Err(_) => {
                // Count first, then claim: the probe thread only uncounts a call it finds
                // claimed, so the counter never goes below zero.
                self.in_flight_abandoned.fetch_add(1, Ordering::AcqRel);
                let claimed = state
                    .compare_exchange(RUNNING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok();
                if !claimed {
                    // It finished just now; its result went with the receiver.
                    self.in_flight_abandoned.fetch_sub(1, Ordering::AcqRel);
                } else {
                    let n = self.abandoned();
                    self.metrics.abandoned(name, true, n);
                    tracing::warn!(
                        source = name,
                        in_flight = n,
                        ?timeout,
                        "call timed out; abandoned"
                    );
                }
                Err(ProbeError::Timeout(timeout))
            }
        }
    }
}

/// Sample `source` until `cancel` fires.
/// Samples woken by events within a second, at most (a storm of events is a sample
/// every 100 ms; a single event is sampled at once).
const WAKES_PER_SECOND: usize = 10;

pub async fn run(
    source: Arc<dyn Source>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    cfg: SamplerConfig,
    cancel: CancellationToken,
) {
    let name = source.name();
    let warm_up = source.needs_warm_up();
    // A source that kills its own child processes at the timeout gets a little longer
    // here, so its clean kill is not also counted as an abandoned call.
    let call_timeout = if source.enforces_timeout() {
        cfg.timeout + Duration::from_secs(1)
    } else {
        cfg.timeout
    };
    let wake = source.wake();
    let caller = Caller::new(source, metrics.clone());
    let mut discarded_first = !warm_up;
    let mut backoff = cfg.interval;
    let mut next = tokio::time::Instant::now();
    let mut last_log: Option<(Instant, String)> = None;
    let mut woken: std::collections::VecDeque<Instant> = Default::default();
    let mut backing_off = false;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
            // A fault event: sample now rather than at the end of the interval (not while
            // a source that cannot start backs off).
            _ = async {
                match &wake {
                    Some(n) => n.notified().await,
                    None => std::future::pending().await,
                }
            }, if !backing_off => {
                // A storm of events is at most WAKES_PER_SECOND samples a second.
                while woken.front().is_some_and(|t| t.elapsed() >= Duration::from_secs(1)) {
                    woken.pop_front();
                }
                if woken.len() >= WAKES_PER_SECOND {
                    if let Some(t) = woken.pop_front() {
                        tokio::time::sleep(Duration::from_secs(1).saturating_sub(t.elapsed())).await;
                    }
                }
                woken.push_back(Instant::now());
            }
        }
        let started = Instant::now();
        let mut result = Err(ProbeError::Call("not attempted".into()));
        for attempt in 0..=cfg.retries {
            result = caller.call(call_timeout, cfg.max_abandoned).await;
            match &result {
                Ok(_) => break,
                // Retrying cannot help a source that is not there or is hung.
                Err(ProbeError::Init(_) | ProbeError::Hung(_)) => break,
                Err(e) => {
                    metrics.count_error(name, e.kind());
                    // Say so at once: readers should not wait for the retries to learn
                    // that the source is failing.
                    store.record_failure(name, e, caller.abandoned());
                    if attempt < cfg.retries {
                        tracing::debug!(source = name, attempt, error = %e, "retrying");
                    }
                }
            }
        }
        let abandoned = caller.abandoned();
        match result {
            Ok(sample) => {
                metrics.observe_sample(name, started.elapsed().as_secs_f64());
                backoff = cfg.interval;
                if !discarded_first {
                    discarded_first = true;
                    store.mark_attempted(name);
                    tracing::info!(source = name, "discarded the first reading (warm-up)");
                } else {
                    store.apply_sample(name, sample);
                }
                store.set_abandoned(name, abandoned);
                last_log = None;
                backing_off = false;
                next = tokio::time::Instant::now() + cfg.interval;
            }
            Err(e) => {
                // Other errors were recorded attempt by attempt.
                if matches!(e, ProbeError::Init(_) | ProbeError::Hung(_)) {
                    metrics.count_error(name, e.kind());
                    store.record_failure(name, &e, abandoned);
                }
                // Log a failure once, then at most once a minute while it repeats.
                let msg = e.to_string();
                let quiet = matches!(&last_log, Some((t, m)) if *m == msg && t.elapsed() < Duration::from_secs(60));
                if !quiet {
                    tracing::warn!(source = name, error = %msg, "sample failed");
                    last_log = Some((Instant::now(), msg));
                }
                // A source that cannot start is retried with exponential backoff.
                backing_off = matches!(e, ProbeError::Init(_));
                let wait = if matches!(e, ProbeError::Init(_)) {
                    let w = backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                    w
                } else {
                    cfg.interval
                };
                next = tokio::time::Instant::now() + wait;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    struct Gate {
        hang: Arc<AtomicBool>,
    }
    impl Source for Gate {
        fn name(&self) -> &'static str {
            "gate"
        }
        fn sample(&self, _: Duration) -> Result<SourceSample, ProbeError> {
            while self.hang.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(SourceSample::default())
        }
    }

    #[tokio::test]
    async fn hung_calls_are_abandoned_bounded_and_released() {
        let hang = Arc::new(AtomicBool::new(true));
        let c = Caller::new(
            Arc::new(Gate { hang: hang.clone() }),
            Arc::new(Metrics::new()),
        );
        let t = Duration::from_millis(50);
        assert_eq!(c.call(t, 2).await.unwrap_err(), ProbeError::Timeout(t));
        assert_eq!(c.call(t, 2).await.unwrap_err(), ProbeError::Timeout(t));
        assert_eq!(c.abandoned(), 2);
        // The bound holds: no third thread is started.
        assert_eq!(c.call(t, 2).await.unwrap_err(), ProbeError::Hung(2));
        hang.store(false, Ordering::Release);
        for _ in 0..200 {
            if c.abandoned() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(c.abandoned(), 0);
        assert!(c.call(t, 2).await.is_ok());
    }

    struct Panics;
    impl Source for Panics {
        fn name(&self) -> &'static str {
            "panics"
        }
        fn sample(&self, _: Duration) -> Result<SourceSample, ProbeError> {
            panic!("driver exploded")
        }
    }

    #[tokio::test]
    async fn a_panicking_source_is_an_error_not_a_crash() {
        let c = Caller::new(Arc::new(Panics), Arc::new(Metrics::new()));
        let e = c.call(Duration::from_secs(5), 2).await.unwrap_err();
        assert_eq!(e, ProbeError::Panic("driver exploded".into()));
    }

    /// Answers one reading of `gpu0`, then fails every call.
    struct OnlyFirst {
        calls: std::sync::atomic::AtomicU32,
        warm_up: bool,
    }
    impl Source for OnlyFirst {
        fn name(&self) -> &'static str {
            "only-first"
        }
        fn sample(&self, _: Duration) -> Result<SourceSample, ProbeError> {
            if self.calls.fetch_add(1, Ordering::AcqRel) > 0 {
                return Err(ProbeError::Call("gone".into()));
            }
            let mut r = faultline_common::DeviceReading::new(
                "gpu0",
                faultline_common::Vendor::Ascend,
                "only-first",
            );
            r.temperature_c = Some(40.0);
            Ok(SourceSample {
                devices: vec![r],
                events: vec![],
            })
        }
        fn needs_warm_up(&self) -> bool {
            self.warm_up
        }
    }

    /// A vendor tool's first reading after start is discarded
    /// when the source says so (incomplete right after the driver loads), and kept
    /// otherwise.
    #[tokio::test]
    async fn the_first_reading_of_a_warming_source_is_discarded() {
        for (warm_up, devices) in [(true, 0), (false, 1)] {
            let metrics = Arc::new(Metrics::new());
            let store = Store::new(
                crate::store::StoreConfig {
                    node: "n".into(),
                    cache_ttl: Duration::from_secs(60),
                    thresholds: faultline_common::Thresholds::default(),
                    xid_policy: faultline_common::XidPolicy::default(),
                    deadband: Default::default(),
                },
                metrics.clone(),
            );
            let source = Arc::new(OnlyFirst {
                calls: Default::default(),
                warm_up,
            });
            let cancel = CancellationToken::new();
            let cfg = SamplerConfig {
                interval: Duration::from_millis(20),
                timeout: Duration::from_secs(1),
                retries: 0,
                max_abandoned: 2,
            };
            let task = tokio::spawn(run(
                source.clone(),
                store.clone(),
                metrics,
                cfg,
                cancel.clone(),
            ));
            while source.calls.load(Ordering::Acquire) < 3 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            cancel.cancel();
            let _ = task.await;
            assert_eq!(store.render().npus.len(), devices, "warm-up {warm_up}");
            assert!(store.ready(), "a discarded reading still counts as tried");
        }
    }
}
