//! The remediation side of [`Metrics`]: actions, quarantines, the intake and
//! notifications.

use super::labels::{
    ActionLabel, ActionLabels, CodeLabel, IntakeLabel, IntakeResult, IsolatedLabels, ResultLabel,
};
use super::{Action, ActionResult, Metrics};

impl Metrics {
    /// A remediation action ended: `ok`, `error`, `held-back`, `dry-run`, ...
    pub fn action(&self, action: Action, result: ActionResult) {
        self.actions
            .get_or_create(&ActionLabels { action, result })
            .inc();
    }

    /// How long a remediation pass took.
    pub fn action_time(&self, action: Action, secs: f64) {
        self.action_seconds
            .get_or_create(&ActionLabel { action })
            .observe(secs);
    }

    /// Quarantined nodes and devices, as last listed.
    pub fn set_quarantined(&self, nodes: usize, devices: usize) {
        self.quarantined_nodes.set(nodes as i64);
        self.quarantined_devices.set(devices as i64);
    }

    /// Nodes held back by a budget now.
    pub fn set_held_back(&self, n: usize) {
        self.held_back.set(n as i64);
    }

    /// The breaker's state.
    pub fn set_breaker(&self, open: bool) {
        self.breaker_open.set(open as i64);
    }

    /// An intake answer.
    pub fn intake_response(&self, code: u16) {
        self.intake_responses
            .get_or_create(&CodeLabel { code })
            .inc();
    }

    /// An alert's outcome.
    pub fn intake_alert(&self, result: IntakeResult) {
        self.intake_alerts
            .get_or_create(&IntakeLabel { result })
            .inc();
    }

    /// A notification's outcome.
    pub fn notification(&self, result: crate::notify::Delivery) {
        self.notifications
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// The devices quarantines keep from new work, as last listed: (node, driver or
    /// resource, how: `device-taint-rule`, `device-plugin`, `node-taint`, ...) and how
    /// many. Replaced whole: a released node's series go.
    pub fn set_devices_isolated(&self, counts: &[(String, String, String, usize)]) {
        self.devices_isolated.clear();
        for (node, driver, by, n) in counts {
            self.devices_isolated
                .get_or_create(&IsolatedLabels {
                    node: node.clone(),
                    driver: driver.clone(),
                    by: by.clone(),
                })
                .set(*n as i64);
        }
    }
}
