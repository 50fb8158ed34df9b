//! Device sources. Each polled source implements [`Source`] and is driven by the
//! sampler; a source that streams (NVML's event set, the kernel log) pushes what it sees,
//! and, when it has no poll of its own, whether it is reading at all, through an
//! [`EventSink`] (the store in the running agent). [`ProbeError`] says why either failed.

mod contract;
pub mod dcmi;
pub mod exec;
pub mod kmsg;
pub mod npu_smi;
pub mod nvml;
pub mod process;
pub mod sim;

pub use contract::*;
