//! `npu-smi`: Huawei Ascend NPUs through the `npu-smi` CLI.
//!
//! Every sample runs `npu-smi info` (one process for all chips). Chips whose Health is
//! not OK are asked `-t health` for their error codes; ECC counters (`-t ecc`) are
//! refreshed every [`ECC_EVERY`] samples, since each call is a process start; `-t common`
//! fills in a temperature the table left out. Every call shares the sample's deadline.
//!
//! Chips are named by physical id (`npu<phy>`), as the `dcmi` source and npu-exporter
//! name them: from the table's `Phy-ID` column (Atlas A3), else from
//! `npu-smi info -t phyid-remap -p N` for each `/dev/davinciN` (the davinci node index is
//! the physical id; npu-smi refuses an N without its node), asked once and kept. Where
//! neither answers, the NPU id (`npuN`, `npuN-C` for several chips) as before.

pub mod parser;
mod source;

pub use source::*;
