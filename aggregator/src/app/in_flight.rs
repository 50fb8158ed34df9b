//! The nodes with a remediation pass running: one pass per node at a time, its turn
//! given back when the pass ends, however it ends.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use faultline_common::sync::Locked;

/// The nodes with a pass running: one pass per node at a time.
#[derive(Clone, Default)]
pub struct InFlight(Arc<Mutex<BTreeSet<String>>>);

/// A node's turn, given back when dropped (however the pass ends).
pub struct Slot(InFlight, String);

impl InFlight {
    /// The node's turn, unless a pass of it is running.
    pub fn take(&self, node: &str) -> Option<Slot> {
        self.0
            .locked()
            .insert(node.to_string())
            .then(|| Slot(self.clone(), node.to_string()))
    }

    /// Passes running now.
    pub fn len(&self) -> usize {
        self.0.locked().len()
    }

    /// Whether a pass of `node` is running.
    pub fn busy(&self, node: &str) -> bool {
        self.0.locked().contains(node)
    }

    /// Whether no pass is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        (self.0).0.locked().remove(&self.1);
    }
}
