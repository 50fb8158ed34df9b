package consumer

import (
	"encoding/json"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func timeAt(t float64) string {
	sec, frac := math.Modf(t)
	return time.Unix(int64(sec), int64(frac*1e9)).UTC().Format("2006-01-02T15:04:05.000Z")
}

func now() float64 { return seconds(time.Now()) }

// nodeDoc is a node's own fault.json as its agent serves it, every verdict fresh (the
// tests change what they need).
func nodeDoc(statuses ...string) document {
	npus := []any{}
	counts := map[string]any{"total": len(statuses)}
	for i, s := range statuses {
		var reason any
		if s != "healthy" {
			reason = "xid-79"
		}
		npus = append(npus, document{"id": "gpu" + string(rune('0'+i)), "status": s, "reason": reason,
			"since": "2026-01-01T00:00:00.000Z", "uuid": "GPU-" + string(rune('0'+i))})
		n, _ := counts[s].(int)
		counts[s] = n + 1
	}
	t := timeAt(now())
	return document{"version": "faultline.fault/v1", "timestamp": t, "node": "n1",
		"agent": document{"reachable": true}, "npus": npus, "summary": counts, "readings_at": t,
		"verdict": document{"sequence": 1, "stale": false, "stale_after_s": 30,
			"writer": "faultline-0", "published": t, "confirmed": t}}
}

func verdict(d document) document { return d["verdict"].(document) }

func line(d document) []byte {
	b, err := json.Marshal(d)
	if err != nil {
		panic(err)
	}
	return b
}

func parse(t *testing.T, d document, node string, at time.Time) *Entry {
	t.Helper()
	e, err := Parse(line(d), node, nil, at)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func statuses(e *Entry) [][2]string {
	var out [][2]string
	for _, d := range e.Devices {
		out = append(out, [2]string{string(d.Status), d.Reason})
	}
	return out
}

func TestParseTime(t *testing.T) {
	// The values the reference kit's parse_time gives, the odd ones included: fields
	// past their range are counted on, as calendar.timegm does.
	for in, want := range map[string]float64{
		"1970-01-01T00:00:01Z":                1,
		"1970-01-01T00:00:01.250Z":            1.25,
		"1970-01-01T01:00:00+01:00":           0,
		"2026-03-01T00:00:00.5-00:30":         1772323200 + 1800.5,
		"2026-02-31T25:61:61Z":                1772589721,
		"0001-01-01T00:00:00Z":                -62135596800,
		"2026-01-01T00:00:00Z\n":              1767225600,
		"2026-01-01 00:00:00.123456789123z":   1767225600.1234567,
		"1970-01-01T00:00:00.1-00:00":         0.1,
		"9999-12-31T23:59:59.999999999+23:59": 253402214460.0,
	} {
		got, ok := parseTime(in)
		if !ok || got != want {
			t.Errorf("parseTime(%q) = %v, %v; want %v", in, got, ok, want)
		}
	}
	for _, bad := range []string{"", "yesterday", "2026-13-01T00:00:00Z", "2026-01-01T00:00:00",
		"0000-01-01T00:00:00Z", "2026-01-01T00:00:00Z\n\n"} {
		if got, ok := parseTime(bad); ok {
			t.Errorf("parseTime(%q) = %v, want none", bad, got)
		}
	}
}

func TestAFreshVerdictIsReadAsItIs(t *testing.T) {
	e := parse(t, nodeDoc("healthy", "failed"), "n1", time.Now())
	if e.Stale != "" {
		t.Fatalf("stale: %q", e.Stale)
	}
	want := []string{"n1 gpu0 healthy -", "n1 gpu1 failed xid-79"}
	if got := Describe(e, "n1"); !slices.Equal(got, want) {
		t.Fatalf("%q, want %q", got, want)
	}
	if f := e.Failed(); len(f) != 1 || f[0].ID != "gpu1" || f[0].UUID != "GPU-1" {
		t.Fatalf("failed: %+v", f)
	}
}

func TestTheAgentsStaleVerdictIsReported(t *testing.T) {
	d := nodeDoc("unknown", "failed")
	verdict(d)["stale"] = true
	d["npus"].([]any)[0].(document)["reason"] = "verdict-stale"
	e := parse(t, d, "", time.Now())
	if e.Stale != VerdictStale {
		t.Fatalf("stale: %q", e.Stale)
	}
	want := []string{"n1 - unknown verdict-stale", "n1 gpu0 unknown verdict-stale", "n1 gpu1 failed xid-79"}
	if got := Describe(e, "n1"); !slices.Equal(got, want) {
		t.Fatalf("%q, want %q", got, want)
	}
	if f := e.Failed(); len(f) != 1 || f[0].ID != "gpu1" {
		t.Fatalf("failed stays failed: %+v", f)
	}
}

func TestNoVerdictYet(t *testing.T) {
	d := nodeDoc("unknown")
	d["verdict"] = document{"sequence": 0, "stale": true, "stale_after_s": 30}
	e := parse(t, d, "", time.Now())
	if e.Stale != NoVerdict || Describe(e, "n1")[0] != "n1 - unknown no-verdict" {
		t.Fatalf("%q: %q", e.Stale, Describe(e, "n1"))
	}
}

func TestAnOldConfirmationIsStaleByItsAge(t *testing.T) {
	d := nodeDoc("healthy", "degraded")
	verdict(d)["confirmed"] = timeAt(1000)
	at := time.Unix(1000+30+5, 0)
	if e := parse(t, d, "", at); e.Stale != "" {
		t.Fatalf("stale at the grace's end: %q", e.Stale)
	}
	e := parse(t, d, "", at.Add(100*time.Millisecond))
	if e.Stale != VerdictStale {
		t.Fatalf("not stale past the grace: %q", e.Stale)
	}
	want := [][2]string{{"unknown", "verdict-stale"}, {"degraded", "xid-79"}}
	if got := statuses(e); !reflect.DeepEqual(got, want) {
		t.Fatalf("%q, want %q", got, want)
	}
	// The fraction and stale_after_s as written count too.
	verdict(d)["confirmed"] = "1970-01-01T00:16:40.5Z"
	verdict(d)["stale_after_s"] = 29.5
	if e := parse(t, d, "", at); e.Stale != "" {
		t.Fatalf("stale at 1035 s: %q", e.Stale)
	}
	if e := parse(t, d, "", at.Add(time.Millisecond)); e.Stale != VerdictStale {
		t.Fatalf("not stale past 1035 s: %q", e.Stale)
	}
}

func TestTheShardEntryHasNoVerdictAndIsNeverStale(t *testing.T) {
	d := nodeDoc("healthy")
	delete(d, "verdict")
	if e := parse(t, d, "", time.Now()); e.Stale != "" {
		t.Fatalf("stale: %q", e.Stale)
	}
	// Nor is one whose confirmation does not parse.
	d = nodeDoc("healthy")
	verdict(d)["confirmed"] = "yesterday"
	if e := parse(t, d, "", time.Now().Add(time.Hour)); e.Stale != "" {
		t.Fatalf("stale: %q", e.Stale)
	}
}

func TestWhatIsRefusedAndWhatIsKept(t *testing.T) {
	for _, bad := range []string{`{"npus":`, `[]`, `{"node":"n1"}`, `{"npus":[]} {}`, `{"npus":[7]}`, "{\"npus\":[],\"x\":\"\xff\"}"} {
		if _, err := Parse([]byte(bad), "", nil, time.Now()); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	if _, err := Parse(line(nodeDoc("healthy")), "n2", nil, time.Now()); err == nil ||
		!strings.Contains(err.Error(), `document of node "n1", not "n2"`) {
		t.Errorf("another node's document: %v", err)
	}
	d := nodeDoc("healthy", "failed", "rebooting")
	d["npus"].([]any)[2].(document)["pci_bus_id"] = "0000:3b:00.0"
	e, err := Parse(append([]byte("\xef\xbb\xbf"), line(d)...), "n1", []string{"GPU-1", "0000:3b:00.0"}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"n1 gpu1 failed xid-79", "n1 gpu2 unknown xid-79"}
	if got := Describe(e, "n1"); !slices.Equal(got, want) {
		t.Fatalf("only two, the one it does not know unknown: %q", got)
	}
	d["agent"] = document{"reachable": false}
	e = parse(t, d, "n1", time.Now())
	if got := Describe(e, "n1"); !slices.Equal(got, []string{"n1 - unknown agent-unreachable"}) {
		t.Fatalf("%q", got)
	}
	if got := Describe(nil, "n3"); !slices.Equal(got, []string{"n3 - unknown not-published"}) {
		t.Fatalf("%q", got)
	}
}

func TestMarkStaleWritesWhatTheAgentWould(t *testing.T) {
	d := nodeDoc("healthy", "failed")
	s := markStale(d)
	if verdict(d)["stale"] != false {
		t.Fatal("the document given was changed")
	}
	var back document
	if err := json.Unmarshal(compact(s), &back); err != nil {
		t.Fatal(err)
	}
	npus := back["npus"].([]any)
	if npus[0].(document)["status"] != "unknown" || npus[0].(document)["reason"] != "verdict-stale" ||
		npus[1].(document)["status"] != "failed" || back["verdict"].(document)["stale"] != true {
		t.Fatalf("%s", compact(s))
	}
	want := document{"total": 2.0, "healthy": 0.0, "degraded": 0.0, "failed": 1.0, "unknown": 1.0}
	if !reflect.DeepEqual(back["summary"], want) {
		t.Fatalf("summary %v", back["summary"])
	}
}

func drainDoc() document {
	d := nodeDoc("failed", "healthy")
	d["drain"] = []any{document{"namespace": "ml", "pod": "train-0", "uid": "u-1",
		"pod_ips": []any{"10.0.0.7"}, "devices": []any{"gpu0"}, "reason": "xid-79",
		"requested": "2026-12-05T00:00:00.000Z", "evict_after": "2026-12-05T00:05:00.000Z"}}
	return d
}

func TestTheIntentOfThisPodIsRead(t *testing.T) {
	e := parse(t, drainDoc(), "", time.Now())
	d := e.DrainFor("u-1")
	if d == nil || d.Namespace != "ml" || d.Pod != "train-0" || !slices.Equal(d.Devices, []string{"gpu0"}) ||
		d.Reason != "xid-79" || d.EvictAfter != "2026-12-05T00:05:00.000Z" || d.Acknowledged != "" {
		t.Fatalf("%+v", d)
	}
	if e.DrainFor("u-2") != nil || e.DrainFor("") != nil {
		t.Fatal("another pod's intent, or none asked for")
	}
	if !slices.Contains(Describe(e, "n1"), "n1 - drain ml/train-0 2026-12-05T00:05:00.000Z xid-79") {
		t.Fatalf("%q", Describe(e, "n1"))
	}
	// A document without intents reads as before.
	plain := parse(t, nodeDoc("healthy"), "", time.Now())
	if len(plain.Drains) != 0 || !slices.Equal(Describe(plain, "n1"), []string{"n1 gpu0 healthy -"}) {
		t.Fatalf("%+v", plain)
	}
}
