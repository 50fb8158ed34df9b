//! Alert intake: `POST /v1/alerts` takes seed 000's GPUAlert JSON (one object or a
//! list) and the Alertmanager webhook format, behind a bearer token read from a file
//! (a mounted Secret, re-read on every request so a rotated Secret takes effect).
//!
//! One alert is a hint, not a verdict (seed 000, 9.1): a device is acted on only after
//! `threshold` firing alerts for the same (node, device, metric) within `window`, and
//! once acted on, the same key is a duplicate for the dedup window (default 15 min), so
//! a burst of repeats is one action. Answers are JSON; every answer is counted by code.

mod alert;
mod answer;
mod forward;
mod gate;

pub use forward::ForwardError;
pub use gate::*;
