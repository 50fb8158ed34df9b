#!/usr/bin/env bash
# What faultline costs a real control plane (issue 51): kube-apiserver, etcd and the
# controllers of a pinned release (tests/controlplane/build.sh builds them), BENCH_NODES
# realistic GPU Nodes (5,000) whose Leases are renewed every 10 s as their kubelets
# would, measured for BENCH_STEADY_S (300) alone and again with BENCH_REPLICAS (2)
# release aggregators publishing the fleet's simulated agents; then BENCH_FAULTS (100)
# hard faults. Runs in a network namespace of its own where 10.244.0.0/16 is local
# (kube-apiserver refuses loopback endpoints): needs root, util-linux and iproute2.
# The figures are in docs/benchmarks.md, "On the real control plane".
#
#   benches/run-real-cluster-bench.sh            # 5,000 nodes: about 40 minutes on 2 cores
#   benches/run-real-cluster-bench.sh --quick    # 500 nodes, 60 s windows
#
# Other knobs: BENCH_RELEASE (1.37), BENCH_SHARDS (32), BENCH_PAGES (2), BENCH_WARM_S (120:
# after the Nodes are made and after faultline stops, before a window), BENCH_PROFILE (release).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --quick ]; then
  export BENCH_NODES="${BENCH_NODES:-500}" BENCH_STEADY_S="${BENCH_STEADY_S:-60}"
  export BENCH_WARM_S="${BENCH_WARM_S:-30}" BENCH_FAULTS="${BENCH_FAULTS:-20}"
fi
ulimit -n "$(ulimit -Hn)"
profile="${BENCH_PROFILE:-release}"
if [ "$profile" = release ]; then
  cargo build --release -p faultline-aggregator -p faultline-benches --bin real-cluster-bench --bin faultline-aggregator >&2
else
  cargo build -p faultline-aggregator -p faultline-benches --bin real-cluster-bench --bin faultline-aggregator >&2
  profile=debug
fi
tests/controlplane/build.sh "${BENCH_RELEASE:-1.37}" >&2
export BENCH_NODE_NET=10.244
exec unshare --net -- sh -c 'ip link set lo up && ip route add local 10.244.0.0/16 dev lo && exec "$0" "$@"' \
  "target/$profile/real-cluster-bench" "target/$profile/faultline-aggregator"
