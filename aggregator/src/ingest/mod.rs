//! What comes in besides the agents' documents (`agents`): which agents to follow (Node
//! discovery in `discover`, the agents' EndpointSlices in `endpoints`), alerts
//! (`POST /v1/alerts`, `intake`) and the kubelet's word on devices (KEP-4680,
//! `podhealth`); `watched` is the one watch loop discovery runs on.

pub mod discover;
pub mod endpoints;
pub mod intake;
pub mod podhealth;
pub mod watched;

pub use intake::{AlertOutcome, Intake, IntakeConfig, IntakeError, IntakeSummary, Route};
