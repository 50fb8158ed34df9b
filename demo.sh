#!/usr/bin/env bash
# faultline end to end on an embedded default: no cluster, no GPU.
#
# Starts three node agents on simulated GPUs and the aggregator with its file sink (a
# directory laid out like a mounted ConfigMap). One agent runs a scenario (a GPU runs
# hot for a while, another falls off the bus); then the demo injects a fault through an
# agent's API and times how long it takes to reach fault.json.
#   ./demo.sh            run the demo and exit
#   ./demo.sh --serve    leave everything running afterwards (Ctrl-C to stop)
set -euo pipefail
cd "$(dirname "$0")"
BASE="${FAULTLINE_DEMO_PORT:-18081}"
WORK="$(mktemp -d)"
cargo build --release -q -p faultline-agent -p faultline-aggregator
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

AGENTS=()
for i in 1 2 3; do
  port=$((BASE + i - 1))
  extra=()
  [[ $i == 1 ]] && extra=(--sim-scenario deploy/scenarios/demo.json)
  target/release/faultline-agent --source sim --sim-devices 8 --sim-seed "$i" "${extra[@]}" \
    --listen "127.0.0.1:$port" --node-name "gpu-node-$i" >"$WORK/agent-$i.log" 2>&1 &
  PIDS+=($!)
  AGENTS+=("http://127.0.0.1:$port")
done
AGG_PORT=$((BASE + 10))
OUT="$WORK/config"
target/release/faultline-aggregator --agents "$(IFS=,; echo "${AGENTS[*]}")" --out "$OUT" \
  --listen "127.0.0.1:$AGG_PORT" --replica demo >"$WORK/aggregator.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [[ -e "$OUT/fault.json" ]] && break; sleep 0.1; done

show() {
  python3 - "$OUT" <<'PY'
import json, sys, os
d = json.load(open(os.path.join(sys.argv[1], "fault.json")))
print("  fault.json sequence %(sequence)s  summary %(summary)s" % d)
for name, n in d["nodes"].items():
    bad = [(x["id"], x["status"], x["reason"]) for x in n["npus"] if x["status"] != "healthy"]
    print("  %-11s %s" % (name, bad if bad else "all %d healthy" % n["summary"]["total"]))
PY
}

echo "== 3 agents x 8 simulated GPUs -> aggregator -> $OUT (laid out like a ConfigMap volume)"
sleep 2; show
echo "== scenario on gpu-node-1: gpu3 falls off the bus (Xid 79) at 6 s; gpu6 runs at 91 C for 6 s"
echo "   (a hard fault fails at once; heat must hold 3 of 5 samples for 60 s before 'degraded')"
sleep 6; show
echo "== injecting a PCIe link-down on gpu-node-2/gpu5 through its agent's API"
START=$(date +%s%N)
curl -sf -X POST "${AGENTS[1]}/v1/sim/faults" -H 'content-type: application/json' \
  -d '{"device":"gpu5","fault":"pcie-down"}' >/dev/null
until python3 -c 'import json,sys; n=json.load(open(sys.argv[1])); sys.exit(0 if any(x["id"]=="gpu5" and x["status"]=="failed" for x in n["npus"]) else 1)' "$OUT/gpu-node-2.json" 2>/dev/null; do
  sleep 0.01
done
echo "  in $OUT/gpu-node-2.json after $(( ($(date +%s%N) - START) / 1000000 )) ms"
show
cat <<TXT
== look yourself (./demo.sh --serve keeps all this running):
  ls -la $OUT                       # ..data -> ..<timestamp>/, one key per node + fault.json
  cat $OUT/gpu-node-2.json          # what a pod on gpu-node-2 reads (seed 003's shape)
  curl -s ${AGENTS[0]}/v1/health?format=pretty
  curl -s http://127.0.0.1:$AGG_PORT/metrics | grep faultline_aggregator_devices
  curl -s -X POST ${AGENTS[2]}/v1/sim/faults -H 'content-type: application/json' -d '{"device":"gpu0","fault":"xid","xid":48}'
TXT
if [[ "${1:-}" == "--serve" ]]; then
  echo "== left running (Ctrl-C to stop)"; wait
fi
