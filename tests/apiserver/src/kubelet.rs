//! The kubelets' watches on the ConfigMaps and Secrets their pods use, and what each
//! write of one costs: the watch event sent to every node watching it.
//!
//! After pkg/kubelet/util/manager/watch_based_manager.go, the default change-detection
//! strategy of pkg/kubelet/configmap/configmap_manager.go and
//! pkg/kubelet/secret/secret_manager.go: a kubelet registers each pod bound to its node
//! and keeps ONE watch (a reflector with `fieldSelector=metadata.name=NAME` in the pod's
//! namespace) per ConfigMap or Secret its pods reference, however many pods share it
//! (`objectCache.AddReference` counts references; the watch stops when the last pod
//! goes, `DeleteReference`). A pod references what pkg/api/v1/pod/util.go visits
//! (`VisitPodConfigmapNames`, `VisitPodSecretNames`): `volumes[].configMap`,
//! `volumes[].secret`, `volumes[].projected.sources[].configMap/.secret`, the
//! `secretRef` of CSI, CephFS, Cinder, FlexVolume, RBD, ScaleIO, iSCSI and StorageOS
//! volumes and AzureFile's `secretName`, `imagePullSecrets`, and in every container
//! (init and ephemeral ones included) `env[].valueFrom.configMapKeyRef/.secretKeyRef`
//! and `envFrom[].configMapRef/.secretRef`. A pod counts while it is bound
//! (`spec.nodeName`) and not terminated (phase `Succeeded` or `Failed`).
//!
//! An object marked `immutable: true` is not watched once its kubelet has read it
//! (KEP-1412; `objectCache.Get` stops the reflector of an immutable object): a watch
//! that starts on an immutable object stops at once, and one open when the object
//! becomes immutable delivers that write and stops.
//!
//! Not modelled: the idle-watch recycling of objects referenced only from env
//! (`maxIdleTime`, 5 resync periods), the initial list each new watch does, and nodes
//! whose kubelet is down (they are still charged).

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::costs::{Fanout, Meter};
use crate::Key;

/// One node's watch on one object.
#[derive(Debug, Default)]
struct Watch {
    /// Registered pods of the node that reference the object.
    pods: u32,
    /// The kubelet read the object as immutable and stopped watching.
    stopped: bool,
}

/// Every kubelet's registered pods and watches.
#[derive(Debug, Default)]
pub(crate) struct Kubelets {
    /// A referenced ConfigMap or Secret -> node -> its watch.
    watches: HashMap<Key, BTreeMap<String, Watch>>,
    /// A registered pod (namespace, name) -> its node and what it references.
    pods: HashMap<(String, String), (String, Vec<Key>)>,
    /// Watches open (not stopped).
    open: u64,
}

fn immutable(obj: &Value) -> bool {
    obj.get("immutable").and_then(Value::as_bool) == Some(true)
}

fn name_at<'a>(v: &'a Value, pointer: &str) -> Option<&'a str> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
}

/// The node and the objects a pod makes its kubelet watch, or `None` when no kubelet
/// registers it (not bound, or terminated).
fn references(pod: &Value) -> Option<(String, Vec<Key>)> {
    let node = name_at(pod, "/spec/nodeName")?;
    if matches!(
        pod.pointer("/status/phase").and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    ) {
        return None;
    }
    let ns = pod
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut refs: Vec<(&str, &str)> = Vec::new();
    let spec = pod.get("spec").unwrap_or(&Value::Null);
    for s in spec
        .get("imagePullSecrets")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        refs.extend(name_at(s, "/name").map(|n| ("secrets", n)));
    }
    for group in ["initContainers", "containers", "ephemeralContainers"] {
        for c in spec
            .get(group)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            for e in c
                .get("envFrom")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                refs.extend(name_at(e, "/configMapRef/name").map(|n| ("configmaps", n)));
                refs.extend(name_at(e, "/secretRef/name").map(|n| ("secrets", n)));
            }
            for e in c.get("env").and_then(Value::as_array).into_iter().flatten() {
                refs.extend(
                    name_at(e, "/valueFrom/configMapKeyRef/name").map(|n| ("configmaps", n)),
                );
                refs.extend(name_at(e, "/valueFrom/secretKeyRef/name").map(|n| ("secrets", n)));
            }
        }
    }
    for v in spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        refs.extend(name_at(v, "/configMap/name").map(|n| ("configmaps", n)));
        refs.extend(name_at(v, "/secret/secretName").map(|n| ("secrets", n)));
        refs.extend(name_at(v, "/azureFile/secretName").map(|n| ("secrets", n)));
        refs.extend(name_at(v, "/csi/nodePublishSecretRef/name").map(|n| ("secrets", n)));
        for source in [
            "cephfs",
            "cinder",
            "flexVolume",
            "rbd",
            "scaleIO",
            "iscsi",
            "storageos",
        ] {
            refs.extend(name_at(v, &format!("/{source}/secretRef/name")).map(|n| ("secrets", n)));
        }
        for p in v
            .pointer("/projected/sources")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            refs.extend(name_at(p, "/configMap/name").map(|n| ("configmaps", n)));
            refs.extend(name_at(p, "/secret/name").map(|n| ("secrets", n)));
        }
    }
    let mut keys: Vec<Key> = refs
        .into_iter()
        .map(|(plural, name)| (plural.to_string(), ns.to_string(), name.to_string()))
        .collect();
    keys.sort();
    keys.dedup();
    Some((node.to_string(), keys))
}

impl Kubelets {
    /// A change of the store, after it was applied to `objects`: pods register and
    /// unregister with their kubelet; a ConfigMap or Secret write is sent to every
    /// kubelet watching it and charged to `meter`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn observe(
        &mut self,
        objects: &BTreeMap<Key, Value>,
        meter: &Meter,
        key: &Key,
        event: &str,
        obj: &Value,
        size: u64,
        rv: u64,
    ) {
        match key.0.as_str() {
            "pods" => {
                let now = if event == "DELETED" {
                    None
                } else {
                    references(obj)
                };
                let pod = (key.1.clone(), key.2.clone());
                if let Some((node, refs)) = self.pods.remove(&pod) {
                    for r in refs {
                        self.unregister(&node, r);
                    }
                }
                if let Some((node, refs)) = now {
                    for r in &refs {
                        let stopped = objects.get(r).is_some_and(immutable);
                        self.register(&node, r.clone(), stopped);
                    }
                    self.pods.insert(pod, (node, refs));
                }
            }
            "configmaps" | "secrets" => {
                let mut kubelets = 0;
                if let Some(nodes) = self.watches.get_mut(key) {
                    for w in nodes.values_mut().filter(|w| !w.stopped) {
                        kubelets += 1;
                        if event != "DELETED" && immutable(obj) {
                            w.stopped = true;
                            self.open -= 1;
                        }
                    }
                }
                meter.fanout(
                    format!("{}/{}/{}", key.0, key.1, key.2),
                    Fanout {
                        event: event.to_string(),
                        resource_version: rv.to_string(),
                        object_bytes: size,
                        kubelets,
                        bytes: size * kubelets,
                    },
                );
            }
            _ => return,
        }
        meter.set_open_watches(self.open);
    }

    fn register(&mut self, node: &str, key: Key, stopped: bool) {
        let nodes = self.watches.entry(key).or_default();
        let w = nodes.entry(node.to_string()).or_insert_with(|| {
            if !stopped {
                self.open += 1;
            }
            Watch { pods: 0, stopped }
        });
        w.pods += 1;
    }

    fn unregister(&mut self, node: &str, key: Key) {
        let Some(nodes) = self.watches.get_mut(&key) else {
            return;
        };
        if let Some(w) = nodes.get_mut(node) {
            w.pods -= 1;
            if w.pods == 0 {
                if !w.stopped {
                    self.open -= 1;
                }
                nodes.remove(node);
            }
        }
        if nodes.is_empty() {
            self.watches.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_reference_upstream_visits() {
        let pod = json!({"metadata": {"namespace": "ns"}, "spec": {"nodeName": "n1",
            "imagePullSecrets": [{"name": "pull"}],
            "initContainers": [{"envFrom": [{"configMapRef": {"name": "init-cm"}}]}],
            "containers": [{"env": [
                {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "env-cm", "key": "k"}}},
                {"name": "B", "valueFrom": {"secretKeyRef": {"name": "env-s", "key": "k"}}},
                {"name": "C", "value": "plain"}],
                "envFrom": [{"secretRef": {"name": "envfrom-s"}}]}],
            "ephemeralContainers": [{"envFrom": [{"configMapRef": {"name": "eph-cm"}}]}],
            "volumes": [
                {"name": "a", "configMap": {"name": "vol-cm"}},
                {"name": "b", "secret": {"secretName": "vol-s"}},
                {"name": "c", "projected": {"sources": [{"configMap": {"name": "proj-cm"}}, {"secret": {"name": "proj-s"}}, {"serviceAccountToken": {"path": "t"}}]}},
                {"name": "d", "csi": {"driver": "x", "nodePublishSecretRef": {"name": "csi-s"}}},
                {"name": "e", "configMap": {"name": "vol-cm"}}]}});
        let (node, refs) = references(&pod).unwrap();
        assert_eq!(node, "n1");
        let names: Vec<String> = refs.iter().map(|(p, _, n)| format!("{p}/{n}")).collect();
        assert_eq!(
            names,
            [
                "configmaps/env-cm",
                "configmaps/eph-cm",
                "configmaps/init-cm",
                "configmaps/proj-cm",
                "configmaps/vol-cm",
                "secrets/csi-s",
                "secrets/env-s",
                "secrets/envfrom-s",
                "secrets/proj-s",
                "secrets/pull",
                "secrets/vol-s"
            ]
        );
        assert!(refs.iter().all(|(_, ns, _)| ns == "ns"));
        let mut done = pod.clone();
        done["status"] = json!({"phase": "Succeeded"});
        assert!(references(&done).is_none());
        let mut unbound = pod.clone();
        unbound["spec"]["nodeName"] = json!("");
        assert!(references(&unbound).is_none());
    }

    #[test]
    fn one_watch_per_node_and_object() {
        let meter = Meter::default();
        let mut k = Kubelets::default();
        let objects = BTreeMap::new();
        let pod = |name: &str, node: &str| {
            json!({"metadata": {"name": name, "namespace": "d"},
                "spec": {"nodeName": node, "volumes": [{"name": "v", "configMap": {"name": "cm"}}]}})
        };
        let key = |p: &str, n: &str| (p.to_string(), "d".to_string(), n.to_string());
        for (name, node) in [("a", "n1"), ("b", "n1"), ("c", "n2")] {
            k.observe(
                &objects,
                &meter,
                &key("pods", name),
                "ADDED",
                &pod(name, node),
                0,
                1,
            );
        }
        assert_eq!(meter.snapshot().kubelet_open_watches, 2);
        let cm = json!({"data": {"k": "v"}});
        k.observe(
            &objects,
            &meter,
            &key("configmaps", "cm"),
            "MODIFIED",
            &cm,
            100,
            2,
        );
        let f = meter
            .snapshot()
            .last_fanout("configmaps", "d", "cm")
            .cloned()
            .unwrap();
        assert_eq!((f.kubelets, f.bytes), (2, 200));
        k.observe(
            &objects,
            &meter,
            &key("pods", "c"),
            "DELETED",
            &pod("c", "n2"),
            0,
            3,
        );
        k.observe(
            &objects,
            &meter,
            &key("pods", "a"),
            "DELETED",
            &pod("a", "n1"),
            0,
            4,
        );
        assert_eq!(
            meter.snapshot().kubelet_open_watches,
            1,
            "n1 still has pod b"
        );
        let sealed = json!({"immutable": true, "data": {"k": "v"}});
        k.observe(
            &objects,
            &meter,
            &key("configmaps", "cm"),
            "MODIFIED",
            &sealed,
            90,
            5,
        );
        assert_eq!(
            meter
                .snapshot()
                .last_fanout("configmaps", "d", "cm")
                .unwrap()
                .kubelets,
            1
        );
        assert_eq!(
            meter.snapshot().kubelet_open_watches,
            0,
            "stopped once read immutable"
        );
        k.observe(
            &objects,
            &meter,
            &key("configmaps", "cm"),
            "MODIFIED",
            &sealed,
            90,
            6,
        );
        assert_eq!(
            meter
                .snapshot()
                .last_fanout("configmaps", "d", "cm")
                .unwrap()
                .kubelets,
            0
        );
        k.observe(
            &objects,
            &meter,
            &key("pods", "b"),
            "DELETED",
            &pod("b", "n1"),
            0,
            7,
        );
        assert!(k.watches.is_empty() && k.pods.is_empty() && k.open == 0);
    }
}
