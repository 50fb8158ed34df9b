//! The two RFC 3339 parsers (`faultline_common::time`, which reads
//! agents' documents, Alertmanager's alerts and records, and the consumer kit's, which
//! a workload links) against chrono as the oracle. Every time either accepts, chrono
//! accepts and means the same instant; every time RFC 3339 writes (any offset, any
//! fraction, `T`/`Z` in either case), both read as chrono does.

use chrono::{DateTime, Datelike, FixedOffset, Timelike};
use proptest::prelude::*;

/// The latest instant the 4-digit year of RFC 3339 can write (9999-12-31T23:59:59.999Z).
const MAX_MS: i64 = 253_402_300_799_999;

/// What chrono reads `s` as: milliseconds since the epoch, when at or after it.
fn oracle(s: &str) -> Option<u64> {
    let t = DateTime::parse_from_rfc3339(s).ok()?;
    u64::try_from(t.timestamp_millis()).ok()
}

fn both(s: &str) -> [Option<u64>; 2] {
    [
        faultline_common::time::parse_rfc3339_ms(s),
        faultline_consumer::parse_rfc3339_ms(s),
    ]
}

/// `ms` as RFC 3339 at offset `off_min`, with `frac` digits of fraction (0-9), `T` or
/// `t`, `Z` or `z` (at offset 0 when `zulu`).
fn write(ms: i64, off_min: i32, frac: usize, lower: bool, zulu: bool) -> String {
    let off = FixedOffset::east_opt(off_min * 60).unwrap();
    let t = DateTime::from_timestamp_millis(ms)
        .unwrap()
        .with_timezone(&off);
    let nanos = format!("{:09}", t.nanosecond());
    let fraction = if frac == 0 {
        String::new()
    } else {
        format!(".{}", &nanos[..frac])
    };
    let zone = if zulu && off_min == 0 {
        (if lower { "z" } else { "Z" }).to_string()
    } else {
        let a = off_min.unsigned_abs();
        format!(
            "{}{:02}:{:02}",
            if off_min < 0 { '-' } else { '+' },
            a / 60,
            a % 60
        )
    };
    format!(
        "{:04}-{:02}-{:02}{}{:02}:{:02}:{:02}{fraction}{zone}",
        t.year(),
        t.month(),
        t.day(),
        if lower { 't' } else { 'T' },
        t.hour(),
        t.minute(),
        t.second()
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// Whatever RFC 3339 writes for an instant since the epoch, both read as chrono
    /// does: the instant, to the millisecond the fraction carries.
    #[test]
    fn every_written_instant_reads_as_chrono_reads_it(
        ms in 0..=MAX_MS,
        off_min in -1439i32..=1439,
        frac in 0usize..=9,
        lower: bool,
        zulu: bool,
    ) {
        let s = write(ms, if zulu { 0 } else { off_min }, frac, lower, zulu);
        let want = oracle(&s);
        prop_assert!(want.is_some(), "chrono reads {s}");
        prop_assert_eq!(both(&s), [want, want], "{}", s);
    }

    /// What faultline writes (`rfc3339_ms`) reads back to the millisecond, and chrono
    /// reads it the same.
    #[test]
    fn what_faultline_writes_reads_back(ms in 0u64..=MAX_MS as u64) {
        let s = faultline_common::time::rfc3339_ms(ms);
        prop_assert_eq!(both(&s), [Some(ms), Some(ms)], "{}", s);
        prop_assert_eq!(oracle(&s), Some(ms), "{}", s);
    }

    /// Anything near a valid time (a byte changed, dropped or doubled): where either
    /// parser accepts, chrono accepts and means the same instant.
    #[test]
    fn nothing_is_accepted_that_rfc3339_refuses(
        ms in 0..=MAX_MS,
        off_min in -1439i32..=1439,
        frac in 0usize..=9,
        at in any::<prop::sample::Index>(),
        byte in prop::sample::select(b"0123456789:-+.TtZz \x00\xff9".to_vec()),
        how in 0u8..3,
    ) {
        let s = write(ms, off_min, frac, false, false).into_bytes();
        let i = at.index(s.len());
        let mut m = s.clone();
        match how {
            0 => m[i] = byte,
            1 => { m.remove(i); }
            _ => m.insert(i, byte),
        }
        let Ok(m) = String::from_utf8(m) else { return Ok(()) };
        let want = oracle(&m);
        for got in both(&m) {
            if got.is_some() {
                prop_assert_eq!(got, want, "{}", m);
            }
        }
    }

    /// Any short text at all: no panic, and no acceptance chrono refuses.
    #[test]
    fn any_text_is_read_as_chrono_reads_it_or_refused(s in "[0-9:TtZz+. -]{0,40}") {
        let want = oracle(&s);
        for got in both(&s) {
            if got.is_some() {
                prop_assert_eq!(got, want, "{}", s);
            }
        }
    }
}

/// What the properties found, pinned.
#[test]
fn known_edges() {
    // No zone is not RFC 3339 (humantime's "weak" parser would take it as UTC).
    assert_eq!(both("2026-12-01T00:00:00"), [None, None]);
    assert_eq!(both("2026-12-01 00:00:00"), [None, None]);
    // Found by the properties in faultline_common's old parser (humantime's weak one
    // behind a trim): a signed offset field, a leading space, and a lowercase `t` it
    // refused.
    assert_eq!(both("1970-01-01T00:00:00+-0:00"), [None, None]);
    assert_eq!(both(" 1970-01-01T00:00:00Z"), [None, None]);
    assert_eq!(both("1970-01-01t00:00:00+00:00"), [Some(0), Some(0)]);
    // A leap second: Go's time.Parse refuses :60 and so do we. Found by
    // nothing_is_accepted_that_rfc3339_refuses on a CI run: humantime read :60 as :59,
    // chrono as the next minute.
    assert_eq!(both("2296-07-25T09:26:60.00000000+00:00"), [None, None]);
    assert_eq!(both("2026-12-31T23:59:60Z"), [None, None]);
    assert_eq!(
        both("2026-12-31T23:59:59.999Z"),
        [Some(1_798_761_599_999), Some(1_798_761_599_999)]
    );
    // Before the epoch: refused (a u64 of milliseconds).
    assert_eq!(both("1969-12-31T23:59:59Z"), [None, None]);
    assert_eq!(
        both("1970-01-01T00:00:00+00:01"),
        [None, None],
        "one minute before the epoch"
    );
}
