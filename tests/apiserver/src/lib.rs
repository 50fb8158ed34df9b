//! A Kubernetes API server for tests and the demo: the real HTTP API for what faultline
//! uses, kept in memory. Both `kubectl` and the `kube` client work against it.
//!
//! Served: discovery (`/version`, `/api`, `/api/v1`, `/apis`, `/apis/<group>/<version>`);
//! for Nodes (and `nodes/status`), Pods (and `pods/status`, `pods/eviction`),
//! ConfigMaps, Secrets, Events, Namespaces, Leases (`coordination.k8s.io/v1`) and
//! PodDisruptionBudgets (`policy/v1`): get, list and watch with resourceVersion, label
//! and field selectors as upstream parses them (`selectors.rs`; objects entering or
//! leaving a selector are ADDED or DELETED), lists in pages (`limit` and `continue`,
//! `paging.rs`); create (409 AlreadyExists); update (409 Conflict on a stale
//! resourceVersion); JSON, merge and strategic-merge patch (list strategies from the Go
//! types); delete, graceful for pods (`lifecycle.rs`). A ConfigMap or Secret over 1 MiB
//! is refused (422) as the real server does, and so are invalid object names, keys,
//! changes to immutable ConfigMaps and Secrets, and Event namespaces (`validation.rs`,
//! each rule citing upstream). Evictions are judged by the budget's status, which a
//! simulated disruption controller keeps current (`disruption.rs`, after
//! pkg/registry/core/pod/storage/eviction.go and pkg/controller/disruption/disruption.go).
//!
//! What it costs: bytes sent per verb and resource, watch events, bytes written, and
//! the fan-out of ConfigMap and Secret writes to the kubelets that watch them
//! (`costs.rs`, `kubelet.rs`; [`ApiServer::costs`], `GET /_test/costs`).
//!
//! Fault injection (`PUT /_faults`, JSON [`Faults`]) adds latency, 5xx, 409 and API
//! Priority and Fairness 429s to a share of calls, bumps Nodes' resourceVersion as the
//! kubelet's status updates do, and ends watches early; `GET /_calls` lists the calls
//! received.
//!
//! Tests, benchmarks and the binary start it one way: [`spawn`] (an empty cluster on
//! loopback) or a [`Bootstrap`] (namespaces, objects, manifests, RBAC, faults).
//! [`fixtures`] builds objects of a real cluster's shape and size.

mod b64;
mod bootstrap;
mod changes;
mod clock;
pub mod costs;
mod discovery;
pub mod disruption;
pub mod dra;
pub mod field_selectors;
pub mod fixtures;
mod http;
mod kinds;
mod kubelet;
mod lifecycle;
mod node_labels;
mod paging;
pub mod patch;
pub mod rbac;
pub mod release;
mod request;
pub mod selectors;
mod server;
mod store;
mod taint_eviction;
pub mod validation;
mod watch;

pub use bootstrap::{spawn, Bootstrap, Running};
pub use costs::{Costs, Fanout, Tally};
pub use http::{router, serve};
pub use kinds::{Kind, KINDS};
pub use release::Release;
pub use server::*;
