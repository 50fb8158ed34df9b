//! Wall-clock helpers shared by the agent and the aggregator: milliseconds since the
//! epoch and RFC 3339 text, in one place so every document and record uses one format;
//! and [`parse_duration`], the one spelling of a duration in flags and thresholds.
//!
//! Everything that judges time in the domain (windows, the state machine) takes `now`
//! as an argument; these are for the edges that stamp or read a time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// RFC 3339 UTC with milliseconds, e.g. `2026-11-30T12:00:00.123Z`.
pub fn rfc3339_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Now, as [`rfc3339_ms`] writes it.
pub fn now_rfc3339() -> String {
    rfc3339_ms(now_ms())
}

/// `d` from now, as [`rfc3339_ms`] writes it (capped at 100 years).
pub fn rfc3339_after(d: Duration) -> String {
    let d = d.min(Duration::from_secs(100 * 365 * 86_400));
    rfc3339_ms(now_ms().saturating_add(d.as_millis() as u64))
}

/// Milliseconds since the epoch of an RFC 3339 time (`date-time` of RFC 3339 §5.6:
/// `T` or `t`, any fraction of a second, `Z`, `z` or `+HH:MM`/`-HH:MM`), or `None` when
/// it is not exactly that (no zone, spaces around it, a signed or one-digit field, a leap
/// second) or is before the epoch. chrono is the oracle of its property tests (`tests/rfc3339.rs`).
pub fn parse_rfc3339_ms(at: &str) -> Option<u64> {
    let b = at.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    let shape = b.len() >= 20
        && digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && matches!(b[10], b'T' | b't')
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19);
    // No leap second: Go's time.Parse (go/src/time/format.go, "second out of range"),
    // which writes every time the API server hands us, refuses :60; humantime would
    // read it as :59 and chrono as the next minute's :00.
    if !shape || &b[17..19] > b"59".as_slice() {
        return None;
    }
    let mut end = 19;
    if b[end] == b'.' {
        let n = b[end + 1..]
            .iter()
            .take_while(|d| d.is_ascii_digit())
            .count();
        if n == 0 {
            return None;
        }
        end += 1 + n;
    }
    let offset_ms: i64 = match &b[end..] {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2]
            if [h1, h2, m1, m2].iter().all(|d| d.is_ascii_digit()) =>
        {
            let num = |x: &u8, y: &u8| i64::from((x - b'0') * 10 + (y - b'0'));
            let (h, m) = (num(h1, h2), num(m1, m2));
            if h > 23 || m > 59 {
                return None;
            }
            let sign = if *sign == b'+' { 1 } else { -1 };
            sign * (h * 3600 + m * 60) * 1000
        }
        _ => return None,
    };
    // The calendar (month lengths, leap years) is humantime's, on the local part in
    // the one spelling it reads.
    let mut local = at[..end].to_string();
    local.replace_range(10..11, "T");
    let t = humantime::parse_rfc3339_weak(&local).ok()?;
    let ms = i64::try_from(t.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()?;
    u64::try_from(ms - offset_ms).ok()
}

/// Seconds from `at` (RFC 3339) to `now_ms` (negative when `at` is later).
pub fn age_secs_at(at: &str, now_ms: u64) -> Option<f64> {
    let t = parse_rfc3339_ms(at)?;
    Some((now_ms as f64 - t as f64) / 1000.0)
}

/// Seconds from `at` (RFC 3339) to now (negative when `at` is in the future).
pub fn age_secs(at: &str) -> Option<f64> {
    age_secs_at(at, now_ms())
}

/// Parse `500ms`, `30s`, `10m`, `1h`, `2d` or plain seconds; `None` for anything else,
/// or a duration too long to hold in milliseconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit {
        "ms" => n,
        "" | "s" => n.checked_mul(1_000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The clock a component judges time by: the system's, moved forward by hand in tests
/// (tests move time instead of sleeping). Clones share one offset.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    offset_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// A clock that moves only by hand: (its time at the start, ms since the epoch; an
    /// instant to count its `Instant`s from). `None`: the system's time.
    manual: Option<(u64, std::time::Instant)>,
}

impl Clock {
    /// A clock that stands at `epoch_ms` until moved by [`Clock::advance`]: the
    /// randomized schedules' virtual time, which the same seed replays
    /// exactly, whatever the machine's pace.
    pub fn manual(epoch_ms: u64) -> Clock {
        Clock {
            offset_ms: std::sync::Arc::default(),
            manual: Some((epoch_ms, std::time::Instant::now())),
        }
    }

    fn offset(&self) -> u64 {
        self.offset_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Milliseconds since the epoch, on this clock.
    pub fn now_ms(&self) -> u64 {
        match self.manual {
            Some((at, _)) => at + self.offset(),
            None => now_ms() + self.offset(),
        }
    }

    /// A monotonic now on this clock, for windows kept as `Instant`s.
    pub fn instant(&self) -> std::time::Instant {
        let base = match self.manual {
            Some((_, anchor)) => anchor,
            None => std::time::Instant::now(),
        };
        base + Duration::from_millis(self.offset())
    }

    /// Now as RFC 3339, on this clock.
    pub fn rfc3339(&self) -> String {
        rfc3339_ms(self.now_ms())
    }

    /// `d` from now as RFC 3339, on this clock.
    pub fn rfc3339_after(&self, d: Duration) -> String {
        let d = d.min(Duration::from_secs(100 * 365 * 86_400));
        rfc3339_ms(self.now_ms().saturating_add(d.as_millis() as u64))
    }

    /// Seconds since `at` (RFC 3339), on this clock.
    pub fn age_secs(&self, at: &str) -> Option<f64> {
        age_secs_at(at, self.now_ms())
    }

    /// Move this clock (and its clones) forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.offset_ms
            .fetch_add(d.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_by_hand() {
        let c = Clock::manual(1_700_000_000_000);
        let (t0, i0) = (c.now_ms(), c.instant());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!((c.now_ms(), c.instant()), (t0, i0));
        c.clone().advance(Duration::from_millis(1_500));
        assert_eq!(c.now_ms(), 1_700_000_001_500);
        assert_eq!(c.instant() - i0, Duration::from_millis(1_500));
        assert_eq!(c.rfc3339(), "2023-11-14T22:13:21.500Z");
        // The system's clock runs on by itself.
        let s = Clock::default();
        let t = s.now_ms();
        std::thread::sleep(Duration::from_millis(5));
        assert!(s.now_ms() > t);
    }

    #[test]
    fn formats_and_parses_back() {
        assert_eq!(rfc3339_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(
            parse_rfc3339_ms("2023-11-14T22:13:20.123Z"),
            Some(1_700_000_000_123)
        );
        // Records written before this module used nanosecond precision.
        assert_eq!(
            parse_rfc3339_ms("2023-11-14T22:13:20.123456789Z"),
            Some(1_700_000_000_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2023-11-14T22:13:20Z"),
            Some(1_700_000_000_000)
        );
        assert_eq!(parse_rfc3339_ms("yesterday"), None);
        // Offsets, as a person or another tool may write them.
        assert_eq!(
            parse_rfc3339_ms("2023-11-15T06:13:20.123+08:00"),
            Some(1_700_000_000_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2023-11-14T21:13:20-01:00"),
            Some(1_700_000_000_000)
        );
        assert_eq!(parse_rfc3339_ms("2023-11-14T22:13:20+25:00"), None);
        assert_eq!(
            age_secs_at("2023-11-14T22:13:20Z", 1_700_000_002_500),
            Some(2.5)
        );
        assert!(age_secs(&rfc3339_after(Duration::from_secs(60))).unwrap() < -50.0);
    }

    #[test]
    fn durations_parse_in_every_unit() {
        for (text, want) in [
            ("250ms", Some(Duration::from_millis(250))),
            ("7", Some(Duration::from_secs(7))),
            ("30s", Some(Duration::from_secs(30))),
            (" 10m ", Some(Duration::from_secs(600))),
            ("1h", Some(Duration::from_secs(3600))),
            ("2d", Some(Duration::from_secs(172_800))),
            ("0s", Some(Duration::ZERO)),
            ("", None),
            ("1.5s", None),
            ("-1s", None),
            ("10y", None),
            ("1 h", None),
            ("99999999999999999999", None),
            ("213503982334602d", None),
        ] {
            assert_eq!(parse_duration(text), want, "{text:?}");
        }
    }
}
