#!/usr/bin/env python3
"""The docs against the code. Standard library only, and PyYAML for check 6.

    python3 scripts/check-docs.py target/release/faultline-aggregator [target/release/faultline-agent]

Checks, each failure one line, exit status 1 if any:

1. README.md has at most 300 lines.
2. Every flag table marked `<!-- check-docs: flags of BINARY -->` in docs/*.md matches
   `BINARY --help`: each flag is in the help, and its default cell is what clap prints
   as `[default: X]`. The table is the markdown table right after the marker:

       | flag | default | meaning |
       |---|---|---|
       | `--dedup-window` | `15m` | ... |
       | `--notify` | none | ... |

   The first cell holds the flag in backticks; the second is the default in backticks,
   exactly as clap prints it, or the word `none` when clap prints no default or an
   empty one. docs/remediation.md must have the aggregator's remediation table, and it
   must list every flag of the help's "Remediation" group; every flag of a checked
   binary must be in one of its tables, and in one only. (Not "Alert intake": clap
   derive's heading leaks from the last flattened group into the top-level flags.)
   The agent's tables are checked when its binary is given, or found next to the
   aggregator's; otherwise they are skipped (said in the last line).
3. README.md states no default of a flag (defaults live in the docs, once): a sentence
   outside code blocks that names a `--flag` and the word "default", or writes a flag's
   default right after it ("`--flag` (5m").
4. Every relative link in README.md, docs/*.md and tests/apiserver/README.md points at a
   file that exists, and a `#anchor` into a markdown file at one of its headings.
5. docs/architecture.md's layout (its "## Layout" code block) names every module folder
   of agent/src, aggregator/src and common/src (`name/`), and every file it names as
   `name.rs` at the start of an entry exists in one of those crates.
6. docs/deploying.md's Helm values table (after `<!-- check-docs: values of
   deploy/helm/faultline -->`) names every value of the chart's values.yaml with its
   default, and nothing else.

On success it prints one line starting with "docs ok:".
"""
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 300
MARKER = re.compile(r"<!--\s*check-docs:\s*flags of\s+([A-Za-z0-9_.-]+)\s*-->")
# clap's help: a heading ("Remediation:"), an argument ("  -h, --help", "      --sink <SINK>").
HEADING = re.compile(r"^([A-Z][A-Za-z0-9 ]*):\s*$")
ARG = re.compile(r"^ {0,8}(?:-[A-Za-z0-9], )?--([a-z0-9][a-z0-9-]*)\b")
DEFAULT = re.compile(r"\[default: ([^\]]*)\]")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
REMEDIATION_GROUPS = ("Remediation",)
SKIP_FLAGS = {"help", "version"}

errors = []


def fail(msg):
    errors.append(msg)


def rel(path):
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def run_help(binary):
    """{flag: (default or None, help group)} from `binary --help`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULTLINE_")}
    env.update({"NO_COLOR": "1", "CLICOLOR": "0", "TERM": "dumb"})
    env.pop("CLICOLOR_FORCE", None)
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                             env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        fail(f"{binary} --help: {e}")
        return None
    if out.returncode != 0:
        fail(f"{binary} --help exited {out.returncode}: {out.stderr.strip()[:200]}")
        return None
    flags = {}
    group, name, text = None, None, []

    def close():
        if name is None:
            return
        # Join the entry's lines: clap wraps long help, even inside "[default: ...]".
        joined = " ".join(" ".join(text).split())
        m = DEFAULT.search(joined)
        default = None
        if m:
            default = m.group(1).strip()
            if len(default) >= 2 and default[0] == default[-1] == '"':
                default = default[1:-1]
        flags[name] = (default, group)

    for line in ANSI.sub("", out.stdout).splitlines():
        h = HEADING.match(line)
        a = ARG.match(line)
        if h:
            close()
            group, name, text = h.group(1).strip(), None, []
        elif a:
            close()
            name, text = a.group(1), [line[a.end():]]
        elif name is not None:
            text.append(line)
    close()
    if len(flags) < 5:
        fail(f"{binary} --help: could not read its flags (found {len(flags)})")
        return None
    return flags


def split_row(line):
    cells = re.split(r"(?<!\\)\|", line.strip())
    if cells and cells[0].strip() == "":
        cells = cells[1:]
    if cells and cells[-1].strip() == "":
        cells = cells[:-1]
    return [c.strip() for c in cells]


def flag_tables():
    """[(binary name, path, [(line number, flag, expected default or None)])]."""
    tables = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = MARKER.search(lines[i])
            i += 1
            if not m:
                continue
            while i < len(lines) and not lines[i].strip():
                i += 1
            if i + 1 >= len(lines) or not lines[i].lstrip().startswith("|") \
                    or not re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
                fail(f"{rel(path)}:{i + 1}: no markdown table after the check-docs marker")
                continue
            i += 2
            rows = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                cells = split_row(lines[i])
                where = f"{rel(path)}:{i + 1}"
                f = re.search(r"`(--[a-z0-9][a-z0-9-]*)[^`]*`", cells[0]) if cells else None
                if not f or len(cells) < 2:
                    fail(f"{where}: a row without a `--flag` and a default cell")
                elif cells[1].startswith("`"):
                    d = re.match(r"`([^`]*)`", cells[1])
                    rows.append((i + 1, f.group(1)[2:], d.group(1) if d else ""))
                elif re.match(r"(?i)none\b", cells[1]):
                    rows.append((i + 1, f.group(1)[2:], None))
                else:
                    fail(f"{where}: {f.group(1)}: the default cell must be `VALUE` or none, not {cells[1]!r}")
                i += 1
            tables.append((m.group(1), path, rows))
    return tables


def check_tables(helps):
    """Flag tables against --help. Returns (rows checked per binary, skipped binaries)."""
    checked, skipped = {}, set()
    seen = {}  # (binary, flag) -> where
    remediation_flags = set()
    for binary, path, rows in flag_tables():
        if binary not in helps:
            fail(f"{rel(path)}: a flag table of {binary!r}, which this script does not know")
            continue
        help_flags = helps[binary]
        if help_flags is None:
            skipped.add(binary)
            continue
        for line, flag, want in rows:
            where = f"{rel(path)}:{line}"
            key = (binary, flag)
            if key in seen:
                fail(f"{where}: --{flag} is also in the table at {seen[key]} (state each default once)")
            seen[key] = where
            if path.name == "remediation.md" and binary == "faultline-aggregator":
                remediation_flags.add(flag)
            if flag not in help_flags:
                fail(f"{where}: --{flag} is not in {binary} --help")
                continue
            got = help_flags[flag][0]
            if want is None:
                if got not in (None, ""):
                    fail(f"{where}: --{flag}: the table says none, {binary} --help says [default: {got}]")
            elif got != want:
                shown = "no default" if got is None else f"[default: {got}]"
                fail(f"{where}: --{flag}: the table says `{want}`, {binary} --help says {shown}")
            checked[binary] = checked.get(binary, 0) + 1
    for binary, help_flags in helps.items():
        if help_flags is None:
            continue
        for flag, (_, group) in sorted(help_flags.items()):
            if flag in SKIP_FLAGS:
                continue
            if binary == "faultline-aggregator" and group in REMEDIATION_GROUPS \
                    and flag not in remediation_flags:
                fail(f"docs/remediation.md: --{flag} ({group} in {binary} --help) is not in its flag table")
            elif (binary, flag) not in seen:
                fail(f"docs: --{flag} of {binary} --help is in no flag table")
    if "faultline-aggregator" in helps and helps["faultline-aggregator"] is not None \
            and not remediation_flags:
        fail("docs/remediation.md: no `<!-- check-docs: flags of faultline-aggregator -->` table")
    return checked, skipped


def prose(path):
    """(first line number, paragraph text) outside fenced code blocks."""
    paras, cur, start, fenced = [], [], 0, False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            if cur:
                paras.append((start, " ".join(cur)))
                cur = []
            continue
        if fenced:
            continue
        if not line.strip():
            if cur:
                paras.append((start, " ".join(cur)))
                cur = []
            continue
        if not cur:
            start = n
        cur.append(line.strip())
    if cur:
        paras.append((start, " ".join(cur)))
    return paras


def check_readme_defaults(helps):
    defaults = {}
    for flags in helps.values():
        for flag, (d, _) in (flags or {}).items():
            if d:
                defaults.setdefault(flag, set()).add(d)
    for start, text in prose(README):
        for sentence in re.split(r"(?<=[.;!?])\s+|\|", text):
            flags = re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", sentence)
            if not flags:
                continue
            if re.search(r"(?i)\bdefault", sentence):
                fail(f"README.md:{start}: states a default ({', '.join('--' + f for f in flags)}): "
                     f"defaults live in docs/ ({sentence.strip()[:80]!r})")
                continue
            for f in flags:
                for d in defaults.get(f, ()):
                    if re.search(r"--" + re.escape(f) + r"`?\s*\(\s*`?" + re.escape(d) + r"\b", sentence):
                        fail(f"README.md:{start}: states --{f}'s default ({d}): defaults live in docs/")


def slug(heading):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, counts, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = counts.get(s, 0)
            counts[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def check_links():
    files = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests/apiserver/README.md"]
    n = 0
    for path in files:
        if not path.exists():
            fail(f"{rel(path)}: missing")
            continue
        for start, text in prose(path):
            text = re.sub(r"`[^`]*`", "", text)  # inline code is not a link
            for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                n += 1
                file_part, _, anchor = target.partition("#")
                dest = path if not file_part else (path.parent / file_part).resolve()
                where = f"{rel(path)}:{start}"
                if not dest.exists():
                    fail(f"{where}: link to {target}: {rel(dest)} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    fail(f"{where}: link to {target}: {rel(dest)} has no heading #{anchor}")
    return n


LAYOUT_CRATES = ("agent", "aggregator", "common")


def check_layout_doc():
    """Every module folder of the crates is in docs/architecture.md's layout."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    at = doc.find("## Layout")
    block = re.search(r"```\n(.*?)```", doc[at:], re.S) if at >= 0 else None
    if block is None:
        fail("docs/architecture.md: no \"## Layout\" section with a code block")
        return 0
    layout = block.group(1)
    named = set(re.findall(r"(?:^|\s)([a-z_]+)/", layout))
    folders = []
    for crate in LAYOUT_CRATES:
        src = ROOT / crate / "src"
        for d in sorted(src.iterdir()):
            if d.is_dir() and d.name != "bin" and any(d.glob("*.rs")):
                folders.append(f"{crate}/src/{d.name}")
                if d.name not in named:
                    fail(f"docs/architecture.md: the layout does not name {crate}/src/{d.name}/")
    files = {f.name for c in LAYOUT_CRATES for f in (ROOT / c / "src").rglob("*.rs")}
    for m in re.finditer(r"^ {2}([a-z_]+\.rs)\b", layout, re.M):
        if m.group(1) not in files:
            fail(f"docs/architecture.md: the layout names {m.group(1)}, which no crate has")
    return len(folders)


# The Helm chart's values: dotted paths to leaves; these maps are one value each.
FREE_FORM = {"resources", "updateStrategy", "tolerations"}
TABLE_MARK = "<!-- check-docs: values of deploy/helm/faultline -->"


def leaves(d, prefix=""):
    """values.yaml's values as the table names them: dotted paths to leaves (an empty
    map, a list, or a free-form block is one value)."""
    for k, x in d.items():
        path = f"{prefix}{k}"
        if isinstance(x, dict) and x and k not in FREE_FORM:
            yield from leaves(x, path + ".")
        else:
            yield path, x


def cell(x):
    if isinstance(x, str):
        return f"`{x}`" if x else '`""`'
    return "`" + json.dumps(x, separators=(", ", ": ")) + "`"


def check_values_table():
    """docs/deploying.md's values table against deploy/helm/faultline/values.yaml: the
    number of values checked."""
    try:
        import yaml
    except ImportError:
        fail("the Helm values table needs PyYAML (pip install pyyaml) to read values.yaml")
        return 0
    doc = (ROOT / "docs/deploying.md").read_text(encoding="utf-8")
    if TABLE_MARK not in doc:
        fail(f"docs/deploying.md has no values table ({TABLE_MARK})")
        return 0
    rows = {}
    for line in doc.split(TABLE_MARK, 1)[1].lstrip("\n").splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    chart = ROOT / "deploy/helm/faultline/values.yaml"
    values = dict(leaves(yaml.safe_load(chart.read_text(encoding="utf-8"))))
    for k, x in values.items():
        if k not in rows:
            fail(f"docs/deploying.md: the values table lacks `{k}` (default {cell(x)})")
        elif rows[k] != cell(x):
            fail(f"docs/deploying.md: `{k}` defaults to {cell(x)} in values.yaml, the table says {rows[k]}")
    for k in sorted(set(rows) - set(values)):
        fail(f"docs/deploying.md: the values table names `{k}`, which values.yaml has not")
    return len(values)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    aggregator = pathlib.Path(sys.argv[1])
    if not aggregator.is_file():
        print(f"check-docs: {aggregator}: no such binary (build it: cargo build --release "
              "-p faultline-aggregator)", file=sys.stderr)
        return 2
    agent = pathlib.Path(sys.argv[2]) if len(sys.argv) == 3 else aggregator.with_name(
        aggregator.name.replace("faultline-aggregator", "faultline-agent"))

    readme_lines = len(README.read_text(encoding="utf-8").splitlines())
    if readme_lines > MAX_README_LINES:
        fail(f"README.md: {readme_lines} lines, more than {MAX_README_LINES}: move detail to docs/")

    helps = {"faultline-aggregator": run_help(aggregator)}
    helps["faultline-agent"] = run_help(agent) if agent.is_file() and agent != aggregator else None
    checked, skipped = check_tables(helps)
    check_readme_defaults(helps)
    links = check_links()
    folders = check_layout_doc()
    values = check_values_table()

    if errors:
        for e in errors:
            print(f"check-docs: {e}")
        return 1
    summary = ", ".join(f"{n} flags of {b}" for b, n in sorted(checked.items()))
    note = f"; skipped the tables of {', '.join(sorted(skipped))} (no binary)" if skipped else ""
    print(f"docs ok: README.md {readme_lines} lines; {summary} match --help; "
          f"{links} relative links resolve; the layout names {folders} module folders; "
          f"the Helm values table names {values} values{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
