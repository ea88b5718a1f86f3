"""DBuffer and BufferLayout without a process group: every rank's segment simulated in one
process (the concatenation of the W segments is what the all-gather produces)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_fsdp.dbuffer import BufferLayout, DBuffer, plan_layout

GRANS = [None, "element", "row", "rows:2", "rows:3", "block:8", "tensor"]


def _usable(shape, gran) -> bool:
    if gran in ("rows:2", "rows:3") and len(shape) == 0:
        return False
    return True


shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)
tensor_lists = st.lists(st.tuples(shapes, st.sampled_from(GRANS)), min_size=1, max_size=6)


def _layouts(tensors, W, itemsize=4):
    spec = [(f"t{i}", s, g) for i, (s, g) in enumerate(tensors)]
    return [plan_layout(spec, W, r, itemsize=itemsize) for r in range(W)]


@settings(max_examples=60, deadline=None)
@given(tensor_lists, st.integers(1, 5))
def test_segments_concatenate_to_the_full_buffer(tensors, W):
    tensors = [(s, g) for s, g in tensors if _usable(s, g)]
    if not tensors:
        return
    layouts = _layouts(tensors, W)
    fulls = [torch.randn(s) for s, _ in tensors]
    bufs = [DBuffer(L, device="cpu", dtype=torch.float32) for L in layouts]
    for buf in bufs:
        for i, t in enumerate(fulls):
            buf.copy_full_(i, t)
    gathered = torch.cat([b.sharded for b in bufs])
    assert gathered.numel() == layouts[0].total
    for i, (slot, t) in enumerate(zip(layouts[0].slots, fulls)):
        torch.testing.assert_close(gathered[slot.offset:slot.offset + slot.numel].view(t.shape), t)
    # the sharded views are this rank's piece of each tensor, as the placement says
    for r, buf in enumerate(bufs):
        for i, (slot, t) in enumerate(zip(buf.slots, fulls)):
            v = buf.sharded_view(i)
            assert tuple(v.shape) == slot.local_shape
            a, b = slot.placement.element_range(slot.shape, r)
            torch.testing.assert_close(v.reshape(-1), t.reshape(-1)[a:b])
            if v.numel():
                assert v.untyped_storage().data_ptr() == buf.sharded.untyped_storage().data_ptr()


@settings(max_examples=40, deadline=None)
@given(tensor_lists, st.integers(1, 5))
def test_granularity_blocks_are_never_cut(tensors, W):
    tensors = [(s, g) for s, g in tensors if _usable(s, g)]
    if not tensors:
        return
    L = _layouts(tensors, W)[0]
    for slot, (shape, g) in zip(L.slots, tensors):
        if g is None or g == "element":
            continue
        n = math.prod(shape)
        if g == "tensor":
            block = n
        elif g == "row":
            block = shape[-1] if len(shape) >= 2 else n
        elif g.startswith("rows:"):
            block = int(g[5:]) * shape[-1] if len(shape) >= 2 else n
        else:
            block = int(g[6:])
        for r in range(W):
            a, b = slot.placement.element_range(shape, r)
            if b > a:
                assert a % block == 0 and (b % block == 0 or b == n), (g, shape, r, a, b)


def _layout(W=3, rank=1):
    return plan_layout([("a", (5, 3), None), ("b", (7,), None), ("c", (), None)], W, rank, itemsize=4)


def test_unsharded_buffer_alloc_free_keeps_views_valid():
    buf = DBuffer(_layout(), device="cpu", dtype=torch.float32)
    assert not buf.unsharded_allocated
    views = buf.unsharded_views()
    flat = buf.alloc_unsharded()
    assert buf.unsharded_allocated and flat.numel() == buf.layout.total
    flat.fill_(2.0)
    assert views[0].shape == (5, 3) and float(views[0].sum()) == 30.0
    buf.free_unsharded()
    assert not buf.unsharded_allocated and flat.untyped_storage().nbytes() == 0
    buf.alloc_unsharded()
    assert buf.unsharded_views()[0] is views[0]  # same view objects, storage back
    assert views[0].untyped_storage().nbytes() == flat.numel() * 4


def test_aliased_at_world_size_one():
    buf = DBuffer(_layout(W=1, rank=0), device="cpu", dtype=torch.float32)
    assert buf.aliased and buf.unsharded is buf.sharded and buf.unsharded_allocated
    buf.free_unsharded()
    assert buf.sharded.untyped_storage().nbytes() > 0
    cast = DBuffer(_layout(W=1, rank=0), device="cpu", dtype=torch.float32, compute_dtype=torch.bfloat16)
    assert not cast.aliased


def test_gather_input_casts_into_own_slot():
    L = _layout(W=3, rank=1)
    buf = DBuffer(L, device="cpu", dtype=torch.float32, compute_dtype=torch.bfloat16)
    buf.sharded.copy_(torch.arange(L.segment, dtype=torch.float32))
    buf.alloc_unsharded()
    inp = buf.gather_input()
    assert inp.dtype == torch.bfloat16 and inp.numel() == L.segment
    assert inp.data_ptr() == buf.unsharded.data_ptr() + L.segment * 2  # rank 1's slot
    torch.testing.assert_close(inp.float(), buf.sharded)
    same = DBuffer(L, device="cpu", dtype=torch.float32)
    assert same.gather_input() is same.sharded  # no copy without a cast


def test_grad_aliases_report_which_tensors_got_gradients():
    buf = DBuffer(_layout(), device="cpu", dtype=torch.bfloat16, reduce_dtype=torch.float32)
    g = buf.alloc_grad()
    assert g.dtype == torch.float32 and float(g.abs().sum()) == 0.0
    assert not any(buf.grad_touched(i) for i in range(3))
    p = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
    p.grad_dtype = torch.float32
    p.grad = buf.grad_view(1)
    (p.float() * 3).sum().backward()
    assert [buf.grad_touched(i) for i in range(3)] == [False, True, False]
    slot = buf.slots[1]
    torch.testing.assert_close(g[slot.offset:slot.offset + 7], torch.full((7,), 3.0))
    assert buf.take_grad() is g and buf.grad is None


def test_rebuild_moves_and_recasts():
    buf = DBuffer(_layout(), device="cpu", dtype=torch.float32)
    buf.rebuild(torch.device("cpu"), torch.float64)
    assert buf.sharded.dtype == torch.float64 and buf.compute_dtype == torch.float64
    assert buf.sharded.numel() == buf.layout.segment


def test_meta_buffer_allocates_nothing():
    buf = DBuffer(_layout(), device="meta", dtype=torch.float32)
    assert buf.sharded.device.type == "meta"
    buf.copy_full_(0, torch.randn(5, 3))  # no-op on meta


def test_layout_rejects_inconsistent_plans():
    from ragged_fsdp.placement import RaggedShard

    class Bad:
        segment = 4
        offsets = {"x": 0}

        def placement(self, name):
            return RaggedShard((0,), (3, 3))  # the buffer cut is 4 | 2

    with pytest.raises(ValueError, match="segment covers"):
        BufferLayout.from_plan(Bad(), [("x", (6,))], 2, 0)


@pytest.mark.parametrize("runs, match", [
    # 12 segments of 4 elements, a (48,) tensor: 4 per rank is right
    ([(4, 12)], None),
    ([(4, 5), (5, 1), (3, 1), (4, 5)], "segment covers"),   # a swap inside the long run
    ([(4, 1), (3, 4), (5, 4), (4, 3)], "segment covers"),   # wrong runs of equal counts
    ([(4, 11), (3, 1), (0, 0)], "sum to"),                  # short by one unit
])
def test_layout_checks_runcounts_placements_by_their_runs(runs, match):
    """A RunCounts placement is checked at each run's ends (O(runs), not O(ranks spanned));
    a wrong count anywhere inside a long run is still refused."""
    from ragged_fsdp.placement import RaggedShard
    from ragged_fsdp.run_counts import RunCounts

    class Given:
        segment = 4
        offsets = {"x": 0}

        def placement(self, name):
            return RaggedShard((0,), RunCounts(runs))

    if match is None:
        BufferLayout.from_plan(Given(), [("x", (48,))], 12, 5)
        return
    with pytest.raises(ValueError, match=match):
        BufferLayout.from_plan(Given(), [("x", (48,))], 12, 5)


def _rank_by_rank_ok(S, off, n, counts, unit, W):
    """The check over every rank the tensor spans (what from_plan did before it went by runs)."""
    first, last = off // S, min(W, -(-(off + n) // S))
    start = 0
    starts = []
    for c in counts:
        starts.append(start)
        start += c
    if start != -(-n // unit):  # the counts must cover the tensor
        return False
    for r in range(W):
        if counts[r] and not first <= r < last:
            return False
    for r in range(first, last):
        lo, hi = max(off, r * S), min(off + n, (r + 1) * S)
        want = (lo - off, hi - off) if hi > lo else (0, 0)
        a, b = min(starts[r] * unit, n), min((starts[r] + counts[r]) * unit, n)
        if (b - a) != want[1] - want[0] or (b > a and a != want[0]):
            return False
    return True


def _from_plan_accepts(S, off, n, placement, W) -> bool:
    """Whether BufferLayout.from_plan takes a 1-D tensor of n elements at ``off`` in a buffer
    of W segments of S elements, placed by ``placement``."""

    class Given:
        segment = S
        offsets = {"x": off}

        def placement(self, name):
            return placement

    try:
        BufferLayout.from_plan(Given(), [("x", (n,))], W, 0)
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(0, 20), st.integers(1, 3), st.integers(4, 24),
       st.lists(st.tuples(st.integers(0, 8), st.integers(1, 9)), min_size=1, max_size=6))
def test_run_by_run_check_refuses_what_the_rank_by_rank_check_refuses(S, off, unit, W, runs):
    """Random RunCounts placements of a 1-D tensor (right ones and wrong ones): from_plan
    accepts exactly those that pass the check of every spanned rank."""
    from ragged_fsdp.placement import RaggedShard
    from ragged_fsdp.run_counts import RunCounts

    counts = RunCounts(runs)
    total = len(counts)
    if total < W:
        counts = RunCounts(list(runs) + [(0, W - total)])
    elif total > W:
        return
    n = sum(counts) * unit
    if n == 0 or off + n > W * S:
        return

    ok = _rank_by_rank_ok(S, off, n, tuple(counts), unit, W)
    assert _from_plan_accepts(S, off, n, RaggedShard((0,), counts, unit), W) == ok, (S, off, unit, W, counts.runs())


def test_run_by_run_check_on_right_layouts_and_one_unit_moved():
    """Planned (right) 1-D layouts, half of them with one unit moved to another rank: the
    run-by-run check agrees with the rank-by-rank one on every one (seeded, 3,000 cases)."""
    import random

    from ragged_fsdp.placement import RaggedShard
    from ragged_fsdp.run_counts import RunCounts

    rng = random.Random(1)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        S, unit, W = rng.randint(1, 6), rng.randint(1, 3), rng.randint(4, 24)
        if S % unit:
            continue
        off = rng.randint(0, W * S // 2) // unit * unit
        n = rng.randint(1, W * S - off) // unit * unit
        if n == 0:
            continue
        counts = [0] * W
        for k in range(off // S, min(W, -(-(off + n) // S))):
            a, b = max(off, k * S) - off, min(off + n, (k + 1) * S) - off
            counts[k] = -(-b // unit) - a // unit
        if rng.random() < 0.5:
            i, j = rng.randrange(W), rng.randrange(W)
            if counts[i]:
                counts[i] -= 1
                counts[j] += 1
        placement = RaggedShard((0,), RunCounts([(c, 1) for c in counts]), unit)
        ok = _rank_by_rank_ok(S, off, n, tuple(counts), unit, W)
        assert _from_plan_accepts(S, off, n, placement, W) == ok, (S, off, n, unit, counts)
        seen[ok] += 1
    assert seen[True] > 1000 and seen[False] > 300, seen
