#!/usr/bin/env bash
# Agent benchmark: footprint, CPU per sample and /v1/health latency on loopback.
# Usage: benches/run-agent-bench.sh   (BENCH_RATE=2000 BENCH_SECS=10 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p faultline-agent -p faultline-benches >&2
mkdir -p target/bench
cc -shared -fPIC -O2 -o target/bench/libnvidia-ml.so.1 tests/fixtures/nvml/fake_nvml.c -lpthread
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%d)"
exec target/release/agent-bench target/release/faultline-agent target/bench/libnvidia-ml.so.1
