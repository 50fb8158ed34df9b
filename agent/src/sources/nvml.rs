//! `nvml`: NVIDIA devices through the real nvml-wrapper FFI.
//!
//! A probe that fails is a probe error (the device turns unknown once its last good
//! reading is older than the TTL); only `NVML_ERROR_GPU_IS_LOST` says the device is
//! broken, and then it is reported as lost, a hard fault. Unsupported metrics are left
//! out, not guessed. Xid critical events come from an NVML event set on a thread of its
//! own and go to the [`EventSink`] (the sampler reports the source's status); an error of that wait is counted and retried, never turned into a fault (unlike
//! NVIDIA's device plugin, which marks every device unhealthy on a wait error).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::sync::Locked;
use faultline_common::time::now_ms;
use faultline_common::xid::class_of;
use faultline_common::{
    normalize_bus_id, DeviceReading, EccCounts, NvLinkState, PcieLink, RecoveryAction,
    RemappedRows, RetiredPages, Throttle, Vendor, XidEvent,
};
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};
use tokio_util::sync::CancellationToken;

use super::{EventSink, ProbeError, Source, SourceSample};
use crate::metrics::Metrics;

/// NVLink links a device may have (NVML_NVLINK_MAX_LINKS).
const MAX_NVLINKS: u32 = 18;
/// How long one wait on the event set blocks (NVIDIA's device plugin uses 5 s).
const EVENT_WAIT_MS: u32 = 5_000;

#[derive(Clone, Default)]
struct Identity {
    uuid: Option<String>,
    bus: Option<String>,
    name: Option<String>,
}

/// The NVML source.
pub struct NvmlSource {
    lib_path: Option<PathBuf>,
    nvml: Mutex<Option<Arc<Nvml>>>,
    /// Identity of each index seen before, so a lost GPU is still named.
    known: Mutex<HashMap<u32, Identity>>,
    events: Option<EventStream>,
    /// Stops the event thread of the current handle: a new handle (after a driver
    /// reset) gets a new thread, never the old one's stale event set.
    events_running: Mutex<Option<CancellationToken>>,
}

/// Where the event thread delivers Xids and counts its errors.
#[derive(Clone)]
pub struct EventStream {
    /// Receives each Xid (only [`EventSink::event`] is used: the sampler reports
    /// the `nvml` source's status).
    pub sink: Arc<dyn EventSink>,
    /// Stops the thread.
    pub cancel: CancellationToken,
    /// Counts wait errors (`source_errors{source="nvml",kind="event-wait"}`).
    pub metrics: Arc<Metrics>,
}

fn init_error(e: NvmlError) -> ProbeError {
    match e {
        NvmlError::LibloadingError(_)
        | NvmlError::DriverNotLoaded
        | NvmlError::LibraryNotFound
        | NvmlError::FailedToLoadSymbol(_)
        | NvmlError::NoPermission => ProbeError::Init(format!("NVML: {e}")),
        other => ProbeError::Call(format!("NVML init: {other}")),
    }
}

impl NvmlSource {
    /// `lib_path`: the library to load (default: the loader finds libnvidia-ml.so.1).
    /// With `events`, a thread delivers Xid critical events to the sink.
    pub fn new(lib_path: Option<PathBuf>, events: Option<EventStream>) -> Self {
        NvmlSource {
            lib_path,
            nvml: Mutex::new(None),
            known: Mutex::new(HashMap::new()),
            events,
            events_running: Mutex::new(None),
        }
    }

    fn handle(&self) -> Result<Arc<Nvml>, ProbeError> {
        let mut g = self.nvml.locked();
        if let Some(n) = g.as_ref() {
            return Ok(n.clone());
        }
        let mut b = Nvml::builder();
        if let Some(p) = &self.lib_path {
            b.lib_path(OsStr::new(p.as_os_str()));
        }
        let nvml = Arc::new(b.init().map_err(init_error)?);
        if let Ok(v) = nvml.sys_driver_version() {
            tracing::info!(driver = %v, "NVML initialised");
        }
        *g = Some(nvml.clone());
        Ok(nvml)
    }

    fn start_events(&self, nvml: &Arc<Nvml>) {
        let Some(stream) = &self.events else {
            return;
        };
        let mut running = self.events_running.locked();
        if running.as_ref().is_some_and(|t| !t.is_cancelled()) {
            return;
        }
        let token = stream.cancel.child_token();
        let (nvml, stream) = (
            nvml.clone(),
            EventStream {
                cancel: token.clone(),
                ..stream.clone()
            },
        );
        let spawned = std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || event_loop(&nvml, &stream));
        if spawned.is_ok() {
            tracing::info!("NVML event thread started on the current handle");
            *running = Some(token);
        }
    }

    /// Drop the handle (the driver lost its state): the next sample starts NVML over,
    /// and its event thread with it.
    fn reset_handle(&self) {
        *self.nvml.locked() = None;
        if let Some(t) = self.events_running.locked().take() {
            t.cancel();
        }
    }

    fn read_device(&self, nvml: &Nvml, index: u32) -> DeviceReading {
        let mut r = DeviceReading::new(format!("gpu{index}"), Vendor::Nvidia, "nvml");
        r.index = Some(index);
        let known = self.known.locked().get(&index).cloned();
        if let Some(k) = &known {
            r.uuid = k.uuid.clone();
            r.pci_bus_id = k.bus.clone();
            r.name = k.name.clone();
        }
        let dev = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(NvmlError::GpuLost) => {
                r.lost = true;
                return r;
            }
            Err(e) => {
                r.probe_errors.push(format!("handle: {e}"));
                return r;
            }
        };
        // The UUID is read every time: if another board now sits at this index, the
        // cached bus id and name are not its own.
        match dev.uuid() {
            Ok(u) if r.uuid.as_deref() != Some(u.as_str()) => {
                r.uuid = Some(u);
                r.pci_bus_id = None;
                r.name = None;
            }
            Ok(_) => {}
            Err(NvmlError::GpuLost) => {
                r.lost = true;
                return r;
            }
            Err(e) => r.probe_errors.push(format!("uuid: {e}")),
        }
        if let Err(lost) = read_metrics(&dev, &mut r) {
            debug_assert!(lost);
            r.lost = true;
        }
        let identity = Identity {
            uuid: r.uuid.clone(),
            bus: r.pci_bus_id.clone(),
            name: r.name.clone(),
        };
        if !r.lost && identity.uuid.is_some() && known.is_none_or(|k| k.uuid != identity.uuid) {
            self.known.locked().insert(index, identity);
        }
        r
    }
}

/// `Ok(v)` -> `Some(v)`; unsupported -> `None`; another error is noted; `GpuLost`
/// stops the whole reading.
macro_rules! read {
    ($r:expr, $what:literal, $call:expr) => {
        match $call {
            Ok(v) => Some(v),
            Err(NvmlError::GpuLost) => return Err(true),
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => None,
            Err(e) => {
                $r.probe_errors.push(format!("{}: {}", $what, e));
                None
            }
        }
    };
}

fn read_metrics(dev: &Device<'_>, r: &mut DeviceReading) -> Result<(), bool> {
    if r.pci_bus_id.is_none() {
        r.pci_bus_id =
            read!(r, "pci_info", dev.pci_info()).and_then(|p| normalize_bus_id(&p.bus_id));
    }
    if r.name.is_none() {
        r.name = read!(r, "name", dev.name());
    }
    r.temperature_c =
        read!(r, "temperature", dev.temperature(TemperatureSensor::Gpu)).map(f64::from);
    r.power_w = read!(r, "power", dev.power_usage()).map(|mw| f64::from(mw) / 1000.0);

    // The four counters are one reading: if any of them cannot be read, none is
    // reported (a 0 standing in for an unread uncorrectable count would hide a fault).
    let ecc = (|| -> Result<Option<EccCounts>, NvmlError> {
        let read = |e, c| match dev.total_ecc_errors(e, c) {
            Ok(v) => Ok(Some(v)),
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => Ok(None),
            Err(x) => Err(x),
        };
        let vc = read(MemoryError::Corrected, EccCounter::Volatile)?;
        let vu = read(MemoryError::Uncorrected, EccCounter::Volatile)?;
        let ac = read(MemoryError::Corrected, EccCounter::Aggregate)?;
        let au = read(MemoryError::Uncorrected, EccCounter::Aggregate)?;
        Ok(match (vc, vu) {
            (Some(vc), Some(vu)) => Some(EccCounts {
                volatile_corrected: vc,
                volatile_uncorrected: vu,
                aggregate_corrected: ac.unwrap_or(0),
                aggregate_uncorrected: au.unwrap_or(0),
            }),
            _ => None,
        })
    })();
    r.ecc = match ecc {
        Ok(e) => e,
        Err(NvmlError::GpuLost) => return Err(true),
        Err(e) => {
            r.probe_errors.push(format!("ecc: {e}"));
            None
        }
    };

    if let Some(pending) = read!(r, "retired_pages", dev.are_pages_pending_retired()) {
        let sbe = read!(
            r,
            "retired_pages",
            dev.retired_pages(RetirementCause::MultipleSingleBitEccErrors)
        );
        let dbe = read!(
            r,
            "retired_pages",
            dev.retired_pages(RetirementCause::DoubleBitEccError)
        );
        r.retired_pages = Some(RetiredPages {
            single_bit: sbe.map(|v| v.len() as u64).unwrap_or(0),
            double_bit: dbe.map(|v| v.len() as u64).unwrap_or(0),
            pending,
        });
    }

    r.remapped_rows = read!(r, "remapped_rows", remapped_rows(dev));
    match read!(r, "recovery_action", recovery_action(dev)) {
        Some(Ok(a)) => r.recovery_action = Some(a),
        Some(Err(v)) => r
            .probe_errors
            .push(format!("recovery_action: value {v} unknown to this build")),
        None => {}
    }

    let reasons = match clock_event_reasons(dev) {
        Err(NvmlError::FailedToLoadSymbol(_)) | Err(NvmlError::NotSupported) => {
            read!(r, "throttle", dev.current_throttle_reasons()).map(|t| t.bits())
        }
        other => read!(r, "throttle", other),
    };
    r.throttle = reasons.map(|raw| {
        let t = ThrottleReasons::from_bits_retain(raw);
        Throttle {
            raw,
            hw_slowdown: t.contains(ThrottleReasons::HW_SLOWDOWN),
            hw_thermal: t.contains(ThrottleReasons::HW_THERMAL_SLOWDOWN),
            hw_power_brake: t.contains(ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN),
            sw_thermal: t.contains(ThrottleReasons::SW_THERMAL_SLOWDOWN),
        }
    });

    let gen = read!(r, "pcie", dev.current_pcie_link_gen());
    let width = read!(r, "pcie", dev.current_pcie_link_width());
    if gen.is_some() || width.is_some() {
        r.pcie = Some(PcieLink {
            // NVML answering about the link means the link is up; a down link shows up
            // as a lost GPU.
            up: true,
            gen,
            max_gen: read!(r, "pcie", dev.max_pcie_link_gen()),
            width,
            max_width: read!(r, "pcie", dev.max_pcie_link_width()),
        });
    }

    let mut nv = NvLinkState::default();
    for link in 0..MAX_NVLINKS {
        match dev.link_wrapper_for(link).is_active() {
            Ok(active) => {
                nv.total += 1;
                if active {
                    nv.active += 1;
                } else {
                    nv.down.push(link);
                }
            }
            Err(NvmlError::GpuLost) => return Err(true),
            // Past the last link, or no NVLink on this device.
            Err(NvmlError::InvalidArg)
            | Err(NvmlError::NotSupported)
            | Err(NvmlError::FailedToLoadSymbol(_)) => break,
            Err(e) => {
                r.probe_errors.push(format!("nvlink {link}: {e}"));
                break;
            }
        }
    }
    if nv.total > 0 {
        r.nvlink = Some(nv);
    }
    Ok(())
}

/// `nvmlDeviceGetRemappedRows`, which nvml-wrapper does not wrap.
fn remapped_rows(dev: &Device<'_>) -> Result<RemappedRows, NvmlError> {
    let lib = dev.nvml().lib();
    let f = lib
        .nvmlDeviceGetRemappedRows
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let (mut corr, mut unc, mut pending, mut failure) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: `f` is the library's nvmlDeviceGetRemappedRows, whose C signature the
    // bindings declare; the handle comes from a live `Device` borrowed for this call, and
    // the four out-pointers are valid, aligned `unsigned int`s on our stack.
    let rc = unsafe {
        f(
            dev.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failure,
        )
    };
    nvml_result(rc)?;
    Ok(RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failure: failure != 0,
    })
}

/// NVML field 230, `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`: the repair the driver says
/// the GPU needs, through `nvmlDeviceGetFieldValues`. A driver without the field answers
/// not supported for it (no reading); `Err(v)`: a value this build does not know.
fn recovery_action(dev: &Device<'_>) -> Result<Result<RecoveryAction, u64>, NvmlError> {
    let id = FieldId(nvml_wrapper_sys::bindings::field_id::NVML_FI_DEV_GET_GPU_RECOVERY_ACTION);
    let sample = dev
        .field_values_for(&[id])?
        .pop()
        .ok_or(NvmlError::Unknown)??;
    let v = match sample.value? {
        SampleValue::U32(v) => u64::from(v),
        SampleValue::U64(v) => v,
        SampleValue::I64(v) => u64::try_from(v).unwrap_or(u64::MAX),
        SampleValue::F64(v) => v as u64,
    };
    Ok(RecoveryAction::from_nvml(v).ok_or(v))
}

/// `nvmlDeviceGetCurrentClocksEventReasons` (the newer name of the throttle reasons).
fn clock_event_reasons(dev: &Device<'_>) -> Result<u64, NvmlError> {
    let lib = dev.nvml().lib();
    let f = lib
        .nvmlDeviceGetCurrentClocksEventReasons
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let mut reasons: u64 = 0;
    // SAFETY: as above: the bound symbol, a live handle, one valid out-pointer.
    let rc = unsafe { f(dev.handle(), &mut reasons) };
    nvml_result(rc)?;
    Ok(reasons)
}

fn nvml_result(rc: nvml_wrapper_sys::bindings::nvmlReturn_t) -> Result<(), NvmlError> {
    nvml_wrapper::error::nvml_try(rc)
}

fn event_loop(nvml: &Nvml, stream: &EventStream) {
    let mut backoff = Duration::from_secs(1);
    while !stream.cancel.is_cancelled() {
        match watch_events(nvml, stream.sink.as_ref(), &stream.cancel) {
            // Cancelled, or time to re-arm.
            Ok(()) => backoff = Duration::from_secs(1),
            Err(e) => {
                stream.metrics.count_error("nvml", "event-wait");
                // A wait error says nothing about the devices: log, back off, re-arm.
                tracing::warn!(error = %e, "NVML event wait failed; re-arming");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        }
    }
}

fn watch_events(
    nvml: &Nvml,
    sink: &dyn EventSink,
    cancel: &CancellationToken,
) -> Result<(), NvmlError> {
    let mut set = nvml.create_event_set()?;
    let mut buses: HashMap<u32, Option<String>> = HashMap::new();
    let mut registered: Vec<u32> = Vec::new();
    let mut skipped = 0;
    for i in 0..nvml.device_count()? {
        // A lost or broken GPU is skipped: it must not cost the others their events.
        let Ok(dev) = nvml.device_by_index(i) else {
            skipped += 1;
            continue;
        };
        let Ok(supported) = dev.supported_event_types() else {
            skipped += 1;
            continue;
        };
        let wanted = EventTypes::CRITICAL_XID_ERROR & supported;
        if wanted.is_empty() {
            continue;
        }
        match dev.register_events(wanted, set) {
            Ok(s) => {
                set = s;
                registered.push(i);
                buses.insert(
                    i,
                    dev.pci_info()
                        .ok()
                        .and_then(|p| normalize_bus_id(&p.bus_id)),
                );
            }
            Err(e) => {
                // nvml-wrapper frees the set on a failed registration: build it again
                // with the devices that did register.
                tracing::warn!(gpu = i, error = %e.error, "cannot register Xid events; skipping this GPU");
                skipped += 1;
                set = nvml.create_event_set()?;
                for &j in &registered {
                    let d = nvml.device_by_index(j)?;
                    set = d
                        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                        .map_err(|e| e.error)?;
                }
            }
        }
    }
    tracing::info!(gpus = registered.len(), skipped, "NVML Xid events armed");
    // With a GPU skipped, re-arm now and then in case it comes back.
    let rearm = (skipped > 0).then(|| std::time::Instant::now() + Duration::from_secs(60));
    while !cancel.is_cancelled() {
        match set.wait(EVENT_WAIT_MS) {
            Ok(ev) => {
                let xid = match ev.event_data {
                    Some(XidError::Value(x)) => x as u32,
                    _ => continue,
                };
                let idx = ev.device.index().ok();
                let bus = idx
                    .and_then(|i| buses.get(&i).cloned().flatten())
                    .or_else(|| {
                        ev.device
                            .pci_info()
                            .ok()
                            .and_then(|p| normalize_bus_id(&p.bus_id))
                    });
                sink.event(XidEvent {
                    xid,
                    class: class_of(xid),
                    pci_bus_id: bus,
                    at_ms: now_ms(),
                    source: "nvml-event".into(),
                    message: format!(
                        "NVML critical Xid event on GPU {}",
                        idx.map(|i| i.to_string()).unwrap_or_default()
                    ),
                });
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => return Err(e),
        }
        if rearm.is_some_and(|t| std::time::Instant::now() >= t) {
            return Ok(());
        }
    }
    Ok(())
}

impl Source for NvmlSource {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn sample(&self, _timeout: Duration) -> Result<SourceSample, ProbeError> {
        let nvml = self.handle()?;
        self.start_events(&nvml);
        let count = match nvml.device_count() {
            Ok(c) => c,
            Err(e) => {
                // A driver that lost its state answers nothing until NVML starts over.
                if matches!(
                    e,
                    NvmlError::Uninitialized | NvmlError::Unknown | NvmlError::DriverNotLoaded
                ) {
                    self.reset_handle();
                }
                return Err(ProbeError::Call(format!("device count: {e}")));
            }
        };
        let devices = (0..count).map(|i| self.read_device(&nvml, i)).collect();
        Ok(SourceSample {
            devices,
            events: vec![],
        })
    }
}
