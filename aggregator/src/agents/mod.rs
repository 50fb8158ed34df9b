//! Everything that talks to the agents, both ways: the HTTP client with its kept
//! connections (`http`), the NDJSON stream decoder (`stream`), following each agent and
//! the one gate every agent document passes (`collect`, `admit_raw`), and the delivery
//! of each node's entry to its agent (`deliver`).

pub mod collect;
pub mod deliver;
pub mod http;
pub mod stream;
mod wire;

pub use collect::{AgentEvent, FetchError};
