//! The kinds served: group, version, resource, kind and scope, as discovery lists them.

use axum::http::StatusCode;

use crate::ApiError;

/// One kind the server knows.
#[derive(Debug, Clone, Copy)]
pub struct Kind {
    /// `""` for the core group.
    pub group: &'static str,
    /// `v1`.
    pub version: &'static str,
    /// Plural resource name.
    pub plural: &'static str,
    /// Kind name.
    pub kind: &'static str,
    /// Namespaced or cluster scoped.
    pub namespaced: bool,
    /// Short names for kubectl.
    pub short: &'static [&'static str],
}

/// Every kind served.
pub const KINDS: &[Kind] = &[
    Kind {
        group: "",
        version: "v1",
        plural: "nodes",
        kind: "Node",
        namespaced: false,
        short: &["no"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "pods",
        kind: "Pod",
        namespaced: true,
        short: &["po"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "configmaps",
        kind: "ConfigMap",
        namespaced: true,
        short: &["cm"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "secrets",
        kind: "Secret",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
        short: &["ev"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "namespaces",
        kind: "Namespace",
        namespaced: false,
        short: &["ns"],
    },
    // discovery.k8s.io/v1 EndpointSlices, as the endpointslice controller writes them
    // (pkg/controller/endpointslice; staging/src/k8s.io/api/discovery/v1/types.go):
    // tests seed them as that controller would for the agents' Service.
    Kind {
        group: "discovery.k8s.io",
        version: "v1",
        plural: "endpointslices",
        kind: "EndpointSlice",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "batch",
        version: "v1",
        plural: "jobs",
        kind: "Job",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "roles",
        kind: "Role",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "rolebindings",
        kind: "RoleBinding",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "clusterroles",
        kind: "ClusterRole",
        namespaced: false,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "clusterrolebindings",
        kind: "ClusterRoleBinding",
        namespaced: false,
        short: &[],
    },
    Kind {
        group: "policy",
        version: "v1",
        plural: "poddisruptionbudgets",
        kind: "PodDisruptionBudget",
        namespaced: true,
        short: &["pdb"],
    },
    // Dynamic Resource Allocation (staging/src/k8s.io/api/resource/v1/types.go): the
    // version here is the storage version; which versions are served depends on the
    // release played (`release.rs`), and the others convert by their apiVersion alone
    // (v1beta2 and v1alpha3's DeviceTaintRule have v1's fields:
    // staging/src/k8s.io/api/resource/v1beta2/types.go).
    Kind {
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceslices",
        kind: "ResourceSlice",
        namespaced: false,
        short: &[],
    },
    Kind {
        group: "resource.k8s.io",
        version: "v1",
        plural: "resourceclaims",
        kind: "ResourceClaim",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "resource.k8s.io",
        version: "v1",
        plural: "deviceclasses",
        kind: "DeviceClass",
        namespaced: false,
        short: &[],
    },
    Kind {
        group: "resource.k8s.io",
        version: "v1",
        plural: "devicetaintrules",
        kind: "DeviceTaintRule",
        namespaced: false,
        short: &[],
    },
];

pub(crate) fn kind_of(group: &str, plural: &str) -> Option<&'static Kind> {
    KINDS
        .iter()
        .find(|k| k.group == group && k.plural == plural)
}

pub(crate) fn api_version(k: &Kind) -> String {
    if k.group.is_empty() {
        k.version.to_string()
    } else {
        format!("{}/{}", k.group, k.version)
    }
}

/// The kind whose resource is `plural`, or a 404 as for an unknown resource.
pub(crate) fn kind_of_plural(plural: &str) -> Result<&'static Kind, ApiError> {
    KINDS.iter().find(|k| k.plural == plural).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({plural})"),
        )
    })
}
