//! `dcmi`: Huawei Ascend NPUs through `libdcmi.so`, loaded at run time with the C
//! signatures Huawei's own device plugin uses (Ascend/mind-cluster
//! `component/ascend-common/devmanager/dcmi/dcmi.go`; see
//! `tests/fixtures/dcmi/SIGNATURES.md` for each prototype and its source).
//!
//! Units: temperature in C, power in 0.1 W. Health: 0 OK, 1 minor (Warning), 2 major
//! (Alarm), 3 critical. `-8012` (not ready) from the health call is how the plugin
//! recognises a card that dropped off: reported as lost. `-8255` means "not supported"
//! and leaves the metric out.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_int, c_uint};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::{DeviceReading, EccCounts, Vendor, VendorHealth, VendorHealthLevel};
use libloading::{Library, Symbol};

use super::{ProbeError, Source, SourceSample};

const NOT_SUPPORTED: c_int = -8255;
const NOT_READY: c_int = -8012;
const MAX_CARDS: usize = 64;
const MAX_ERROR_CODES: usize = 128;
const DEVICE_TYPE_DDR: c_int = 0;
const DEVICE_TYPE_HBM: c_int = 2;
const CHIP_NAME_LEN: usize = 32;

/// `struct dcmi_ecc_info`, with room for the two trailing fields of mind-cluster's
/// longer header (the library writes 28 or 36 bytes).
#[repr(C)]
#[derive(Default)]
struct EccInfo {
    enable_flag: c_int,
    single_bit_error_cnt: c_uint,
    double_bit_error_cnt: c_uint,
    total_single_bit_error_cnt: c_uint,
    total_double_bit_error_cnt: c_uint,
    single_bit_isolated_pages_cnt: c_uint,
    double_bit_isolated_pages_cnt: c_uint,
    single_bit_next_isolated_pages_cnt: c_uint,
    double_bit_next_isolated_pages_cnt: c_uint,
}

/// `struct dcmi_pcie_info_all` (64 bytes).
#[repr(C)]
#[derive(Default)]
struct PcieInfoAll {
    venderid: c_uint,
    subvenderid: c_uint,
    deviceid: c_uint,
    subdeviceid: c_uint,
    domain: c_int,
    bdf_busid: c_uint,
    bdf_deviceid: c_uint,
    bdf_funcid: c_uint,
    reserve: [u8; 32],
}

/// `struct dcmi_chip_info` (100 bytes).
#[repr(C)]
struct ChipInfo {
    chip_type: [u8; CHIP_NAME_LEN],
    chip_name: [u8; CHIP_NAME_LEN],
    chip_ver: [u8; CHIP_NAME_LEN],
    aicore_cnt: c_uint,
}

type FnInit = unsafe extern "C" fn() -> c_int;
type FnCardList = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
type FnDevNum = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type FnLogicId = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type FnHealth = unsafe extern "C" fn(c_int, c_int, *mut c_uint) -> c_int;
type FnErrorCodes = unsafe extern "C" fn(c_int, c_int, *mut c_int, *mut c_uint, c_uint) -> c_int;
type FnInt = unsafe extern "C" fn(c_int, c_int, *mut c_int) -> c_int;
type FnEcc = unsafe extern "C" fn(c_int, c_int, c_int, *mut EccInfo) -> c_int;
type FnPcie = unsafe extern "C" fn(c_int, c_int, *mut PcieInfoAll) -> c_int;
type FnChip = unsafe extern "C" fn(c_int, c_int, *mut ChipInfo) -> c_int;

/// The loaded library.
struct Dcmi {
    lib: Library,
}

impl Dcmi {
    /// Look a function up. A missing symbol is an error of that call, not of the load.
    fn sym<T>(&self, name: &[u8]) -> Result<Symbol<'_, T>, String> {
        // SAFETY: every `T` used with this is the exact C prototype of `name` from
        // Huawei's dcmi_interface_api.h (see SIGNATURES.md).
        unsafe { self.lib.get::<T>(name) }.map_err(|e| {
            format!(
                "{}: {e}",
                String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name))
            )
        })
    }
}

fn rc(what: &str, rc: c_int) -> Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what}: dcmi error {rc}"))
    }
}

/// The DCMI source.
pub struct DcmiSource {
    path: PathBuf,
    /// The library, loaded once and kept loaded (an init that failed is retried on the
    /// same handle; unloading a vendor library that started threads is not safe).
    lib: Mutex<Option<Arc<Dcmi>>>,
    ready: std::sync::atomic::AtomicBool,
    /// Per (card, chip): logic id once known, so a transient error cannot rename a chip,
    /// and the run of "not ready" answers.
    chips: Mutex<HashMap<(c_int, c_int), ChipMemo>>,
}

#[derive(Default, Clone, Copy)]
struct ChipMemo {
    logic: Option<c_int>,
    not_ready: u32,
}

/// "Not ready" answers in a row before a chip is reported lost (one may be a blip).
const NOT_READY_LOST_AFTER: u32 = 3;

impl DcmiSource {
    /// Load `path` on first use.
    pub fn new(path: PathBuf) -> Self {
        DcmiSource {
            path,
            lib: Mutex::new(None),
            ready: std::sync::atomic::AtomicBool::new(false),
            chips: Mutex::new(HashMap::new()),
        }
    }

    fn handle(&self) -> Result<Arc<Dcmi>, ProbeError> {
        use std::sync::atomic::Ordering;
        let mut g = self.lib.lock().unwrap_or_else(|p| p.into_inner());
        let d = match g.as_ref() {
            Some(d) => d.clone(),
            None => {
                // SAFETY: loading a shared library runs its initialisers; libdcmi.so is
                // the vendor's library named by the operator, which we are here to call.
                let lib = unsafe { Library::new(&self.path) }
                    .map_err(|e| ProbeError::Init(format!("{}: {e}", self.path.display())))?;
                let d = Arc::new(Dcmi { lib });
                *g = Some(d.clone());
                d
            }
        };
        if !self.ready.load(Ordering::Acquire) {
            let init = d.sym::<FnInit>(b"dcmi_init\0").map_err(ProbeError::Init)?;
            // SAFETY: dcmi_init(void) takes no arguments.
            let r = unsafe { init() };
            if r != 0 {
                return Err(ProbeError::Init(format!("dcmi_init: dcmi error {r}")));
            }
            self.ready.store(true, Ordering::Release);
        }
        Ok(d)
    }

    fn memo(&self, card: c_int, chip: c_int) -> ChipMemo {
        self.chips
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(card, chip))
            .copied()
            .unwrap_or_default()
    }

    fn set_memo(&self, card: c_int, chip: c_int, m: ChipMemo) {
        self.chips
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((card, chip), m);
    }
}

fn read_chip(src: &DcmiSource, d: &Dcmi, card: c_int, chip: c_int) -> DeviceReading {
    let mut memo = src.memo(card, chip);
    if memo.logic.is_none() {
        let mut logic: c_int = -1;
        let ok = d
            .sym::<FnLogicId>(b"dcmi_get_device_logic_id\0")
            // SAFETY: out-pointer first, then card and chip ids, as in the header.
            .map(|f| unsafe { f(&mut logic, card, chip) } == 0 && logic >= 0)
            .unwrap_or(false);
        if ok {
            memo.logic = Some(logic);
        }
    }
    let id = match memo.logic {
        Some(l) => format!("npu{l}"),
        None => format!("npu{card}-{chip}"),
    };
    let mut r = DeviceReading::new(id, Vendor::Ascend, "dcmi");
    r.index = memo.logic.map(|l| l as u32);
    let note = |r: &mut DeviceReading, e: String| r.probe_errors.push(e);

    // Health first: a dropped card answers "not ready" and nothing else is worth asking.
    match d.sym::<FnHealth>(b"dcmi_get_device_health\0") {
        Ok(f) => {
            let mut h: c_uint = 0;
            // SAFETY: card, chip, one valid out-pointer.
            match unsafe { f(card, chip, &mut h) } {
                0 => {
                    let (level, raw) = match h {
                        0 => (Some(VendorHealthLevel::Ok), "OK"),
                        1 => (Some(VendorHealthLevel::Warning), "Warning"),
                        2 => (Some(VendorHealthLevel::Alarm), "Alarm"),
                        3 => (Some(VendorHealthLevel::Critical), "Critical"),
                        _ => (None, ""),
                    };
                    match level {
                        Some(level) => {
                            r.vendor_health = Some(VendorHealth {
                                level,
                                raw: raw.into(),
                                error_codes: vec![],
                            })
                        }
                        None => note(&mut r, format!("health: unexpected value {h:#x}")),
                    }
                }
                NOT_READY => {
                    // How Huawei's plugin spots a card that dropped off; a single answer
                    // may be a blip, so it takes a few in a row.
                    memo.not_ready += 1;
                    src.set_memo(card, chip, memo);
                    if memo.not_ready >= NOT_READY_LOST_AFTER {
                        r.lost = true;
                    } else {
                        r.probe_errors
                            .push(format!("health: not ready ({} in a row)", memo.not_ready));
                    }
                    return r;
                }
                e => note(&mut r, format!("health: dcmi error {e}")),
            }
        }
        Err(e) => note(&mut r, e),
    }
    // Without the chip's own verdict its other numbers do not make it healthy: report
    // only the errors, and its last good reading ages into unknown.
    if r.vendor_health.is_none() {
        src.set_memo(card, chip, memo);
        return r;
    }
    memo.not_ready = 0;
    src.set_memo(card, chip, memo);

    if let Some(vh) = r
        .vendor_health
        .as_mut()
        .filter(|v| v.level != VendorHealthLevel::Ok)
    {
        match d.sym::<FnErrorCodes>(b"dcmi_get_device_errorcode_v2\0") {
            Ok(f) => {
                let mut n: c_int = 0;
                let mut codes = [0 as c_uint; MAX_ERROR_CODES];
                // SAFETY: the buffer holds MAX_ERROR_CODES entries and we say so.
                let e = unsafe {
                    f(
                        card,
                        chip,
                        &mut n,
                        codes.as_mut_ptr(),
                        MAX_ERROR_CODES as c_uint,
                    )
                };
                if e == 0 {
                    let n = (n.max(0) as usize).min(MAX_ERROR_CODES);
                    vh.error_codes = codes[..n].iter().map(|c| format!("{c:08X}")).collect();
                } else {
                    r.probe_errors.push(format!("error codes: dcmi error {e}"));
                }
            }
            Err(e) => r.probe_errors.push(e),
        }
    }

    let int_call = |r: &mut DeviceReading, name: &[u8]| -> Option<c_int> {
        let f = match d.sym::<FnInt>(name) {
            Ok(f) => f,
            Err(e) => {
                r.probe_errors.push(e);
                return None;
            }
        };
        let mut v: c_int = 0;
        // SAFETY: card, chip, one valid out-pointer to an int.
        match unsafe { f(card, chip, &mut v) } {
            0 => Some(v),
            NOT_SUPPORTED => None,
            e => {
                let n =
                    String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned();
                r.probe_errors.push(format!("{n}: dcmi error {e}"));
                None
            }
        }
    };
    r.temperature_c = int_call(&mut r, b"dcmi_get_device_temperature\0")
        .filter(|t| *t > -275)
        .map(f64::from);
    r.power_w = int_call(&mut r, b"dcmi_get_device_power_info\0")
        .filter(|p| *p >= 0)
        .map(|p| f64::from(p) / 10.0);

    if let Ok(f) = d.sym::<FnEcc>(b"dcmi_get_device_ecc_info\0") {
        // HBM on 910-class chips; DDR on the others.
        for ty in [DEVICE_TYPE_HBM, DEVICE_TYPE_DDR] {
            let mut e = EccInfo::default();
            // SAFETY: `e` is zeroed and at least as large as either header's struct.
            let code = unsafe { f(card, chip, ty, &mut e) };
            if code == 0 {
                r.ecc = Some(EccCounts {
                    volatile_corrected: e.single_bit_error_cnt.into(),
                    volatile_uncorrected: e.double_bit_error_cnt.into(),
                    aggregate_corrected: e.total_single_bit_error_cnt.into(),
                    aggregate_uncorrected: e.total_double_bit_error_cnt.into(),
                });
                break;
            }
            if code != NOT_SUPPORTED && ty == DEVICE_TYPE_DDR {
                r.probe_errors.push(format!("ecc: dcmi error {code}"));
            }
        }
    }

    if let Ok(f) = d.sym::<FnPcie>(b"dcmi_get_device_pcie_info_v2\0") {
        let mut p = PcieInfoAll::default();
        // SAFETY: `p` is a zeroed struct of the header's 64-byte layout.
        if unsafe { f(card, chip, &mut p) } == 0 {
            r.pci_bus_id = faultline_common::normalize_bus_id(&format!(
                "{:04x}:{:02x}:{:02x}.{:x}",
                p.domain, p.bdf_busid, p.bdf_deviceid, p.bdf_funcid
            ));
        }
    }

    if let Ok(f) = d.sym::<FnChip>(b"dcmi_get_device_chip_info\0") {
        let mut c = ChipInfo {
            chip_type: [0; CHIP_NAME_LEN],
            chip_name: [0; CHIP_NAME_LEN],
            chip_ver: [0; CHIP_NAME_LEN],
            aicore_cnt: 0,
        };
        // SAFETY: `c` has the header's 100-byte layout.
        if unsafe { f(card, chip, &mut c) } == 0 {
            let s = |b: &[u8]| {
                let end = b.iter().position(|x| *x == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end]).trim().to_string()
            };
            let name = format!("{}{}", s(&c.chip_type), s(&c.chip_name));
            if !name.is_empty() {
                r.name = Some(name);
            }
        }
    }
    r
}

impl Source for DcmiSource {
    fn name(&self) -> &'static str {
        "dcmi"
    }

    fn sample(&self, _timeout: Duration) -> Result<SourceSample, ProbeError> {
        let d = self.handle()?;
        let list = d
            .sym::<FnCardList>(b"dcmi_get_card_list\0")
            .map_err(ProbeError::Call)?;
        let mut n: c_int = 0;
        let mut cards = [0 as c_int; MAX_CARDS];
        // SAFETY: the buffer holds MAX_CARDS ints and we say so.
        rc("dcmi_get_card_list", unsafe {
            list(&mut n, cards.as_mut_ptr(), MAX_CARDS as c_int)
        })
        .map_err(ProbeError::Call)?;
        let n = (n.max(0) as usize).min(MAX_CARDS);
        let chips = d
            .sym::<FnDevNum>(b"dcmi_get_device_num_in_card\0")
            .map_err(ProbeError::Call)?;
        let mut out = SourceSample::default();
        for &card in &cards[..n] {
            let mut m: c_int = 0;
            // SAFETY: card id and one valid out-pointer.
            if let Err(e) = rc("dcmi_get_device_num_in_card", unsafe {
                chips(card, &mut m)
            }) {
                let mut r = DeviceReading::new(format!("npu{card}-0"), Vendor::Ascend, "dcmi");
                r.probe_errors.push(e);
                out.devices.push(r);
                continue;
            }
            // The plugin accepts 1..=4 chips; an id at or above the count is the MCU.
            for chip in 0..m.clamp(0, 4) {
                out.devices.push(read_chip(self, &d, card, chip));
            }
        }
        Ok(out)
    }

    fn needs_warm_up(&self) -> bool {
        true
    }
}
