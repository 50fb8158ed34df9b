//! `dcmi`: Huawei Ascend NPUs through `libdcmi.so`, loaded at run time with the C
//! signatures Huawei's own device plugin uses (Ascend/mind-cluster
//! `component/ascend-common/devmanager/dcmi/`; `tests/fixtures/dcmi/SIGNATURES.md` and
//! `MINDCLUSTER.md` give each prototype and its source).
//!
//! - **API version** (`devmanager_common.go` `DetectDcmiApiVersion`): `dcmi_init`, else
//!   `dcmiv2_init`. On Ascend 950 hosts (Atlas 350/850/950) `dcmi_init` answers -8255
//!   and only the `dcmiv2_*` family works; there a chip is one `dev_id`, its logic id,
//!   and `dcmiv2_get_device_list` takes the list first, the count second.
//! - **Ids**: a chip is `npu<physical id>` (as npu-exporter keys chips), learned once and
//!   kept, so a failed lookup never renames it; logic id, card and chip are fields.
//! - **Fault codes** are read on every sample whatever the health level, and graded by
//!   MindCluster's table (`faultline_common::ascend`). With a fault-event subscription
//!   (`dcmi_subscribe_fault_event`, every device), an event wakes the sampler at once
//!   and its code counts for a minute even if the next poll misses it; if subscribing
//!   fails, polling the codes every sample is the fallback (`fault_event_mode`).
//! - **Boot status** below 16 (`DCMI_SYSTEM_START_FINISH`): the chip is booting, unknown.
//! - **RoCE network health** has its own 1 s bound on its own thread (the call blocks
//!   after a card drop; Huawei bounds it the same way); 0 and 6 are up.
//! - **ECC** switched off (`enable_flag` 0) is no reading, not zero errors; an HBM error
//!   other than "not supported" is reported, not hidden by trying DDR.
//!
//! Units: temperature in C, power in 0.1 W. Health: 0 OK, 1 minor (Warning), 2 major
//! (Alarm), 3 critical. `-8012` (not ready) from the health call is how the plugin
//! recognises a card that dropped off: reported as lost. `-8255` means "not supported"
//! and leaves the metric out.
//!
//! This file only calls the library and gathers a chip's answers as they came
//! ([`map::RawChip`]); `map.rs` judges them, without the library, so every case is a
//! unit test there.

mod ffi;
mod library;
mod map;
mod net;
mod source;

pub use source::*;
