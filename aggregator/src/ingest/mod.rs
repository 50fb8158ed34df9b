//! What comes in: agents' documents (followed by long-poll, found by Node discovery),
//! alerts (`POST /v1/alerts`) and the kubelet's word on devices (KEP-4680).

pub mod collect;
pub mod deliver;
pub mod discover;
pub mod endpoints;
pub mod http;
pub mod intake;
pub mod podhealth;
pub mod stream;

pub use collect::{AgentEvent, FetchError};
pub use intake::{AlertOutcome, Intake, IntakeConfig, IntakeError, IntakeSummary, Route};
