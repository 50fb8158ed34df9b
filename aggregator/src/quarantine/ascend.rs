//! Ascend clusters with Huawei's device plugin (issue 28, point 6), pure: the NPUs the
//! plugin has already separated by hand, which faultline never isolates a second time.
//!
//! Huawei's Ascend device plugin (Ascend/mind-cluster, component/ascend-device-plugin)
//! keeps, per node, the ConfigMap `kube-system/mindx-dl-deviceinfo-<node>`
//! (pkg/common/constants.go `DeviceInfoCMNamePrefix`; ascend-common/api/consts.go
//! `KubeNS`). Its key `ManuallySeparateNPU` (`DeviceInfoCMManuallySeparateNPUKey`)
//! lists the chips a fault-frequency rule separated for good, as device names joined by
//! commas without spaces, the number the **physical** id: `Ascend910-0,Ascend910-3`
//! (pkg/device/ascendcommon.go `convertLogicIDsToDeviceNames`, `"%s-%d"` of the run
//! mode and the physical id; `Ascend910`, `Ascend310`, `Ascend310P`, or a custom public
//! name such as `npu` on Atlas 950). The plugin reports such a chip Unhealthy to the
//! kubelet (ascendcommon.go `isHealthy`), so it already leaves the node's allocatable;
//! only an operator deleting its name releases it. The plugin reads names back with
//! `strings.Split(…, ",")` and skips those `CheckDeviceName` refuses; so does this.
//!
//! faultline names a chip `npu<physical id>` (docs/ascend.md), the same number.

use std::collections::BTreeSet;

use super::scope::Failed;

/// The device plugin's per-node ConfigMap: this prefix and the node's name.
pub const DEVICE_INFO_PREFIX: &str = "mindx-dl-deviceinfo-";
/// Its namespace.
pub const DEVICE_INFO_NAMESPACE: &str = "kube-system";
/// The key listing the chips separated by hand.
pub const MANUALLY_SEPARATE_KEY: &str = "ManuallySeparateNPU";

/// The physical ids in a `ManuallySeparateNPU` value; a name that is not
/// `<letters and digits>-<digits>` is skipped, as the plugin skips it.
pub fn manually_separated(value: &str) -> BTreeSet<u32> {
    value
        .split(',')
        .filter_map(|name| {
            let (prefix, id) = name.rsplit_once('-')?;
            let prefix_ok = prefix.starts_with(|c: char| c.is_ascii_alphabetic())
                && prefix.chars().all(|c| c.is_ascii_alphanumeric());
            let id_ok = !id.is_empty() && id.chars().all(|c| c.is_ascii_digit());
            (prefix_ok && id_ok).then(|| id.parse().ok()).flatten()
        })
        .collect()
}

/// The physical id of faultline's chip id `npu<physical id>`.
pub fn chip_physical_id(id: &str) -> Option<u32> {
    let n = id.strip_prefix("npu")?;
    if n.is_empty() || !n.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// Whether every failed chip is already separated by the plugin: then faultline adds
/// no isolation of its own (no taint, no rule), and says so. A failed device that is no
/// Ascend chip, or one not listed, is not covered.
pub fn separated_already(failed: &[Failed<'_>], separated: &BTreeSet<u32>) -> bool {
    !failed.is_empty()
        && failed
            .iter()
            .all(|f| chip_physical_id(f.id).is_some_and(|p| separated.contains(&p)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugins_list_is_read_as_the_plugin_reads_it() {
        assert_eq!(
            manually_separated("Ascend910-0,Ascend910-3"),
            BTreeSet::from([0, 3])
        );
        assert_eq!(manually_separated("Ascend310P-12"), BTreeSet::from([12]));
        assert_eq!(manually_separated("npu-7"), BTreeSet::from([7]));
        assert!(manually_separated("").is_empty());
        // A prefix of letters and digits only.
        assert!(manually_separated("Ascend_910-8,Asc.end910-9").is_empty());
        // An id of digits only: no sign.
        assert!(manually_separated("Ascend910-+5").is_empty());
        // What the plugin's own check refuses is skipped, the rest kept.
        assert_eq!(
            manually_separated(
                "Ascend910-1, Ascend910-2,Ascend910-x,-4,910-5,Ascend910-,Ascend910-6"
            ),
            BTreeSet::from([1, 6])
        );
    }

    #[test]
    fn chips_are_matched_by_physical_id() {
        assert_eq!(chip_physical_id("npu3"), Some(3));
        assert_eq!(chip_physical_id("npu"), None);
        assert_eq!(chip_physical_id("npu3a"), None);
        // Digits only: a sign the integer parser would take is no id.
        assert_eq!(chip_physical_id("npu+3"), None);
        assert_eq!(chip_physical_id("GPU-3"), None);
        let sep = manually_separated("Ascend910-3,Ascend910-5");
        let r = vec!["ascend-separate-npu".to_string()];
        let three = Failed {
            id: "npu3",
            reasons: &r,
        };
        let five = Failed {
            id: "npu5",
            reasons: &r,
        };
        let four = Failed {
            id: "npu4",
            reasons: &r,
        };
        assert!(separated_already(&[three], &sep));
        assert!(separated_already(&[three, five], &sep));
        assert!(!separated_already(&[three, four], &sep));
        assert!(!separated_already(&[], &sep));
        assert!(!separated_already(
            &[Failed {
                id: "GPU-a",
                reasons: &r
            }],
            &sep
        ));
    }
}
