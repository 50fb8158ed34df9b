//! One write to a Node: a JSON patch that first tests the Node's resourceVersion, so a
//! change made since the pass read it makes the whole patch fail (409, or 422 on the
//! test) instead of being overwritten, and the next pass starts from the live Node.

use k8s_openapi::api::core::v1::{Node, Taint};

use super::record::{
    QuarantineRecord, RECORD_ANNOTATION, RELEASE_ANNOTATION, RELEASE_BY_ANNOTATION,
    RELEASE_REASON_ANNOTATION,
};

/// A JSON patch of a live Node, built op by op (parent maps added where missing).
pub struct NodePatch {
    ops: Vec<serde_json::Value>,
    has_spec: bool,
    has_labels: bool,
    has_annotations: bool,
}

/// A map key as a JSON pointer segment.
pub fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

impl NodePatch {
    /// A patch of `live` that applies only while its resourceVersion is unchanged.
    pub fn on(live: &Node) -> Self {
        NodePatch {
            ops: vec![serde_json::json!({
                "op": "test", "path": "/metadata/resourceVersion", "value": live.metadata.resource_version
            })],
            has_spec: live.spec.is_some(),
            has_labels: live.metadata.labels.is_some(),
            has_annotations: live.metadata.annotations.is_some(),
        }
    }

    fn add(&mut self, path: String, value: serde_json::Value) {
        self.ops
            .push(serde_json::json!({"op": "add", "path": path, "value": value}));
    }

    /// Set the whole taint list.
    pub fn taints(&mut self, taints: &[Taint]) {
        if !std::mem::replace(&mut self.has_spec, true) {
            self.add("/spec".into(), serde_json::json!({}));
        }
        self.add("/spec/taints".into(), serde_json::json!(taints));
    }

    /// Set a label.
    pub fn label(&mut self, key: &str, value: &str) {
        if !std::mem::replace(&mut self.has_labels, true) {
            self.add("/metadata/labels".into(), serde_json::json!({}));
        }
        self.add(
            format!("/metadata/labels/{}", escape(key)),
            serde_json::json!(value),
        );
    }

    /// Remove a label.
    pub fn remove_label(&mut self, key: &str) {
        self.remove(format!("/metadata/labels/{}", escape(key)));
    }

    /// Remove an annotation.
    pub fn remove_annotation(&mut self, key: &str) {
        self.remove(format!("/metadata/annotations/{}", escape(key)));
    }

    fn remove(&mut self, path: String) {
        self.ops
            .push(serde_json::json!({"op": "remove", "path": path}));
    }

    /// Set an annotation.
    pub fn annotation(&mut self, key: &str, value: String) {
        if !std::mem::replace(&mut self.has_annotations, true) {
            self.add("/metadata/annotations".into(), serde_json::json!({}));
        }
        self.add(
            format!("/metadata/annotations/{}", escape(key)),
            serde_json::json!(value),
        );
    }

    /// Write the quarantine record.
    pub fn record(&mut self, record: &QuarantineRecord) {
        self.annotation(RECORD_ANNOTATION, record.to_annotation());
    }

    /// Remove a person's release request from the Node (it has been acted on).
    pub fn clear_request(&mut self, live: &Node) {
        let a = live.metadata.annotations.clone().unwrap_or_default();
        for key in [
            RELEASE_ANNOTATION,
            RELEASE_BY_ANNOTATION,
            RELEASE_REASON_ANNOTATION,
        ] {
            if a.contains_key(key) {
                self.remove_annotation(key);
            }
        }
    }

    /// The patch, for the API.
    pub fn into_patch(self) -> Result<json_patch::Patch, serde_json::Error> {
        serde_json::from_value(serde_json::Value::Array(self.ops))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_the_resource_version_first_and_adds_missing_maps() {
        let mut live = Node::default();
        live.metadata.resource_version = Some("42".into());
        let mut p = NodePatch::on(&live);
        p.label("faultline.io/unhealthy-devices", "gpu3");
        p.label("other", "x");
        p.annotation("a/b~c", "v".into());
        let ops = serde_json::to_value(p.into_patch().unwrap()).unwrap();
        let ops = ops.as_array().unwrap();
        assert_eq!(ops[0]["op"], "test");
        assert_eq!(ops[0]["value"], "42");
        assert_eq!(ops[1]["path"], "/metadata/labels", "the map is added once");
        assert_eq!(
            ops[2]["path"],
            "/metadata/labels/faultline.io~1unhealthy-devices"
        );
        assert_eq!(ops[3]["path"], "/metadata/labels/other");
        assert_eq!(ops[5]["path"], "/metadata/annotations/a~1b~0c");
    }
}
