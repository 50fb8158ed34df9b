#!/usr/bin/env python3
"""The Helm chart (deploy/helm/faultline), checked the way chart users check it, with the
pinned helm built from its Go module (tests/helm/build.sh). Needs python3 with PyYAML
and kubernetes-validate, kubectl (for `kubectl kustomize`) and Go (for helm).

    scripts/check-helm.py            every check below; exit 1 naming each failure

1. `helm lint --strict`, alone and with each documented values file (ci/*-values.yaml);
2. `helm template` of each renders objects valid against Kubernetes 1.30 (strict);
3. the chart and kustomize agree: each ci/<overlay>-values.yaml renders the objects
   `kubectl kustomize deploy/overlays/<overlay>` renders, but for Helm's own labels and
   the Namespace (the chart installs into one: `helm install --namespace`);
4. the RBAC follows the flags (scripts/gen-rbac.py --check --rendered) for every values
   file and for each optional feature turned on;
5. the schema refuses unknown keys and bad values, and the chart's validation refuses
   contradictions, each with a message naming the value;
6. template tests over `helm template` output (a release name other than the chart's,
   extra args and env, the monitoring objects only when their CRD is served);
7. every pod running at a system priority class outside kube-system has a ResourceQuota
   admitting that class in its namespace (GKE refuses such pods otherwise), in the chart
   and in every kustomize overlay;
8. the previous chart version (tests/helm/previous/) is older, has an upgrade note, and
   today's templates render with its values.yaml (what `helm upgrade --reuse-values`
   does). docs/deploying.md's values table is checked by scripts/check-docs.py.
"""
import json
import pathlib
import re
import shutil
import subprocess
import tarfile
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy/helm/faultline"
OVERLAYS = ("nvidia", "ascend", "nvidia-enforce", "nvidia-monitoring")
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version")
MONITORING = "monitoring.coreos.com/v1"
SYSTEM_CLASSES = ("system-node-critical", "system-cluster-critical")
failures = []


def fail(what):
    failures.append(what)
    print(f"check-helm: FAIL {what}", file=sys.stderr)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def helm_binary():
    r = run([str(ROOT / "tests/helm/build.sh")])
    if r.returncode != 0:
        sys.exit(f"check-helm: tests/helm/build.sh failed:\n{r.stderr}")
    return r.stdout.strip().splitlines()[-1]


HELM = None


def template(*args, release="faultline", namespace="faultline"):
    """(objects, None) or (None, stderr)."""
    r = run([HELM, "template", release, str(CHART), "--namespace", namespace, *args])
    if r.returncode != 0:
        return None, r.stderr.strip()
    return [d for d in yaml.safe_load_all(r.stdout) if isinstance(d, dict)], None


def must_render(what, *args, **kw):
    objs, err = template(*args, **kw)
    if objs is None:
        fail(f"{what}: helm template failed: {err}")
        return []
    return objs


def values_file(overlay):
    return str(CHART / "ci" / f"{overlay}-values.yaml")


def extra_args(overlay):
    # The monitoring objects render only where their CRD is served: say it is.
    return ["--api-versions", MONITORING] if overlay.endswith("monitoring") else []


def key(o):
    m = o.get("metadata") or {}
    return (o.get("kind"), m.get("namespace") or "", m.get("name"))


def words(args):
    """Container args as flags with their values, order aside (`--f v` and `--f=v` alike)."""
    out, i = [], 0
    args = [str(a) for a in args]
    while i < len(args):
        w = args[i]
        if w.startswith("--") and "=" not in w and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(f"{w}={args[i + 1]}")
            i += 2
        else:
            out.append(w)
            i += 1
    return sorted(out)


def normal(o):
    o = json.loads(json.dumps(o))
    labels = (o.get("metadata") or {}).get("labels") or {}
    for k in HELM_LABELS:
        labels.pop(k, None)
    spec = ((o.get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in spec.get("containers") or []:
        if "args" in c:
            c["args"] = words(c["args"])
        c.pop("imagePullPolicy", None)
    return o


def diff(a, b, path=""):
    """The first few paths where a and b differ."""
    if type(a) is not type(b):
        return [f"{path or '/'}: {json.dumps(a)[:120]} != {json.dumps(b)[:120]}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'kustomize' if k in a else 'helm'}: {json.dumps(a.get(k, b.get(k)))[:120]}")
            else:
                out += diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items in kustomize, {len(b)} in helm: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:120]} != {json.dumps(b)[:120]}"]


def compare(overlay):
    r = run(["kubectl", "kustomize", str(ROOT / "deploy/overlays" / overlay)])
    if r.returncode != 0:
        fail(f"kubectl kustomize deploy/overlays/{overlay}: {r.stderr.strip()}")
        return
    kust = {key(o): normal(o) for o in yaml.safe_load_all(r.stdout) if isinstance(o, dict) and o.get("kind") != "Namespace"}
    objs = must_render(f"ci/{overlay}-values.yaml", "-f", values_file(overlay), *extra_args(overlay))
    chart = {key(o): normal(o) for o in objs}
    bad = []
    for k in sorted(set(kust) - set(chart), key=str):
        bad.append(f"{'/'.join(map(str, k))}: only in kustomize")
    for k in sorted(set(chart) - set(kust), key=str):
        bad.append(f"{'/'.join(map(str, k))}: only in helm")
    for k in sorted(set(kust) & set(chart), key=str):
        bad += [f"{'/'.join(map(str, k))}{d}" for d in diff(kust[k], chart[k])[:5]]
    if bad:
        fail(f"ci/{overlay}-values.yaml and deploy/overlays/{overlay} render different objects:\n  " + "\n  ".join(bad))
    else:
        print(f"check-helm: ci/{overlay}-values.yaml renders what deploy/overlays/{overlay} does ({len(chart)} objects)")


def priority_quota(what, objs):
    """Pods of a system priority class outside kube-system need a ResourceQuota admitting it."""
    quotas = {}
    for o in objs:
        if o.get("kind") == "ResourceQuota":
            for e in ((o.get("spec") or {}).get("scopeSelector") or {}).get("matchExpressions") or []:
                if e.get("scopeName") == "PriorityClass" and e.get("operator") == "In":
                    quotas.setdefault((o.get("metadata") or {}).get("namespace"), set()).update(e.get("values") or [])
    for o in objs:
        spec = ((o.get("spec") or {}).get("template") or {}).get("spec") or {}
        cls, ns = spec.get("priorityClassName"), (o.get("metadata") or {}).get("namespace")
        if cls in SYSTEM_CLASSES and ns != "kube-system" and cls not in quotas.get(ns, set()):
            fail(f"{what}: {o['kind']} {ns}/{o['metadata']['name']} runs at {cls} in {ns}, and no ResourceQuota there admits it: GKE makes no pod (\"insufficient quota to match these scopes\")")


def rbac(what, objs):
    r = run([sys.executable, str(ROOT / "scripts/gen-rbac.py"), "--check", "--rendered", "-"], input=yaml.safe_dump_all(objs))
    if r.returncode != 0:
        fail(f"{what}: the RBAC does not follow the flags:\n{r.stderr.strip()}")


def validate(what, objs):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        # kubernetes-validate knows no CRDs: the Prometheus Operator's objects aside.
        yaml.safe_dump_all([o for o in objs if not o.get("apiVersion", "").startswith("monitoring.coreos.com")], f)
        f.flush()
        r = run([sys.executable, "-m", "kubernetes_validate", "-k", "1.30.0", "--strict", "--quiet", f.name])
        if r.returncode != 0:
            fail(f"{what}: not valid against Kubernetes 1.30: {r.stdout.strip()} {r.stderr.strip()}")


def semver(v):
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", v).groups())


def previous(chart, app_version):
    """The chart version before this one (tests/helm/previous/, which the real upgrade
    test installs first): older than this chart, with an upgrade note for this version
    in docs/deploying.md, and this chart's templates rendering with its values.yaml as
    `helm upgrade --reuse-values` renders them (the previous chart's defaults, not this
    one's), for each documented values file."""
    tgz = sorted((ROOT / "tests/helm/previous").glob("faultline-*.tgz"))
    if len(tgz) != 1:
        fail(f"tests/helm/previous holds {len(tgz)} packaged charts, not 1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        with tarfile.open(tgz[0]) as t:
            t.extractall(tmp / "previous", filter="data")
        old = yaml.safe_load((tmp / "previous/faultline/Chart.yaml").read_text())
        expect(f"{tgz[0].name}: older than this chart ({chart['version']})", semver(old["version"]) < semver(chart["version"]), old["version"])
        notes = (ROOT / "docs/deploying.md").read_text().split("### Upgrade notes", 1)[-1]
        if semver(chart["version"]) > semver(old["version"]):
            expect(f"docs/deploying.md: an upgrade note for chart {chart['version']}", f"\n- {chart['version']}:" in notes)
        reused = tmp / "reused"
        shutil.copytree(CHART, reused, symlinks=False)
        shutil.copy(tmp / "previous/faultline/values.yaml", reused / "values.yaml")
        for o in OVERLAYS:
            r = run([HELM, "template", "faultline", str(reused), "--namespace", "faultline", "-f", values_file(o), *extra_args(o)])
            what = f"chart {chart['version']} with {old['version']}'s values.yaml and ci/{o}-values.yaml (helm upgrade --reuse-values)"
            if r.returncode != 0:
                fail(f"{what}: {r.stderr.strip()}")
                continue
            objs = [d for d in yaml.safe_load_all(r.stdout) if isinstance(d, dict)]
            validate(what, objs)
            rbac(what, objs)
            now = must_render(o, "-f", values_file(o), *extra_args(o))
            expect(f"{what}: the same objects as a fresh install", sorted(map(key, objs)) == sorted(map(key, now)))
    print(f"check-helm: {tgz[0].name} upgrades to {chart['version']} with --reuse-values (rendered with its values)")


def find(objs, kind, name=None):
    return [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]


def container(objs, kind):
    return find(objs, kind)[0]["spec"]["template"]["spec"]["containers"][0]


def expect(what, ok, detail=""):
    if not ok:
        fail(f"{what}{': ' + detail if detail else ''}")


def refused(what, args, needle):
    objs, err = template(*args)
    if objs is not None:
        fail(f"{what}: rendered, but the chart must refuse it ({' '.join(args)})")
    elif needle not in err:
        fail(f"{what}: refused, but the message does not say {needle!r}: {err}")


def main():
    global HELM
    HELM = helm_binary()
    print(f"check-helm: {run([HELM, 'version', '--short']).stdout.strip()} ({HELM})")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    expect("Chart.yaml appVersion is the workspace version", chart["appVersion"] == version, f"{chart['appVersion']} != {version}")

    # 1. lint
    for extra in [[]] + [["-f", values_file(o)] for o in OVERLAYS]:
        r = run([HELM, "lint", "--strict", str(CHART), *extra])
        expect(f"helm lint --strict {' '.join(extra)}", r.returncode == 0, r.stdout + r.stderr)

    # 2-4, 7: each documented values file
    for o in OVERLAYS:
        objs = must_render(o, "-f", values_file(o), *extra_args(o))
        validate(f"ci/{o}-values.yaml", objs)
        rbac(f"ci/{o}-values.yaml", objs)
        priority_quota(f"ci/{o}-values.yaml", objs)
        compare(o)
    for d in sorted((ROOT / "deploy/overlays").iterdir()):
        if d.is_dir() and not re.search(r"^kind:\s*Component", (d / "kustomization.yaml").read_text(), re.M):
            r = run(["kubectl", "kustomize", str(d)])
            priority_quota(f"deploy/overlays/{d.name}", [x for x in yaml.safe_load_all(r.stdout) if isinstance(x, dict)])
    features = {
        "--discovery=nodes": ["--set", "aggregator.discovery=nodes"],
        "the canary": ["--set", "remediation.release=auto", "--set-string", "remediation.canary.job=kind: Job"],
        "the canary elsewhere": ["--set", "remediation.release=auto", "--set-string", "remediation.canary.job=kind: Job", "--set", "remediation.canary.namespace=canaries"],
        "pod health": ["--set", "aggregator.watchPodHealth=true"],
        "force delete": ["--set", "dryRun=false", "--set", "remediation.forceDeleteAfterDeadline=true"],
        "publish namespaces and pages": ["--set", "aggregator.publishNamespaces={default,train}", "--set", "aggregator.pages=3", "--set", "aggregator.shards=2"],
    }
    for what, args in features.items():
        objs = must_render(what, *args)
        rbac(what, objs)
        validate(what, objs)

    # 5. the schema and the chart's own validation
    refused("an unknown key", ["--set", "agent.colour=blue"], "colour")
    refused("an unknown top-level key", ["--set", "remediaton.enabled=true"], "remediaton")
    refused("an unknown vendor", ["--set", "vendor=amd"], "vendor")
    refused("no shards", ["--set", "aggregator.shards=0"], "shards")
    refused("a duration without its unit", ["--set", "agent.interval=5"], "interval")
    refused("an unknown discovery", ["--set", "aggregator.discovery=dns"], "discovery")
    refused("a client rate of 0", ["--set", "aggregator.kubeQPS=0"], "kubeQPS")
    refused("enforce without a budget", ["--set", "dryRun=false", "--set", "remediation.budget.maxQuarantined=0"], "maxQuarantined")
    refused("force delete while dry-run", ["--set", "remediation.forceDeleteAfterDeadline=true"], "forceDeleteAfterDeadline")
    refused("Ascend's device info on NVIDIA", ["--set", "remediation.ascendDeviceInfo=true"], "vendor=ascend")
    refused("acting without the aggregator", ["--set", "dryRun=false", "--set", "aggregator.enabled=false"], "aggregator.enabled")
    refused("an older Kubernetes", ["--kube-version", "1.29.0"], "kubeVersion")

    # 6. template tests
    objs = must_render("the defaults")
    agg = container(objs, "Deployment")
    expect("the default remediation is a dry run", "--remediation=dry-run" in agg["args"], str(agg["args"]))
    expect("no monitoring object without its CRD", not find(objs, "ServiceMonitor") and not find(objs, "PodMonitor"))
    expect("the agent's delivery volumes are optional", all(
        (v.get("secret") or v.get("configMap") or {}).get("optional") for v in find(objs, "DaemonSet")[0]["spec"]["template"]["spec"]["volumes"] if v["name"] in ("delivery", "delivery-key")))
    expect("the image tag defaults to the appVersion", container(objs, "DaemonSet")["image"] == f"faultline/agent:{version}")
    local = [o for o in find(objs, "Service") if o["spec"].get("internalTrafficPolicy") == "Local"]
    expect("a node-local Service to the agents' fault port", local and local[0]["spec"]["ports"][0]["targetPort"] == "fault", str(local))
    cr = find(objs, "ClusterRole")[0]
    nodes = next(r for r in cr["rules"] if r["resources"] == ["nodes"])
    expect("a watch of the Nodes (the quarantined ones, for remediation)", "watch" in nodes["verbs"], str(nodes))
    expect("no Jobs without a canary", not any("jobs" in r["resources"] for o in find(objs, "Role") for r in o["rules"]))
    objs = must_render("another release name", release="gpu", namespace="health")
    agg = container(objs, "Deployment")
    expect("another release: its own --name", "--name=gpu-faultline" in agg["args"], str(agg["args"]))
    expect("another release: its agents' Service", "--agent-service=gpu-faultline-agent" in agg["args"], str(agg["args"]))
    pub = find(objs, "Role", "gpu-faultline-publisher")
    expect("another release: its shard ConfigMaps by name", pub and "gpu-faultline-shard-0" in pub[0]["rules"][0]["resourceNames"], str(pub))
    rbac("another release name", objs)
    objs = must_render("extras", "--set", "aggregator.extraArgs={--kube-timeout=10s}", "--set", "aggregator.kubeQPS=20", "--set", "aggregator.kubeBurst=40", "--set", "agent.extraEnv[0].name=RUST_LOG", "--set", "agent.extraEnv[0].value=debug",
                       "--set", "aggregator.lease.duration=20s", "--set", "remediation.budget.maxQuarantined=3", "--set", "remediation.deviceQuarantine=off")
    agg = container(objs, "Deployment")
    for flag in ("--kube-timeout=10s", "--kube-qps=20", "--kube-burst=40", "--lease-duration=20s", "--max-quarantined=3", "--device-quarantine=off"):
        expect(f"extras: {flag}", flag in agg["args"], str(agg["args"]))
    expect("extras: the agent's env", any(e.get("name") == "RUST_LOG" for e in container(objs, "DaemonSet")["env"]))
    objs = must_render("monitoring with its CRD", "--api-versions", MONITORING, "--set", "metrics.serviceMonitor.enabled=true",
                       "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.grafanaDashboard.enabled=true")
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        expect(f"monitoring: a {kind}", len(find(objs, kind)) == 1)
    rules = find(objs, "PrometheusRule")
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/faultline-rules.yaml").read_text())
    expect("monitoring: the PrometheusRule carries the shipped rules", rules and rules[0]["spec"] == shipped)
    dash = [o for o in find(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    expect("monitoring: the dashboard", dash and json.loads(dash[0]["data"]["faultline-dashboard.json"]).get("title"))
    for choice, flag in (("auto", None), ("dra", "dra"), ("devicePlugin", "device-plugin"), ("off", "off")):
        objs = must_render(f"deviceQuarantine={choice}", "--set", f"remediation.deviceQuarantine={choice}")
        args = [a for a in container(objs, "Deployment")["args"] if a.startswith("--device-quarantine")]
        expect(f"deviceQuarantine={choice}: the flag", args == ([f"--device-quarantine={flag}"] if flag else []), str(args))
        dra = [r for o in find(objs, "ClusterRole") for r in o["rules"] if "resource.k8s.io" in r["apiGroups"]]
        expect(f"deviceQuarantine={choice}: resource.k8s.io granted only when not off", bool(dra) == (choice != "off"), str(dra))
        rbac(f"deviceQuarantine={choice}", objs)
    objs = must_render("the agent alone", "--set", "aggregator.enabled=false")
    expect("the agent alone: no aggregator, no RBAC", not find(objs, "Deployment") and not find(objs, "ClusterRole") and find(objs, "DaemonSet"))

    previous(chart, version)

    if failures:
        print(f"check-helm: {len(failures)} failed", file=sys.stderr)
        return 1
    print("check-helm: the chart lints, validates, agrees with kustomize and refuses what it must")
    return 0


if __name__ == "__main__":
    sys.exit(main())
