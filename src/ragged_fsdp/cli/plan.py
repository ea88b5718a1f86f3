"""`python -m ragged_fsdp plan`: plan catalog models and compare with other sharding schemes.

For every (model, world size, granularity) it plans each FSDP group (identical groups once),
validates the plans, and prints per group kind and for the whole model: the padding, the
structural lower bound, the planning time, and the padding and blocks cut of FSDP2, FSDP1,
DeepSpeed ZeRO-3 and Megatron-FSDP on the same tensors. ``--suggest`` adds, where padding
exceeds 1%, the smaller shard groups (HSDP) or larger groups that cut it, each with the
DeviceMesh and ``fully_shard`` calls that realise it. ``--json`` prints one JSON document instead.

``--tp T`` / ``--ep E`` plan what FSDP sees after tensor / expert parallelism (TP first, then
FSDP): dense tensors take their TP-local shapes (the Llama/torchtitan plan: q/k/v, gate/up and
the LM head split on dim 0, attention output and down on dim 1, the embedding on dim 0, norms
and routers whole) and are sharded over W/T ranks; routed experts are not tensor-parallel,
each EP rank holds 1/E of them, sharded over W/(T*E) ranks, as their own group per block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench.meta import run_meta
from ..models.catalog import get_model, group_specs, list_models
from ..models.parallel import ParallelDims, local_groups, module_map
from ..planner.baselines import BASELINES, all_baselines
from ..planner.granularity import GRANULARITY_FORMS, Granularity
from ..planner.recipe import mesh_layout, recipe
from ..planner.sections import Section, plan_sections
from ..planner.suggest import ORDER, suggest_sections

DTYPES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
          "float64": 8, "float8": 1, "fp8": 1}
SUGGEST_ABOVE = 0.01  # padding ratio above which --suggest looks for a way out
# Plans, baselines and suggestions keep per-rank tables, so time and memory grow linearly
# with W (2^20 ranks took 42 s on the 2-core dev machine, 10^7 would take minutes); 2^17
# is far above any FSDP shard group in use (larger jobs shard over a group and replicate).
MAX_WORLD = 131072


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="plan model layouts; compare padding with FSDP2/FSDP1/DeepSpeed/Megatron",
        description=__doc__.split("\n\n", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama3-8b",
                   help="comma list of model ids (default llama3-8b); known: " + ", ".join(list_models(True)))
    p.add_argument("--world", default="1024", help=f"comma list of world sizes, 1..{MAX_WORLD} (default 1024)")
    p.add_argument("--granularity", default="row",
                   help=f"comma list of granularities for tensors with >= 2 dims ({GRANULARITY_FORMS}); default row. "
                        "shampoo:B (e.g. shampoo:1024) applies Shampoo.granularity_for(B) to every tensor "
                        "(whole B x B preconditioner tiles; --granularity-1d is then ignored)")
    p.add_argument("--granularity-1d", default=None,
                   help="granularity for 1-D tensors (biases, norms); default element")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype (default float32)")
    p.add_argument("--align-bytes", type=int, default=16, help="offset alignment in bytes (default 16)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel degree (default 1): plan the TP-local shapes over world/tp ranks")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel degree (default 1): each EP rank holds 1/ep of the routed experts, "
                        "sharded over world/(tp*ep) ranks in a group of their own per block")
    p.add_argument("--suggest", action="store_true",
                   help="for cells over 1%% padding, list smaller shard groups (HSDP) or merged groups that cut "
                        "it, each with the DeviceMesh and fully_shard calls that realise it")
    p.add_argument("--json", action="store_true", help="print one JSON document (a list, one object per cell)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="also write the cells with the run's conditions ({meta, cells}) to PATH, "
                        "for python benchmarks/render.py")
    p.add_argument("--list-models", action="store_true", help="list the model ids and exit")
    return p


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _parse(args) -> tuple[list[str], list[int], list[Granularity], Granularity | None]:
    models = _split(args.model)
    for m in models:
        get_model(m)  # raises ValueError naming the known ids
    worlds = []
    for w in _split(args.world):
        if not w.isdigit() or int(w) < 1:
            raise ValueError(f"world size {w!r} is not a positive integer")
        if int(w) > MAX_WORLD:
            raise ValueError(
                f"world size {w} is above {MAX_WORLD}: planning time and memory grow linearly with "
                "the number of ranks, and no FSDP shard group is that large; plan the shard group "
                "(HSDP replicates it over the rest of the job)"
            )
        worlds.append(int(w))
    grans = [_ShampooPolicy.parse(g) or Granularity.parse(g) for g in _split(args.granularity)]
    g1 = Granularity.parse(args.granularity_1d) if args.granularity_1d else None
    if not (models and worlds and grans):
        raise ValueError("--model, --world and --granularity each need at least one value")
    if args.align_bytes < 1:
        raise ValueError(f"--align-bytes must be >= 1 (got {args.align_bytes})")
    for w in worlds:
        dims = ParallelDims(w, args.tp, args.ep)  # raises naming --world/--tp/--ep
        for m in models:
            local_groups(get_model(m), dims)  # raises when a split does not divide
    return models, worlds, grans, g1


def _kind_label(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    first, last = names[0], names[-1]
    suffix = ".experts"
    if first.endswith(suffix) and last.endswith(suffix):  # layers.0..47.experts
        return _kind_label([n[:-len(suffix)] for n in names]) + suffix
    head, _, tail = last.rpartition(".")
    if first.startswith(head + ".") and head:
        return f"{first}..{tail}"
    return f"{first}..{last}"


class _ShampooPolicy:
    """``shampoo:B``: each tensor's granularity from ``Shampoo.granularity_for(B)``."""

    def __init__(self, max_dim: int):
        self.max_dim = max_dim

    def __str__(self) -> str:
        return f"shampoo:{self.max_dim}"

    @classmethod
    def parse(cls, text: str):
        kind, sep, count = text.strip().lower().partition(":")
        if kind != "shampoo":
            return None
        if not (sep and count.isdigit() and int(count) >= 1):
            raise ValueError(f"granularity {text!r}: write shampoo:B with B >= 1 (e.g. shampoo:1024)")
        return cls(int(count))


def _cell(model_id: str, world: int, gran: Granularity, g1, itemsize: int, align: int, want_suggest: bool,
          tp: int = 1, ep: int = 1) -> dict:
    model = get_model(model_id)
    dims = ParallelDims(world, tp, ep)
    lgroups = local_groups(model, dims)
    if isinstance(gran, _ShampooPolicy):
        from ..optim.shampoo_blocks import shampoo_specs

        specs = dict(shampoo_specs(lgroups, gran.max_dim, itemsize))
        g1 = "shampoo"
    else:
        specs = {g.name: group_specs(g, gran, g1, itemsize) for g in lgroups}
    sections = [Section(kind, dp, [(g.name, specs[g.name]) for g in lgroups if g.kind == kind])
                for kind, dp in (("dense", dims.dense_dp), ("experts", dims.expert_dp))]
    sections = [s for s in sections if s.groups]
    sp = plan_sections(sections, align)
    errors = sp.validate()
    base = {name: [0, 0] for name in BASELINES}  # padding, blocks cut
    kinds = []
    for sec, mp in sp.sections:
        for k in mp.kinds:
            kspecs = mp.group_specs[k.groups[0]]
            for name, res in all_baselines(kspecs, sec.world_size).items():
                base[name][0] += res.padding * k.count
                base[name][1] += res.blocks_cut * k.count
            p = k.plan
            kinds.append({
                "group": _kind_label([mp.group_names[i] for i in k.groups]), "count": k.count,
                "kind": sec.kind, "dp_ranks": sec.world_size,
                "tensors": len(kspecs), "segment": p.segment, "padding_ratio": p.padding_ratio,
                "lower_bound_ratio": p.lower_bound_ratio, "plan_seconds": p.plan_seconds,
                "strategy": p.strategy,
            })
    used = sp.used
    out = {
        "model": model.id, "world_size": world, "tp": tp, "ep": ep, "dense_dp": dims.dense_dp,
        "expert_dp": dims.expert_dp, "granularity": str(gran),
        "granularity_1d": str(g1 or "element"), "itemsize": itemsize, "align_bytes": align,
        "params": used, "padding_ratio": sp.padding_ratio, "lower_bound_ratio": sp.lower_bound_ratio,
        "plan_seconds": sp.plan_seconds, "valid": not errors, "errors": errors[:5],
        "bytes_per_rank": sp.bytes_per_rank, "groups": kinds,
        "baselines": {name: {"padding_ratio": pad / used if used else 0.0, "blocks_cut": cut}
                      for name, (pad, cut) in base.items()},
    }
    title = f"{model.id}, W={world}, tp={tp}, ep={ep}"
    if not dims.trivial or want_suggest:
        out["mesh"] = mesh_layout(world, tp, ep).as_dict()
        out["recipe"] = recipe(module_map(model), world, tp, ep, title=f"{title}: as planned")
    if want_suggest and sp.padding_ratio > SUGGEST_ABOVE:
        mm, rows = module_map(model), []
        for s in suggest_sections(sections, align, current=sp):
            hsdp = s.value if s.kind == "hsdp" else None
            merge = s.value if s.kind == "merge" else 1
            rows.append({
                "kind": s.kind, "value": s.value, "description": s.describe(), "padding_ratio": s.padding_ratio,
                "bytes_per_rank": s.bytes_per_rank, "gathered_bytes": s.gathered_bytes,
                "replicas": s.replicas, "mesh": mesh_layout(world, tp, ep, hsdp).as_dict(),
                "recipe": recipe(mm, world, tp, ep, hsdp=hsdp, merge=merge, title=f"{title}: {s.describe()}"),
                "recipe_brief": recipe(mm, world, tp, ep, hsdp=hsdp, merge=merge, title=s.describe(), brief=True),
            })
        out["suggestions"] = rows
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.3f}%" if x < 10 else f"{x * 100:.0f}%"


def _gib(b: int) -> str:
    return f"{b / 2**30:.3f} GiB"


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _print_cell(c: dict, out, show_recipe: bool = False) -> None:
    par = c["tp"] > 1 or c["ep"] > 1
    mesh = f"  tp={c['tp']} ep={c['ep']}" if par else ""
    print(f"== {c['model']}  W={c['world_size']}{mesh}  granularity={c['granularity']} "
          f"(1-D: {c['granularity_1d']}, {c['itemsize']}-byte elements, {c['align_bytes']}-byte alignment) ==", file=out)
    if par:
        m = c["mesh"]
        print(f"mesh {tuple(m['shape'])} {tuple(m['dim_names'])}: TP-/EP-local shapes; dense groups sharded over "
              f"{c['dense_dp']} ranks" + (f", routed experts over {c['expert_dp']}" if c["ep"] > 1 else ""), file=out)
    rows = [["group", "count", "tensors"] + (["dp ranks"] if par else []) +
            ["segment S", "padding", "bound", "plan s", "packing"]]
    for k in c["groups"]:
        rows.append([k["group"], str(k["count"]), str(k["tensors"])] + ([str(k["dp_ranks"])] if par else []) +
                    [str(k["segment"]), _pct(k["padding_ratio"]),
                     _pct(k["lower_bound_ratio"]), f"{k['plan_seconds']:.4f}", k["strategy"]])
    rows.append(["whole model", str(sum(k["count"] for k in c["groups"])), ""] + ([""] if par else []) +
                ["", _pct(c["padding_ratio"]), _pct(c["lower_bound_ratio"]), f"{c['plan_seconds']:.4f}",
                 "valid" if c["valid"] else "INVALID"])
    print(_table(rows, set(range(1, len(rows[0]) - 1))), file=out)
    for e in c["errors"]:
        print(f"  error: {e}", file=out)
    rows = [["scheme", "padding", "blocks cut"], ["ragged (planner)", _pct(c["padding_ratio"]), "0"]]
    for name, b in c["baselines"].items():
        rows.append([name, _pct(b["padding_ratio"]), str(b["blocks_cut"])])
    print(_table(rows, {1, 2}), file=out)
    print(f"parameter memory per rank: {_gib(c['bytes_per_rank'])}", file=out)
    if show_recipe and par:
        print("\n" + c["recipe"].rstrip("\n") + "\n", file=out)
    if "suggestions" in c:
        if c["suggestions"]:
            rows = [["way out", "padding", "params/rank", "largest gather"]]
            for s in c["suggestions"]:
                rows.append([s["description"], _pct(s["padding_ratio"]), _gib(s["bytes_per_rank"]),
                             _gib(s["gathered_bytes"])])
            print(f"padding above 1%; alternatives that cut it (per lever, the 3 with the least memory), "
                  f"ordered by {ORDER}:", file=out)
            print(_table(rows, {1, 2, 3}), file=out)
            for i, s in enumerate(c["suggestions"]):
                brief = bool(i) or (show_recipe and par)  # imports (and TP plan) printed once
                note = ", imports as above" if brief else ""
                print(f"\n# way out {i + 1} of {len(c['suggestions'])}{note}:", file=out)
                print(s["recipe_brief" if brief else "recipe"].rstrip("\n"), file=out)
        else:
            print("padding above 1%; no smaller shard group or merge cuts it", file=out)
    print(file=out)


def run(args) -> int:
    if args.list_models:
        for m in list_models(True):
            print(m)
        return 0
    try:
        models, worlds, grans, g1 = _parse(args)
    except ValueError as exc:
        print(f"plan: error: {exc}", file=sys.stderr)
        return 2
    itemsize = DTYPES[args.dtype]
    cells = []
    for m in models:
        for w in worlds:
            for g in grans:
                c = _cell(m, w, g, g1, itemsize, args.align_bytes, args.suggest, args.tp, args.ep)
                cells.append(c)
                if not args.json:
                    _print_cell(c, sys.stdout, args.suggest)
    if args.json:
        json.dump(cells, sys.stdout, indent=1)
        sys.stdout.write("\n")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": run_meta(), "cells": cells}, indent=1))
    return 0 if all(c["valid"] for c in cells) else 1
