"""faultline consumer: react to your own node's device health. Python 3.8+, stdlib only.

Three ways a pod reads its node's entry (consumers/README.md):

* the node's own ``fault.json``, kept by its agent (the aggregator's verdict on this
  node, with ``verdict``: whose, and whether it is still confirmed), either on a
  read-only hostPath (``/run/faultline/node`` mounted at ``/config``) or, in a
  ``restricted`` namespace, written into an emptyDir by this module's follow mode
  running as a sidecar: ``watch_file("/config/fault.json")``;
* the shard ConfigMaps projected into one volume (small clusters):
  ``watch_entry("/config", node)`` reads ``/config/<node>.json``.

Files are swapped, never rewritten in place: kubelet swaps the ``..data`` symlink of a
ConfigMap volume (``atomic_writer.go``), the agent and the follow mode rename a new file
over the old one. So this module re-opens the path on every change it sees (the
``..data`` target, the file's inode, size or mtime) and compares what it read; it never
holds a file open.

A verdict that is no longer confirmed is reported (``Entry.stale``, and the line
``<node> - unknown verdict-stale``): by the agent itself (``verdict.stale``), or, when
nobody rewrites the file any more (the agent or the follow mode stopped), by its age
(``verdict.confirmed`` older than ``verdict.stale_after_s``); then every device the
verdict called healthy reads ``unknown verdict-stale``, as the agent would write it.
Failed and degraded devices keep their status.

Command line (exit status 3 when ``--exit-on-failed`` sees a failed device, 4 when
``--exit-on-drain`` sees this pod's drain intent)::

    python3 faultline_consumer.py --file /config/fault.json --exit-on-failed
    python3 faultline_consumer.py --dir /config --node "$NODE_NAME" --device gpu3
    python3 faultline_consumer.py --file /config/fault.json --pod-uid "$POD_UID" --exit-on-drain
    python3 faultline_consumer.py --ack "http://$HOST_IP:8082" --pod-uid "$POD_UID"

Each change prints one line per device: ``<node> <device> <status> <reason or ->``, and
one per drain intent: ``<node> - drain <namespace>/<pod> <evict_after> <reason>``.

Warn before evicting (docs/remediation.md#warn-before-evicting): a pod annotated
``faultline.io/checkpoint-grace: 300s`` that uses a failed device is named in its node's
entry (``Entry.drains``) with a deadline (``evict_after``) before it is evicted. It
checkpoints, then acknowledges: it exits, or, to stay up until the eviction,
``acknowledge("http://$HOST_IP:8082", uid)`` (its node's agent, from the pod's own
address; no API rights). It is then evicted at once, and at the deadline in any case.

Follow mode, the sidecar of a ``restricted`` namespace (no hostPath): follow the agent's
``/v1/fault?watch=true`` on the node's port 8082 and keep ``--write`` a copy of the
latest document, replaced by rename; it reconnects with backoff and exits non-zero only
on bad arguments::

    python3 faultline_consumer.py --url "http://$HOST_IP:8082/v1/fault" --write /config/fault.json
"""

import argparse
import calendar
import http.client
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import namedtuple

STATUSES = ("healthy", "degraded", "failed", "unknown")
# The reasons of a verdict that cannot be trusted (the agent's words for its devices):
# none confirmed within its stale_after_s, or none received yet.
STALE = "verdict-stale"
NO_VERDICT = "no-verdict"
# A verdict is judged stale by its age only this long after the agent would have said so
# itself: a running agent rewrites the file when its verdict turns stale.
STALE_GRACE_S = 5.0
# Longest line the follow mode accepts from the agent's stream (a document of 1,024
# devices is about 400 KiB); a longer one is skipped.
MAX_LINE = 1 << 20

Device = namedtuple("Device", "id status reason uuid pci_bus_id")
# A pod asked to checkpoint before its eviction: evicted at ``evict_after`` (RFC 3339) at
# the latest, at once once ``acknowledged``.
Drain = namedtuple("Drain", "namespace pod uid devices reason requested evict_after acknowledged")


class Entry(namedtuple("Entry", "node devices reachable stale drains", defaults=(None, ()))):
    """One node's published health: its devices, whether its agent was reached,
    ``stale``: None, or why the verdict is not to be trusted (``verdict-stale``: not
    confirmed in time; ``no-verdict``: none received yet), and ``drains``: the drain
    intents of its pods (a tuple of Drain). Only the node's own ``fault.json`` has a
    verdict; the shard ConfigMaps' entries are never stale here."""

    def drain_for(self, uid):
        """This pod's drain intent (by its UID, the downward API's ``metadata.uid``), or
        None."""
        return next((d for d in self.drains if uid and d.uid == uid), None)

    def failed(self):
        return [d for d in self.devices if d.status == "failed"]

    def degraded(self):
        return [d for d in self.devices if d.status == "degraded"]


_RFC3339 = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(?:([Zz])|([+-])(\d\d):(\d\d))$")


def parse_time(text):
    """Seconds since the epoch of an RFC 3339 time (``Z`` or an offset, any fraction);
    None when it does not parse. (``datetime.fromisoformat`` reads ``Z`` only from 3.11.)"""
    m = _RFC3339.match(text) if isinstance(text, str) else None
    if not m:
        return None
    y, mo, d, h, mi, s = (int(x) for x in m.group(1, 2, 3, 4, 5, 6))
    try:
        t = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0))
    except (ValueError, OverflowError):
        return None
    if m.group(7):
        t += int(m.group(7)) / 10 ** len(m.group(7))
    if m.group(9):
        off = int(m.group(10)) * 3600 + int(m.group(11)) * 60
        t -= off if m.group(9) == "+" else -off
    return t


def stale_at(doc):
    """When the verdict of a node's own ``fault.json`` must be judged stale by its age
    (seconds since the epoch): ``verdict.confirmed`` + ``verdict.stale_after_s`` +
    ``STALE_GRACE_S``; None without a confirmed verdict (or outside the node's own file)."""
    v = doc.get("verdict") if isinstance(doc, dict) else None
    if not isinstance(v, dict):
        return None
    confirmed = parse_time(v.get("confirmed"))
    after = v.get("stale_after_s")
    if confirmed is None or not isinstance(after, (int, float)):
        return None
    return confirmed + after + STALE_GRACE_S


def mark_stale(doc):
    """``doc`` (a node's own ``fault.json``) as its agent writes it once the verdict is
    stale: ``verdict.stale``, every healthy device ``unknown`` (``verdict-stale``), the
    summary counted again. Returns a new dict."""
    doc = json.loads(json.dumps(doc))
    doc.setdefault("verdict", {})["stale"] = True
    counts = dict.fromkeys(STATUSES, 0)
    for d in doc.get("npus", []):
        if d.get("status") == "healthy":
            d["status"], d["reason"] = "unknown", STALE
        status = d.get("status")
        counts[status if status in counts else "unknown"] += 1
    counts["total"] = sum(counts.values())
    doc["summary"] = counts
    return doc


def check_node_document(doc, node=None):
    """Raise ValueError unless ``doc`` is a node document (of ``node``, when given)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("npus"), list):
        raise ValueError("not a faultline node document (no npus list)")
    if node is not None and doc.get("node") != node:
        raise ValueError("document of node %r, not %r" % (doc.get("node"), node))


def parse(text, node=None, only=None, now=None):
    """An Entry from a node document (the node's own ``fault.json``, the aggregator's
    ``<node>.json`` or the agent's ``--health-file``; all list ``npus``). ``node``: refuse
    another node's document. ``only``: keep the devices named by id, UUID or PCI bus id.
    ``now`` (seconds since the epoch; default: the clock) judges the verdict's age.
    Raises ValueError."""
    doc = json.loads(text)
    check_node_document(doc, node)
    stale = None
    verdict = doc.get("verdict")
    if isinstance(verdict, dict):
        at = stale_at(doc)
        aged = at is not None and (time.time() if now is None else now) > at
        if verdict.get("stale") or aged:
            doc = mark_stale(doc)
            stale = STALE if verdict.get("writer") else NO_VERDICT
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
    drains = tuple(
        Drain(str(d.get("namespace")), str(d.get("pod")), str(d.get("uid")),
              tuple(str(x) for x in d.get("devices") or ()), d.get("reason"),
              d.get("requested"), d.get("evict_after"), d.get("acknowledged"))
        for d in doc.get("drain") or () if isinstance(d, dict)
    )
    return Entry(doc.get("node"), devices, bool(reachable), stale, drains)


def acknowledge(agent, uid, timeout=5.0):
    """Tell the node's agent (``http://HOST:PORT``, its ``--fault-listen``) that pod
    ``uid`` has checkpointed: faultline evicts it now instead of at its deadline. Must
    run in that pod (the agent takes it only from the pod's own address). True when
    taken (202; 200: taken before); raises ValueError with the agent's answer otherwise
    (403: not from the pod's address; 404: no intent for it), OSError when the agent
    cannot be reached."""
    u = urllib.parse.urlsplit(agent)
    if u.scheme != "http" or not u.hostname:
        raise ValueError("%s: the agent's http://HOST:PORT" % agent)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/drain/ack", body=json.dumps({"uid": uid}),
                     headers={"Content-Type": "application/json",
                              "User-Agent": "faultline-consumer"})
        resp = conn.getresponse()
        body = resp.read(4096).decode("utf-8", "replace")
    except http.client.HTTPException as e:
        raise OSError("%s: %s" % (agent, e)) from e
    finally:
        conn.close()
    if resp.status in (200, 202):
        return True
    try:
        why = json.loads(body).get("error", body)
    except ValueError:
        why = body
    raise ValueError("HTTP %d: %s" % (resp.status, why))


def read(path, node=None, only=None):
    """The Entry at ``path``; None when it is not there (this node is not published)."""
    return _read(path, node, only)[0]


def _read(path, node, only):
    """The Entry at ``path`` and when its verdict ages out (None: never)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    entry = parse(text, node, only)
    return entry, (None if entry.stale else stale_at(json.loads(text)))


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
    """Yield the Entry (or None: not published) at ``path`` now and after every change,
    including its verdict turning stale by age while the file stays as it is.

    A document that does not parse is skipped (and counted in ``errors``, a dict, if
    given); the last good one stands, and the next change is read again."""
    stamp, last, first, ages_at = object(), object(), True, None
    while True:
        now = _stamp(path)
        if now != stamp or (ages_at is not None and time.time() > ages_at):
            stamp = now
            try:
                entry, ages_at = _read(path, node, only)
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
    """``watch`` of the node's own ``fault.json`` (or the agent's ``--health-file``)."""
    return watch(path, node, only, interval)


def describe(entry, node):
    """The lines printed for one change."""
    if entry is None:
        return ["%s - unknown not-published" % node]
    who = entry.node or node
    if not entry.reachable:
        return ["%s - unknown agent-unreachable" % who]
    head = ["%s - unknown %s" % (who, entry.stale)] if entry.stale else []
    return head + [
        "%s %s %s %s" % (who, d.id, d.status, d.reason or "-") for d in entry.devices
    ] + [
        "%s - drain %s/%s %s %s" % (who, d.namespace, d.pod, d.evict_after, d.reason or "-")
        for d in entry.drains
    ]


def write_atomic(path, data):
    """Replace ``path`` with ``data`` (bytes): a temporary file in the same directory,
    renamed over it, so a reader sees the old document or the new one, never half."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def watch_url(url):
    """``url`` with ``watch=true`` in its query (kept when it already has one)."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if not any(k == "watch" for k, _ in query):
        query.append(("watch", "true"))
    return parts._replace(query=urllib.parse.urlencode(query))


class Follower:
    """Follow mode: keep ``path`` a copy of the latest node document the agent streams
    at ``url`` (``GET /v1/fault?watch=true``: one document a line, a blank line as a
    heartbeat). Reconnects with exponential backoff (``backoff``: first and longest wait,
    seconds, with jitter); a line over ``max_line`` bytes, or one that is not a node
    document (of ``node``, when given), is skipped. While the agent cannot be reached,
    the copy it last wrote is rewritten once as stale (``mark_stale``) when its verdict
    ages out, so the file never keeps saying "healthy" on its own. ``stop``: a
    threading.Event that ends ``run``."""

    def __init__(self, url, path, node=None, max_line=MAX_LINE, backoff=(0.5, 30.0),
                 read_timeout=35.0, stop=None, log=None):
        self.url = watch_url(url)
        if self.url.scheme not in ("http", "https") or not self.url.hostname:
            raise ValueError("%s: an http:// URL with a host" % url)
        self.path, self.node, self.max_line = path, node, max_line
        self.backoff, self.read_timeout = backoff, read_timeout
        self.stop = stop or threading.Event()
        self.log = log or (lambda msg: print("faultline_consumer: %s" % msg, file=sys.stderr,
                                            flush=True))
        self.written = None     # the bytes last written
        self.doc = None         # the document last written (parsed)
        self.writes = 0
        self._error = None      # the last write error logged, not to repeat it

    def run(self):
        wait = self.backoff[0]
        while not self.stop.is_set():
            streamed = False
            try:
                streamed = self._follow()
            except (OSError, http.client.HTTPException, ValueError) as e:
                self.log("%s: %s" % (self.url.geturl(), e or type(e).__name__))
            if self.stop.is_set():
                return
            # A stream that brought documents and ended (its life is bounded) is followed
            # again soon; anything else (no connection, an error, the plain document of
            # an agent with too many watches open) waits longer each time.
            wait = self.backoff[0] if streamed else min(wait * 2, self.backoff[1])
            self._pause(wait * random.uniform(0.5, 1.0))

    def _pause(self, seconds):
        """Sleep ``seconds`` (or until stopped), marking the copy stale when it ages out."""
        end = time.time() + seconds
        while not self.stop.is_set():
            now = time.time()
            fresh = self.doc is not None and not (self.doc.get("verdict") or {}).get("stale")
            at = stale_at(self.doc) if fresh else None
            if at is not None and now > at:
                self.log("%s: no verdict confirmed since %s: marked stale"
                         % (self.path, self.doc["verdict"].get("confirmed")))
                self.doc = mark_stale(self.doc)
                self._write(json.dumps(self.doc, separators=(",", ":")).encode())
                continue
            if now >= end:
                return
            self.stop.wait(min(end, at if at is not None else end) - now)

    def _follow(self):
        """One connection; whether it was a stream that brought documents."""
        u = self.url
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname, u.port, timeout=self.read_timeout)
        got = 0
        try:
            conn.request("GET", urllib.parse.urlunsplit(("", "", u.path or "/", u.query, "")),
                         headers={"Accept": "application/x-ndjson",
                                  "User-Agent": "faultline-consumer"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ValueError("HTTP %d %s" % (resp.status, resp.read(512).decode("utf-8", "replace")))
            stream = "ndjson" in (resp.getheader("Content-Type") or "")
            while not self.stop.is_set():
                line = resp.readline(self.max_line + 1)
                if not line:
                    return stream and got > 0
                if len(line) > self.max_line and not line.endswith(b"\n"):
                    self.log("a line over %d bytes: skipped" % self.max_line)
                    while line and not line.endswith(b"\n"):
                        line = resp.readline(self.max_line + 1)
                    continue
                line = line.strip()
                if not line:
                    continue            # a heartbeat
                try:
                    doc = json.loads(line)
                    check_node_document(doc, self.node)
                except ValueError as e:
                    self.log("skipped a line: %s" % e)
                    continue
                got += 1
                self.doc = doc
                self._write(line)
        finally:
            conn.close()
        return False

    def _write(self, data):
        if data == self.written:
            return
        try:
            write_atomic(self.path, data)
        except OSError as e:
            if str(e) != self._error:
                self.log("cannot write %s: %s (retried with the next document)" % (self.path, e))
                self._error = str(e)
            return
        self._error, self.written = None, data
        self.writes += 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", help="the node's own fault.json (or the agent's --health-file)")
    src.add_argument("--dir", help="the projected shard ConfigMaps (with --node)")
    src.add_argument("--url", help="follow mode: the agent's /v1/fault (with --write)")
    p.add_argument("--write", help="follow mode: keep this file the latest document")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"),
                   help="this node (default: $NODE_NAME)")
    p.add_argument("--device", action="append", default=[],
                   help="only this device (id, UUID or bus id); repeatable")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between looks")
    p.add_argument("--exit-on-failed", action="store_true",
                   help="exit 3 once a watched device is failed")
    p.add_argument("--pod-uid", default=os.environ.get("POD_UID"),
                   help="this pod's UID (default: $POD_UID; the downward API's metadata.uid)")
    p.add_argument("--exit-on-drain", action="store_true",
                   help="exit 4 once this pod (--pod-uid) is asked to checkpoint before its eviction")
    src.add_argument("--ack", metavar="AGENT",
                     help="acknowledge this pod's drain intent (--pod-uid) to its node's "
                          "agent, http://HOST:PORT, and exit: 0 taken, 1 refused")
    a = p.parse_args(argv)
    if (a.exit_on_drain or a.ack) and not a.pod_uid:
        p.error("--exit-on-drain and --ack need --pod-uid or $POD_UID")
    if a.ack:
        try:
            acknowledge(a.ack, a.pod_uid)
        except (ValueError, OSError) as e:
            print("faultline_consumer: acknowledgement refused: %s" % e, file=sys.stderr)
            return 1
        print("acknowledged %s" % a.pod_uid, flush=True)
        return 0
    if a.dir and not a.node:
        p.error("--dir needs --node or $NODE_NAME")
    if bool(a.url) != bool(a.write):
        p.error("--url and --write go together (follow mode)")
    if a.url:
        if a.exit_on_failed or a.exit_on_drain or a.device:
            p.error("follow mode only writes the file: --exit-on-failed, --exit-on-drain "
                    "and --device belong to the consumer reading it")
        if not os.path.isdir(os.path.dirname(os.path.abspath(a.write))):
            p.error("--write %s: its directory does not exist" % a.write)
        try:
            follower = Follower(a.url, a.write, a.node)
        except ValueError as e:
            p.error(str(e))
        # SIGTERM (the pod stops) ends it with status 0, even in a blocking read.
        def stop(*_):
            follower.stop.set()
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        try:
            follower.run()
        except KeyboardInterrupt:
            pass
        return 0
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
        drain = entry.drain_for(a.pod_uid) if entry is not None else None
        if a.exit_on_drain and drain is not None:
            print("DRAIN %s/%s evict_after=%s %s" % (drain.namespace, drain.pod, drain.evict_after,
                                                  drain.reason or "-"), flush=True)
            return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
