//! Clusters without DRA, pure: whether the device plugin has
//! already taken the failed devices out of the scheduler's hands, so that faultline
//! lets that stand instead of tainting the node.
//!
//! A device plugin reports each device Healthy or Unhealthy to the kubelet
//! (`ListAndWatch`, staging/src/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto);
//! the kubelet's device manager counts only healthy devices in the Node's allocatable
//! and all of them in its capacity (pkg/kubelet/cm/devicemanager/manager.go
//! `GetCapacity`). NVIDIA's device plugin marks a GPU Unhealthy on a critical Xid
//! (k8s-device-plugin, internal/rm/health.go), so an 8-GPU node with one bad GPU shows
//! capacity 8, allocatable 7. That difference is the plugin's isolation, and is all the
//! node-level evidence there is of it.

use k8s_openapi::api::core::v1::Node;

use super::scope::{node_fault, Failed, NodeWhy};
use faultline_common::rules::Rules;

/// A whole-number quantity (`"8"`); `None` for anything else (`"8k"`, `"500m"`).
fn count(q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Option<u64> {
    q.0.trim().parse().ok()
}

/// How many devices of `resource` the Node's allocatable lacks against its capacity:
/// those the plugin reported unhealthy. `None` when the Node reports neither, or not
/// as whole numbers.
pub fn taken_out(node: &Node, resource: &str) -> Option<u64> {
    let status = node.status.as_ref()?;
    let capacity = count(status.capacity.as_ref()?.get(resource)?)?;
    let allocatable = count(status.allocatable.as_ref()?.get(resource)?)?;
    Some(capacity.saturating_sub(allocatable))
}

/// How long a refused pod counts against its node.
pub const REJECTION_WINDOW_MS: u64 = 3_600_000;

/// Pods the kubelet refused at admission within `window_ms` before `now_ms`: phase
/// `Failed` with reason `UnexpectedAdmissionError`, which the kubelet writes when a
/// device plugin's allocation fails ("Allocate failed due to requested number of devices
/// unavailable", pkg/kubelet/lifecycle/predicate.go). Counted by creation time; a pod
/// without one is not counted.
pub fn rejections(pods: &[k8s_openapi::api::core::v1::Pod], now_ms: u64, window_ms: u64) -> usize {
    pods.iter()
        .filter(|p| {
            let s = p.status.as_ref();
            s.and_then(|s| s.phase.as_deref()) == Some("Failed")
                && s.and_then(|s| s.reason.as_deref()) == Some("UnexpectedAdmissionError")
        })
        .filter_map(|p| p.metadata.creation_timestamp.as_ref())
        .filter(|t| {
            let at = t.0.as_millisecond();
            at >= 0 && now_ms.saturating_sub(at as u64) <= window_ms
        })
        .count()
}

/// What to do on a device-plugin cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginScope {
    /// The plugin already keeps the failed devices from new pods: no node taint; evict
    /// only the pods of the failed devices and say which devices they are.
    AlreadyOut { taken_out: u64 },
    /// The node path, as before.
    Node(NodeWhy),
}

/// Decide for one node's failed devices, given what the plugin took out
/// ([`taken_out`]). The node's own faults and `node_after_devices` take the node path
/// as on a DRA cluster; otherwise the plugin's isolation stands only when it took out
/// at least as many devices as failed (fewer: some failed device is still offered to
/// new pods).
pub fn plugin_scope(rules: &Rules, failed: &[Failed<'_>], taken_out: Option<u64>) -> PluginScope {
    if let Some(why) = node_fault(rules, failed) {
        return PluginScope::Node(why);
    }
    match taken_out {
        Some(n) if n >= failed.len() as u64 => PluginScope::AlreadyOut { taken_out: n },
        _ => PluginScope::Node(NodeWhy::NotTakenOut {
            taken_out,
            failed: failed.len(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn node(capacity: &str, allocatable: &str) -> Node {
        let q = |v: &str| {
            [("nvidia.com/gpu".to_string(), Quantity(v.into()))]
                .into_iter()
                .collect()
        };
        Node {
            status: Some(NodeStatus {
                capacity: Some(q(capacity)),
                allocatable: Some(q(allocatable)),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }

    #[test]
    fn what_the_plugin_took_out_is_capacity_less_allocatable() {
        assert_eq!(taken_out(&node("8", "7"), "nvidia.com/gpu"), Some(1));
        assert_eq!(taken_out(&node("8", "8"), "nvidia.com/gpu"), Some(0));
        assert_eq!(taken_out(&node("8", "9"), "nvidia.com/gpu"), Some(0));
        assert_eq!(taken_out(&node("8", "7"), "huawei.com/Ascend910"), None);
        assert_eq!(taken_out(&node("8k", "7"), "nvidia.com/gpu"), None);
        assert_eq!(taken_out(&node("8", "7.5"), "nvidia.com/gpu"), None);
        assert_eq!(taken_out(&Node::default(), "nvidia.com/gpu"), None);
    }

    #[test]
    fn refused_pods_count_within_the_window_only() {
        let pod = |phase: &str, reason: &str, at: &str| -> k8s_openapi::api::core::v1::Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "creationTimestamp": at},
                "status": {"phase": phase, "reason": reason}}))
            .unwrap()
        };
        // 2026-12-05T10:00:00Z
        let now = 1_796_464_800_000;
        let pods = [
            pod("Failed", "UnexpectedAdmissionError", "2026-12-05T09:59:00Z"),
            pod("Failed", "UnexpectedAdmissionError", "2026-12-05T09:00:00Z"),
            // Older than the hour.
            pod("Failed", "UnexpectedAdmissionError", "2026-12-05T08:59:59Z"),
            // Failed otherwise, or not failed.
            pod("Failed", "Evicted", "2026-12-05T09:59:00Z"),
            pod(
                "Pending",
                "UnexpectedAdmissionError",
                "2026-12-05T09:59:00Z",
            ),
        ];
        assert_eq!(rejections(&pods, now, REJECTION_WINDOW_MS), 2);
        assert_eq!(rejections(&pods, now, 0), 0);
        assert_eq!(rejections(&[], now, REJECTION_WINDOW_MS), 0);
    }

    #[test]
    fn the_plugins_isolation_stands_only_when_it_covers_the_failures() {
        let rules = Rules::default();
        let soft = vec!["xid-48".to_string()];
        let lost = vec!["xid-79".to_string()];
        let one = [Failed {
            id: "GPU-a",
            reasons: &soft,
        }];
        assert_eq!(
            plugin_scope(&rules, &one, Some(1)),
            PluginScope::AlreadyOut { taken_out: 1 }
        );
        assert_eq!(
            plugin_scope(&rules, &one, Some(2)),
            PluginScope::AlreadyOut { taken_out: 2 }
        );
        let left = |taken_out| {
            PluginScope::Node(NodeWhy::NotTakenOut {
                taken_out,
                failed: 1,
            })
        };
        assert_eq!(plugin_scope(&rules, &one, Some(0)), left(Some(0)));
        assert_eq!(plugin_scope(&rules, &one, None), left(None));
        assert!(NodeWhy::NotTakenOut {
            taken_out: Some(0),
            failed: 1
        }
        .describe()
        .contains("took 0 of 1"));
        assert!(NodeWhy::NotTakenOut {
            taken_out: None,
            failed: 1
        }
        .describe()
        .contains("none (not reported)"));
        // The node's own fault, or too many devices: the node, whatever the plugin did.
        let bus = [Failed {
            id: "GPU-b",
            reasons: &lost,
        }];
        assert_eq!(
            plugin_scope(&rules, &bus, Some(1)),
            PluginScope::Node(NodeWhy::NodeFault {
                device: "GPU-b".into(),
                reason: "xid-79".into()
            })
        );
        let two = [
            Failed {
                id: "GPU-a",
                reasons: &soft,
            },
            Failed {
                id: "GPU-c",
                reasons: &soft,
            },
        ];
        assert_eq!(
            plugin_scope(&rules, &two, Some(2)),
            PluginScope::Node(NodeWhy::Devices { failed: 2 })
        );
        let three = Rules {
            node_after_devices: 3,
            ..Rules::default()
        };
        assert_eq!(
            plugin_scope(&three, &two, Some(2)),
            PluginScope::AlreadyOut { taken_out: 2 }
        );
        assert_eq!(
            plugin_scope(&three, &two, Some(1)),
            PluginScope::Node(NodeWhy::NotTakenOut {
                taken_out: Some(1),
                failed: 2
            })
        );
    }
}
