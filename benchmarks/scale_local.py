"""Planning ``checkpoint.save_local`` / ``load_local`` at W ranks from shapes alone.

A local save has no coordinator: each rank writes its part and its ``.meta``, whose size
and build time are what grows with the model and W. A load reads one ``.meta`` and finds,
for each tensor it holds, the saved ranks' pieces (``RunLayout.pieces``). Both are measured
here on the layout math (``scale_layout``), for the first, middle and last rank.
"""

from __future__ import annotations

import pickle
import time

from ragged_fsdp.checkpoint.local_layout import RunLayout, encode_runs

from scale_layout import ragged_plans, span_placement

__all__ = ["meta_entries", "plan_local"]


def meta_entries(groups, plans, world: int) -> dict:
    """The ``entries`` of a part's ``.meta`` (as ``local_save.part_meta`` writes them), built
    from each tensor's span: zeros, the span's runs, zeros."""
    out = {}
    for wg, plan in zip(groups, plans):
        for name, shape in zip(wg.names, wg.shapes):
            span, pl = span_placement(plan, name)
            runs = ([[0, span.start]] if span.start else []) + encode_runs(pl.local_units) + \
                ([[0, world - span.stop]] if world > span.stop else [])
            out[wg.fqn(name)] = {"kind": "ragged", "shape": tuple(shape), "dtype": "torch.float32",
                                 "dims": tuple(pl.dims), "unit": pl.unit, "runs": runs}
    return out


def plan_local(groups, plans, world: int, load_to: int | None, granularity: str | None) -> dict:
    """Part ``.meta`` bytes and build CPU at ``world``; per sampled rank of ``load_to``, the CPU
    of finding its pieces, how many and from how many parts."""
    t0 = time.process_time()
    entries = meta_entries(groups, plans, world)
    meta = {"format": 1, "rank": 0, "world": world, "entries": entries}
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    build = time.process_time() - t0
    t1 = time.process_time()
    pickle.loads(blob)
    read = time.process_time() - t1
    out = {"world": world, "meta_bytes_per_rank": len(blob), "meta_build_cpu_s": build, "meta_read_cpu_s": read,
           "coordinator_cpu_s": 0.0, "collectives_at_save": 0}
    if not load_to:
        return out
    target = ragged_plans(groups, load_to, granularity)
    layouts = {k: RunLayout(e["shape"], e["dims"], e["unit"], tuple(map(tuple, e["runs"]))) for k, e in entries.items()}
    ranks = {}
    for r in sorted({0, load_to // 2, load_to - 1}):
        # what the loading rank holds (it knows from its own DTensors; not timed)
        held = []
        for wg, plan in zip(groups, target):
            for name, shape in zip(wg.names, wg.shapes):
                span, pl = span_placement(plan, name)
                if r in span:
                    held.append((wg.fqn(name), *pl.element_range(shape, r - span.start)))
        t = time.process_time()
        pieces, sources = 0, set()
        for fqn, a, b in held:
            for pc in layouts[fqn].pieces(a, b):
                pieces += 1
                sources.add(pc.rank)
        ranks[r] = {"cpu_s": time.process_time() - t, "pieces": pieces, "parts_read": len(sources)}
    out["load"] = {"world": load_to, "ranks": ranks}
    return out

