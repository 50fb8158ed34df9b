#!/usr/bin/env python3
"""The check that each safety guardrail's test can fail: remove the guardrail
(one small source edit), run the test that guards it, expect it to FAIL, restore.

    python3 scripts/guardrail-mutations.py            # all (about 12 minutes on 2 cores, tests built)
    python3 scripts/guardrail-mutations.py breaker    # those whose name contains "breaker"

First a baseline: every test named below must pass on the unmutated tree (exit 2 if
not, or if a mutation's code is no longer found). A mutant counts as caught only when
its test builds, runs at least one test, and a test fails: a build error, a missing
target or a filter that matches nothing is NOT COUNTED. Exit status 1 if any mutation
is not caught (a test that cannot fail). The source is restored after each mutation,
also on Ctrl-C. CI runs it after the tests (.ci/run); each mutation rebuilds one crate.
"""
import pathlib
import os
import re
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (guardrail, file, the code, the code without the guardrail, cargo test arguments)
# The longest one mutant's build and test may take (the slowest baseline is ~1 min
# warm; a cold build of the aggregator's tests ~8).
MUTANT_TIMEOUT = 900

MUTATIONS = [
    ("1 default dry-run: a default install acts",
     "aggregator/src/config/checked.rs",
     "(None, SinkKind::ConfigMap) => Mode::DryRun,",
     "(None, SinkKind::ConfigMap) => Mode::Enforce,",
     ["-p", "faultline-aggregator", "--test", "kubernetes", "a_default_install_is_a_dry_run"]),
    ("2 fencing: a write goes without the shard's Lease",
     "aggregator/src/shard/fence.rs",
     "Kind::Shard { held, shard } => held.admit(*shard).map(Some),",
     "Kind::Shard { .. } => Some(None),",
     ["-p", "faultline-aggregator", "--test", "remediation", "a_replica_without_its_lease_changes_nothing"]),
    ("2 fencing: a write in flight when the hold ends is not given up",
     "aggregator/src/shard/fence.rs",
     "let given_up = tokio::time::timeout(left, call).await;",
     "let given_up = Ok::<_, tokio::time::error::Elapsed>(call.await);",
     ["-p", "faultline-aggregator", "--test", "late_writes", "a_taint_due_to_land_after_the_hold_ended_changes_nothing"]),
    ("2 fencing: a Lease past its renewals still counts as held (no self-expiry)",
     "aggregator/src/shard/held.rs",
     "until.is_some_and(|u| now < u)",
     "until.is_some() || now < now",
     ["-p", "faultline-aggregator", "--test", "kubernetes", "a_replica_whose_renewals_fail_stops_acting_on_its_own_clock"]),
    ("3 breaker: never trips",
     "aggregator/src/remediate/policy.rs",
     "    if failures.len() >= nodes {\n        Noted::Tripped",
     "    if false {\n        Noted::Tripped",
     ["-p", "faultline-aggregator", "--test", "healing", "the_breaker_opens_on_real_failures"]),
    ("3 breaker: the window never expires",
     "aggregator/src/remediate/policy.rs",
     "failures.retain(|_, at| age_secs(at).is_some_and(|a| a <= window_secs));",
     "failures.retain(|_, at| age_secs(at).is_some() || window_secs > 0.0 || at.is_empty());",
     ["-p", "faultline-aggregator", "--test", "healing", "the_breaker_opens_on_real_failures"]),
    ("4 budgets: no budget",
     "aggregator/src/remediate/policy.rs",
     "    let why = budget.refusal(domain, &domains, total);",
     "    let why = budget.refusal(domain, &domains, total).filter(|_| false);",
     ["-p", "faultline-aggregator", "--test", "healing", "a_held_back_node_is_quarantined_once_room_frees"]),
    ("4 budgets: no budget, two replicas isolating at once",
     "aggregator/src/remediate/policy.rs",
     "    let why = budget.refusal(domain, &domains, total);",
     "    let why = budget.refusal(domain, &domains, total).filter(|_| false);",
     ["-p", "faultline-aggregator", "--test", "late_writes", "two_replicas_isolating_at_once_keep_the_budget_exactly"]),
    # Counting the Nodes alone, replicas deciding at once reach B + R - 1.
    ("4 budgets: the ledger's places not counted, two replicas isolating at once",
     "aggregator/src/remediate/policy.rs",
     "    let domains: Vec<Option<String>> = others.chain(reserved).collect();",
     "    let domains: Vec<Option<String>> = others.chain(reserved.take(0)).collect();",
     ["-p", "faultline-aggregator", "--test", "late_writes", "two_replicas_isolating_at_once_keep_the_budget_exactly"]),
    # The schedules check the budget at every step: a count that misses one quarantined
    # node (one over the budget) fails them, takeovers or not (about 2 minutes).
    ("4 budgets: the count misses a node, in the randomized schedules",
     "aggregator/src/remediate/policy.rs",
     "    let why = budget.refusal(domain, &domains, total);",
     "    let why = budget.refusal(domain, &domains[domains.len().min(1)..], total);",
     ["-p", "faultline-aggregator", "--test", "schedules", "randomized_fault_schedules_keep_the_invariants"]),
    ("5 pods: terminating and finished pods are evicted",
     "aggregator/src/remediate/policy.rs",
     "    pod.terminating || pod.finished || pod.mirror || pod.daemon || pod.canary\n}",
     "    (pod.terminating && pod.finished) || pod.mirror || pod.daemon || pod.canary\n}",
     ["-p", "faultline-aggregator", "--test", "remediation", "evicts_only_pods_on_the_failed_device"]),
    ("5 pods: DaemonSet pods are evicted",
     "aggregator/src/remediate/view.rs",
     'o.iter().any(|r| r.kind == "DaemonSet")',
     'o.iter().any(|r| r.kind == "NotADaemonSet")',
     ["-p", "faultline-aggregator", "--test", "remediation", "evicts_only_pods_on_the_failed_device"]),
    ("6 auto release: no cool-down",
     "aggregator/src/remediate/policy.rs",
     "if !record.unknown_only && healthy_for < policy.cooldown {",
     "if !record.unknown_only && healthy_for < Duration::ZERO {",
     ["-p", "faultline-aggregator", "--test", "healing", "auto_release_waits_for_health_cooldown_and_the_canary"]),
    ("7 dedup window: a person's release is undone at once",
     "aggregator/src/remediate/policy.rs",
     "let recent = |at: &str| age_secs_at(at, now_ms).is_some_and(|a| a < window);",
     "let recent = |at: &str| age_secs_at(at, now_ms).is_some_and(|a| a < window * 0.0);",
     ["-p", "faultline-aggregator", "--test", "healing", "a_persons_release_holds_for_the_dedup_window_only"]),
    ("8 agent: --retries ignored",
     "agent/src/sampler.rs",
     "for attempt in 0..=cfg.retries {",
     "for attempt in 0..=0 {",
     ["-p", "faultline-agent", "--test", "vendor_tools", "retries_within_a_sample_and_backoff"]),
    ("8 agent: a rotated or truncated kernel log is not reopened",
     "agent/src/sources/kmsg/source.rs",
     "Ok(m) if m.ino() != ino || m.len() < offset => return Ok(()),",
     "Ok(m) if m.ino() != ino && m.len() < offset => return Ok(()),",
     ["-p", "faultline-agent", "--test", "kmsg", "a_rotated_or_truncated_log_is_reopened"]),
    ("9 write scheduling: an unchanged page rewritten",
     "aggregator/src/publish/configmap.rs",
     "if attempt == 0 && unchanged {",
     "if attempt == 0 && unchanged && false {",
     ["-p", "faultline-aggregator", "--test", "kubernetes", "the_sequence_carries_over_and_a_quiet_shard_is_not_rewritten"]),
    ("10 notifications: nothing is sent",
     "aggregator/src/notify.rs",
     "    pub fn send(&self, n: Notification) {",
     "    pub fn send(&self, n: Notification) {\n        if n.kind.is_empty() || !n.kind.is_empty() {\n            return;\n        }",
     ["-p", "faultline-aggregator", "--test", "healing", "the_binary_notifies_audits_and_stops_on_sigterm"]),
    # The 13 facets that had no mutation.
    ('1 lease margin: a replica acts until the Lease runs out, not margin before',
     'aggregator/src/shard/timing.rs',
     'started + self.duration.saturating_sub(self.margin)',
     'started + self.duration',
     ['-p', 'faultline-aggregator', '--lib', 'a_hold_ends_the_margin_before_the_lease']),
    # The situation the margin is for: a holder cut off from the Lease whose clock runs
    # behind the other replica's (the model's two-clock lab, about 2 minutes).
    ('1 lease margin: a holder on a clock behind acts until the Lease runs out (model)',
     'aggregator/src/shard/timing.rs',
     'started + self.duration.saturating_sub(self.margin)',
     'started + self.duration',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_lease_keeps_one_writer_on_two_clocks']),
    ('1 lease margin: the aggregator configures no margin',
     'aggregator/src/shard/timing.rs',
     'margin: retry + Duration::from_secs(1),',
     'margin: Duration::ZERO,',
     ['-p', 'faultline-aggregator', '--lib', 'a_hold_ends_the_margin_before_the_lease']),
    ('14 kmsg: a rotated log (new inode) is not reopened',
     'agent/src/sources/kmsg/source.rs',
     'Ok(m) if m.ino() != ino || m.len() < offset => return Ok(()),',
     'Ok(m) if m.len() < offset => return Ok(()),',
     ['-p', 'faultline-agent', '--test', 'kmsg', 'a_rotated_or_truncated_log_is_reopened']),
    ("2 fencing: dispatch runs a node's pass without the shard's Lease (no holds_node gate, unfenced pass)",
     'aggregator/src/app/dispatch.rs',
     '            if nothing || !self.shards.holds_node(&node) {\n                continue;\n            }\n            let Some(slot) = self.in_flight.take(&node) else {\n                continue;\n            };\n            let node_name = node.clone();\n            let pass = NodePass {\n                remediator: self.remediator.clone(),\n                fence: self.shards.fence(&node),',
     '            if nothing {\n                continue;\n            }\n            let Some(slot) = self.in_flight.take(&node) else {\n                continue;\n            };\n            let node_name = node.clone();\n            let pass = NodePass {\n                remediator: self.remediator.clone(),\n                fence: Fence::unfenced(),',
     ['-p', 'faultline-aggregator', '--test', 'kubernetes', 'a_replica_whose_renewals_fail_stops_acting_on_its_own_clock']),
    ("2 fencing: an eviction that lands late evicts the judged pod's successor",
     'aggregator/src/remediate/evict.rs',
     '            "deleteOptions": {"preconditions": {"uid": pod.metadata.uid}},',
     '            "deleteOptions": {},',
     ['-p', 'faultline-aggregator', '--test', 'remediation', 'an_eviction_that_lands_late_never_evicts_the_pods_successor']),
    ('4 budgets: max_nodes not enforced (Budget::refusal)',
     'aggregator/src/remediate/policy.rs',
     'if quarantined.len() >= self.max_nodes {',
     'if quarantined.len() >= usize::MAX {',
     ['-p', 'faultline-aggregator', '--lib', 'budget_arithmetic']),
    ('4 budgets: max_percent not enforced (Budget::refusal)',
     'aggregator/src/remediate/policy.rs',
     'if !quarantined.is_empty() && share > self.max_percent {',
     'if !quarantined.is_empty() && share > f64::MAX {',
     ['-p', 'faultline-aggregator', '--lib', 'budget_arithmetic']),
    ('3 breaker: the shared count never trips (policy::note_failure)',
     'aggregator/src/remediate/policy.rs',
     '    if failures.len() >= nodes {\n        Noted::Tripped',
     '    if failures.len() >= usize::MAX {\n        Noted::Tripped',
     ['-p', 'faultline-aggregator', '--test', 'remediation', 'the_breaker_counts_across_replicas_and_restarts']),
    ('3 breaker: the count is not shared (each replica ignores the stored failures)',
     'aggregator/src/remediate/guards.rs',
     '            failures: data\n                .get("failures")\n                .and_then(|f| serde_json::from_str(f).ok())\n                .unwrap_or_default(),',
     '            failures: BTreeMap::new(),',
     ['-p', 'faultline-aggregator', '--test', 'remediation', 'the_breaker_counts_across_replicas_and_restarts']),
    ('6 canary: no cool-down after a failed canary (unit)',
     'aggregator/src/remediate/policy.rs',
     '(waited < cooldown.as_secs_f64()).then(|| {',
     '(waited < 0.0 * cooldown.as_secs_f64()).then(|| {',
     ['-p', 'faultline-aggregator', '--lib', 'how_a_canary_stands']),
    ('6 canary: no cool-down after a failed canary (end to end)',
     'aggregator/src/remediate/policy.rs',
     '(waited < cooldown.as_secs_f64()).then(|| {',
     '(waited < 0.0 * cooldown.as_secs_f64()).then(|| {',
     ['-p', 'faultline-aggregator', '--test', 'healing', 'auto_release_waits_for_health_cooldown_and_the_canary']),
    ('7 intake: one alert acts (threshold N ignored)',
     'aggregator/src/ingest/intake/gate.rs',
     'if q.len() < threshold {',
     'if q.len() < threshold.min(1) {',
     ['-p', 'faultline-aggregator', '--lib', 'n_within_w_then_duplicates']),
    ('7 intake: the N-within-W window never runs out',
     'aggregator/src/ingest/intake/gate.rs',
     '            counts.expire(now, self.cfg.window);\n            if !counts.contains_key(&key) {\n                evicted += counts.make_room(MAX_KEYS);\n            }\n            let q = counts.touch(key.clone(), now, Seen::new);\n            while q\n                .front()\n                .is_some_and(|(t, _)| now.duration_since(*t) >= self.cfg.window)\n            {\n                q.pop_front();',
     '            counts.expire(now, Duration::MAX);\n            if !counts.contains_key(&key) {\n                evicted += counts.make_room(MAX_KEYS);\n            }\n            let q = counts.touch(key.clone(), now, Seen::new);\n            while q\n                .front()\n                .is_some_and(|(t, _)| now.duration_since(*t) >= Duration::MAX)\n            {\n                q.pop_front();',
     ['-p', 'faultline-aggregator', '--lib', 'the_counting_window_and_the_dedup_window_expire']),
    ("8 agent: a warming source's first reading is kept",
     'agent/src/sampler.rs',
     'let mut discarded_first = !warm_up;',
     'let mut discarded_first = !warm_up || true;',
     ['-p', 'faultline-agent', '--lib', 'the_first_reading_of_a_warming_source_is_discarded']),
    ('7 intake: every alert for a node that does not exist costs a Node GET',
     'aggregator/src/remediate/remediator.rs',
     '            if !g.take(now) {',
     '            if !g.take(now) && false {',
     ['-p', 'faultline-aggregator', '--test', 'adversarial', 'every_hostile_input_at_once_moves_nothing_but_the_real_fault']),
    ('8 agent: an escalator keeps the history of a code long gone, for ever',
     'common/src/ascend_escalation.rs',
     '            s.present || s.by_frequency || s.by_duration || !s.occurrences.is_empty()',
     '            true',
     ['-p', 'faultline-common', '--lib', 'histories_are_kept_only_for_codes_seen']),
    ("8 agent: an untrusted text log's Xid fails a GPU by time in the aggregator",
     'common/src/state.rs',
     '                    let may_fail = !reasons.iter().all(|r| crate::xid::degrade_only(r));',
     '                    let may_fail = true;',
     ['-p', 'faultline-common', '--lib', 'a_reason_that_may_only_degrade_never_fails_by_time']),
    ('9 agent: no backoff when a source cannot start',
     'agent/src/sampler.rs',
     'backoff = (backoff * 2).min(Duration::from_secs(60));',
     'backoff = backoff.min(Duration::from_secs(60));',
     ['-p', 'faultline-agent', '--test', 'vendor_tools', 'retries_within_a_sample_and_backoff']),
    ('10 write scheduling: urgent writes of a shard not spaced',
     'aggregator/src/app/schedule.rs',
     '.map(|t| *t + self.timing.urgent_spacing)',
     '.map(|t| *t + self.timing.urgent_spacing * 0)',
     ['-p', 'faultline-aggregator', '--lib', 'a_failed_device_gets_a_write_of_its_own_after_the_spacing']),
    ("10 write scheduling: the file sink's urgent write not spaced",
     'aggregator/src/app/schedule.rs',
     'last + t.urgent_spacing',
     'last + t.urgent_spacing * 0',
     ['-p', 'faultline-aggregator', '--lib', 'write_scheduling']),
    ('11 nudges: --nudge-rate ignored',
     'aggregator/src/publish/nudge.rs',
     'if b.tokens >= 1.0 {',
     'if b.tokens >= 1.0 || self.rate > 0.0 {',
     ['-p', 'faultline-aggregator', '--test', 'kubernetes', 'nudges_keep_to_their_rate_and_selector']),
    ('11 nudges: --nudge-selector ignored',
     'aggregator/src/publish/nudge.rs',
     '        if !self.selector.is_empty() {\n            lp = lp.labels(&self.selector);\n        }',
     '        if self.selector.is_empty() && !self.selector.is_empty() {\n            lp = lp.labels(&self.selector);\n        }',
     ['-p', 'faultline-aggregator', '--test', 'kubernetes', 'nudges_keep_to_their_rate_and_selector']),
    ('12 lease: held shard Leases not released on stop',
     'aggregator/src/shard/lease.rs',
     '        for shard in held {',
     '        for shard in held.into_iter().take(0) {',
     ['-p', 'faultline-aggregator', '--test', 'healing', 'a_graceful_stop_finishes_the_pass_in_flight_then_releases_the_lease']),
    ('13 unknown guard: runs while standing down',
     'aggregator/src/app/dispatch.rs',
     '        if !self.standing_down {\n            self.guard_unknown(pipeline);\n        }',
     '        self.guard_unknown(pipeline);',
     ['-p', 'faultline-aggregator', '--test', 'kubernetes', 'an_agent_gone_past_the_tolerance_gets_a_noschedule_taint_and_no_eviction']),
    ('13 unknown guard: never stands down',
     'aggregator/src/app/dispatch.rs',
     'total > 0 && (total - reachable) as f64 > self.standdown_share * total as f64',
     'total > 0 && (total - reachable) as f64 > self.standdown_share * total as f64 && false',
     ['-p', 'faultline-aggregator', '--test', 'kubernetes', 'an_agent_gone_past_the_tolerance_gets_a_noschedule_taint_and_no_eviction']),
    ('13 unknown guard: its taint does not lift by itself under --release manual',
     'aggregator/src/remediate/policy.rs',
     'if !record.unknown_only && !policy.auto {',
     'if !policy.auto {',
     ['-p', 'faultline-aggregator', '--test', 'remediation', 'an_unknown_only_taint_lifts_once_the_devices_are_healthy']),
    ("3 breaker: the shared count's replace is not a compare-and-swap",
     'aggregator/src/remediate/ledger.rs',
     '        Some(mut cm) => {\n            cm.data = Some(data);',
     '        Some(mut cm) => {\n            cm.data = Some(data);\n            cm.metadata.resource_version = None;',
     ['-p', 'faultline-aggregator', '--test', 'remediation', 'the_breaker_counts_across_replicas_and_restarts']),
    ('4 budgets: a node the unknown guard tainted is quarantined without asking the budget',
     'aggregator/src/remediate/isolate.rs',
     'Some(r) => r.unknown_only || !r.node_scoped(),',
     'Some(_) => false,',
     ['-p', 'faultline-aggregator', '--test', 'remediation', 'a_node_tainted_for_unknown_devices_asks_the_budget_when_a_device_fails']),
    ('2 fencing: a release hands the shard over with a write of the old holder in flight',
     'aggregator/src/shard/lease.rs',
     '        self.drain(&held).await;',
     '',
     ['-p', 'faultline-aggregator', '--test', 'schedules', 'a_release_waits_out_the_margin_after_a_write_went']),
    # The randomized schedules judge this one (200 of them, about 2 minutes): only a lagging
    # watch cache after a record write that did not land shows the pod again.
    ('5 pods: a pod listed from a lagging watch cache is evicted again, unread',
     'aggregator/src/remediate/evict.rs',
     '            if !self.still_runs(pod).await? {',
     '            if !self.still_runs(pod).await? && false {',
     ['-p', 'faultline-aggregator', '--test', 'schedules', 'randomized_fault_schedules_keep_the_invariants']),
    ('11 discovery: an agent away takes its node out of the published shard',
     'aggregator/src/ingest/endpoints.rs',
     '        f.follow_keeping(wanted, &away.keep()).await;',
     '        f.follow_keeping(wanted, &BTreeSet::new()).await;',
     ['-p', 'faultline-aggregator', '--test', 'real_cluster', 'an_agent_rollout_keeps_every_node_published_1_37']),
    ('12 device path: a holder that tolerates the taint for good is counted',
     'aggregator/src/device_taint/index.rs',
     '        .filter(|c| tolerates_forever(c, device, key, value))',
     '        .filter(|c| tolerates_forever(c, device, key, value) && c.is_null())',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_holder_that_tolerates_the_taint_is_left_and_the_gpu_taken_out']),
    ('12 device path: a stale prediction is never asked again',
     'aggregator/src/remediate/prediction.rs',
     '                Prediction::Disagrees { .. } if !asked_again => {',
     '                Prediction::Disagrees { .. } if asked_again && !asked_again => {',
     ['-p', 'faultline-aggregator', '--test', 'real_cluster', 'a_stale_prediction_is_asked_again_1_37']),
    ('15 supervision: a core loop that panics leaves its Leases held',
     'aggregator/src/app/supervise.rs',
     '        let _release = lease_cancel.drop_guard();',
     '        let _release = lease_cancel;',
     ['-p', 'faultline-aggregator', '--lib', 'a_panic_in_the_core_loop_releases_the_leases_and_fails']),
    ('15 supervision: a Lease loop that dies leaves the replica running',
     'common/src/supervise.rs',
     '        Ok(()) => Err(Stopped::Ended { part }),',
     '        Ok(()) => Ok(()),',
     ['-p', 'faultline-aggregator', '--lib', 'a_core_loop_that_ends_on_its_own_fails']),
    ("16 tenancy: the pods' port shows a pod the other pods' drain intents",
     'agent/src/fault_api.rs',
     '        doc.drain.retain(|n| from.is_some_and(|ip| lists(n, ip)));',
     '        let _ = from;',
     ['-p', 'faultline-aggregator', '--test', 'drain', 'a_warned_pod_is_evicted_at_its_acknowledgement_or_its_deadline_never_before']),
    ("16 tenancy: a publish namespace's copy lists other namespaces' pods",
     'aggregator/src/app/wiring.rs',
     '                sink.with_drains_of(ns)',
     '                sink',
     ['-p', 'faultline-aggregator', '--test', 'drain', 'a_warned_pod_is_evicted_at_its_acknowledgement_or_its_deadline_never_before']),
    ("17 delivery trust: an agent takes a delivery without the aggregator's signature",
     'agent/src/verdict.rs',
     '                .map_err(Refused::Unsigned),',
     '                .or(Ok(Checked::Signed)),',
     ['-p', 'faultline-aggregator', '--test', 'delivery', 'a_neighbours_credentials_cannot_set_a_verdict_and_keys_rotate_live']),
    ("17 delivery trust: a recorded signed message is taken again",
     'agent/src/verdict.rs',
     '            if sent <= last {',
     '            if sent < last && sent > last {',
     ['-p', 'faultline-agent', '--lib', 'a_signed_message_cannot_be_played_again_here_or_elsewhere']),
    ("17 delivery trust: the aggregator's kept-alive connection closed between confirmations",
     'common/src/server.rs',
     '                let head_limit = if activity.trusted.load(Ordering::Relaxed) {\n                    limits.idle_timeout',
     '                let head_limit = if activity.trusted.load(Ordering::Relaxed) {\n                    limits.header_timeout',
     # The flood test itself no longer tells: a closed delivery connection now takes
     # a crowd connection's slot again (make_room). The server's own test does.
     ['-p', 'faultline-common', '--features', 'server', '--lib', 'a_trusted_connection_is_kept_between_its_requests']),
    ("17 delivery trust: a crowd of slow heads keeps the pods' reads out",
     'common/src/server.rs',
     '                Err(_) => match make_room(&open, &peers, peer.ip()) {',
     '                Err(_) => match None::<tokio::sync::OwnedSemaphorePermit> {',
     ['-p', 'faultline-aggregator', '--test', 'delivery', 'the_pods_port_answers_its_pods_through_a_connection_flood']),
    ("17 delivery trust: an agent without its delivery Secret does not start",
     'agent/src/verdict.rs',
     '        Reloaded::load_or(path, faultline_common::seal::token, Vec::new())',
     '        Reloaded::load(path, faultline_common::seal::token)',
     ['-p', 'faultline-agent', '--lib', 'a_token_file_not_there_yet_refuses_all_until_it_appears']),
    ("17 delivery trust: an empty bearer matches a token not there yet",
     'agent/src/verdict.rs',
     '            !held.is_empty() && same_secret(got, &held)',
     '            same_secret(got, &held)',
     ['-p', 'faultline-agent', '--lib', 'a_token_file_not_there_yet_refuses_all_until_it_appears']),
    ("18 device path: a rule waits at None for ever, the failed GPU in service",
     'aggregator/src/remediate/device.rs',
     '        if let Some((device, rule, why)) = overdue {',
     '        if let Some((device, rule, why)) = overdue.filter(|_| false) {',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_prediction_that_never_comes_takes_the_node_path_at_its_deadline']),
    ("18 device path: a prediction in other words read as none yet, the rule waiting",
     'aggregator/src/remediate/device.rs',
     '                    overdue.get_or_insert((r.id.clone(), r.rule.clone(), why));',
     '                    drop(why);',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_prediction_that_cannot_be_read_takes_the_node_path_at_once']),
    ("18 device path: after a GPU swap the canary asks for the old UUID, never allocated",
     'aggregator/src/remediate/device_canary.rs',
     '                    Some(now) if now != r.uuid => {',
     '                    Some(now) if now != now => {',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'after_a_gpu_swap_the_canary_tests_the_new_gpu_in_the_slot']),
    ("18 device path: claims found missing read again every pass, for ever",
     'aggregator/src/device_taint/claims.rs',
     '            if !known_missing(c) && seen.insert(c.clone()) {',
     '            if seen.insert(c.clone()) {',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_pod_naming_thousands_of_claims_costs_a_bounded_number_of_reads']),
    ("18 device path: an earlier fault's rule left at None for ever, reused with its prediction",
     'aggregator/src/remediate/prediction.rs',
     '        for rule in &idle {',
     '        for rule in idle.iter().take(0) {',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_rule_left_at_none_by_an_earlier_fault_is_made_again']),
    ("18 device path: a pod holding a GPU through an extended resource is missed",
     'aggregator/src/device_taint/claims.rs',
     '                .chain(extended)',
     '                .chain(extended.take(0))',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_pod_holding_a_gpu_through_an_extended_resource_is_counted']),
    ("18 device path: a failed GPU's MIG partitions stay allocatable",
     'aggregator/src/remediate/device.rs',
     '                        for (uuid, ix) in whole.chain(parts) {',
     '                        for (uuid, ix) in whole.chain(parts.take(0)) {',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'a_failed_gpus_mig_partitions_are_quarantined_with_it']),
    ("18 device path: the canary tolerates its taint without NoExecute written out",
     'aggregator/src/remediate/device_canary.rs',
     '"operator": "Exists", "effect": "NoExecute"},',
     '"operator": "Exists"},',
     ['-p', 'faultline-aggregator', '--lib', 'the_canary_tolerates_its_taint_as_the_eviction_controller_reads_it']),
    ("18 device path: the holder of a device gone from its slice is never found",
     'aggregator/src/remediate/device.rs',
     '            return Ok(super::kubelet_dra::holders(pods, &[], node_path, &[]));',
     '            return Ok(BTreeSet::new());',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'the_kubelets_dra_health_finds_the_holder_of_a_device_gone_from_its_slice']),
    ("18 device path: the record's DRA name of a device not used for its holders",
     'aggregator/src/remediate/holders.rs',
     '                    .and_then(DeviceRef::from_resource_id)',
     '                    .and_then(|_: &str| None::<DeviceRef>)',
     ['-p', 'faultline-aggregator', '--test', 'device_taints', 'the_record_keeps_each_devices_dra_name_for_its_holders']),
    ('19 model: the fence lets a write go past the hold (held::holding)',
     'aggregator/src/shard/held.rs',
     'until.is_some_and(|u| now < u)',
     'until.is_some()',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_lease_keeps_one_writer_per_shard']),
    ("19 model: another replica's Lease counted out at once (Observer)",
     'aggregator/src/shard/plan.rs',
     'if now.duration_since(at) > record.duration(self.duration) {',
     'if now.duration_since(at) >= Duration::ZERO {',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_lease_keeps_one_writer_per_shard']),
    ('19 model: an unknown-only quarantine evicts (policy::record_evicts)',
     'aggregator/src/remediate/policy.rs',
     'pub fn record_evicts(unknown_only: bool) -> bool {\n    !unknown_only',
     'pub fn record_evicts(_unknown_only: bool) -> bool {\n    true',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_nodes_are_quarantined_and_unknown_never_evicts']),
    ('19 model: max_nodes not enforced (Budget::refusal)',
     'aggregator/src/remediate/policy.rs',
     'if quarantined.len() >= self.max_nodes {',
     'if quarantined.len() >= usize::MAX {',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_budget_holds_with_three_failed_nodes']),
    ("19 model: the ledger's places not counted (policy::take_place)",
     'aggregator/src/remediate/policy.rs',
     '    let domains: Vec<Option<String>> = others.chain(reserved).collect();',
     '    let domains: Vec<Option<String>> = others.chain(reserved.take(0)).collect();',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_budget_holds_with_three_failed_nodes']),
    ('19 model: an open breaker stops releases too (policy::breaker_stops)',
     'aggregator/src/remediate/policy.rs',
     '    !matches!(step, Step::Release)',
     '    true || matches!(step, Step::Release)',
     ['-p', 'faultline-aggregator', '--test', 'model', 'the_breaker_trips_and_never_blocks_a_release']),
    ('15 supervision: a discovery loop that panics leaves the replica running',
     'common/src/supervise.rs',
     '                s.fail(e);',
     '                drop(e);',
     ['-p', 'faultline-aggregator', '--lib', 'a_part_that_panics_stops_the_replica_and_is_named']),
]


def cargo_test(args):
    """Run one test; (outcome, seconds, output). outcome: 'passed' (at least one test
    ran, none failed), 'failed' (a test failed), or why it means nothing: 'no build',
    'no target', 'no test ran'."""
    t0 = time.time()
    # Each run is bounded: a mutation that makes its test hang is stopped (with every
    # process cargo started) after MUTANT_TIMEOUT, and counts as caught, as
    # cargo-mutants counts a timeout.
    p = subprocess.Popen(["cargo", "test", "--locked"] + args[:-1] + ["--", args[-1]],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=MUTANT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        return "timed out", time.time() - t0, stdout + stderr
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    took = time.time() - t0
    out = r.stdout + r.stderr
    if "could not compile" in r.stderr or "error[" in r.stderr:
        return "no build", took, out
    if "no test target named" in r.stderr or "no such test" in r.stderr:
        return "no target", took, out
    ran = [int(m) for m in re.findall(r"^running (\d+) tests?$", r.stdout, re.M)]
    if re.search(r"^test result: FAILED\.", r.stdout, re.M) and r.returncode != 0:
        return "failed", took, out
    if r.returncode == 0 and sum(ran) > 0:
        return "passed", took, out
    if sum(ran) == 0:
        return "no test ran", took, out
    return f"exit {r.returncode} without a failed test", took, out


def baseline(mutations):
    """Every test a mutation relies on passes on the unmutated tree, or nothing counts."""
    bad = 0
    for args in sorted({tuple(m[4]) for m in mutations}):
        outcome, took, out = cargo_test(list(args))
        print(f"baseline {' '.join(args)}: {outcome}, {took:.0f} s", flush=True)
        if outcome != "passed":
            print(out[-3000:])
            bad += 1
    return bad


def run(name, path, old, new, args):
    f = ROOT / path
    text = f.read_text()
    if text.count(old) != 1:
        return "STALE (the code changed: update this script)"
    try:
        f.write_text(text.replace(old, new))
        outcome, took, out = cargo_test(args)
        if outcome == "failed":
            return f"caught (the test fails), {took:.0f} s"
        if outcome == "timed out":
            return f"caught (the test hangs: stopped after {took:.0f} s)"
        if outcome == "passed":
            return f"NOT CAUGHT (the test passes), {took:.0f} s"
        return f"NOT COUNTED ({outcome}: fix the mutation)\n" + out[-2000:]
    finally:
        f.write_text(text)


def main():
    # Stopped from outside (CI's bound, a person's kill): the mutated file is restored
    # by run()'s `finally`, not left in the tree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    chosen = [m for m in MUTATIONS if only in m[0]]
    stale = [m[0] for m in chosen if (ROOT / m[1]).read_text().count(m[2]) != 1]
    if stale:
        print("STALE (the code changed: update this script):", *stale, sep="\n  ")
        sys.exit(2)
    if baseline(chosen):
        print("the baseline fails: no mutation can be judged")
        sys.exit(2)
    bad = 0
    for m in chosen:
        result = run(*m)
        bad += not result.startswith("caught")
        print(f"{m[0]}: {result}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} caught")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
