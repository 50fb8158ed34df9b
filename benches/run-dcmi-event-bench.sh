#!/usr/bin/env bash
# Ascend fault event to the agent's document (issue 13): the C double of libdcmi calls
# the agent's dcmi_subscribe_fault_event callback (its thread reads one line per event
# from a file, looking every 10 ms); the callback wakes the sampler, which reads every
# chip and publishes. Timed from writing the event line to the long-poll answer that
# shows the chip failed, with --interval 30s (so no poll can be what found it).
# Usage: benches/run-dcmi-event-bench.sh   (BENCH_EVENTS=40, BENCH_PAUSE=0.2 s between
# fault-and-recovery pairs by default; BENCH_PAUSE=0 is a storm, which the agent bounds
# to 10 event-woken samples a second)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p faultline-agent >&2
mkdir -p target/bench
cc -shared -fPIC -O2 -o target/bench/libdcmi.so tests/fixtures/dcmi/fake_dcmi.c -lpthread
work=$(mktemp -d)
trap 'kill $agent 2>/dev/null || true; rm -rf "$work"' EXIT
: >"$work/events"
printf 'card_count=8\nevents_file=%s\n' "$work/events" >"$work/state"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
FAKE_DCMI_STATE="$work/state" target/release/faultline-agent --source dcmi \
  --dcmi-lib target/bench/libdcmi.so --interval 30s --cache-ttl 120s \
  --listen "127.0.0.1:$port" --node-name bench >"$work/agent.log" 2>&1 &
agent=$!
echo "machine: $(nproc) cores, $(uname -m), $(date -u +%Y-%m-%d); 8 chips; ${BENCH_EVENTS:-40} events"
python3 - "$port" "$work/events" "${BENCH_EVENTS:-40}" "${BENCH_PAUSE:-0.2}" <<'PY'
import json, sys, time, urllib.request
port, events, n, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
base = f"http://127.0.0.1:{port}"
def get(path, timeout=10):
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return r.read().decode()
def event(line):
    with open(events, "a") as f:
        f.write(line + "\n")
deadline = time.time() + 20
while True:
    try:
        if 'mode="events"} 1' in get("/metrics"):
            break
    except OSError:
        pass
    if time.time() > deadline:
        sys.exit("the agent did not subscribe")
    time.sleep(0.05)
# The first reading is discarded (warm-up); a harmless one-off event wakes a second one.
event("0 A4025021 0 2")
while len(json.loads(get("/v1/health"))["npus"]) < 8:
    time.sleep(0.05)
def wait(chip, status):
    doc = json.loads(get("/v1/health"))
    while True:
        d = next(x for x in doc["npus"] if x["id"] == f"npu{chip}")
        if d["status"] == status:
            return
        doc = json.loads(get(f"/v1/health?wait_generation={doc['generation']}&timeout_ms=5000"))
lat = []
for i in range(n):
    chip = i % 8
    t0 = time.monotonic()
    event(f"{chip} 80E18402 2 1")      # SeparateNPU, occurs
    wait(chip, "failed")
    lat.append((time.monotonic() - t0) * 1000)
    event(f"{chip} 80E18402 2 0")      # recovers
    wait(chip, "healthy")
    time.sleep(pause)                  # events a storm apart: the agent samples at most 10 a second on events
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
print(f"fault event to failed in /v1/health: p50 {q(0.5):.1f} ms, p95 {q(0.95):.1f} ms, max {lat[-1]:.1f} ms over {n} events")
PY
