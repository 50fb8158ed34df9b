#!/usr/bin/env python3
"""The aggregator's RBAC follows its flags. Needs python3 with PyYAML (a dependency of
kubernetes-validate) and kubectl (for `kubectl kustomize`).

    scripts/gen-rbac.py                  print the publisher Roles deploy/base/aggregator.yaml's flags need
    scripts/gen-rbac.py --write          rewrite them there (between the gen-rbac.py markers;
                                         --base FILE: another base file)
    scripts/gen-rbac.py DIR              an overlay whose flags differ: print the patches it needs
    scripts/gen-rbac.py --write DIR      write them to DIR/publisher-rbac.yaml (patches) and
                                         DIR/publisher-roles.yaml (new namespaces), listed in
                                         DIR/kustomization.yaml (lines marked "# gen-rbac.py")
    scripts/gen-rbac.py --check [DIR...] exit 1 unless each rendered DIR grants what its
                                         Deployment's flags need, naming the command that fixes
                                         it (default: deploy/base and every overlay)
    scripts/gen-rbac.py --self-test      shows --check failing on a resized overlay, a moved
                                         publish namespace, a flag without its component and a
                                         component's rule without its flag, and --write fixing each

What the flags need (aggregator/src/config/args.rs; the names: common/src/fault.rs page_name):

- in each --publish-namespaces entry other than --namespace (with --sink configmap): get
  and update on exactly the ConfigMaps <name>-shard-<i> (0 <= i < --shards) and
  <name>-shard-<i>-page-<p> (1 <= p < --pages), create on ConfigMaps (create names no
  object) and patch on pods (nudges): a name too few is a 403 on a write, one too many a
  grant nobody uses;
- in --namespace: get, create and update on ConfigMaps (every shard page, <name>-breaker
  and <name>-budget, the budget's ledger);
- ConfigMaps nowhere else and never cluster-wide (on EKS that includes kube-system/aws-auth);
- watch on pods cluster-wide exactly when --watch-pod-health=true (deploy/components/pod-health),
  delete on pods exactly when --force-delete-after-deadline=true (deploy/components/force-delete);
- get (only) on ConfigMaps in kube-system exactly when --ascend-device-info=true
  (deploy/components/ascend-device-plugin: Huawei's device plugin's per-node ConfigMaps);
- watch on Nodes always (remediation's passes read the quarantined Nodes from one watch of
  the labelled ones), and with --discovery=nodes (deploy/components/node-discovery);
- create on Jobs and on ResourceClaims in --canary-namespace (default --namespace) exactly
  when a canary runs: --release=auto with --canary-job (deploy/components/canary).

--check also takes rendered manifests (--rendered FILE, `-` for stdin): the Helm chart's
`helm template` output is judged by the same rules (scripts/check-helm.py).

Flags are read from the container's args (`--flag=value` or `--flag value`, the last one
wins), then its env (FAULTLINE_*, plain values), then the aggregator's defaults.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover
    sys.exit("gen-rbac: needs PyYAML (python3 -m pip install kubernetes-validate brings it)")

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE_FILE = ROOT / "deploy/base/aggregator.yaml"
ME = "scripts/gen-rbac.py"
DEPLOYMENT = "faultline-aggregator"
PUBLISHER = "faultline-publisher"
BEGIN = "# gen-rbac.py begin"
END = "# gen-rbac.py end"
MARK = "# gen-rbac.py"
PATCH_FILE = "publisher-rbac.yaml"
ROLES_FILE = "publisher-roles.yaml"
RBAC = "rbac.authorization.k8s.io"
# flag: (environment variable, default), as aggregator/src/config/args.rs declares them.
FLAGS = {
    "sink": ("FAULTLINE_SINK", "file"),
    "namespace": ("FAULTLINE_NAMESPACE", "faultline"),
    "publish-namespaces": ("FAULTLINE_PUBLISH_NAMESPACES", ""),
    "name": ("FAULTLINE_NAME", "faultline"),
    "shards": ("FAULTLINE_SHARDS", "1"),
    "pages": ("FAULTLINE_PAGES", "1"),
    "watch-pod-health": ("FAULTLINE_WATCH_POD_HEALTH", "false"),
    "force-delete-after-deadline": ("FAULTLINE_FORCE_DELETE_AFTER_DEADLINE", "false"),
    "ascend-device-info": ("FAULTLINE_ASCEND_DEVICE_INFO", "false"),
    "discovery": ("FAULTLINE_DISCOVERY", "endpoints"),
    "release": ("FAULTLINE_RELEASE", "manual"),
    "canary-job": ("FAULTLINE_CANARY_JOB", ""),
    "canary-namespace": ("FAULTLINE_CANARY_NAMESPACE", ""),
}
# Flags whose value (not a switch) needs rules: (what needs them, the rules as
# (verb, resource, group), where: "cluster" or the namespace flag they land in, component).
NODE_DISCOVERY = "deploy/components/node-discovery"
CANARY = "deploy/components/canary"
COMPONENT = {
    "watch-pod-health": ("watch", "deploy/components/pod-health"),
    "force-delete-after-deadline": ("delete", "deploy/components/force-delete"),
}
# A feature reading ConfigMaps of another namespace: (namespace, its only verb, component).
# Huawei's device plugin's per-node ConfigMaps carry the node's name, so they cannot be
# named in advance: get on every ConfigMap there, and nothing else.
FOREIGN = {
    "ascend-device-info": ("kube-system", "get", "deploy/components/ascend-device-plugin"),
}
CONFIGMAP_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


class Failure(Exception):
    pass


def page_name(name, shard, page):
    """common/src/fault.rs page_name."""
    return f"{name}-shard-{shard}" if page == 0 else f"{name}-shard-{shard}-page-{page}"


def shown(path):
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(pathlib.Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ---- reading manifests -------------------------------------------------------------


def load(text):
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def render(target):
    r = subprocess.run(["kubectl", "kustomize", str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure(f"kubectl kustomize {shown(target)}: {r.stderr.strip()}")
    return load(r.stdout)


def meta(o, key):
    return (o.get("metadata") or {}).get(key) or ""


def find(objs, kind, name=None, namespace=None):
    return [
        o
        for o in objs
        if o.get("kind") == kind
        and (name is None or meta(o, "name") == name)
        and (namespace is None or meta(o, "namespace") == namespace)
    ]


class Need:
    """What the aggregator Deployment's flags need."""

    def __init__(self, deploy):
        spec = deploy["spec"]["template"]["spec"]
        containers = spec.get("containers") or []
        c = next((c for c in containers if c.get("name") == "aggregator"), containers[0])
        self.sa = (meta(deploy, "namespace") or "default", spec.get("serviceAccountName") or "default")
        values = {k: d for k, (_, d) in FLAGS.items()}
        by_env = {e: k for k, (e, _) in FLAGS.items()}
        for e in c.get("env") or []:
            if e.get("name") in by_env:
                if "value" not in e:
                    raise Failure(f"env {e['name']} is not a plain value: cannot tell what it needs")
                values[by_env[e["name"]]] = str(e["value"])
        words = list((c.get("command") or [])[1:]) + list(c.get("args") or [])
        i = 0
        while i < len(words):
            w = str(words[i])
            i += 1
            if not w.startswith("--"):
                continue
            key, eq, value = w[2:].partition("=")
            if key in FLAGS:
                if not eq:
                    if i >= len(words):
                        raise Failure(f"--{key} has no value")
                    value, i = str(words[i]), i + 1
                values[key] = value
        self.flags = values
        self.name = values["name"]
        self.namespace = values["namespace"]
        self.sink = values["sink"]
        try:
            self.shards, self.pages = int(values["shards"]), int(values["pages"])
        except ValueError:
            raise Failure(f"--shards={values['shards']} --pages={values['pages']}: not numbers")
        if not 1 <= self.shards <= 1024 or not 1 <= self.pages <= 16:
            raise Failure(f"--shards={self.shards} --pages={self.pages}: the aggregator refuses them (1-1024, 1-16)")
        self.publish = []
        if self.sink == "configmap":
            for ns in values["publish-namespaces"].split(","):
                ns = ns.strip()
                if ns and ns != self.namespace and ns not in self.publish:
                    self.publish.append(ns)
        self.discovery = values["discovery"]
        if self.discovery not in ("endpoints", "nodes"):
            raise Failure(f"--discovery={self.discovery}: the aggregator takes endpoints or nodes")
        self.canary = values["release"] == "auto" and values["canary-job"] != ""
        self.canary_namespace = values["canary-namespace"] or self.namespace
        self.feature = {}
        for flag in list(COMPONENT) + list(FOREIGN):
            v = values[flag]
            if v not in ("true", "false"):
                raise Failure(f"--{flag}={v}: the aggregator takes true or false")
            self.feature[flag] = v == "true"

    def names(self):
        return [page_name(self.name, s, p) for s in range(self.shards) for p in range(self.pages)]

    def key(self):
        return (self.name, self.shards, self.pages, self.namespace, tuple(self.publish), self.sa)

    def describe(self):
        return (
            f"--name={self.name} --shards={self.shards} --pages={self.pages} "
            f"--namespace={self.namespace} --publish-namespaces={','.join(self.publish) or '(none)'}"
        )

    def rules(self):
        return [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": self.names(), "verbs": ["get", "update"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        ]

    def binding(self):
        return {
            "subjects": [{"kind": "ServiceAccount", "name": self.sa[1], "namespace": self.sa[0]}],
            "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": PUBLISHER},
        }


def need_of(objs):
    deploys = find(objs, "Deployment", DEPLOYMENT)
    if not deploys:
        # Another name (a Helm release's): the Deployment running the aggregator container.
        deploys = [
            d for d in find(objs, "Deployment")
            if any(c.get("name") == "aggregator" for c in d["spec"]["template"]["spec"].get("containers") or [])
        ]
    if len(deploys) != 1:
        raise Failure(f"{len(deploys)} Deployments named {DEPLOYMENT}")
    try:
        return Need(deploys[0])
    except (KeyError, IndexError, TypeError) as e:
        raise Failure(f"the {DEPLOYMENT} Deployment has no aggregator container to read flags from ({e!r})")


# ---- what the rendered RBAC grants (rbac/v1 evaluation_helpers.go) ------------------


def binds(binding, sa):
    ns, name = sa
    for s in binding.get("subjects") or []:
        kind, sname = s.get("kind"), s.get("name")
        if kind == "ServiceAccount" and sname == name and (s.get("namespace") or meta(binding, "namespace")) == ns:
            return True
        if kind == "User" and sname == f"system:serviceaccount:{ns}:{name}":
            return True
        if kind == "Group" and sname in ("system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"):
            return True
    return False


def rules_for(objs, sa, namespace=None, cluster=True):
    """The rules bound to `sa`: cluster-wide ones (`cluster`), and those of `namespace`."""
    out = []
    roles = lambda kind, ns, name: [r for o in find(objs, kind, name, ns) for r in o.get("rules") or []]
    if cluster:
        for b in find(objs, "ClusterRoleBinding"):
            ref = b.get("roleRef") or {}
            if binds(b, sa) and ref.get("kind") == "ClusterRole":
                out += roles("ClusterRole", None, ref.get("name"))
    if namespace is not None:
        for b in find(objs, "RoleBinding", namespace=namespace):
            ref = b.get("roleRef") or {}
            if binds(b, sa):
                if ref.get("kind") == "Role":
                    out += roles("Role", namespace, ref.get("name"))
                elif ref.get("kind") == "ClusterRole":
                    out += roles("ClusterRole", None, ref.get("name"))
    return out


def granted(rules, verb, resource, group=""):
    """The names `verb` is granted on (None: every name; an empty set: none)."""
    names, every = set(), False
    for r in rules:
        if (
            any(v in (verb, "*") for v in r.get("verbs") or [])
            and any(g in (group, "*") for g in r.get("apiGroups") or [])
            and any(x in (resource, "*") for x in r.get("resources") or [])
        ):
            if r.get("resourceNames"):
                names |= set(r["resourceNames"])
            else:
                every = True
    return None if every else names


def listed(names, most=6):
    names = sorted(names)
    more = f", ... ({len(names)} in all)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def problems(objs):
    """(problems with the ConfigMap names, problems with the features' rules), each a line."""
    need = need_of(objs)
    names, sa = set(need.names()), need.sa
    by_name, by_feature = [], []
    cluster = rules_for(objs, sa)
    for verb in ("get", "create", "update", "list", "watch", "patch", "delete"):
        if granted(cluster, verb, "configmaps") != set():
            by_name.append(f"{verb} on ConfigMaps cluster-wide (never: on EKS that includes kube-system/aws-auth)")
    own = rules_for(objs, sa, need.namespace)
    for verb in ("get", "update") if need.sink == "configmap" else ():
        g = granted(own, verb, "configmaps")
        missing = set() if g is None else (names | {f"{need.name}-breaker", f"{need.name}-budget"}) - g
        if missing:
            by_name.append(f"{verb} on ConfigMaps in --namespace {need.namespace} lacks {listed(missing)}")
    if need.sink == "configmap" and granted(own, "create", "configmaps") is not None:
        by_name.append(f"create on ConfigMaps in --namespace {need.namespace} is not granted")
    for ns in need.publish:
        if not rules_for(objs, sa, ns, cluster=False):
            by_name.append(f"no Role in publish namespace {ns}: every write there is a 403")
            continue
        rules = rules_for(objs, sa, ns)
        for verb in ("get", "update"):
            g = granted(rules, verb, "configmaps")
            if g is None:
                by_name.append(f"{verb} on every ConfigMap in {ns}: the shards' pages must be named")
                continue
            if names - g:
                by_name.append(f"{verb} on ConfigMaps in {ns} lacks {listed(names - g)} (403 on writing them)")
            if g - names:
                by_name.append(f"{verb} on ConfigMaps in {ns} names {listed(g - names)}, which {need.describe()} never writes")
        if granted(rules, "create", "configmaps") is not None:
            by_name.append(f"create on ConfigMaps in {ns} is not granted")
        if granted(rules, "patch", "pods") is not None:
            by_name.append(f"patch on pods in {ns} (nudges) is not granted")
    others = {meta(b, "namespace") for b in find(objs, "RoleBinding") if binds(b, sa)}
    foreign = {ns: flag for flag, (ns, _, _) in FOREIGN.items()}
    for flag, (ns, verb, component) in FOREIGN.items():
        if ns in set(need.publish) | {need.namespace}:
            if need.feature[flag]:
                by_feature.append(f"--{flag}=true with {ns} as --namespace or a publish namespace: its ConfigMaps there are named ones; keep {ns} for {component} alone")
            continue
        rules = rules_for(objs, sa, ns, cluster=False) if ns in others else []
        extra = [v for v in CONFIGMAP_VERBS if v != verb and granted(rules, v, "configmaps") != set()]
        # Nothing but that verb on ConfigMaps of the core group: no other resource (a
        # Secret of kube-system), no wildcard, no other group.
        wider = sorted({
            f"{'/'.join(r.get('apiGroups') or [])}:{x}"
            for r in rules
            for x in r.get("resources") or []
            if x != "configmaps" or (r.get("apiGroups") or []) != [""]
        })
        if wider:
            by_feature.append(f"rules in {ns} grant more than ConfigMaps ({', '.join(wider)}): {component} grants {verb} on ConfigMaps only")
        if need.feature[flag]:
            if granted(rules, verb, "configmaps") is not None:
                by_feature.append(f"--{flag}=true without {verb} on ConfigMaps in {ns}: use {component} (the flag and its rule), not the flag alone")
            if extra:
                by_feature.append(f"{', '.join(extra)} on ConfigMaps in {ns}: --{flag} needs {verb} only ({component})")
        elif granted(rules, verb, "configmaps") != set() or extra:
            by_feature.append(f"ConfigMaps in {ns} are granted but --{flag} is not true: drop that rule, or add {component} (flag and rule together)")
    for ns in sorted(others - set(need.publish) - {need.namespace} - set(foreign)):
        rules = rules_for(objs, sa, ns, cluster=False)
        if any(granted(rules, v, "configmaps") != set() for v in ("get", "update", "create")):
            by_name.append(f"ConfigMaps in {ns}, which --publish-namespaces does not name ({need.describe()})")
    for flag, (verb, component) in COMPONENT.items():
        g = granted(cluster, verb, "pods")
        if need.feature[flag] and g is not None:
            by_feature.append(f"--{flag}=true without {verb} on pods cluster-wide: use {component} (the flag and its rule), not the flag alone")
        if need.feature[flag] and flag == "watch-pod-health" and granted(cluster, "list", "pods") is not None:
            by_feature.append(f"--{flag}=true without list on pods cluster-wide: use {component}")
        if g != set() and not need.feature[flag]:
            by_feature.append(f"{verb} on pods is granted but --{flag} is not true: drop that rule, or add {component} (flag and rule together)")
    watch = granted(cluster, "watch", "nodes") != set()
    if need.discovery == "nodes" and not watch:
        by_feature.append(f"--discovery=nodes without watch on Nodes: use {NODE_DISCOVERY} (the flag and its rule), not the flag alone")
    there = rules_for(objs, sa, need.canary_namespace)
    for resource, group in (("jobs", "batch"), ("resourceclaims", "resource.k8s.io")):
        g = granted(there, "create", resource, group) != set()
        if need.canary and not g:
            by_feature.append(f"--canary-job with --release=auto without create on {resource} in {need.canary_namespace}: use {CANARY} (the flags and the rule), not the flags alone")
        if not need.canary and g:
            by_feature.append(f"create on {resource} in {need.canary_namespace} is granted but no canary runs (--release=auto with --canary-job): drop that rule, or add {CANARY}")
    return need, by_name, by_feature


# ---- generating --------------------------------------------------------------------

PLAIN = re.compile(r"[a-z][a-z0-9.-]*")
RESERVED = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}


def q(s):
    return s if PLAIN.fullmatch(s) and s not in RESERVED else json.dumps(s)


def flow(items, indent, first):
    """A YAML flow list, wrapped under `indent` when it would pass 100 columns."""
    one = "[" + ", ".join(q(i) for i in items) + "]"
    if first + len(one) <= 100:
        return one
    lines, line = [], " " * indent
    for i in items:
        word = q(i) + ","
        if len(line) + len(word) + 1 > 100 and line.strip():
            lines.append(line.rstrip())
            line = " " * indent
        line += word + " "
    return "[\n" + "\n".join(lines + [line.rstrip()[:-1] + "]"])


def meta_text(ns, labels):
    extra = ", labels: {app.kubernetes.io/part-of: faultline}" if labels else ""
    return f"metadata: {{name: {PUBLISHER}, namespace: {q(ns)}{extra}}}\n"


def role_text(need, ns, labels=False):
    head = "    resourceNames: "
    return (
        f"apiVersion: {RBAC}/v1\nkind: Role\n"
        + meta_text(ns, labels)
        + "rules:\n"
        + f"  # --shards {need.shards} x --pages {need.pages} of --name {need.name}: the ConfigMaps written here\n"
        + "  - apiGroups: [\"\"]\n    resources: [configmaps]\n"
        + head + flow(need.names(), 6, len(head)) + "\n"
        + "    verbs: [get, update]\n"
        + "  - apiGroups: [\"\"]\n    resources: [configmaps]\n"
        + "    verbs: [create]                           # create names no object: no resourceNames\n"
        + "  - apiGroups: [\"\"]\n    resources: [pods]\n    verbs: [patch]\n"
    )


def binding_text(need, ns, labels=False):
    sa_ns, sa = need.sa
    return (
        f"apiVersion: {RBAC}/v1\nkind: RoleBinding\n"
        + meta_text(ns, labels)
        + f"subjects: [{{kind: ServiceAccount, name: {q(sa)}, namespace: {q(sa_ns)}}}]\n"
        + f"roleRef: {{apiGroup: {RBAC}, kind: Role, name: {PUBLISHER}}}\n"
    )


def base_docs(need):
    return "---\n".join(role_text(need, ns) + "---\n" + binding_text(need, ns) for ns in need.publish)


def write_base(path):
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    begin = [i for i, l in enumerate(lines) if l.startswith(BEGIN)]
    end = [i for i, l in enumerate(lines) if l.startswith(END)]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise Failure(f"{shown(path)}: wants one '{BEGIN}' line and one '{END}' line after it")
    b = begin[0] + 1
    while b < end[0] and lines[b].startswith("#"):
        b += 1
    need = need_of(load(text))
    new = "".join(lines[:b]) + base_docs(need) + "".join(lines[end[0]:])
    if new != text:
        path.write_text(new)
    return need, new != text


def is_base(target):
    f = pathlib.Path(target) / "aggregator.yaml"
    return f.is_file() and BEGIN in f.read_text()


def base_command(target):
    f = pathlib.Path(target) / "aggregator.yaml"
    if f.resolve() == BASE_FILE.resolve():
        return f"{ME} --write"
    return f"{ME} --write --base {shown(f)}"


def kustomization(target):
    for n in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (pathlib.Path(target) / n).is_file():
            return pathlib.Path(target) / n
    raise Failure(f"{shown(target)}: no kustomization.yaml")


def unmarked(text):
    """A kustomization's text without the lines this script added (ending in the mark)."""
    return "".join(l for l in text.splitlines(keepends=True) if not l.rstrip().endswith(MARK))


def upstream(target):
    """`target` rendered without the files this script wrote there."""
    target = pathlib.Path(target).resolve()
    tmp = target.parent / f".{target.name}.gen-rbac-{os.getpid()}"
    try:
        shutil.copytree(target, tmp)
        k = kustomization(tmp)
        k.write_text(unmarked(k.read_text()))
        return render(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def delete_line(ns):
    """A patches entry deleting the publisher Role and RoleBinding of `ns` (its target
    matches both; one entry per namespace, as kustomize 5.5 panics on a second
    `$patch: delete` in one patch file). The body's kind and name yield to the target."""
    body = json.dumps({"$patch": "delete", "apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": {"name": PUBLISHER}})
    return f"{{target: {{group: {RBAC}, name: {PUBLISHER}, namespace: {q(ns)}}}, patch: '{body}'}}"


def overlay_files(target):
    """The text of publisher-rbac.yaml (patches) and publisher-roles.yaml (resources),
    and the publish namespaces whose Role and RoleBinding go."""
    objs = upstream(target)
    need = need_of(objs)
    roles = {meta(o, "namespace"): o for o in find(objs, "Role", PUBLISHER)}
    rbs = {meta(o, "namespace"): o for o in find(objs, "RoleBinding", PUBLISHER)}
    patches, resources = [], []
    for ns in need.publish:
        if ns not in roles:
            resources.append(role_text(need, ns, labels=True))
        elif roles[ns].get("rules") != need.rules():
            patches.append(role_text(need, ns))
        want = need.binding()
        if ns not in rbs:
            resources.append(binding_text(need, ns, labels=True))
        elif {k: rbs[ns].get(k) for k in want} != want:
            patches.append(binding_text(need, ns))
    gone = sorted((set(roles) | set(rbs)) - set(need.publish))
    head = (
        f"# Generated by {ME} from this overlay's aggregator flags ({need.describe()}).\n"
        f"# Do not edit: change the flags, then run {ME} --write {shown(target)}\n"
    )
    return (
        need,
        (head + "---\n".join(patches)) if patches else None,
        (head + "---\n".join(resources)) if resources else None,
        gone,
    )


def refer(k, key, item):
    """List `item` (marked) under the top-level `key` of kustomization file `k`."""
    lines = k.read_text().splitlines()
    at = next((i for i, l in enumerate(lines) if re.match(rf"{key}:\s*(\[\s*\])?\s*(#.*)?$", l)), None)
    if at is None:
        lines += [f"{key}:", f"  - {item}  {MARK}"]
    else:
        lines[at] = re.sub(r"\[\s*\]", "", lines[at], count=1)
        nxt = next((l for l in lines[at + 1:] if l.strip() and not l.lstrip().startswith("#")), "")
        m = re.match(r"(\s*)- ", nxt)
        lines.insert(at + 1, f"{m.group(1) if m else '  '}- {item}  {MARK}")
    k.write_text("\n".join(lines) + "\n")


def write_overlay(target):
    target = pathlib.Path(target)
    need, patches, resources, gone = overlay_files(target)
    k = kustomization(target)
    k.write_text(unmarked(k.read_text()))
    for name, text, key, item in (
        (PATCH_FILE, patches, "patches", f"path: {PATCH_FILE}"),
        (ROLES_FILE, resources, "resources", ROLES_FILE),
    ):
        if text is None:
            (target / name).unlink(missing_ok=True)
        else:
            (target / name).write_text(text)
            refer(k, key, item)
    for ns in gone:
        refer(k, "patches", delete_line(ns))
    return need


# ---- checking ----------------------------------------------------------------------


def parents(target):
    """The local kustomize directories `target` lists under resources."""
    data = yaml.safe_load(kustomization(target).read_text()) or {}
    return [pathlib.Path(target) / r for r in data.get("resources") or [] if (pathlib.Path(target) / r).is_dir()]


def fix_for(target, need):
    """The command that fixes `target`'s names: where its flags come from (an overlay
    that only inherits them from a wrong base is fixed in that base)."""
    for up in parents(target):
        try:
            up_need, by_name, _ = problems(render(up))
        except (Failure, KeyError, IndexError):
            continue
        if by_name and up_need.key() == need.key():
            return fix_for(up, need)
    return base_command(target) if is_base(target) else f"{ME} --write {shown(target)}"


def check(target, objs=None):
    """Lines to print; empty when `target` renders the RBAC its flags need (`objs`: the
    objects already rendered, e.g. by `helm template`)."""
    need, by_name, by_feature = problems(render(target) if objs is None else objs)
    label = shown(target)
    out = [f"gen-rbac: {label}: {p}" for p in by_name + by_feature]
    if by_name:
        out.append(f"gen-rbac: {label}: ConfigMap names follow {need.describe()}; fix: {fix_for(target, need)}")
    if by_feature:
        out.append(f"gen-rbac: {label}: a feature's flag and its RBAC come together: add or remove the component, not the flag or the rule alone")
    return out


def default_targets():
    out = [ROOT / "deploy/base"]
    for d in sorted((ROOT / "deploy/overlays").iterdir()):
        if d.is_dir() and not re.search(r"^kind:\s*Component", kustomization(d).read_text(), re.M):
            out.append(d)
    return out


def run_check(targets):
    failed = False
    for t in targets or default_targets():
        try:
            lines = check(t)
        except Failure as e:
            lines = [f"gen-rbac: {shown(t)}: {e}"]
        for l in lines:
            print(l, file=sys.stderr)
        if lines:
            failed = True
        else:
            need = need_of(render(t))
            feats = ", ".join(f"--{f}=true" for f, on in need.feature.items() if on) or "no optional features"
            print(f"gen-rbac: {shown(t)}: RBAC follows the flags ({need.describe()}; {feats})")
    return 1 if failed else 0


# ---- the self-test -----------------------------------------------------------------

# A base of its own (the shape of deploy/base/aggregator.yaml, known flags), so the
# self-test proves the same whatever deploy/ is sized for today.
FIXTURE = """apiVersion: v1
kind: ServiceAccount
metadata: {name: faultline-aggregator, namespace: faultline}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: faultline-aggregator, namespace: faultline}
rules:
  - apiGroups: [""]
    resources: [configmaps]
    verbs: [get, create, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: faultline-aggregator, namespace: faultline}
subjects: [{kind: ServiceAccount, name: faultline-aggregator, namespace: faultline}]
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: faultline-aggregator}
---
# gen-rbac.py begin: the self-test's fixture
# gen-rbac.py end
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: faultline-aggregator}
rules:
  - apiGroups: [""]
    resources: [pods]
    verbs: [list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: faultline-aggregator}
subjects: [{kind: ServiceAccount, name: faultline-aggregator, namespace: faultline}]
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: faultline-aggregator}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: faultline-aggregator, namespace: faultline}
spec:
  selector:
    matchLabels: {app: a}
  template:
    metadata:
      labels: {app: a}
    spec:
      serviceAccountName: faultline-aggregator
      containers:
        - name: aggregator
          image: faultline/aggregator:0.1.0
          args:
            - --sink=configmap
            - --namespace=faultline
            - --shards=4                       # args/2
            - --publish-namespaces=default     # args/3
            # - --pages=2
            - --remediation=dry-run
"""


def self_test():
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gen-rbac-"))
    results = []

    def expect(what, ok, detail=""):
        results.append(bool(ok))
        print(f"gen-rbac self-test: {'ok  ' if ok else 'FAIL'} {what}" + ("" if ok else f"\n    {detail}"))

    def overlay(name, resources=("../base",), components=(), args_patch=None, copy_files=()):
        d = tmp / name
        d.mkdir()
        for f in copy_files:
            shutil.copy(ROOT / f, d / pathlib.Path(f).name)
        text = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n"
        text += "".join(f"  - {r}\n" for r in resources)
        if components:
            text += "components:\n" + "".join(f"  - {os.path.relpath(ROOT / c, d)}\n" for c in components)
        if args_patch:
            text += "patches:\n  - target: {kind: Deployment, name: faultline-aggregator}\n    patch: |-\n"
            text += "".join(f"      {l}\n" for l in args_patch)
        (d / "kustomization.yaml").write_text(text)
        return d

    def fails_with(d, *needles):
        text = "\n".join(check(d))
        return bool(text) and all(n in text for n in needles), text

    def passes(d):
        lines = check(d)
        return not lines, "\n".join(lines)

    def validate(d):
        try:
            import kubernetes_validate  # noqa: F401
        except ImportError:
            return True, "kubernetes-validate missing: not validated"
        f = tmp / "rendered.yaml"
        f.write_text(subprocess.run(["kubectl", "kustomize", str(d)], capture_output=True, text=True, check=True).stdout)
        r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "-k", "1.30.0", "--strict", "--quiet", str(f)], capture_output=True, text=True)
        return r.returncode == 0, r.stdout + r.stderr

    def publisher_names(d, ns):
        return [n for o in find(render(d), "Role", PUBLISHER, ns) for r in o["rules"] for n in r.get("resourceNames") or []]

    at = "/spec/template/spec/containers/0/args"
    arg = lambda i, old, new: [f"- {{op: test, path: {at}/{i}, value: {json.dumps(old)}}}", f"- {{op: replace, path: {at}/{i}, value: {json.dumps(new)}}}"]
    add = lambda a: [f"- {{op: add, path: {at}/-, value: {json.dumps(a)}}}"]
    try:
        base = tmp / "base"
        base.mkdir()
        (base / "aggregator.yaml").write_text(FIXTURE)
        (base / "kustomization.yaml").write_text("resources: [aggregator.yaml]\n")
        expect("the fixture without its publisher Role fails", *fails_with(base, "no Role in publish namespace default", f"--write --base {shown(base / 'aggregator.yaml')}"))
        write_base(base / "aggregator.yaml")
        expect("--write --base gives it the 4 names of --shards=4", passes(base)[0] and publisher_names(base, "default") == [f"faultline-shard-{i}" for i in range(4)], passes(base)[1])

        # 1. Resized (6 shards of 2 pages) without regenerating: --check fails, naming the command.
        d = overlay("sized", args_patch=arg(2, "--shards=4", "--shards=6") + add("--pages=2"))
        r = subprocess.run([sys.executable, __file__, "--check", str(d)], capture_output=True, text=True)
        expect(
            "a resized overlay fails --check (exit 1), naming the command that fixes it",
            r.returncode == 1 and "lacks faultline-shard-0-page-1" in r.stderr and f"fix: {ME} --write {shown(d)}" in r.stderr,
            r.stderr,
        )
        d2 = overlay("sized-child", resources=["../sized"])
        expect("an overlay inheriting those flags is sent to the same fix", *fails_with(d2, f"fix: {ME} --write {shown(d)}"))
        write_overlay(d)
        ok, why = passes(d)
        want = [page_name("faultline", s, p) for s in range(6) for p in range(2)]
        expect("--write on it makes --check pass, with the 12 names the binary writes", ok and publisher_names(d, "default") == want, why)
        expect("... and the overlay inheriting them too", *passes(d2))
        before = {f.name: f.read_text() for f in d.iterdir()}
        write_overlay(d)
        expect("--write again changes nothing", before == {f.name: f.read_text() for f in d.iterdir()})
        expect("the resized overlay validates against 1.30", *validate(d))

        # 2. Fewer shards than the Role names: the names nobody writes are refused too.
        d = overlay("smaller", args_patch=arg(2, "--shards=4", "--shards=2"))
        expect("fewer shards than the Role names fails", *fails_with(d, "names faultline-shard-2, faultline-shard-3"))

        # 3. Publish namespaces moved: default dropped, two new ones; then moved back.
        d = overlay("moved", args_patch=arg(3, "--publish-namespaces=default", "--publish-namespaces=training,team-b"))
        expect("moved publish namespaces fail", *fails_with(d, "no Role in publish namespace training", "ConfigMaps in default, which --publish-namespaces does not name"))
        write_overlay(d)
        ok, why = passes(d)
        expect("--write adds their Roles and deletes default's", ok and not publisher_names(d, "default") and len(publisher_names(d, "team-b")) == 4, why)
        expect("that overlay validates against 1.30", *validate(d))
        k = d / "kustomization.yaml"
        k.write_text(k.read_text().replace("--publish-namespaces=training,team-b", "--publish-namespaces=default"))
        write_overlay(d)
        ok, why = passes(d)
        expect("moved back, --write removes what it wrote", ok and unmarked(k.read_text()) == k.read_text() and not (d / PATCH_FILE).exists() and not (d / ROLES_FILE).exists(), why)

        # 4. A feature's flag without its component, and a component's rule without its flag.
        for flag, component in (("--watch-pod-health=true", "pod-health"), ("--force-delete-after-deadline=true", "force-delete"), ("--ascend-device-info=true", "ascend-device-plugin")):
            d = overlay(f"flag-{component}", args_patch=add(flag))
            expect(f"{flag} alone fails, naming deploy/components/{component}", *fails_with(d, f"use deploy/components/{component}"))
            d = overlay(f"rule-{component}", resources=["../base", "rbac.yaml"], copy_files=[f"deploy/components/{component}/rbac.yaml"])
            expect(f"deploy/components/{component}'s rule without its flag fails", *fails_with(d, "is not true: drop that rule"))

        # ... the flags whose value needs rules: --discovery=nodes and a canary.
        d = overlay("flag-node-discovery", args_patch=add("--discovery=nodes"))
        expect("--discovery=nodes alone fails, naming deploy/components/node-discovery", *fails_with(d, f"use {NODE_DISCOVERY}"))
        d = overlay("flag-canary", args_patch=add("--release=auto") + add("--canary-job=/etc/job.yaml"))
        expect("a canary's flags alone fail, naming deploy/components/canary", *fails_with(d, f"create on jobs in faultline: use {CANARY}"))
        d = overlay("rule-canary", resources=["../base", "rbac.yaml"], copy_files=[f"{CANARY}/rbac.yaml"])
        expect("Jobs granted with no canary fail", *fails_with(d, "create on jobs in faultline is granted but no canary runs"))
        d = overlay("canary-manual", resources=["../base", "rbac.yaml"], copy_files=[f"{CANARY}/rbac.yaml"], args_patch=add("--canary-job=/etc/job.yaml"))
        expect("Jobs granted for a canary that a manual release never runs fail", *fails_with(d, "no canary runs"))

        # 5. Every component: flags and rules together pass and validate.
        d = overlay("features", components=["deploy/components/pod-health", "deploy/components/force-delete", "deploy/components/ascend-device-plugin", NODE_DISCOVERY])
        ok, why = passes(d)
        need = need_of(render(d))
        expect("every component passes --check, each flag on", ok and all(need.feature.values()) and need.discovery == "nodes", why)
        expect("every component validates against 1.30", *validate(d))
        # ... and a wider grant than a foreign namespace's feature needs fails.
        d = overlay("wide", resources=["../base", "wide.yaml"], args_patch=add("--ascend-device-info=true"))
        (d / "wide.yaml").write_text((ROOT / "deploy/components/ascend-device-plugin/rbac.yaml").read_text().replace("verbs: [get]", "verbs: [get, list, update]"))
        expect("list and update on kube-system's ConfigMaps fail though the flag is on", *fails_with(d, "list, update on ConfigMaps in kube-system"))
        d = overlay("secrets", resources=["../base", "wide.yaml"], args_patch=add("--ascend-device-info=true"))
        (d / "wide.yaml").write_text((ROOT / "deploy/components/ascend-device-plugin/rbac.yaml").read_text().replace("resources: [configmaps]", "resources: [configmaps, secrets]"))
        expect("get on kube-system's Secrets beside its ConfigMaps fails", *fails_with(d, "grant more than ConfigMaps (:secrets)"))
        d = overlay("star", resources=["../base", "wide.yaml"], args_patch=add("--ascend-device-info=true"))
        (d / "wide.yaml").write_text((ROOT / "deploy/components/ascend-device-plugin/rbac.yaml").read_text().replace("resources: [configmaps]", 'resources: ["*"]'))
        expect("get on every resource of kube-system fails", *fails_with(d, "grant more than ConfigMaps (:*)"))

        # 6. Resized in the base file itself: --write --base rewrites only its block.
        f = base / "aggregator.yaml"
        f.write_text(f.read_text().replace("--shards=4 ", "--shards=3 ").replace("# - --pages=2", "- --pages=3").replace("--publish-namespaces=default ", "--publish-namespaces=default,ml "))
        expect("a resized base fails, naming --write --base", *fails_with(base, "lacks faultline-shard-0-page-1", f"fix: {ME} --write --base {shown(f)}", "no Role in publish namespace ml"))
        before = f.read_text()
        write_base(f)
        after = f.read_text()
        ok, why = passes(base)
        outside = lambda text: re.sub(rf"(?s){re.escape(BEGIN)}.*?{re.escape(END)}", "", text)
        expect("--write --base makes it pass, changing nothing outside its markers", ok and outside(before) == outside(after) and len(publisher_names(base, "ml")) == 9, why)
        write_base(f)
        expect("--write --base again changes nothing", f.read_text() == after)
        f.write_text(after.replace("--publish-namespaces=default,ml ", "--publish-namespaces=faultline "))
        write_base(f)
        ok, why = passes(base)
        expect("no publish namespace but its own: no publisher Role", ok and not find(render(base), "Role", PUBLISHER), why)
        expect(
            "deploy/base/aggregator.yaml is what --write makes of it",
            base_docs(need_of(load(BASE_FILE.read_text()))) in BASE_FILE.read_text(),
            f"its block between the gen-rbac.py markers was edited by hand: run {ME} --write",
        )
    except Failure as e:
        expect("the self-test ran through", False, str(e))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"gen-rbac self-test: {sum(results)}/{len(results)} ok")
    return 0 if all(results) else 1


def main():
    p = argparse.ArgumentParser(usage="%(prog)s [--write | --check | --self-test] [--base FILE] [DIR ...]", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("targets", nargs="*", help="kustomize directories (overlays)")
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--self-test", action="store_true")
    p.add_argument("--rendered", help="with --check: judge these rendered manifests (a file, - for stdin)")
    p.add_argument("--base", type=pathlib.Path, default=BASE_FILE, help="the base file (default deploy/base/aggregator.yaml)")
    a = p.parse_args()
    try:
        if a.self_test:
            return self_test()
        if a.check and a.rendered:
            text = sys.stdin.read() if a.rendered == "-" else pathlib.Path(a.rendered).read_text()
            lines = check(a.rendered, load(text))
            for l in lines:
                print(l, file=sys.stderr)
            if not lines:
                print(f"gen-rbac: {a.rendered}: RBAC follows the flags ({need_of(load(text)).describe()})")
            return 1 if lines else 0
        if a.check:
            return run_check(a.targets)
        if not a.targets or all(is_base(t) for t in a.targets):
            files = [pathlib.Path(t) / "aggregator.yaml" for t in a.targets] or [a.base]
            for f in files:
                if a.write:
                    need, changed = write_base(f)
                    print(f"gen-rbac: {shown(f)}: {'rewritten' if changed else 'already'} for {need.describe()}")
                else:
                    print(base_docs(need_of(load(f.read_text()))), end="")
            return 0
        for t in a.targets:
            if a.write:
                need = write_overlay(t)
                print(f"gen-rbac: {shown(t)}: written for {need.describe()}")
                lines = check(t)
                for l in lines:
                    print(l, file=sys.stderr)
                if lines:
                    return 1
            else:
                need, patches, resources, gone = overlay_files(t)
                none = "# none needed\n"
                print(f"# {shown(t)}: {need.describe()}")
                print(f"# {PATCH_FILE} (under patches:)\n{patches or none}", end="")
                print(f"---\n# {ROLES_FILE} (under resources:)\n{resources or none}", end="")
                for ns in gone:
                    print(f"# under patches: (no longer published: {ns})\n#   - {delete_line(ns)}")
        return 0
    except Failure as e:
        print(f"gen-rbac: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
