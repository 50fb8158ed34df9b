//! Telling people what remediation did: Events on the Node (and on each evicted Pod),
//! one structured audit line per action, webhook notifications, and the set of
//! announcements known to be made, so nothing is announced twice.
//!
//! An Event's name is derived from the node, its reason and a key, so a pass that
//! repeats (after an error, a timeout or a leader change) meets a 409 and announces
//! nothing twice. Announcing is best effort: a failing Events API is logged and
//! counted, never stops a pass.
//!
//! What can repeat without bound (alerts naming devices nobody reports) is
//! one Event per node and reason whose `count` and `lastTimestamp` are patched, at most
//! once a minute, as client-go aggregates similar Events
//! (staging/src/k8s.io/client-go/tools/record/events_cache.go, `eventObserve`: a repeat
//! patches the existing Event's count instead of creating another).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::fault::fnv1a64;
use faultline_common::sync::Locked;
use faultline_common::time::now_rfc3339;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};

use super::record::describe;
use crate::metrics::{Action, ActionResult, Metrics};
use crate::model::RecordDevice;
use crate::notify::{Notification, Notifier, Severity};

/// Announcements known to be recorded at most (then the set starts over).
const ANNOUNCED_MAX: usize = 10_000;

/// An aggregated Event's count is written at most this often.
const REPEAT_WRITE_MS: u64 = 60_000;

/// How often an aggregated Event repeated, and what its object says so far.
#[derive(Debug, Clone, Copy)]
struct Repeat {
    /// Occurrences counted (the Event's first included).
    count: i32,
    /// When its count was last written (ms since the epoch).
    written_ms: u64,
}

/// Events, audit lines, notifications and the metrics of actions.
pub struct Announcer {
    client: kube::Client,
    events: Api<Event>,
    actor: String,
    notifier: Option<Arc<Notifier>>,
    metrics: Option<Arc<Metrics>>,
    /// Names of the Events known to be recorded (not sent again); owned here.
    announced: Mutex<HashSet<String>>,
    /// Aggregated Events by name (at most [`ANNOUNCED_MAX`]); owned here.
    repeats: Mutex<HashMap<String, Repeat>>,
}

/// One structured audit line per action (target `faultline::audit`): the action, the
/// node, each device with its UUID, bus id and reason, the actor and the object acted on.
pub fn audit(action: &str, node: &str, devices: &[RecordDevice], actor: &str, object: &str) {
    let devices = serde_json::to_string(devices).unwrap_or_default();
    tracing::warn!(
        target: "faultline::audit",
        action, node, devices = %devices, actor, object, source = "faultline-aggregator", at = %now_rfc3339(),
        "remediation action"
    );
}

impl Announcer {
    /// Node Events go to `event_namespace`, reported by `actor`.
    pub fn new(client: kube::Client, event_namespace: &str, actor: &str) -> Self {
        Announcer {
            events: Api::namespaced(client.clone(), event_namespace),
            client,
            actor: actor.to_string(),
            notifier: None,
            metrics: None,
            announced: Default::default(),
            repeats: Default::default(),
        }
    }

    /// Where announcements go besides Events, and where actions are counted.
    pub fn with_reporting(
        mut self,
        notifier: Option<Arc<Notifier>>,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        self.notifier = notifier;
        self.metrics = metrics;
        self
    }

    /// Count an action's result.
    pub fn metric(&self, action: Action, result: ActionResult) {
        if let Some(m) = &self.metrics {
            m.action(action, result);
        }
    }

    /// Count how long an action's pass took.
    pub fn action_time(&self, action: Action, secs: f64) {
        if let Some(m) = &self.metrics {
            m.action_time(action, secs);
        }
    }

    /// The metrics, where there are some.
    pub fn metrics(&self) -> Option<&Arc<Metrics>> {
        self.metrics.as_ref()
    }

    /// The name of the Node Event for `reason` and `key`.
    fn event_name(node: &str, reason: &str, key: &str) -> String {
        format!(
            "{node}.faultline.{:016x}",
            fnv1a64(format!("{reason}\0{key}").as_bytes())
        )
    }

    /// Announce something that may repeat without bound: one Event per node and
    /// `reason` (and one notification), whose count, last time and message a repeat
    /// updates, at most once a minute. Whether this call created the Event.
    pub async fn repeated_event(
        &self,
        node: &str,
        reason: &str,
        message: String,
        warning: bool,
        devices: &[RecordDevice],
    ) -> bool {
        let name = Self::event_name(node, reason, "repeated");
        if !self.known(&name) {
            let created = self
                .event(node, reason, "repeated", message, warning, devices)
                .await;
            if self.known(&name) {
                // The first repeat is written at once (the Event then says it repeats),
                // the later ones at most once a minute.
                self.repeats.locked().insert(
                    name,
                    Repeat {
                        count: 1,
                        written_ms: 0,
                    },
                );
            }
            return created;
        }
        let now = faultline_common::time::now_ms();
        let due = {
            let mut repeats = self.repeats.locked();
            if repeats.len() >= ANNOUNCED_MAX && !repeats.contains_key(&name) {
                repeats.clear();
            }
            // Recorded by another replica (or before the map started over): counted
            // from here.
            let r = repeats.entry(name.clone()).or_insert(Repeat {
                count: 1,
                written_ms: 0,
            });
            r.count = r.count.saturating_add(1);
            (now.saturating_sub(r.written_ms) >= REPEAT_WRITE_MS).then(|| {
                r.written_ms = now;
                r.count
            })
        };
        let Some(count) = due else {
            return false;
        };
        let patch = serde_json::json!({
            "count": count,
            "lastTimestamp": Time(Timestamp::now()),
            "message": message,
        });
        match self
            .events
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => tracing::debug!(node, reason, count, "aggregated Event counted"),
            Err(e) => {
                self.metric(Action::Event, ActionResult::Error);
                tracing::warn!(node, reason, error = %e, "cannot count the repeat on the Event; a later repeat tries again");
            }
        }
        false
    }

    /// Announce on the Node: one Event (and one notification) per `key`. Whether this
    /// call created it.
    pub async fn event(
        &self,
        node: &str,
        reason: &str,
        key: &str,
        message: String,
        warning: bool,
        devices: &[RecordDevice],
    ) -> bool {
        let name = Self::event_name(node, reason, key);
        if self.known(&name) {
            return false;
        }
        let ev = self.event_object(
            name.clone(),
            // `kubectl describe node` finds a Node's Events by kind, name, namespace and
            // uid, trying the Node's uid and its name (what the kubelet uses as the uid:
            // staging/src/k8s.io/kubectl/pkg/describe/describe.go, NodeDescriber).
            ObjectReference {
                kind: Some("Node".into()),
                name: Some(node.to_string()),
                uid: Some(node.to_string()),
                api_version: Some("v1".into()),
                ..Default::default()
            },
            reason,
            message.clone(),
            warning,
        );
        let mut created = false;
        for attempt in 0..3u32 {
            match self.events.create(&PostParams::default(), &ev).await {
                Ok(_) => {
                    created = true;
                    break;
                }
                Err(kube::Error::Api(e)) if e.code == 409 => break,
                Err(e) => {
                    if attempt == 2 {
                        // Not known to be recorded: the next pass that reaches this
                        // point tries again (the name keeps it to one).
                        self.metric(Action::Event, ActionResult::Error);
                        tracing::warn!(node, reason, error = %e, "cannot record the Event; the next pass retries");
                        return false;
                    }
                    tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                }
            }
        }
        self.remember(name);
        if created {
            if let Some(n) = &self.notifier {
                n.send(Notification {
                    kind: reason.to_string(),
                    severity: if warning {
                        Severity::Warning
                    } else {
                        Severity::Info
                    },
                    node: node.to_string(),
                    devices: devices.to_vec(),
                    message,
                    actor: self.actor.clone(),
                    at: now_rfc3339(),
                });
            }
        }
        created
    }

    fn known(&self, name: &str) -> bool {
        self.announced.locked().contains(name)
    }

    fn remember(&self, name: String) {
        let mut a = self.announced.locked();
        if a.len() > ANNOUNCED_MAX {
            a.clear();
        }
        a.insert(name);
    }

    /// An Event named `name` about `object`, reported by this replica.
    fn event_object(
        &self,
        name: String,
        object: ObjectReference,
        reason: &str,
        message: String,
        warning: bool,
    ) -> Event {
        let t = Time(Timestamp::now());
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                ..Default::default()
            },
            involved_object: object,
            reason: Some(reason.to_string()),
            message: Some(message),
            type_: Some(if warning { "Warning" } else { "Normal" }.into()),
            source: Some(EventSource {
                component: Some("faultline-aggregator".into()),
                host: None,
            }),
            first_timestamp: Some(t.clone()),
            last_timestamp: Some(t),
            count: Some(1),
            reporting_component: Some("faultline-aggregator".into()),
            reporting_instance: Some(self.actor.clone()),
            ..Default::default()
        }
    }

    /// The Event on the evicted Pod itself (its owners see it with `kubectl describe`).
    /// Best effort and named by the pod's UID, like the Node's Events.
    pub async fn pod_event(&self, pod: &Pod, devices: &[RecordDevice]) {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .unwrap_or("");
        let message = format!("evicted from {node}: {}", describe(devices));
        self.pod_note(pod, "FaultlineEvicted", "evicted", message)
            .await;
    }

    /// An Event on the pod itself, once per pod and `tag` (its name says so).
    pub async fn pod_note(&self, pod: &Pod, reason: &str, tag: &str, message: String) {
        let (Some(name), Some(ns)) = (
            pod.metadata.name.as_deref(),
            pod.metadata.namespace.as_deref(),
        ) else {
            return;
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ev = self.event_object(
            format!(
                "{name}.faultline.{:016x}",
                fnv1a64(format!("{tag}\0{uid}").as_bytes())
            ),
            ObjectReference {
                kind: Some("Pod".into()),
                name: Some(name.to_string()),
                namespace: Some(ns.to_string()),
                uid: Some(uid),
                api_version: Some("v1".into()),
                ..Default::default()
            },
            reason,
            message,
            true,
        );
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        match api.create(&PostParams::default(), &ev).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => tracing::debug!(pod = name, error = %e, "cannot record the Pod's Event"),
        }
    }
}
