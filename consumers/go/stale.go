package consumer

import (
	"encoding/json"
	"regexp"
	"strconv"
	"time"
)

// StaleGrace is how long after the agent would have said so itself a verdict is
// judged stale by its age: a running agent rewrites the file when its verdict turns
// stale.
const StaleGrace = 5 * time.Second

// staleGrace is StaleGrace in seconds; a variable so that a test need not wait for it.
var staleGrace = StaleGrace.Seconds()

// StaleReason is the reason of a device whose healthy verdict is no longer confirmed.
const StaleReason = string(VerdictStale)

// The reference kit's pattern; Python's $ also matches before a final newline.
var rfc3339 = regexp.MustCompile(
	`^(\d{4})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(?:([Zz])|([+-])(\d\d):(\d\d))\n?$`)

// parseTime is the seconds since the epoch of an RFC 3339 time (Z or an offset, any
// fraction), as the reference kit reads it: month and year checked, the other fields
// counted on (calendar.timegm), so that both judge the same verdicts stale.
func parseTime(s string) (float64, bool) {
	m := rfc3339.FindStringSubmatch(s)
	if m == nil {
		return 0, false
	}
	n := func(i int) int64 {
		v, _ := strconv.ParseInt(m[i], 10, 64)
		return v
	}
	y, mo := n(1), n(2)
	if y < 1 || mo < 1 || mo > 12 {
		return 0, false
	}
	t := time.Date(int(y), time.Month(mo), 1, 0, 0, 0, 0, time.UTC).Unix() +
		(n(3)-1)*86400 + n(4)*3600 + n(5)*60 + n(6)
	at := float64(t)
	if m[7] != "" {
		frac, _ := strconv.ParseFloat("0."+m[7], 64)
		at += frac
	}
	if m[9] != "" {
		off := float64(n(10)*3600 + n(11)*60)
		if m[9] == "+" {
			at -= off
		} else {
			at += off
		}
	}
	return at, true
}

// staleAt is when the verdict of a node's own fault.json must be judged stale by its
// age (seconds since the epoch): verdict.confirmed + verdict.stale_after_s +
// StaleGrace; false without a confirmed verdict (or outside the node's own file).
func staleAt(doc document) (float64, bool) {
	v, ok := doc["verdict"].(document)
	if !ok {
		return 0, false
	}
	s, ok := v["confirmed"].(string)
	if !ok {
		return 0, false
	}
	confirmed, ok := parseTime(s)
	if !ok {
		return 0, false
	}
	n, ok := v["stale_after_s"].(json.Number)
	if !ok {
		return 0, false
	}
	after, err := n.Float64()
	if err != nil {
		return 0, false
	}
	return confirmed + after + staleGrace, true
}

// markStale is doc (a node's own fault.json) as its agent writes it once the verdict
// is stale: verdict.stale, every healthy device unknown (verdict-stale), the summary
// counted again. doc is left as it was.
func markStale(doc document) document {
	doc = deepCopy(doc).(document)
	v, ok := doc["verdict"].(document)
	if !ok {
		v = document{}
		doc["verdict"] = v
	}
	v["stale"] = true
	counts := map[string]int{"healthy": 0, "degraded": 0, "failed": 0, "unknown": 0}
	npus, _ := doc["npus"].([]any)
	for _, raw := range npus {
		d, ok := raw.(document)
		if !ok {
			continue
		}
		if d["status"] == "healthy" {
			d["status"], d["reason"] = "unknown", StaleReason
		}
		s, _ := d["status"].(string)
		if _, known := counts[s]; !known {
			s = "unknown"
		}
		counts[s]++
	}
	counts["total"] = counts["healthy"] + counts["degraded"] + counts["failed"] + counts["unknown"]
	doc["summary"] = counts
	return doc
}

func deepCopy(v any) any {
	switch v := v.(type) {
	case document:
		out := make(document, len(v))
		for k, x := range v {
			out[k] = deepCopy(x)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = deepCopy(x)
		}
		return out
	}
	return v
}

func seconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }
