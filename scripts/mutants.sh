#!/usr/bin/env bash
# cargo-mutants over the pure decision modules, each against its own
# unit tests (`--lib`, filtered to the module: one crate's unit tests rebuilt per
# mutant, about 12 s; the wiring and the integration tests belong to the guardrail
# script, scripts/guardrail-mutations.py). cargo-mutants builds and tests the unmutated
# tree first (a failing baseline stops it), and counts a mutant that does not build as
# unviable, never as caught. Exit status non-zero when a mutant survives or times out.
# Survivors that are no gap (an equivalent mutant) go in .cargo/mutants.toml's
# exclude_re, each with its reason. Mutates the tree in place, restoring each file after
# its mutant: do not edit sources while it runs.
#
#   scripts/mutants.sh                       # every module below (about 1 hour, 2 cores)
#   scripts/mutants.sh common/src/rules.rs   # one
#   scripts/mutants.sh --ci                  # CI: one 32nd of each module's mutants, the
#                                            # shard chosen by the commit (rotates)
#
# Needs cargo-mutants 27.0.0: `cargo install --locked cargo-mutants@27.0.0` (.ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
# module|the unit tests that judge it
modules=(
  'common/src/state.rs|state::'                    # the per-device state machine
  'common/src/rules.rs|rules::'                    # windows and correlation rules
  'aggregator/src/remediate/policy.rs|remediate::' # budgets, breaker, release, eviction choice
  'aggregator/src/remediate/drain.rs|remediate::drain' # warn before evicting
  'aggregator/src/app/schedule.rs|app::schedule'   # write schedule
  'aggregator/src/shard/plan.rs|shard::'           # shard planning (fair share, hand-back)
  'aggregator/src/device_taint/index.rs|device_taint::index' # DRA devices by UUID, holders
  'aggregator/src/device_taint/rule.rs|device_taint::rule'   # DeviceTaintRule names, ownership, prediction
  'aggregator/src/device_taint/scope.rs|device_taint::scope' # device or node
  'aggregator/src/device_taint/plugin.rs|device_taint::plugin' # what a device plugin already took out
  'aggregator/src/device_taint/ascend.rs|device_taint::ascend' # Ascend's ManuallySeparateNPU
)
shard=()
if [ "${1:-}" = "--ci" ]; then
  shift
  k=$(( 0x$(git rev-parse --short=7 HEAD) % 32 ))
  shard=(--shard "$k/32")
  echo "mutants: shard $k/32 of each module (the commit's); the whole run: scripts/mutants.sh"
fi
if [ $# -gt 0 ]; then
  picked=()
  for f in "$@"; do
    for m in "${modules[@]}"; do [ "${m%%|*}" = "$f" ] && picked+=("$m"); done
  done
  [ ${#picked[@]} -eq $# ] || { echo "mutants.sh: not a module of this list: $*" >&2; exit 2; }
  modules=("${picked[@]}")
fi
status=0
for m in "${modules[@]}"; do
  file=${m%%|*} filter=${m#*|}
  echo "== $file (tests $filter)"
  cargo mutants --in-place --no-shuffle --file "$file" --minimum-test-timeout 60 \
    -C --lib "${shard[@]}" -- "$filter" || status=$?
  # The outcome of each module, for docs/testing.md (cargo-mutants writes mutants.out/).
  [ -d mutants.out ] && rm -rf "mutants.out.$(basename "$file" .rs)" &&
    mv mutants.out "mutants.out.$(basename "$file" .rs)"
done
rm -rf mutants.out.old
exit $status
