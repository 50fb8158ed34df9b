//! The Kubernetes release this server plays (`--kubernetes-version`, `/version`), and so
//! which versions of `resource.k8s.io` (Dynamic Resource Allocation) it serves.
//!
//! Upstream, a version of a resource is served when its API group version is enabled
//! (staging/src/k8s.io/apiserver/pkg/server/storage/resource_config.go; new beta APIs
//! are off by default since 1.24, KEP-3136) and, for DeviceTaintRule, when its feature
//! gate is on (pkg/registry/resource/rest/storage_resource.go serves `devicetaintrules`
//! only with `DRADeviceTaintRules`). The gate's history, from
//! staging/src/k8s.io/apiserver/pkg/features/kube_features.go:
//! - 1.33 to 1.35 alpha, off by default (API `v1alpha3`; effect `None` only from 1.35:
//!   pkg/apis/resource/validation/validation.go `validateDeviceTaint` checks the effect
//!   against `resource.SupportedDeviceTaintEffects`, which gains `None` in 1.35, so a
//!   1.33 or 1.34 cluster refuses a rule at `None` with a 422, as `dra.rs` does);
//! - 1.36 beta, **off** by default ("Depends on an off-by-default beta API", `v1beta2`);
//! - 1.37 GA, on by default (`v1`).
//!
//! So a 1.36 cluster serves no DeviceTaintRule unless its administrator turned the gate
//! and the API on, which [`Release::device_taint_rules`] stands for. Where unsure this
//! model serves fewer versions, never more: ResourceSlices, ResourceClaims and
//! DeviceClasses at `v1` only from 1.34 (DRA's GA; the beta versions may still be on
//! in a real cluster, and no client of ours needs them), DeviceTaintRule at the one
//! version of its release.

use crate::Kind;

/// The group of Dynamic Resource Allocation.
pub const RESOURCE_GROUP: &str = "resource.k8s.io";

/// A Kubernetes minor release and the one gate this server models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// `1.<minor>`.
    pub minor: u32,
    /// `--feature-gates=DRADeviceTaintRules=…` (with the API turned on through
    /// `--runtime-config` where its version is not on by default); `None` is the
    /// release's default.
    pub device_taint_rules_gate: Option<bool>,
}

impl Default for Release {
    /// 1.34, what this server played before it modelled DRA: DRA's first GA release,
    /// no DeviceTaintRule.
    fn default() -> Self {
        Release {
            minor: 34,
            device_taint_rules_gate: None,
        }
    }
}

impl Release {
    /// `1.36`, `v1.37` or `1.37.2`; no gate set.
    pub fn parse(s: &str) -> Result<Release, String> {
        let t = s.trim().trim_start_matches('v');
        let mut parts = t.split('.');
        let (major, minor) = (parts.next(), parts.next());
        let patch_ok =
            parts.next().is_none_or(|p| p.parse::<u32>().is_ok()) && parts.next().is_none();
        match (major, minor.and_then(|m| m.parse::<u32>().ok())) {
            (Some("1"), Some(minor)) if patch_ok && (20..=99).contains(&minor) => Ok(Release {
                minor,
                device_taint_rules_gate: None,
            }),
            _ => Err(format!(
                "not a Kubernetes release 1.<minor>[.<patch>]: {s:?}"
            )),
        }
    }

    /// The same release with `DRADeviceTaintRules` set.
    pub fn with_device_taint_rules(mut self, on: bool) -> Release {
        self.device_taint_rules_gate = Some(on);
        self
    }

    /// Whether DeviceTaintRules are served: the gate (its default from 1.37 on), and
    /// only from 1.33, the first release that has it (KEP-5055).
    pub fn device_taint_rules(&self) -> bool {
        self.minor >= 33 && self.device_taint_rules_gate.unwrap_or(self.minor >= 37)
    }

    /// The versions at which `k` is served, newest first; empty when it is not.
    pub fn versions(&self, k: &'static Kind) -> &'static [&'static str] {
        if k.group != RESOURCE_GROUP {
            return std::slice::from_ref(&k.version);
        }
        match k.plural {
            "devicetaintrules" if self.device_taint_rules() => match self.minor {
                33..=35 => &["v1alpha3"],
                36 => &["v1beta2"],
                _ => &["v1"],
            },
            "devicetaintrules" => &[],
            _ if self.minor >= 34 => &["v1"],
            _ => &[],
        }
    }

    /// Whether `k` is served at `version`.
    pub fn serves(&self, k: &'static Kind, version: &str) -> bool {
        self.versions(k).contains(&version)
    }

    /// `/version`'s `gitVersion`.
    pub fn git_version(&self) -> String {
        format!("v1.{}.0-faultline-test", self.minor)
    }
}
