"""Render the measured tables of Markdown pages from the JSON the benches write.

A page marks each table with a spec in an HTML comment and an end marker; everything between
them is generated (a line with the run's conditions, then the table) and is rewritten in place:

    <!-- bench: data/plan.json rows=cells where=tp=1
    | model | W | ragged_fsdp | FSDP2 (blocks cut) |
    | {model} | {world_size} | {padding_ratio:pct} | {baselines.fsdp2.padding_ratio:pct} ({baselines.fsdp2.blocks_cut:int}) |
    -->
    (generated)
    <!-- /bench -->

- The JSON path is relative to the page. The file must have a top-level ``meta`` block
  (``ragged_fsdp.bench.meta.run_meta``: command, date, torch, CPU cores, GPU, load average).
- ``rows=PATH`` is a dotted path to a list of objects, or to an object of objects whose items
  become rows (the key is ``{_key}``), or to an object of values (one row); ``rows=`` left out
  renders one row from the top level.
- ``where=PATH=VALUE[,PATH=VALUE...]`` keeps the rows whose field, as text, equals VALUE.
- ``optional``: a missing JSON renders a one-line "not measured yet" note instead of failing.
- A cell is a template: ``{path:format}`` with ``path`` dotted keys and list indices
  (``by_world.2.report.dense.peak_mib``, ``points.0.1``), also ``a/b`` (a ratio of two paths)
  and ``a*2`` (a path times a number), and ``format`` one of FORMATS or a Python format spec
  (``.3f``). A path that does not exist renders ``-``.

    python benchmarks/render.py docs/benchmarks.md [more pages]   # rewrite the tables
    python benchmarks/render.py --check docs/*.md                 # exit 1 if one is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

START = re.compile(r"<!-- bench: (?P<spec>.*?)-->\n", re.S)
END = "<!-- /bench -->"
FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]+))?\}")
MISSING = object()


class RenderError(ValueError):
    pass


def _pct(x: float) -> str:
    v = 100 * x
    return f"{v:.0f}%" if abs(v) >= 1000 else f"{v:.2f}%"


FORMATS = {
    "pct": _pct,                                   # ratio -> 2.87% (no decimals from 1000%)
    "pct1": lambda x: f"{100 * x:.1f}%",
    "int": lambda x: f"{int(round(x)):,}",         # 1,234,567
    "mib": lambda x: f"{x / 2**20:.2f}",           # bytes -> MiB
    "gib": lambda x: f"{x / 2**30:.2f}",
    "x": lambda x: f"{x:.2f}x",
    "ms": lambda x: f"{1000 * x:.1f}",             # seconds -> ms
    "size": lambda x: _size(x),                    # bytes -> 1.75 MiB / 59.83 GiB
}


def _size(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def lookup(obj, path: str):
    for part in path.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and re.fullmatch(r"-?\d+", part) and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return MISSING
    return obj


def fmt(value, spec: str | None) -> str:
    if value is MISSING or value is None:
        return "-"
    if spec is None:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)
    if spec in FORMATS:
        return FORMATS[spec](value)
    return format(value, spec)


def value(expr: str, row: dict):
    """A path, or two paths divided (``a/b``: a ratio), or a path times a number (``a*2``)."""
    if "/" in expr:
        a, b = (lookup(row, e.strip()) for e in expr.split("/", 1))
        if MISSING in (a, b) or a is None or b in (None, 0):
            return MISSING
        return a / b
    if "*" in expr:
        path, k = expr.split("*", 1)
        a = lookup(row, path.strip())
        return MISSING if a is MISSING or a is None else a * float(k)
    return lookup(row, expr.strip())


def cell(template: str, row: dict) -> str:
    return FIELD.sub(lambda m: fmt(value(m.group(1), row), m.group(2)), template)


def conditions(meta: dict) -> str:
    gpu = meta.get("gpu") or "none"
    load = f", load average {meta['load_average']}" if meta.get("load_average") else ""
    note = f" {meta['note']}" if meta.get("note") else ""
    return (f"*Produced by `{meta['command']}` on {meta['date']}; torch {meta['torch']}, "
            f"{meta['cpu_cores']} CPU cores, GPU: {gpu}{load}.{note}*")


def _split_row(line: str) -> list[str]:
    line = line.strip()
    if not (line.startswith("|") and line.endswith("|")):
        raise RenderError(f"table line must start and end with '|': {line!r}")
    return [c.strip() for c in line[1:-1].split(" | ")]


def parse_spec(spec: str) -> tuple[str, dict, list[str], list[str]]:
    lines = [ln for ln in spec.strip().splitlines() if ln.strip()]
    head, *table = lines
    words = head.split()
    path, opts = words[0], {}
    for w in words[1:]:
        k, _, v = w.partition("=")
        opts[k] = v
    if len(table) != 2:
        raise RenderError(f"spec for {path}: expected a header line and a template line, got {len(table)} lines")
    headers, templates = _split_row(table[0]), _split_row(table[1])
    if len(headers) != len(templates):
        raise RenderError(f"spec for {path}: {len(headers)} headers but {len(templates)} templates")
    return path, opts, headers, templates


def rows_of(data, opts: dict) -> list[dict]:
    where = opts.get("rows")
    src = data if not where else lookup(data, where)
    if src is MISSING:
        raise RenderError(f"rows={where}: no such path")
    if isinstance(src, dict) and src and all(isinstance(v, dict) for v in src.values()):
        rows = [{"_key": k, **v} for k, v in src.items()]  # an object of objects: one row each
    elif isinstance(src, dict):
        rows = [src]  # an object of values: one row
    else:
        rows = list(src)
    for cond in filter(None, opts.get("where", "").split(",")):
        k, _, v = cond.partition("=")
        rows = [r for r in rows if str(lookup(r, k)) == v]
    return rows


def render_block(spec: str, page: Path) -> str:
    path, opts, headers, templates = parse_spec(spec)
    file = (page.parent / path).resolve()
    if not file.exists() and "optional" in opts:
        return f"*Not measured yet: the command above writes `{path}` (pass it as the output path), then re-render.*\n"
    if not file.exists():
        raise RenderError(f"{page}: {path} does not exist (run the command that writes it)")
    data = json.loads(file.read_text())
    if not isinstance(data, dict) or "meta" not in data:
        raise RenderError(f"{page}: {path} has no top-level 'meta' block (see ragged_fsdp.bench.meta)")
    rows = rows_of(data, opts)
    if not rows:
        raise RenderError(f"{page}: {path} rows={opts.get('rows')} where={opts.get('where')}: no rows")
    out = [conditions(data["meta"]), "", "| " + " | ".join(headers) + " |",
           "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(t, r) for t in templates) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _fenced(text: str) -> list[tuple[int, int]]:
    """Spans of fenced code blocks: a spec shown inside one is an example, not a table."""
    spans, start, pos = [], None, 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            if start is None:
                start = pos
            else:
                spans.append((start, pos + len(line)))
                start = None
        pos += len(line)
    return spans


def render_page(text: str, page: Path) -> str:
    out, pos = [], 0
    fences = _fenced(text)
    for m in START.finditer(text):
        if m.start() < pos or any(a <= m.start() < b for a, b in fences):
            continue
        end = text.find(END, m.end())
        if end < 0:
            raise RenderError(f"{page}: a bench block has no {END!r}")
        out += [text[pos:m.end()], "\n", render_block(m.group("spec"), page), "\n"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("pages", nargs="+", type=Path)
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if a page's tables are stale")
    a = p.parse_args(argv)
    stale = []
    for page in a.pages:
        text = page.read_text()
        try:
            new = render_page(text, page)
        except RenderError as exc:
            print(f"render: {exc}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(page)
            if not a.check:
                page.write_text(new)
    for page in stale:
        print(f"{'stale' if a.check else 'rendered'}: {page}")
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
