#!/usr/bin/env bash
# The real alerting chain, end to end: Prometheus scrapes a faultline agent
# and evaluates the shipped rules (deploy/prometheus/faultline-rules.yaml); Alertmanager
# (its default group_interval and repeat_interval) sends the firing alert to the
# aggregator's /v1/alerts with the bearer token, through the receiver of
# docs/remediation.md; faultline quarantines the node and evicts only the pod on that
# GPU. Runs on the Kubernetes API test server; no cluster, no GPU.
# Needs Debian's prometheus and prometheus-alertmanager (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
if [ ${#missing[@]} -gt 0 ]; then
  if [ -n "${CI:-}" ]; then
    echo "alerting-chain: missing ${missing[*]} and CI is set (.ci/run installs them)" >&2
    exit 1
  fi
  echo "SKIPPED alerting-chain: missing ${missing[*]}"
  exit 0
fi
BASE="${FAULTLINE_CHAIN_PORT:-19081}"
AGENT=$BASE AGG=$((BASE + 10)) KUBE_PORT=$((BASE + 20)) PROM=$((BASE + 30)) AM=$((BASE + 40))
KUBE="http://127.0.0.1:$KUBE_PORT"
WORK="$(mktemp -d)"
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
fail() {
  echo "alerting-chain: FAILED: $*" >&2
  for log in "$WORK"/*.log; do
    [ -f "$log" ] || continue
    echo "--- last lines of $log" >&2
    tail -n 15 "$log" >&2
  done
  exit 1
}
wait_until() {
  local secs=$1 what=$2
  shift 2
  local end=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) < end )) || fail "$what (not within ${secs} s)"
    sleep 0.2
  done
}
for port in $AGENT $AGG $KUBE_PORT $PROM $AM; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    fail "port $port is in use; set FAULTLINE_CHAIN_PORT to another base (now $BASE)"
  fi
done
# FAULTLINE_PROFILE=debug: the debug binaries (CI; see demo.sh). Default release.
PROFILE=${FAULTLINE_PROFILE:-release}
case $PROFILE in
  release) BIN=target/release; BUILD=(--release) ;;
  debug) BIN=target/debug; BUILD=() ;;
  *) fail "FAULTLINE_PROFILE is release or debug, not $PROFILE" ;;
esac
cargo build --locked "${BUILD[@]}" -q -p faultline-agent -p faultline-aggregator -p faultline-test-apiserver

$BIN/faultline-test-apiserver --listen "127.0.0.1:$KUBE_PORT" >"$WORK/apiserver.log" 2>&1 &
PIDS+=($!)
wait_until 10 "the test API server answers" curl -sf "$KUBE/version"
post() { curl -sf -X POST "$KUBE$1" -H 'content-type: application/json' -d "$2" >/dev/null; }
patch_status() { curl -sf -X PATCH "$KUBE$1/status" -H 'content-type: application/merge-patch+json' -d "$2" >/dev/null; }
post /api/v1/namespaces '{"metadata":{"name":"faultline"}}'
post /api/v1/nodes '{"metadata":{"name":"gpu-node-1","labels":{"nvidia.com/gpu.present":"true"}},"status":{"conditions":[{"type":"Ready","status":"True"}]}}'
$BIN/faultline-agent --source sim --sim-devices 8 --sim-seed 1 --interval 500ms \
  --listen "127.0.0.1:$AGENT" --node-name gpu-node-1 >"$WORK/agent.log" 2>&1 &
PIDS+=($!)
wait_until 10 "the agent answers" curl -sf "http://127.0.0.1:$AGENT/v1/health"
uuid_of() { curl -sf "http://127.0.0.1:$AGENT/v1/health/gpu$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["uuid"])'; }
# Two 4-GPU jobs; the kubelet reports which GPUs each holds (KEP-4680).
for half in a b; do
  first=$([[ $half == a ]] && echo 0 || echo 4)
  ids=$(for g in $(seq $first $((first + 3))); do printf '{"resourceID":"%s","health":"Healthy"},' "$(uuid_of "$g")"; done)
  post /api/v1/namespaces/default/pods "{\"metadata\":{\"name\":\"train-$half\",\"labels\":{\"app\":\"train\"}},\"spec\":{\"nodeName\":\"gpu-node-1\",\"containers\":[{\"name\":\"trainer\",\"image\":\"trainer\",\"resources\":{\"limits\":{\"nvidia.com/gpu\":\"4\"}}}]}}"
  patch_status "/api/v1/namespaces/default/pods/train-$half" "{\"status\":{\"phase\":\"Running\",\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}],\"containerStatuses\":[{\"name\":\"trainer\",\"ready\":true,\"restartCount\":0,\"image\":\"trainer\",\"imageID\":\"\",\"allocatedResourcesStatus\":[{\"name\":\"nvidia.com/gpu\",\"resources\":[${ids%,}]}]}]}}"
done
head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/intake-token"
$BIN/faultline-aggregator --sink configmap --kube-server "$KUBE" --namespace faultline \
  --remediation enforce --max-quarantined-percent 100 --agents "gpu-node-1=http://127.0.0.1:$AGENT" \
  --listen "127.0.0.1:$AGG" --replica chain-0 --intake-token-file "$WORK/intake-token" \
  --reconcile-interval 2s --publish-namespaces default >"$WORK/aggregator.log" 2>&1 &
PIDS+=($!)
wait_until 20 "the aggregator is ready" curl -sf "http://127.0.0.1:$AGG/readyz"

# Prometheus: scrapes the agent (with its node's name, as the PodMonitor relabels it)
# and evaluates the shipped rules every second.
cat >"$WORK/prometheus.yml" <<EOF
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: ["$PWD/deploy/prometheus/faultline-rules.yaml"]
alerting:
  alertmanagers: [{static_configs: [{targets: ["127.0.0.1:$AM"]}]}]
scrape_configs:
  - job_name: faultline-agent
    static_configs: [{targets: ["127.0.0.1:$AGENT"], labels: {node: gpu-node-1}}]
EOF
prometheus --config.file "$WORK/prometheus.yml" --storage.tsdb.path "$WORK/prom" \
  --web.listen-address "127.0.0.1:$PROM" >"$WORK/prometheus.log" 2>&1 &
PIDS+=($!)
# Alertmanager: the receiver of docs/remediation.md, pointed here; Alertmanager's
# default group_interval (5m) and repeat_interval (4h); group_wait 1s so the first
# notification goes at once.
receiver=$(sed -n '/An Alertmanager receiver for faultline/,/^```$/p' docs/remediation.md |
  sed -n '/^receivers:/,/^```$/p' | sed '$d' |
  sed "s|http://faultline-aggregator.faultline.svc:8082|http://127.0.0.1:$AGG|; s|/etc/alertmanager/secrets/faultline-intake-token/token|$WORK/intake-token|")
[[ "$receiver" == *"127.0.0.1:$AGG/v1/alerts"* ]] || fail "the receiver example of docs/remediation.md was not found"
{
  echo "route: {receiver: faultline, group_wait: 1s, group_by: [alertname, node, device]}"
  echo "$receiver"
} >"$WORK/alertmanager.yml"
prometheus-alertmanager --config.file "$WORK/alertmanager.yml" --storage.path "$WORK/am" \
  --web.listen-address "127.0.0.1:$AM" --cluster.listen-address "" >"$WORK/alertmanager.log" 2>&1 &
PIDS+=($!)
wait_until 20 "Prometheus is ready" curl -sf "http://127.0.0.1:$PROM/-/ready"
wait_until 20 "Alertmanager is ready" curl -sf "http://127.0.0.1:$AM/-/ready"
wait_until 20 "Prometheus scrapes the agent" sh -c "curl -sf 'http://127.0.0.1:$PROM/api/v1/query?query=up%7Bjob%3D%22faultline-agent%22%7D' | grep -q '\"1\"\\]'"

echo "== gpu5 of gpu-node-1 fails (a row remap failure); train-b holds GPUs 4-7"
START=$(date +%s)
curl -sf -X POST "http://127.0.0.1:$AGENT/v1/sim/faults" -H 'content-type: application/json' \
  -d '{"device":"gpu5","fault":"row-remap-failure"}' >/dev/null
acted() { curl -sf "http://127.0.0.1:$AGG/metrics" | grep -q 'faultline_aggregator_intake_alerts_total{result="acted"} [1-9]'; }
wait_until 60 "Prometheus -> Alertmanager -> faultline: the intake acted on the alert" acted
echo "  the alert reached the intake and was acted on $(( $(date +%s) - START )) s after the fault"
curl -sf "http://127.0.0.1:$AGG/metrics" | grep -E 'faultline_aggregator_intake_(alerts|responses)_total' | sed 's/^/  /'
tainted() { curl -sf "$KUBE/api/v1/nodes/gpu-node-1" | grep -q 'nvidia.com/gpu-fault'; }
wait_until 30 "gpu-node-1 is tainted" tainted
# Evicted: Terminating (graceful deletion) or already gone.
gone() {
  local url="$KUBE/api/v1/namespaces/default/pods/train-b"
  ! curl -sf "$url" >/dev/null || curl -sf "$url" | grep -q deletionTimestamp
}
wait_until 30 "train-b (on the failed GPU) is evicted" gone
curl -sf "$KUBE/api/v1/namespaces/default/pods/train-a" >/dev/null || fail "train-a was evicted, but its GPUs are healthy"
curl -sf "$KUBE/api/v1/namespaces/default/pods/train-a" | grep -q deletionTimestamp && fail "train-a is being deleted, but its GPUs are healthy"
echo "  gpu-node-1 quarantined, train-b evicted, train-a stays"
echo "alerting chain ok: Prometheus (shipped rules) -> Alertmanager (docs' receiver) -> faultline"
