#!/usr/bin/env bash
# Issue 27, point 2: cargo-mutants over the pure decision modules, each against its
# crate's unit tests (fast: one crate rebuilt per mutant; the integration tests are the
# guardrail script's, scripts/guardrail-mutations.py). Exit status non-zero when a mutant
# survives. Needs `cargo install --locked cargo-mutants` (27.x). Mutates the tree in place
# (restored after each mutant): do not edit sources while it runs.
#
#   scripts/mutants.sh                       # every module below
#   scripts/mutants.sh common/src/rules.rs   # one
set -euo pipefail
cd "$(dirname "$0")/.."
modules=(
  common/src/state.rs                 # the per-device state machine
  common/src/rules.rs                 # windows and correlation rules
  aggregator/src/remediate/policy.rs  # budgets, breaker, release, eviction choice
  aggregator/src/app/schedule.rs      # write schedule
  aggregator/src/shard/plan.rs        # shard planning (fair share, hand-back)
)
[ $# -gt 0 ] && modules=("$@")
status=0
for m in "${modules[@]}"; do
  echo "== $m"
  cargo mutants --in-place --no-shuffle --file "$m" --cargo-test-arg=--lib \
    --minimum-test-timeout 60 || status=1
done
exit $status
