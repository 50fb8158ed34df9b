//! Lease timing, and the bound on each Lease call that keeps one hung call from
//! holding up a pass past the holds.

use std::time::Duration;

/// Lease timing.
#[derive(Debug, Clone, Copy)]
pub struct LeaseConfig {
    /// How long a lease lasts without renewal.
    pub duration: Duration,
    /// How often holders renew and others look.
    pub retry: Duration,
    /// Stop writing this long before the lease would run out.
    pub margin: Duration,
}

impl LeaseConfig {
    /// The aggregator's timing from its flags: a replica stops acting one retry and a
    /// second before its Lease runs out, so a renewal that is one retry late still
    /// lands while the hold stands, and no other replica's take can overlap it.
    pub fn from_flags(duration: Duration, retry: Duration) -> Self {
        LeaseConfig {
            duration,
            retry,
            margin: retry + Duration::from_secs(1),
        }
    }

    /// Until when a renewal (or take) whose request started at `started` lets this
    /// replica write, on its own clock: the Lease's duration less the margin, counted
    /// from before the server could have written it. Pure: the Lease loop and the model
    /// checker (`aggregator/tests/model.rs`) both ask this.
    pub fn hold_until(&self, started: tokio::time::Instant) -> tokio::time::Instant {
        started + self.duration.saturating_sub(self.margin)
    }

    /// The longest one Lease call may take before this loop gives up on it: half of what
    /// a hold lasts (`duration - margin`), whatever the client's own timeout. One call
    /// that hangs past the hold (`--kube-timeout` is 15 s by default, a hold 12 s) held
    /// up the whole pass, and every shard's hold ran out behind it; given up
    /// at half the hold, the next pass renews the others in time.
    pub fn call_deadline(&self) -> Duration {
        (self.duration.saturating_sub(self.margin) / 2).max(Duration::from_millis(100))
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            duration: Duration::from_secs(15),
            retry: Duration::from_secs(2),
            margin: Duration::from_secs(3),
        }
    }
}

/// `call`, given up after `deadline` as a client error (never a 409: a call that got no
/// answer neither keeps nor loses a shard; the hold runs out on this replica's clock).
pub(super) async fn bounded<T>(
    deadline: Duration,
    what: &str,
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, kube::Error> {
    match tokio::time::timeout(deadline, call).await {
        Ok(r) => r,
        Err(_) => Err(kube::Error::Service(
            format!("{what}: no answer within {deadline:?} (half a hold); given up").into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[test]
    fn a_hold_ends_the_margin_before_the_lease() {
        let t = Instant::now();
        let cfg = LeaseConfig::from_flags(Duration::from_secs(15), Duration::from_secs(2));
        assert_eq!(cfg.margin, Duration::from_secs(3));
        assert_eq!(cfg.hold_until(t), t + Duration::from_secs(12));
        assert_eq!(cfg.call_deadline(), Duration::from_secs(6));
        // A margin past the duration holds nothing, and a call still gets 100 ms.
        let tight = LeaseConfig {
            margin: Duration::from_secs(20),
            ..cfg
        };
        assert_eq!(tight.hold_until(t), t);
        assert_eq!(tight.call_deadline(), Duration::from_millis(100));
    }
}
