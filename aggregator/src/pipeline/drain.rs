//! What a node's remediation pass tells the pipeline to publish in its entry: the
//! drain intents and how its quarantined devices are kept from new work; and the
//! drain acknowledgements its agent carries.

use faultline_common::fault::DrainNotice;

use super::node::Marks;
use super::Pipeline;

impl Pipeline {
    /// The drain intents to publish for node `name` (from its remediation pass):
    /// whether its entry changed.
    pub fn set_drain(&mut self, name: &str, notices: Vec<DrainNotice>, now_ms: u64) -> bool {
        let Some(n) = self.nodes.get_mut(name) else {
            return false;
        };
        if n.drain.as_ref().map_or(&[][..], |d| &d.notices[..]) == notices.as_slice() {
            return false;
        }
        n.drain.get_or_insert_with(Default::default).notices = notices;
        n.changed_ms = now_ms;
        true
    }

    /// How node `name`'s quarantined devices are kept from new work, as its
    /// remediation pass found the record; whether that changed what is published.
    pub fn set_marks(&mut self, name: &str, marks: Marks, now_ms: u64) -> bool {
        let Some(n) = self.nodes.get_mut(name) else {
            return false;
        };
        if n.drain.as_ref().map_or(&[][..], |d| &d.marks[..]) == marks.as_slice() {
            return false;
        }
        n.drain.get_or_insert_with(Default::default).marks = marks;
        n.changed_ms = now_ms;
        true
    }

    /// The drain acknowledgements node `name`'s agent carries: (pod UID, the
    /// acknowledged intent's `requested`).
    pub fn drain_acks(&self, name: &str) -> Vec<(String, String)> {
        self.nodes
            .get(name)
            .and_then(|n| n.drain.as_ref())
            .map(|d| d.acks.clone())
            .unwrap_or_default()
    }
}
