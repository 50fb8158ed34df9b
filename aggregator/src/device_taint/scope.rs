//! Device or node, pure: whether a node's failed devices can each
//! be quarantined alone, or the fault is the node's and the node is tainted as before.
//!
//! The node's, in this order of precedence (the first that holds is the reason given):
//! 1. a device failed for a fault the rules file calls the node's (`node_faults`: the
//!    GPU gone from the bus, the PCIe link, NVLink's fabric, a reboot-class recovery
//!    action);
//! 2. `node_after_devices` or more failed devices;
//! 3. the cluster serves no DeviceTaintRule (no DRA, or the gate off);
//! 4. a failed device that no complete ResourceSlice pool of an allowlisted driver
//!    publishes (the device plugin's cluster, or a pool mid-update): no rule could
//!    select it.
//!
//! Otherwise each failed device is quarantined alone and the node's other devices stay
//! schedulable.

use faultline_common::rules::Rules;

/// A failed device of a node, as the pipeline holds it.
#[derive(Debug, Clone, Copy)]
pub struct Failed<'a> {
    /// The device's id (a GPU's UUID).
    pub id: &'a str,
    /// Why it failed (finding codes, rule reasons).
    pub reasons: &'a [String],
}

/// Why the node, not its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeWhy {
    /// `device` failed for `reason`, a node fault.
    NodeFault { device: String, reason: String },
    /// `failed` devices failed, at least `node_after_devices`.
    Devices { failed: usize },
    /// No DeviceTaintRule API in this cluster.
    NoDeviceApi,
    /// No complete pool publishes `device`.
    NotPublished { device: String },
    /// A device-plugin cluster whose plugin took out fewer devices (`taken_out`, from
    /// the Node's capacity and allocatable) than `failed`.
    NotTakenOut {
        taken_out: Option<u64>,
        failed: usize,
    },
    /// Another owner's DeviceTaintRule holds `rule`, the name faultline's would have:
    /// left alone.
    ForeignRule { device: String, rule: String },
    /// The kubelet refused `pods` pods within the hour for lack of devices.
    RejectsAllocations { pods: usize },
    /// The DRA objects could not be read (`why`: an RBAC without them, an API error):
    /// the node, as before the device path.
    Unreadable { why: String },
    /// The API server refused the proposed rule for `device` (`why`): a cluster whose
    /// DeviceTaintRule has no effect `None` (the alpha API of 1.33 and 1.34).
    RuleRefused { device: String, why: String },
    /// No agreement on `device`'s rule (`rule`) within the deadline (`why`): the
    /// controller's prediction never came, could not be read, or kept disagreeing.
    NoAgreement {
        device: String,
        rule: String,
        why: String,
    },
}

impl NodeWhy {
    /// For the record, the Event and the log.
    pub fn describe(&self) -> String {
        match self {
            NodeWhy::NodeFault { device, reason } => {
                format!("{device} failed for {reason}, a fault of the whole node")
            }
            NodeWhy::Devices { failed } => format!("{failed} devices failed on this node"),
            NodeWhy::NoDeviceApi => {
                "the cluster serves no DeviceTaintRule (DRA device taints)".into()
            }
            NodeWhy::NotPublished { device } => {
                format!("{device} is in no complete ResourceSlice pool")
            }
            NodeWhy::NotTakenOut { taken_out, failed } => format!(
                "the device plugin took {} of {failed} failed devices out of the node's allocatable",
                taken_out.map_or("none (not reported)".to_string(), |n| n.to_string())
            ),
            NodeWhy::Unreadable { why } => {
                format!("the DRA objects could not be read ({why})")
            }
            NodeWhy::RuleRefused { device, why } => format!(
                "the API server refused the DeviceTaintRule proposed for {device} ({why}); before 1.35 a rule has no effect None to propose with"
            ),
            NodeWhy::RejectsAllocations { pods } => format!(
                "the kubelet refused {pods} pods within the hour for lack of devices (UnexpectedAdmissionError)"
            ),
            NodeWhy::NoAgreement { device, rule, why } => format!(
                "no agreement with the device-taint controller on {device} (DeviceTaintRule {rule}, deleted): {why}"
            ),
            NodeWhy::ForeignRule { device, rule } => format!(
                "DeviceTaintRule {rule} for {device} belongs to another owner (no app.kubernetes.io/managed-by=faultline): left alone"
            ),
        }
    }
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Quarantine each failed device alone.
    Devices,
    /// Quarantine the node.
    Node(NodeWhy),
}

/// The node's fault whatever the cluster can do: a node fault of the rules file, or
/// `node_after_devices` failed devices (1 and 2 above). Shared by [`scope`] and the
/// device-plugin path (`plugin.rs`).
pub fn node_fault(rules: &Rules, failed: &[Failed<'_>]) -> Option<NodeWhy> {
    for f in failed {
        if let Some(r) = f.reasons.iter().find(|r| rules.is_node_fault(r)) {
            return Some(NodeWhy::NodeFault {
                device: f.id.to_string(),
                reason: r.clone(),
            });
        }
    }
    (failed.len() >= rules.node_after_devices as usize).then_some(NodeWhy::Devices {
        failed: failed.len(),
    })
}

/// The node's fault when its kubelet keeps refusing pods for lack of devices: `rejected`
/// refusals within the hour, at least the rules file's `node_after_rejections` (0:
/// never).
pub fn rejecting(rules: &Rules, rejected: usize) -> Option<NodeWhy> {
    let at = rules.node_after_rejections as usize;
    (at > 0 && rejected >= at).then_some(NodeWhy::RejectsAllocations { pods: rejected })
}

/// Decide for one node's failed devices. `device_api`: the cluster serves
/// DeviceTaintRule; `published(id)`: a complete pool publishes the device.
pub fn scope(
    rules: &Rules,
    failed: &[Failed<'_>],
    device_api: bool,
    published: impl Fn(&str) -> bool,
) -> Scope {
    if let Some(why) = node_fault(rules, failed) {
        return Scope::Node(why);
    }
    if failed.is_empty() {
        return Scope::Devices;
    }
    if !device_api {
        return Scope::Node(NodeWhy::NoDeviceApi);
    }
    if let Some(f) = failed.iter().find(|f| !published(f.id)) {
        return Scope::Node(NodeWhy::NotPublished {
            device: f.id.to_string(),
        });
    }
    Scope::Devices
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reasons(r: &[&str]) -> Vec<String> {
        r.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_node_that_keeps_refusing_pods_is_the_nodes_fault() {
        let rules = Rules::default();
        assert_eq!(rules.node_after_rejections, 3);
        assert_eq!(rejecting(&rules, 2), None);
        assert_eq!(
            rejecting(&rules, 3),
            Some(NodeWhy::RejectsAllocations { pods: 3 })
        );
        assert_eq!(
            rejecting(&rules, 4),
            Some(NodeWhy::RejectsAllocations { pods: 4 })
        );
        let off = Rules {
            node_after_rejections: 0,
            ..Rules::default()
        };
        assert_eq!(rejecting(&off, 0), None);
        assert_eq!(rejecting(&off, 100), None);
        assert!(NodeWhy::RejectsAllocations { pods: 3 }
            .describe()
            .contains("refused 3 pods"));
    }

    #[test]
    fn one_failed_gpu_is_quarantined_alone() {
        let rules = Rules::default();
        let r = reasons(&["xid-48"]);
        let one = [Failed {
            id: "GPU-a",
            reasons: &r,
        }];
        assert_eq!(scope(&rules, &one, true, |_| true), Scope::Devices);
        assert_eq!(scope(&rules, &[], true, |_| true), Scope::Devices);
        assert_eq!(scope(&rules, &[], false, |_| false), Scope::Devices);
    }

    #[test]
    fn the_node_is_quarantined_for_its_own_faults() {
        let rules = Rules::default();
        let soft = reasons(&["xid-48"]);
        let lost = reasons(&["xid-48", "gpu-lost"]);
        // A node fault wins, and names the device and reason.
        let f = [
            Failed {
                id: "GPU-a",
                reasons: &soft,
            },
            Failed {
                id: "GPU-b",
                reasons: &lost,
            },
        ];
        assert_eq!(
            scope(&rules, &f[1..], true, |_| true),
            Scope::Node(NodeWhy::NodeFault {
                device: "GPU-b".into(),
                reason: "gpu-lost".into()
            })
        );
        assert!(matches!(
            scope(&rules, &f, true, |_| true),
            Scope::Node(NodeWhy::NodeFault { .. })
        ));
        // Two failed devices: the node's.
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
            scope(&rules, &two, true, |_| true),
            Scope::Node(NodeWhy::Devices { failed: 2 })
        );
        let three = Rules {
            node_after_devices: 3,
            ..Rules::default()
        };
        assert_eq!(scope(&three, &two, true, |_| true), Scope::Devices);
        let always = Rules {
            node_after_devices: 1,
            ..Rules::default()
        };
        assert_eq!(
            scope(&always, &two[..1], true, |_| true),
            Scope::Node(NodeWhy::Devices { failed: 1 })
        );
    }

    #[test]
    fn without_the_api_or_a_published_device_the_node_path_stays() {
        let rules = Rules::default();
        let r = reasons(&["xid-48"]);
        let one = [Failed {
            id: "GPU-a",
            reasons: &r,
        }];
        assert_eq!(
            scope(&rules, &one, false, |_| true),
            Scope::Node(NodeWhy::NoDeviceApi)
        );
        assert_eq!(
            scope(&rules, &one, true, |id| id != "GPU-a"),
            Scope::Node(NodeWhy::NotPublished {
                device: "GPU-a".into()
            })
        );
        assert!(NodeWhy::NotPublished {
            device: "GPU-a".into()
        }
        .describe()
        .contains("GPU-a"));
        assert!(NodeWhy::Devices { failed: 2 }
            .describe()
            .starts_with("2 devices"));
    }
}
