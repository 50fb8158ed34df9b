//! Objects of a real cluster's shape and size, for benchmarks that must pay what a
//! real API server pays to store, list and watch them.
//!
//! [`realistic_node`] is a Node as an 8-GPU H100 node of a GPU Operator cluster reports
//! itself (about 26 KB of JSON, where a bare test Node is a few hundred bytes): the
//! kubelet's labels, Node Feature Discovery's `feature.node.kubernetes.io/*` labels
//! and annotations, GPU Feature Discovery's and the operator's `nvidia.com/*` labels
//! (`nvidia.com/gpu.present=true`, `gpu.count=8`, `gpu.product`, CUDA versions,
//! `gpu.deploy.*`), one `managedFields` entry per writer (kubelet, its status,
//! kube-controller-manager, nfd-master, gpu-feature-discovery, gpu-operator) with its
//! `fieldsV1`, `capacity` and `allocatable` with `nvidia.com/gpu: 8`, the kubelet's
//! four conditions, `nodeInfo`, `runtimeHandlers`, and 50 container images with
//! digests and sizes (the kubelet reports at most 50, `--node-status-max-images`,
//! pkg/kubelet/nodestatus/setters.go `Images`). Values are made up but well formed:
//! every label passes the API's validation, and the object decodes as a
//! `k8s-openapi` Node.

use serde_json::{json, Map, Value};

use crate::node_labels::{CPUID, GFD, IMAGES, NFD, OPERATOR};

/// 64 hex digits derived from `seed` (FNV-1a, four lanes): a stable fake digest.
fn digest(seed: &str) -> String {
    (0u64..4)
        .map(|lane| {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ lane.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            for b in seed.bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            format!("{h:016x}")
        })
        .collect()
}

fn labels(name: &str) -> Map<String, Value> {
    let mut l = Map::new();
    for (k, v) in [
        ("beta.kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/instance-type", "p5.48xlarge"),
        ("beta.kubernetes.io/os", "linux"),
        ("failure-domain.beta.kubernetes.io/region", "us-east-1"),
        ("failure-domain.beta.kubernetes.io/zone", "us-east-1a"),
        ("kubernetes.io/arch", "amd64"),
        ("kubernetes.io/hostname", name),
        ("kubernetes.io/os", "linux"),
        ("node.kubernetes.io/instance-type", "p5.48xlarge"),
        ("topology.kubernetes.io/region", "us-east-1"),
        ("topology.kubernetes.io/zone", "us-east-1a"),
        ("topology.ebs.csi.aws.com/zone", "us-east-1a"),
        ("vpc.amazonaws.com/efa.present", "true"),
    ] {
        l.insert(k.into(), json!(v));
    }
    for flag in CPUID {
        l.insert(
            format!("feature.node.kubernetes.io/cpu-cpuid.{flag}"),
            json!("true"),
        );
    }
    for (k, v) in NFD {
        l.insert(format!("feature.node.kubernetes.io/{k}"), json!(v));
    }
    for (k, v) in GFD.iter().chain(OPERATOR) {
        l.insert(format!("nvidia.com/{k}"), json!(v));
    }
    l
}

/// `fieldsV1` of the keys of `m` under `field` (`{"f:labels": {".": {}, "f:k": {}}}`).
fn owned(field: &str, keys: impl Iterator<Item = String>) -> Value {
    let mut m = Map::new();
    m.insert(".".into(), json!({}));
    for k in keys {
        m.insert(format!("f:{k}"), json!({}));
    }
    json!({ format!("f:{field}"): m })
}

fn entry(manager: &str, time: &str, sub: Option<&str>, fields: Value) -> Value {
    let mut e = json!({"manager": manager, "operation": "Update", "apiVersion": "v1",
        "time": time, "fieldsType": "FieldsV1", "fieldsV1": fields});
    if let Some(s) = sub {
        e["subresource"] = json!(s);
    }
    e
}

fn managed_fields(labels: &Map<String, Value>, annotations: &Map<String, Value>) -> Value {
    let with = |prefix: &str| {
        labels
            .keys()
            .filter(move |k| k.starts_with(prefix))
            .cloned()
            .collect::<Vec<_>>()
    };
    let gfd: Vec<String> = GFD.iter().map(|(k, _)| format!("nvidia.com/{k}")).collect();
    let operator: Vec<String> = OPERATOR
        .iter()
        .map(|(k, _)| format!("nvidia.com/{k}"))
        .collect();
    let kubelet_labels = labels
        .keys()
        .filter(|k| !k.starts_with("feature.node.") && !k.starts_with("nvidia.com/"))
        .cloned();
    let nfd_annotations = annotations
        .keys()
        .filter(|k| k.starts_with("nfd."))
        .cloned();
    let mut nfd_meta = owned("labels", with("feature.node.kubernetes.io/").into_iter());
    nfd_meta["f:annotations"] = owned("annotations", nfd_annotations)["f:annotations"].clone();
    let condition = |t: &str| {
        (
            format!("k:{{\"type\":\"{t}\"}}"),
            json!({".": {}, "f:lastHeartbeatTime": {}, "f:lastTransitionTime": {}, "f:message": {}, "f:reason": {}, "f:status": {}, "f:type": {}}),
        )
    };
    let conditions: Map<String, Value> = ["DiskPressure", "MemoryPressure", "PIDPressure", "Ready"]
        .iter()
        .map(|t| condition(t))
        .collect();
    let resources = json!({"f:cpu": {}, "f:ephemeral-storage": {}, "f:hugepages-1Gi": {}, "f:hugepages-2Mi": {}, "f:memory": {}, "f:nvidia.com/gpu": {}, "f:pods": {}, "f:vpc.amazonaws.com/efa": {}});
    json!([
        entry(
            "kubelet",
            "2024-12-01T09:12:44Z",
            None,
            json!({
            "f:metadata": {
                "f:annotations": {".": {}, "f:alpha.kubernetes.io/provided-node-ip": {}, "f:volumes.kubernetes.io/controller-managed-attach-detach": {}},
                "f:labels": owned("labels", kubelet_labels)["f:labels"].clone()},
            "f:spec": {"f:providerID": {}}})
        ),
        entry(
            "kube-controller-manager",
            "2024-12-01T09:12:52Z",
            None,
            json!({
            "f:metadata": {"f:annotations": {"f:node.alpha.kubernetes.io/ttl": {}}},
            "f:spec": {"f:podCIDR": {}, "f:podCIDRs": {".": {}, "v:\"10.244.12.0/24\"": {}}}})
        ),
        entry(
            "nfd-master",
            "2024-12-01T09:14:03Z",
            None,
            json!({"f:metadata": nfd_meta})
        ),
        entry(
            "gpu-feature-discovery",
            "2024-12-01T09:16:31Z",
            None,
            json!({"f:metadata": owned("labels", gfd.into_iter())})
        ),
        entry(
            "gpu-operator",
            "2024-12-01T09:15:10Z",
            None,
            json!({"f:metadata": owned("labels", operator.into_iter())})
        ),
        entry(
            "kubelet",
            "2024-12-01T11:40:12Z",
            Some("status"),
            json!({"f:status": {
            "f:allocatable": resources, "f:capacity": resources,
            "f:conditions": conditions,
            "f:features": {".": {}, "f:supplementalGroupsPolicy": {}},
            "f:images": {}, "f:nodeInfo": {"f:bootID": {}, "f:containerRuntimeVersion": {}, "f:kernelVersion": {}, "f:kubeProxyVersion": {}, "f:kubeletVersion": {}},
            "f:runtimeHandlers": {}}})
        ),
    ])
}

/// A Node named `name` whose InternalIP is `ip`, the shape and size (about 26 KB of
/// JSON) of a real 8-GPU H100 node (see the module comment). Create it with
/// [`crate::ApiServer::create`] or POST it; each name gets its own IDs.
pub fn realistic_node(name: &str, ip: &str) -> Value {
    let labels = labels(name);
    let id = digest(name);
    let feature_labels: Vec<&str> = labels
        .keys()
        .filter_map(|k| k.strip_prefix("feature.node.kubernetes.io/"))
        .collect();
    let mut annotations = Map::new();
    for (k, v) in [
        ("alpha.kubernetes.io/provided-node-ip", ip.to_string()),
        (
            "csi.volume.kubernetes.io/nodeid",
            format!("{{\"ebs.csi.aws.com\":\"i-{}\"}}", &id[..17]),
        ),
        (
            "nfd.node.kubernetes.io/feature-labels",
            feature_labels.join(","),
        ),
        ("nfd.node.kubernetes.io/extended-resources", String::new()),
        ("nfd.node.kubernetes.io/worker.version", "v0.16.3".into()),
        ("node.alpha.kubernetes.io/ttl", "0".into()),
        (
            "volumes.kubernetes.io/controller-managed-attach-detach",
            "true".into(),
        ),
    ] {
        annotations.insert(k.into(), json!(v));
    }
    let images: Vec<Value> = IMAGES
        .iter()
        .map(|(repo, tag, size)| {
            json!({"names": [format!("{repo}@sha256:{}", digest(&format!("{repo}:{tag}"))), format!("{repo}:{tag}")], "sizeBytes": size})
        })
        .collect();
    let resources = |cpu: &str, memory: &str, storage: &str| {
        json!({"cpu": cpu, "ephemeral-storage": storage, "hugepages-1Gi": "0", "hugepages-2Mi": "21000Mi",
            "memory": memory, "nvidia.com/gpu": "8", "pods": "100", "vpc.amazonaws.com/efa": "32"})
    };
    let condition = |t: &str, status: &str, reason: &str, message: &str| {
        json!({"type": t, "status": status, "lastHeartbeatTime": "2024-12-01T11:40:12Z",
            "lastTransitionTime": "2024-12-01T09:13:20Z", "reason": reason, "message": message})
    };
    let handler = |n: &str| json!({"name": n, "features": {"recursiveReadOnlyMounts": true, "userNamespaces": true}});
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": annotations,
            "managedFields": managed_fields(&labels, &annotations),
        },
        "spec": {
            "podCIDR": "10.244.12.0/24",
            "podCIDRs": ["10.244.12.0/24"],
            "providerID": format!("aws:///us-east-1a/i-{}", &id[..17]),
        },
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": ip},
                {"type": "InternalDNS", "address": format!("ip-{}.ec2.internal", ip.replace('.', "-"))},
                {"type": "Hostname", "address": name},
            ],
            "allocatable": resources("191450m", "2002345612Ki", "3276800000000"),
            "capacity": resources("192", "2097075404Ki", "3437823369216"),
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "features": {"supplementalGroupsPolicy": true},
            "images": images,
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": format!("{}-{}-{}-{}-{}", &id[..8], &id[8..12], &id[12..16], &id[16..20], &id[20..32]),
                "containerRuntimeVersion": "containerd://1.7.20",
                "kernelVersion": "5.15.0-1056-aws",
                "kubeProxyVersion": "v1.30.4",
                "kubeletVersion": "v1.30.4",
                "machineID": &id[32..64],
                "operatingSystem": "linux",
                "osImage": "Ubuntu 22.04.4 LTS",
                "systemUUID": format!("ec2{}-{}-{}-{}-{}", &id[35..40], &id[40..44], &id[44..48], &id[48..52], &id[52..64]),
            },
            "runtimeHandlers": [handler("nvidia"), handler("runc"), handler("")],
        },
    })
}

/// The UUID NVIDIA's driver reports for GPU `index` of `node` in these fixtures
/// (`GPU-` and a UUID, as `nvidia-smi -L` prints it), stable per node and index.
pub fn gpu_uuid(node: &str, index: usize) -> String {
    let h = node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!(
        "GPU-{:08x}-{:04x}-4{:03x}-8000-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        index & 0xfff,
        h & 0xffff_ffff_ffff
    )
}

/// A node's ResourceSlice as NVIDIA's DRA driver publishes it
/// (kubernetes-sigs/dra-driver-nvidia-gpu: driver `gpu.nvidia.com`, one pool per node
/// named after it, devices `gpu-<minor>` with the attributes `uuid`, `productName`,
/// `architecture`, `driverVersion`, and the capacity `memory`).
pub fn nvidia_slice(node: &str, gpus: usize) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| {
            json!({"name": format!("gpu-{i}"),
                "attributes": {"uuid": {"string": gpu_uuid(node, i)}, "productName": {"string": "NVIDIA H200"},
                               "architecture": {"string": "Hopper"}, "driverVersion": {"version": "570.133.20"},
                               "type": {"string": "gpu"}},
                "capacity": {"memory": {"value": "143771Mi"}}})
        })
        .collect();
    json!({"metadata": {"name": format!("{node}-gpu.nvidia.com-0")},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}})
}

/// A running pod on `node`, as its kubelet reports it, to be seeded with
/// [`ApiServer::create`](crate::ApiServer::create) before [`claim_for`].
pub fn dra_pod(name: &str, node: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"app": "train"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": format!("{name}-gpu")}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
}

/// The claim of `pod` (as created, with its uid) on GPU `device` of its node, as the
/// scheduler allocates and reserves it (`status.allocation.devices.results`,
/// `status.reservedFor`); `tolerations` are the allocation's.
pub fn claim_for(pod: &Value, device: &str, tolerations: Value) -> Value {
    let name = pod["metadata"]["name"].as_str().unwrap_or("");
    let node = pod["spec"]["nodeName"].as_str().unwrap_or("");
    json!({"metadata": {"name": format!("{name}-gpu")},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node,
                                                             "device": device, "tolerations": tolerations}]}},
                   "reservedFor": [{"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}]}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_nodes_size_and_labels() {
        let n = realistic_node("gpu-node-0001", "10.0.12.7");
        let size = serde_json::to_vec(&n).unwrap().len();
        assert!((15_000..=40_000).contains(&size), "{size} bytes");
        assert_eq!(
            n.pointer("/metadata/labels/nvidia.com~1gpu.present"),
            Some(&json!("true"))
        );
        assert_eq!(
            n.pointer("/status/capacity/nvidia.com~1gpu"),
            Some(&json!("8"))
        );
        assert_eq!(
            n.pointer("/status/addresses/0/address"),
            Some(&json!("10.0.12.7"))
        );
        assert_eq!(n["status"]["images"].as_array().unwrap().len(), 50);
        for (k, v) in n["metadata"]["labels"].as_object().unwrap() {
            assert!(crate::validation::is_qualified_name(k).is_empty(), "{k}");
            assert!(
                crate::validation::is_label_value(v.as_str().unwrap()).is_empty(),
                "{k}={v}"
            );
        }
        let other = realistic_node("gpu-node-0002", "10.0.12.8");
        assert_ne!(n["spec"]["providerID"], other["spec"]["providerID"]);
        assert_eq!(digest("x").len(), 64);
    }
}
