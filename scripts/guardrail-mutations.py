#!/usr/bin/env python3
"""Issue 14's check that each safety guardrail's test can fail: remove the guardrail
(one small source edit), run the test that guards it, expect it to FAIL, restore.

    python3 scripts/guardrail-mutations.py            # all (about 20 minutes on 2 cores)
    python3 scripts/guardrail-mutations.py breaker    # those whose name contains "breaker"

Exit status 1 if any test still passes with its guardrail removed (a test that cannot
fail). The source is restored after each mutation, also on Ctrl-C. Not part of CI (it
rebuilds once per mutation); run it after changing a guardrail or its test.
"""
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (guardrail, file, the code, the code without the guardrail, cargo test arguments)
MUTATIONS = [
    ("1 default dry-run: a default install acts",
     "aggregator/src/config.rs",
     "(None, SinkKind::ConfigMap) => Mode::DryRun,",
     "(None, SinkKind::ConfigMap) => Mode::Enforce,",
     ["-p", "faultline-aggregator", "--test", "kubernetes", "a_default_install_is_a_dry_run"]),
    ("2 fencing: a write goes without the shard's Lease",
     "aggregator/src/shard/fence.rs",
     "Kind::Shard { held, shard } => held.holds(*shard),",
     "Kind::Shard { .. } => true,",
     ["-p", "faultline-aggregator", "--test", "remediation", "a_replica_without_its_lease_changes_nothing"]),
    ("2 fencing: a Lease past its renewals still counts as held (no self-expiry)",
     "aggregator/src/shard/lease.rs",
     ".is_some_and(|until| Instant::now() < *until)",
     ".is_some()",
     ["-p", "faultline-aggregator", "--test", "kubernetes", "a_replica_whose_renewals_fail_stops_acting_on_its_own_clock"]),
    ("3 breaker: never trips",
     "aggregator/src/remediate/guards.rs",
     "let trip = count >= self.nodes;",
     "let trip = false;",
     ["-p", "faultline-aggregator", "--test", "healing", "the_breaker_opens_on_real_failures"]),
    ("3 breaker: the window never expires",
     "aggregator/src/remediate/guards.rs",
     ".retain(|_, at| self.clock.age_secs(at).is_some_and(|a| a <= window));",
     ".retain(|_, at| !at.is_empty() || window > 0.0);",
     ["-p", "faultline-aggregator", "--test", "healing", "the_breaker_opens_on_real_failures"]),
    ("4 budgets: no budget",
     "aggregator/src/remediate/guards.rs",
     "        if quarantined.len() >= self.budget.max_nodes {\n            return Ok(self.budget.refusal(mine.as_deref(), &domains, || 0));\n        }",
     "        if quarantined.len() >= usize::MAX {\n            return Ok(self.budget.refusal(mine.as_deref(), &domains, || 0));\n        }\n        if !quarantined.is_empty() || quarantined.is_empty() {\n            return Ok(None);\n        }",
     ["-p", "faultline-aggregator", "--test", "healing", "a_held_back_node_is_quarantined_once_room_frees"]),
    ("5 pods: terminating and finished pods are evicted",
     "aggregator/src/remediate/policy.rs",
     "if pod.terminating || pod.finished || pod.mirror || pod.daemon || pod.canary {",
     "if (pod.terminating && pod.finished) || pod.mirror || pod.daemon || pod.canary {",
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
     "agent/src/sources/kmsg/mod.rs",
     "Ok(m) if m.ino() != ino || m.len() < offset => return Ok(()),",
     "Ok(m) if m.ino() != ino && m.len() < offset => return Ok(()),",
     ["-p", "faultline-agent", "--test", "kmsg", "a_rotated_or_truncated_log_is_reopened"]),
    ("9 write scheduling: an unchanged page rewritten",
     "aggregator/src/publish/configmap.rs",
     "if attempt == 0 && last == Some(page_body.content) {",
     "if attempt == 0 && last == Some(page_body.content) && false {",
     ["-p", "faultline-aggregator", "--test", "kubernetes", "the_sequence_carries_over_and_a_quiet_shard_is_not_rewritten"]),
    ("10 notifications: nothing is sent",
     "aggregator/src/notify.rs",
     "    pub fn send(&self, n: Notification) {",
     "    pub fn send(&self, n: Notification) {\n        if n.kind.is_empty() || !n.kind.is_empty() {\n            return;\n        }",
     ["-p", "faultline-aggregator", "--test", "healing", "the_binary_notifies_audits_and_stops_on_sigterm"]),
]


def run(name, path, old, new, args):
    f = ROOT / path
    text = f.read_text()
    if text.count(old) != 1:
        return "STALE (the code changed: update this script)"
    try:
        f.write_text(text.replace(old, new))
        t0 = time.time()
        r = subprocess.run(["cargo", "test", "-q", "--locked"] + args[:-1] + ["--", args[-1]],
                           cwd=ROOT, capture_output=True, text=True)
        took = time.time() - t0
        if "error[" in r.stderr and "could not compile" in r.stderr:
            return "DID NOT COMPILE (fix the mutation)\n" + r.stderr[-2000:]
        return ("caught (the test fails)" if r.returncode != 0 else "NOT CAUGHT (the test passes)") + f", {took:.0f} s"
    finally:
        f.write_text(text)


def main():
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    bad = 0
    for m in MUTATIONS:
        if only not in m[0]:
            continue
        result = run(*m)
        bad += not result.startswith("caught")
        print(f"{m[0]}: {result}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
