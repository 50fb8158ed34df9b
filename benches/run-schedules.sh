#!/usr/bin/env bash
# Randomized fault schedules (issue 10): runs SCHEDULES (default 1,000) seeded schedules
# of the real remediation code against the Kubernetes API test server, and reports how
# many held every invariant (aggregator/tests/schedules.rs lists them).
# Usage: benches/run-schedules.sh   (SCHEDULES=1000 FIRST=1 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${SCHEDULES:-1000}
first=${FIRST:-1}
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%d); schedules $first..$((first + n - 1))"
FAULTLINE_SCHEDULES=$n FAULTLINE_SCHEDULE_FIRST=$first \
  cargo test --locked -p faultline-aggregator --test schedules -- --nocapture 2>&1 |
  grep -E '^schedules:|^schedule seed|^  [0-9]:|^  [a-z]|test result'
