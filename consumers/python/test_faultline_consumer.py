"""Tests of faultline_consumer.py (stdlib unittest; cargo test runs them through
consumers/rust/tests/kit.rs):

    python3 -m unittest discover -s consumers/python -v

The follow mode runs against a small HTTP server in a thread that streams NDJSON as
the agent's GET /v1/fault?watch=true does.
"""

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import faultline_consumer as fc  # noqa: E402


def rfc3339(t):
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%03dZ" % (int(t * 1000) % 1000)


def node_doc(statuses, sequence=1, stale=False, writer="faultline-0", confirmed=None,
             stale_after_s=30, node="n1"):
    """A node's own fault.json as its agent serves it."""
    npus = [
        {"id": "gpu%d" % i, "status": s, "reason": None if s == "healthy" else "xid-79",
         "since": "2026-01-01T00:00:00.000Z", "uuid": "GPU-%d" % i}
        for i, s in enumerate(statuses)
    ]
    counts = {k: statuses.count(k) for k in fc.STATUSES}
    counts["total"] = len(statuses)
    verdict = {"sequence": sequence, "stale": stale, "stale_after_s": stale_after_s}
    if writer:
        verdict.update(writer=writer, published=rfc3339(time.time()),
                       confirmed=rfc3339(time.time() if confirmed is None else confirmed))
    return {"version": "faultline.fault/v1", "timestamp": rfc3339(time.time()), "node": node,
            "agent": {"reachable": True}, "npus": npus, "summary": counts,
            "readings_at": rfc3339(time.time()), "verdict": verdict}


def line(doc):
    return json.dumps(doc, separators=(",", ":")).encode()


class Agent:
    """An HTTP server in a thread. ``script``: per connection (in order; the last one
    repeats), a list of byte strings to send as the chunks of an NDJSON response, or an
    int: answer with that status. After the chunks the connection is held open until
    ``hold`` is set (or closed at once when ``close`` is true)."""

    def __init__(self, script, close=False):
        self.script, self.close, self.connections = script, close, 0
        self.paths = []
        self.hold = threading.Event()
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                n = agent.connections
                agent.connections += 1
                agent.paths.append(self.path)
                step = agent.script[min(n, len(agent.script) - 1)]
                if isinstance(step, int):
                    body = b'{"error":"no"}'
                    self.send_response(step)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for chunk in step:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                        time.sleep(0.02)
                    if not agent.close:
                        agent.hold.wait(10)
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass
                self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = "http://127.0.0.1:%d/v1/fault" % self.server.server_address[1]

    def stop(self):
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


def until(what, check, within=10.0):
    end = time.time() + within
    while time.time() < end:
        v = check()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("not within %.0f s: %s" % (within, what))


class FollowTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "fault.json")
        self.agents, self.followers = [], []

    def tearDown(self):
        for f in self.followers:
            f.stop.set()
        for a in self.agents:
            a.stop()
        shutil.rmtree(self.dir)

    def agent(self, script, close=False):
        a = Agent(script, close)
        self.agents.append(a)
        return a

    def follow(self, url, **kw):
        logs = []
        kw.setdefault("backoff", (0.05, 0.2))
        f = fc.Follower(url, self.path, log=logs.append, **kw)
        f.logs = logs
        threading.Thread(target=f.run, daemon=True).start()
        self.followers.append(f)
        return f

    def read(self):
        with open(self.path, "rb") as f:
            return f.read()

    def test_the_written_file_is_the_last_documents_line(self):
        first, last = node_doc(["healthy", "healthy"]), node_doc(["healthy", "failed"], 2)
        agent = self.agent([[line(first) + b"\n", b"\n", line(last) + b"\n"]])
        f = self.follow(agent.url)
        until("two documents written", lambda: f.writes == 2)
        self.assertEqual(self.read(), line(last))
        self.assertEqual(json.loads(self.read()), last)
        self.assertEqual(agent.paths, ["/v1/fault?watch=true"])
        self.assertEqual(sorted(os.listdir(self.dir)), ["fault.json"], "no temporary file left")
        e = fc.read(self.path, "n1")
        self.assertEqual([d.id for d in e.failed()], ["gpu1"])
        self.assertIsNone(e.stale)

    def test_a_line_split_over_chunks_and_a_line_too_long(self):
        good = line(node_doc(["failed"], 3))
        junk = b'{"npus":[' + b" " * 3000 + b"]}\n"
        agent = self.agent([[good[:10], good[10:] + b"\n", junk, b"not json\n",
                             line({"node": "n1"}) + b"\n"]])
        f = self.follow(agent.url, max_line=2048)
        until("the first document", lambda: f.writes == 1)
        until("the junk skipped", lambda: len(f.logs) >= 3)
        time.sleep(0.2)
        self.assertEqual(f.writes, 1, f.logs)
        self.assertEqual(self.read(), good)
        self.assertIn("a line over 2048 bytes: skipped", f.logs)

    def test_reconnects_after_the_stream_ends_and_after_errors(self):
        one, two = node_doc(["healthy"], 1), node_doc(["failed"], 2)
        agent = self.agent([[line(one) + b"\n"], 503, [line(two) + b"\n"]], close=True)
        f = self.follow(agent.url)
        until("the second stream's document", lambda: os.path.exists(self.path)
              and json.loads(self.read()) == two)
        self.assertGreaterEqual(agent.connections, 3)
        self.assertTrue(any("HTTP 503" in m for m in f.logs), f.logs)

    def test_another_nodes_document_is_not_written(self):
        agent = self.agent([[line(node_doc(["failed"], node="n2")) + b"\n",
                             line(node_doc(["healthy"])) + b"\n"]])
        f = self.follow(agent.url, node="n1")
        until("n1's document", lambda: f.writes == 1)
        self.assertEqual(json.loads(self.read())["node"], "n1")

    def test_the_copy_turns_stale_once_its_verdict_ages_without_the_agent(self):
        old = node_doc(["healthy", "failed"], confirmed=time.time() - 40, stale_after_s=30)
        agent = self.agent([[line(old) + b"\n"], 503], close=True)
        f = self.follow(agent.url)
        until("marked stale", lambda: os.path.exists(self.path)
              and json.loads(self.read())["verdict"]["stale"])
        doc = json.loads(self.read())
        self.assertEqual([(d["status"], d["reason"]) for d in doc["npus"]],
                         [("unknown", "verdict-stale"), ("failed", "xid-79")])
        self.assertEqual(doc["summary"], {"total": 2, "healthy": 0, "degraded": 0,
                                          "failed": 1, "unknown": 1})
        writes = f.writes
        time.sleep(0.3)
        self.assertEqual(f.writes, writes, "marked once")

    def test_the_command_line(self):
        script = os.path.join(HERE, "faultline_consumer.py")
        run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True,
                                        timeout=20)
        self.assertEqual(run("--url", "http://127.0.0.1:1/v1/fault").returncode, 2)
        self.assertEqual(run("--url", "ftp://x/v1/fault", "--write", self.path).returncode, 2)
        self.assertEqual(run("--url", "http://127.0.0.1:1/v1/fault", "--write",
                             os.path.join(self.dir, "no", "fault.json")).returncode, 2)
        self.assertEqual(run("--file", self.path, "--write", self.path).returncode, 2)
        doc = node_doc(["healthy", "degraded"], 7)
        agent = self.agent([[line(doc) + b"\n"]])
        p = subprocess.Popen([sys.executable, script, "--url", agent.url, "--write", self.path],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, NODE_NAME="n1"))
        try:
            until("written", lambda: os.path.exists(self.path))
            self.assertEqual(json.loads(self.read()), doc)
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(10), 0, p.stderr.read())
        finally:
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


class StaleTest(unittest.TestCase):
    def test_parse_time(self):
        self.assertEqual(fc.parse_time("1970-01-01T00:00:01Z"), 1)
        self.assertEqual(fc.parse_time("1970-01-01T00:00:01.250Z"), 1.25)
        self.assertEqual(fc.parse_time("1970-01-01T01:00:00+01:00"), 0)
        self.assertEqual(fc.parse_time("2026-03-01T00:00:00.5-00:30"), 1772323200 + 1800.5)
        for bad in (None, 7, "", "yesterday", "2026-13-01T00:00:00Z", "2026-01-01T00:00:00"):
            self.assertIsNone(fc.parse_time(bad), bad)

    def test_a_fresh_verdict_is_read_as_it_is(self):
        e = fc.parse(line(node_doc(["healthy", "failed"])), "n1")
        self.assertIsNone(e.stale)
        self.assertEqual([d.status for d in e.devices], ["healthy", "failed"])
        self.assertEqual(fc.describe(e, "n1"), ["n1 gpu0 healthy -", "n1 gpu1 failed xid-79"])

    def test_the_agents_stale_verdict_is_reported(self):
        doc = node_doc(["unknown", "failed"], stale=True)
        doc["npus"][0]["reason"] = "verdict-stale"
        e = fc.parse(line(doc))
        self.assertEqual(e.stale, "verdict-stale")
        self.assertEqual(fc.describe(e, "n1"), ["n1 - unknown verdict-stale",
                                                "n1 gpu0 unknown verdict-stale",
                                                "n1 gpu1 failed xid-79"])
        self.assertEqual([d.id for d in e.failed()], ["gpu1"], "failed stays failed")

    def test_no_verdict_yet(self):
        doc = node_doc(["unknown"], sequence=0, stale=True, writer=None)
        e = fc.parse(line(doc))
        self.assertEqual(e.stale, "no-verdict")
        self.assertEqual(fc.describe(e, "n1")[0], "n1 - unknown no-verdict")

    def test_an_old_confirmation_is_stale_by_its_age(self):
        doc = node_doc(["healthy", "degraded"], confirmed=1000.0, stale_after_s=30)
        self.assertIsNone(fc.parse(line(doc), now=1000.0 + 30 + fc.STALE_GRACE_S).stale)
        e = fc.parse(line(doc), now=1000.0 + 30 + fc.STALE_GRACE_S + 0.1)
        self.assertEqual(e.stale, "verdict-stale")
        self.assertEqual([(d.status, d.reason) for d in e.devices],
                         [("unknown", "verdict-stale"), ("degraded", "xid-79")])

    def test_the_shard_entry_has_no_verdict_and_is_never_stale(self):
        doc = node_doc(["healthy"])
        del doc["verdict"]
        self.assertIsNone(fc.parse(line(doc)).stale)

    def test_a_watch_reports_the_verdict_ageing_while_the_file_stays(self):
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        path = os.path.join(d, "fault.json")
        with open(path, "wb") as f:
            f.write(line(node_doc(["healthy"], confirmed=time.time() - 0.5, stale_after_s=1)))
        grace, fc.STALE_GRACE_S = fc.STALE_GRACE_S, 0.0
        self.addCleanup(setattr, fc, "STALE_GRACE_S", grace)
        w = fc.watch_file(path, "n1", interval=0.05)
        first = next(w)
        self.assertIsNone(first.stale)
        start = time.time()
        second = next(w)
        self.assertEqual(second.stale, "verdict-stale")
        self.assertEqual(second.devices[0].status, "unknown")
        self.assertLess(time.time() - start, 3)


if __name__ == "__main__":
    unittest.main()


class DrainTest(unittest.TestCase):
    """Warn before evicting: the entry's drain intents, and the acknowledgement."""

    def doc(self):
        d = node_doc(["failed", "healthy"])
        d["drain"] = [{"namespace": "ml", "pod": "train-0", "uid": "u-1", "pod_ips": ["10.0.0.7"],
                       "devices": ["gpu0"], "reason": "xid-79",
                       "requested": "2026-12-05T00:00:00.000Z",
                       "evict_after": "2026-12-05T00:05:00.000Z"}]
        return d

    def test_the_intent_of_this_pod_is_read_and_printed(self):
        e = fc.parse(json.dumps(self.doc()))
        d = e.drain_for("u-1")
        self.assertEqual((d.namespace, d.pod, d.devices, d.reason), ("ml", "train-0", ("gpu0",), "xid-79"))
        self.assertEqual(d.evict_after, "2026-12-05T00:05:00.000Z")
        self.assertIsNone(d.acknowledged)
        self.assertIsNone(e.drain_for("u-2"), "another pod's")
        self.assertIsNone(e.drain_for(None))
        self.assertIn("n1 - drain ml/train-0 2026-12-05T00:05:00.000Z xid-79", fc.describe(e, "n1"))
        # A document without intents reads as before.
        plain = fc.parse(json.dumps(node_doc(["healthy"])))
        self.assertEqual(plain.drains, ())
        self.assertEqual(fc.describe(plain, "n1"), ["n1 gpu0 healthy -"])

    def test_the_command_line_exits_4_on_this_pods_intent_only(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        path = os.path.join(tmp, "fault.json")
        with open(path, "w") as f:
            json.dump(self.doc(), f)
        run = lambda uid: subprocess.run(
            [sys.executable, os.path.join(HERE, "faultline_consumer.py"), "--file", path,
             "--pod-uid", uid, "--exit-on-drain", "--interval", "0.05"],
            capture_output=True, text=True, timeout=10)
        r = run("u-1")
        self.assertEqual(r.returncode, 4, r.stderr)
        self.assertIn("DRAIN ml/train-0 evict_after=2026-12-05T00:05:00.000Z xid-79", r.stdout)
        with self.assertRaises(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, os.path.join(HERE, "faultline_consumer.py"), "--file",
                            path, "--pod-uid", "u-2", "--exit-on-drain", "--interval", "0.05"],
                           capture_output=True, timeout=1)

    def test_acknowledge_posts_the_uid_and_reports_a_refusal(self):
        got = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                got.append((self.path, body))
                status = 202 if body["uid"] == "u-1" else 403
                out = json.dumps({"error": "not from its address", "status": status} if status == 403
                                 else {"uid": body["uid"], "acknowledged": True}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        agent = "http://127.0.0.1:%d" % server.server_address[1]
        self.assertTrue(fc.acknowledge(agent, "u-1"))
        self.assertEqual(got[0], ("/v1/drain/ack", {"uid": "u-1"}))
        with self.assertRaises(ValueError) as e:
            fc.acknowledge(agent, "u-2")
        self.assertIn("HTTP 403: not from its address", str(e.exception))
        cli = [sys.executable, os.path.join(HERE, "faultline_consumer.py"), "--ack", agent, "--pod-uid"]
        self.assertEqual(subprocess.run(cli + ["u-1"], capture_output=True, timeout=10).returncode, 0)
        self.assertEqual(subprocess.run(cli + ["u-2"], capture_output=True, timeout=10).returncode, 1)
        with self.assertRaises(OSError):
            fc.acknowledge("http://127.0.0.1:9", "u-1", timeout=1)
