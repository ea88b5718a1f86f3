"""Check a plan against every layout constraint, independently of how it was made."""

from __future__ import annotations

from collections.abc import Sequence

from ..run_counts import total
from .granularity import TensorSpec
from .plan import Plan
from .problem import align_elems

__all__ = ["validate_plan"]


def validate_plan(plan: Plan, specs: Sequence[TensorSpec]) -> list[str]:
    """Every broken constraint, one message each; an empty list means the plan is valid."""
    errs: list[str] = []
    W, S = plan.world_size, plan.segment
    if W < 1:
        return [f"world_size={W} must be >= 1"]
    if S < 0:
        return [f"segment S={S} must be >= 0"]
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        errs.append("tensor names repeat in the group")
    itemsizes = {s.itemsize for s in specs}
    a = align_elems(plan.align_bytes, min(itemsizes)) if itemsizes else 1
    if len(itemsizes) > 1:
        errs.append(f"the group mixes itemsizes {sorted(itemsizes)}; plan one dtype per group")
    if S % a:
        errs.append(f"segment S={S} is not a multiple of the alignment ({a} elements)")
    missing = [n for n in names if n not in plan.offsets]
    extra = [n for n in plan.offsets if n not in set(names)]
    if missing:
        errs.append(f"no offset for {missing}")
    if extra:
        errs.append(f"offsets for tensors not in the group: {extra}")
    if sorted(plan.order) != sorted(names):
        errs.append("plan.order does not list each tensor of the group exactly once")
    if missing:
        return errs
    total = W * S
    by_name = {s.name: s for s in specs}
    runs = []
    for s in specs:
        lo, e, g = plan.offsets[s.name], s.numel, s.block_elems
        hi = lo + e
        if lo < 0 or hi > total:
            errs.append(f"{s.name}: [{lo}, {hi}) leaves the buffer [0, {total})")
        if lo % a:
            errs.append(f"{s.name}: offset {lo} is not aligned to {a} elements ({plan.align_bytes} bytes)")
        if e > 0:
            runs.append((lo, hi, s.name))
        if S > 0 and e > 0:
            k = lo // S + 1
            while k * S < hi:
                cut = k * S - lo
                if cut % g:
                    errs.append(
                        f"{s.name}: boundary {k * S} (rank {k - 1}|{k}) cuts a block: {cut} elements "
                        f"from the tensor start, not a multiple of its block {g} ({s.gran})"
                    )
                    break
                k += 1
    runs.sort()
    for (lo1, hi1, n1), (lo2, hi2, n2) in zip(runs, runs[1:]):
        if lo2 < hi1:
            errs.append(f"{n1} [{lo1}, {hi1}) and {n2} [{lo2}, {hi2}) overlap")
    order_offsets = [plan.offsets[n] for n in plan.order if n in plan.offsets]
    if order_offsets != sorted(order_offsets):
        errs.append("plan.order is not sorted by offset")
    if errs:
        return errs
    for s in specs:
        errs.extend(_check_placement(plan, by_name[s.name]))
    return errs


def _check_placement(plan: Plan, s: TensorSpec) -> list[str]:
    W, S = plan.world_size, plan.segment
    try:
        p = plan.placement(s.name)
        p.check(s.shape, W)
    except ValueError as exc:
        return [f"{s.name}: placement is inconsistent: {exc}"]
    dims, unit = s.placement_dims_unit()
    if p.dims != dims or p.unit != unit:
        return [f"{s.name}: placement dims/unit {p.dims}/{p.unit} differ from its granularity's {dims}/{unit}"]
    lo, e = plan.offsets[s.name], s.numel
    if e == 0 or S == 0:
        return []
    inner, m = p.inner(s.shape), p.axis_len(s.shape)
    first, last = lo // S, (lo + e - 1) // S
    units = p.local_units
    if sum(units[first:last + 1]) != total(units):
        return [f"{s.name}: placement gives units to ranks whose segments do not hold the tensor"]
    done = 0  # units before the first rank: zero, by the check above
    for k in range(first, last + 1):
        a_ax, b_ax = done * unit, (done + units[k]) * unit
        got = (min(a_ax, m) * inner, min(b_ax, m) * inner)
        want = (max(lo, k * S) - lo, min(lo + e, (k + 1) * S) - lo)
        if got != want:
            return [f"{s.name}: rank {k} gets elements {got} from its placement but {want} from the buffer"]
        done += units[k]
    return []
