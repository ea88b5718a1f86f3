"""Leave-one-source-out cross-validation of the fitted constants, and the error bands it earns:
``python -m ragged_fsdp.sim.crossval``.

For each source (a document; one cited at two commits is one source): refit the constants of
:mod:`.fitted` without any of its points, on the fit *and* validation points of every other
source, then predict its points. The refit is one Gauss-Newton step in log space from the
full fit, on the Jacobian of each point's log tokens/s in the log of the constants its
prediction uses (finite differences, computed once); the points a constant is fitted on in
production weigh ``FIT_WEIGHT`` times the others, so where they remain they pin their
constant as the production fit does, and where they are held out the other points decide.
The held-out points are then predicted exactly with the refitted constants.

A held-out point whose GPU has no other source is *not predicted*: its efficiency would
have to come from another GPU, which the simulator never does. It is counted ("no
evidence") and enters no band.

Bands: a group (a GPU profile, or a feature: float8, MXFP8, NVFP4, EP, CP, TP, PP, bf16)
with at least ``MIN_GROUP`` cross-validated points gets the split-conformal quantile of
|log(predicted / published)| over its points at a level ``q``: the ``ceil(q (n + 1))``-th
smallest. A prediction's band is the widest of its groups' (its GPU and each feature it
uses), or the pooled one where none of its groups has enough points. ``coverage`` checks the
rule on points it never saw: each source's cross-validated predictions against bands
computed from the other sources' residuals only; ``q`` is the lowest of 0.90, 0.91, ...
whose coverage there reaches ``TARGET`` (90%), so a band is as wide as that needs.

Writes ``data/error_bands.json`` (what :mod:`.uncertainty` prints with every prediction).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

from . import fitted
from . import validate as V
from .bands import BANDS_PATH, MIN_GROUP, band_for, groups_of, load_bands

__all__ = ["BANDS_PATH", "MIN_GROUP", "TARGET", "source_of", "groups_of", "jacobian", "crossvalidate", "bands",
           "band_for", "coverage", "calibrated_level", "load_bands", "run", "main"]

FIT_WEIGHT = 100.0
STEP = 0.02  # relative step of the finite differences
TARGET = 0.9  # the fraction of unseen published values a band must cover


def source_of(pt: dict) -> str:
    return re.sub(r"/blob/[^/]+/", "/blob/", pt["source"])


def _point_groups(pt: dict) -> list[str]:
    return groups_of(pt["gpu"], pt["recipe"], pt["mesh"], "ep=" in pt["mesh"])


def _uses(pt: dict) -> list[str]:
    """The constants a point's tokens/s depends on (the rest have zero derivative)."""
    r = pt["recipe"]
    keys = [f"efficiency:{pt['gpu']}", "attention_rate"]
    if r.get("compile"):
        keys.append("compile_speedup")
    f8 = r.get("float8")
    if f8:
        keys.append(f"float8_speedup:{'mxfp8' if f8 == 'nvfp4' else f8}")
    if "ep=" in pt["mesh"] and r.get("moe_dispatcher", "standard") == "standard":
        keys.append("a2a_efficiency:standard")
    return [k for k in keys if k in fitted.FIT_POINTS]


def _log_tps(pt: dict) -> float:
    return math.log(V.predict(pt).tokens_per_s_per_gpu)


def jacobian(points: list[dict], base: dict) -> tuple[list[float], list[dict]]:
    """(log tokens/s at ``base``, per point {constant: d log tokens/s / d log constant})."""
    y0, jac = [], []
    with V.constants(base):
        for pt in points:
            y = _log_tps(pt)
            y0.append(y)
            row = {}
            for k in _uses(pt):
                with V.constants({k: base[k] * (1 + STEP)}):
                    row[k] = (_log_tps(pt) - y) / math.log(1 + STEP)
            jac.append(row)
    return y0, jac


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems are ~15 x 15)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c]
        for r in range(c + 1, n):
            f = m[r][c] / piv
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _refit(train: list[int], points, y0, jac, base: dict) -> tuple[dict, set]:
    """One weighted Gauss-Newton step on the ``train`` points: the constants in log space.
    Returns (constants, the constants no training point identifies)."""
    fit_ids = set(fitted.FIT_POINTS.values())
    keys = sorted({k for i in train for k in jac[i]})
    unidentified = set(base) - set(keys)
    idx = {k: j for j, k in enumerate(keys)}
    n = len(keys)
    ata = [[0.0] * n for _ in range(n)]
    atb = [0.0] * n
    for i in train:
        pt = points[i]
        w = FIT_WEIGHT if pt["id"] in fit_ids else 1.0
        r = y0[i] - math.log(pt["tokens_per_s"])
        row = jac[i]
        for a, ja in row.items():
            atb[idx[a]] -= w * ja * r
            for b, jb in row.items():
                ata[idx[a]][idx[b]] += w * ja * jb
    for j in range(n):  # a whisper of ridge: a constant only weakly identified stays near the full fit
        ata[j][j] += 1e-6
    delta = _solve(ata, atb)
    out = dict(base)
    for k, j in idx.items():
        out[k] = base[k] * math.exp(max(-1.5, min(1.5, delta[j])))
    return out, unidentified


def crossvalidate(points: list[dict] | None = None) -> dict:
    """Every source held out in turn: its points' cross-validated tokens/s errors."""
    points = points if points is not None else V.load_points()["points"]
    base = V.current()
    y0, jac = jacobian(points, base)
    sources = sorted({source_of(p) for p in points})
    rows = []
    for s in sources:
        held = [i for i, p in enumerate(points) if source_of(p) == s]
        train = [i for i, p in enumerate(points) if source_of(p) != s]
        consts, missing = _refit(train, points, y0, jac, base)
        for i in held:
            pt = points[i]
            lacking = sorted(set(_uses(pt)) & missing)
            row = {"id": pt["id"], "source": s, "gpu": pt["gpu"], "role": pt["role"], "groups": _point_groups(pt),
                   "published": pt["tokens_per_s"]}
            if lacking:
                row.update(predicted=None, error=None, no_evidence=lacking)
            else:
                with V.constants(consts):
                    pred = V.predict(pt).tokens_per_s_per_gpu
                row.update(predicted=pred, error=pred / pt["tokens_per_s"] - 1)
            rows.append(row)
    return {"rows": rows, "sources": sources}


def _conformal(logs: list[float], level: float) -> float:
    a = sorted(logs)
    k = min(len(a), math.ceil(level * (len(a) + 1)))
    return a[k - 1]


def bands(rows: list[dict], level: float = TARGET) -> dict:
    """Per group: n, median and max |error|, and the band (|log ratio| quantile at ``level``)."""
    done = [r for r in rows if r["error"] is not None]
    out = {"pooled": _stats(done, level)}
    names = sorted({g for r in done for g in r["groups"]})
    for g in names:
        out[g] = _stats([r for r in done if g in r["groups"]], level)
    return out


def _stats(rows: list[dict], level: float) -> dict:
    e = [abs(r["error"]) for r in rows]
    lg = [abs(math.log1p(r["error"])) for r in rows]
    return {"n": len(rows), "median_abs_error": statistics.median(e) if e else None,
            "max_abs_error": max(e) if e else None, "band_log": _conformal(lg, level) if lg else None}


def coverage(rows: list[dict], level: float = TARGET) -> dict:
    """Each source's cross-validated predictions against bands from the other sources only."""
    hit = tot = 0
    widths = []
    for s in sorted({r["source"] for r in rows}):
        table = bands([r for r in rows if r["source"] != s], level)
        for r in rows:
            if r["source"] != s or r["error"] is None:
                continue
            q, _ = band_for(r["groups"], table)
            widths.append(math.expm1(q))
            tot += 1
            hit += abs(math.log1p(r["error"])) <= q
    return {"covered": hit, "points": tot, "fraction": hit / tot if tot else None,
            "median_half_width": statistics.median(widths) if widths else None}


def calibrated_level(rows: list[dict]) -> float:
    """The lowest quantile level (0.90, 0.91, ...) whose bands cover ``TARGET`` of the points
    their sources never saw: as wide as the target needs, no wider."""
    for pct in range(round(TARGET * 100), 100):
        if coverage(rows, pct / 100)["fraction"] >= TARGET:
            return pct / 100
    return 0.99


def run() -> dict:
    cv = crossvalidate()
    level = calibrated_level(cv["rows"])
    return {"command": "python -m ragged_fsdp.sim.crossval", "target": TARGET, "level": level,
            "min_group": MIN_GROUP, "fit_weight": FIT_WEIGHT, "constants": V.current(), "sources": cv["sources"],
            "bands": bands(cv["rows"], level), "coverage": coverage(cv["rows"], level),
            "no_evidence": [r["id"] for r in cv["rows"] if r["error"] is None], "rows": cv["rows"]}


def render(doc: dict) -> str:
    lines = ["| group | CV points | median abs. error | max abs. error | band (level below) |", "|---|---|---|---|---|"]
    for g, st in doc["bands"].items():
        if not st["n"]:
            continue
        lines.append(f"| {g} | {st['n']} | {st['median_abs_error']:.1%} | {st['max_abs_error']:.1%} | "
                     f"x{math.exp(-st['band_log']):.2f} .. x{math.exp(st['band_log']):.2f}"
                     + ("" if st["n"] >= MIN_GROUP else " (too few: not used)") + " |")
    c = doc["coverage"]
    lines.append("")
    lines.append(f"Band level {doc['level']:.2f}. Coverage on points whose source no band saw: {c['covered']} of {c['points']} "
                 f"({c['fraction']:.0%}); median half-width {c['median_half_width']:.0%}. Not predicted (the GPU has "
                 f"no other source): {', '.join(doc['no_evidence']) or 'none'}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ragged_fsdp.sim.crossval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", default=str(BANDS_PATH), help="where to write the bands ('' = nowhere)")
    ap.add_argument("--rows", action="store_true", help="also print every held-out point")
    args = ap.parse_args(argv)
    doc = run()
    if args.rows:
        for r in doc["rows"]:
            err = "no evidence: " + ", ".join(r["no_evidence"]) if r["error"] is None else f"{r['error']:+.1%}"
            print(f"{r['id']:36s} {r['gpu']:11s} {r['published']:10,.1f} {err}")
        print()
    print(render(doc))
    if args.write:
        Path(args.write).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
