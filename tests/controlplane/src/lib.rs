//! A real Kubernetes control plane for faultline's tests: kube-apiserver,
//! etcd, kube-controller-manager and kube-scheduler of a pinned release, built from
//! their Go modules by `tests/controlplane/build.sh` (cached by version; nothing is
//! rebuilt when the cache holds them) and started on loopback with generated
//! certificates, a service-account signing key, `--authorization-mode=Node,RBAC`, and
//! the feature gates and runtime-config each release needs for DRA device taints.
//!
//! There is no kubelet: [`Kubelet`] plays every node's (Node objects, their Leases, pods
//! bound by the real scheduler marked running with an IP, graceful deletions finished),
//! so the real controllers (endpointslice, disruption, job, garbage collector,
//! taint-eviction, device-taint-eviction, resourceclaim) see pods as on a cluster.
//!
//! Every process runs in a process group of its own and gets SIGKILL when the test
//! process dies (`PR_SET_PDEATHSIG`, set from a thread that lives as long as the
//! process); dropping [`ControlPlane`] kills the groups. No process is left behind
//! after a failed or killed test.

mod admission;
mod certs;
mod gobuild;
mod kubelet;
mod netns;
mod plane;
mod procs;

pub use gobuild::helm;
pub use kubelet::{Delays, FakeNode, Kubelet, PodHook, PodPhase};
pub use netns::{network_namespace, POD_RANGE};
pub use plane::*;
