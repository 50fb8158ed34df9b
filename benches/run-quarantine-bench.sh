#!/usr/bin/env bash
# One failed GPU quarantined alone at fleet scale (issue 28): BENCH_NODES realistic GPU
# Nodes (1,000 by default) x 8 GPUs published by NVIDIA's DRA driver in the Kubernetes
# API test server at 1.37, one training pod per GPU holding it through its claim, the
# aggregator's RBAC enforced; BENCH_FAULTS GPU faults (50) on distinct nodes, each through
# faultline's isolation and eviction passes. Checks and figures in one block at the end
# (docs/benchmarks.md, "One device, not the node"); exits non-zero if a check fails.
#
#   benches/run-quarantine-bench.sh     # about a minute on 2 cores
#
# Other knobs: BENCH_SEED (which GPUs fail).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p faultline-benches --bin quarantine-bench >&2
BENCH_COMMAND="$({ env | grep -E '^BENCH_' || true; } | sort | tr '\n' ' ')benches/run-quarantine-bench.sh"
export BENCH_COMMAND
exec target/release/quarantine-bench
