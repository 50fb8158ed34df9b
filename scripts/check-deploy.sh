#!/usr/bin/env bash
# The manifests (issue 12): every kustomize overlay renders with `kubectl kustomize` and
# validates strictly against the Kubernetes 1.30 schema (kubernetes-validate, PyPI);
# the overlays say what they claim (Ascend sources and mounts, enforce turned on).
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v kubectl >/dev/null 2>&1 || missing+=(kubectl)
# The module, wherever pip put its script.
validate() { python3 -m kubernetes_validate "$@"; }
python3 -c 'import kubernetes_validate' >/dev/null 2>&1 || missing+=(kubernetes-validate)
if [ ${#missing[@]} -gt 0 ]; then
  if [ -n "${CI:-}" ]; then
    echo "check-deploy: missing ${missing[*]} and CI is set (.ci/run installs them)" >&2
    exit 1
  fi
  echo "SKIPPED check-deploy: missing ${missing[*]}"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for dir in deploy/overlays/*/; do
  o=$(basename "$dir")
  kubectl kustomize "$dir" >"$out/$o.yaml"
  validate -k 1.30.0 --strict --quiet "$out/$o.yaml"
  echo "deploy/overlays/$o: $(grep -c '^kind:' "$out/$o.yaml") objects, valid against 1.30"
done
expect() { grep -q -- "$2" "$out/$1.yaml" || { echo "check-deploy: $1 lacks $2" >&2; exit 1; }; }
refuse() { if grep -q -- "$2" "$out/$1.yaml"; then echo "check-deploy: $1 has $2" >&2; exit 1; fi; }
expect nvidia "--remediation=dry-run"
expect nvidia "nvml,kmsg"
expect ascend "dcmi,kmsg"
expect ascend "mountPath: /usr/local/dcmi"
expect ascend "--node-selector=accelerator=huawei-Ascend910"
expect ascend "--resource-names=huawei.com/Ascend910"
refuse ascend "NVIDIA_VISIBLE_DEVICES"
expect nvidia-monitoring "kind: PodMonitor"
expect nvidia-monitoring "kind: ServiceMonitor"
expect nvidia-monitoring "targetLabel: node"
expect nvidia-monitoring "kubernetes.io/metadata.name: monitoring"
refuse nvidia "kind: PodMonitor"
expect nvidia-enforce "--remediation=enforce"
refuse nvidia-enforce "--remediation=dry-run"
