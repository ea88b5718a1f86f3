"""Pure RaggedShard math: no process group needed."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragged_fsdp import RaggedShard
from ragged_fsdp.placement import even_units, same_layout


def test_local_shapes_rows():
    p = RaggedShard((0,), (3, 0, 4, 1), unit=8)
    shape = (64, 512)
    p.check(shape, 4)
    assert [p.local_shape(shape, r) for r in range(4)] == [(24, 512), (0, 512), (32, 512), (8, 512)]
    assert p.element_range(shape, 2) == (24 * 512, 56 * 512)


def test_partial_last_block():
    # 29100 elements in 256-element flat blocks: 113 full blocks and one of 172.
    shape = (100, 291)
    p = RaggedShard((0, 1), (60, 54), unit=256)
    assert p.num_units(shape) == 114
    p.check(shape, 2)
    assert p.local_shape(shape, 1) == (29100 - 60 * 256,)


def test_whole_tensor_unit():
    p = RaggedShard((), (0, 0, 1, 0))
    shape = (5, 7)
    p.check(shape, 4)
    assert p.local_shape(shape, 2) == (5, 7)
    assert p.local_shape(shape, 0) == (0, 7)
    assert p.local_boxes(shape, 0) == []
    assert p.local_boxes(shape, 2) == [((0, 0), (5, 7))]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="prefix"):
        RaggedShard((1,), (1, 1))
    with pytest.raises(ValueError, match="non-negative"):
        RaggedShard((0,), (1, -1))
    p = RaggedShard((0,), (2, 1))
    with pytest.raises(ValueError, match="cover the tensor exactly"):
        p.check((4, 3), 2)
    with pytest.raises(ValueError, match="one count per rank"):
        p.check((3, 3), 3)
    with pytest.raises(ValueError, match="unit"):
        RaggedShard((0,), (1,), unit=0)


def test_equality_and_layout():
    a = RaggedShard((0,), (2, 2), unit=1)
    assert a == RaggedShard((0,), (2, 2)) and hash(a) == hash(RaggedShard((0,), (2, 2)))
    b = RaggedShard((0, 1), (6, 6), unit=1)
    assert a != b and same_layout(a, b, (4, 3))
    assert not same_layout(a, RaggedShard((0,), (1, 3)), (4, 3))
    assert even_units(10, 4) == (3, 3, 2, 2)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    k=st.integers(0, 4),
    unit=st.integers(1, 5),
    world=st.integers(1, 5),
    data=st.data(),
)
def test_boxes_tile_the_local_run(shape, k, unit, world, data):
    """The boxes of every rank are disjoint, contiguous in flat order, and cover its run."""
    k = min(k, len(shape))
    m = math.prod(shape[:k])
    units = -(-m // unit)
    cuts = sorted(data.draw(st.lists(st.integers(0, units), min_size=world - 1, max_size=world - 1)))
    local = [b - a for a, b in zip([0] + cuts, cuts + [units])]
    p = RaggedShard(tuple(range(k)), local, unit)
    p.check(shape, world)
    seen = 0
    grid = np.arange(math.prod(shape)).reshape(shape)
    for r in range(world):
        a, b = p.element_range(shape, r)
        assert a == seen
        flat = a
        for off, size in p.local_boxes(shape, r):
            # A box is contiguous when all but its leading non-1 dim are full.
            idx = grid[tuple(slice(o, o + n) for o, n in zip(off, size))].ravel()
            assert idx.tolist() == list(range(flat, flat + idx.size))
            flat += math.prod(size)
        assert flat == b
        assert len(p.local_boxes(shape, r)) <= max(1, 2 * k - 1)
        assert math.prod(p.local_shape(shape, r)) == b - a
        seen = b
    assert seen == math.prod(shape)
