//! What the intake answers and how it decides: each alert's outcome, the summary a
//! request gets, its errors with their HTTP codes, and the intake's settings.

use std::path::PathBuf;
use std::time::Duration;

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::alert::Alert;
use crate::metrics::IntakeResult;

/// What became of one alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlertOutcome {
    /// Counted toward its key's threshold.
    Counted,
    /// Reached the threshold: the device is judged failed.
    Acted,
    /// A copy of an occurrence already counted, or a key acted on within the dedup
    /// window.
    Duplicate,
    /// A resolved alert: nothing to do.
    Resolved,
    /// Names no device (or no node): nothing is acted on a guess.
    Unattributed,
}

impl AlertOutcome {
    /// The metric label (and the answer's field).
    pub fn as_str(self) -> &'static str {
        match self {
            AlertOutcome::Counted => "counted",
            AlertOutcome::Acted => "acted",
            AlertOutcome::Duplicate => "duplicates",
            AlertOutcome::Resolved => "resolved",
            AlertOutcome::Unattributed => "unattributed",
        }
    }

    /// The metric label.
    pub fn label(self) -> IntakeResult {
        match self {
            AlertOutcome::Counted => IntakeResult::Counted,
            AlertOutcome::Acted => IntakeResult::Acted,
            AlertOutcome::Duplicate => IntakeResult::Duplicates,
            AlertOutcome::Resolved => IntakeResult::Resolved,
            AlertOutcome::Unattributed => IntakeResult::Unattributed,
        }
    }
}

/// An alert that reached its threshold, as the answer lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActedAlert {
    /// The node.
    pub node: String,
    /// The UUID or bus id the alert named.
    pub device: Option<String>,
    /// The alert's metric.
    pub metric: String,
}

/// The answer to an accepted request (202): what became of its alerts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntakeSummary {
    /// Alerts in the body.
    #[serde(default)]
    pub received: u64,
    /// Counted toward a threshold.
    #[serde(default)]
    pub counted: u64,
    /// Alerts that reached their threshold.
    #[serde(default)]
    pub acted: Vec<ActedAlert>,
    /// Copies and repeats within the dedup window.
    #[serde(default)]
    pub duplicates: u64,
    /// Resolved alerts.
    #[serde(default)]
    pub resolved: u64,
    /// Alerts naming no device.
    #[serde(default)]
    pub unattributed: u64,
    /// Handed to the replica that holds their node's shard.
    #[serde(default)]
    pub forwarded: u64,
}

impl IntakeSummary {
    pub(super) fn count(&mut self, o: AlertOutcome, a: &Alert) {
        match o {
            AlertOutcome::Counted => self.counted += 1,
            AlertOutcome::Acted => self.acted.push(ActedAlert {
                node: a.node.clone(),
                device: a.uuid.clone().or(a.bus_id.clone()),
                metric: a.metric.clone(),
            }),
            AlertOutcome::Duplicate => self.duplicates += 1,
            AlertOutcome::Resolved => self.resolved += 1,
            AlertOutcome::Unattributed => self.unattributed += 1,
        }
    }

    /// Add what a holder answered for the alerts handed to it.
    pub(super) fn merge_forwarded(&mut self, handed: usize, answer: IntakeSummary) {
        self.forwarded += handed as u64;
        self.counted += answer.counted;
        self.duplicates += answer.duplicates;
        self.resolved += answer.resolved;
        self.unattributed += answer.unattributed;
        self.acted.extend(answer.acted);
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntakeError {
    /// No token, or the wrong one (401).
    #[error("{0}")]
    Unauthorized(&'static str),
    /// Not an alert body (400).
    #[error("{0}")]
    BadRequest(String),
    /// Over the body limit (413).
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
    /// Cannot take it now (503), with the seconds to wait when known.
    #[error("{0}")]
    Unavailable(String, Option<u64>),
}

impl IntakeError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            IntakeError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            IntakeError::BadRequest(_) => StatusCode::BAD_REQUEST,
            IntakeError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            IntakeError::Unavailable(..) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Seconds the sender should wait before retrying, when known.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            IntakeError::Unavailable(_, r) => *r,
            _ => None,
        }
    }
}

/// How the intake decides.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    /// The file holding the bearer token.
    pub token_file: PathBuf,
    /// Largest body accepted.
    pub max_bytes: usize,
    /// Firing alerts for a key within `window` before it acts.
    pub threshold: usize,
    /// The counting window.
    pub window: Duration,
    /// After acting, repeats of the key are duplicates this long.
    pub dedup: Duration,
}
