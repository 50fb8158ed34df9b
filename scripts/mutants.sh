#!/usr/bin/env bash
# cargo-mutants over the decision modules and the code that acts.
#
# The pure decision modules are judged by their own unit tests (`--lib`, filtered to
# the module: one crate's unit tests rebuilt per mutant, about 12 s). The modules that
# act (the fence, the Lease, the guards, isolate, evict, release, the device path,
# dispatch) talk to the API server, so their judges are the integration tests that
# run them against it (`aggregator/tests/*.rs`), named per module below with the
# tests' names: each mutant rebuilds the library and links those test binaries (about
# 30-40 s a mutant on 2 cores). cargo-mutants builds and tests the unmutated tree
# first (a failing baseline stops it), and counts a mutant that does not build as
# unviable, never as caught. Exit status non-zero when a mutant survives or times out.
# Survivors that are no gap (an equivalent mutant) go in .cargo/mutants.toml's
# exclude_re, each with its reason. Mutates the tree in place, restoring each file after
# its mutant: do not edit sources while it runs.
#
#   scripts/mutants.sh                        # the pure modules (about 45 minutes, 2 cores)
#   scripts/mutants.sh --acting               # the modules that act (hours: docs/testing.md)
#   scripts/mutants.sh --all                  # both
#   scripts/mutants.sh common/src/rules.rs    # one module of either list
#   scripts/mutants.sh --ci                   # CI: the pure modules' 32nd picked by the
#                                             # commit (the acting modules: not yet in CI)
#   scripts/mutants.sh --shard K/N FILE...    # one shard of the named modules
#
# Needs cargo-mutants 27.0.0: `cargo install --locked cargo-mutants@27.0.0` (.ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
# module|test targets (lib: the crate's unit tests; others: aggregator/tests/NAME.rs)|
# test name filters (any of them; a target where none matches runs nothing)
pure=(
  'common/src/state.rs|lib|state::'                    # the per-device state machine
  'common/src/rules.rs|lib|rules::'                    # windows and correlation rules
  'aggregator/src/remediate/policy.rs|lib|remediate::' # budgets, breaker, release, eviction choice
  'aggregator/src/remediate/drain.rs|lib|remediate::drain' # warn before evicting
  'aggregator/src/app/schedule.rs|lib|app::schedule'   # write schedule
  'aggregator/src/shard/plan.rs|lib|shard::'           # shard planning (fair share, hand-back)
  'aggregator/src/device_taint/index.rs|lib|device_taint::index' # DRA devices by UUID, holders
  'aggregator/src/device_taint/rule.rs|lib|device_taint::rule'   # DeviceTaintRule names, ownership, prediction
  'aggregator/src/device_taint/scope.rs|lib|device_taint::scope' # device or node
  'aggregator/src/device_taint/plugin.rs|lib|device_taint::plugin' # what a device plugin already took out
  'aggregator/src/device_taint/ascend.rs|lib|device_taint::ascend' # Ascend's ManuallySeparateNPU
)
acting=(
  # Judged by every test of the named targets (no filter: the aggregator's unit tests
  # take 17 s, late_writes 1 s, remediation, drain and device_taints a few), except
  # where the judge is a slow binary: then the filters name its tests.
  # the fence: a write only under the hold, given up when it ends
  'aggregator/src/shard/fence.rs|lib,late_writes,remediation,device_taints|'
  # the hold a Lease gives, on this replica's clock; the Lease loop and its writes
  'aggregator/src/shard/held.rs|lib,late_writes,kubernetes|shard:: fence a_taint_due two_replicas lease renewals'
  'aggregator/src/shard/lease.rs|lib,kubernetes,schedules|shard:: lease renewals a_release_waits_out_the_margin a_seed_replays'
  'aggregator/src/shard/lease_write.rs|lib,kubernetes,schedules|shard:: lease renewals a_release_waits_out_the_margin a_seed_replays'
  # the budget and the breaker's shared count
  'aggregator/src/remediate/guards.rs|lib,late_writes,remediation|'
  'aggregator/src/remediate/ledger.rs|lib,late_writes,remediation|'
  # isolate, evict, release, the Node patch
  'aggregator/src/remediate/isolate.rs|lib,late_writes,remediation,device_taints|'
  'aggregator/src/remediate/evict.rs|lib,remediation,drain|'
  'aggregator/src/remediate/release.rs|lib,remediation,device_taints|'
  'aggregator/src/remediate/remediator.rs|lib,remediation|'
  'aggregator/src/remediate/patch.rs|lib,remediation|'
  # the device path: DeviceTaintRules, their prediction, their release
  'aggregator/src/remediate/device.rs|lib,device_taints|'
  'aggregator/src/remediate/prediction.rs|lib,device_taints|'
  'aggregator/src/remediate/device_release.rs|lib,device_taints|'
  # dispatch: which node's pass runs, under which fence
  # (24 randomized schedules a mutant, not CI's 200: about 15 s; the verdicts of the
  # intake and of the kubelet, which the schedules' faults reach anyway through the
  # agents: without healing's two, dispatch dropping every verdict went unseen; the
  # wakes at a drain intent's deadline; the bounds on verdicts for unknown nodes; the
  # unknown guard's taint)
  'aggregator/src/app/dispatch.rs|lib,schedules,healing,drain,adversarial,kubernetes|app:: randomized intake kubelets a_warned_pod every_hostile_input an_agent_gone'
)
modules=("${pure[@]}")
shard=()
acting_shard=()
case "${1:-}" in
  --acting) shift; modules=("${acting[@]}") ;;
  --all) shift; modules=("${pure[@]}" "${acting[@]}") ;;
  --ci)
    shift
    k=$(( 0x$(git rev-parse --short=7 HEAD) ))
    shard=(--shard "$((k % 32))/32")
    echo "mutants: shard $((k % 32))/32 of each pure module (the commit's); the whole run: scripts/mutants.sh --all"
    ;;
  --shard)
    shard=(--shard "$2"); acting_shard=(--shard "$2"); shift 2 ;;
esac
if [ $# -gt 0 ]; then
  picked=()
  for f in "$@"; do
    for m in "${pure[@]}" "${acting[@]}"; do [ "${m%%|*}" = "$f" ] && picked+=("$m"); done
  done
  [ ${#picked[@]} -eq $# ] || { echo "mutants.sh: not a module of these lists: $*" >&2; exit 2; }
  modules=("${picked[@]}")
fi
is_acting() {
  local m
  for m in "${acting[@]}"; do [ "${m%%|*}" = "$1" ] && return 0; done
  return 1
}
export FAULTLINE_SCHEDULES="${FAULTLINE_SCHEDULES:-24}"
status=0
for m in "${modules[@]}"; do
  IFS='|' read -r file targets filters <<<"$m"
  args=()
  for t in ${targets//,/ }; do
    if [ "$t" = lib ]; then args+=(-C --lib); else args+=(-C "--test=$t"); fi
  done
  cut=("${shard[@]}")
  is_acting "$file" && cut=("${acting_shard[@]}")
  echo "== $file (tests: $targets; $filters)"
  # After the second `--`, to the test binaries: cargo test takes one name alone.
  # shellcheck disable=SC2086 # the filters are words
  cargo mutants --in-place --no-shuffle --file "$file" --minimum-test-timeout 120 \
    "${args[@]}" "${cut[@]}" -- -- $filters || status=$?
  # The outcome of each module, for docs/testing.md (cargo-mutants writes mutants.out/).
  [ -d mutants.out ] && rm -rf "mutants.out.$(basename "$file" .rs)" &&
    mv mutants.out "mutants.out.$(basename "$file" .rs)"
done
rm -rf mutants.out.old
exit $status
