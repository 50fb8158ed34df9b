#!/usr/bin/env bash
# faultline end to end on an embedded default: no cluster, no GPU.
#
# Starts the Kubernetes API test server with three GPU nodes and two training pods on each,
# one agent per node on 8 simulated GPUs, and the aggregator writing shard ConfigMaps
# under a shard Lease and delivering each node's verdict to its agent, which keeps it as
# the node's own fault.json (what the node's pods read). One agent runs a scenario (a
# GPU falls off the bus); then the demo injects a fault through another agent's API and
# times how long it takes to reach that node's own fault.json, the ConfigMap and a nudge
# of the pod on that node, and heals it: quarantine, eviction of the pod on the failed
# GPU, alerts through the intake, `faultline status`, and a release.
#   ./demo.sh            run the demo and exit
#   ./demo.sh --serve    leave everything running afterwards (Ctrl-C to stop)
# Every step is checked: the demo exits non-zero, naming the step and showing the
# aggregator's log, when something does not happen within its time (CI runs it).
set -euo pipefail
cd "$(dirname "$0")"
BASE="${FAULTLINE_DEMO_PORT:-18081}"
WORK="$(mktemp -d)"
PIDS=()
# The log file of each process started, by pid: a process that dies is named.
declare -A LOGS=()
# The processes are waited for before their files go (an agent or the file sink could
# still write into $WORK while rm walks it); the removal never decides the exit status.
cleanup() {
  kill "${PIDS[@]}" 2>/dev/null || true
  wait "${PIDS[@]}" 2>/dev/null || true
  rm -rf "$WORK" 2>/dev/null || true
}
trap cleanup EXIT
fail() {
  echo "demo: FAILED: $*" >&2
  for pid in "${PIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null || echo "demo: $(basename "${LOGS[$pid]}" .log) (pid $pid) is not running" >&2
  done
  for log in "$WORK"/*.log; do
    [ -f "$log" ] || continue
    echo "--- last lines of $log" >&2
    tail -n 20 "$log" >&2
  done
  exit 1
}
# started LOG: remember the process just started in the background and its log.
started() { PIDS+=($!); LOGS[$!]=$1; }
# The ports the demo listens on must be free (FAULTLINE_DEMO_PORT moves them all).
for port in $BASE $((BASE + 1)) $((BASE + 2)) $((BASE + 10)) $((BASE + 11)) $((BASE + 20)); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    fail "port $port is in use by another process; set FAULTLINE_DEMO_PORT to another base (now $BASE)"
  fi
done
# FAULTLINE_PROFILE=debug runs the debug binaries (what CI does: `cargo test` has
# built them; a cold release build is 14 of CI's minutes). The default is release.
PROFILE=${FAULTLINE_PROFILE:-release}
case $PROFILE in
  release) BIN=target/release; BUILD=(--release) ;;
  debug) BIN=target/debug; BUILD=() ;;
  *) fail "FAULTLINE_PROFILE is release or debug, not $PROFILE" ;;
esac
echo "== building the agent, the aggregator and the test API server ($PROFILE; the first release build on a fresh clone takes about 14 minutes on 2 cores)"
cargo build --locked "${BUILD[@]}" -q -p faultline-agent -p faultline-aggregator -p faultline-test-apiserver
# wait_until SECONDS WHAT COMMAND...: run COMMAND every 20 ms until it succeeds; fail
# the demo when it has not within SECONDS.
wait_until() {
  local secs=$1 what=$2
  shift 2
  local end=$(( $(date +%s%N) + secs * 1000000000 ))
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s%N) < end )) || fail "$what (not within ${secs} s)"
    sleep 0.02
  done
}
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

KUBE="http://127.0.0.1:$((BASE + 20))"
# Kubernetes 1.37: DRA's DeviceTaintRule is served (resource.k8s.io/v1), so one GPU can
# be quarantined alone where NVIDIA's DRA driver publishes it (the last act below).
$BIN/faultline-test-apiserver --listen "127.0.0.1:$((BASE + 20))" --kubernetes-version 1.37 >"$WORK/apiserver.log" 2>&1 &
started "$WORK/apiserver.log"
wait_until 10 "the test API server answers" curl -sf "$KUBE/version"
post() { curl -sf -X POST "$KUBE$1" -H 'content-type: application/json' -d "$2" >/dev/null; }
# The UUID of simulated GPU $2 of the agent on port $1.
uuid_of() { curl -sf "http://127.0.0.1:$1/v1/health/gpu$2" | python3 -c 'import json,sys; print(json.load(sys.stdin)["uuid"])'; }
patch_status() { curl -sf -X PATCH "$KUBE$1/status" -H 'content-type: application/merge-patch+json' -d "$2" >/dev/null; }
post /api/v1/namespaces '{"metadata":{"name":"faultline"}}'

# The token the aggregator delivers verdicts with and the agents take them with (in a
# cluster: the Secret faultline-delivery).
head -c 32 /dev/urandom | base64 >"$WORK/delivery-token"
# And the key each delivery is signed with: the aggregator holds it, the agents its
# public half only, so no node can set another's verdict (in a cluster: the Secret
# faultline-delivery-signing and the ConfigMap faultline-delivery-key).
SIGNING=()
KEY=()
if command -v openssl >/dev/null 2>&1; then
  openssl genpkey -algorithm ed25519 -out "$WORK/delivery.pem" 2>/dev/null
  openssl pkey -in "$WORK/delivery.pem" -pubout -out "$WORK/delivery-key.pem"
  SIGNING=(--delivery-signing-key-file "$WORK/delivery.pem")
  KEY=(--delivery-key-file "$WORK/delivery-key.pem")
else
  echo "demo: no openssl here: deliveries carry the token only, unsigned"
fi
AGENTS=()
NAMED=()
for i in 1 2 3; do
  port=$((BASE + i - 1))
  post /api/v1/nodes "{\"metadata\":{\"name\":\"gpu-node-$i\",\"labels\":{\"nvidia.com/gpu.present\":\"true\"}},\"status\":{\"addresses\":[{\"type\":\"InternalIP\",\"address\":\"127.0.0.1\"}],\"capacity\":{\"nvidia.com/gpu\":\"8\"}}}"
  extra=()
  [[ $i == 1 ]] && extra=(--sim-scenario deploy/scenarios/demo.json)
  # --fault-dir: the node's own fault.json (on a node: /run/faultline/node, the hostPath
  # its pods mount at /config).
  mkdir "$WORK/node-$i"
  $BIN/faultline-agent --source sim --sim-devices 8 --sim-seed "$i" "${extra[@]}" \
    --listen "127.0.0.1:$port" --node-name "gpu-node-$i" \
    --fault-dir "$WORK/node-$i" --delivery-token-file "$WORK/delivery-token" "${KEY[@]}" >"$WORK/agent-$i.log" 2>&1 &
  started "$WORK/agent-$i.log"
  wait_until 10 "agent $i answers" curl -sf "http://127.0.0.1:$port/v1/health"
  # Two 4-GPU jobs per node; the kubelet reports which GPUs each holds (KEP-4680), by
  # the UUIDs the node's agent reports (each simulated node has its own).
  for half in a b; do
    first=$([[ $half == a ]] && echo 0 || echo 4)
    ids=$(for g in $(seq $first $((first + 3))); do printf '{"resourceID":"%s","health":"Healthy"},' "$(uuid_of "$port" "$g")"; done)
    # A new pod starts Pending (the API server drops a client's status); its kubelet
    # then reports it running, Ready, with the GPUs it holds.
    post /api/v1/namespaces/default/pods "{\"metadata\":{\"name\":\"train-$i$half\",\"labels\":{\"app\":\"train\"}},\"spec\":{\"nodeName\":\"gpu-node-$i\",\"containers\":[{\"name\":\"trainer\",\"image\":\"trainer\",\"resources\":{\"limits\":{\"nvidia.com/gpu\":\"4\"}}}]}}"
    patch_status /api/v1/namespaces/default/pods/train-$i$half "{\"status\":{\"phase\":\"Running\",\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}],\"containerStatuses\":[{\"name\":\"trainer\",\"ready\":true,\"restartCount\":0,\"image\":\"trainer\",\"imageID\":\"\",\"allocatedResourcesStatus\":[{\"name\":\"nvidia.com/gpu\",\"resources\":[${ids%,}]}]}]}}"
  done
  AGENTS+=("http://127.0.0.1:$port")
  # Named, as discovery names them: the aggregator delivers to the agents of named nodes.
  NAMED+=("gpu-node-$i=http://127.0.0.1:$port")
done
AGG="http://127.0.0.1:$((BASE + 10))"
TOKEN=demo-token-$RANDOM
echo "$TOKEN" >"$WORK/intake-token"
$BIN/faultline-aggregator --sink configmap --kube-server "$KUBE" --namespace faultline \
  --remediation enforce --max-quarantined-percent 100 --agents "$(IFS=,; echo "${NAMED[*]}")" --listen "127.0.0.1:$((BASE + 10))" --replica demo-0 \
  --intake-token-file "$WORK/intake-token" --reconcile-interval 2s --publish-namespaces default \
  --delivery-token-file "$WORK/delivery-token" "${SIGNING[@]}" \
  >"$WORK/aggregator.log" 2>&1 &
started "$WORK/aggregator.log"
# A second aggregator with the file sink: the same documents in a directory laid out the
# way kubelet lays out a mounted ConfigMap, for a local consumer.
OUT="$WORK/config"
$BIN/faultline-aggregator --sink file --out "$OUT" \
  --agents "$(IFS=,; echo "${NAMED[*]}")" --listen "127.0.0.1:$((BASE + 11))" --replica demo-file \
  >"$WORK/aggregator-file.log" 2>&1 &
started "$WORK/aggregator-file.log"

cm() { curl -sf "$KUBE/api/v1/namespaces/faultline/configmaps/faultline-shard-0"; }
wait_until 20 "the aggregator writes the shard ConfigMap" cm
# failed_in_cm NODE DEVICE: the device is failed in the node's entry of the shard.
failed_in_cm() {
  cm | python3 -c 'import json,sys; n=json.loads(json.load(sys.stdin)["data"][sys.argv[1] + ".json"]); sys.exit(0 if any(x["id"]==sys.argv[2] and x["status"]=="failed" for x in n["npus"]) else 1)' "$1" "$2"
}
failed_in_file() {
  python3 -c 'import json,sys; n=json.load(open(sys.argv[1])); sys.exit(0 if any(x["id"]==sys.argv[2] and x["status"]=="failed" for x in n["npus"]) else 1)' "$OUT/$1.json" "$2"
}
# failed_in_own I DEVICE: the device is failed in gpu-node-I's own fault.json (kept by its
# agent from the aggregator's delivery), and the verdict is fresh (verdict.stale false).
failed_in_own() {
  python3 -c 'import json,sys; n=json.load(open(sys.argv[1])); sys.exit(0 if n["verdict"]["stale"] is False and any(x["id"]==sys.argv[2] and x["status"]=="failed" for x in n["npus"]) else 1)' "$WORK/node-$1/fault.json" "$2"
}
pod_exists() { curl -sf "$KUBE/api/v1/namespaces/default/pods/$1" >/dev/null; }
pod_gone() { ! pod_exists "$1"; }
nudged() { curl -sf "$KUBE/api/v1/namespaces/default/pods/$1" | grep -q 'faultline.io/fault-refresh'; }
tainted() { curl -sf "$KUBE/api/v1/nodes/$1" | grep -q 'nvidia.com/gpu-fault'; }
show() {
  cm | python3 -c '
import json, sys
cm = json.load(sys.stdin)
idx = json.loads(cm["data"]["fault.json"])
print("  ConfigMap faultline/faultline-shard-0  sequence %(sequence)s  writer %(writer)s  summary %(summary)s" % idx)
for key in sorted(k for k in cm["data"] if k != "fault.json"):
    n = json.loads(cm["data"][key])
    bad = [(x["id"], x["status"], x["reason"]) for x in n["npus"] if x["status"] != "healthy"]
    print("  %-18s %s" % (key, bad if bad else "all %d healthy" % n["summary"]["total"]))'
}

echo "== test API server $KUBE: 3 GPU nodes, two 4-GPU training pods on each; 3 agents x 8 simulated GPUs; aggregator"
sleep 2; show
echo "== scenario on gpu-node-1: gpu3 falls off the bus (Xid 79) at 6 s; gpu6 runs at 91 C for 6 s"
echo "   (a hard fault fails at once; heat must hold 3 of 5 samples for 60 s before 'degraded')"
wait_until 20 "gpu-node-1/gpu3 fails in the ConfigMap (the scenario's fall off the bus)" failed_in_cm gpu-node-1 gpu3
show
echo "== injecting a PCIe link-down on gpu-node-2/gpu5 through its agent's API"
START=$(date +%s%N)
curl -sf -X POST "${AGENTS[1]}/v1/sim/faults" -H 'content-type: application/json' \
  -d '{"device":"gpu5","fault":"pcie-down"}' >/dev/null
wait_until 10 "gpu-node-2/gpu5 fails in gpu-node-2's own fault.json" failed_in_own 2 gpu5
echo "  in gpu-node-2's own fault.json after $(ms_since "$START") ms (the agent samples once a second;"
echo "  the aggregator delivered its verdict to the node's agent: no ConfigMap, no kubelet)"
wait_until 10 "gpu-node-2/gpu5 fails in the ConfigMap" failed_in_cm gpu-node-2 gpu5
echo "  in the ConfigMap after $(ms_since "$START") ms"
wait_until 10 "gpu-node-2/gpu5 fails in the file sink" failed_in_file gpu-node-2 gpu5
echo "  in the file sink $OUT/gpu-node-2.json after $(ms_since "$START") ms"
wait_until 10 "pod train-2a is nudged" nudged train-2a
echo "  pod default/train-2a (GPUs 0-3, healthy) nudged (annotation faultline.io/fault-refresh) after $(ms_since "$START") ms:"
echo "  kubelet refreshes its mount now, not in 60-90 s"
show
wait_until 10 "gpu-node-2 is tainted" tainted gpu-node-2
echo "  node gpu-node-2 tainted $(ms_since "$START") ms after the fault was injected"
curl -sf "$KUBE/api/v1/nodes/gpu-node-2" | python3 -c '
import json, sys
n = json.load(sys.stdin)
print("  node gpu-node-2 taints:", [t["key"] + ":" + t["effect"] for t in n["spec"]["taints"]])
print("  label faultline.io/unhealthy-devices:", n["metadata"]["labels"].get("faultline.io/unhealthy-devices"))
print("  condition:", [(c["type"], c["status"], c["reason"]) for c in n["status"]["conditions"]])'
wait_until 10 "pod train-2b (on the failed gpu5) is evicted" pod_gone train-2b
echo "  pod train-2b gone $(ms_since "$START") ms after the fault was injected"
echo "  pod default/train-2b (GPUs 4-7, with the failed gpu5) evicted through the Eviction API"
pod_exists train-2a || fail "pod train-2a was evicted, but its GPUs are healthy"
echo "  pod default/train-2a (GPUs 0-3, healthy) stays"

echo "== alert intake: seed 000's GPUAlert for gpu-node-3's GPU 2 (held by train-3a), 3 samples (the threshold)"
alert="{\"cluster\":\"demo\",\"node_name\":\"gpu-node-3\",\"gpu_uuid\":\"$(uuid_of $((BASE + 2)) 2)\",\"bus_id\":\"00000000:3B:00.0\",\"metric\":\"xid_error\",\"value\":\"Xid 79\",\"time\":1699999999}"
intake() { curl -s -X POST "$AGG/v1/alerts" -H "authorization: Bearer $1" -H 'content-type: application/json' -d "$2"; }
# expect WHAT NEEDLE TEXT: TEXT must contain NEEDLE.
expect() { [[ "$3" == *"$2"* ]] || fail "$1: expected $2 in $3"; }
answer=$(intake wrong "$alert")
echo "  without the token: $answer"
expect "the intake refuses a wrong token" '"status":401' "$answer"
for n in 1 2 3; do
  answer=$(intake "$TOKEN" "${alert/1699999999/$((1699999999 + n * 10))}")
  echo "  alert $n: $answer"
done
expect "the third alert reaches the threshold" '"acted":[{"node":"gpu-node-3"' "$answer"
answer=$(intake "$TOKEN" "[$(printf "$alert,%.0s" $(seq 19))$alert]")
echo "  20 duplicates at once: $answer"
expect "20 repeats are duplicates" '"duplicates":20' "$answer"
wait_until 15 "pod train-3a (holds the alerted GPU 2) is evicted" pod_gone train-3a
pod_exists train-3b || fail "pod train-3b was evicted, but its GPUs are healthy"
echo "  pod default/train-3a (holds GPU 2) evicted; train-3b stays: yes"
echo "== faultline status (what an SRE sees)"
status=$($BIN/faultline status --kube-server "$KUBE")
echo "$status" | sed 's/^/  /'
for n in gpu-node-1 gpu-node-2 gpu-node-3; do
  expect "faultline status lists $n" "$n " "$status"
done
echo "== faultline describe gpu-node-2 (also: kubectl faultline describe ...)"
described=$($BIN/faultline describe gpu-node-2 --kube-server "$KUBE")
echo "$described" | sed 's/^/  /'
expect "describe shows gpu5 failed" " gpu5 " "$(echo "$described" | grep ' failed ')"
expect "describe shows the quarantine record" "Quarantine:" "$described"
agents=$($BIN/faultline agents --kube-server "$KUBE")
echo "$agents" | sed 's/^/  /'
expect "faultline agents lists gpu-node-1's agent as reachable" "gpu-node-1  true" "$agents"
echo "== the PCIe link of gpu-node-2/gpu5 is repaired; an SRE releases the node"
curl -sf -X DELETE "${AGENTS[1]}/v1/sim/faults" >/dev/null
$BIN/faultline release --node gpu-node-2 --by sre-demo --reason "PCIe link reseated" --kube-server "$KUBE" | sed 's/^/  /'
curl -sf "$KUBE/api/v1/nodes/gpu-node-2" | python3 -c '
import json, sys
n = json.load(sys.stdin)
a = n["metadata"].get("annotations", {})
h = json.loads(a.get("faultline.io/quarantine-history", "[]"))
print("  node gpu-node-2 taints:", [t["key"] for t in n["spec"].get("taints") or []] or "none")
print("  condition:", [(c["type"], c["status"], c["reason"]) for c in n["status"]["conditions"] if c["type"] == "AcceleratorHealthy"])
print("  history: %d record(s); last released by %s: %s" % (len(h), h[-1]["released"]["actor"], h[-1]["released"]["reason"]))
ours = [t for t in n["spec"].get("taints") or [] if t["key"] == "nvidia.com/gpu-fault"]
sys.exit(0 if not ours and len(h) == 1 and "faultline.io/quarantine" not in a else 1)' \
  || fail "gpu-node-2 still quarantined after its release"
echo "== one GPU of eight, not the node (DRA, issue 28): gpu-node-2's 8 GPUs published by NVIDIA's DRA driver,"
echo "   one training pod per GPU holding it through its ResourceClaim; gpu6 fails (a double-bit ECC error, Xid 48)"
python3 - "$KUBE" "$(for g in 0 1 2 3 4 5 6 7; do uuid_of $((BASE + 1)) $g; done | paste -sd,)" <<'PY' || fail "publishing gpu-node-2's DRA devices and pods"
import json, sys, urllib.request
kube, uuids = sys.argv[1], sys.argv[2].split(",")
def call(method, path, body, ctype="application/json"):
    req = urllib.request.Request(kube + path, data=json.dumps(body).encode(), method=method, headers={"content-type": ctype})
    return json.load(urllib.request.urlopen(req))
node = "gpu-node-2"
call("POST", "/apis/resource.k8s.io/v1/resourceslices", {"metadata": {"name": node + "-gpu.nvidia.com-0"}, "spec": {
    "driver": "gpu.nvidia.com", "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
    "devices": [{"name": "gpu-%d" % i, "attributes": {"uuid": {"string": u}, "productName": {"string": "NVIDIA H200"}}} for i, u in enumerate(uuids)]}})
for i in range(8):
    name = "dra-train-%d" % i
    pod = call("POST", "/api/v1/namespaces/default/pods", {"metadata": {"name": name, "labels": {"app": "dra-train"}}, "spec": {
        "nodeName": node, "containers": [{"name": "trainer", "image": "trainer", "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}})
    call("PATCH", "/api/v1/namespaces/default/pods/%s/status" % name, {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}, "application/merge-patch+json")
    call("POST", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", {"metadata": {"name": name}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}})
    # What the scheduler writes: the allocation, and the pod it is reserved for.
    call("PATCH", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/%s/status" % name, {"status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node, "device": "gpu-%d" % i}]}},
        "reservedFor": [{"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}]}}, "application/merge-patch+json")
PY
START=$(date +%s%N)
curl -sf -X POST "${AGENTS[1]}/v1/sim/faults" -H 'content-type: application/json' -d '{"device":"gpu6","fault":"xid","xid":48}' >/dev/null
rules() { curl -sf "$KUBE/apis/resource.k8s.io/v1/devicetaintrules"; }
rule_enforced() { rules | grep -q '"effect":"NoSchedule"'; }
wait_until 15 "gpu-node-2/gpu6's DeviceTaintRule is enforced" rule_enforced
echo "  DeviceTaintRule NoSchedule $(ms_since "$START") ms after the fault was injected (created at effect None first;"
echo "  enforced once kube-controller-manager's dry run agreed with faultline's count of the pods holding gpu6)"
rules | python3 -c '
import json, sys
for r in json.load(sys.stdin)["items"]:
    s, t = r["spec"]["deviceSelector"], r["spec"]["taint"]
    print("  DeviceTaintRule %s: %s/%s/%s %s=%s:%s" % (r["metadata"]["name"], s["driver"], s["pool"], s["device"], t["key"], t.get("value", ""), t["effect"]))'
wait_until 15 "pod dra-train-6 (holds gpu6 through its claim) is evicted" pod_gone dra-train-6
echo "  pod default/dra-train-6 evicted through the Eviction API $(ms_since "$START") ms after the fault"
python3 - "$KUBE" <<'PY' || fail "one GPU of eight was not quarantined alone"
import json, sys, urllib.request
kube = sys.argv[1]
get = lambda p: json.load(urllib.request.urlopen(kube + p))
node = get("/api/v1/nodes/gpu-node-2")
ours = [t for t in node["spec"].get("taints") or [] if t["key"] == "nvidia.com/gpu-fault"]
rules = [r for r in get("/apis/resource.k8s.io/v1/devicetaintrules")["items"] if r["spec"]["taint"]["effect"] in ("NoSchedule", "NoExecute")]
slices = [s for s in get("/apis/resource.k8s.io/v1/resourceslices")["items"] if s["spec"].get("nodeName") == "gpu-node-2"]
devices = [d["name"] for s in slices for d in s["spec"]["devices"]]
free = [d for d in devices if not any(r["spec"]["deviceSelector"].get("pool") == "gpu-node-2" and r["spec"]["deviceSelector"].get("device") == d for r in rules)]
pods = [p["metadata"]["name"] for p in get("/api/v1/namespaces/default/pods?labelSelector=app%3Ddra-train")["items"]]
print("  node gpu-node-2 taints by faultline: %s" % (len(ours) or "none"))
print("  GPUs still schedulable on gpu-node-2: %d of %d (%s)" % (len(free), len(devices), ", ".join(free)))
print("  training pods still running: %d of 8" % len(pods))
sys.exit(0 if not ours and len(free) == 7 and len(pods) == 7 else 1)
PY
described=$($BIN/faultline describe gpu-node-2 --kube-server "$KUBE")
echo "$described" | grep -E 'Isolation:|Rule:' | sed 's/^/  /'
expect "describe lists gpu6's rule" "Rule:      gpu6" "$described"
echo "== gpu-node-1's own fault.json: what its pods read at /config/fault.json (hostPath or sidecar)"
wait_until 10 "gpu-node-1's own fault.json says gpu3 failed, verdict fresh" failed_in_own 1 gpu3
python3 - "$WORK/node-1/fault.json" <<'PY' || fail "gpu-node-1's own fault.json does not say gpu3 failed with a fresh verdict"
import json, sys
n = json.load(open(sys.argv[1]))
v = n["verdict"]
print("  %s: node %s  verdict of %s, sequence %s, confirmed %s, stale %s (after %s s unconfirmed)"
      % (sys.argv[1], n["node"], v.get("writer"), v["sequence"], v.get("confirmed"), str(v["stale"]).lower(), v["stale_after_s"]))
print("  summary %(summary)s  readings at %(readings_at)s" % n)
for x in n["npus"]:
    if x["status"] != "healthy":
        print("  %-5s %-8s %s" % (x["id"], x["status"], x["reason"]))
gpu3 = [x for x in n["npus"] if x["id"] == "gpu3"]
sys.exit(0 if v["stale"] is False and gpu3 and gpu3[0]["status"] == "failed" else 1)
PY
# The consumer kit reads it as a pod would (and exits 3 on the failed device).
kit=$(timeout 10 python3 consumers/python/faultline_consumer.py --file "$WORK/node-1/fault.json" --exit-on-failed) && code=0 || code=$?
echo "$kit" | grep -v ' healthy -$' | sed 's/^/  consumer kit: /' || true
[[ $code == 3 ]] || fail "the consumer kit did not exit 3 on gpu-node-1's failed gpu3 (status $code)"
expect "the consumer kit names the failed gpu3" "FAILED gpu-node-1 gpu3 " "$kit"
cat <<TXT
== look yourself (./demo.sh --serve keeps all this running):
  kubectl --server $KUBE get nodes,pods -A
  kubectl --server $KUBE get lease,cm -n faultline
  kubectl --server $KUBE get node gpu-node-1 -o yaml     # taint, label, condition, faultline.io/quarantine
  kubectl --server $KUBE get devicetaintrules -o yaml    # gpu-node-2/gpu6 alone, and the controller's dry run
  kubectl --server $KUBE get events -n default
  $BIN/faultline status --kube-server $KUBE
  $BIN/faultline agents -o wide --kube-server $KUBE
  $BIN/faultline describe gpu-node-3 -o yaml --kube-server $KUBE
  $BIN/faultline release --node gpu-node-3 --by me --kube-server $KUBE
  kubectl --server $KUBE get cm faultline-shard-0 -n faultline -o jsonpath='{.data.gpu-node-2\.json}'
  ls -la $OUT; cat $OUT/gpu-node-2.json   # the file sink: ..data -> ..<timestamp>/, a key per node
  curl -s ${AGENTS[0]}/v1/health?format=pretty
  cat $WORK/node-1/fault.json                  # gpu-node-1's own fault.json (its agent's --fault-dir)
  curl -s ${AGENTS[0]}/v1/fault                # the same, served by its agent (?watch=true: a stream)
  curl -s $AGG/metrics | grep -E 'faultline_aggregator_(devices|lease_held|pod_nudges|remediation|quarantined|intake)'
  curl -s -X POST ${AGENTS[2]}/v1/sim/faults -H 'content-type: application/json' -d '{"device":"gpu0","fault":"xid","xid":48}'
TXT
if [[ "${1:-}" == "--serve" ]]; then
  echo "== left running (Ctrl-C to stop)"; wait
fi
