"""The layout planner: granularity, bound, heuristic, validator, exact solver, baselines."""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ragged_fsdp.placement import RaggedShard
from ragged_fsdp.planner import (
    Granularity, Plan, TensorSpec, all_baselines, lower_bound, plan_group, plan_model,
    solve_exact, suggest, validate_plan,
)
from ragged_fsdp.planner.baselines import count_cut_blocks
from ragged_fsdp.planner.problem import Problem, earliest_start

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- granularity ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, n", [
    ("element", "element", 1), ("row", "row", 1), ("rows:16", "rows", 16), ("block:256", "block", 256),
    ("tensor", "tensor", 1), (" Rows:3 ", "rows", 3),
])
def test_parse_valid(text, kind, n):
    g = Granularity.parse(text)
    assert (g.kind, g.n) == (kind, n)
    assert Granularity.parse(str(g)) == g
    assert Granularity.parse(g) is g


def test_parse_none_passes_through():
    assert Granularity.parse(None) is None


@pytest.mark.parametrize("bad", ["rows", "rows:0", "rows:-2", "block:", "blocks:4", "col", "rows:2.5", "", "row:4"])
def test_parse_bad_names_spec_and_forms(bad):
    with pytest.raises(ValueError) as info:
        Granularity.parse(bad)
    msg = str(info.value)
    assert repr(bad) in msg and "rows:K" in msg and "block:N" in msg


@pytest.mark.parametrize("shape", [(), (7,), (5, 6), (4, 3, 10), (2, 3, 4, 5), (0, 8), (3, 0)])
@pytest.mark.parametrize("spec", ["element", "row", "rows:4", "block:5", "tensor"])
def test_block_elems_matches_placement(shape, spec):
    g = Granularity.parse(spec)
    if spec == "rows:4" and len(shape) == 0:
        with pytest.raises(ValueError, match="0-d"):
            g.block_elems(shape)
        return
    dims, unit = g.placement_dims_unit(shape)
    assert dims == tuple(range(len(dims)))
    assert g.block_elems(shape) == unit * math.prod(shape[len(dims):])
    expect = {"element": 1, "block": 5, "tensor": math.prod(shape)}.get(g.kind)
    if g.kind in ("row", "rows"):
        expect = math.prod(shape) if len(shape) <= 1 else (g.n * shape[-1])
    assert g.block_elems(shape) == expect


def test_tensor_spec_normalises():
    s = TensorSpec("w", [4, 5], torch.bfloat16, "rows:2")
    assert s.shape == (4, 5) and s.itemsize == 2 and s.granularity == Granularity("rows", 2)
    assert s.numel == 20 and s.block_elems == 10
    assert TensorSpec("b", (3,)).gran == Granularity("element")
    with pytest.raises(ValueError, match="'x'"):
        TensorSpec("x", (), 4, "rows:2")


# -- the constraint math ------------------------------------------------------------------
def _valid_start(l, e, g, S, a):
    if l % a:
        return False
    return all((k * S - l) % g == 0 for k in range(l // S + 1, (l + e - 1) // S + 1) if l < k * S < l + e)


@given(st.integers(1, 40), st.integers(1, 12), st.integers(1, 4), st.integers(1, 12), st.integers(0, 60))
@settings(max_examples=400, deadline=None)
def test_earliest_start_is_the_first_valid_offset(e, g, a, s_mult, p_mult):
    S, p = a * s_mult, a * p_mult
    L = g * a // math.gcd(g, a)
    got = earliest_start(p, e, L, S)
    horizon = p + 4 * S + 2 * e
    brute = next((l for l in range(p, horizon) if _valid_start(l, e, g, S, a)), None)
    assert got == brute


# -- hand-built plans and the validator -----------------------------------------------------
def _hand_plan():
    specs = [TensorSpec("a", (4, 8), 4, "rows:2"), TensorSpec("b", (10,), 4), TensorSpec("c", (3, 4), 4, "row")]
    # W=3, S=16: a [0,32) cut at 16 (2 rows of 8), b [32,42), c [44,56)? too big: use S=20
    plan = Plan(world_size=3, segment=20, offsets={"a": 0, "b": 32, "c": 44}, order=["a", "b", "c"],
                specs={s.name: s for s in specs}, align_bytes=16)
    return plan, specs


def test_hand_plan_is_valid_and_placements_match():
    plan, specs = _hand_plan()
    # a: [0,32): boundary 20 is 20 into a: 20 % 16 != 0 -> must fix: rebuild with S=16
    plan.segment = 16  # buffer 48; a [0,32) cuts at 16 (a block edge), b [32,42), c does not fit
    plan.offsets["c"] = 44
    assert any("leaves the buffer" in m for m in validate_plan(plan, specs))
    plan.world_size = 4  # buffer 64: c [44,56) crosses 48 at 4 elements = one row of c
    assert validate_plan(plan, specs) == []
    assert plan.placement("a") == RaggedShard((0,), (1, 1, 0, 0), 2)
    assert plan.placement("c") == RaggedShard((0,), (0, 0, 1, 2), 1)
    assert plan.placement("b") == RaggedShard((0,), (0, 0, 10, 0), 1)
    assert plan.local_range("c", 2) == (12, 16) and plan.local_range("c", 3) == (0, 8)
    assert plan.local_range("a", 3) == (0, 0)
    assert plan.total == 64 and plan.used == 54 and plan.padding == 10


@pytest.mark.parametrize("breakage, expect", [
    (lambda p: p.offsets.__setitem__("b", 28), "overlap"),
    (lambda p: p.offsets.__setitem__("c", 60), "leaves the buffer"),
    (lambda p: p.offsets.__setitem__("b", 34), "not aligned"),
    (lambda p: setattr(p, "segment", 18), "not a multiple of the alignment"),
    (lambda p: p.offsets.__setitem__("a", 4), "cuts a block"),
    (lambda p: p.offsets.pop("b"), "no offset"),
    (lambda p: p.order.reverse(), "not sorted"),
])
def test_validator_catches_each_broken_constraint(breakage, expect):
    plan, specs = _hand_plan()
    plan.segment, plan.world_size = 16, 4
    assert validate_plan(plan, specs) == []
    breakage(plan)
    errs = validate_plan(plan, specs)
    assert errs and any(expect in m for m in errs), errs


def test_validator_catches_a_cut_block_of_a_rows_tensor():
    plan, specs = _hand_plan()
    plan.segment, plan.world_size = 12, 6  # a [0,32): boundary 12 is 12 into a: 2-row blocks are 16
    plan.offsets.update(b=32, c=44)
    assert any("a: boundary 12" in m and "rows:2" in m for m in validate_plan(plan, specs))


def test_validator_catches_inconsistent_placements():
    plan, specs = _hand_plan()
    plan.segment, plan.world_size = 16, 4

    class Wrong(Plan):
        def placement(self, name):
            p = super().placement(name)
            if name == "c":
                return RaggedShard(p.dims, (0, 0, 2, 1), p.unit)  # units sum right, ranges wrong
            if name == "a":
                return RaggedShard(p.dims, (1, 0, 0, 0), p.unit)  # units do not cover a
            return p

    bad = Wrong(**{f: getattr(plan, f) for f in ("world_size", "segment", "offsets", "order", "specs", "align_bytes")})
    errs = validate_plan(bad, specs)
    assert any(m.startswith("a: placement is inconsistent") for m in errs), errs
    assert any(m.startswith("c: rank 2 gets elements") for m in errs), errs


# -- heuristic plans -----------------------------------------------------------------------
GRANS = [None, "element", "row", "rows:2", "rows:3", "block:4", "block:7", "block:64", "tensor"]


@st.composite
def instances(draw, max_tensors=8, max_dim=12):
    n = draw(st.integers(0, max_tensors))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    specs = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0 if i % 5 == 4 else 1, max_dim), min_size=0, max_size=3)))
        gran = draw(st.sampled_from(GRANS))
        if gran == "rows:2" and not shape or gran == "rows:3" and not shape:
            gran = "row"
        specs.append(TensorSpec(f"t{i}", shape, itemsize, gran))
    world = draw(st.sampled_from([1, 1, 2, 3, 4, 5, 7, 8, 16, 64]))
    align = draw(st.sampled_from([1, 4, 16, 64]))
    return specs, world, align


def _check_plan(plan, specs):
    assert validate_plan(plan, specs) == []
    assert plan.total >= plan.lower_bound >= plan.used
    W = plan.world_size
    for s in specs:
        p = plan.placement(s.name)
        assert len(p.local_units) == W
        assert sum(p.local_units) == p.num_units(s.shape)
        lo = plan.offsets[s.name]
        for r in range(W):
            a, b = plan.local_range(s.name, r)
            ea, eb = p.element_range(s.shape, r)
            if eb > ea:
                assert (r * plan.segment + a - lo, r * plan.segment + b - lo) == (ea, eb)
            else:
                assert a == b


def _counted_rank_by_rank(plan, name):
    """Each rank's units, counted segment by segment (what Plan.placement did before it
    took the inner segments as one run)."""
    spec = plan.specs[name]
    p = plan.placement(name)
    g = p.unit * p.inner(spec.shape)
    lo, e, S, W = plan.offsets[name], spec.numel, plan.segment, plan.world_size
    if not p.num_units(spec.shape) or e == 0 or S == 0:
        return None
    out = [0] * W
    for k in range(lo // S, min(W, -(-(lo + e) // S))):
        a, b = max(lo, k * S) - lo, min(lo + e, (k + 1) * S) - lo
        out[k] = -(-b // g) - a // g
    return tuple(out)


@given(instances())
@FAST
def test_placement_runs_are_the_counts_of_each_segment(inst):
    specs, world, align = inst
    plan = plan_group(specs, world, align)
    for s in specs:
        want = _counted_rank_by_rank(plan, s.name)
        if want is not None:
            assert tuple(plan.placement(s.name).local_units) == want


def test_placement_of_a_tensor_over_many_segments_is_five_runs():
    from ragged_fsdp.run_counts import RunCounts

    specs = [TensorSpec("a", (3, 5), 4, "row"), TensorSpec("w", (1000, 6), 4, "row"), TensorSpec("b", (7,), 4)]
    for W in (64, 4096):
        plan = plan_group(specs, W, 16)
        _check_plan(plan, specs)
        lu = plan.placement("w").local_units
        assert isinstance(lu, RunCounts) and len(lu.runs()) <= 5
        assert tuple(lu) == _counted_rank_by_rank(plan, "w")


@given(instances())
@FAST
def test_heuristic_plans_always_validate(inst):
    specs, world, align = inst
    plan = plan_group(specs, world, align)
    _check_plan(plan, specs)
    assert plan.lower_bound == lower_bound(specs, world, align)
    assert plan.segment % max(1, align // (specs[0].itemsize if specs else 4)) == 0


def test_tensors_smaller_than_alignment_and_big_blocks():
    specs = [TensorSpec("tiny", (1,), 4), TensorSpec("two", (2,), 4, "tensor"),
             TensorSpec("blocky", (40, 10), 4, "rows:30"), TensorSpec("flat", (100,), 4)]
    for W in (1, 2, 8, 64):
        plan = plan_group(specs, W, 64)  # 16-element alignment
        _check_plan(plan, specs)
        assert plan.segment >= 300  # a 300-element block cannot be split
        assert all(o % 16 == 0 for o in plan.offsets.values())


def test_ranks_holding_zero_units():
    specs = [TensorSpec("w", (8, 4), 4, "row"), TensorSpec("v", (6,), 4)]
    plan = plan_group(specs, 16, 16)
    _check_plan(plan, specs)
    pw = plan.placement("w")
    assert 0 in pw.local_units and sum(pw.local_units) == 8
    empty = [r for r in range(16) if pw.local_units[r] == 0]
    for r in empty:
        assert pw.local_shape((8, 4), r) == (0, 4) and pw.local_boxes((8, 4), r) == []
        assert plan.local_range("w", r) == (0, 0)


def test_world_size_one_is_one_segment():
    specs = [TensorSpec("a", (5, 3), 4, "rows:2"), TensorSpec("b", (7,), 4)]
    plan = plan_group(specs, 1, 16)
    _check_plan(plan, specs)
    assert plan.segment == 16 + 8  # 15 -> 16 aligned, then 7 -> 8
    assert plan.placement("a").local_units == (3,)


def test_empty_group():
    plan = plan_group([], 8)
    assert plan.segment == 0 and plan.padding_ratio == 0.0 and validate_plan(plan, []) == []


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unique"):
        plan_group([TensorSpec("a", (2,)), TensorSpec("a", (3,))], 2)
    with pytest.raises(ValueError, match="itemsizes"):
        plan_group([TensorSpec("a", (2,), 4), TensorSpec("b", (3,), 2)], 2)
    with pytest.raises(ValueError, match="world_size"):
        plan_group([TensorSpec("a", (2,))], 0)


# -- exact solver and the lower bound ---------------------------------------------------------
def _brute_min_segment(specs, W, align_bytes):
    """Smallest S by enumerating every order and every aligned offset (tiny instances)."""
    prob = Problem.build(specs, W, align_bytes)
    a = prob.a
    S = a
    while True:
        cap = W * S
        for order in itertools.permutations(range(prob.n)):
            if _brute_fit(prob, S, cap, list(order), 0):
                return S
        S += a


def _brute_fit(prob, S, cap, order, p):
    if not order:
        return True
    t, rest = order[0], order[1:]
    e, g, a = prob.e[t], prob.g[t], prob.a
    for l in range(p, cap - e + 1):
        if _valid_start(l, e, g, S, a) and _brute_fit(prob, S, cap, rest, -(-(l + e) // a) * a):
            return True
    return False


@given(instances(max_tensors=3, max_dim=4))
@settings(max_examples=100, deadline=None)
def test_exact_matches_brute_force(inst):
    specs, world, align = inst
    assume(world <= 3 and sum(s.numel for s in specs) <= 24)
    exact = solve_exact(specs, world, align)
    assert validate_plan(exact, specs) == []
    if sum(s.numel for s in specs):
        assert exact.segment == _brute_min_segment(specs, world, align)


@given(instances(max_tensors=6))
@FAST
def test_lower_bound_below_exact_below_heuristic(inst):
    specs, world, align = inst
    heur = plan_group(specs, world, align)
    exact = solve_exact(specs, world, align, s_max=heur.segment)
    assert validate_plan(exact, specs) == []
    assert lower_bound(specs, world, align) <= exact.total <= heur.total


@st.composite
def repeated_instances(draw):
    """Few kinds of identical tensors (like a layer's experts) and maybe one flexible one."""
    specs = []
    for k in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 10), min_size=1, max_size=2)))
        gran = draw(st.sampled_from(["row", "rows:2", "rows:3", "block:4", "block:6", "tensor", None]))
        specs += [TensorSpec(f"k{k}.{c}", shape, 1, gran) for c in range(draw(st.integers(1, 6)))]
    if draw(st.booleans()):
        specs.append(TensorSpec("flex", (draw(st.integers(1, 9)),), 1))
    return specs, draw(st.sampled_from([2, 3, 4, 6, 8, 16])), draw(st.sampled_from([1, 2, 4]))


@given(repeated_instances())
@FAST
def test_lower_bound_below_exact_with_repeated_tensors(inst):
    specs, world, align = inst
    heur = plan_group(specs, world, align)
    exact = solve_exact(specs, world, align, s_max=heur.segment)
    assert validate_plan(heur, specs) == [] and validate_plan(exact, specs) == []
    assert heur.lower_bound <= exact.total <= heur.total


def test_lower_bound_respects_divisibility():
    # 100 rows of 7 in blocks of 4 rows (28 elements) over 10 ranks: capacity says 70, but a
    # tensor longer than 2S must have its block divide S: S=84 (3 blocks) is the first that
    # holds it (e >= 2S forces 28 | S for S <= 350)
    specs = [TensorSpec("w", (100, 7), 4, "rows:4")]
    assert lower_bound(specs, 10, 4) == 10 * 84
    assert plan_group(specs, 10, 4).segment == 84
    # a block larger than the natural segment sets the bound
    specs = [TensorSpec("big", (1000,), 4, "tensor"), TensorSpec("x", (8, 100), 4)]
    assert lower_bound(specs, 4, 4) == 4 * 1000


def test_grain_bound_counts_whole_blocks_per_segment():
    # four tensors of two 10-element rows and one flexible 8-element tensor over 4 ranks: the
    # capacity allows S=22, but a segment holds whole 10-element pieces of the row tensors
    # (20 or 30), and the 8 flexible elements touch at most two segments: S >= 24
    specs = [TensorSpec(f"t{i}", (2, 10), 1, "row") for i in range(4)] + [TensorSpec("f", (8,), 1)]
    assert lower_bound(specs, 4, 1) == 4 * 24
    exact = solve_exact(specs, 4, 1)
    assert exact.segment == 24 and validate_plan(exact, specs) == []
    assert plan_group(specs, 4, 1).segment == 24


# -- whole models -------------------------------------------------------------------------
def test_plan_model_dedupes_identical_groups():
    layer = lambda i: (f"layers.{i}", [TensorSpec(f"layers.{i}.w", (64, 32), 4, "rows:8"),
                                      TensorSpec(f"layers.{i}.b", (64,), 4)])
    groups = [("embed", [TensorSpec("embed", (100, 32), 4, "row")])] + [layer(i) for i in range(5)]
    mp = plan_model(groups, 8)
    assert [k.count for k in mp.kinds] == [1, 5]
    assert mp.validate() == []
    p3 = mp.plan("layers.3")
    assert set(p3.offsets) == {"layers.3.w", "layers.3.b"}
    assert p3.offsets["layers.3.w"] == mp.plan(1).offsets["layers.0.w"]
    assert validate_plan(p3, groups[4][1]) == []
    assert mp.used == 100 * 32 + 5 * (64 * 32 + 64)
    assert mp.padding_ratio >= mp.lower_bound_ratio >= 0


def test_suggest_cuts_padding():
    groups = [(f"g{i}", [TensorSpec(f"g{i}.w", (64, 64), 4, "rows:16")]) for i in range(4)]
    mp = plan_model(groups, 64)  # 4096-element groups, 1024-element blocks: 16x padding
    assert mp.padding_ratio > 1
    out = suggest(groups, 64, current=mp)
    assert out and all(s.padding_ratio < mp.padding_ratio for s in out)
    assert {s.kind for s in out} == {"hsdp", "merge"}
    # the stated order: padding, then memory at the all-gather peak
    keys = [(round(s.padding_ratio, 5), s.bytes_per_rank + s.gathered_bytes) for s in out]
    assert keys == sorted(keys)
    best_hsdp = min((s for s in out if s.kind == "hsdp"), key=lambda s: s.padding_ratio)
    assert best_hsdp.value <= 4 and best_hsdp.padding_ratio == 0  # 4 ranks hold 4 blocks each


# -- baselines ------------------------------------------------------------------------------
def test_baselines_hand_checked():
    # A: 10 rows of 4 in 2-row blocks (8 elements); B: 6 elements, element-granular. W = 4.
    specs = [TensorSpec("A", (10, 4), 4, "rows:2"), TensorSpec("B", (6,), 4)]
    res = all_baselines(specs, 4)
    # fsdp2: A -> 3 rows per rank, 12 rows: 2 padding rows (8 elements); cuts at elements
    # 12, 24, 36 -> 12 and 36 fall inside 8-element blocks. B -> 2 per rank, 8: 2 padding.
    assert (res["fsdp2"].padding, res["fsdp2"].blocks_cut) == (10, 2)
    # deepspeed: A -> 10 per rank (no padding), cuts 10, 20, 30 each inside a block;
    # B -> 2 per rank, padding 2, element blocks are never cut
    assert (res["deepspeed"].padding, res["deepspeed"].blocks_cut) == (2, 3)
    # fsdp1: 46 elements -> 12 per rank (48): cuts at 12, 24, 36 in A (12, 36 cut a block),
    # B = [40, 46) holds no cut
    assert (res["fsdp1"].padding, res["fsdp1"].blocks_cut) == (2, 2)
    # megatron: row sizes 4 and 1 -> chunks a multiple of 4: ceil(46/4)=12 -> 12, same cuts
    assert (res["megatron"].padding, res["megatron"].blocks_cut) == (2, 2)
    assert res["fsdp2"].padding_ratio == pytest.approx(10 / 46)


def test_megatron_rounds_chunks_to_the_row_lcm():
    specs = [TensorSpec("A", (3, 6), 4, "row"), TensorSpec("B", (2, 4), 4, "row")]
    res = all_baselines(specs, 2)["megatron"]
    assert res.per_rank == 24 and res.padding == 2 * 24 - 26  # ceil(26 / 2) = 13 -> 24, lcm(6, 4) = 12


@given(st.integers(1, 80), st.integers(1, 90), st.integers(1, 40), st.data())
@settings(max_examples=400, deadline=None)
def test_count_cut_blocks_matches_brute_force(e, g, step, data):
    assume(e > 1)
    x0 = data.draw(st.integers(1, e - 1))
    count = data.draw(st.integers(0, (e - 1 - x0) // step + 1))
    cuts = [x0 + j * step for j in range(count)]
    assert count_cut_blocks(x0, step, count, g, e) == len({p // g for p in cuts if p % g})
