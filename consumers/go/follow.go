package consumer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"
)

// MaxLine is the longest line a Follower takes from the agent's stream (a document of
// 1,024 devices is about 400 KiB); a longer one is skipped.
const MaxLine = 1 << 20

// Follower is the follow mode, the sidecar of a restricted namespace (no hostPath): it
// keeps Path a copy of the latest node document the agent streams (GET
// /v1/fault?watch=true on the node's port 8082: one document a line, a blank line a
// heartbeat), each written to a temporary file in the same directory and renamed over
// Path, so a reader never sees half of one. It reconnects with exponential backoff and
// jitter (a stream that brought documents and ended, as streams do after their life,
// is followed again after the shortest wait), counts a stream silent for ReadTimeout as
// lost, and skips a line over MaxLine bytes or one that is not a node document (of
// Node, when set). While the agent cannot be reached, the copy it last wrote is
// rewritten once as stale when its verdict ages out, as the agent would, so the file
// never keeps saying "healthy" on its own.
type Follower struct {
	Path        string
	Node        string
	MaxLine     int              // 0 is MaxLine
	Backoff     [2]time.Duration // the first and the longest wait; zero: 0.5 s and 30 s
	ReadTimeout time.Duration    // 0 is 35 s
	Log         func(string)     // nil writes to stderr

	url     *url.URL
	client  *http.Client
	written []byte   // the bytes last written
	doc     document // the document last written
	writes  atomic.Int64
	lastErr string // the last write error logged, not to repeat it
}

// NewFollower follows the agent's /v1/fault at agentURL (watch=true is added) into
// path, taking only documents of node unless it is "".
func NewFollower(agentURL, path, node string) (*Follower, error) {
	u, err := url.Parse(agentURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return nil, fmt.Errorf("%s: an http:// URL with a host", agentURL)
	}
	q := u.Query()
	if !q.Has("watch") {
		q.Set("watch", "true")
		u.RawQuery = q.Encode()
	}
	return &Follower{Path: path, Node: node, url: u}, nil
}

// Writes is how many times the file was written.
func (f *Follower) Writes() int { return int(f.writes.Load()) }

// Run follows the agent until ctx ends.
func (f *Follower) Run(ctx context.Context) {
	first, longest := f.Backoff[0], f.Backoff[1]
	if first <= 0 {
		first = 500 * time.Millisecond
	}
	if longest <= 0 {
		longest = 30 * time.Second
	}
	timeout := f.ReadTimeout
	if timeout <= 0 {
		timeout = 35 * time.Second
	}
	// No proxy, as the reference kit: the agent is on the node's own address.
	f.client = &http.Client{Transport: &http.Transport{
		Proxy:              nil,
		DialContext:        (&net.Dialer{Timeout: timeout}).DialContext,
		DisableCompression: true,
	}}
	wait := first
	for ctx.Err() == nil {
		streamed, err := f.follow(ctx, timeout)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			f.log(fmt.Sprintf("%s: %v", f.url, err))
		}
		// A stream that brought documents and ended (its life is bounded) is followed
		// again soon; anything else (no connection, an error, the plain document of an
		// agent with too many watches open) waits longer each time.
		if streamed {
			wait = first
		} else {
			wait = min(wait*2, longest)
		}
		f.pause(ctx, time.Duration(float64(wait)*(0.5+0.5*rand.Float64())))
	}
}

// pause sleeps d (or until ctx ends), marking the copy stale when it ages out.
func (f *Follower) pause(ctx context.Context, d time.Duration) {
	end := time.Now().Add(d)
	for ctx.Err() == nil {
		now := time.Now()
		var at float64
		ages := false
		if f.doc != nil {
			v, _ := f.doc["verdict"].(document)
			if !truthy(v["stale"]) {
				at, ages = staleAt(f.doc)
			}
		}
		if ages && seconds(now) > at {
			v, _ := f.doc["verdict"].(document)
			f.log(fmt.Sprintf("%s: no verdict confirmed since %s: marked stale", f.Path, pyStr(v["confirmed"])))
			f.doc = markStale(f.doc)
			f.write(compact(f.doc))
			continue
		}
		if !now.Before(end) {
			return
		}
		left := end.Sub(now)
		if ages {
			left = min(left, time.Duration((at-seconds(now))*1e9))
		}
		select {
		case <-ctx.Done():
		case <-time.After(left):
		}
	}
}

// follow is one connection; whether it was a stream that brought documents.
func (f *Follower) follow(stop context.Context, timeout time.Duration) (bool, error) {
	ctx, cancel := context.WithCancel(stop)
	defer cancel()
	var silent atomic.Bool
	idle := time.AfterFunc(timeout, func() { silent.Store(true); cancel() })
	defer idle.Stop()
	lost := func(err error) error {
		if silent.Load() {
			return fmt.Errorf("nothing for %s: %w", timeout, err)
		}
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.url.String(), nil)
	if err != nil {
		return false, err
	}
	req.Header.Set("Accept", "application/x-ndjson")
	req.Header.Set("User-Agent", "faultline-consumer")
	resp, err := f.client.Do(req)
	if err != nil {
		return false, lost(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return false, fmt.Errorf("HTTP %d %s", resp.StatusCode, body)
	}
	stream := strings.Contains(resp.Header.Get("Content-Type"), "ndjson")
	r := bufio.NewReader(&resetting{r: resp.Body, idle: idle, after: timeout})
	maxLine := f.MaxLine
	if maxLine <= 0 {
		maxLine = MaxLine
	}
	got := 0
	for {
		line, tooLong, err := readLine(r, maxLine)
		if tooLong {
			f.log(fmt.Sprintf("a line over %d bytes: skipped", maxLine))
		} else if line = bytes.Trim(line, " \t\n\r\v\f"); len(line) > 0 { // else a heartbeat
			doc, derr := decode(line)
			if derr == nil {
				derr = checkNodeDocument(doc, f.Node)
			}
			if derr != nil {
				f.log("skipped a line: " + derr.Error())
			} else {
				got++
				f.doc = doc
				f.write(line)
			}
		}
		if errors.Is(err, io.EOF) {
			return stream && got > 0, nil
		}
		if err != nil {
			return false, lost(err)
		}
	}
}

// readLine is the next line (its newline kept), or tooLong when it holds more than
// max bytes before its newline: then it is read to its end and dropped.
func readLine(r *bufio.Reader, max int) (line []byte, tooLong bool, err error) {
	for {
		chunk, err := r.ReadSlice('\n')
		if !tooLong {
			line = append(line, chunk...)
			if len(bytes.TrimSuffix(line, []byte("\n"))) > max {
				line, tooLong = nil, true
			}
		}
		if err != bufio.ErrBufferFull {
			return line, tooLong, err
		}
	}
}

// resetting restarts the idle timer whenever bytes arrive: a heartbeat keeps the
// stream alive, silence ends it.
type resetting struct {
	r     io.Reader
	idle  *time.Timer
	after time.Duration
}

func (s *resetting) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if n > 0 {
		s.idle.Reset(s.after)
	}
	return n, err
}

func (f *Follower) write(data []byte) {
	if f.written != nil && bytes.Equal(data, f.written) {
		return
	}
	if err := writeAtomic(f.Path, data); err != nil {
		if err.Error() != f.lastErr {
			f.log(fmt.Sprintf("cannot write %s: %v (retried with the next document)", f.Path, err))
			f.lastErr = err.Error()
		}
		return
	}
	f.lastErr, f.written = "", data
	f.writes.Add(1)
}

func (f *Follower) log(msg string) {
	if f.Log != nil {
		f.Log(msg)
		return
	}
	fmt.Fprintf(os.Stderr, "faultline-consumer: %s\n", msg)
}

// writeAtomic replaces path with data: a temporary file in the same directory, renamed
// over it, so a reader sees the old document or the new one, never half.
func writeAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Chmod(0o644)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
	return err
}

// compact is doc as one line of JSON.
func compact(doc document) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(doc)
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}
