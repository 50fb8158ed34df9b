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
    /// How a device is taken out alone: a DeviceTaintRule, the device plugin's own
    /// isolation, or either (`--device-quarantine`).
    pub backend: Backend,
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
            backend: Backend::Auto,
            ascend_device_info: false,
            missing_claims: Arc::default(),
        }
    }
}

/// How one failed device is kept from new work without its node (`--device-quarantine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A DeviceTaintRule where the device is published through DRA, else the device
    /// plugin's isolation where it took the device out of the node's allocatable.
    Auto,
    /// DeviceTaintRules only: a device no rule can select takes the node path, even
    /// where its device plugin took it out.
    Dra,
    /// The device plugin's isolation only: no DeviceTaintRule is written (rules an
    /// earlier setting made are still released).
    DevicePlugin,
}

impl Backend {
    /// The flag's value for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Dra => "dra",
            Backend::DevicePlugin => "device-plugin",
        }
    }
}

/// `--device-quarantine`'s value: a backend, or off (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice(pub Option<Backend>);

/// `--device-quarantine`: `auto`, `dra`, `device-plugin` or `off`; `true` and `false`,
/// its earlier values, still mean `auto` and `off`.
pub fn backend(v: &str) -> Result<Choice, String> {
    match v {
        "auto" | "true" => Ok(Choice(Some(Backend::Auto))),
        "dra" => Ok(Choice(Some(Backend::Dra))),
        "device-plugin" => Ok(Choice(Some(Backend::DevicePlugin))),
        "off" | "false" => Ok(Choice(None)),
        _ => Err(format!(
            "{v:?}: one of auto, dra, device-plugin, off (true and false: auto and off)"
        )),
    }
}

/// The device path's flags.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Device quarantine")]
pub struct DeviceArgs {
    /// Quarantine one failed device alone where the cluster can. auto: its own DRA
    /// DeviceTaintRule where the device is published through DRA, else the device
    /// plugin's isolation where it took the device out of the node's allocatable
    /// already. dra: DeviceTaintRules only. device-plugin: the plugin's isolation only,
    /// no DeviceTaintRule written. off: every fault taints its node. (true and false
    /// are auto and off.)
    #[arg(long, env = "FAULTLINE_DEVICE_QUARANTINE", default_value = "auto", value_parser = backend)]
    pub device_quarantine: Choice,
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
        let backend = flags.device_quarantine.0?;
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
            backend,
            ascend_device_info: flags.ascend_device_info,
            ..DeviceQuarantine::new(rules)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_flag_takes_its_four_values_and_the_old_two() {
        for (v, b) in [
            ("auto", Some(Backend::Auto)),
            ("true", Some(Backend::Auto)),
            ("dra", Some(Backend::Dra)),
            ("device-plugin", Some(Backend::DevicePlugin)),
            ("off", None),
            ("false", None),
        ] {
            assert_eq!(backend(v), Ok(Choice(b)), "{v}");
        }
        for b in [Backend::Auto, Backend::Dra, Backend::DevicePlugin] {
            assert_eq!(backend(b.as_str()), Ok(Choice(Some(b))));
        }
        let e = backend("devicePlugin").unwrap_err();
        assert!(e.contains("device-plugin"), "{e}");
    }
}
