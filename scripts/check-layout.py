#!/usr/bin/env python3
"""Layout checks, run by CI, over agent/src, aggregator/src, common/src, the test API
server (tests/apiserver/src), the real control plane (tests/controlplane/src), the Rust
consumer kit (consumers/rust/src) and benches/:

- no source file has more than 600 lines of non-test code (the lines before its
  `#[cfg(test)]` module; `*_tests.rs` files are tests);
- no import cycle among the modules of any of them (a module is a file; a root that
  only declares and re-exports its children does not import them): two modules
  importing each other, or a longer ring;
- roots declare: a module root (`mod.rs`, `lib.rs`) holds only `mod`, `use` and
  attribute lines, or at most 60 lines of code (comments and blank lines aside);
- wiring is a table: no function that starts, builds, spawns or wires the parts
  (`start*`, `build*`, `spawn*`, `wire*`, `main`) in agent, aggregator or common has
  more than 80 lines;
- the README has at most 300 lines.

Function length otherwise (at most 200 lines) is clippy's `too_many_lines`, set in
clippy.toml. Exit status 1 with one line per finding when a check fails.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 600
MAX_README = 300
MAX_ROOT = 60
MAX_WIRING = 80
# (name, source folder): the product crates, then the test API server and benches.
CRATES = (
    ("agent", "agent/src"),
    ("aggregator", "aggregator/src"),
    ("common", "common/src"),
    ("tests/apiserver", "tests/apiserver/src"),
    ("tests/controlplane", "tests/controlplane/src"),
    ("consumers/rust", "consumers/rust/src"),
    ("benches", "benches"),
)
PRODUCT = ("agent", "aggregator", "common")
WIRING = re.compile(r"(?:start|build|spawn|wire)\w*|main")
DECLARATION = re.compile(r"\s*(?:#!?\[.*\]|(?:pub(?:\([^)]*\))?\s+)?(?:mod|use)\b.*|[\w:{}, *]*[}]?;?)\s*$")


def non_test_lines(path):
    n = 0
    for line in path.read_text().splitlines():
        if line.startswith("#[cfg(test)]"):
            break
        n += 1
    return n


def module_of(src, path):
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def expand(use):
    """`a::{b, c::{d, e}}` -> ["a::b", "a::c::d", "a::c::e"]."""
    use = re.sub(r"\s+", "", use)
    i = use.find("{")
    if i < 0:
        return [use]
    prefix, inner = use[:i], use[i + 1 : use.rfind("}")]
    items, depth, cur = [], 0, ""
    for c in inner:
        if c == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += c == "{"
        depth -= c == "}"
        cur += c
    if cur:
        items.append(cur)
    return [p for it in items if it for p in expand(prefix + it)]


def resolve(path, here, is_root, modules):
    segs = path.split("::")
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = here if (is_root or segs[0] == "self") else here[:-1]
        if segs[0] == "super" and is_root:
            base = here[:-1]
        rest = segs[1:]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    elif here + (segs[0],) in modules:
        # `use child::X` (2018 paths: a child module named without `self::`).
        base, rest = here + (segs[0],), segs[1:]
    else:
        return None
    best = base if base in modules else None
    cur = base
    for s in rest:
        cur = cur + (s,)
        if cur in modules:
            best = cur
    return best


def imports(src, path, modules):
    here = module_of(src, path)
    is_root = path.name in ("mod.rs", "lib.rs", "main.rs")
    code = []
    for line in path.read_text().splitlines():
        if line.startswith("#[cfg(test)]"):
            break
        code.append(re.sub(r"//.*", "", line))
    text = "\n".join(code)
    found = set()
    for m in re.finditer(r"\b(pub(\([^)]*\))?\s+)?use\s+([^;]+);", text):
        if m.group(1) and is_root:
            continue  # a root's re-exports declare its children, they do not import
        for p in expand(m.group(3)):
            p = p.split(" as ")[0]
            t = resolve(p, here, is_root, modules)
            if t is not None:
                found.add(t)
    body = re.sub(r"\buse\s+[^;]+;", "", text)
    for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", body):
        t = resolve(m.group(1), here, is_root, modules)
        if t is not None:
            found.add(t)
    found.discard(here)
    # A child naming its own root (for a re-exported item) is not an import cycle
    # by itself; the pair check below still sees root -> child imports.
    return here, found


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "crate"


def code_lines(path):
    """The non-test lines of `path` that are code (no blank line, no comment)."""
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("#[cfg(test)]"):
            break
        t = line.strip()
        if t and not t.startswith("//"):
            out.append(line)
    return out


def root_finding(path):
    """A module root that holds more than declarations and more than MAX_ROOT lines."""
    code = code_lines(path)
    if len(code) <= MAX_ROOT or all(DECLARATION.fullmatch(l) for l in code):
        return None
    return f"{path.relative_to(ROOT)}: a module root with {len(code)} lines of code (declarations only, or at most {MAX_ROOT}): move the code to a named child"


def functions(text):
    """(name, first line, length in lines) of every function with a body in `text`."""
    out = []
    for m in re.finditer(r"^[ \t]*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+)?fn\s+(\w+)", text, re.M):
        i, semi = text.find("{", m.end()), text.find(";", m.end())
        if i < 0 or 0 <= semi < i:
            continue
        depth, j = 0, i
        while j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        first = text.count("\n", 0, m.start()) + 1
        out.append((m.group(1), first, text.count("\n", 0, j) + 2 - first))
    return out


def wiring_findings(path):
    text = path.read_text()
    cut = text.find("#[cfg(test)]")
    text = text if cut < 0 else text[:cut]
    return [
        f"{path.relative_to(ROOT)}:{line}: wiring function `{fn}` has {n} lines (at most {MAX_WIRING}): let each part build itself"
        for fn, line, n in functions(text)
        if WIRING.fullmatch(fn) and n > MAX_WIRING
    ]


def main():
    sys.setrecursionlimit(10000)
    bad = []
    total = 0
    for crate, folder in CRATES:
        src = ROOT / folder
        for f in sorted(src.rglob("*.rs")):
            if f.name.endswith("_tests.rs"):
                continue
            n = non_test_lines(f)
            if n > MAX_LINES:
                bad.append(f"{f.relative_to(ROOT)}: {n} lines of non-test code (at most {MAX_LINES})")
            if f.name in ("mod.rs", "lib.rs"):
                finding = root_finding(f)
                if finding:
                    bad.append(finding)
            if crate in PRODUCT:
                bad.extend(wiring_findings(f))
        files = [
            f
            for f in src.rglob("*.rs")
            if "bin" not in f.relative_to(src).parts and not f.name.endswith("_tests.rs")
        ]
        total += len(files)
        modules = {module_of(src, f) for f in files}
        edges = dict(imports(src, f, modules) for f in files)
        for comp in cycles(edges):
            bad.append(f"{crate}: import cycle among modules {', '.join(name(m) for m in comp)}")
        # The same a level up: a top-level module with its submodules as one (a file of
        # `sources/` importing `metrics` while `metrics` imports another of `sources/`).
        top = {}
        for a, targets in edges.items():
            top.setdefault(a[:1], set()).update(b[:1] for b in targets if b[:1] != a[:1])
        for comp in cycles(top):
            if len(comp) > 1 and not any(len(c) == 0 for c in comp):
                bad.append(f"{crate}: import cycle among top-level modules {', '.join(name(m) for m in comp)}")
    readme = len((ROOT / "README.md").read_text().splitlines())
    if readme > MAX_README:
        bad.append(f"README.md: {readme} lines (at most {MAX_README})")
    for line in bad:
        print(line)
    if bad:
        return 1
    print(
        f"layout ok: {total} modules in {', '.join(c for c, _ in CRATES)}, no import cycle; "
        f"no file over {MAX_LINES} lines of non-test code; roots declare (or hold at most "
        f"{MAX_ROOT} lines); no wiring function over {MAX_WIRING} lines; README {readme} lines"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
