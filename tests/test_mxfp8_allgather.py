"""MXFP8 all-gather (fully_shard(all_gather_quant=MXFP8())): one plane per gather.

The reference is torchao's own ``to_mx`` (``torchao.prototype.mx_formats``, independent of
``ragged_fsdp.quant.mxfp8``): pure math first (both planes, both scaling modes, tail blocks,
bf16 and fp32 input, dequantisation), then on W = 1..4 gloo ranks (one launch per W): the
codes and scales each gather moved are bitwise torchao's quantisation of the full master
weight, the forward's the row plane and the backward's re-gather the column plane (never
both), with tail blocks, fused experts in both tilings and a rank holding nothing; training
(fp32 compute, accumulation over two micro-batches) matches a single-process emulation that
computes the forward with the row plane and the input gradient with the column plane; HSDP,
EP and offload gather the same planes; checkpoints hold fp32 masters only; ranks passing
different policies fail on every rank. Under ``global_order`` a few steps give the same bits
at every W (the last test compares the launches' files).

NVFP4 (``NVFP4()``) rides the same launches: its math against torchao's ``NVFP4Tensor.to_nvfp4``
with a per-tensor scale, then one case per W: the gathered codes, block scales and per-tensor
scale of each phase's plane bitwise torchao's of the full master (2-D weights, fused experts
in both tilings, a rank holding nothing), the wire bytes, one training step against the
emulation, and the gathered planes written out so that a last test compares them across W.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

from _dist import check_case, cpu_mesh, full, global_batch, run_cases

from ragged_fsdp import MXFP8, NVFP4, BlockFP8, OffloadPolicy, fully_shard
from ragged_fsdp.fsdp import trace
from ragged_fsdp.quant.mxfp8 import mx_dequantize, mx_quantize
from ragged_fsdp.quant.nvfp4 import e2m1_encode, nv_dequantize, nv_quantize

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
torchao_nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
torchao_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ENV = "RAGGED_MXFP8_DIR"


# -- the independent reference: torchao ---------------------------------------------------
def _torchao(full_w: torch.Tensor, plane: str, scaling: str = "floor"):
    """torchao's to_mx of the full weight in ``plane``, as (codes, scales) uint8 at the
    weight's element positions; a blocked dim that is not a multiple of 32 is zero-padded
    for torchao (which requires a multiple) and the codes cropped back."""
    src = full_w if plane == "rows" else full_w.transpose(-1, -2)
    K = src.shape[-1]
    padded = F.pad(src, (0, -K % 32)).contiguous()
    scales, data = torchao_mx.to_mx(padded, torch.float8_e4m3fn, 32, torchao_mx.ScaleCalculationMode(scaling))
    codes, scales = data[..., :K].view(torch.uint8), scales.view(torch.uint8)
    if plane == "cols":
        codes, scales = codes.transpose(-1, -2), scales.transpose(-1, -2)
    return codes.contiguous(), scales.contiguous()


def _torchao_dequant(full_w: torch.Tensor, plane: str, dtype: torch.dtype, whole=None) -> torch.Tensor:
    codes, scales = _torchao(full_w, plane)
    if plane == "cols":
        codes, scales = codes.transpose(-1, -2), scales.transpose(-1, -2)
    K = codes.shape[-1]
    c = F.pad(codes, (0, -K % 32)).contiguous()
    out = torchao_mx.to_dtype(c.view(torch.float8_e4m3fn).reshape(-1, c.shape[-1]),
                              scales.contiguous().view(torch.float8_e8m0fnu), torch.float8_e4m3fn, 32, dtype)
    out = out.reshape(c.shape)[..., :K]
    return (out.transpose(-1, -2) if plane == "cols" else out).contiguous()


def _torchao_nv(full_w: torch.Tensor, plane: str, whole: torch.Tensor | None = None):
    """torchao's ``NVFP4Tensor.to_nvfp4`` of the full weight in ``plane`` with the per-tensor
    scale of its amax: (codes one per element, E4M3 scales as uint8, per-tensor scale,
    fp32 dequantisation), at the weight's element positions; a blocked dim that is not a
    multiple of 16 zero-padded for torchao and cropped back. ``whole``: the tensor whose amax
    sets the per-tensor scale (one expert of fused experts: the whole parameter)."""
    src = full_w if plane == "rows" else full_w.transpose(-1, -2)
    K = src.shape[-1]
    pts = torchao_nv.per_tensor_amax_to_scale((full_w if whole is None else whole).abs().amax())
    t = torchao_nv.NVFP4Tensor.to_nvfp4(F.pad(src, (0, -K % 16)).contiguous(), per_tensor_scale=pts)
    codes = torchao_kernels.unpack_uint4(t.qdata.contiguous().view(torch.uint8))[..., :K]
    scales, deq = t.scale.view(torch.uint8), t.dequantize(torch.float32)[..., :K]
    if plane == "cols":
        codes, scales, deq = codes.transpose(-1, -2), scales.transpose(-1, -2), deq.transpose(-1, -2)
    return codes.contiguous(), scales.contiguous(), pts, deq.contiguous()


def _torchao_nv_dequant(full_w: torch.Tensor, plane: str, dtype: torch.dtype, whole=None) -> torch.Tensor:
    return _torchao_nv(full_w, plane, whole)[3].to(dtype)


# -- pure math ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_bitwise_torchao(dtype):
    # E2M1 rounding: every tie, signed zeros, the clamp edge
    grid = torch.cat([torch.arange(-48, 49) / 8, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 1e-9, -1e-9])])
    grid = torch.cat([grid, -grid, torch.randn(10000).clamp(-6, 6)])
    assert torch.equal(e2m1_encode(grid), torchao_kernels.f32_to_f4_unpacked(grid))
    torch.manual_seed(0)
    for shape in [(64, 96), (70, 45), (3, 40, 33), (2, 64, 32)]:
        w = (torch.randn(shape) * torch.logspace(-9, 2, shape[-1])).to(dtype)  # clamped block scales
        w[..., :16, :16] = 0
        for plane in ("rows", "cols"):
            codes, scales, pts = nv_quantize(w, plane)
            want_c, want_s, want_p, want_d = _torchao_nv(w, plane)
            assert torch.equal(pts, want_p) and torch.equal(codes, want_c) and torch.equal(scales, want_s), (shape, plane)
            assert torch.equal(nv_dequantize(codes, scales, pts, plane, torch.float32), want_d), (shape, plane)
    with pytest.raises(ValueError, match="NVFP4: min_numel"):
        NVFP4(min_numel=-1)
    assert NVFP4().applies("w", torch.empty(16, 16)) and not NVFP4().applies("w", torch.empty(15, 16))


@pytest.mark.parametrize("scaling", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planes_bitwise_torchao(scaling, dtype):
    torch.manual_seed(0)
    for shape in [(64, 96), (70, 45), (3, 40, 33), (2, 64, 32)]:
        # columns spanning 11 decades (subnormal E4M3 codes, clamped scales), zero blocks
        w = (torch.randn(shape) * torch.logspace(-9, 2, shape[-1])).to(dtype)
        w[..., :32, :32] = 0
        for plane in ("rows", "cols"):
            codes, scales = mx_quantize(w, plane, scaling)
            want_c, want_s = _torchao(w, plane, scaling)
            assert torch.equal(codes, want_c), (shape, plane)
            assert torch.equal(scales, want_s), (shape, plane)
            if scaling == "floor":
                for out in (torch.float32, torch.bfloat16):
                    got = mx_dequantize(codes, scales, plane, out)
                    assert torch.equal(got.view(torch.uint8), _torchao_dequant(w, plane, out).view(torch.uint8))


def test_planes_differ_and_errors():
    torch.manual_seed(0)
    w = torch.randn(64, 64) * torch.logspace(-3, 3, 64)
    rows = mx_dequantize(*mx_quantize(w, "rows"), "rows", torch.float32)
    cols = mx_dequantize(*mx_quantize(w, "cols"), "cols", torch.float32)
    assert not torch.equal(rows, cols)  # the two planes are not interchangeable
    for bad, match in [(dict(scaling="even"), "scaling='even'"), (dict(min_numel=-1), "min_numel"),
                       (dict(param_filter=3), "param_filter")]:
        with pytest.raises((ValueError, TypeError), match=match):
            MXFP8(**bad)
    pol = MXFP8()
    assert pol.applies("w", torch.empty(32, 32)) and not pol.applies("w", torch.empty(31, 32))
    assert not pol.applies("b.bias", torch.empty(64, 64)) and not pol.applies("v", torch.empty(4096))


# -- the model on W ranks -------------------------------------------------------------------
def _lin(x, w):
    return F.linear(x, w)


class Linear(nn.Linear):
    mm = staticmethod(_lin)

    def forward(self, x):
        y = self.mm(x, self.weight)
        return y if self.bias is None else y + self.bias


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = Linear(40, 72)  # rows 72 = 2 tiles + 8, cols 40: a tail block both ways
        self.experts_a = nn.Parameter(torch.randn(3, 40, 72) * 0.1)  # R=40: whole expert matrices
        self.experts_b = nn.Parameter(torch.randn(2, 64, 40) * 0.1)  # R=64: 32-row tiles
        self.experts_c = nn.Parameter(torch.randn(2, 40, 64) * 0.1)
        self.norm = nn.Parameter(torch.ones(40))
        self.mm = _lin

    def forward(self, x):
        a = F.silu(self.lin(x))
        h = sum(self.mm(a, self.experts_a[e]) for e in range(3)) / 3
        b = sum(self.mm(F.silu(self.mm(h, self.experts_b[e])), self.experts_c[e]) for e in range(2))
        return (x + b) * self.norm


class Net(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, 40)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = Linear(40, 96, bias=False)  # 3 tile rows: a rank holds nothing at W = 4
        self.head = Linear(96, vocab)

    def set_mm(self, mm):
        for m in self.modules():
            if isinstance(m, (Block, Linear)):
                m.mm = mm
        return self

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


def _groups(model):
    return [*model.blocks, model.proj, model]


def _prefix(model, g):
    return "" if g is model else next(n for n, m in model.named_modules() if m is g) + "."


class Seen:
    """An ``on_gathered`` recorder: every (full name, plane) a gather moved, with its bits."""

    def __init__(self):
        self.got: list[tuple] = []  # (name, plane, codes, scales[, per-tensor scale])

    def at(self, prefix):
        def record(name, plane, codes, scales, *pts):
            self.got.append((prefix + name, plane, codes.clone(), scales.clone(), *(p.clone() for p in pts)))
        return record

    def planes(self):
        return [(n, p) for n, p, *_ in self.got]


def _wrap(model, mesh, seen: Seen | None = None, fmt=MXFP8, **kw):
    kw.setdefault("mp_policy", BF16)
    kw.setdefault("reshard_after_forward", True)
    for g in _groups(model):
        pol = fmt(on_gathered=None if seen is None else seen.at(_prefix(model, g)))
        fully_shard(g, mesh=mesh, all_gather_quant=pol, **kw)
    return model


def _check_against_torchao(seen: Seen, masters: dict[str, torch.Tensor]):
    assert seen.got
    for name, plane, codes, scales, *pts in seen.got:
        if pts:  # NVFP4
            want_c, want_s, want_p, _ = _torchao_nv(masters[name], plane)
            assert torch.equal(pts[0], want_p), f"{name} ({plane}): per-tensor scale differs from torchao's"
        else:
            want_c, want_s = _torchao(masters[name], plane)
        assert torch.equal(codes, want_c), f"{name} ({plane}): codes differ from torchao's"
        assert torch.equal(scales, want_s), f"{name} ({plane}): scales differ from torchao's"


QUANTISED = {"emb.weight", "proj.weight", "head.weight"} | {
    f"blocks.{i}.{k}" for i in range(2) for k in ("lin.weight", "experts_a", "experts_b", "experts_c")}


def case_planes_per_phase_bitwise(rank, world):
    """Forward gathers move the row plane, backward re-gathers the column plane, and every
    code and scale is torchao's quantisation of the full fp32 master; bytes on the wire."""
    mesh = cpu_mesh(world)
    ref = _build()
    masters = {n: p.detach() for n, p in ref.named_parameters()}
    assert {n for n, p in ref.named_parameters() if MXFP8().applies(n, p)} == QUANTISED
    seen = Seen()
    model = _wrap(_build(), mesh, seen)
    t, y = global_batch(0, 2, 8, 50)
    with trace() as tr:
        model.loss(t, y).backward()
    _check_against_torchao(seen, masters)
    fwd = [e for e in tr.of("all_gather") if e.plane is not None and not e.backward]
    bwd = [e for e in tr.of("all_gather") if e.plane is not None and e.backward]
    assert {e.plane for e in fwd} == {"rows"} and {e.plane for e in bwd} == {"cols"}
    # each quantised weight: rows once in forward; cols once in backward, but the embedding,
    # whose backward needs no weight
    planes = seen.planes()
    for n in QUANTISED:
        assert planes.count((n, "rows")) == 1, (n, planes)
        assert planes.count((n, "cols")) == (0 if n == "emb.weight" else 1), (n, planes)
    # wire bytes: codes (one byte per element of the segment) + one E8M0 byte per 32 elements
    by_group = {_prefix(model, g).rstrip(".") or "<root>": g for g in _groups(model)}
    for e in fwd + bwd:
        buf = by_group[e.group].dbuffers[e.index]
        assert e.wire == world * buf.segment + buf.quant.layouts[e.plane].total
    if world == 1:  # no padding: 1 byte per element + one per 32-element block (tail blocks too)
        (e,) = [e for e in fwd if e.group == "blocks.0"]
        assert e.wire == (72 * 40 + 3 * 40 * 72 + 2 * 64 * 40 + 2 * 40 * 64) + (72 * 2 + 3 * 40 * 3 + 2 * 64 * 2 + 2 * 40 * 2)
    # the forward computes with the row plane: a plain bf16 model holding torchao's dequantised rows
    ref_q = _build().to(torch.bfloat16)
    with torch.no_grad():
        for (n, q), (_, p) in zip(ref_q.named_parameters(), ref.named_parameters()):
            q.copy_(_torchao_dequant(p.detach(), "rows", torch.bfloat16) if n in QUANTISED else p.to(torch.bfloat16))
        assert torch.equal(model(t), ref_q(t))
    if world == 4:
        lay = model.proj.dbuffers[0].quant.layouts["rows"]
        assert min(sum(row) for row in lay.tiles) == 0  # proj's 3 tile rows: a rank holds none


def _linear_ref(deq):
    """The emulated MXFP8 / NVFP4 linear, written from torchao: forward ``x @ Qrows(W).T``,
    input gradient ``dy @ Qcols(W)``, weight gradient ``dy.T @ x`` (high precision);
    ``deq(w, plane, dtype, whole)``: torchao's dequantised plane, ``whole`` the parameter ``w``
    is a view of (one expert of fused experts: NVFP4's per-tensor scale is the parameter's)."""

    class LinearRef(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            q, whole = w.detach(), (w if w._base is None else w._base).detach()
            if w.numel() >= 1024:
                q = deq(q, "rows", torch.float32, whole)
            return F.linear(x, q)

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            q, whole = w.detach(), (w if w._base is None else w._base).detach()
            if w.numel() >= 1024:
                q = deq(q, "cols", torch.float32, whole)
            dw = dy.flatten(0, -2).t() @ x.flatten(0, -2)
            return dy @ q, dw

    return LinearRef.apply


_ref_mm = _linear_ref(_torchao_dequant)
_nv_ref_mm = _linear_ref(_torchao_nv_dequant)


def case_training_matches_emulation(rank, world):
    """MXFP8, 2 steps (see below)."""
    _training_matches_emulation(rank, world, MXFP8, _ref_mm, _torchao_dequant)


def _training_matches_emulation(rank, world, fmt, ref_mm, deq, steps=2):
    """fp32 compute, AdamW, ``steps`` steps of 2 accumulated micro-batches: loss, grads and weights
    match a single-process reference (torchao's planes, forward rows / backward cols) up to
    the order of the gradient sums. The embedding is quantised in rows only (its backward
    needs no weight). Masters and optimizer state stay fp32 and sharded; the checkpoint
    holds the masters only."""
    mesh = cpu_mesh(world)
    ref = _build().set_mm(ref_mm)
    model = _wrap(_build(), mesh, fmt=fmt, mp_policy=MixedPrecisionPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    named_ref = dict(ref.named_parameters())
    per = 2
    for step in range(steps):
        ref_total = 0.0
        total = torch.zeros(())
        for micro in range(2):
            tokens, targets = global_batch(10 * step + micro, per * world, 8, 50)
            # the reference's embedding computes with its rows plane too
            with torch.no_grad():
                emb_q = deq(named_ref["emb.weight"].detach(), "rows", torch.float32)
            w_emb = named_ref["emb.weight"]
            saved = w_emb.data.clone()
            w_emb.data.copy_(emb_q)
            rl = ref.loss(tokens, targets) / 2
            rl.backward()
            w_emb.data.copy_(saved)
            ref_total += rl.item()
            last = micro == 1
            for g in _groups(model):
                g.set_requires_gradient_sync(last, recurse=False)
            loss = model.loss(tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]) / 2
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        total /= world
        rel = abs(total.item() - ref_total) / ref_total
        assert rel <= 1e-5, f"step {step}: loss {total.item()} vs reference {ref_total} (rel {rel:.1e})"
        for n, p in model.named_parameters():
            g, rg = full(p.grad), named_ref[n].grad
            err = (g - rg).abs().max() / rg.abs().max()
            assert err <= 1e-4, f"step {step}: {n}.grad off by {err:.1e} (relative to its max)"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and full(p).shape == named_ref[n].shape, n
        err = (full(p) - named_ref[n]).abs().max().item()
        assert err <= 1e-4, f"{n}: |engine - reference| = {err:.1e} after 2 steps"
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim():
                assert v.dtype == torch.float32, k
    sd = model.state_dict()
    assert sd.keys() == ref.state_dict().keys()  # masters only: no codes, no scales
    for k, v in sd.items():
        assert full(v).dtype == torch.float32, k


def case_reshard_false_keeps_rows(rank, world):
    """``reshard_after_forward=False``: the forward's row plane stays (dequantised) for
    backward; no backward gather, no column plane."""
    mesh = cpu_mesh(world)
    seen = Seen()
    model = _wrap(_build(), mesh, seen, reshard_after_forward=False)
    t, y = global_batch(0, 2, 8, 50)
    model.loss(t, y).backward()
    assert {p for _, p in seen.planes()} == {"rows"}


def case_compositions(rank, world):
    """HSDP (W = 4: 2 replicas x 2 shards), EP (W = 4: ep 2 x dp 2) and offload gather the
    same torchao planes; a
    granularity that would cut a tile is refused; policies that differ across ranks fail on
    every rank."""
    masters = {n: p.detach() for n, p in _build().named_parameters()}
    t, y = global_batch(0, 2, 8, 50)
    meshes = [("1-D", cpu_mesh(world))]
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        meshes.append(("HSDP", init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))))
    for what, mesh in meshes:
        for kw in ({}, {"offload_policy": OffloadPolicy(params=True, grads=True, optimizer_states=True)}):
            seen = Seen()
            model = _wrap(_build(), mesh, seen, **kw)
            model.loss(t, y).backward()
            _check_against_torchao(seen, masters)
            assert {p for _, p in seen.planes()} == {"rows", "cols"}, (what, kw)
    if world == 4:
        # NVFP4 once, HSDP and offload together: per-tensor scales agreed over the shard dim
        seen = Seen()
        model = _wrap(_build(), meshes[1][1], seen, fmt=NVFP4,
                      offload_policy=OffloadPolicy(params=True, grads=True, optimizer_states=True))
        model.loss(t, y).backward()
        _check_against_torchao(seen, masters)
        assert {p for _, p in seen.planes()} == {"rows", "cols"}
        _expert_parallel_planes(MXFP8)
        _expert_parallel_planes(NVFP4)
    mesh = cpu_mesh(world)
    with pytest.raises(ValueError, match=r"MXFP8.*quantises '.*' .*32x32 tiles.*granularity_fn returned 'row'.*return 'rows:(32|40)'.*MXFP8\(param_filter"):
        _wrap(_build(), mesh, granularity_fn=lambda n, p: "row" if p.dim() >= 2 else None)
    if world > 1:
        from ragged_fsdp.agreement import DisagreementError

        pol = MXFP8() if rank == 0 else BlockFP8(tile=(32, 32))
        with pytest.raises(DisagreementError, match=r"all_gather_quant differs across ranks.*MXFP8"):
            fully_shard(_build(), mesh=mesh, all_gather_quant=pol)
        pol = MXFP8() if rank == 0 else NVFP4()
        with pytest.raises(DisagreementError, match=r"all_gather_quant differs across ranks.*NVFP4"):
            fully_shard(_build(), mesh=mesh, all_gather_quant=pol)


def _expert_parallel_planes(fmt):
    """EP 2 x dp 2: each layer's EP-local experts (4 of 8, rows 40: whole expert matrices)
    gather their planes over dp; the bits are torchao's of the EP-local master (NVFP4: its
    per-tensor scale that of the EP-local experts, agreed over dp)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.models import MoE, MoEConfig, apply_expert_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny(fused_experts=True, n_experts=8, dim=64, expert_hidden=40))
    apply_expert_parallel(model, mesh["ep"])
    masters = {f"layers.{i}.{k}": getattr(layer.feed_forward.experts, k).to_local().detach().clone()
               for i, layer in enumerate(model.layers) for k in ("w1", "w2", "w3")}
    seen = Seen()
    dp_ep = mesh["dp", "ep"]._flatten("dp_ep")
    for i, layer in enumerate(model.layers):
        fully_shard(layer.feed_forward.experts, mesh=mesh["dp"], reshard_after_forward=True,
                    all_gather_quant=fmt(on_gathered=seen.at(f"layers.{i}.")))
        layer.feed_forward.experts.set_gradient_divide_factor(4)
        fully_shard(layer, mesh=dp_ep)
    fully_shard(model, mesh=dp_ep)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens).mean().backward()
    _check_against_torchao(seen, masters)
    assert sorted(seen.planes()) == sorted((n, p) for n in masters for p in ("rows", "cols"))


def case_nvfp4(rank, world):
    """NVFP4: forward gathers move the row plane, backward re-gathers the column plane, and
    every code, block scale and per-tensor scale is torchao's NVFP4 of the full fp32 master;
    bytes on the wire; the planes written out (W-invariance, the last test); then one
    training step against the emulation (one: a later step could flip an FP4 code on a
    last-bit difference of the weights, a jump that says nothing about the gather)."""
    mesh = cpu_mesh(world)
    masters = {n: p.detach() for n, p in _build().named_parameters()}
    assert {n for n, p in masters.items() if NVFP4().applies(n, p)} == QUANTISED
    seen = Seen()
    model = _wrap(_build(), mesh, seen, fmt=NVFP4)
    t, y = global_batch(0, 2, 8, 50)
    with trace() as tr:
        model.loss(t, y).backward()
    _check_against_torchao(seen, masters)
    planes = seen.planes()
    for n in QUANTISED:
        assert planes.count((n, "rows")) == 1, (n, planes)
        assert planes.count((n, "cols")) == (0 if n == "emb.weight" else 1), (n, planes)
    gathers = [e for e in tr.of("all_gather") if e.plane is not None]
    assert {(e.plane, e.backward) for e in gathers} == {("rows", False), ("cols", True)}
    # wire bytes: codes two per byte + one E4M3 byte per 16 elements + a 4-byte amax per tensor
    by_group = {_prefix(model, g).rstrip(".") or "<root>": g for g in _groups(model)}
    for e in gathers:
        buf = by_group[e.group].dbuffers[e.index]
        lay = buf.quant.layouts[e.plane]
        assert e.wire == world * -(-buf.segment // 2) + lay.total + 4 * len(lay.slots)
    if world == 1:
        (e,) = [e for e in gathers if e.group == "blocks.0" and e.plane == "rows"]
        elems = 72 * 40 + 3 * 40 * 72 + 2 * 64 * 40 + 2 * 40 * 64
        assert e.wire == elems // 2 + (72 * 3 + 3 * 40 * 5 + 2 * 64 * 3 + 2 * 40 * 4) + 4 * 4
    if world == 4:
        lay = model.proj.dbuffers[0].quant.layouts["rows"]
        assert sorted(sum(row) for row in lay.tiles) != [sum(lay.tiles[0])] * 4  # uneven shards
    if rank == 0:
        got = {f"{n}/{p}": (c, e, *pts) for n, p, c, e, *pts in seen.got}
        torch.save(got, os.path.join(os.environ[ENV], f"nv{world}.pt"))
    _training_matches_emulation(rank, world, NVFP4, _nv_ref_mm, _torchao_nv_dequant, steps=1)


def case_global_order_bits(rank, world):
    """``global_order`` with MXFP8: one step (12 micro-batches) of a tiny Llama (odd dims); the launch writes
    its parameters, compared bitwise across W by the last test."""
    from ragged_fsdp import global_order
    from ragged_fsdp.fsdp import deterministic as det
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=72,
                              max_seq_len=8))
    mesh = cpu_mesh(world)
    for g in (*model.layers, model):
        fully_shard(g, mesh=mesh, all_gather_quant=MXFP8(), reshard_after_forward=True)
    global_order(model, micro_batches=12)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    for step in range(1):
        for j in det.micro_batches(model):
            g = torch.Generator().manual_seed(100 * step + j)
            data = torch.randint(0, 97, (2, 9), generator=g)
            model.loss(data[:, :-1], data[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    params = {k: full(p.detach()).clone() for k, p in model.named_parameters()}
    if rank == 0:
        torch.save(params, os.path.join(os.environ[ENV], f"w{world}.pt"))


CASES = [case_planes_per_phase_bitwise, case_training_matches_emulation, case_reshard_false_keeps_rows,
         case_compositions, case_global_order_bits, case_nvfp4]
WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mxfp8"))


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"W{w}")
def results(request, outdir):
    os.environ[ENV] = outdir
    out = run_cases(request.param, CASES)
    out["_world"] = request.param
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_mxfp8_allgather(results, case):
    check_case(results, case, results.get("_world"))


def test_global_order_same_bits_at_every_world_size(outdir, results):
    files = {w: os.path.join(outdir, f"w{w}.pt") for w in WORLDS}
    if not all(os.path.exists(f) for f in files.values()):
        pytest.skip("runs after the last launch")
    base = torch.load(files[1], weights_only=True)
    for w in WORLDS[1:]:
        got = torch.load(files[w], weights_only=True)
        for k in base:
            assert torch.equal(got[k].view(torch.uint8), base[k].view(torch.uint8)), f"W={w}: {k} differs from W=1"


def test_nvfp4_planes_same_bits_at_every_world_size(outdir, results):
    """The NVFP4 planes each W gathered (codes, block scales, per-tensor scale) are the same bits."""
    files = {w: os.path.join(outdir, f"nv{w}.pt") for w in WORLDS}
    if not all(os.path.exists(f) for f in files.values()):
        pytest.skip("runs after the last launch")
    base = torch.load(files[1], weights_only=True)
    assert len(base) == 2 * len(QUANTISED) - 1  # every quantised weight in both planes, the embedding in rows
    for w in WORLDS[1:]:
        got = torch.load(files[w], weights_only=True)
        assert got.keys() == base.keys()
        for k in base:
            for a, b in zip(got[k], base[k]):
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"W={w}: {k} differs from W=1"
