"""An example training loop that checkpoints and leaves when a GPU it holds fails.

It resumes from its last checkpoint, trains (here: counts steps), checkpoints every
CHECKPOINT_EVERY steps, and watches its node's entry with faultline_consumer in a
thread. When one of its devices is failed it writes a checkpoint at once and exits 42:
the Job's podFailurePolicy ignores that exit (it does not count against backoffLimit),
so the Job starts a new pod, which the quarantine taint keeps off this node, and that
pod resumes from the checkpoint.

It says when its node's verdict is no longer confirmed (the aggregator or the agent fell
silent): the devices the verdict called healthy then read "unknown", never "healthy".
It goes on training: unknown is "could not look", not "broken"; a failed device still
stops it.

Environment: NODE_NAME (downward API), FAULTLINE_FILE (the node's own fault.json:
/config/fault.json, on a hostPath or written by the kit's follow mode as a sidecar) or
FAULTLINE_DIR (the projected shard ConfigMaps), FAULTLINE_DEVICES (ids, UUIDs or bus
ids of the devices this pod holds, comma separated; default: all; NVIDIA's device
plugin sets NVIDIA_VISIBLE_DEVICES to the UUIDs), CHECKPOINT_DIR, STEPS, STEP_SECONDS,
CHECKPOINT_EVERY.
"""
import json
import os
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

    failed = threading.Event()
    why = []

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
            if entry is not None and entry.failed():
                why.extend("%s (%s)" % (d.id, d.reason) for d in entry.failed())
                failed.set()
                return

    threading.Thread(target=watcher, daemon=True).start()
    while step < steps:
        if failed.is_set():
            checkpoint(ckpt, step)
            print("device failed on %s: %s; checkpointed at step %d, exiting %d"
                  % (node, ", ".join(why), step, EXIT_DEVICE_FAILED), flush=True)
            return EXIT_DEVICE_FAILED
        time.sleep(step_seconds)
        step += 1
        if step % every == 0:
            checkpoint(ckpt, step)
    checkpoint(ckpt, step)
    print("done at step %d" % step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
