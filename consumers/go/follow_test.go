package consumer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// agent is an HTTP server that streams NDJSON as the agent's GET /v1/fault?watch=true
// does. script: per connection (in order; the last one repeats), the chunks of the
// response, or a status to answer with. After the chunks the connection is held open
// until the test ends, or closed at once when close is true.
type agent struct {
	*httptest.Server
	mu    sync.Mutex
	paths []string
}

type step struct {
	chunks [][]byte
	status int
}

func newAgent(t *testing.T, closeAtOnce bool, script ...step) *agent {
	a := &agent{}
	hold := make(chan struct{})
	a.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		s := script[min(len(a.paths), len(script)-1)]
		a.paths = append(a.paths, r.URL.RequestURI())
		a.mu.Unlock()
		if s.status != 0 {
			w.WriteHeader(s.status)
			w.Write([]byte(`{"error":"no"}`))
			return
		}
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.WriteHeader(http.StatusOK)
		for _, c := range s.chunks {
			w.Write(c)
			w.(http.Flusher).Flush()
			time.Sleep(20 * time.Millisecond)
		}
		if !closeAtOnce {
			select {
			case <-hold:
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
		}
	}))
	t.Cleanup(a.Close)
	t.Cleanup(func() { close(hold) })
	return a
}

func (a *agent) connections() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.paths)
}

// logs collects a Follower's messages.
type logs struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logs) add(m string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, m)
}

func (l *logs) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.msgs)
}

func follow(t *testing.T, url, node string, maxLine int) (*Follower, *logs, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fault.json")
	f, err := NewFollower(url+"/v1/fault", path, node)
	if err != nil {
		t.Fatal(err)
	}
	l := &logs{}
	f.Log, f.MaxLine = l.add, maxLine
	f.Backoff = [2]time.Duration{50 * time.Millisecond, 200 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return f, l, path
}

func until(t *testing.T, what string, check func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if check() {
			return
		}
	}
	t.Fatalf("not within 10 s: %s", what)
}

func readDoc(path string) document {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var d document
	if json.Unmarshal(b, &d) != nil {
		return nil
	}
	return d
}

func nl(b []byte) []byte { return append(slices.Clone(b), '\n') }

func TestTheWrittenFileIsTheLastDocumentsLine(t *testing.T) {
	first, last := nodeDoc("healthy", "healthy"), nodeDoc("healthy", "failed")
	verdict(last)["sequence"] = 2
	a := newAgent(t, false, step{chunks: [][]byte{nl(line(first)), []byte("\n"), nl(line(last))}})
	f, _, path := follow(t, a.URL, "", 0)
	until(t, "two documents written", func() bool { return f.Writes() == 2 })
	if got, _ := os.ReadFile(path); !bytes.Equal(got, line(last)) {
		t.Fatalf("%s", got)
	}
	a.mu.Lock()
	asked := a.paths[0]
	a.mu.Unlock()
	if asked != "/v1/fault?watch=true" {
		t.Fatalf("asked for %q", asked)
	}
	if names, _ := os.ReadDir(filepath.Dir(path)); len(names) != 1 {
		t.Fatalf("a temporary file left: %v", names)
	}
	e, err := Read(path, "n1", nil)
	if err != nil || len(e.Failed()) != 1 || e.Failed()[0].ID != "gpu1" || e.Stale != "" {
		t.Fatalf("%+v, %v", e, err)
	}
}

func TestALineSplitOverChunksAndALineTooLong(t *testing.T) {
	d := nodeDoc("failed")
	verdict(d)["sequence"] = 3
	good := line(d)
	junk := []byte(`{"npus":[` + strings.Repeat(" ", 3000) + "]}\n")
	a := newAgent(t, false, step{chunks: [][]byte{good[:10], nl(good[10:]), junk, []byte("not json\n"),
		nl(line(document{"node": "n1"}))}})
	f, l, path := follow(t, a.URL, "", 2048)
	until(t, "the first document", func() bool { return f.Writes() == 1 })
	until(t, "the junk skipped", func() bool { return len(l.all()) >= 3 })
	time.Sleep(200 * time.Millisecond)
	if f.Writes() != 1 {
		t.Fatalf("%d writes: %q", f.Writes(), l.all())
	}
	if got, _ := os.ReadFile(path); !bytes.Equal(got, good) {
		t.Fatalf("%s", got)
	}
	if !slices.Contains(l.all(), "a line over 2048 bytes: skipped") {
		t.Fatalf("%q", l.all())
	}
}

func TestReconnectsAfterTheStreamEndsAndAfterErrors(t *testing.T) {
	one, two := nodeDoc("healthy"), nodeDoc("failed")
	verdict(two)["sequence"] = 2
	a := newAgent(t, true, step{chunks: [][]byte{nl(line(one))}}, step{status: 503},
		step{chunks: [][]byte{nl(line(two))}})
	_, l, path := follow(t, a.URL, "", 0)
	until(t, "the second stream's document", func() bool {
		got, _ := os.ReadFile(path)
		return bytes.Equal(got, line(two))
	})
	if a.connections() < 3 {
		t.Fatalf("%d connections", a.connections())
	}
	if !slices.ContainsFunc(l.all(), func(m string) bool { return strings.Contains(m, "HTTP 503") }) {
		t.Fatalf("%q", l.all())
	}
}

func TestAnotherNodesDocumentIsNotWritten(t *testing.T) {
	other := nodeDoc("failed")
	other["node"] = "n2"
	a := newAgent(t, false, step{chunks: [][]byte{nl(line(other)), nl(line(nodeDoc("healthy")))}})
	f, _, path := follow(t, a.URL, "n1", 0)
	until(t, "n1's document", func() bool { return f.Writes() == 1 })
	time.Sleep(100 * time.Millisecond)
	if d := readDoc(path); d["node"] != "n1" || f.Writes() != 1 {
		t.Fatalf("%v", d)
	}
}

func TestTheCopyTurnsStaleOnceItsVerdictAgesWithoutTheAgent(t *testing.T) {
	old := nodeDoc("healthy", "failed")
	verdict(old)["confirmed"], verdict(old)["stale_after_s"] = timeAt(now()-40), 30
	a := newAgent(t, true, step{chunks: [][]byte{nl(line(old))}}, step{status: 503})
	f, l, path := follow(t, a.URL, "", 0)
	until(t, "marked stale", func() bool { d := readDoc(path); return d != nil && verdict(d)["stale"] == true })
	d := readDoc(path)
	var got [][2]any
	for _, n := range d["npus"].([]any) {
		got = append(got, [2]any{n.(document)["status"], n.(document)["reason"]})
	}
	if want := [][2]any{{"unknown", "verdict-stale"}, {"failed", "xid-79"}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("%v", got)
	}
	want := document{"total": 2.0, "healthy": 0.0, "degraded": 0.0, "failed": 1.0, "unknown": 1.0}
	if !reflect.DeepEqual(d["summary"], want) {
		t.Fatalf("summary %v", d["summary"])
	}
	writes := f.Writes()
	time.Sleep(300 * time.Millisecond)
	if f.Writes() != writes {
		t.Fatalf("marked %d times: %q", f.Writes()-writes+1, l.all())
	}
	if !slices.ContainsFunc(l.all(), func(m string) bool { return strings.HasSuffix(m, ": marked stale") }) {
		t.Fatalf("%q", l.all())
	}
}

func TestAFollowerNeedsAnHTTPURLWithAHost(t *testing.T) {
	for _, bad := range []string{"ftp://x/v1/fault", "http:///v1/fault", "127.0.0.1:8082"} {
		if _, err := NewFollower(bad, "fault.json", ""); err == nil {
			t.Errorf("%s taken", bad)
		}
	}
	f, err := NewFollower("http://10.0.0.1:8082/v1/fault?watch=false", "fault.json", "")
	if err != nil || f.url.String() != "http://10.0.0.1:8082/v1/fault?watch=false" {
		t.Fatalf("%v %v", f.url, err)
	}
}

func TestAcknowledgePostsTheUIDAndReportsARefusal(t *testing.T) {
	type call struct{ path, uid, contentType string }
	var mu sync.Mutex
	var got []call
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct{ UID string }
		json.NewDecoder(r.Body).Decode(&body)
		mu.Lock()
		got = append(got, call{r.Method + " " + r.URL.Path, body.UID, r.Header.Get("Content-Type")})
		mu.Unlock()
		if body.UID == "u-1" {
			w.WriteHeader(http.StatusAccepted)
			fmt.Fprintf(w, `{"uid":%q,"acknowledged":true}`, body.UID)
			return
		}
		w.WriteHeader(http.StatusForbidden)
		w.Write([]byte(`{"error":"not from its address","status":403}`))
	}))
	defer srv.Close()
	ctx := context.Background()
	if err := Acknowledge(ctx, srv.URL, "u-1"); err != nil {
		t.Fatal(err)
	}
	if want := (call{"POST /v1/drain/ack", "u-1", "application/json"}); got[0] != want {
		t.Fatalf("%+v", got[0])
	}
	err := Acknowledge(ctx, srv.URL, "u-2")
	var refused *RefusedError
	if !errors.As(err, &refused) || refused.Status != 403 || err.Error() != "HTTP 403: not from its address" {
		t.Fatalf("%v", err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := Acknowledge(ctx, "http://127.0.0.1:9", "u-1"); err == nil || errors.As(err, &refused) {
		t.Fatalf("an agent not there: %v", err)
	}
	if err := Acknowledge(ctx, "ftp://x", "u-1"); err == nil {
		t.Fatal("not http")
	}
}
