#!/usr/bin/env python3
"""Layout checks of issue 8, run by CI:

- no source file of agent/src or aggregator/src has more than 900 lines of non-test
  code (the lines before its `#[cfg(test)]` module; `*_tests.rs` files are tests);
- no two modules of the aggregator import each other (a module is a file; a root that
  only declares and re-exports its children does not import them).

Function length (at most 200 lines) is clippy's `too_many_lines`, set in clippy.toml.
Exit status 1 with one line per finding when a check fails.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 900


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


def main():
    bad = []
    for crate in ("agent", "aggregator"):
        for f in sorted((ROOT / crate / "src").rglob("*.rs")):
            if f.name.endswith("_tests.rs"):
                continue
            n = non_test_lines(f)
            if n > MAX_LINES:
                bad.append(f"{f.relative_to(ROOT)}: {n} lines of non-test code (at most {MAX_LINES})")
    src = ROOT / "aggregator" / "src"
    files = [f for f in src.rglob("*.rs") if "bin" not in f.relative_to(src).parts and not f.name.endswith("_tests.rs")]
    modules = {module_of(src, f) for f in files}
    edges = dict(imports(src, f, modules) for f in files)
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            if a < b and a in edges.get(b, ()):
                bad.append(f"aggregator modules {'::'.join(a) or 'crate'} and {'::'.join(b) or 'crate'} import each other")
    for line in bad:
        print(line)
    if bad:
        return 1
    print(f"layout ok: {len(files)} aggregator modules, no mutual imports; no file over {MAX_LINES} lines of non-test code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
