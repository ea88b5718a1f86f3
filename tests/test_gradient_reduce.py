"""fully_shard(gradient_reduce=GradientReduce(...)): gradients sent in bf16, or as int8 / fp8
e4m3 codes with one fp32 scale per block, and summed in fp32 on the segment's owner.

* The blocks (pure): they tile the buffer, every segment boundary is a block boundary, no
  block has elements of two tensors, and a block inside a tensor is whole units of its
  granularity merged up to ``block_size`` or, for a unit larger than ``block_size``, a
  ``block_size`` piece of one unit: checked from planned layouts with odd shapes (rows:128
  of a [300, 200] weight, a matrix placed whole) at W = 1..5 and block sizes 1, 32, 128 and
  one larger than every unit.
* The residual (pure): int8 storage keeps every element within scale / 508 of the exact
  residual, bf16 within one bf16 rounding; its size is the other ranks' segments only, and
  bad combinations are refused naming the parameter and the fix.
* The collective, bitwise: every rank's segment equals a single-process reference that
  quantises each other rank's buffer the same way, dequantises and sums the pieces with its
  own piece, exact, in rank order (``quant.grad_wire.reference_reduce``), on groups of 1, 2,
  3 and 4 ranks, every format, with error feedback over three steps in every residual
  storage, and with 32-element blocks and blocks larger than every unit on a layout with
  large units; and with zeros from the other ranks a rank's segment is its own gradient / W
  exactly (its own piece is never quantised).
* The engine, bitwise: one backward of an MLP with odd shapes equals the reference applied
  to each rank's own gradient (a plain replica on that rank's rows); also with
  ``no_sync`` accumulation, a divide factor, accumulation into existing grads and an
  identity all-reduce hook, on a 1-D mesh (W=4) and an HSDP (2, 2) mesh; and three steps
  of error feedback (int8 and fp8 wires, 128- and 32-element blocks) equal the reference
  with each rank's residual carried across the steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import _benchmarks  # noqa: F401  (benchmarks/ on sys.path)
from _dist import check_case, run_cases

from ragged_fsdp import GradientReduce
from ragged_fsdp.dbuffer.planning import plan_layout
from ragged_fsdp.quant.grad_wire import dequantize, quantize, reference_reduce, wire_blocks
from ragged_fsdp.quant.wire_residual import Residual

FORMATS = [GradientReduce(torch.bfloat16), GradientReduce(torch.int8), GradientReduce(torch.float8_e4m3fn)]
FEEDBACK = [GradientReduce(torch.int8, True), GradientReduce(torch.int8, True, torch.bfloat16),
            GradientReduce(torch.int8, True, torch.float32), GradientReduce(torch.float8_e4m3fn, True),
            GradientReduce(torch.float8_e4m3fn, True, torch.float32), GradientReduce(torch.bfloat16, True)]
SHAPES = [("w1", (37, 24), "rows:3"), ("b1", (37,), None), ("w2", (5, 37), None), ("e", (3, 7, 11), "rows:7"),
          ("w3", (64, 64), None), ("b3", (1,), None)]
# units larger than a block: 128 rows of 200 (25,600 elements, the last unit 44 rows), a
# matrix placed whole (3,015), rows of 300
LARGE = [("big", (300, 200), "rows:128"), ("b", (300,), None), ("whole", (45, 67), "tensor"),
         ("e", (3, 7, 11), "rows:7"), ("wide", (9, 300), "row"), ("w3", (64, 64), None)]
HUGE_BLOCK = 1 << 20  # larger than every unit of SHAPES and LARGE
BLOCKED = [GradientReduce(torch.int8), GradientReduce(torch.int8, block_size=32),
           GradientReduce(torch.float8_e4m3fn, block_size=32), GradientReduce(torch.int8, True, block_size=32),
           GradientReduce(torch.int8, True, torch.float32, block_size=32),
           GradientReduce(torch.float8_e4m3fn, True, block_size=32), GradientReduce(torch.int8, block_size=HUGE_BLOCK),
           GradientReduce(torch.int8, True, block_size=HUGE_BLOCK),
           GradientReduce(torch.float8_e4m3fn, True, block_size=HUGE_BLOCK)]


def _layout(world, rank, shapes=SHAPES):
    from ragged_fsdp.dbuffer.planning import parse_granularity

    tensors = [(k, s, parse_granularity(g) if g else None) for k, s, g in shapes]
    return plan_layout(tensors, world, rank, itemsize=4)


# -- the blocks (no process group) ---------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shapes, block_size", [(SHAPES, 128), (SHAPES, 32), (LARGE, 128), (LARGE, 32),
                                                (SHAPES, 1), (LARGE, HUGE_BLOCK)],
                         ids=["small-128", "small-32", "large-128", "large-32", "small-1", "large-huge"])
def test_blocks_tile_the_buffer_and_never_cross_a_segment(world, shapes, block_size):
    lay = _layout(world, 0, shapes)
    blocks = wire_blocks(lay, block_size)
    S = lay.segment
    ends = torch.cumsum(blocks.lengths, 0).tolist()
    starts = [0] + ends[:-1]
    assert ends[-1] == world * S and all(n > 0 for n in blocks.lengths.tolist())
    assert sum(blocks.per_segment) == len(ends)
    for k, first in enumerate(blocks.starts):  # segment k's blocks are a run starting at its boundary
        assert starts[first] == k * S if blocks.per_segment[k] else True
    for a, b in zip(starts, ends):
        assert a // S == (b - 1) // S, f"block [{a}, {b}) crosses a segment boundary (S={S})"
    for s in lay.slots:  # a block is inside one tensor or inside padding
        lo, hi = s.offset, s.offset + s.numel
        k = len(s.placement.dims)
        unit = s.numel if k == 0 else s.placement.unit * (s.numel // _entries(s))
        for a, b in zip(starts, ends):
            if not (a < hi and b > lo):
                continue
            assert lo <= a and b <= hi, f"{s.key}: block [{a}, {b}) spills out of [{lo}, {hi})"
            run_end = min(hi, (a // S + 1) * S)  # where this tensor's run in the segment ends
            if unit <= block_size:  # whole units, merged up to >= block_size (the run's last may be short)
                assert (a - lo) % unit == 0, f"{s.key}: block starts inside a unit ({unit} elements)"
                assert b == run_end or ((b - lo) % unit == 0 and b - a >= block_size), (s.key, a, b, unit)
                assert b - a < block_size + unit, f"{s.key}: merged past block_size ({b - a} elements)"
            else:  # one unit cut into block_size pieces, the last of the unit shorter
                u0 = lo + (a - lo) // unit * unit
                u_end = min(hi, u0 + unit)
                assert b <= u_end, f"{s.key}: block [{a}, {b}) spans two units of {unit}"
                assert (a - u0) % block_size == 0 and b - a == min(block_size, u_end - a), (s.key, a, b, unit)


def test_large_units_are_cut_into_blocks():
    """rows:128 of a [300, 200] weight (units of 25,600 elements) and a matrix placed whole
    become blocks of at most block_size inside the tensors (the old rule made one block per
    unit: 25,600 elements under one scale)."""
    for world in (1, 2, 3, 4):
        lay = _layout(world, 0, LARGE)
        for bs in (32, 128):
            blocks = wire_blocks(lay, bs)
            ends = torch.cumsum(blocks.lengths, 0).tolist()
            starts = [0] + ends[:-1]
            for s in lay.slots:
                if s.key not in ("big", "whole", "wide"):
                    continue
                inside = [b - a for a, b in zip(starts, ends) if s.offset <= a < s.offset + s.numel]
                assert max(inside) == bs and sum(inside) == s.numel, (world, bs, s.key)
                # a unit of 128 rows of 200 (25,600) is 800 x 32 or 200 x 128; the last unit,
                # 44 rows (8,800), 275 x 32 or 68 x 128 + 96
                if s.key == "big":
                    assert sorted(set(inside)) == ([32] if bs == 32 else [96, 128]), (world, bs, sorted(set(inside)))
        # larger than every unit: each run of whole units is one block (old behaviour for merged units)
        blocks = wire_blocks(lay, HUGE_BLOCK)
        assert int(blocks.lengths.max()) <= lay.segment


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "32", None])
def test_block_size_is_validated(bad):
    with pytest.raises(ValueError, match=r"block_size=.*pass an int >= 1"):
        GradientReduce(torch.int8, block_size=bad)
    with pytest.raises(ValueError, match=r"wire_blocks: block_size=.*pass an int >= 1"):
        wire_blocks(_layout(2, 0), bad)


def test_block_size_bytes():
    """Scale overhead 4 bytes per block: 32-element blocks send about 1 + 4/32 bytes per
    element on a layout of one-element units, and the residual's int8 storage the same."""
    from ragged_fsdp.quant.grad_wire import wire_bytes
    from ragged_fsdp.quant.wire_residual import residual_bytes_per_element

    world = 4
    lay = plan_layout([("w1", (512, 128), None), ("w2", (256, 96), None)], world, 0, itemsize=4)
    for bs in (32, 64, 128):
        fmt = GradientReduce(torch.int8, True, block_size=bs)
        sent, _ = wire_bytes(wire_blocks(lay, bs), fmt, 0)
        assert sent / ((world - 1) * lay.segment) == pytest.approx(1 + 4 / bs, rel=2e-3), bs
        assert residual_bytes_per_element(fmt) == 1 + 4 / bs
        res = Residual(wire_blocks(lay, bs), 0, fmt)
        assert res.nbytes / ((world - 1) * lay.segment) == pytest.approx(1 + 4 / bs, rel=2e-3), bs
        assert sent / ((world - 1) * lay.segment * 4) <= 0.3, bs  # the goal's bytes, against fp32's 4


def _entries(slot):
    k = len(slot.placement.dims)
    n = 1
    for d in slot.shape[:k]:
        n *= d
    return n


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt"], "--model 'gpt': choose one of small, demo, moe"),
    (["--modes", "fp32,int4"], "--modes: unknown int4"),
    (["--model", "demo", "--world", "4", "--batch", "6"], "--batch 6 is not a multiple of --world 4"),
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--dim", "0"], "--dim 0: must be >= 1"),
    (["--plot", "a.json"], "--plot needs --png"),
    (["--seeds", "3"], "needs two or more distinct seeds"),
    (["--seeds", "a-b"], "pass a range A-B or a list"),
    (["--modes", "fp32,bf16-b32"], "--modes: unknown bf16-b32"),
    (["--modes", "fp32,int8-ef-b0"], "--modes: unknown int8-ef-b0"),
    (["--modes", "fp32,fsdp2-b32"], "--modes: unknown fsdp2-b32"),
])
def test_bench_refuses_bad_options(argv, message, capsys):
    import grad_wire as bench

    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_bench_block_modes():
    """``-b<N>`` on a scaled wire mode sets the block size; the mode without it keeps its
    name and the default block size (its rows unchanged)."""
    import grad_wire as bench

    assert bench.mode_of("int8-ef") == bench.MODES["int8-ef"]
    name, spec = bench.mode_of("int8-ef-b32")
    assert name == "int8 + scale, error feedback, 32-element blocks"
    assert bench._fmt(spec) == GradientReduce(torch.int8, True, block_size=32)
    assert bench._fmt(bench.MODES["int8-ef"][1]) == GradientReduce(torch.int8, True, block_size=128)
    assert bench._fmt(bench.mode_of("fp8-b64")[1]).block_size == 64


def test_seed_summary_interval():
    """The seed summary's 95% interval is mean +- t(0.975, n - 1) * s.e.: for offsets 0, 1, 2, 3
    (mean 1.5, sample s.d. 1.291, s.e. 0.6455) it is 1.5 +- 3.182 * 0.6455."""
    import grad_wire as bench

    runs = [{"rows": {"fp32 reduce": {}, "int8": {"mode": "int8", "final_loss_vs_fp32": x, "last50_vs_fp32": -x,
                                                 "bytes_vs_fp32": 0.258}}} for x in (0.0, 1.0, 2.0, 3.0)]
    row = bench.summarise(runs)["int8"]
    f = row["final_loss_vs_fp32"]
    assert f["mean"] == 1.5 and abs(f["sem"] - 0.645497) < 1e-6
    assert abs(f["ci95_lo"] - (1.5 - 3.182 * f["sem"])) < 1e-9 and abs(f["ci95_hi"] - (1.5 + 3.182 * f["sem"])) < 1e-9
    assert row["last50_vs_fp32"]["ci95_hi"] == -f["ci95_lo"]
    assert bench.t975(23) == 2.069 and bench.t975(200) == 1.96


def test_grad_blocks_diagnostic():
    """benchmarks/grad_blocks.py: the histogram covers the buffers, smaller blocks round fewer of the
    MoE gradient's elements to code 0, and a rows:128 Llama block's largest block is the
    block size."""
    import grad_blocks

    row = grad_blocks.measure_model("moe", 4, [32, 128])
    by = row["by_block"]
    assert sum(int(k) * v for k, v in by["32"]["lengths"].items()) == sum(
        int(k) * v for k, v in by["128"]["lengths"].items())
    assert 0 < by["32"]["code0_fraction"] < by["128"]["code0_fraction"] < 0.5
    assert grad_blocks.llama_block_max(8, [32, 128])["max_block"] == {"32": 32, "128": 128}


def test_refuses_other_dtypes():
    with pytest.raises(ValueError, match="wire_dtype=torch.float16"):
        GradientReduce(torch.float16)


@pytest.mark.parametrize("kw, message", [
    (dict(wire_dtype=torch.float8_e4m3fn, error_feedback=True, residual_dtype=torch.int8),
     "residual_dtype=torch.int8 .* use residual_dtype=torch.bfloat16"),
    (dict(wire_dtype=torch.bfloat16, error_feedback=True, residual_dtype=torch.int8),
     "residual_dtype=torch.int8 .* use residual_dtype=torch.bfloat16"),
    (dict(wire_dtype=torch.int8, residual_dtype=torch.bfloat16), "pass error_feedback=True or leave residual_dtype"),
    (dict(wire_dtype=torch.int8, error_feedback=True, residual_dtype=torch.float16), "residual_dtype=torch.float16"),
])
def test_refuses_bad_residual_storage(kw, message):
    with pytest.raises(ValueError, match=message):
        GradientReduce(**kw)


def test_residual_storage_default():
    """Left out, the residual is int8 for the int8 wire, bf16 for the others; resolved at
    construction, so the default and its explicit spelling are the same format."""
    assert GradientReduce(torch.int8, True).residual_dtype is torch.int8
    assert GradientReduce(torch.float8_e4m3fn, True).residual_dtype is torch.bfloat16
    assert GradientReduce(torch.bfloat16, True).residual_dtype is torch.bfloat16
    assert GradientReduce(torch.int8).residual_dtype is None
    assert GradientReduce(torch.int8, True) == GradientReduce(torch.int8, True, torch.int8)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_residual_is_the_sent_pieces_and_within_its_bound(world):
    """The residual covers the other ranks' segments only ((W - 1) * S elements, plus the
    scales of their blocks for int8 storage), and what it stores is within its storage's
    bound of the exact residual ``x - dequant(quant(x))``."""
    lay = _layout(world, 0)
    blocks = wire_blocks(lay)
    S = lay.segment
    for rank in range(world):
        x = _rank_grad(rank, lay.total)
        for fmt in FEEDBACK:
            res = Residual(blocks, rank, fmt)
            codes, scale = quantize(x, blocks.lengths, fmt)
            res.keep(x, codes, scale)
            exact = x - dequantize(codes, scale, blocks.lengths, x.dtype, fmt)
            got = torch.zeros_like(x)
            res.add_into(got)
            own = slice(rank * S, (rank + 1) * S)
            assert not got[own].any(), "the own segment has a residual"
            others = torch.ones(lay.total, dtype=torch.bool)
            others[own] = False
            n_other = int(blocks.lengths.numel()) - blocks.per_segment[rank]
            item = {torch.float32: 4, torch.bfloat16: 2, torch.int8: 1}[fmt.residual_dtype]
            assert res.nbytes == (world - 1) * S * item + (4 * n_other if fmt.residual_dtype is torch.int8 else 0)
            err = (got - exact)[others]
            if fmt.residual_dtype is torch.float32:
                assert torch.equal(got[others], exact[others])
            elif fmt.residual_dtype is torch.bfloat16:
                assert (err.abs() <= exact[others].abs() * 2.0 ** -8).all()
            else:
                step = torch.repeat_interleave(scale, blocks.lengths)[others]
                assert (exact[others].abs() <= step / 2 * (1 + 1e-6)).all(), "int8 rounding exceeds scale / 2"
                assert (err.abs() <= step / 508 * (1 + 1e-5)).all(), "int8 storage exceeds scale / 508"


# -- the collective, bitwise ---------------------------------------------------------------

def _rank_grad(k, n, step=0):
    g = torch.Generator().manual_seed(1000 * step + k)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)]
    return x


def _collective_vs_reference(comm, lay, fmt, ranks, size, failed):
    from ragged_fsdp.fsdp.comms.device import Device
    from ragged_fsdp.fsdp.comms.wire_reduce import WireState, wire_reduce_scatter

    blocks = wire_blocks(lay, fmt.block_size)
    state = WireState(lay, fmt)
    residuals = [Residual(blocks, k, fmt) for k in ranks] if fmt.error_feedback else None
    for step in range(3 if fmt.error_feedback else 1):
        grads = [_rank_grad(k, lay.total, step) for k in ranks]
        got = torch.empty(lay.segment)
        wire_reduce_scatter(Device(torch.device("cpu")), comm, grads[comm.rank].clone(), got, False, None,
                            state).wait()
        want = reference_reduce(grads, lay, fmt, comm.rank, residuals=residuals)
        if not torch.equal(got, want):
            failed.append(f"W={size} {fmt} step {step}: {(got != want).sum().item()} of {got.numel()} "
                          "elements differ from the reference")
        mine = [g.narrow(0, comm.rank * lay.segment, lay.segment) for g in grads]
        exact = sum(mine[1:], mine[0].clone()) / size
        bound = sum(m.abs() for m in mine) / size * 2.0 ** -8  # one bf16 rounding per piece
        if fmt.wire_dtype is torch.bfloat16 and not fmt.error_feedback and not ((got - exact).abs() <= bound).all():
            failed.append(f"W={size}: the bf16-wire mean is further than the pieces' rounding from fp32's")
    # the own piece is never quantised: every rank sends zeros but keeps its own
    # segment, and each gets that segment / W back bit for bit
    S = lay.segment
    g = torch.zeros(lay.total)
    g[comm.rank * S:(comm.rank + 1) * S] = _rank_grad(comm.rank, lay.total)[:S]
    got = torch.empty(S)
    wire_reduce_scatter(Device(torch.device("cpu")), comm, g, got, False, None, WireState(lay, fmt)).wait()
    want = g[comm.rank * S:(comm.rank + 1) * S] * (1.0 / size)
    if not torch.equal(got, want):
        failed.append(f"W={size} {fmt}: the own segment is not exact ({(got != want).sum().item()} differ)")


def case_collective_matches_reference(rank, world):
    from ragged_fsdp.comm import Comm

    failed = []
    for size in (1, 2, 3, 4):
        ranks = list(range(size))
        group = dist.new_group(ranks)
        if rank not in ranks:
            continue
        comm = Comm.of(group)
        for shapes, fmts in ((SHAPES, FORMATS + FEEDBACK), (LARGE, BLOCKED)):
            lay = _layout(size, comm.rank, shapes)
            for fmt in fmts:
                _collective_vs_reference(comm, lay, fmt, ranks, size, failed)
    # every rank takes part in every new_group before raising (a rank that raised early
    # would leave the others in the next group's creation)
    assert not failed, "\n".join(failed)


# -- the engine, bitwise --------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 37)
        self.b = nn.Linear(37, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _rows(dp_rank, micro=0):
    g = torch.Generator().manual_seed(50 + 10 * micro + dp_rank)
    return torch.randn(3, 24, generator=g), torch.randn(3, 5, generator=g)


def _local_grads(model_state, dp_rank, micros=(0,)):
    """This data-parallel rank's own gradient (sum over its micro-batches), on a plain replica."""
    torch.manual_seed(0)
    m = MLP()
    m.load_state_dict(model_state)
    for mb in micros:
        x, y = _rows(dp_rank, mb)
        nn.functional.mse_loss(m(x), y).backward()
    return {n: p.grad for n, p in m.named_parameters()}


def _buffer_of(layout, grads_by_key):
    full = torch.zeros(layout.total)
    for s in layout.slots:
        full[s.offset:s.offset + s.numel] = grads_by_key[s.key].reshape(-1)
    return full


def _engine_case(rank, world, hsdp, fmt, *, no_sync=False, divide=None, hook=False, accumulate=False):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.fsdp import fully_shard

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    plain = MLP()
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    m = MLP()
    m.load_state_dict(state)
    fully_shard(m, mesh=mesh, gradient_reduce=fmt)
    if divide is not None:
        m.set_gradient_divide_factor(divide)
    seen = []
    if hook:
        m.set_all_reduce_hook(lambda t: seen.append(t.dtype))
    micros = (0, 1) if (no_sync or accumulate) else (0,)
    for i, mb in enumerate(micros):
        if no_sync:
            m.set_requires_gradient_sync(i == len(micros) - 1)
        x, y = _rows(rank, mb)
        nn.functional.mse_loss(m(x), y).backward()
    buf = m.dbuffers[0]
    lay = buf.layout
    keys = {s.key: s.key for s in lay.slots}
    per_rank = [_local_grads(state, k, micros if no_sync else (0,)) for k in range(world)]
    shard = mesh["shard"] if hsdp else mesh
    sr, sw = shard.get_local_rank(), shard.size()
    if hsdp:  # each replica's shard group reduces its own two ranks, then fp32 sum over replicas / 4
        rep = mesh["replicate"].get_local_rank()
        parts = []
        for r in range(2):
            members = [r * sw + j for j in range(sw)]
            bufs = [_buffer_of(lay, {s.key: per_rank[k][s.key] for s in lay.slots}) for k in members]
            parts.append(reference_reduce(bufs, lay, fmt, sr, divide_factor=1.0))
        want = parts[0].clone()
        want += parts[1]
        want.mul_(1.0 / float(divide or world))
        del rep
    else:
        bufs = [_buffer_of(lay, {s.key: per_rank[k][s.key] for s in lay.slots}) for k in range(world)]
        want = reference_reduce(bufs, lay, fmt, sr, divide_factor=divide)
    if accumulate:  # the second micro-batch was a second step's backward without zero_grad
        per_rank2 = [_local_grads(state, k, (1,)) for k in range(world)]
        bufs2 = [_buffer_of(lay, {s.key: per_rank2[k][s.key] for s in lay.slots}) for k in range(world)]
        first = want
        want = first.clone()
        want.add_(reference_reduce(bufs2, lay, fmt, sr, divide_factor=divide))
    named = dict(m.named_parameters())
    for s in lay.slots:
        name = keys[s.key]
        got = named[name].grad.to_local().reshape(-1)
        w = want[s.local_offset:s.local_offset + s.local_numel]
        assert torch.equal(got, w), f"{fmt} {name}: {(got != w).sum().item()} of {w.numel()} elements differ"
    if hook:
        assert seen and all(d == torch.float32 for d in seen)


def case_engine_fsdp(rank, world):
    for fmt in FORMATS + [GradientReduce(torch.int8, block_size=32), GradientReduce(torch.int8, block_size=HUGE_BLOCK)]:
        _engine_case(rank, world, False, fmt)
    fmt = GradientReduce(torch.int8)
    _engine_case(rank, world, False, fmt, no_sync=True)
    _engine_case(rank, world, False, fmt, divide=2.0)
    _engine_case(rank, world, False, fmt, hook=True)
    _engine_case(rank, world, False, fmt, accumulate=True)


def case_engine_feedback_three_steps(rank, world):
    """Three steps of fully_shard with error feedback: each step's reduced gradient equals
    the reference with every rank's residual carried from the step before, bit for bit
    (int8 and fp8 wires; default, 32-element and larger-than-any-unit blocks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for fmt in (GradientReduce(torch.int8, True), GradientReduce(torch.float8_e4m3fn, True),
                GradientReduce(torch.int8, True, block_size=32),
                GradientReduce(torch.float8_e4m3fn, True, block_size=32),
                GradientReduce(torch.int8, True, torch.float32, block_size=HUGE_BLOCK)):
        torch.manual_seed(0)
        state = {k: v.clone() for k, v in MLP().state_dict().items()}
        m = MLP()
        m.load_state_dict(state)
        fully_shard(m, mesh=mesh, gradient_reduce=fmt)
        lay = m.dbuffers[0].layout
        residuals = [Residual(wire_blocks(lay, fmt.block_size), k, fmt) for k in range(world)]
        named = dict(m.named_parameters())
        for step in range(3):
            x, y = _rows(rank, step)
            nn.functional.mse_loss(m(x), y).backward()
            bufs = [_buffer_of(lay, _local_grads(state, k, (step,))) for k in range(world)]
            want = reference_reduce(bufs, lay, fmt, mesh.get_local_rank(), residuals=residuals)
            for s in lay.slots:
                got = named[s.key].grad.to_local().reshape(-1)
                w = want[s.local_offset:s.local_offset + s.local_numel]
                assert torch.equal(got, w), (f"{fmt} step {step} {s.key}: {(got != w).sum().item()} of "
                                             f"{w.numel()} differ")
            m.zero_grad()


def case_engine_hsdp(rank, world):
    for fmt in FORMATS:
        _engine_case(rank, world, True, fmt)


def case_refuses_bf16_reduce_dtype(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp.fsdp import fully_shard

    m = MLP().to(torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype=torch.float32"):
        fully_shard(m, mesh=init_device_mesh("cpu", (world,)), gradient_reduce=GradientReduce(torch.int8),
                    mp_policy=MixedPrecisionPolicy())


def _bench_args(*extra):
    import grad_wire as bench

    ap = bench._parser()
    args = ap.parse_args(["--model", "demo", "--dim", "32", "--layers", "1", "--hidden", "48", "--seq-len", "16",
                          "--batch", "4", "--steps", "3", *extra])
    bench.check_args(ap, args)
    return args


def case_bench_error_probe_leaves_training_bitwise(rank, world):
    """benchmarks/grad_wire.py --grad-error wraps the engine's wire reduction to measure it: the
    training it measures must be the one without it, bit for bit (losses and weights), and
    with error feedback its accumulated error is the residuals' mean (bounded), below the
    one without feedback after a few steps."""
    from torch.distributed.device_mesh import init_device_mesh

    import grad_wire as bench

    mesh = init_device_mesh("cpu", (world,))
    batches = bench._Batches(_bench_args(), world)
    for mode in (("int8", True, None), ("bf16", False, None)):
        plain, _ = bench._train(_bench_args(), "x", mode, mesh, batches, None)
        probed, _ = bench._train(_bench_args("--grad-error"), "x", mode, mesh, batches, None)
        assert plain["losses"] == probed["losses"], (mode, plain["losses"], probed["losses"])
        for (n, a), (_, b) in zip(plain["_model"].named_parameters(), probed["_model"].named_parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), f"{mode} {n}: the probe changed the weights"
        if mode[1]:  # the residual the bench reports is the engine's storage: int8 codes of the sent pieces
            want = 0
            for m in plain["_model"].modules():
                for buf in getattr(m, "dbuffers", []) if hasattr(m, "_fsdp_state") else []:
                    blocks = wire_blocks(buf.layout, 128)
                    n_other = int(blocks.lengths.numel()) - blocks.per_segment[buf.layout.rank]
                    want += (world - 1) * buf.layout.segment + 4 * n_other
            assert bench._residual_bytes(plain["_model"]) == want > 0
        errs = probed["grad_rel_err_per_step"]
        assert len(errs) == 3 and all(0 < e < 0.1 for e in errs), errs
    # the probe wraps the engine's function and puts it back
    from ragged_fsdp.fsdp.core import reduction
    from ragged_fsdp.fsdp.comms.wire_reduce import wire_reduce_scatter

    assert reduction.wire_reduce_scatter is wire_reduce_scatter


CASES = [case_collective_matches_reference, case_engine_fsdp, case_engine_feedback_three_steps, case_engine_hsdp,
         case_refuses_bf16_reduce_dtype, case_bench_error_probe_leaves_training_bitwise]


@pytest.fixture(scope="module")
def results():
    return run_cases(4, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_gradient_reduce_w4(results, case):
    check_case(results, case, 4)
