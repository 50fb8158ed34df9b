//! What the device path of remediation needs, shared by every pass.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::rules::Rules;
use tokio::sync::watch;

use super::{Effect, TaintApi};

/// What the device path needs, shared by every pass.
#[derive(Clone)]
pub struct DeviceQuarantine {
    /// Where DeviceTaintRule is served, as last discovered (`device_taint::api::follow`
    /// keeps it current); `None`: nowhere.
    pub api: Arc<Mutex<Option<TaintApi>>>,
    /// The DRA drivers whose devices may be quarantined (`gpu.nvidia.com`, ...).
    pub drivers: Vec<String>,
    /// The rules file (its node faults and `node_after_devices`).
    pub rules: watch::Receiver<Arc<Rules>>,
    /// The effect a rule is enforced with: `NoSchedule`, or `NoExecute` where the
    /// operator opted in (kube-controller-manager then deletes the holders, bypassing
    /// their PodDisruptionBudgets).
    pub effect: Effect,
    /// Devices quarantined alone at most, cluster-wide.
    pub max_devices: usize,
    /// How long a pass waits for the controller's prediction before leaving the rule at
    /// `None` for the next pass.
    pub prediction_wait: Duration,
    /// How long after its proposal a rule may stay at `None` without an agreement;
    /// past it the pass deletes it and takes the node path.
    pub prediction_deadline: Duration,
    /// The DeviceClass a canary's claim asks for (`gpu.nvidia.com`).
    pub device_class: String,
    /// Whether Huawei's device plugin's ConfigMaps are read
    /// (`kube-system/mindx-dl-deviceinfo-<node>`): chips it lists in
    /// `ManuallySeparateNPU` are isolated already, and faultline adds nothing.
    pub ascend_device_info: bool,
    /// Claims found missing that no running pod names: not asked for again for a
    /// while ([`super::claims::MISSING_CLAIM_TTL`]).
    pub missing_claims: super::claims::MissingClaims,
}

impl DeviceQuarantine {
    /// Off until discovery finds the API: NVIDIA's DRA driver, `NoSchedule`, 64 devices,
    /// two seconds for the prediction.
    pub fn new(rules: watch::Receiver<Arc<Rules>>) -> Self {
        DeviceQuarantine {
            api: Arc::default(),
            drivers: vec!["gpu.nvidia.com".into()],
            rules,
            effect: Effect::NoSchedule,
            max_devices: 64,
            prediction_wait: Duration::from_secs(2),
            prediction_deadline: Duration::from_secs(60),
            device_class: "gpu.nvidia.com".into(),
            ascend_device_info: false,
            missing_claims: Arc::default(),
        }
    }
}

/// The device path's flags.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Device quarantine")]
pub struct DeviceArgs {
    /// Quarantine one failed device alone where the cluster can: its own DRA
    /// DeviceTaintRule, or the device plugin's isolation where it took the device out of
    /// the node's allocatable already. Off: every fault taints its node.
    #[arg(long, env = "FAULTLINE_DEVICE_QUARANTINE", default_value = "true", action = clap::ArgAction::Set)]
    pub device_quarantine: bool,
    /// DRA drivers whose devices may be quarantined, comma separated.
    #[arg(
        long,
        env = "FAULTLINE_DRA_DRIVERS",
        default_value = "gpu.nvidia.com,npu.huawei.com"
    )]
    pub dra_drivers: String,
    /// The effect a device's rule is enforced with: NoSchedule (faultline evicts the
    /// holders through the Eviction API, PodDisruptionBudgets respected) or NoExecute
    /// (kube-controller-manager deletes them, bypassing their PodDisruptionBudgets).
    #[arg(long, env = "FAULTLINE_DEVICE_TAINT_EFFECT", default_value = "NoSchedule", value_parser = ["NoSchedule", "NoExecute"])]
    pub device_taint_effect: String,
    /// Devices quarantined alone at most at once, cluster-wide (faultline's
    /// DeviceTaintRules).
    #[arg(long, env = "FAULTLINE_MAX_QUARANTINED_DEVICES", default_value_t = 64)]
    pub max_quarantined_devices: usize,
    /// How long a device's rule may wait at effect None for the device-taint
    /// controller's prediction to agree with faultline's count of its holders; past it
    /// (no prediction, one that cannot be read, or pods that keep changing) the rule is
    /// deleted and the node is tainted instead, saying why.
    #[arg(long, env = "FAULTLINE_DEVICE_PREDICTION_DEADLINE", default_value = "60s", value_parser = faultline_common::flags::positive_duration)]
    pub device_prediction_deadline: Duration,
    /// The DeviceClass a device canary's claim asks for.
    #[arg(
        long,
        env = "FAULTLINE_CANARY_DEVICE_CLASS",
        default_value = "gpu.nvidia.com"
    )]
    pub canary_device_class: String,
    /// Read Huawei's Ascend device plugin's per-node ConfigMap
    /// (kube-system/mindx-dl-deviceinfo-<node>): chips it lists in ManuallySeparateNPU
    /// are isolated by the plugin already, and faultline adds no taint of its own. Needs
    /// get on ConfigMaps in kube-system (deploy/components/ascend-device-plugin).
    #[arg(long, env = "FAULTLINE_ASCEND_DEVICE_INFO", default_value = "false", action = clap::ArgAction::Set)]
    pub ascend_device_info: bool,
}

impl DeviceQuarantine {
    /// The device path `flags` ask for (`None`: off), following `rules`.
    pub fn from_flags(flags: &DeviceArgs, rules: watch::Receiver<Arc<Rules>>) -> Option<Self> {
        if !flags.device_quarantine {
            return None;
        }
        let drivers: Vec<String> = flags
            .dra_drivers
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        Some(DeviceQuarantine {
            drivers,
            effect: if flags.device_taint_effect == "NoExecute" {
                Effect::NoExecute
            } else {
                Effect::NoSchedule
            },
            max_devices: flags.max_quarantined_devices,
            prediction_deadline: flags.device_prediction_deadline,
            device_class: flags.canary_device_class.clone(),
            ascend_device_info: flags.ascend_device_info,
            ..DeviceQuarantine::new(rules)
        })
    }
}
