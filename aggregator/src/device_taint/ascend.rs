//! Ascend clusters with Huawei's device plugin, pure: the NPUs the
//! plugin has already separated by hand, which faultline never isolates a second time.
//!
//! Huawei's Ascend device plugin (Ascend/mind-cluster, component/ascend-device-plugin)
//! keeps, per node, the ConfigMap `kube-system/mindx-dl-deviceinfo-<node>`
//! (pkg/common/constants.go `DeviceInfoCMNamePrefix`; ascend-common/api/consts.go
//! `KubeNS`). Its key `ManuallySeparateNPU` (`DeviceInfoCMManuallySeparateNPUKey`)
//! lists the chips a fault-frequency rule separated for good, as device names joined by
//! commas without spaces, the number the **physical** id: `Ascend910-0,Ascend910-3`
//! (pkg/device/ascendcommon.go `convertLogicIDsToDeviceNames`, `"%s-%d"` of the run
//! mode and the physical id). The plugin reports such a chip Unhealthy to the kubelet
//! (ascendcommon.go `isHealthy`), so it already leaves the node's allocatable; only an
//! operator deleting its name releases it.
//!
//! The plugin reads the list back in pkg/kubeclient/client_server.go
//! `GetManuallySeparateNPUFromDeviceInfo`, and so does this, step by step: the value
//! split at `,` (empty: none); a name kept only when `CheckDeviceName`
//! (pkg/common/common.go) accepts it for the node's run mode, i.e. it matches
//! `^<run mode>-\d+` (run mode `Ascend910`, `Ascend310` or `Ascend310P`; on Atlas 950,
//! whose resource is `huawei.com/npu`, `^npu-\d+` as well); the id its second
//! `-`-separated field, and the first one that is no integer ends the reading (the
//! plugin returns what it has); the integer is taken as Go converts it to the plugin's
//! `PhyId` (int32). The run mode is the node's extended resource without
//! `huawei.com/` (pkg/common/device.go); a resource of another name separates nothing.
//!
//! faultline names a chip `npu<physical id>` (docs/ascend.md), the same number.

use std::collections::BTreeSet;

/// The device plugin's per-node ConfigMap: this prefix and the node's name.
pub const DEVICE_INFO_PREFIX: &str = "mindx-dl-deviceinfo-";
/// Its namespace.
pub const DEVICE_INFO_NAMESPACE: &str = "kube-system";
/// The key listing the chips separated by hand.
pub const MANUALLY_SEPARATE_KEY: &str = "ManuallySeparateNPU";
/// The extended resources of Huawei's device plugin start so
/// (ascend-common/api/default_name.go `ResourceNamePrefix`).
pub const RESOURCE_PREFIX: &str = "huawei.com/";

/// The device-name prefixes `CheckDeviceName` accepts on a node whose accelerator is
/// `resource`; none for a resource that is not the plugin's.
pub fn name_prefixes(resource: &str) -> &'static [&'static str] {
    match resource.strip_prefix(RESOURCE_PREFIX) {
        Some("Ascend910") => &["Ascend910"],
        Some("Ascend310") => &["Ascend310"],
        Some("Ascend310P") => &["Ascend310P"],
        // Atlas 950 (Ascend910A5): run mode Ascend910, and `npu-<id>` accepted too.
        Some("npu") => &["Ascend910", "npu"],
        _ => &[],
    }
}

/// The physical ids in a `ManuallySeparateNPU` value on a node whose accelerator is
/// `resource`, as the plugin reads them (module doc).
pub fn manually_separated(value: &str, resource: &str) -> BTreeSet<u32> {
    let prefixes = name_prefixes(resource);
    let mut ids = BTreeSet::new();
    if value.is_empty() {
        return ids;
    }
    for name in value.split(',') {
        // `^<prefix>-\d+`: the prefix, a dash and at least one digit; anything after.
        let accepted = prefixes.iter().any(|p| {
            name.strip_prefix(p)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        });
        if !accepted {
            continue;
        }
        // `strings.Split(name, "-")[1]` through `strconv.Atoi`: a failure ends it.
        let Some(Ok(id)) = name.split('-').nth(1).map(str::parse::<i64>) else {
            break;
        };
        // `common.PhyId(phyID)`: Go's int to int32 (pkg/common/upgradefault.go `type
        // PhyId int32`), which keeps the low 32 bits; a negative one is no chip.
        if let Ok(id) = u32::try_from(id as i32) {
            ids.insert(id);
        }
    }
    ids
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
/// no isolation of its own (no taint, no rule), and says so. Each chip is (its id, the
/// physical id its agent learned): only a chip named `npu<p>` whose agent learned that
/// `p` is its physical id is matched (npu-smi names a chip by its card until it learns
/// the id, and a card's number is not the plugin's); a device that is no such chip, or
/// one not listed, is not covered.
pub fn separated_already(chips: &[(&str, Option<u32>)], separated: &BTreeSet<u32>) -> bool {
    !chips.is_empty()
        && chips.iter().all(|(id, phy)| {
            chip_physical_id(id).is_some_and(|p| *phy == Some(p) && separated.contains(&p))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugins_list_is_read_as_the_plugin_reads_it() {
        const A910: &str = "huawei.com/Ascend910";
        let read = |v: &str| manually_separated(v, A910);
        assert_eq!(read("Ascend910-0,Ascend910-3"), BTreeSet::from([0, 3]));
        assert!(read("").is_empty());
        // The run mode's name only: another chip's name is refused.
        assert!(read("Ascend310P-12,Ascend310-1,npu-7").is_empty());
        assert_eq!(
            manually_separated("Ascend310P-12,Ascend310-1", "huawei.com/Ascend310P"),
            BTreeSet::from([12])
        );
        assert_eq!(
            manually_separated("Ascend310-1,Ascend310P-2", "huawei.com/Ascend310"),
            BTreeSet::from([1])
        );
        // Atlas 950: both names.
        assert_eq!(
            manually_separated("npu-7,Ascend910-2", "huawei.com/npu"),
            BTreeSet::from([2, 7])
        );
        // A resource that is not the plugin's separates nothing.
        assert!(manually_separated("Ascend910-1", "nvidia.com/gpu").is_empty());
        assert!(manually_separated("Ascend910-1", "huawei.com/Ascend910B").is_empty());
        // Names the check refuses are skipped (no dash, no digit after it, a space).
        assert_eq!(
            read(
                "Ascend910-1, Ascend910-2,Ascend910-x,-4,910-5,Ascend910-,Ascend910+6,Ascend910-7"
            ),
            BTreeSet::from([1, 7])
        );
        // The regexp is not anchored at its end: the second field is the id.
        assert_eq!(read("Ascend910-3-extra"), BTreeSet::from([3]));
        // A name the check accepts whose id is no integer ends the reading.
        assert_eq!(
            read("Ascend910-1,Ascend910-2c-100-3,Ascend910-4"),
            BTreeSet::from([1])
        );
        assert_eq!(
            read("Ascend910-99999999999999999999,Ascend910-4"),
            BTreeSet::new()
        );
        // An integer that fits Go's int goes through its int32 as Go converts it: the
        // low 32 bits (2^32 + 3 is chip 3), a negative one no chip; the reading goes on.
        assert_eq!(
            read("Ascend910-4294967299,Ascend910-2147483648,Ascend910-4"),
            BTreeSet::from([3, 4])
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
        let sep = manually_separated("Ascend910-3,Ascend910-5", "huawei.com/Ascend910");
        let (three, five, four) = (("npu3", Some(3)), ("npu5", Some(5)), ("npu4", Some(4)));
        assert!(separated_already(&[three], &sep));
        assert!(separated_already(&[three, five], &sep));
        assert!(!separated_already(&[three, four], &sep));
        assert!(!separated_already(&[], &sep));
        assert!(!separated_already(&[("GPU-a", None)], &sep));
        // The physical id must be known, and be the number the id carries: npu-smi's
        // `npu3` named by card 3 (its physical id not learned) is not chip 3.
        assert!(!separated_already(&[("npu3", None)], &sep));
        assert!(!separated_already(&[("npu3", Some(5))], &sep));
    }
}
