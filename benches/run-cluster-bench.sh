#!/usr/bin/env bash
# What faultline costs a real cluster (issue 25): BENCH_NODES realistic GPU Nodes (20,000
# by default) with a workload pod each in the Kubernetes API test server, the agents'
# EndpointSlices, a fleet of simulated agents at a loopback address each (deadband,
# node-local deliveries), BENCH_REPLICAS release aggregators (4) with 32 shards of 8
# pages; start, steady state at 0 and 1 s of API latency (BENCH_STEADY_S each, 120) and
# at 2 s (BENCH_SLOW_STEADY_S, 300), hard faults. One summary block at the end (docs/benchmarks.md, "Cluster costs").
#
#   benches/run-cluster-bench.sh            # 20,000 nodes: about 20 minutes on 2 cores, 7 GiB
#   benches/run-cluster-bench.sh --quick    # 2,000 nodes, 30 s per phase: about 5 minutes
#
# Other knobs: BENCH_SHARDS, BENCH_PAGES, BENCH_SETTLE_S, BENCH_LATENCIES_MS, BENCH_FAULTS,
# BENCH_SLOW_FAULTS, BENCH_SINGLE_FAULTS, BENCH_SINGLE_WINDOW_S, BENCH_POWER_NOISE,
# BENCH_PUBLISH_NAMESPACES (e.g. default: the shards written there too).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --quick ]; then
  export BENCH_NODES="${BENCH_NODES:-2000}" BENCH_STEADY_S="${BENCH_STEADY_S:-30}" BENCH_SLOW_STEADY_S="${BENCH_SLOW_STEADY_S:-30}"
  export BENCH_SETTLE_S="${BENCH_SETTLE_S:-5}" BENCH_FAULTS="${BENCH_FAULTS:-50}"
fi
# Each fleet process holds two sockets per node (a watch and a delivery connection), 5,000
# nodes each; each replica the same for the nodes it follows.
ulimit -n "$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt 12000 ]; then
  echo "open files limited to $(ulimit -n): 12,000 or more needed" >&2
  exit 1
fi
cargo build --release -p faultline-aggregator -p faultline-benches >&2
BENCH_COMMAND="$({ env | grep -E '^BENCH_' || true; } | sort | tr '\n' ' ')benches/run-cluster-bench.sh${1:+ $1}"
export BENCH_COMMAND
exec target/release/cluster-bench target/release/faultline-aggregator
