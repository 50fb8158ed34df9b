//! The DCMI library, loaded once, and its calls as typed answers: each symbol looked up
//! by name, each call's return code kept with its value (`map::Answer`).

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint};
use std::sync::Arc;

use libloading::{Library, Symbol};

use super::ffi::*;
use super::map::{Answer, DcmiError};

/// Which DCMI family the host answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    /// `dcmi_*`: (card, chip) pairs (910, 910B, 910_93, 310P).
    V1,
    /// `dcmiv2_*`: one `dev_id`, the logic id (Ascend 950).
    V2,
}

/// The loaded library and the family that initialised.
pub(super) struct Dcmi {
    pub(super) lib: Arc<Library>,
    pub(super) api: Api,
}

/// A symbol's name without its NUL, for messages.
pub(super) fn fn_name(name: &[u8]) -> String {
    String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned()
}

impl Dcmi {
    /// Look a function up. A missing symbol is an error of that call, not of the load.
    pub(super) fn sym<T>(&self, name: &[u8]) -> Result<Symbol<'_, T>, DcmiError> {
        // SAFETY: every `T` used with this is the exact C prototype of `name` from
        // Huawei's dcmi_interface_api.h (see SIGNATURES.md and MINDCLUSTER.md).
        unsafe { self.lib.get::<T>(name) }
            .map_err(|e| DcmiError::Missing(format!("{}: {e}", fn_name(name))))
    }

    /// An unsigned out-parameter call, v1 `(card, chip, *out)` or v2 `(dev, *out)`:
    /// the return code and the value.
    pub(super) fn uint(&self, a: Addr, v1: &[u8], v2: &[u8]) -> Answer<c_uint> {
        let mut v: c_uint = 0;
        let rc = match a {
            // SAFETY: ids and one valid out-pointer, as in the header.
            Addr::V1 { card, chip } => unsafe { self.sym::<V1Uint>(v1)?(card, chip, &mut v) },
            // SAFETY: as above, the v2 prototype.
            Addr::V2 { dev } => unsafe { self.sym::<V2Uint>(v2)?(dev, &mut v) },
        };
        Ok((rc, v))
    }

    /// A signed out-parameter call.
    pub(super) fn int(&self, a: Addr, v1: &[u8], v2: &[u8]) -> Answer<c_int> {
        let mut v: c_int = 0;
        let rc = match a {
            // SAFETY: ids and one valid out-pointer, as in the header.
            Addr::V1 { card, chip } => unsafe { self.sym::<V1Int>(v1)?(card, chip, &mut v) },
            // SAFETY: as above, the v2 prototype.
            Addr::V2 { dev } => unsafe { self.sym::<V2Int>(v2)?(dev, &mut v) },
        };
        Ok((rc, v))
    }

    /// The chip's fault codes.
    pub(super) fn codes(&self, a: Addr) -> Answer<Vec<c_uint>> {
        let mut n: c_int = 0;
        let mut codes = [0 as c_uint; MAX_ERROR_CODES];
        let len = MAX_ERROR_CODES as c_uint;
        let rc = match a {
            // SAFETY: the buffer holds MAX_ERROR_CODES entries and we say so.
            Addr::V1 { card, chip } => unsafe {
                self.sym::<V1Codes>(b"dcmi_get_device_errorcode_v2\0")?(
                    card,
                    chip,
                    &mut n,
                    codes.as_mut_ptr(),
                    len,
                )
            },
            // SAFETY: as above; the v2 name is `_error_code_list`.
            Addr::V2 { dev } => unsafe {
                self.sym::<V2Codes>(b"dcmiv2_get_device_error_code_list\0")?(
                    dev,
                    &mut n,
                    codes.as_mut_ptr(),
                    len,
                )
            },
        };
        let n = (n.max(0) as usize).min(MAX_ERROR_CODES);
        Ok((rc, codes[..n].to_vec()))
    }

    /// ECC counters of one memory type (`DEVICE_TYPE_HBM` or `DEVICE_TYPE_DDR`).
    pub(super) fn ecc(&self, a: Addr, ty: c_int) -> Answer<EccInfo> {
        let mut e = EccInfo::default();
        let rc = match a {
            // SAFETY: `e` is zeroed and at least as large as either header's struct.
            Addr::V1 { card, chip } => unsafe {
                self.sym::<V1Ecc>(b"dcmi_get_device_ecc_info\0")?(card, chip, ty, &mut e)
            },
            // SAFETY: as above.
            Addr::V2 { dev } => unsafe {
                self.sym::<V2Ecc>(b"dcmiv2_get_device_ecc_info\0")?(dev, ty, &mut e)
            },
        };
        Ok((rc, e))
    }

    /// A v1 chip's logic id.
    pub(super) fn logic_id(&self, card: c_int, chip: c_int) -> Answer<c_int> {
        let f = self.sym::<FnLogicId>(b"dcmi_get_device_logic_id\0")?;
        let mut logic: c_int = -1;
        // SAFETY: out-pointer first, then card and chip ids, as in the header.
        let rc = unsafe { f(&mut logic, card, chip) };
        Ok((rc, logic))
    }

    /// A chip's physical id: v2 by its dev_id, v1 by its logic id.
    pub(super) fn phy_id(&self, a: Addr, logic: c_int) -> Answer<c_uint> {
        let mut phy: c_uint = u32::MAX;
        let rc = match a {
            // SAFETY: dev_id and one valid out-pointer.
            Addr::V2 { dev } => unsafe {
                self.sym::<V2Uint>(b"dcmiv2_get_chip_phy_id_by_dev_id\0")?(dev, &mut phy)
            },
            // SAFETY: the logic id and one valid out-pointer.
            Addr::V1 { .. } => unsafe {
                self.sym::<FnPhyFromLogic>(b"dcmi_get_device_phyid_from_logicid\0")?(
                    logic as c_uint,
                    &mut phy,
                )
            },
        };
        Ok((rc, phy))
    }

    /// A v1 chip's PCIe identity (bus id).
    pub(super) fn pcie(&self, card: c_int, chip: c_int) -> Answer<PcieInfoAll> {
        let f = self.sym::<FnPcie>(b"dcmi_get_device_pcie_info_v2\0")?;
        let mut p = PcieInfoAll::default();
        // SAFETY: `p` is a zeroed struct of the header's 64-byte layout.
        let rc = unsafe { f(card, chip, &mut p) };
        Ok((rc, p))
    }

    /// A v1 chip's type and name.
    pub(super) fn chip_info(&self, card: c_int, chip: c_int) -> Answer<ChipInfo> {
        let f = self.sym::<FnChip>(b"dcmi_get_device_chip_info\0")?;
        let mut c = ChipInfo::default();
        // SAFETY: `c` has the header's 100-byte layout.
        let rc = unsafe { f(card, chip, &mut c) };
        Ok((rc, c))
    }
}
