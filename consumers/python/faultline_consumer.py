"""faultline consumer: react to your own node's device health. Python 3.8+, stdlib only.

Two ways a pod reads its node's entry (consumers/README.md):

* the shard ConfigMaps projected into one volume (Pod Security baseline):
  ``watch_entry("/config", node)`` reads ``/config/<node>.json``;
* the agent's node file on a hostPath (privileged namespaces, milliseconds):
  ``watch_file("/config/fault.json")`` with ``/run/faultline`` mounted at ``/config``.

Files are swapped, never rewritten in place: kubelet swaps the ``..data`` symlink of a
ConfigMap volume (``atomic_writer.go``), the agent renames a new file over the old one.
So this module re-opens the path on every change it sees (the ``..data`` target, the
file's inode, size or mtime) and compares what it read; it never holds a file open.

Command line (exit status 3 when ``--exit-on-failed`` sees a failed device)::

    python3 faultline_consumer.py --dir /config --node "$NODE_NAME" --exit-on-failed
    python3 faultline_consumer.py --file /config/fault.json --device gpu3

Each change prints one line per device: ``<node> <device> <status> <reason or ->``.
"""

import argparse
import json
import os
import sys
import time
from collections import namedtuple

STATUSES = ("healthy", "degraded", "failed", "unknown")

Device = namedtuple("Device", "id status reason uuid pci_bus_id")


class Entry(namedtuple("Entry", "node devices reachable")):
    """One node's published health: its devices, and whether its agent was reached."""

    def failed(self):
        return [d for d in self.devices if d.status == "failed"]

    def degraded(self):
        return [d for d in self.devices if d.status == "degraded"]


def parse(text, node=None, only=None):
    """An Entry from a node document (the aggregator's ``<node>.json`` or the agent's
    node file; both list ``npus``). ``node``: refuse another node's document.
    ``only``: keep the devices named by id, UUID or PCI bus id. Raises ValueError."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("npus"), list):
        raise ValueError("not a faultline node document (no npus list)")
    if node is not None and doc.get("node") != node:
        raise ValueError("document of node %r, not %r" % (doc.get("node"), node))
    devices = []
    for d in doc["npus"]:
        status = d.get("status")
        dev = Device(
            str(d.get("id")),
            status if status in STATUSES else "unknown",
            d.get("reason"),
            d.get("uuid"),
            d.get("pci_bus_id"),
        )
        if only and not ({dev.id, dev.uuid, dev.pci_bus_id} & set(only)):
            continue
        devices.append(dev)
    agent = doc.get("agent")
    reachable = agent.get("reachable", True) if isinstance(agent, dict) else True
    return Entry(doc.get("node"), devices, bool(reachable))


def read(path, node=None, only=None):
    """The Entry at ``path``; None when it is not there (this node is not published)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return parse(text, node, only)


def _stamp(path):
    """What changes when the file is swapped: the ``..data`` target and the inode."""
    data = os.path.join(os.path.dirname(path), "..data")
    try:
        target = os.readlink(data)
    except OSError:
        target = None
    try:
        st = os.stat(path)
        return (target, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return (target, None)


def watch(path, node=None, only=None, interval=0.5, errors=None):
    """Yield the Entry (or None: not published) at ``path`` now and after every change.

    A document that does not parse is skipped (and counted in ``errors``, a dict, if
    given); the last good one stands, and the next change is read again."""
    stamp, last, first = object(), object(), True
    while True:
        now = _stamp(path)
        if now != stamp:
            stamp = now
            try:
                entry = read(path, node, only)
            except (ValueError, OSError) as e:
                if errors is not None:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                print("faultline_consumer: %s: %s" % (path, e), file=sys.stderr)
            else:
                if first or entry != last:
                    first, last = False, entry
                    yield entry
        time.sleep(interval)


def watch_entry(directory, node, only=None, interval=0.5):
    """``watch`` of ``<directory>/<node>.json`` (the projected shard ConfigMaps)."""
    return watch(os.path.join(directory, node + ".json"), node, only, interval)


def watch_file(path, node=None, only=None, interval=0.5):
    """``watch`` of the agent's node file (mounted from the host)."""
    return watch(path, node, only, interval)


def describe(entry, node):
    """The lines printed for one change."""
    if entry is None:
        return ["%s - unknown not-published" % node]
    who = entry.node or node
    if not entry.reachable:
        return ["%s - unknown agent-unreachable" % who]
    return [
        "%s %s %s %s" % (who, d.id, d.status, d.reason or "-") for d in entry.devices
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dir", help="the projected shard ConfigMaps (with --node)")
    src.add_argument("--file", help="the agent's node file")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"),
                   help="this node (default: $NODE_NAME)")
    p.add_argument("--device", action="append", default=[],
                   help="only this device (id, UUID or bus id); repeatable")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between looks")
    p.add_argument("--exit-on-failed", action="store_true",
                   help="exit 3 once a watched device is failed")
    a = p.parse_args(argv)
    if a.dir and not a.node:
        p.error("--dir needs --node or $NODE_NAME")
    if a.dir:
        changes = watch_entry(a.dir, a.node, a.device or None, a.interval)
    else:
        changes = watch_file(a.file, a.node, a.device or None, a.interval)
    for entry in changes:
        for line in describe(entry, a.node or "-"):
            print(line, flush=True)
        if a.exit_on_failed and entry is not None and entry.failed():
            for d in entry.failed():
                print("FAILED %s %s %s" % (entry.node, d.id, d.reason or "-"), flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
