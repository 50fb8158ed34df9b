#!/usr/bin/env bash
# faultline end to end on an embedded default: no cluster, no GPU.
#
# Starts the agent on 8 simulated GPUs with a scenario (one GPU runs hot for a while,
# another falls off the bus), shows /v1/health before and after, injects one more fault
# through the API, long-polls for the change, and shows the node file a pod could read.
#   ./demo.sh            run the demo and exit
#   ./demo.sh --serve    leave the agent running afterwards (Ctrl-C to stop)
set -euo pipefail
cd "$(dirname "$0")"
PORT="${FAULTLINE_DEMO_PORT:-18081}"
WORK="$(mktemp -d)"
cargo build --release -q -p faultline-agent
BIN=target/release/faultline-agent
"$BIN" --source sim --sim-devices 8 --sim-seed 42 --sim-scenario deploy/scenarios/demo.json \
  --listen "127.0.0.1:$PORT" --node-name demo-node --node-file "$WORK/node.json" \
  >"$WORK/agent.log" 2>&1 &
AGENT=$!
trap 'kill $AGENT 2>/dev/null || true; rm -rf "$WORK"' EXIT
URL="http://127.0.0.1:$PORT"
for _ in $(seq 100); do curl -sf "$URL/readyz" >/dev/null && break; sleep 0.1; done

summary() {
  curl -sf "$URL/v1/health" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("  generation %(generation)s  summary %(summary)s" % d)
for n in d["npus"]:
    if n["status"] != "healthy":
        print("  %-5s %-8s reason=%-16s temp=%s" % (n["id"], n["status"], n["reason"], n.get("temperature_c")))'
}

echo "== faultline agent on 8 simulated GPUs at $URL"
summary
echo "== waiting 7 s for the scenario: gpu6 runs hot, gpu3 falls off the bus (Xid 79)"
sleep 7
summary
echo "== injecting an uncorrectable-ECC row remap failure on gpu1 through the API"
GEN=$(curl -sf "$URL/v1/health" | python3 -c 'import json,sys; print(json.load(sys.stdin)["generation"])')
curl -sf -X POST "$URL/v1/sim/faults" -H 'content-type: application/json' \
  -d '{"device":"gpu1","fault":"row-remap-failure"}' >/dev/null
START=$(date +%s%N)
until curl -sf "$URL/v1/health?wait_generation=$GEN&timeout_ms=5000" | grep -q '"row-remap-failure"'; do
  GEN=$(curl -sf "$URL/v1/health" | python3 -c 'import json,sys; print(json.load(sys.stdin)["generation"])')
done
echo "  seen by a long-poll after $(( ($(date +%s%N) - START) / 1000000 )) ms (sampling interval 1 s)"
summary
echo "== the node file a pod can mount from the host ($WORK/node.json):"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("  node=%s failed=%s" % (d["node"], d["summary"]["failed"]))' "$WORK/node.json"
cat <<TXT
== look yourself:
  curl -s $URL/v1/health?format=pretty
  curl -s $URL/v1/health/gpu3
  curl -s $URL/metrics | grep faultline_agent_device_status
  curl -s -X POST $URL/v1/sim/faults -H 'content-type: application/json' -d '{"device":"gpu0","fault":"pcie-down"}'
TXT
if [[ "${1:-}" == "--serve" ]]; then
  echo "== agent left running (Ctrl-C to stop)"; wait $AGENT
fi
