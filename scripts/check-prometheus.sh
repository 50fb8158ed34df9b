#!/usr/bin/env bash
# The Prometheus rules: promtool checks them and runs their unit tests; the
# PrometheusRule carries the same groups as the plain rules file; every runbook_url
# points at a section of docs/runbooks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=deploy/prometheus
if ! command -v promtool >/dev/null 2>&1; then
  if [ -n "${CI:-}" ]; then
    echo "check-prometheus: promtool missing and CI is set (.ci/run installs Debian's prometheus)" >&2
    exit 1
  fi
  echo "SKIPPED check-prometheus: no promtool on PATH (apt-get install prometheus)"
  exit 0
fi
promtool check rules "$dir/faultline-rules.yaml"
(cd "$dir" && promtool test rules rules-tests.yaml)
# The PrometheusRule's spec is the rules file's groups, indented.
want=$(sed -n '/^groups:/,$p' "$dir/faultline-rules.yaml")
got=$(sed -n '/^spec:/,$p' "$dir/prometheusrule.yaml" | tail -n +2 | sed 's/^  //')
if [ "$want" != "$got" ]; then
  echo "check-prometheus: $dir/prometheusrule.yaml does not carry the groups of faultline-rules.yaml" >&2
  diff <(echo "$want") <(echo "$got") >&2 || true
  exit 1
fi
# Every runbook anchor exists.
missing=0
for anchor in $(grep -o 'runbooks.md#[a-z0-9-]*' "$dir/faultline-rules.yaml" | cut -d'#' -f2 | sort -u); do
  if ! grep -qi "^## ${anchor}\$" docs/runbooks.md; then
    echo "check-prometheus: docs/runbooks.md has no section for #$anchor" >&2
    missing=1
  fi
done
[ "$missing" = 0 ]
# Every query of the Grafana dashboard is valid PromQL: written into a rules file as
# recording rules, which promtool parses.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - deploy/grafana/faultline-dashboard.json "$tmp/dashboard-queries.yaml" <<'PY'
import json, sys
dash = json.load(open(sys.argv[1]))
lines = ["groups:", "  - name: dashboard-queries", "    rules:"]
n = 0
for panel in dash["panels"]:
    for t in panel.get("targets", []):
        n += 1
        lines.append(f"      - record: dashboard:query_{n}")
        lines.append("        expr: " + json.dumps(t["expr"]))
if n == 0:
    sys.exit("the dashboard has no queries")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
PY
promtool check rules "$tmp/dashboard-queries.yaml"
echo "prometheus rules ok: $(grep -c 'alert:' "$dir/faultline-rules.yaml") alerts checked, unit tests passed, runbooks found, dashboard queries parse"
