//! The C side of DCMI: the structs and prototypes of Huawei's `dcmi_interface_api.h`
//! (and the driver's longer copy), as `tests/fixtures/dcmi/MINDCLUSTER.md` quotes them.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_ushort};

pub(super) const CHIP_NAME_LEN: usize = 32;

/// "Not supported": the chip or library has no such value; the metric is left out.
pub(super) const NOT_SUPPORTED: c_int = -8255;
/// "Not ready": how Huawei's plugin recognises a card that dropped off.
pub(super) const NOT_READY: c_int = -8012;
pub(super) const MAX_CARDS: usize = 64;
/// `HiAIMaxCardNum * HiAIMaxDeviceNum`: the most chips a host has.
pub(super) const MAX_CHIPS: usize = 256;
pub(super) const MAX_ERROR_CODES: usize = 128;
pub(super) const DEVICE_TYPE_DDR: c_int = 0;
pub(super) const DEVICE_TYPE_HBM: c_int = 2;

/// How one chip is addressed in a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Addr {
    /// `dcmi_*`: card and chip ids.
    V1 { card: c_int, chip: c_int },
    /// `dcmiv2_*`: one `dev_id`, the logic id.
    V2 { dev: c_int },
}

/// `struct dcmi_ecc_info`, with room for the two trailing fields of mind-cluster's
/// longer header (the library writes 28 or 36 bytes).
#[repr(C)]
#[derive(Default)]
pub(super) struct EccInfo {
    pub(super) enable_flag: c_int,
    pub(super) single_bit_error_cnt: c_uint,
    pub(super) double_bit_error_cnt: c_uint,
    pub(super) total_single_bit_error_cnt: c_uint,
    pub(super) total_double_bit_error_cnt: c_uint,
    pub(super) single_bit_isolated_pages_cnt: c_uint,
    pub(super) double_bit_isolated_pages_cnt: c_uint,
    pub(super) single_bit_next_isolated_pages_cnt: c_uint,
    pub(super) double_bit_next_isolated_pages_cnt: c_uint,
}

/// `struct dcmi_pcie_info_all` (64 bytes).
#[repr(C)]
#[derive(Default)]
pub(super) struct PcieInfoAll {
    pub(super) venderid: c_uint,
    pub(super) subvenderid: c_uint,
    pub(super) deviceid: c_uint,
    pub(super) subdeviceid: c_uint,
    pub(super) domain: c_int,
    pub(super) bdf_busid: c_uint,
    pub(super) bdf_deviceid: c_uint,
    pub(super) bdf_funcid: c_uint,
    pub(super) reserve: [u8; 32],
}

/// `struct dcmi_chip_info` (100 bytes).
#[repr(C)]
#[derive(Default)]
pub(super) struct ChipInfo {
    pub(super) chip_type: [u8; CHIP_NAME_LEN],
    pub(super) chip_name: [u8; CHIP_NAME_LEN],
    pub(super) chip_ver: [u8; CHIP_NAME_LEN],
    pub(super) aicore_cnt: c_uint,
}

/// `struct dcmi_event_filter` (48 bytes, passed by value). All zero: no filter.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct EventFilter {
    pub(super) filter_flag: c_ulonglong,
    pub(super) event_id: c_uint,
    pub(super) severity: u8,
    pub(super) node_type: u8,
    pub(super) resv: [u8; 32],
}

/// `struct dcmi_dms_fault_event` (352 bytes).
#[repr(C)]
pub(super) struct FaultEvent {
    pub(super) event_id: c_uint,
    pub(super) deviceid: c_ushort,
    pub(super) node_type: u8,
    pub(super) node_id: u8,
    pub(super) sub_node_type: u8,
    pub(super) sub_node_id: u8,
    pub(super) severity: u8,
    pub(super) assertion: u8,
    pub(super) event_serial_num: c_int,
    pub(super) notify_serial_num: c_int,
    pub(super) alarm_raised_time: c_ulonglong,
    pub(super) event_name: [c_char; 256],
    pub(super) additional_info: [c_char; 32],
    pub(super) tail: [u8; 32],
}

/// `struct dcmi_event` (360 bytes): a type and, for type 0, the fault event.
#[repr(C)]
pub(super) struct DcmiEvent {
    pub(super) kind: c_int,
    pub(super) dms: FaultEvent,
}

const _: () = assert!(std::mem::size_of::<EventFilter>() == 48);
const _: () = assert!(std::mem::size_of::<FaultEvent>() == 352);
const _: () = assert!(std::mem::size_of::<DcmiEvent>() == 360);

pub(super) type Callback = extern "C" fn(*mut DcmiEvent);
pub(super) type FnInit = unsafe extern "C" fn() -> c_int;
/// v1 `dcmi_get_card_list(int *card_num, int *card_list, int list_len)` and v2
/// `dcmiv2_get_device_list(int *device_list, int *device_cnt, int list_len)`: the same C
/// types, the first two in the opposite roles.
pub(super) type FnList = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
pub(super) type FnDevNum = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
pub(super) type FnLogicId = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
pub(super) type FnPhyFromLogic = unsafe extern "C" fn(c_uint, *mut c_uint) -> c_int;
pub(super) type V1Uint = unsafe extern "C" fn(c_int, c_int, *mut c_uint) -> c_int;
pub(super) type V2Uint = unsafe extern "C" fn(c_int, *mut c_uint) -> c_int;
pub(super) type V1Int = unsafe extern "C" fn(c_int, c_int, *mut c_int) -> c_int;
pub(super) type V2Int = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
pub(super) type V1Codes =
    unsafe extern "C" fn(c_int, c_int, *mut c_int, *mut c_uint, c_uint) -> c_int;
pub(super) type V2Codes = unsafe extern "C" fn(c_int, *mut c_int, *mut c_uint, c_uint) -> c_int;
pub(super) type V1Ecc = unsafe extern "C" fn(c_int, c_int, c_int, *mut EccInfo) -> c_int;
pub(super) type V2Ecc = unsafe extern "C" fn(c_int, c_int, *mut EccInfo) -> c_int;
pub(super) type FnPcie = unsafe extern "C" fn(c_int, c_int, *mut PcieInfoAll) -> c_int;
pub(super) type FnChip = unsafe extern "C" fn(c_int, c_int, *mut ChipInfo) -> c_int;
pub(super) type V1Subscribe = unsafe extern "C" fn(c_int, c_int, EventFilter, Callback) -> c_int;
pub(super) type V2Subscribe = unsafe extern "C" fn(c_int, EventFilter, Callback) -> c_int;
