"""Block-wise FP8 all-gather (fully_shard(all_gather_quant=BlockFP8(...))).

Pure math first (tiles, partial edges, pieces vs whole, granularity checks), then on W = 1..4
gloo ranks (one launch per W): the gathered weights are bitwise the single-process
quantise-dequantise of the full weights (so bitwise the same at every W), with odd shapes,
partial tiles at both edges, fused experts in both tilings and a rank holding nothing;
training matches a single-process reference that computes with the same quantised weights;
bad configurations fail with errors naming the fix.

Small tiles (8x16) keep the tensors small while exercising every edge case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import _benchmarks  # noqa: F401  (benchmarks/ on sys.path)
from _dist import check_case, cpu_mesh, full, global_batch, run_cases

from ragged_fsdp import BlockFP8, fully_shard
from ragged_fsdp.dbuffer.planning import plan_layout
from ragged_fsdp.fsdp.comms.quant_gather import fp8_granularity
from ragged_fsdp.planner.granularity import Granularity
from ragged_fsdp.quant import (
    FP8_DTYPES, ScaleLayout, TileGeometry, dequantize_pieces, per_tensor_quantize_dequantize, quantize_dequantize,
    quantize_pieces, tile_amax,
)

POL = BlockFP8(tile=(8, 16))
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# -- pure math ------------------------------------------------------------------------------
def _qd_pieces(x3, tile, dtype=torch.float8_e4m3fn):
    n, rows, C = x3.shape
    codes = torch.empty(x3.shape, dtype=torch.uint8)
    scales = torch.empty(n, -(-rows // tile[0]), -(-C // tile[1]))
    quantize_pieces(x3, tile, dtype, codes, scales)
    return codes, scales


def test_tile_scales_edges_and_zero_tiles():
    torch.manual_seed(0)
    x = torch.randn(1, 19, 37)  # partial tiles at the bottom (3 rows) and right (5 cols)
    x[0, 8:16, 16:32] = 0  # an all-zero tile
    x[0, 16:, 32:] *= 1000  # an outlier in the corner tile only
    codes, scales = _qd_pieces(x, (8, 16))
    assert scales.shape == (1, 3, 3)
    amax = torch.zeros(1, 3, 3)
    for i in range(3):
        for j in range(3):
            amax[0, i, j] = x[0, 8 * i:8 * i + 8, 16 * j:16 * j + 16].abs().max()
    assert torch.equal(tile_amax(x, (8, 16)), amax)
    assert scales[0, 1, 1] == 1 and codes[0, 8:16, 16:32].eq(0).all()
    want = torch.where(amax > 0, amax / 448.0, torch.ones(()))
    assert torch.equal(scales, want)
    # every tile's largest element maps to +-448 (the fp8 max) exactly
    vals = codes.view(torch.float8_e4m3fn).float()
    assert vals.abs().max() == 448.0
    out = torch.empty_like(x)
    dequantize_pieces(codes, scales, (8, 16), torch.float8_e4m3fn, out)
    rel = (out - x).abs() / amax.repeat_interleave(8, 1)[:, :19].repeat_interleave(16, 2)[:, :, :37].clamp_min(1e-30)
    assert rel.max() <= 2 ** -4  # e4m3: 3 mantissa bits -> half an ulp at the top binade


def test_pieces_equal_whole_bitwise():
    """Quantising runs of whole tile rows (what each rank does) gives the whole tensor's bits."""
    torch.manual_seed(1)
    x = torch.randn(1, 43, 29) * torch.logspace(-3, 2, 43)[None, :, None]
    codes, scales = _qd_pieces(x, (8, 16))
    for cut in ([0, 8, 43], [0, 24, 40, 43], [0, 0, 16, 43]):
        parts = [_qd_pieces(x[:, a:b], (8, 16)) for a, b in zip(cut, cut[1:])]
        assert torch.equal(torch.cat([c for c, _ in parts], 1), codes)
        assert torch.equal(torch.cat([s for _, s in parts], 1), scales)


def test_geometry_and_granularity():
    assert TileGeometry.of((300, 200), (128, 128)).granularity == "rows:128"
    assert TileGeometry.of((8, 256, 64), (128, 128)).granularity == "rows:128"  # tiles never span experts
    g = TileGeometry.of((8, 200, 64), (128, 128))  # 200 rows: partial tile per expert
    assert g.per_matrix and g.granularity == "rows:200"
    assert g.piece_shape(200 * 64, 3 * 200 * 64) == (2, 200, 64)
    with pytest.raises(ValueError, match="cut"):
        g.piece_shape(128 * 64, 200 * 64)
    with pytest.raises(ValueError, match="cut"):
        TileGeometry.of((300, 200), (128, 128)).piece_shape(64 * 200, 300 * 200)
    gran = fp8_granularity(POL, "w", (40, 24), None)
    assert gran == Granularity("rows", 8)
    assert fp8_granularity(POL, "w", (40, 24), Granularity("rows", 16)) == Granularity("rows", 16)
    assert fp8_granularity(POL, "w", (40, 24), Granularity("tensor")) == Granularity("tensor")
    assert fp8_granularity(POL, "e", (3, 12, 24), Granularity("rows", 24)) == Granularity("rows", 24)
    for bad in ("row", "rows:4", "rows:12", "block:256", "element"):
        with pytest.raises(ValueError, match=r"granularity_fn returned .*return 'rows:8'"):
            fp8_granularity(POL, "w", (40, 24), Granularity.parse(bad))
    with pytest.raises(ValueError, match="return 'rows:12'"):
        fp8_granularity(POL, "e", (3, 12, 24), Granularity.parse("rows:8"))


def test_policy_validation_and_eligibility():
    with pytest.raises(ValueError, match="tile"):
        BlockFP8(tile=(0, 128))
    with pytest.raises(ValueError, match="tile"):
        BlockFP8(tile=128)
    with pytest.raises(ValueError, match="fp8 format"):
        BlockFP8(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="min_numel"):
        BlockFP8(min_numel=-1)
    p = BlockFP8(tile=(8, 16))
    assert p.applies("w", torch.empty(8, 16)) and not p.applies("w", torch.empty(7, 16))
    assert not p.applies("b", torch.empty(128)) and not p.applies("x.bias", torch.empty(16, 16))
    assert not p.applies("i", torch.empty(16, 16, dtype=torch.int64))
    q = BlockFP8(tile=(8, 16), param_filter=lambda n, t: "emb" not in n)
    assert not q.applies("emb.weight", torch.empty(16, 16)) and q.applies("lin.weight", torch.empty(16, 16))
    assert BlockFP8(dtype=torch.float8_e5m2).fp8_max == 57344.0


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_every_fp8_format_round_trips(dtype):
    """Out of range e5m2 gives inf and the fnuz formats NaN: the clamp keeps codes finite."""
    torch.manual_seed(3)
    x = torch.randn(21, 19) * torch.logspace(-4, 4, 21)[:, None]
    pol = BlockFP8(tile=(4, 8), dtype=dtype)
    y = quantize_dequantize(x, pol)
    assert torch.isfinite(y).all()
    err = (y - x).abs().amax() / x.abs().amax()
    assert err <= 2 ** -2, f"{dtype}: {err}"  # e5m2: 2 mantissa bits
    assert torch.allclose(x.abs().amax(), y.abs().amax(), rtol=1e-6)  # the max maps to fp8_max * scale


def test_scale_layout_index():
    """Scales of a tensor split over ranks come back in the tensor's tile order."""
    shapes = [("a", (40, 24), "rows:8"), ("e", (3, 12, 24), "rows:12"), ("b", (9, 16), "rows:8")]
    for W in (1, 2, 3, 5):
        lays = [plan_layout(shapes, W, r, itemsize=4) for r in range(W)]
        geoms = [POL.geometry(s) for _, s, _ in shapes]
        sls = [ScaleLayout.build(lay, [0, 1, 2], geoms) for lay in lays]
        T = sls[0].per_rank
        gathered = torch.full((W * T,), -1.0)
        fulls = [torch.randn(s) for _, s, _ in shapes]
        for r, (lay, sl) in enumerate(zip(lays, sls)):
            offs = sl.local_offsets()
            for j, (full_t, g) in enumerate(zip(fulls, geoms)):
                a, b = lay.slots[j].placement.element_range(g.shape, r)
                n, rows, C = g.piece_shape(a, b)
                if b > a:
                    _, s = _qd_pieces(full_t.reshape(-1)[a:b].view(n, rows, C), (8, 16))
                    gathered[r * T + offs[j]: r * T + offs[j] + s.numel()] = s.reshape(-1)
        ordered = gathered[sls[0].gather_index()]
        at = 0
        for full_t, g in zip(fulls, geoms):
            _, s = _qd_pieces(full_t.view(g.piece_shape(0, g.numel)), (8, 16))
            assert torch.equal(ordered[at:at + s.numel()], s.reshape(-1)), W
            at += s.numel()
        assert at == ordered.numel() == sls[0].used


def test_per_tile_beats_per_tensor_on_outliers():
    torch.manual_seed(2)
    x = torch.randn(64, 64) * 0.01
    x[:8, :16] *= 1e5  # one outlier tile: a per-tensor scale flushes the rest to (sub)normals or zero
    err_tile = (quantize_dequantize(x, POL) - x)[8:].norm() / x[8:].norm()
    err_tensor = (per_tensor_quantize_dequantize(x) - x)[8:].norm() / x[8:].norm()
    assert err_tile < 0.05 and err_tensor > 5 * err_tile


# -- distributed ----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(24, 37)  # (37, 24): partial tiles at both edges; bias stays bf16
        self.experts_b = nn.Parameter(torch.randn(2, 16, 37) * 0.2)  # 16 % 8 == 0: rows:8 across experts
        self.experts_a = nn.Parameter(torch.randn(3, 12, 16) * 0.2)  # 12 % 8 != 0: whole expert matrices
        self.out = nn.Linear(36, 24, bias=False)
        self.norm = nn.Parameter(torch.ones(24))
        self.small = nn.Parameter(torch.randn(4, 8) * 0.1)  # under one tile: stays bf16

    def forward(self, x):
        a = F.silu(self.lin(x))
        z = torch.einsum("btf,ekf->btk", a, self.experts_b)
        w = torch.einsum("btk,emk->btem", z, self.experts_a).flatten(2)
        return (x + self.out(w) + self.small.mean()) * self.norm


class Net(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, 24)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Linear(24, 24, bias=False)  # 3 tile rows: a rank holds nothing at W = 4
        self.head = nn.Linear(24, vocab)

    def forward(self, t):
        h = self.emb(t)
        for b in self.blocks:
            h = b(h)
        return self.head(self.proj(h))

    def loss(self, t, y):
        return F.cross_entropy(self(t).float().flatten(0, 1), y.flatten())


def _build():
    torch.manual_seed(0)
    return Net()


def _wrap(model, mesh, **kw):
    kw.setdefault("mp_policy", BF16)
    kw.setdefault("all_gather_quant", POL)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model.proj, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _groups(model):
    return [*model.blocks, model.proj, model]


def _expected(name, full_t, dtype=torch.bfloat16):
    if POL.applies(name, full_t):
        return quantize_dequantize(full_t, POL, dtype)
    return full_t.to(dtype)


def _check_gathered(model, masters: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """Unshard every group and compare each registered parameter with the reference."""
    for g in _groups(model):
        g.unshard()
    for name, p in model.named_parameters():
        assert not isinstance(p, torch.distributed.tensor.DTensor), name
        want = _expected(name, masters[name], dtype)
        assert p.dtype == dtype and torch.equal(p, want), (
            f"{name}: gathered weight differs from the single-process quantise-dequantise "
            f"(max |diff| {(p.float() - want.float()).abs().max():.3e})")
    for g in _groups(model):
        g.reshard()


def case_gathered_weights_bitwise(rank, world):
    mesh = cpu_mesh(world)
    ref = _build()
    model = _wrap(_build(), mesh)
    quantised = {n for n, p in ref.named_parameters() if POL.applies(n, p)}
    assert quantised == {"emb.weight", "proj.weight", "head.weight"} | {
        f"blocks.{i}.{k}" for i in range(2) for k in ("lin.weight", "experts_b", "experts_a", "out.weight")}
    kinds = [(b.quant is not None, b.compute_dtype) for g in _groups(model) for b in g.dbuffers]
    assert (True, torch.bfloat16) in kinds and (False, torch.bfloat16) in kinds
    if world == 4:  # proj's 3 tile rows: at least one rank holds none of them
        lay = model.proj.dbuffers[0].quant.layout
        assert min(sum(t) for t in lay.tiles) == 0
    _check_gathered(model, {n: p.detach() for n, p in ref.named_parameters()})
    # the forward computes with exactly these weights
    ref_q = _build().to(torch.bfloat16)
    with torch.no_grad():
        for (n, q), (_, p) in zip(ref_q.named_parameters(), ref.named_parameters()):
            q.copy_(_expected(n, p))
    t, _ = global_batch(0, 2, 8, 50)
    assert torch.equal(model(t), ref_q(t))
    if world == 4:  # reshard_after_forward=2: backward re-gathers the kept bf16 within pairs
        m2 = _wrap(_build(), mesh, reshard_after_forward=2)
        m2(t).sum()  # forward with grad: each rank keeps its half of every gathered buffer
        assert all(b._fsdp_state().group.sharded_state.name == "SHARDED_POST_FORWARD" for b in m2.blocks)
        _check_gathered(m2, {n: p.detach() for n, p in ref.named_parameters()})


def case_training_matches_reference(rank, world):
    """AdamW on fp32 masters, computing in fp32 (so the only difference from the reference is
    the order of the gradient sums); the reference computes with the quantise-dequantise of
    its masters on the global batch. After each step the gathered weights are checked bitwise
    against quantise-dequantise of the engine's own masters. (bf16 compute: the gathered
    weights and the forward are checked bitwise in case_gathered_weights_bitwise.)"""
    mesh = cpu_mesh(world)
    ref = _build()
    ref_c = _build()
    model = _wrap(_build(), mesh, mp_policy=MixedPrecisionPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    named_ref = dict(ref.named_parameters())
    per, f32 = 2, torch.float32
    for step in range(3):
        tokens, targets = global_batch(step, per * world, 12, 50)
        with torch.no_grad():
            for n, q in ref_c.named_parameters():
                q.copy_(_expected(n, named_ref[n], f32))
        ref_loss = ref_c.loss(tokens, targets)
        ref_loss.backward()
        for n, q in ref_c.named_parameters():
            named_ref[n].grad, q.grad = q.grad, None
        loss = model.loss(tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        total /= world
        rel = abs(total.item() - ref_loss.item()) / ref_loss.item()
        assert rel <= 1e-5, f"step {step}: loss {total.item()} vs reference {ref_loss.item()} (rel {rel:.1e})"
        for n, p in model.named_parameters():
            g, rg = full(p.grad), named_ref[n].grad
            err = (g - rg).abs().max() / rg.abs().max()
            assert err <= 1e-4, f"step {step}: {n}.grad off by {err:.1e} (relative to its max)"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _check_gathered(model, {n: full(p).detach() for n, p in model.named_parameters()}, f32)
    for n, p in model.named_parameters():
        err = (full(p) - named_ref[n]).abs().max().item()
        assert err <= 1e-4, f"{n}: |engine - reference| = {err:.1e} after 3 steps"


def case_bad_configurations(rank, world):
    mesh = cpu_mesh(world)
    with pytest.raises(TypeError, match="all_gather_quant must be a ragged_fsdp.BlockFP8"):
        fully_shard(_build(), mesh=mesh, all_gather_quant="fp8")
    with pytest.raises(ValueError, match=r"quantises 'experts_b'.*granularity_fn returned 'row'.*return 'rows:8'"):
        _wrap(_build(), mesh, granularity_fn=lambda n, p: "row" if p.dim() >= 2 else None)
    with pytest.raises(ValueError, match=r"experts_a.*return 'rows:12'"):
        _wrap(_build(), mesh, granularity_fn=lambda n, p: "rows:8" if "experts" in n else None)
    # a granularity that keeps tiles whole is honoured (whole tensors on one rank)
    m = _wrap(_build(), mesh, granularity_fn=lambda n, p: "tensor" if p.dim() >= 2 else None)
    _check_gathered(m, {n: p.detach() for n, p in _build().named_parameters()})
    # no mixed precision: dequantised into fp32, still quantised at W = 1 (no aliasing)
    m = _wrap(_build(), mesh, mp_policy=MixedPrecisionPolicy())
    m.proj.unshard()
    w = m.proj.weight
    assert w.dtype == torch.float32 and torch.equal(w, quantize_dequantize(_build().proj.weight.detach(), POL))
    m.proj.reshard()


def case_bench_bytes_match_engine(rank, world):
    """The bench's planned bytes per gather equal the engine's buffers for the same model."""
    from fp8_allgather import cell, module_groups

    mesh = cpu_mesh(world)
    plain = _build()
    want = cell(module_groups(plain, _groups(plain)), world, POL, want_suggest=False)
    model = _wrap(_build(), mesh)
    got = {"codes": 0, "scales": 0, "rest_bf16": 0}
    for g in _groups(model):
        for b in g.dbuffers:
            if b.quant is not None:
                got["codes"] += b.layout.total
                got["scales"] += b.quant.layout.total * 4
            else:
                got["rest_bf16"] += b.layout.total * 2
    assert got == {k: want["fp8"][k] for k in got}, (got, want["fp8"])


CASES = [case_gathered_weights_bitwise, case_training_matches_reference, case_bad_configurations,
         case_bench_bytes_match_engine]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def results(request):
    return run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_fp8_allgather(results, case):
    check_case(results, case, results.get("_world"))
