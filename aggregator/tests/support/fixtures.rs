//! Nodes and Pods for the test API server, built like controller-rs's fixtures, and
//! seeded as the kubelet would have reported them.

use faultline_test_apiserver::ApiServer;
use serde_json::{json, Value};

/// A Node for the test API server.
pub struct NodeFixture(Value);

impl NodeFixture {
    /// A Node named `name`, with no labels, taints or status.
    pub fn new(name: &str) -> Self {
        NodeFixture(json!({"metadata": {"name": name}}))
    }

    /// A GPU Node of a real one's size and shape (NFD and GPU feature discovery
    /// labels, ~50 images, managedFields; ~26 KB), at 127.0.0.1.
    pub fn realistic(name: &str) -> Self {
        NodeFixture(faultline_test_apiserver::fixtures::realistic_node(
            name,
            "127.0.0.1",
        ))
    }

    /// A node someone else looks after too: their label `team=a` and their NoSchedule
    /// taint `other.example/maintenance=x` on it (faultline must keep both).
    pub fn shared(name: &str) -> Self {
        Self::new(name)
            .label("team", "a")
            .taint("other.example/maintenance", "x")
    }

    /// Its name.
    pub fn name(&self) -> &str {
        self.0["metadata"]["name"].as_str().unwrap()
    }

    /// A label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.0["metadata"]["labels"][key] = json!(value);
        self
    }

    /// A NoSchedule taint someone else put there.
    pub fn taint(mut self, key: &str, value: &str) -> Self {
        let t = json!({"key": key, "value": value, "effect": "NoSchedule"});
        match self.0["spec"]["taints"].as_array_mut() {
            Some(list) => list.push(t),
            None => self.0["spec"]["taints"] = json!([t]),
        }
        self
    }

    /// The Ready condition.
    pub fn ready(mut self, ready: bool) -> Self {
        self.0["status"]["conditions"] =
            json!([{"type": "Ready", "status": if ready { "True" } else { "False" }}]);
        self
    }

    /// `capacity` devices of the extended resource `resource`, `allocatable` of them
    /// healthy (the kubelet's device manager counts only those the device plugin
    /// reports healthy in allocatable).
    pub fn devices(mut self, resource: &str, capacity: u32, allocatable: u32) -> Self {
        self.0["status"]["capacity"][resource] = json!(capacity.to_string());
        self.0["status"]["allocatable"][resource] = json!(allocatable.to_string());
        self
    }

    /// The Node's InternalIP (where discovery finds its agent).
    pub fn address(mut self, ip: &str) -> Self {
        self.0["status"]["addresses"] = json!([{"type": "InternalIP", "address": ip}]);
        self
    }

    /// The object.
    pub fn build(self) -> Value {
        self.0
    }

    /// Create it on `server`.
    pub fn create(self, server: &ApiServer) {
        server.create("nodes", "", self.0).unwrap();
    }
}

/// A Pod for the test API server.
pub struct PodFixture(Value);

impl PodFixture {
    /// A running, Ready pod `name` in `default` on `node`, one container, labelled
    /// `app=name` (what its kubelet would have reported).
    pub fn new(name: &str, node: &str) -> Self {
        PodFixture(json!({
            "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
    }

    /// Not Ready (a crash-looping or starting container).
    pub fn unready(mut self) -> Self {
        self.0["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
        self
    }

    /// It asks for one `nvidia.com/gpu`.
    pub fn gpu(self) -> Self {
        self.asks("nvidia.com/gpu")
    }

    /// It asks for one of the extended resource `resource` (`huawei.com/Ascend910`).
    pub fn asks(mut self, resource: &str) -> Self {
        self.0["spec"]["containers"][0]["resources"] = json!({"limits": {resource: "1"}});
        self
    }

    /// The kubelet says it holds `nvidia.com/gpu` device `id` with `health` (KEP-4680).
    pub fn holds(self, id: &str, health: &str) -> Self {
        self.holds_of("nvidia.com/gpu", id, health)
    }

    /// The kubelet says it holds device `id` of `resource` with `health` (KEP-4680).
    pub fn holds_of(mut self, resource: &str, id: &str, health: &str) -> Self {
        self.0["status"]["containerStatuses"] = json!([{"name": "c", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
            "allocatedResourcesStatus": [{"name": resource, "resources": [{"resourceID": id, "health": health}]}]}]);
        self
    }

    /// Owned by a controller of `kind`.
    pub fn owner(mut self, kind: &str) -> Self {
        self.0["metadata"]["ownerReferences"] =
            json!([{"apiVersion": "apps/v1", "kind": kind, "name": "owner", "uid": "owner-uid"}]);
        self
    }

    /// Its phase.
    pub fn phase(mut self, phase: &str) -> Self {
        self.0["status"]["phase"] = json!(phase);
        self
    }

    /// A label (`app` is the pod's name unless set here).
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.0["metadata"]["labels"][key] = json!(value);
        self
    }

    /// The object.
    pub fn build(self) -> Value {
        self.0
    }

    /// Create it on `server`.
    pub fn create(self, server: &ApiServer) {
        server.create("pods", "default", self.0).unwrap();
    }
}
