//! RoCE network health (`dcmi_get_device_network_health`) on a thread per call, bounded
//! by [`NETWORK_HEALTH_BOUND`] for all the chips of a sample together.

use std::ffi::c_uint;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ffi::NOT_SUPPORTED;
use super::map::{Answer, DcmiError, RawNet};

/// Huawei's bound on `dcmi_get_device_network_health` (`DcmiApiTimeout`).
pub(super) const NETWORK_HEALTH_BOUND: Duration = Duration::from_secs(1);

/// A chip's network-health probe: at most one call in flight, however long it blocks.
#[derive(Default)]
pub(super) struct NetProbe {
    busy: AtomicBool,
    /// The chip answered "not supported": not asked again.
    unsupported: AtomicBool,
}

/// An answer of `dcmi_get_device_network_health`, on its way.
pub(super) type NetAnswer = std::sync::mpsc::Receiver<Answer<c_uint>>;

/// Start a chip's RoCE network-health call on its own thread: the call can block for
/// a long time after a card drop (`dcmi.go` `DcGetDeviceNetWorkHealth`). A call still
/// blocked from an earlier sample is not joined by another; a chip that answered "not
/// supported" (inference cards, 950) is not asked again. `Ok(None)`: nothing to wait for.
/// `call` makes the call itself (the library stays the caller's business).
pub(super) fn start_network_health(
    call: impl FnOnce() -> Answer<c_uint> + Send + 'static,
    probe: &Arc<NetProbe>,
) -> Result<Option<NetAnswer>, DcmiError> {
    if probe.unsupported.load(Ordering::Acquire) {
        return Ok(None);
    }
    if probe.busy.swap(true, Ordering::AcqRel) {
        return Err(DcmiError::NetBusy);
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let p2 = probe.clone();
    let spawned = std::thread::Builder::new()
        .name("dcmi-net-health".into())
        .spawn(move || {
            let r = call();
            if matches!(r, Ok((NOT_SUPPORTED, _)) | Err(_)) {
                p2.unsupported.store(true, Ordering::Release);
            }
            p2.busy.store(false, Ordering::Release);
            let _ = tx.send(r);
        });
    match spawned {
        Ok(_) => Ok(Some(rx)),
        Err(e) => {
            probe.busy.store(false, Ordering::Release);
            Err(DcmiError::NetThread(e.to_string()))
        }
    }
}

/// The answer of a call started with [`start_network_health`], waiting at most until
/// `deadline` (the same one for every chip of the sample: [`NETWORK_HEALTH_BOUND`] after
/// the calls started, however many block). What it means is `map`'s to say.
pub(super) fn finish_network_health(rx: NetAnswer, deadline: Instant) -> RawNet {
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(answer) => RawNet::Answered(answer),
        Err(_) => RawNet::TimedOut(NETWORK_HEALTH_BOUND),
    }
}
