#!/usr/bin/env bash
# Every package selection CI builds sees each dependency with the features `cargo test
# --workspace` gives it, so no selection builds the tree again (hack/Cargo.toml says
# why; a second and a third copy of target/debug filled a CI machine's disk). Reads
# `cargo tree` only: no build. On a difference, add the crate and the workspace's
# features to hack/Cargo.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
features() {  # one line per dependency: name version [features]; ours and Windows' left out
  cargo tree --locked "$@" -f '{p} [{f}]' --prefix none --target x86_64-unknown-linux-gnu |
    sed -E 's/ \((proc-macro|\*|\/[^)]*)\)//g' | grep -v -e '^$' -e '^faultline' | sort -u
}
ws=$(features --workspace -e normal,build,dev)
status=0
check() {  # what: the command it stands for; then cargo tree's selection
  local what=$1; shift
  local extra
  extra=$(comm -13 <(echo "$ws") <(features "$@"))
  if [ -n "$extra" ]; then
    echo "check-hack: $what builds these with other features than the workspace:" >&2
    echo "$extra" | sed 's/^/  /' >&2
    status=1
  fi
}
check "cargo test -p faultline-aggregator (the guardrail and mutation scripts)" \
  -p faultline-aggregator -e normal,build,dev
check "cargo test -p faultline-common (scripts/mutants.sh)" -p faultline-common -e normal,build,dev
check "cargo build -p faultline-agent -p faultline-aggregator -p faultline-test-apiserver (demo.sh)" \
  -p faultline-agent -p faultline-aggregator -p faultline-test-apiserver -e normal,build
[ $status -eq 0 ] && echo "check-hack: every selection builds the workspace's features"
exit $status
