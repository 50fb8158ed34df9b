// Package consumer reacts to your own node's accelerator health as faultline publishes
// it: the Go twin of consumers/python/faultline_consumer.py, the kit's reference,
// whose judgements it repeats exactly. Standard library only.
//
// Ways a pod reads its node's entry (consumers/README.md):
//
//   - the node's own fault.json, kept by its agent (the aggregator's verdict on this
//     node, with verdict: whose, and whether it is still confirmed), on a read-only
//     hostPath (/run/faultline/node mounted at /config) or, in a restricted namespace,
//     written into an emptyDir by a [Follower] running as a sidecar:
//     WatchFile("/config/fault.json");
//   - the shard ConfigMaps projected into one volume (small clusters):
//     WatchEntry("/config", node) reads /config/<node>.json.
//
// Files are swapped, never rewritten in place: kubelet swaps the ..data symlink of a
// ConfigMap volume (atomic_writer.go), the agent and the follow mode rename a new file
// over the old one. So a [Watch] re-opens the path on every change it sees (the ..data
// target, the file's inode, size or mtime) and compares what it read; it never holds
// the file open.
//
// A verdict that is no longer confirmed is reported ([Entry].Stale): when the agent
// says so (verdict.stale), or by its age when nobody rewrites the file any more
// (verdict.confirmed older than verdict.stale_after_s plus [StaleGrace]). Then every
// device the verdict called healthy reads unknown (verdict-stale), as the agent writes
// it; failed and degraded devices keep their status.
//
// Warn before evicting (docs/remediation.md#warn-before-evicting): a pod annotated
// faultline.io/checkpoint-grace that uses a failed device is named in its node's entry
// ([Entry.DrainFor] its UID) with a deadline. It checkpoints, then exits or calls
// [Acknowledge] (its node's agent, from the pod's own address, no API rights); it is
// then evicted at once, and at the deadline in any case.
//
//	for e := range consumer.WatchFile("/config/fault.json").Entries(ctx) {
//		if e != nil && len(e.Failed()) > 0 {
//			// checkpoint and exit
//		}
//	}
package consumer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"syscall"
	"time"
	"unicode/utf8"
)

// Status is a device's status.
type Status string

// The statuses; anything else a document says reads as Unknown.
const (
	Healthy  Status = "healthy"
	Degraded Status = "degraded"
	Failed   Status = "failed"
	Unknown  Status = "unknown"
)

// Stale says why a node's verdict is not to be trusted; empty when it is.
type Stale string

const (
	// VerdictStale: not confirmed within its stale_after_s.
	VerdictStale Stale = "verdict-stale"
	// NoVerdict: none received yet.
	NoVerdict Stale = "no-verdict"
)

// Device is one device of the node.
type Device struct {
	ID       string // its id on the node (gpu3, npu0)
	Status   Status
	Reason   string // why it is not healthy; empty when none
	UUID     string // where known
	PCIBusID string // where known
}

// Drain is a pod asked to checkpoint before its eviction from a failed device: evicted
// at EvictAfter at the latest, at once when it acknowledges.
type Drain struct {
	Namespace    string
	Pod          string
	UID          string // the downward API's metadata.uid
	Devices      []string
	Reason       string // xid-79; empty when none
	Requested    string // RFC 3339
	EvictAfter   string // RFC 3339
	Acknowledged string // RFC 3339; empty until faultline got the acknowledgement
}

// Entry is one node's published health: the node's own fault.json, the aggregator's
// <node>.json or the agent's --health-file. Only the node's own fault.json has a
// verdict; a shard ConfigMap's entry is never stale here.
type Entry struct {
	Node      string
	Devices   []Device // those asked for, when only some are
	Reachable bool     // whether the aggregator reached the agent
	Stale     Stale    // empty, or why the verdict is not to be trusted
	Drains    []Drain  // pods of the node asked to checkpoint before their eviction
}

// DrainFor is the drain intent of pod uid, or nil.
func (e *Entry) DrainFor(uid string) *Drain {
	if uid == "" {
		return nil
	}
	for i := range e.Drains {
		if e.Drains[i].UID == uid {
			return &e.Drains[i]
		}
	}
	return nil
}

// Failed is the failed devices.
func (e *Entry) Failed() []Device { return e.with(Failed) }

// Degraded is the degraded devices.
func (e *Entry) Degraded() []Device { return e.with(Degraded) }

func (e *Entry) with(s Status) []Device {
	var out []Device
	for _, d := range e.Devices {
		if d.Status == s {
			out = append(out, d)
		}
	}
	return out
}

// Parse reads a node document (all of them list npus). node: refuse another node's
// document ("" takes any); only: keep the devices named by id, UUID or PCI bus id
// (empty keeps all); now judges the verdict's age.
func Parse(data []byte, node string, only []string, now time.Time) (*Entry, error) {
	doc, err := decode(data)
	if err != nil {
		return nil, err
	}
	return entryOf(doc, node, only, seconds(now))
}

// Read is the Entry at path now; nil (and no error) when there is none: the node is
// not published.
func Read(path, node string, only []string) (*Entry, error) {
	e, _, err := read(path, node, only)
	return e, err
}

// read is the Entry at path and when its verdict ages out (seconds since the epoch;
// 0: never).
func read(path, node string, only []string) (*Entry, float64, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	doc, err := decode(data)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", path, err)
	}
	e, err := entryOf(doc, node, only, seconds(time.Now()))
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", path, err)
	}
	if e.Stale != "" {
		return e, 0, nil
	}
	at, _ := staleAt(doc)
	return e, at, nil
}

// Describe is the lines printed for one change (entry nil: not published), the same
// as every consumer of the kit prints: "<node> <device> <status> <reason or ->", after
// "<node> - unknown verdict-stale" while the verdict is not confirmed, then one line
// per drain intent. node names the node when the document does not.
func Describe(e *Entry, node string) []string {
	if e == nil {
		return []string{node + " - unknown not-published"}
	}
	who := e.Node
	if who == "" {
		who = node
	}
	if !e.Reachable {
		return []string{who + " - unknown agent-unreachable"}
	}
	var lines []string
	if e.Stale != "" {
		lines = append(lines, fmt.Sprintf("%s - unknown %s", who, e.Stale))
	}
	for _, d := range e.Devices {
		lines = append(lines, fmt.Sprintf("%s %s %s %s", who, d.ID, d.Status, orDash(d.Reason)))
	}
	for _, d := range e.Drains {
		lines = append(lines, fmt.Sprintf("%s - drain %s/%s %s %s",
			who, d.Namespace, d.Pod, OrNone(d.EvictAfter), orDash(d.Reason)))
	}
	return lines
}

// OrNone is s, or "None" when empty: what the Python kit prints for a field the
// document leaves out, so that every consumer prints the same line.
func OrNone(s string) string {
	if s == "" {
		return "None"
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// document is a decoded node document. Decoded loosely (a map, numbers kept as
// written) so that it reads what the Python kit reads, and the follow mode can write
// it back.
type document = map[string]any

func decode(data []byte) (document, error) {
	// Python's json reads a UTF-8 byte order mark and refuses invalid UTF-8.
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf"))
	if !utf8.Valid(data) {
		return nil, errors.New("not UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("extra data after the document")
	}
	doc, _ := v.(document)
	return doc, checkNodeDocument(doc, "")
}

// checkNodeDocument fails unless doc is a node document (of node, unless "").
func checkNodeDocument(doc document, node string) error {
	if _, ok := doc["npus"].([]any); !ok {
		return errors.New("not a faultline node document (no npus list)")
	}
	if node != "" {
		if n, _ := doc["node"].(string); n != node {
			return fmt.Errorf("document of node %s, not %q", pyRepr(doc["node"]), node)
		}
	}
	return nil
}

func entryOf(doc document, node string, only []string, now float64) (*Entry, error) {
	if err := checkNodeDocument(doc, node); err != nil {
		return nil, err
	}
	for _, d := range doc["npus"].([]any) {
		if _, ok := d.(document); !ok {
			return nil, errors.New("not a faultline node document (a device is not an object)")
		}
	}
	var stale Stale
	if v, ok := doc["verdict"].(document); ok {
		at, ages := staleAt(doc)
		if truthy(v["stale"]) || (ages && now > at) {
			doc = markStale(doc)
			stale = NoVerdict
			if truthy(v["writer"]) {
				stale = VerdictStale
			}
		}
	}
	e := &Entry{Node: text(doc["node"]), Devices: []Device{}, Reachable: true, Stale: stale, Drains: []Drain{}}
	for _, raw := range doc["npus"].([]any) {
		d := raw.(document)
		dev := Device{
			ID:       pyStr(d["id"]),
			Status:   Unknown,
			Reason:   truthyText(d["reason"]),
			UUID:     text(d["uuid"]),
			PCIBusID: text(d["pci_bus_id"]),
		}
		switch s := Status(text(d["status"])); s {
		case Healthy, Degraded, Failed, Unknown:
			dev.Status = s
		}
		if len(only) > 0 && !slices.Contains(only, dev.ID) &&
			!(dev.UUID != "" && slices.Contains(only, dev.UUID)) &&
			!(dev.PCIBusID != "" && slices.Contains(only, dev.PCIBusID)) {
			continue
		}
		e.Devices = append(e.Devices, dev)
	}
	if a, ok := doc["agent"].(document); ok {
		if r, ok := a["reachable"]; ok {
			e.Reachable = truthy(r)
		}
	}
	drains, _ := doc["drain"].([]any)
	for _, raw := range drains {
		d, ok := raw.(document)
		if !ok {
			continue
		}
		devices := []string{}
		if list, ok := d["devices"].([]any); ok {
			for _, x := range list {
				devices = append(devices, pyStr(x))
			}
		}
		e.Drains = append(e.Drains, Drain{
			Namespace:    pyStr(d["namespace"]),
			Pod:          pyStr(d["pod"]),
			UID:          pyStr(d["uid"]),
			Devices:      devices,
			Reason:       truthyText(d["reason"]),
			Requested:    text(d["requested"]),
			EvictAfter:   text(d["evict_after"]),
			Acknowledged: text(d["acknowledged"]),
		})
	}
	return e, nil
}

// truthy is Python's truth of a JSON value: what the reference kit tests.
func truthy(v any) bool {
	switch v := v.(type) {
	case nil:
		return false
	case bool:
		return v
	case string:
		return v != ""
	case json.Number:
		f, err := v.Float64()
		return err != nil || f != 0
	case []any:
		return len(v) > 0
	case document:
		return len(v) > 0
	}
	return true
}

// text is a JSON string's value; "" for anything else.
func text(v any) string {
	s, _ := v.(string)
	return s
}

// truthyText is a field printed with Python's "x or '-'": "" when falsy.
func truthyText(v any) string {
	if !truthy(v) {
		return ""
	}
	return pyStr(v)
}

// pyStr is Python's str() of a JSON value, as the reference kit keeps ids and names.
func pyStr(v any) string {
	switch v := v.(type) {
	case nil:
		return "None"
	case bool:
		if v {
			return "True"
		}
		return "False"
	case string:
		return v
	case json.Number:
		return v.String()
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func pyRepr(v any) string {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	return pyStr(v)
}
