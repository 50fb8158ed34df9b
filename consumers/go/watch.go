package consumer

import (
	"context"
	"fmt"
	"iter"
	"os"
	"path/filepath"
	"reflect"
	"time"
)

// Watch follows one node's entry at Path by polling: the path is re-opened whenever
// the ..data target beside it (a ConfigMap volume), or the file's inode, size or mtime
// changes, since every writer replaces the file by rename and a held file or inode
// would never change.
type Watch struct {
	Path     string
	Node     string        // refuse another node's document; "" takes any
	Only     []string      // keep these devices (id, UUID or PCI bus id); empty keeps all
	Interval time.Duration // between looks; 0 is 500 ms
	// OnError hears of a document that could not be read or parsed (skipped: the last
	// good one stands, and the next change is read again); nil writes it to stderr.
	OnError func(error)
}

// WatchFile watches the node's own fault.json (or the agent's --health-file).
func WatchFile(path string) *Watch { return &Watch{Path: path} }

// WatchEntry watches <dir>/<node>.json: the projected shard ConfigMaps.
func WatchEntry(dir, node string) *Watch {
	return &Watch{Path: filepath.Join(dir, node+".json"), Node: node}
}

// Entries yields the Entry at the path (nil: not published) now and after every
// change, including its verdict turning stale by age while the file stays as it is.
// It ends when ctx does or the loop stops. An Entry yielded is compared with the next
// one read, so it is not to be modified.
func (w *Watch) Entries(ctx context.Context) iter.Seq[*Entry] {
	return func(yield func(*Entry) bool) {
		interval := w.Interval
		if interval <= 0 {
			interval = 500 * time.Millisecond
		}
		tick := time.NewTicker(interval)
		defer tick.Stop()
		var (
			seen, first = stamp{}, true
			last        *Entry
			looked      bool
			agesAt      float64 // when the verdict read last ages out; 0: never
		)
		for ctx.Err() == nil {
			now := stampOf(w.Path)
			if !looked || now != seen || (agesAt != 0 && seconds(time.Now()) > agesAt) {
				seen, looked = now, true
				e, at, err := read(w.Path, w.Node, w.Only)
				if err != nil {
					w.fail(err)
				} else {
					agesAt = at
					if first || !reflect.DeepEqual(e, last) {
						first, last = false, e
						if !yield(e) {
							return
						}
					}
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}
}

func (w *Watch) fail(err error) {
	if w.OnError != nil {
		w.OnError(err)
		return
	}
	fmt.Fprintf(os.Stderr, "faultline-consumer: %v\n", err)
}

// stamp is what changes when the file is swapped: the ..data target and the file.
type stamp struct {
	target string
	file   fileID
	exists bool
}

type fileID struct {
	inode uint64
	size  int64
	mtime int64 // nanoseconds
}

func stampOf(path string) stamp {
	target, _ := os.Readlink(filepath.Join(filepath.Dir(path), "..data"))
	fi, err := os.Stat(path)
	if err != nil {
		return stamp{target: target}
	}
	return stamp{target: target, file: idOf(fi), exists: true}
}
