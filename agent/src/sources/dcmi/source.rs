//! The `dcmi` source itself: the library loaded once, each chip read per sample through
//! `ffi`, graded through `map`, its RoCE links through `net`.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_int;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use faultline_common::ascend::Catalog;
use faultline_common::sync::Locked;
use faultline_common::{DeviceReading, Vendor};
use libloading::Library;

use super::super::{ProbeError, Source, SourceSample};
use super::map::{DcmiError, RawChip, RawDetails, RawNet};
use super::net::{
    finish_network_health, start_network_health, NetAnswer, NetProbe, NETWORK_HEALTH_BOUND,
};
use crate::metrics::{FaultAssertion, FaultEventMode};

use crate::metrics::Metrics;

/// How long an event's code counts without the poll confirming it.
const EVENT_CODE_TTL: Duration = Duration::from_secs(60);

use super::ffi::*;
use super::library::{fn_name, Api, Dcmi};

/// What the source remembers of a chip between samples.
#[derive(Default, Clone)]
struct ChipMemo {
    logic: Option<c_int>,
    phy: Option<u32>,
    not_ready: u32,
    net: Arc<NetProbe>,
}

/// Codes from fault events, per logic id: (code, when, still asserted).
type EventCodes = HashMap<u32, Vec<(u32, Instant)>>;

/// Where the library's callback delivers (one subscription per process).
struct EventTarget {
    wake: Arc<tokio::sync::Notify>,
    codes: Arc<Mutex<EventCodes>>,
    metrics: Option<Arc<Metrics>>,
}

static EVENT_TARGET: Mutex<Option<EventTarget>> = Mutex::new(None);

/// The callback DCMI calls on its own thread for every fault event.
extern "C" fn on_fault_event(ev: *mut DcmiEvent) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: the library passes an event valid for the call; we only read it.
        let Some(ev) = (unsafe { ev.as_ref() }) else {
            return;
        };
        if ev.kind != 0 {
            return;
        }
        let e = &ev.dms;
        let g = EVENT_TARGET.locked();
        let Some(t) = g.as_ref() else {
            return;
        };
        let assertion = match e.assertion {
            0 => FaultAssertion::Recover,
            1 => FaultAssertion::Occur,
            2 => FaultAssertion::OneOff,
            _ => FaultAssertion::Other,
        };
        if let Some(m) = &t.metrics {
            m.count_fault_event("dcmi", assertion);
        }
        // Event id 0 carries nothing; 0x8C2FA009 is "reset finished": re-read only.
        if e.event_id != 0 && e.event_id != 0x8C2F_A009 {
            let mut codes = t.codes.locked();
            let list = codes.entry(u32::from(e.deviceid)).or_default();
            list.retain(|(c, _)| *c != e.event_id);
            if e.assertion != 0 {
                list.push((e.event_id, Instant::now()));
            }
        }
        t.wake.notify_one();
    });
}

/// The DCMI source.
pub struct DcmiSource {
    path: PathBuf,
    /// The library, loaded once and kept loaded (an init that failed is retried on the
    /// same handle; unloading a vendor library that started threads is not safe).
    loaded: Mutex<Option<Arc<Library>>>,
    /// The library once an init succeeded, with its API family.
    lib: Mutex<Option<Arc<Dcmi>>>,
    /// Per chip address: ids once known, the run of "not ready" answers, the network
    /// probe.
    chips: Mutex<HashMap<Addr, ChipMemo>>,
    fault_codes: Arc<Catalog>,
    across: super::super::AcrossChips,
    metrics: Option<Arc<Metrics>>,
    /// Subscribe to fault events (tests of the polling path turn it off).
    events: bool,
    wake: Arc<tokio::sync::Notify>,
    event_codes: Arc<Mutex<EventCodes>>,
}

impl DcmiSource {
    /// Load `path` on first use.
    pub fn new(path: PathBuf) -> Self {
        DcmiSource {
            path,
            loaded: Mutex::new(None),
            lib: Mutex::new(None),
            chips: Mutex::new(HashMap::new()),
            fault_codes: Arc::new(Catalog::builtin().clone()),
            across: super::super::AcrossChips::default(),
            metrics: None,
            events: true,
            wake: Arc::new(tokio::sync::Notify::new()),
            event_codes: Arc::default(),
        }
    }

    /// Grade fault codes with this table (the built-in one by default).
    pub fn with_fault_codes(mut self, fault_codes: Arc<Catalog>) -> Self {
        self.fault_codes = fault_codes;
        self
    }

    /// Escalate codes by these rules (MindCluster's by default).
    pub fn with_escalation(
        mut self,
        rules: Arc<faultline_common::ascend_escalation::Escalation>,
    ) -> Self {
        self.across = super::super::AcrossChips::new(rules);
        self
    }

    /// Count fault events and the subscription mode here.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Whether to subscribe to fault events (default: yes).
    pub fn with_events(mut self, events: bool) -> Self {
        self.events = events;
        self
    }

    fn handle(&self) -> Result<Arc<Dcmi>, ProbeError> {
        let mut g = self.lib.locked();
        if let Some(d) = g.as_ref() {
            return Ok(d.clone());
        }
        let lib = {
            let mut loaded = self.loaded.locked();
            match loaded.as_ref() {
                Some(l) => l.clone(),
                None => {
                    // SAFETY: loading a shared library runs its initialisers; libdcmi.so
                    // is the vendor's library named by the operator, which we are here
                    // to call. It stays loaded, whether or not its init succeeds.
                    let l =
                        Arc::new(unsafe { Library::new(&self.path) }.map_err(|e| {
                            ProbeError::Init(format!("{}: {e}", self.path.display()))
                        })?);
                    *loaded = Some(l.clone());
                    // Never unloaded, not even when the source is dropped: the library
                    // runs its own threads (the fault-event subscription, calls a
                    // timeout abandoned) that a dlclose would pull the code from under
                    // (a SIGSEGV, seen with two agents in one test process).
                    std::mem::forget(l.clone());
                    l
                }
            }
        };
        let init = |name: &[u8]| -> Result<(), DcmiError> {
            // SAFETY: dcmi_init(void) and dcmiv2_init(void) take no arguments.
            let f = unsafe { lib.get::<FnInit>(name) }
                .map_err(|e| DcmiError::Missing(format!("{}: {e}", fn_name(name))))?;
            // SAFETY: as above.
            match unsafe { f() } {
                0 => Ok(()),
                rc => Err(DcmiError::Code {
                    call: fn_name(name),
                    rc,
                }),
            }
        };
        // DetectDcmiApiVersion: v1 first; any failure tries v2 (-8255 on a 950 host).
        let api = match init(b"dcmi_init\0") {
            Ok(()) => Api::V1,
            Err(v1) => match init(b"dcmiv2_init\0") {
                Ok(()) => {
                    tracing::info!(%v1, "DCMI v1 refused; using the dcmiv2 API (Ascend 950)");
                    Api::V2
                }
                Err(v2) => return Err(ProbeError::Init(format!("{v1}; {v2}"))),
            },
        };
        let d = Arc::new(Dcmi { lib, api });
        *g = Some(d.clone());
        drop(g);
        self.subscribe(&d);
        Ok(d)
    }

    /// Subscribe every device's fault events, once; polling stays the fallback.
    fn subscribe(&self, d: &Dcmi) {
        let mode = |m: FaultEventMode| {
            if let Some(metrics) = &self.metrics {
                metrics.set_fault_event_mode("dcmi", m);
            }
        };
        if !self.events {
            mode(FaultEventMode::Polling);
            return;
        }
        *EVENT_TARGET.locked() = Some(EventTarget {
            wake: self.wake.clone(),
            codes: self.event_codes.clone(),
            metrics: self.metrics.clone(),
        });
        let filter = EventFilter {
            filter_flag: 0,
            event_id: 0,
            severity: 0,
            node_type: 0,
            resv: [0; 32],
        };
        let r = match d.api {
            // SAFETY: (-1, -1) is every device; the filter by value; the callback is
            // a plain extern "C" function that lives as long as the process.
            Api::V1 => d
                .sym::<V1Subscribe>(b"dcmi_subscribe_fault_event\0")
                .map(|f| unsafe { f(-1, -1, filter, on_fault_event) }),
            // SAFETY: as above; -1 is every device.
            Api::V2 => d
                .sym::<V2Subscribe>(b"dcmiv2_subscribe_fault_event\0")
                .map(|f| unsafe { f(-1, filter, on_fault_event) }),
        };
        match r {
            Ok(0) => {
                tracing::info!("subscribed to DCMI fault events");
                mode(FaultEventMode::Events);
            }
            Ok(rc) => {
                tracing::warn!(
                    rc,
                    "DCMI fault-event subscription refused; polling the codes"
                );
                mode(FaultEventMode::Polling);
            }
            Err(e) => {
                tracing::warn!(error = %e, "no DCMI fault-event subscription; polling the codes");
                mode(FaultEventMode::Polling);
            }
        }
    }

    fn memo(&self, a: Addr) -> ChipMemo {
        self.chips.locked().entry(a).or_default().clone()
    }

    fn set_memo(&self, a: Addr, m: &ChipMemo) {
        self.chips.locked().insert(a, m.clone());
    }

    /// Codes events reported for `logic` within the last minute, still asserted.
    fn event_codes_of(&self, logic: Option<c_int>) -> Vec<u32> {
        let Some(logic) = logic.and_then(|l| u32::try_from(l).ok()) else {
            return Vec::new();
        };
        let mut g = self.event_codes.locked();
        let Some(list) = g.get_mut(&logic) else {
            return Vec::new();
        };
        list.retain(|(_, at)| at.elapsed() < EVENT_CODE_TTL);
        list.iter().map(|(c, _)| *c).collect()
    }

    /// The chips of the host.
    fn addresses(&self, d: &Dcmi, out: &mut SourceSample) -> Result<Vec<Addr>, ProbeError> {
        let list = match d.api {
            Api::V1 => d.sym::<FnList>(b"dcmi_get_card_list\0"),
            Api::V2 => d.sym::<FnList>(b"dcmiv2_get_device_list\0"),
        }
        .map_err(|e| ProbeError::Call(e.to_string()))?;
        let mut n: c_int = 0;
        let mut ids = [0 as c_int; MAX_CHIPS];
        let rc = match d.api {
            // SAFETY: (count, list, capacity), the buffer holds MAX_CARDS ints.
            Api::V1 => unsafe { list(&mut n, ids.as_mut_ptr(), MAX_CARDS as c_int) },
            // SAFETY: (list, count, capacity): list first in v2; MAX_CHIPS ints.
            Api::V2 => unsafe { list(ids.as_mut_ptr(), &mut n, MAX_CHIPS as c_int) },
        };
        if rc != 0 {
            let name = match d.api {
                Api::V1 => "dcmi_get_card_list",
                Api::V2 => "dcmiv2_get_device_list",
            };
            return Err(ProbeError::Call(format!("{name}: dcmi error {rc}")));
        }
        let n = (n.max(0) as usize).min(MAX_CHIPS);
        if d.api == Api::V2 {
            return Ok(ids[..n].iter().map(|&dev| Addr::V2 { dev }).collect());
        }
        let chips = d
            .sym::<FnDevNum>(b"dcmi_get_device_num_in_card\0")
            .map_err(|e| ProbeError::Call(e.to_string()))?;
        let mut addrs = Vec::new();
        for &card in &ids[..n.min(MAX_CARDS)] {
            let mut m: c_int = 0;
            // SAFETY: card id and one valid out-pointer.
            let rc = unsafe { chips(card, &mut m) };
            if rc != 0 {
                let mut r = DeviceReading::new(format!("npu{card}-0"), Vendor::Ascend, "dcmi");
                r.probe_errors
                    .push(format!("dcmi_get_device_num_in_card: dcmi error {rc}"));
                out.devices.push(r);
                continue;
            }
            // The plugin accepts 1..=4 chips; an id at or above the count is the MCU.
            addrs.extend((0..m.clamp(0, 4)).map(|chip| Addr::V1 { card, chip }));
        }
        Ok(addrs)
    }
}

/// Logic and physical ids, learned once and kept; why a lookup failed this time.
fn learn_ids(d: &Dcmi, a: Addr, memo: &mut ChipMemo) -> Vec<String> {
    let mut errors = Vec::new();
    if memo.logic.is_none() {
        match a {
            Addr::V2 { dev } => memo.logic = Some(dev),
            Addr::V1 { card, chip } => match super::map::logic_id(d.logic_id(card, chip)) {
                Ok(logic) => memo.logic = Some(logic),
                Err(e) => errors.push(e.to_string()),
            },
        }
    }
    // v1 looks the physical id up by the logic id; v2 always has one (its dev_id).
    if let (None, Some(logic)) = (memo.phy, memo.logic) {
        match super::map::phy_id(d.phy_id(a, logic), logic) {
            Ok(phy) => memo.phy = Some(phy),
            Err(e) => errors.push(e.to_string()),
        }
    }
    errors
}

/// One chip's reading; `net`: its network-health call, started with the others'. Which
/// calls are worth making is `map`'s to say (nothing after a booting chip's boot status,
/// nothing after a health call without a verdict), and so is what the answers mean.
fn read_chip(
    src: &DcmiSource,
    d: &Arc<Dcmi>,
    a: Addr,
    net: Result<Option<NetAnswer>, DcmiError>,
    net_deadline: Instant,
) -> DeviceReading {
    let mut memo = src.memo(a);
    let id_errors = learn_ids(d, a, &mut memo);
    let boot = d.uint(
        a,
        b"dcmi_get_device_boot_status\0",
        b"dcmiv2_get_device_boot_status\0",
    );
    let health = (!super::map::booting(&boot)).then(|| {
        d.uint(
            a,
            b"dcmi_get_device_health\0",
            b"dcmiv2_get_device_health\0",
        )
    });
    let details = match &health {
        Some(h) if super::map::judged(h) => Some(details(src, d, a, memo.logic, net, net_deadline)),
        _ => None,
    };
    let raw = RawChip {
        addr: a,
        logic: memo.logic,
        phy: memo.phy,
        id_errors,
        boot,
        health,
        details,
    };
    let (reading, not_ready) = super::map::reading(raw, memo.not_ready, &src.fault_codes);
    memo.not_ready = not_ready;
    src.set_memo(a, &memo);
    reading
}

/// The calls made of a chip that gave its verdict, in the order they always were.
fn details(
    src: &DcmiSource,
    d: &Dcmi,
    a: Addr,
    logic: Option<c_int>,
    net: Result<Option<NetAnswer>, DcmiError>,
    net_deadline: Instant,
) -> RawDetails {
    let codes = d.codes(a);
    let event_codes = src.event_codes_of(logic);
    let temperature = d.int(
        a,
        b"dcmi_get_device_temperature\0",
        b"dcmiv2_get_device_temperature\0",
    );
    let power = d.int(
        a,
        b"dcmi_get_device_power_info\0",
        b"dcmiv2_get_device_power_info\0",
    );
    let ecc_hbm = d.ecc(a, DEVICE_TYPE_HBM);
    let ecc_ddr = super::map::ecc_falls_back(&ecc_hbm).then(|| d.ecc(a, DEVICE_TYPE_DDR));
    let (pcie, chip_info) = match a {
        Addr::V1 { card, chip } => (Some(d.pcie(card, chip)), Some(d.chip_info(card, chip))),
        Addr::V2 { .. } => (None, None),
    };
    let net = match net {
        Ok(Some(rx)) => finish_network_health(rx, net_deadline),
        Ok(None) => RawNet::NotAsked,
        Err(e) => RawNet::NotStarted(e),
    };
    RawDetails {
        codes,
        event_codes,
        temperature,
        power,
        ecc_hbm,
        ecc_ddr,
        pcie,
        chip_info,
        net,
    }
}

impl Source for DcmiSource {
    fn name(&self) -> &'static str {
        "dcmi"
    }

    fn sample(&self, _timeout: Duration) -> Result<SourceSample, ProbeError> {
        let d = self.handle()?;
        let mut out = SourceSample::default();
        let addrs = self.addresses(&d, &mut out)?;
        // Every chip's network-health call starts now and shares one 1 s deadline, so
        // blocked calls cost the sample at most 1 s together, not 1 s each.
        let nets: Vec<_> = addrs
            .iter()
            .map(|&a| {
                let d = d.clone();
                let call = move || {
                    d.uint(
                        a,
                        b"dcmi_get_device_network_health\0",
                        b"dcmiv2_get_device_network_health\0",
                    )
                };
                start_network_health(call, &self.memo(a).net)
            })
            .collect();
        let net_deadline = Instant::now() + NETWORK_HEALTH_BOUND;
        for (a, net) in addrs.into_iter().zip(nets) {
            out.devices.push(read_chip(self, &d, a, net, net_deadline));
        }
        self.across.apply(&mut out.devices);
        Ok(out)
    }

    fn needs_warm_up(&self) -> bool {
        true
    }

    fn wake(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.events.then(|| self.wake.clone())
    }
}
