//! Index the devices, pure: what the DRA drivers publish in
//! ResourceSlices, as (driver, pool, device) by the GPU's UUID, and which pods hold a
//! device through their ResourceClaims.
//!
//! A pool is what a driver publishes for one node (NVIDIA's DRA driver: pool = node
//! name, devices `gpu-<minor>` with the attribute `uuid`). It may span several slices,
//! and a driver that republishes bumps the pool's generation; until every slice of the
//! new generation is there, the pool is incomplete and the scheduler itself does not
//! trust it (staging/src/k8s.io/dynamic-resource-allocation/structured/pools.go
//! `GatherPools`: the slices of the highest generation, complete when their number is
//! `resourceSliceCount`). Only devices of complete pools are indexed: a UUID seen only
//! in an incomplete or older generation names no device.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

/// One device as DRA names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceRef {
    pub driver: String,
    pub pool: String,
    pub device: String,
}

impl DeviceRef {
    /// `<driver>/<pool>/<device>`: how the kubelet names a DRA device in
    /// `allocatedResourcesStatus` (KEP-4680), and how a record keeps it.
    pub fn resource_id(&self) -> String {
        format!("{}/{}/{}", self.driver, self.pool, self.device)
    }

    /// The device of a [`DeviceRef::resource_id`] (a pool may hold slashes; a driver
    /// and a device do not).
    pub fn from_resource_id(id: &str) -> Option<DeviceRef> {
        let (driver, rest) = id.split_once('/')?;
        let (pool, device) = rest.rsplit_once('/')?;
        Some(DeviceRef {
            driver: driver.into(),
            pool: pool.into(),
            device: device.into(),
        })
    }
}

/// A taint a slice carries on a device (the driver's own, e.g. `gpu.nvidia.com/xid`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceTaint {
    pub key: String,
    pub value: String,
    pub effect: String,
}

/// A device of a slice, as far as the index needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceDevice {
    pub name: String,
    /// The `uuid` attribute (NVIDIA: `GPU-…`), with or without the driver's domain.
    pub uuid: Option<String>,
    /// The `parentUUID` attribute: the GPU a MIG partition is carved from.
    pub parent: Option<String>,
    pub taints: Vec<SliceTaint>,
}

/// A ResourceSlice, as far as the index needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub name: String,
    pub driver: String,
    pub pool: String,
    pub generation: i64,
    pub slice_count: i64,
    pub node: Option<String>,
    pub devices: Vec<SliceDevice>,
}

fn text(v: &Value, pointer: &str) -> Option<String> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// The string value of attribute `name` of a device, written bare (`uuid`) or with the
/// driver's domain (`gpu.nvidia.com/uuid`): DRA treats the two as one
/// (pkg/apis/resource/types.go `QualifiedName`).
fn attribute(device: &Value, driver: &str, name: &str) -> Option<String> {
    let attrs = device.get("attributes")?.as_object()?;
    attrs
        .get(name)
        .or_else(|| attrs.get(&format!("{driver}/{name}")))
        .and_then(|a| a.get("string"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// The elements of the array at `key` of `v` (none when it is absent).
fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    v.get(key).and_then(Value::as_array).into_iter().flatten()
}

impl SliceTaint {
    fn from_json(t: &Value) -> Option<SliceTaint> {
        Some(SliceTaint {
            key: text(t, "/key")?,
            value: text(t, "/value").unwrap_or_default(),
            effect: text(t, "/effect")?,
        })
    }
}

impl SliceDevice {
    fn from_json(d: &Value, driver: &str) -> Option<SliceDevice> {
        Some(SliceDevice {
            name: text(d, "/name")?,
            uuid: attribute(d, driver, "uuid"),
            parent: attribute(d, driver, "parentUUID"),
            taints: items(d, "taints")
                .filter_map(SliceTaint::from_json)
                .collect(),
        })
    }
}

impl Slice {
    /// A slice from its JSON (any served version: v1 and v1beta2 share these fields);
    /// `None` when a field the index needs is missing.
    pub fn from_json(obj: &Value) -> Option<Slice> {
        let spec = obj.get("spec")?;
        let driver = text(spec, "/driver")?;
        let devices = items(spec, "devices")
            .filter_map(|d| SliceDevice::from_json(d, &driver))
            .collect();
        Some(Slice {
            name: text(obj, "/metadata/name")?,
            pool: text(spec, "/pool/name")?,
            generation: spec.pointer("/pool/generation")?.as_i64()?,
            slice_count: spec.pointer("/pool/resourceSliceCount")?.as_i64()?,
            node: text(spec, "/nodeName"),
            driver,
            devices,
        })
    }
}

/// A device of a complete pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Indexed {
    pub device: DeviceRef,
    /// The pool's node, where the slice names one.
    pub node: Option<String>,
    /// Taints the driver publishes on it.
    pub taints: Vec<SliceTaint>,
}

/// The devices of the allowlisted drivers' complete pools, by UUID.
#[derive(Debug, Default, Clone)]
pub struct DeviceIndex {
    by_uuid: HashMap<String, Indexed>,
    /// MIG partitions by their parent GPU's UUID: (the partition's UUID, the device).
    partitions: HashMap<String, Vec<(String, Indexed)>>,
    /// Pools left out: incomplete at their newest generation.
    incomplete: BTreeSet<(String, String)>,
    /// UUIDs published by two devices: neither is indexed (a guess is no quarantine).
    ambiguous: BTreeSet<String>,
}

impl DeviceIndex {
    /// Index `slices` of the `drivers` allowed.
    pub fn build<'a>(slices: impl IntoIterator<Item = &'a Slice>, drivers: &[String]) -> Self {
        let mut pools: BTreeMap<(&str, &str), Vec<&Slice>> = BTreeMap::new();
        for s in slices {
            if drivers.contains(&s.driver) {
                pools.entry((&s.driver, &s.pool)).or_default().push(s);
            }
        }
        let mut ix = DeviceIndex::default();
        for ((driver, pool), slices) in pools {
            let newest = slices.iter().map(|s| s.generation).max().unwrap_or(0);
            let current: Vec<&&Slice> = slices.iter().filter(|s| s.generation == newest).collect();
            let complete = current
                .iter()
                .all(|s| s.slice_count == current.len() as i64);
            if !complete {
                ix.incomplete.insert((driver.to_string(), pool.to_string()));
                continue;
            }
            for s in current {
                for d in &s.devices {
                    let Some(uuid) = &d.uuid else { continue };
                    let entry = Indexed {
                        device: DeviceRef {
                            driver: driver.to_string(),
                            pool: pool.to_string(),
                            device: d.name.clone(),
                        },
                        node: s.node.clone(),
                        taints: d.taints.clone(),
                    };
                    if ix.ambiguous.contains(uuid) {
                        continue;
                    }
                    if let Some(parent) = &d.parent {
                        ix.partitions
                            .entry(parent.clone())
                            .or_default()
                            .push((uuid.clone(), entry.clone()));
                    }
                    if ix.by_uuid.insert(uuid.clone(), entry).is_some() {
                        ix.by_uuid.remove(uuid);
                        ix.ambiguous.insert(uuid.clone());
                    }
                }
            }
        }
        ix
    }

    /// The device that publishes `uuid`, in a complete pool.
    pub fn by_uuid(&self, uuid: &str) -> Option<&Indexed> {
        self.by_uuid.get(uuid)
    }

    /// The UUID `device` publishes now, if it is indexed: after a GPU was swapped in
    /// its slot, the new one's.
    pub fn uuid_of(&self, device: &DeviceRef) -> Option<&str> {
        self.by_uuid
            .iter()
            .find(|(_, i)| &i.device == device)
            .map(|(uuid, _)| uuid.as_str())
    }

    /// The MIG partitions carved from GPU `uuid` (dynamic MIG publishes them beside
    /// the whole GPU): each its own device, allocatable, and failed with its GPU.
    pub fn partitions_of(&self, uuid: &str) -> &[(String, Indexed)] {
        self.partitions.get(uuid).map_or(&[], Vec::as_slice)
    }

    /// How many devices are indexed.
    pub fn len(&self) -> usize {
        self.by_uuid.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.by_uuid.is_empty()
    }

    /// The pools left out as incomplete: (driver, pool).
    pub fn incomplete(&self) -> impl Iterator<Item = &(String, String)> {
        self.incomplete.iter()
    }

    /// UUIDs two devices publish: left out.
    pub fn ambiguous(&self) -> impl Iterator<Item = &String> {
        self.ambiguous.iter()
    }
}

/// A pod that holds a device through a claim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    pub uid: String,
    pub claim: String,
}

impl Holder {
    /// Whether the pod `namespace/name` with `uid` is this holder. A claim's
    /// `reservedFor` names pods of the claim's own namespace, by name and uid, as the
    /// device-taint eviction controller resolves it (the pod looked up in the claim's
    /// namespace by name, then its uid compared): a pod of another namespace that
    /// carries the uid holds nothing through this claim.
    pub fn is(&self, namespace: &str, name: &str, uid: &str) -> bool {
        self.namespace == namespace && self.pod == name && self.uid == uid
    }

    /// [`Holder::is`] of `pod`.
    pub fn is_pod(&self, pod: &k8s_openapi::api::core::v1::Pod) -> bool {
        let m = &pod.metadata;
        self.is(
            m.namespace.as_deref().unwrap_or_default(),
            m.name.as_deref().unwrap_or_default(),
            m.uid.as_deref().unwrap_or_default(),
        )
    }
}

/// The pods that hold `device`: each claim allocated to it
/// (`status.allocation.devices.results[]`, matched on driver, pool and device) and
/// reserved for pods (`status.reservedFor[]` with resource `pods`; a claim reserved for
/// something else holds no pod). The device-taint eviction controller reads the same
/// two fields (pkg/controller/devicetainteviction/device_taint_eviction.go).
pub fn holders(claims: &[Value], device: &DeviceRef) -> Vec<Holder> {
    let mut out = Vec::new();
    for c in claims {
        let allocated = c
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array)
            .is_some_and(|rs| {
                rs.iter().any(|r| {
                    text(r, "/driver").as_deref() == Some(device.driver.as_str())
                        && text(r, "/pool").as_deref() == Some(device.pool.as_str())
                        && text(r, "/device").as_deref() == Some(device.device.as_str())
                })
            });
        if !allocated {
            continue;
        }
        let namespace = text(c, "/metadata/namespace").unwrap_or_default();
        let claim = text(c, "/metadata/name").unwrap_or_default();
        for r in c
            .pointer("/status/reservedFor")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let is_pod = text(r, "/resource").as_deref() == Some("pods")
                && text(r, "/apiGroup").unwrap_or_default().is_empty();
            if let (true, Some(pod), Some(uid)) = (is_pod, text(r, "/name"), text(r, "/uid")) {
                out.push(Holder {
                    namespace: namespace.clone(),
                    pod,
                    uid,
                    claim: claim.clone(),
                });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Whether `claim`'s allocation of `device` tolerates a `NoExecute` taint `key=value`
/// for ever: a toleration of that result whose effect is `NoExecute` (an empty effect
/// does not count here), with no `tolerationSeconds`, that matches the taint as
/// `resourceclaim.ToleratesTaint` does (an empty key matches any key; `Exists` any
/// value, `Equal` or empty the same value). device_taint_eviction.go
/// `claimEvictionTime` ignores such a taint for the claim.
pub fn tolerates_forever(claim: &Value, device: &DeviceRef, key: &str, value: &str) -> bool {
    claim
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| {
            text(r, "/driver").as_deref() == Some(device.driver.as_str())
                && text(r, "/pool").as_deref() == Some(device.pool.as_str())
                && text(r, "/device").as_deref() == Some(device.device.as_str())
        })
        .flat_map(|r| {
            r.get("tolerations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
        .any(|t| {
            let field = |f: &str| t.get(f).and_then(Value::as_str).unwrap_or("");
            field("effect") == "NoExecute"
                && t.get("tolerationSeconds").is_none_or(Value::is_null)
                && (field("key").is_empty() || field("key") == key)
                && match field("operator") {
                    "" | "Equal" => field("value") == value,
                    "Exists" => true,
                    _ => false,
                }
        })
}

/// The holders of `device` that the device-taint eviction controller would count for a
/// `NoExecute` taint `key=value`, as it counts "pods would be evicted" for a rule at
/// effect `None`: [`holders`], less pods that are not scheduled or are terminating
/// (`running(uid)` is false: device_taint_eviction.go `countPendingPods` skips a
/// `deletionTimestamp`, `podEvictionTime` an empty `nodeName`) and claims that
/// tolerate the taint for ever ([`tolerates_forever`]).
pub fn would_be_evicted(
    claims: &[Value],
    device: &DeviceRef,
    (key, value): (&str, &str),
    running: impl Fn(&Holder) -> bool,
) -> Vec<Holder> {
    let tolerating: Vec<(String, String)> = claims
        .iter()
        .filter(|c| tolerates_forever(c, device, key, value))
        .map(|c| {
            (
                text(c, "/metadata/namespace").unwrap_or_default(),
                text(c, "/metadata/name").unwrap_or_default(),
            )
        })
        .collect();
    holders(claims, device)
        .into_iter()
        .filter(|h| running(h))
        .filter(|h| {
            !tolerating
                .iter()
                .any(|(ns, c)| *ns == h.namespace && *c == h.claim)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(name: &str, pool: &str, generation: i64, count: i64, gpus: &[(&str, &str)]) -> Slice {
        Slice::from_json(&json!({"metadata": {"name": name},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": pool,
                "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
                "devices": gpus.iter().map(|(d, u)| json!({"name": d, "attributes": {"uuid": {"string": u}}})).collect::<Vec<_>>()}}))
        .unwrap()
    }

    fn nvidia() -> Vec<String> {
        vec!["gpu.nvidia.com".into()]
    }

    #[test]
    fn a_complete_pool_is_indexed_by_uuid() {
        let s = [slice(
            "n1-a",
            "n1",
            1,
            1,
            &[("gpu-0", "GPU-a"), ("gpu-1", "GPU-b")],
        )];
        let ix = DeviceIndex::build(&s, &nvidia());
        assert_eq!(ix.len(), 2);
        assert!(!ix.is_empty());
        let d = ix.by_uuid("GPU-b").unwrap();
        assert_eq!(
            d.device,
            DeviceRef {
                driver: "gpu.nvidia.com".into(),
                pool: "n1".into(),
                device: "gpu-1".into()
            }
        );
        assert_eq!(d.node.as_deref(), Some("n1"));
        assert!(ix.by_uuid("GPU-c").is_none());
    }

    #[test]
    fn only_the_newest_generation_of_a_complete_pool_counts() {
        // Generation 2 of two slices, one published so far: the pool is incomplete,
        // and generation 1 is stale: nothing is indexed.
        let s = [
            slice("n1-old", "n1", 1, 1, &[("gpu-0", "GPU-a")]),
            slice("n1-new-a", "n1", 2, 2, &[("gpu-0", "GPU-a")]),
        ];
        let ix = DeviceIndex::build(&s, &nvidia());
        assert!(ix.is_empty());
        assert_eq!(ix.incomplete().count(), 1);
        // The second slice arrives: complete, the new generation's devices only.
        let s = [
            slice("n1-old", "n1", 1, 1, &[("gpu-9", "GPU-z")]),
            slice("n1-new-a", "n1", 2, 2, &[("gpu-0", "GPU-a")]),
            slice("n1-new-b", "n1", 2, 2, &[("gpu-1", "GPU-b")]),
        ];
        let ix = DeviceIndex::build(&s, &nvidia());
        assert_eq!(ix.len(), 2);
        assert!(ix.by_uuid("GPU-z").is_none());
        assert_eq!(ix.by_uuid("GPU-b").unwrap().device.device, "gpu-1");
    }

    #[test]
    fn a_gpus_mig_partitions_are_found_by_its_uuid() {
        let s = Slice::from_json(&json!({"metadata": {"name": "s"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "n1",
                "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-a"}}},
                    {"name": "gpu-0-mig-0", "attributes": {"uuid": {"string": "MIG-a0"},
                        "gpu.nvidia.com/parentUUID": {"string": "GPU-a"}}},
                    {"name": "gpu-0-mig-1", "attributes": {"uuid": {"string": "MIG-a1"},
                        "parentUUID": {"string": "GPU-a"}}},
                    {"name": "gpu-1", "attributes": {"uuid": {"string": "GPU-b"}}}]}}))
        .unwrap();
        let ix = DeviceIndex::build([&s], &["gpu.nvidia.com".to_string()]);
        let parts: Vec<(&str, &str)> = ix
            .partitions_of("GPU-a")
            .iter()
            .map(|(u, d)| (u.as_str(), d.device.device.as_str()))
            .collect();
        assert_eq!(
            parts,
            [("MIG-a0", "gpu-0-mig-0"), ("MIG-a1", "gpu-0-mig-1")]
        );
        assert!(ix.partitions_of("GPU-b").is_empty());
        assert_eq!(ix.by_uuid("MIG-a1").unwrap().device.device, "gpu-0-mig-1");
    }

    #[test]
    fn other_drivers_and_ambiguous_uuids_are_left_out() {
        let mut other = slice("x", "n1", 1, 1, &[("gpu-0", "GPU-a")]);
        other.driver = "example.com".into();
        let s = [
            other,
            slice("n2", "n2", 1, 1, &[("gpu-0", "GPU-dup")]),
            slice(
                "n3",
                "n3",
                1,
                1,
                &[("gpu-0", "GPU-dup"), ("gpu-1", "GPU-ok")],
            ),
        ];
        let ix = DeviceIndex::build(&s, &nvidia());
        assert!(ix.by_uuid("GPU-a").is_none());
        assert!(ix.by_uuid("GPU-dup").is_none());
        assert_eq!(ix.ambiguous().collect::<Vec<_>>(), ["GPU-dup"]);
        assert!(ix.by_uuid("GPU-ok").is_some());
    }

    #[test]
    fn the_attribute_may_carry_the_driver_domain() {
        let s = Slice::from_json(&json!({"metadata": {"name": "s"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "n1", "pool": {"name": "n1", "generation": 0, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0", "attributes": {"gpu.nvidia.com/uuid": {"string": "GPU-q"}},
                             "taints": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]}]}}))
        .unwrap();
        let ix = DeviceIndex::build([&s], &nvidia());
        let d = ix.by_uuid("GPU-q").unwrap();
        assert_eq!(
            d.taints,
            [SliceTaint {
                key: "gpu.nvidia.com/xid".into(),
                value: "79".into(),
                effect: "NoSchedule".into()
            }]
        );
    }

    /// A holder is the pod of its claim's namespace with that name and uid, and no
    /// other: not another namespace's pod with the uid, not a pod recreated under the
    /// name (a new uid).
    #[test]
    fn a_holder_is_one_pod_of_its_claim_s_namespace() {
        let h = Holder {
            namespace: "tenant".into(),
            pod: "w-0".into(),
            uid: "u-1".into(),
            claim: "gpu".into(),
        };
        assert!(h.is("tenant", "w-0", "u-1"));
        for (ns, name, uid) in [
            ("train", "w-0", "u-1"),
            ("tenant", "w-1", "u-1"),
            ("tenant", "w-0", "u-2"),
        ] {
            assert!(!h.is(ns, name, uid), "{ns}/{name} {uid}");
        }
        let pod = |ns: &str, name: &str, uid: &str| -> k8s_openapi::api::core::v1::Pod {
            serde_json::from_value(json!({"metadata": {"namespace": ns, "name": name, "uid": uid}}))
                .unwrap()
        };
        assert!(h.is_pod(&pod("tenant", "w-0", "u-1")));
        assert!(!h.is_pod(&pod("train", "w-0", "u-1")));
        assert!(!h.is_pod(&pod("tenant", "w-0", "u-2")));
        assert!(!h.is_pod(&pod("tenant", "w-1", "u-1")));
    }

    #[test]
    fn holders_are_the_pods_a_claim_on_the_device_is_reserved_for() {
        let dev = DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: "gpu-3".into(),
        };
        let claim = |name: &str, device: &str, reserved: Value| {
            json!({"metadata": {"namespace": "train", "name": name},
                "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": device}]}},
                           "reservedFor": reserved}})
        };
        let claims = [
            claim(
                "c1",
                "gpu-3",
                json!([{"resource": "pods", "name": "p1", "uid": "u1"}]),
            ),
            claim(
                "c2",
                "gpu-4",
                json!([{"resource": "pods", "name": "p2", "uid": "u2"}]),
            ),
            // Reserved for something that is not a pod: no pod holds it through this.
            claim(
                "c3",
                "gpu-3",
                json!([{"apiGroup": "batch", "resource": "jobs", "name": "j", "uid": "u3"}]),
            ),
            // Allocated, not yet reserved: no pod yet.
            claim("c4", "gpu-3", json!([])),
            // A "pods" of another API group is no Pod.
            claim(
                "c5",
                "gpu-3",
                json!([{"apiGroup": "example.com", "resource": "pods", "name": "x", "uid": "u5"}]),
            ),
        ];
        let h = holders(&claims, &dev);
        assert_eq!(
            h,
            [Holder {
                namespace: "train".into(),
                pod: "p1".into(),
                uid: "u1".into(),
                claim: "c1".into()
            }]
        );
    }

    fn claim_on(name: &str, pods: &[(&str, &str)], tolerations: Value) -> Value {
        json!({"metadata": {"namespace": "ml", "name": name},
        "status": {
            "allocation": {"devices": {"results": [
                {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-1", "request": "gpu",
                 "tolerations": tolerations},
                {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-2", "request": "gpu"},
            ]}},
            "reservedFor": pods.iter().map(|(p, u)| json!({"resource": "pods", "name": p, "uid": u})).collect::<Vec<_>>(),
        }})
    }

    fn gpu(device: &str) -> DeviceRef {
        DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: device.into(),
        }
    }

    #[test]
    fn a_resource_id_reads_back_a_pool_with_slashes() {
        let r = DeviceRef::from_resource_id("gpu.nvidia.com/rack-7/n1/gpu-3").unwrap();
        assert_eq!(r.pool, "rack-7/n1");
        assert_eq!(r.resource_id(), "gpu.nvidia.com/rack-7/n1/gpu-3");
        assert!(DeviceRef::from_resource_id("gpu-3").is_none());
        assert!(DeviceRef::from_resource_id("gpu.nvidia.com/gpu-3").is_none());
    }

    /// Each toleration that the controller honours, and each it does not.
    #[test]
    fn a_toleration_counts_only_as_the_controller_honours_it() {
        let key = "faultline.io/unhealthy";
        let t = |v: Value| {
            tolerates_forever(
                &claim_on("c", &[], json!([v])),
                &gpu("gpu-1"),
                key,
                "xid-79",
            )
        };
        assert!(t(
            json!({"key": key, "operator": "Exists", "effect": "NoExecute"})
        ));
        assert!(
            t(json!({"operator": "Exists", "effect": "NoExecute"})),
            "an empty key matches any"
        );
        assert!(
            t(json!({"key": key, "value": "xid-79", "effect": "NoExecute"})),
            "Equal by default"
        );
        assert!(t(
            json!({"key": key, "operator": "Equal", "value": "xid-79", "effect": "NoExecute"})
        ));
        assert!(!t(
            json!({"key": key, "operator": "Equal", "value": "other", "effect": "NoExecute"})
        ));
        assert!(
            !t(json!({"key": key, "operator": "Exists"})),
            "no effect: not honoured"
        );
        assert!(!t(
            json!({"key": key, "operator": "Exists", "effect": "NoSchedule"})
        ));
        assert!(!t(
            json!({"key": "other", "operator": "Exists", "effect": "NoExecute"})
        ));
        assert!(
            !t(
                json!({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60})
            ),
            "only for a while"
        );
        assert!(!t(
            json!({"key": key, "operator": "Later", "effect": "NoExecute"})
        ));
        // Another device's toleration is not this one's.
        let c = claim_on(
            "c",
            &[],
            json!([{"operator": "Exists", "effect": "NoExecute"}]),
        );
        assert!(!tolerates_forever(&c, &gpu("gpu-2"), key, "xid-79"));
    }

    #[test]
    fn only_running_pods_of_claims_that_do_not_tolerate_would_be_evicted() {
        let key = ("faultline.io/unhealthy", "xid-79");
        let claims = vec![
            claim_on("a", &[("pa", "ua"), ("pt", "ut")], json!([])),
            claim_on(
                "b",
                &[("pb", "ub")],
                json!([{"operator": "Exists", "effect": "NoExecute"}]),
            ),
        ];
        let all = would_be_evicted(&claims, &gpu("gpu-1"), key, |_| true);
        assert_eq!(
            all.iter().map(|h| h.pod.as_str()).collect::<Vec<_>>(),
            ["pa", "pt"]
        );
        let running = would_be_evicted(&claims, &gpu("gpu-1"), key, |h| h.uid != "ut");
        assert_eq!(
            running.iter().map(|h| h.pod.as_str()).collect::<Vec<_>>(),
            ["pa"]
        );
        // On gpu-2 the toleration of gpu-1's result does not apply.
        assert_eq!(
            would_be_evicted(&claims, &gpu("gpu-2"), key, |_| true).len(),
            3
        );
    }
}
