//! RoCE network health (`dcmi_get_device_network_health`) on a thread per call, bounded
//! by [`NETWORK_HEALTH_BOUND`] for all the chips of a sample together.

use std::ffi::{c_int, c_uint};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use faultline_common::ascend::roce_healthy;
use faultline_common::RoceLink;

use super::{Addr, Dcmi, NetProbe, NETWORK_HEALTH_BOUND, NOT_SUPPORTED};

/// An answer of `dcmi_get_device_network_health`, on its way.
pub(super) type NetAnswer = std::sync::mpsc::Receiver<Result<(c_int, c_uint), String>>;

/// Start a chip's RoCE network-health call on its own thread: the call can block for
/// a long time after a card drop (`dcmi.go` `DcGetDeviceNetWorkHealth`). A call still
/// blocked from an earlier sample is not joined by another; a chip that answered "not
/// supported" (inference cards, 950) is not asked again. `Ok(None)`: nothing to wait for.
pub(super) fn start_network_health(
    d: &Arc<Dcmi>,
    a: Addr,
    probe: &Arc<NetProbe>,
) -> Result<Option<NetAnswer>, String> {
    if probe.unsupported.load(Ordering::Acquire) {
        return Ok(None);
    }
    if probe.busy.swap(true, Ordering::AcqRel) {
        return Err("network health: an earlier call is still blocked".into());
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let (d2, p2) = (d.clone(), probe.clone());
    let spawned = std::thread::Builder::new()
        .name("dcmi-net-health".into())
        .spawn(move || {
            let r = d2.uint(
                a,
                b"dcmi_get_device_network_health\0",
                b"dcmiv2_get_device_network_health\0",
            );
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
            Err(format!("network health: cannot start a thread: {e}"))
        }
    }
}

/// The answer of a call started with [`start_network_health`], waiting at most until
/// `deadline` (the same one for every chip of the sample: [`NETWORK_HEALTH_BOUND`] after
/// the calls started, however many block).
pub(super) fn finish_network_health(
    rx: NetAnswer,
    deadline: Instant,
) -> Result<Option<RoceLink>, String> {
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(Ok((0, v))) => Ok(Some(RoceLink {
            result: v,
            up: roce_healthy(v),
        })),
        // Not a training card, or no such call in this library.
        Ok(Ok((NOT_SUPPORTED, _))) | Ok(Err(_)) => Ok(None),
        Ok(Ok((rc, _))) => Err(format!("network health: dcmi error {rc}")),
        Err(_) => Err(format!(
            "network health: no answer within {}s",
            NETWORK_HEALTH_BOUND.as_secs()
        )),
    }
}
