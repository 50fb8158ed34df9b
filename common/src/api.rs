//! The wire shape shared by faultline's HTTP APIs: the JSON body of every error answer,
//! so the agent, the aggregator and their clients read one definition.

use serde::{Deserialize, Serialize};

/// The body of every error answer of faultline's HTTP APIs: `{"error": "...", "status": 404}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a person.
    pub error: String,
    /// The HTTP status code of the answer, repeated in the body.
    pub status: u16,
}

impl ErrorBody {
    /// An error body for an answer with HTTP status `status`.
    pub fn new(status: u16, error: impl Into<String>) -> Self {
        ErrorBody {
            error: error.into(),
            status,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_error_then_status() {
        let b = ErrorBody::new(404, "no such endpoint");
        let text = serde_json::to_string(&b).unwrap();
        assert_eq!(text, r#"{"error":"no such endpoint","status":404}"#);
        assert_eq!(serde_json::from_str::<ErrorBody>(&text).unwrap(), b);
    }
}
