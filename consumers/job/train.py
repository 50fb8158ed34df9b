"""An example training loop that checkpoints and leaves when a GPU it holds fails.

It resumes from its last checkpoint, trains (here: counts steps), checkpoints every
CHECKPOINT_EVERY steps, and watches its node's entry with faultline_consumer in a
thread. When one of its devices is failed it writes a checkpoint at once and exits 42:
the Job's podFailurePolicy ignores that exit (it does not count against backoffLimit),
so the Job starts a new pod, which the quarantine taint keeps off this node, and that
pod resumes from the checkpoint.

Warned before its eviction (the pod's `faultline.io/checkpoint-grace` annotation; POD_UID
from the downward API): when its node's entry names this pod in `drain`, it stops
training, checkpoints, and acknowledges through its node's agent (FAULTLINE_AGENT,
http://$HOST_IP:8082), then waits for the eviction, which comes at once; without
FAULTLINE_AGENT it exits 42 instead, which acknowledges as well. FAULTLINE_ON=drain makes
it react to its drain intent only, not to a failed device it reads itself (the
aggregator decides). Evicted without a warning (SIGTERM), it loses the steps since its
last periodic checkpoint, and says how many.

It says when its node's verdict is no longer confirmed (the aggregator or the agent fell
silent): the devices the verdict called healthy then read "unknown", never "healthy".
It goes on training: unknown is "could not look", not "broken"; a failed device still
stops it.

Environment: NODE_NAME (downward API), FAULTLINE_FILE (the node's own fault.json:
/config/fault.json, on a hostPath or written by the kit's follow mode as a sidecar) or
FAULTLINE_DIR (the projected shard ConfigMaps), FAULTLINE_DEVICES (ids, UUIDs or bus
ids of the devices this pod holds, comma separated; default: all; NVIDIA's device
plugin sets NVIDIA_VISIBLE_DEVICES to the UUIDs), CHECKPOINT_DIR, STEPS, STEP_SECONDS,
CHECKPOINT_EVERY, POD_UID, FAULTLINE_AGENT, FAULTLINE_ON (`failed`, the default, or
`drain`).
"""
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Next to this file in the Job's ConfigMap; in consumers/python/ in the repository.
sys.path[:0] = [HERE, os.path.join(HERE, "..", "python")]
import faultline_consumer  # noqa: E402

EXIT_DEVICE_FAILED = 42


def checkpoint(path, step):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step, "at": time.time()}, f)
    os.replace(tmp, path)


def devices():
    raw = os.environ.get("FAULTLINE_DEVICES") or os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
    names = [d.strip() for d in raw.split(",") if d.strip()]
    return [d for d in names if d not in ("all", "none", "void")] or None


def main():
    node = os.environ["NODE_NAME"]
    ckpt = os.path.join(os.environ.get("CHECKPOINT_DIR", "/checkpoints"), "ckpt.json")
    steps = int(os.environ.get("STEPS", "1000000"))
    step_seconds = float(os.environ.get("STEP_SECONDS", "0.05"))
    every = int(os.environ.get("CHECKPOINT_EVERY", "20"))
    step = 0
    if os.path.exists(ckpt):
        with open(ckpt) as f:
            step = json.load(f)["step"]
        print("resumed from step %d" % step, flush=True)

    print("training from step %d" % step, flush=True)
    failed = threading.Event()
    drain = threading.Event()
    why = []
    uid = os.environ.get("POD_UID")
    on_failed = os.environ.get("FAULTLINE_ON", "failed") != "drain"
    state = {"step": step, "saved": step}

    def terminated(*_):
        # The eviction's SIGTERM: what was not checkpointed is lost. Never exit 0 here:
        # the pod would be Succeeded and the Job complete before its last step.
        lost = state["step"] - state["saved"]
        print("terminated at step %d; last checkpoint at step %d: %d steps lost"
              % (state["step"], state["saved"], lost), flush=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, terminated)

    def watcher():
        only = devices()
        if os.environ.get("FAULTLINE_FILE"):
            changes = faultline_consumer.watch_file(os.environ["FAULTLINE_FILE"], node, only, 0.2)
        else:
            changes = faultline_consumer.watch_entry(
                os.environ.get("FAULTLINE_DIR", "/config"), node, only, 0.2)
        stale = None
        for entry in changes:
            if entry is not None and entry.stale != stale:
                stale = entry.stale
                print("verdict on %s: %s" % (node, "stale (%s): devices it called healthy "
                                             "read unknown" % stale if stale else "confirmed"),
                      flush=True)
            intent = entry.drain_for(uid) if entry is not None else None
            if intent is not None:
                why.append("evicted after %s (%s)" % (intent.evict_after, intent.reason))
                drain.set()
                return
            if on_failed and entry is not None and entry.failed():
                why.extend("%s (%s)" % (d.id, d.reason) for d in entry.failed())
                failed.set()
                return

    threading.Thread(target=watcher, daemon=True).start()
    while step < steps:
        if drain.is_set():
            checkpoint(ckpt, step)
            state["saved"] = step
            print("drain requested on %s: %s; checkpointed at step %d" % (node, why[0], step),
                  flush=True)
            agent = os.environ.get("FAULTLINE_AGENT")
            if not agent:
                print("exiting %d (acknowledges the intent)" % EXIT_DEVICE_FAILED, flush=True)
                return EXIT_DEVICE_FAILED
            try:
                faultline_consumer.acknowledge(agent, uid)
                print("acknowledged at %.3f; waiting for the eviction" % time.time(), flush=True)
            except (ValueError, OSError) as e:
                print("cannot acknowledge (%s): evicted at the deadline" % e, flush=True)
            while True:
                time.sleep(1)
        if failed.is_set():
            checkpoint(ckpt, step)
            print("device failed on %s: %s; checkpointed at step %d, exiting %d"
                  % (node, ", ".join(why), step, EXIT_DEVICE_FAILED), flush=True)
            return EXIT_DEVICE_FAILED
        time.sleep(step_seconds)
        step += 1
        state["step"] = step
        if step % every == 0:
            checkpoint(ckpt, step)
            state["saved"] = step
    checkpoint(ckpt, step)
    print("done at step %d" % step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
