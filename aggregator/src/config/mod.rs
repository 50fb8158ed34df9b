//! Flags (each also read from `FAULTLINE_<FLAG>`), in groups (agents, publishing,
//! shards, remediation, intake), checked into one [`Config`] in one place. Durations and
//! choices are parsed by clap (`ValueEnum`, [`positive_duration`]), so a bad flag fails
//! at start with a clear message.

mod args;
mod checked;
#[cfg(test)]
mod tests;

pub use args::*;
pub use checked::*;
