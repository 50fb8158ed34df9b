package consumer

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// next pulls entries from a watch in the background; each waits at most 5 s.
type next struct {
	t       *testing.T
	entries chan *Entry
}

func watching(t *testing.T, w *Watch) *next {
	ctx, cancel := context.WithCancel(context.Background())
	n := &next{t: t, entries: make(chan *Entry)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for e := range w.Entries(ctx) {
			select {
			case n.entries <- e:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return n
}

func (n *next) next() *Entry {
	n.t.Helper()
	select {
	case e := <-n.entries:
		return e
	case <-time.After(5 * time.Second):
		n.t.Fatal("no change within 5 s")
		return nil
	}
}

func (n *next) none(within time.Duration) {
	n.t.Helper()
	select {
	case e := <-n.entries:
		n.t.Fatalf("a change nobody made: %+v", e)
	case <-time.After(within):
	}
}

func replace(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := writeAtomic(path, data); err != nil {
		t.Fatal(err)
	}
}

func TestAWatchReportsTheVerdictAgeingWhileTheFileStays(t *testing.T) {
	grace := staleGrace
	staleGrace = 0
	t.Cleanup(func() { staleGrace = grace })
	path := filepath.Join(t.TempDir(), "fault.json")
	d := nodeDoc("healthy")
	verdict(d)["confirmed"], verdict(d)["stale_after_s"] = timeAt(now()-0.5), 1
	replace(t, path, line(d))
	w := watching(t, &Watch{Path: path, Node: "n1", Interval: 50 * time.Millisecond})
	if e := w.next(); e.Stale != "" {
		t.Fatalf("first: %+v", e)
	}
	start := time.Now()
	e := w.next()
	if e.Stale != VerdictStale || e.Devices[0].Status != Unknown {
		t.Fatalf("second: %+v", e)
	}
	if time.Since(start) > 3*time.Second {
		t.Fatalf("after %v", time.Since(start))
	}
}

func TestAWatchPicksUpAFileReplacedByRename(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fault.json")
	var mu sync.Mutex
	var errs []error
	w := watching(t, &Watch{Path: path, Interval: 20 * time.Millisecond, OnError: func(err error) {
		mu.Lock()
		defer mu.Unlock()
		errs = append(errs, err)
	}})
	if e := w.next(); e != nil {
		t.Fatalf("not published yet: %+v", e)
	}
	replace(t, path, line(nodeDoc("healthy", "healthy")))
	if e := w.next(); e == nil || len(e.Failed()) != 0 {
		t.Fatalf("%+v", e)
	}
	// The same document again is no change; a document that does not parse is skipped.
	replace(t, path, line(nodeDoc("healthy", "healthy")))
	replace(t, path, []byte(`{"npus":`))
	w.none(200 * time.Millisecond)
	mu.Lock()
	if len(errs) != 1 {
		t.Errorf("errors: %v", errs)
	}
	mu.Unlock()
	replace(t, path, line(nodeDoc("healthy", "failed")))
	if e := w.next(); e == nil || len(e.Failed()) != 1 || e.Failed()[0].ID != "gpu1" {
		t.Fatalf("%+v", e)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if e := w.next(); e != nil {
		t.Fatalf("gone: %+v", e)
	}
}

// TestAWatchOfTheShardVolumeFollowsTheDataSwap lays the directory out as kubelet lays
// out a ConfigMap volume: <node>.json -> ..data/<node>.json, ..data -> a timestamped
// directory, swapped by rename.
func TestAWatchOfTheShardVolumeFollowsTheDataSwap(t *testing.T) {
	dir := t.TempDir()
	publish := func(version string, d document) {
		t.Helper()
		if err := os.Mkdir(filepath.Join(dir, version), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, version, "n1.json"), line(d), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(version, filepath.Join(dir, "..data_tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	shard := func(statuses ...string) document {
		d := nodeDoc(statuses...)
		delete(d, "verdict")
		return d
	}
	publish("..2026_01_01_00_00_00.1", shard("healthy", "healthy"))
	if err := os.Symlink("..data/n1.json", filepath.Join(dir, "n1.json")); err != nil {
		t.Fatal(err)
	}
	w := watching(t, &Watch{Path: WatchEntry(dir, "n1").Path, Node: "n1", Interval: 20 * time.Millisecond})
	if e := w.next(); e == nil || e.Node != "n1" || len(e.Devices) != 2 || len(e.Failed()) != 0 {
		t.Fatalf("%+v", e)
	}
	publish("..2026_01_01_00_00_01.2", shard("healthy", "failed"))
	if e := w.next(); e == nil || len(e.Failed()) != 1 {
		t.Fatalf("%+v", e)
	}
}

func TestAWatchEndsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	w := WatchFile(filepath.Join(t.TempDir(), "none.json"))
	go func() {
		n := 0
		for range w.Entries(ctx) {
			n++
		}
		done <- n
	}()
	time.Sleep(100 * time.Millisecond)
	cancel()
	select {
	case n := <-done:
		if n != 1 {
			t.Fatalf("%d entries, want the one not published", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the watch went on")
	}
}
