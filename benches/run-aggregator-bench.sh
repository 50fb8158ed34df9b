#!/usr/bin/env bash
# Aggregator benchmark: fault-to-ConfigMap latency at 1,000 nodes, fault-to-taint and
# fault-to-eviction at 1,000 nodes, and CPU, memory and ConfigMap writes at 5,000 nodes
# x 8 devices (BENCH_LATENCY_NODES, BENCH_REMEDIATION_NODES, BENCH_NODES; 0 skips one).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p faultline-aggregator -p faultline-benches >&2
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%d)"
exec target/release/aggregator-bench target/release/faultline-aggregator
