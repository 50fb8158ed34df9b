#!/usr/bin/env bash
# Scale-out benchmark (issue 11): one replica at 5,000 nodes, then 20,000 nodes x 8
# devices across 4 replicas and 32 shards of two ConfigMaps each, a fault's latency at
# that scale, a replica killed and a fifth started (BENCH_SCALE_NODES, BENCH_REPLICAS,
# BENCH_SHARDS, BENCH_PAGES).
# About 6 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each replica holds a socket per followed agent; each fleet process 5,000 of them.
ulimit -n "$(ulimit -Hn)"
cargo build --release -p faultline-aggregator -p faultline-benches >&2
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%d), open files $(ulimit -n)"
exec target/release/scale-bench target/release/faultline-aggregator
