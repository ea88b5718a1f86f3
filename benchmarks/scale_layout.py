"""The layout math behind ``scale.py``: which checkpoint chunks every rank of W holds.

Pure (no process group, no tensors): given a catalog model wrapped the way the bench wraps it
(one ``fully_shard`` per transformer block, then the root, which takes the embedding, the
final norm and the head), it says

* for ragged_fsdp: the planner's layout of each group (rank-independent, exactly what
  ``fully_shard`` plans on every rank) and the boxes DCP gets from each rank
  (``RaggedUnits.local_boxes``);
* for FSDP2: each tensor's ``Shard(0)`` chunk (``torch.chunk`` rule: ``ceil(d0 / W)`` rows
  per rank, an empty chunk past the end; FSDP2 still writes one item per tensor per rank).

The bench builds the W local save plans from this instead of building W state dicts, and
checks it against the plans of real ``fully_shard``-ed ranks on the fake process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragged_fsdp.models.catalog import Group, ModelShapes, get_model
from ragged_fsdp.planner import Granularity, TensorSpec, plan_group
from ragged_fsdp.planner.plan import Plan
from ragged_fsdp.ragged_units import RaggedUnits

__all__ = [
    "WrapGroup", "wrap_groups", "module_order", "ragged_plans", "ragged_chunks", "fsdp2_chunk",
    "fsdp2_chunks", "items_per_rank", "span_placement", "loglog_exponent", "subset_model",
]

# A DCP chunk: (fqn, offsets, sizes)
Chunk = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class WrapGroup:
    """One ``fully_shard`` group: ``prefix`` is the wrapped module's FQN ("" for the root);
    ``names`` are the parameters' names inside it, in ``named_parameters`` order."""

    prefix: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def fqn(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name


def module_order(names: Sequence[str]) -> list[str]:
    """``names`` in the order ``nn.Module.named_parameters`` lists them when the modules are
    created in first-appearance order: a module's own parameters, then its children's, depth
    first. (The planner gets the parameters in this order, so the math must use it too.)"""
    tree: dict = {}
    for n in names:
        *mods, leaf = n.split(".")
        node = tree
        for m in mods:
            node = node.setdefault(("m", m), {})
        node[("p", leaf)] = n

    out: list[str] = []

    def visit(node):
        for (kind, _), v in node.items():
            if kind == "p":
                out.append(v)
        for (kind, _), v in node.items():
            if kind == "m":
                visit(v)

    visit(tree)
    return out


def subset_model(model_id: str, layers: Sequence[int] | None = None, experts: int | None = None) -> ModelShapes:
    """The catalog model, or only the blocks ``layers`` (embedding and head always kept), and
    with ``experts``: only the first ``experts`` routed experts of each MoE block."""
    m = get_model(model_id)
    keep = None if layers is None else {f"layers.{i}" for i in layers}
    groups = []
    for g in m.groups:
        if keep is not None and g.name.startswith("layers.") and g.name not in keep:
            continue
        if experts is not None:
            g = Group(g.name, [t for t in g.tensors if t.expert is None or 0 <= t.expert < experts])
        groups.append(g)
    return ModelShapes(m.id, m.base, m.variant, m.config, groups)


def wrap_groups(model: ModelShapes) -> list[WrapGroup]:
    """The groups ``fully_shard`` forms: one per block (``model.layers.{i}``), then the root."""
    shapes = {t.name: tuple(t.shape) for g in model.groups for t in g.tensors}
    order = module_order(list(shapes))
    out, rest = [], []
    layer_names: dict[str, list[str]] = {}
    for g in model.groups:
        if g.name.startswith("layers."):
            layer_names[g.name] = [t.name for t in g.tensors]
    claimed = set()
    for gname, names in layer_names.items():
        prefix = f"model.{gname}"
        inner = [n for n in order if n.startswith(prefix + ".")]
        if set(inner) != set(names):
            raise ValueError(f"scale bench: block {gname} does not live under {prefix!r}")
        claimed.update(inner)
        out.append(WrapGroup(prefix, tuple(n[len(prefix) + 1:] for n in inner), tuple(shapes[n] for n in inner)))
    rest = [n for n in order if n not in claimed]
    out.append(WrapGroup("", tuple(rest), tuple(shapes[n] for n in rest)))
    return out


def ragged_plans(groups: Sequence[WrapGroup], world_size: int, granularity: str | None,
                 itemsize: int = 4) -> list[Plan]:
    """The planner's layout of each group, as ``fully_shard(granularity_fn=lambda n, p:
    granularity)`` plans it (16-byte alignment, the engine's default)."""
    g = None if granularity is None else Granularity.parse(granularity)
    return [
        plan_group([TensorSpec(n, s, itemsize=itemsize, granularity=g) for n, s in zip(wg.names, wg.shapes)],
                   world_size, align_bytes=16)
        for wg in groups
    ]


def _span(plan: Plan, name: str) -> range:
    """The ranks whose segment the tensor overlaps (the only ones that can hold a box)."""
    S, lo, n = plan.segment, plan.offsets[name], plan.specs[name].numel
    if n == 0 or S == 0:
        return range(0, 1)
    return range(lo // S, min(plan.world_size, -(-(lo + n) // S)))


def span_placement(plan: Plan, name: str) -> tuple[range, RaggedUnits]:
    """The ranks the tensor spans and its placement restricted to them (rank ``r`` of the
    span is index ``r - span.start``). Every rank outside the span holds no unit, so the
    restricted placement gives the same boxes; ``Plan.placement`` builds all W counts, which
    for every tensor of DeepSeek-V3 at W=16,384 is 740 M numbers."""
    spec = plan.specs[name]
    dims, unit = spec.placement_dims_unit()
    span = _span(plan, name)
    probe = RaggedUnits(dims, (0,), unit)
    inner, total = probe.inner(spec.shape), probe.num_units(spec.shape)
    S, lo, e = plan.segment, plan.offsets[name], spec.numel
    if e == 0 or S == 0:
        return span, RaggedUnits(dims, (total,), unit)
    g = unit * inner  # the same count as Plan.placement: blocks (a partial last one counts) per segment
    counts = [-(-(min(lo + e, (k + 1) * S) - lo) // g) - (max(lo, k * S) - lo) // g for k in span]
    return span, RaggedUnits(dims, counts, unit)


def ragged_chunks(groups: Sequence[WrapGroup], plans: Sequence[Plan], world_size: int,
                  ranks: Sequence[int] | None = None) -> dict[int, list[Chunk]]:
    """The chunks each rank of ``ranks`` (default: all) hands DCP (``placement/dcp.py``'s
    boxes), in state-dict order. Each tensor visits only the ranks its range spans, and each
    placement is built once, so all W ranks cost O(tensors + boxes) in all."""
    want = range(world_size) if ranks is None else ranks
    out: dict[int, list[Chunk]] = {r: [] for r in want}
    for wg, plan in zip(groups, plans):
        for name, shape in zip(wg.names, wg.shapes):
            fqn = wg.fqn(name)
            if math.prod(shape) == 0:
                if 0 in out:  # an empty tensor: rank 0 declares one empty chunk
                    out[0].append((fqn, (0,) * len(shape), shape))
                continue
            span, pl = span_placement(plan, name)
            for r in span:
                if r in out:
                    out[r].extend((fqn, tuple(o), tuple(z)) for o, z in pl.local_boxes(shape, r - span.start))
    return out


def fsdp2_chunk(shape: Sequence[int], world_size: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FSDP2's ``Shard(0)`` chunk of ``shape`` on ``rank``: ``torch.chunk`` rows, empty (at
    offset ``d0``) on the ranks past the last chunk."""
    d0 = shape[0]
    c = -(-d0 // world_size)
    off = min(rank * c, d0)
    rows = max(0, min(d0, off + c) - off)
    return (off,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:])


def fsdp2_chunks(groups: Sequence[WrapGroup], world_size: int, rank: int) -> list[Chunk]:
    return [(wg.fqn(n), *fsdp2_chunk(s, world_size, rank)) for wg in groups for n, s in zip(wg.names, wg.shapes)]


def items_per_rank(groups: Sequence[WrapGroup], plans: Sequence[Plan] | None, world_size: int) -> list[int]:
    """Save-plan items on every rank: ragged_fsdp's (``plans`` given) or FSDP2's (None, one
    per tensor everywhere). Only the ranks a tensor spans are visited, so this costs
    O(tensors + boxes), not O(W x tensors)."""
    if plans is None:
        return [sum(len(wg.names) for wg in groups)] * world_size
    counts = [0] * world_size
    for wg, plan in zip(groups, plans):
        for name, shape in zip(wg.names, wg.shapes):
            if math.prod(shape) == 0:
                counts[0] += 1
                continue
            span, pl = span_placement(plan, name)
            for r in span:
                counts[r] += len(pl.local_boxes(shape, r - span.start))
    return counts


def loglog_exponent(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of the least-squares line through ``(log x, log y)``: y ~ x^slope. None when
    fewer than two points are positive (nothing to fit)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
