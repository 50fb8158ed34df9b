//! What the two binaries' flags share: one error type, and one copy of each parser that
//! both use (durations, comma-separated lists). A flag's own parser returns
//! [`FlagError`] (or its binary's error, which wraps it); clap prints it after the
//! flag's name.

use std::time::Duration;

use crate::names::NameError;
use crate::time::parse_duration;

/// Why a flag's value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// Not a duration at all.
    #[error("{0:?}: expected a duration such as 500ms, 15s, 5m, 24h")]
    NotADuration(String),
    /// Zero, where the duration is a period, a bound, a window or an age.
    #[error("{0:?}: must be more than zero")]
    ZeroDuration(String),
    /// Longer than the flag allows.
    #[error("{value:?}: at most {max}")]
    TooLong {
        /// What was given.
        value: String,
        /// The most the flag takes, as written (`7d`).
        max: &'static str,
    },
    /// Not a name the API server takes.
    #[error(transparent)]
    Name(#[from] NameError),
}

/// The items of a comma-separated list, trimmed, blanks skipped.
pub fn comma_list(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// A duration such as `500ms`, `15s`, `5m`, `24h`; zero is refused (every duration flag
/// of either binary is a period, a bound, a window or an age, where zero means nothing).
pub fn positive_duration(v: &str) -> Result<Duration, FlagError> {
    match parse_duration(v) {
        Some(d) if !d.is_zero() => Ok(d),
        Some(_) => Err(FlagError::ZeroDuration(v.into())),
        None => Err(FlagError::NotADuration(v.into())),
    }
}

/// A duration from `0` up to `max` (written `max_text` in the error).
pub fn duration_at_most(
    v: &str,
    max: Duration,
    max_text: &'static str,
) -> Result<Duration, FlagError> {
    match parse_duration(v) {
        Some(d) if d <= max => Ok(d),
        Some(_) => Err(FlagError::TooLong {
            value: v.into(),
            max: max_text,
        }),
        None => Err(FlagError::NotADuration(v.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_lists() {
        assert_eq!(positive_duration("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(
            positive_duration("0s"),
            Err(FlagError::ZeroDuration("0s".into()))
        );
        assert_eq!(
            positive_duration("soon").unwrap_err().to_string(),
            "\"soon\": expected a duration such as 500ms, 15s, 5m, 24h"
        );
        let week = Duration::from_secs(7 * 86_400);
        assert_eq!(duration_at_most("0", week, "7d"), Ok(Duration::ZERO));
        assert_eq!(
            duration_at_most("8d", week, "7d").unwrap_err().to_string(),
            "\"8d\": at most 7d"
        );
        assert_eq!(comma_list(" a, ,b,").collect::<Vec<_>>(), ["a", "b"]);
    }
}
