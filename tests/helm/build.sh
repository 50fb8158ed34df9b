#!/usr/bin/env bash
# Build the pinned helm (helm.sh/helm/v4, pinned with every dependency in go.mod and
# go.sum here) from its Go module, as tests/controlplane/build.sh builds the control
# plane: into $FAULTLINE_HELM_CACHE (default ~/.cache/faultline/helm)/<version>-<hash of
# the pins and this script>/helm, not rebuilt while the cache holds it. Prints the path
# of the helm binary. About 3 minutes cold on 2 cores; less after tests/controlplane/build.sh
# (the Kubernetes 1.37 modules it shares, k8s.io/client-go v0.37.2 and the rest, are
# compiled once in the Go build cache: no -trimpath, as that build).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${FAULTLINE_HELM_CACHE:-$HOME/.cache/faultline/helm}"
if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: Go is not installed: helm is built from its Go module; install Go 1.26 or newer (the go command on PATH) and run again" >&2
  exit 3
fi
version="$(sed -nE 's/^require helm\.sh\/helm\/v4 (v[0-9.]+)$/\1/p' "$here/go.mod")"
[ -n "$version" ] || { echo "build.sh: no helm.sh/helm/v4 pin in $here/go.mod" >&2; exit 2; }
key="$(cat "$here/go.mod" "$here/go.sum" "$0" | sha256sum | cut -c1-12)"
out="$cache/${version}-${key}"
mkdir -p "$cache"
if [ ! -x "$out/helm" ]; then
  # One build at a time: a second caller waits on the lock, then finds the cache full.
  exec 9>"$cache/.lock"
  flock 9
  if [ ! -x "$out/helm" ]; then
    start=$(date +%s)
    echo "build.sh: building helm $version into $out" >&2
    tmp="$out.tmp.$$"
    mkdir -p "$tmp"
    # What helm's Makefile stamps: `helm version` answers the release, and the
    # Kubernetes version it assumes for .Capabilities without a cluster is its client-go's.
    ld="-s -w -X helm.sh/helm/v4/internal/version.version=$version -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
    (cd "$here" && go build -ldflags "$ld" -o "$tmp/helm" helm.sh/helm/v4/cmd/helm) >&2
    rm -rf "$out"
    mv "$tmp" "$out"
    echo "build.sh: built helm $version in $(( $(date +%s) - start )) s" >&2
  fi
  flock -u 9
fi
echo "$out/helm"
