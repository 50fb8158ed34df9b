#!/usr/bin/env bash
# Build a pinned Kubernetes control plane from its Go modules: kube-apiserver,
# kube-controller-manager, kube-scheduler and etcd, for each version named (default:
# every k8s-*/ folder here). One folder per minor version holds the pins: go.mod names
# k8s.io/kubernetes and replaces each of its staging modules by the matching v0.x (the
# module's own go.mod points them at ./staging, which a dependent module cannot see);
# go.sum is committed, so nothing is resolved anew. etcd is built at the version that
# Kubernetes release pins (etcd/main.go calls etcdmain as etcd's own main does).
#
# The binaries go to $FAULTLINE_CONTROLPLANE_CACHE (default ~/.cache/faultline/
# controlplane)/<version>-<hash of the pins and this script>/bin; a cache that holds them
# is not rebuilt. Prints the bin directory of each version, one per line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${FAULTLINE_CONTROLPLANE_CACHE:-$HOME/.cache/faultline/controlplane}"
if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: Go is not installed: the real control plane is built from its Go modules; install Go 1.26 or newer (the go command on PATH) and run again" >&2
  exit 3
fi
dirs=()
if [ $# -eq 0 ]; then
  for d in "$here"/k8s-*/; do dirs+=("$(basename "$d")"); done
else
  for v in "$@"; do dirs+=("k8s-${v#v}"); done
fi
mkdir -p "$cache"
for d in "${dirs[@]}"; do
  src="$here/$d"
  [ -f "$src/go.mod" ] || { echo "build.sh: no pins for $d ($src/go.mod)" >&2; exit 2; }
  version="$(sed -nE 's/^(require)?[[:space:]]*k8s\.io\/kubernetes (v[0-9.]+)$/\2/p' "$src/go.mod")"
  key="$(cat "$src/go.mod" "$src/go.sum" "$src/etcd/main.go" "$0" | sha256sum | cut -c1-12)"
  out="$cache/${version}-${key}"
  bins=(kube-apiserver kube-controller-manager kube-scheduler etcd)
  have=1
  for b in "${bins[@]}"; do [ -x "$out/bin/$b" ] || have=0; done
  if [ "$have" = 1 ]; then
    echo "$out/bin"
    continue
  fi
  # One build at a time: a second caller waits on the lock, then finds the cache full.
  exec 9>"$cache/.lock"
  flock 9
  have=1
  for b in "${bins[@]}"; do [ -x "$out/bin/$b" ] || have=0; done
  if [ "$have" = 0 ]; then
    minor="$(echo "$version" | sed -E 's/^v([0-9]+)\.([0-9]+)\..*/\2/')"
    # What kube's own build stamps (hack/lib/version.sh): the version that discovery's
    # /version answers and that the components compare.
    ld="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld="$ld -X $p.gitVersion=$version -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    done
    start=$(date +%s)
    echo "build.sh: building Kubernetes $version (kube-apiserver, kube-controller-manager, kube-scheduler, etcd) into $out" >&2
    tmp="$out.tmp.$$"
    mkdir -p "$tmp/bin"
    (cd "$src" && go build -ldflags "$ld" -o "$tmp/bin/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler ./etcd) >&2
    rm -rf "$out"
    mv "$tmp" "$out"
    echo "build.sh: built $version in $(( $(date +%s) - start )) s" >&2
  fi
  flock -u 9
  echo "$out/bin"
done
