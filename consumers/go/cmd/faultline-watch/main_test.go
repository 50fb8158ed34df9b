package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// The reference kit: when python3 is there, every case is also run through it and
// must print the same lines and exit with the same status.
const reference = "../../../python/faultline_consumer.py"

// lines is a writer that the test reads as the command writes.
type lines struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *lines) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	// Whole lines only: a line being written is not in yet.
	all := strings.Split(l.buf.String(), "\n")
	return all[:len(all)-1]
}

func noEnv(string) string { return "" }

// runUntil runs the command until it printed n lines (at most 10 s), then waits for it
// to exit (at most linger); its first n lines and exit status (-1: still running).
func runUntil(args []string, n int, linger time.Duration) ([]string, int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &lines{}
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, noEnv, out, io.Discard) }()
	return waitFor(out.all, done, n, linger, func() { cancel(); <-done })
}

// runReference is runUntil for the Python kit.
func runReference(t *testing.T, args []string, n int, linger time.Duration) ([]string, int) {
	cmd := exec.Command("python3", append([]string{reference}, args...)...)
	cmd.Env = slices.DeleteFunc(os.Environ(), func(e string) bool {
		return strings.HasPrefix(e, "NODE_NAME=") || strings.HasPrefix(e, "POD_UID=")
	})
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []string
	read := make(chan struct{})
	go func() {
		defer close(read)
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			mu.Lock()
			got = append(got, s.Text())
			mu.Unlock()
		}
	}()
	done := make(chan int, 1)
	go func() {
		<-read
		cmd.Wait()
		done <- cmd.ProcessState.ExitCode()
	}()
	all := func() []string { mu.Lock(); defer mu.Unlock(); return slices.Clone(got) }
	return waitFor(all, done, n, linger, func() { cmd.Process.Kill(); <-done })
}

func waitFor(all func() []string, done chan int, n int, linger time.Duration, stop func()) ([]string, int) {
	code := -1
	for end := time.Now().Add(10 * time.Second); len(all()) < n && time.Now().Before(end); {
		select {
		case code = <-done:
			end = time.Now()
		case <-time.After(10 * time.Millisecond):
		}
	}
	if code == -1 {
		select {
		case code = <-done:
		case <-time.After(linger):
			stop()
		}
	}
	got := all()
	return got[:min(n, len(got))], code
}

// own is a node's own fault.json as its agent serves it.
func own(verdict string, devices ...[2]string) string {
	var npus []string
	for i, d := range devices {
		reason := "null"
		if d[1] != "" {
			reason = fmt.Sprintf("%q", d[1])
		}
		npus = append(npus, fmt.Sprintf(`{"id":"gpu%d","status":%q,"reason":%s,"since":"2026-01-01T00:00:00.000Z","uuid":"GPU-%d"}`,
			i, d[0], reason, i))
	}
	return fmt.Sprintf(`{"version":"faultline.fault/v1","timestamp":"2026-01-01T00:00:00.000Z","node":"n1",
		"agent":{"reachable":true},"npus":[%s],
		"summary":{"total":0,"healthy":0,"degraded":0,"failed":0,"unknown":0},
		"readings_at":"2026-01-01T00:00:00.000Z","verdict":%s}`, strings.Join(npus, ","), verdict)
}

// withDrain is doc with a drain intent for pod pod (UID uid) of namespace ml.
func withDrain(doc, uid, pod string) string {
	return strings.Replace(doc, `"verdict":`, fmt.Sprintf(`"drain":[{"namespace":"ml","pod":%q,"uid":%q,"devices":["gpu0"],"reason":"xid-79","requested":"2026-01-01T00:00:00.000Z","evict_after":"2026-01-01T00:05:00.000Z"}],"verdict":`, pod, uid), 1)
}

func TestTheLinesOfEveryConsumer(t *testing.T) {
	// Confirmed far ahead (fresh for the test's life) or long ago (aged: nobody rewrote it).
	fresh := `{"writer":"agg-0","sequence":3,"published":"2026-01-01T00:00:00.000Z","confirmed":"2999-01-01T00:00:00.000Z","stale":false,"stale_after_s":30}`
	aged := strings.Replace(fresh, "2999", "2000", 1)
	said := strings.Replace(fresh, `"stale":false`, `"stale":true`, 1)
	none := `{"sequence":0,"stale":true,"stale_after_s":60}`
	shard := func(reachable bool, devices ...[2]string) string {
		doc := strings.Replace(own("null", devices...), `,"verdict":null`, "", 1)
		return strings.Replace(doc, `"reachable":true`, fmt.Sprintf(`"reachable":%t`, reachable), 1)
	}
	file := []string{"--file", "FILE", "--exit-on-failed", "--pod-uid", "u-9", "--exit-on-drain"}
	dir := []string{"--dir", "DIR", "--node", "n1", "--exit-on-failed"}
	cases := []struct {
		what string
		doc  string
		args []string
		want []string
		exit int // -1: keeps watching
	}{
		{"fresh", own(fresh, [2]string{"healthy", ""}, [2]string{"degraded", "thermal"}), file,
			[]string{"n1 gpu0 healthy -", "n1 gpu1 degraded thermal"}, -1},
		{"stale, as the agent says", own(said, [2]string{"unknown", "verdict-stale"}, [2]string{"failed", "xid-79"}), file,
			[]string{"n1 - unknown verdict-stale", "n1 gpu0 unknown verdict-stale", "n1 gpu1 failed xid-79", "FAILED n1 gpu1 xid-79"}, 3},
		{"stale by its age", own(aged, [2]string{"healthy", ""}, [2]string{"degraded", "thermal"}), file,
			[]string{"n1 - unknown verdict-stale", "n1 gpu0 unknown verdict-stale", "n1 gpu1 degraded thermal"}, -1},
		{"no verdict yet", own(none, [2]string{"unknown", "no-verdict"}), file,
			[]string{"n1 - unknown no-verdict", "n1 gpu0 unknown no-verdict"}, -1},
		{"another pod's drain intent", withDrain(own(fresh, [2]string{"degraded", "thermal"}), "u-1", "t1"), file,
			[]string{"n1 gpu0 degraded thermal", "n1 - drain ml/t1 2026-01-01T00:05:00.000Z xid-79"}, -1},
		{"this pod's drain intent", withDrain(own(fresh, [2]string{"degraded", "thermal"}), "u-9", "t9"), file,
			[]string{"n1 gpu0 degraded thermal", "n1 - drain ml/t9 2026-01-01T00:05:00.000Z xid-79",
				"DRAIN ml/t9 evict_after=2026-01-01T00:05:00.000Z xid-79"}, 4},
		{"the shard volume", shard(true, [2]string{"healthy", ""}, [2]string{"failed", "row-remap-failure"}), dir,
			[]string{"n1 gpu0 healthy -", "n1 gpu1 failed row-remap-failure", "FAILED n1 gpu1 row-remap-failure"}, 3},
		{"an agent the aggregator cannot reach", shard(false, [2]string{"failed", "xid-79"}), dir,
			[]string{"n1 - unknown agent-unreachable", "FAILED n1 gpu0 xid-79"}, 3},
		{"not published", "", []string{"--dir", "DIR", "--node", "n2", "--exit-on-failed"},
			[]string{"n2 - unknown not-published"}, -1},
		{"one device", own(fresh, [2]string{"failed", "xid-79"}, [2]string{"healthy", ""}),
			[]string{"--file", "FILE", "--device", "GPU-1", "--exit-on-failed"}, []string{"n1 gpu1 healthy -"}, -1},
	}
	python := true
	if _, err := exec.LookPath("python3"); err != nil {
		t.Log("no python3: the lines are not compared with the reference kit's")
		python = false
	}
	for _, c := range cases {
		t.Run(c.what, func(t *testing.T) {
			t.Parallel()
			// The shard volume as kubelet lays it out: n1.json -> ..data/n1.json.
			d := t.TempDir()
			if c.doc != "" {
				if err := os.Mkdir(filepath.Join(d, "..2026_01_01"), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(d, "..2026_01_01", "n1.json"), []byte(c.doc), 0o644); err != nil {
					t.Fatal(err)
				}
				for link, to := range map[string]string{"..data": "..2026_01_01", "n1.json": "..data/n1.json", "fault.json": "..data/n1.json"} {
					if err := os.Symlink(to, filepath.Join(d, link)); err != nil {
						t.Fatal(err)
					}
				}
			}
			args := slices.Clone(c.args)
			for i, a := range args {
				args[i] = strings.NewReplacer("FILE", filepath.Join(d, "fault.json"), "DIR", d).Replace(a)
			}
			args = append(args, "--interval", "0.05")
			// One that must exit gets 5 s for it; one that must keep watching, 0.3 s.
			linger := 300 * time.Millisecond
			if c.exit != -1 {
				linger = 5 * time.Second
			}
			got, code := runUntil(args, len(c.want), linger)
			if !slices.Equal(got, c.want) || code != c.exit {
				t.Errorf("go: %q, exit %d; want %q, exit %d", got, code, c.want, c.exit)
			}
			if python {
				got, code := runReference(t, args, len(c.want), linger)
				if !slices.Equal(got, c.want) || code != c.exit {
					t.Errorf("python: %q, exit %d; want %q, exit %d", got, code, c.want, c.exit)
				}
			}
		})
	}
}

func TestTheCommandLineAcknowledges(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/v1/drain/ack" && string(body) == `{"uid":"u-1"}` {
			w.WriteHeader(http.StatusAccepted)
			return
		}
		w.WriteHeader(http.StatusNotFound)
		w.Write([]byte(`{"error":"no drain intent for it"}`))
	}))
	defer srv.Close()
	for uid, want := range map[string]int{"u-1": 0, "u-2": 1} {
		out, errs := &lines{}, &lines{}
		code := run(context.Background(), []string{"--ack", srv.URL, "--pod-uid", uid}, noEnv, out, errs)
		if code != want {
			t.Errorf("%s: exit %d, want %d: %q", uid, code, want, errs.all())
		}
		if want == 0 && !slices.Equal(out.all(), []string{"acknowledged u-1"}) {
			t.Errorf("%q", out.all())
		}
		if want == 1 && !strings.Contains(errs.buf.String(), "acknowledgement refused: HTTP 404: no drain intent for it") {
			t.Errorf("%q", errs.buf.String())
		}
	}
	// The UID from the downward API's environment.
	env := func(k string) string { return map[string]string{"POD_UID": "u-1"}[k] }
	if code := run(context.Background(), []string{"--ack", srv.URL}, env, io.Discard, io.Discard); code != 0 {
		t.Errorf("$POD_UID: exit %d", code)
	}
}

func TestBadArgumentsExit2(t *testing.T) {
	d := t.TempDir()
	path := filepath.Join(d, "fault.json")
	for _, args := range [][]string{
		{},
		{"--url", "http://127.0.0.1:1/v1/fault"},
		{"--url", "ftp://x/v1/fault", "--write", path},
		{"--url", "http://127.0.0.1:1/v1/fault", "--write", filepath.Join(d, "no", "fault.json")},
		{"--url", "http://127.0.0.1:1/v1/fault", "--write", path, "--exit-on-failed"},
		{"--file", path, "--write", path},
		{"--file", path, "--dir", d},
		{"--dir", d},
		{"--file", path, "--exit-on-drain"},
		{"--ack", "http://127.0.0.1:1"},
		{"--file", path, "extra"},
		{"--nope"},
	} {
		if code := run(context.Background(), args, noEnv, io.Discard, io.Discard); code != 2 {
			t.Errorf("%q: exit %d, want 2", args, code)
		}
	}
}

func TestTheFollowModeWritesTheFileAndEndsWithStatus0(t *testing.T) {
	doc := own(`{"writer":"agg-0","sequence":7,"confirmed":"2999-01-01T00:00:00.000Z","stale":false,"stale_after_s":30}`,
		[2]string{"healthy", ""}, [2]string{"degraded", "thermal"})
	doc = strings.Join(strings.Fields(doc), "")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.Write([]byte(doc + "\n"))
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "fault.json")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	env := func(k string) string { return map[string]string{"NODE_NAME": "n1"}[k] }
	go func() {
		done <- run(ctx, []string{"--url", srv.URL + "/v1/fault", "--write", path}, env, io.Discard, io.Discard)
	}()
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if got, _ := os.ReadFile(path); string(got) == doc {
			break
		}
		if time.Now().After(end) {
			t.Fatal("not written within 10 s")
		}
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d", code)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the follow mode went on")
	}
}
