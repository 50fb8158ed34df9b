#!/usr/bin/env bash
# Fault to taint with real agents (issue 14): N `faultline-agent` processes (simulated
# GPUs, 1 s sampling), the Kubernetes API test server and the release aggregator with
# --remediation enforce, all as separate processes on this machine. For each of F
# faults, one GPU of one node is failed through its agent's API and the time until its
# Node carries the taint is measured (from before the injection; the agent's sampling
# interval is part of it, as on a real node). BENCH_NODES (20) and BENCH_FAULTS (10).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${BENCH_NODES:-20}"
F="${BENCH_FAULTS:-10}"
BASE="${BENCH_PORT:-19100}"
cargo build --locked --release -q -p faultline-agent -p faultline-aggregator -p faultline-test-apiserver
WORK="$(mktemp -d)"
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
KUBE="http://127.0.0.1:$BASE"
target/release/faultline-test-apiserver --listen "127.0.0.1:$BASE" >"$WORK/apiserver.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "$KUBE/version" >/dev/null && break; sleep 0.1; done
post() { curl -sf -X POST "$KUBE$1" -H 'content-type: application/json' -d "$2" >/dev/null; }
post /api/v1/namespaces '{"metadata":{"name":"faultline"}}'
AGENTS=()
for i in $(seq 1 "$N"); do
  port=$((BASE + 100 + i))
  post /api/v1/nodes "{\"metadata\":{\"name\":\"node-$i\"},\"status\":{\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}]}}"
  target/release/faultline-agent --source sim --sim-devices 8 --sim-seed "$i" \
    --listen "127.0.0.1:$port" --node-name "node-$i" >"$WORK/agent-$i.log" 2>&1 &
  PIDS+=($!)
  AGENTS+=("node-$i=http://127.0.0.1:$port")
done
target/release/faultline-aggregator --sink configmap --kube-server "$KUBE" --namespace faultline \
  --remediation enforce --max-quarantined 1000 --max-quarantined-percent 100 --breaker-nodes 0 \
  --agents "$(IFS=,; echo "${AGENTS[*]}")" --listen "127.0.0.1:$((BASE + 1))" --replica bench-0 \
  >"$WORK/aggregator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do
  curl -sf "$KUBE/api/v1/namespaces/faultline/configmaps/faultline-shard-0" >/dev/null && break; sleep 0.1
done
sleep 3
tainted() { curl -sf "$KUBE/api/v1/nodes/$1" | grep -q 'nvidia.com/gpu-fault'; }
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%d); $N real agents x 8 simulated GPUs, 1 s sampling"
: >"$WORK/times"
for f in $(seq 1 "$F"); do
  node=$(( (f - 1) % N + 1 ))
  port=$((BASE + 100 + node))
  start=$(date +%s%N)
  curl -sf -X POST "http://127.0.0.1:$port/v1/sim/faults" -H 'content-type: application/json' \
    -d '{"device":"gpu3","fault":"lost"}' >/dev/null
  until tainted "node-$node"; do
    (( ($(date +%s%N) - start) < 10000000000 )) || { echo "node-$node not tainted within 10 s" >&2; exit 1; }
    sleep 0.005
  done
  echo $(( ($(date +%s%N) - start) / 1000000 )) >>"$WORK/times"
done
python3 - "$WORK/times" <<'PY'
import sys
t = sorted(int(x) for x in open(sys.argv[1]))
q = lambda p: t[min(len(t) - 1, int(round(p * (len(t) - 1))))]
print(f"| fault injected at a real agent to the Node's taint, {len(t)} faults | p50 {q(0.5)} ms, p90 {q(0.9)} ms, max {t[-1]} ms (includes the agent's 1 s sampling) |")
PY
