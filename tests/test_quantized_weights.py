"""Tensor-subclass parameters with their own all-gather (FSDP2's fsdp_pre/post_all_gather)
and QLoRA with NF4 base weights whose quantisation blocks stay whole; trainable subclass
weights (a float8-like test weight) against the same model in one process.

One launch of 3 gloo ranks; sub-meshes give W = 1 (each rank alone), 2 (ranks 0, 1) and 3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import check_case, run_cases

WORLD = 3


class Int8Rows(torch.Tensor):
    """A test weight: int8 codes plus one fp32 scale per block of ``rows`` rows. Its
    all-gather inputs are the codes and the scales (two dtypes). ``legacy``: the 1-argument
    fsdp_pre_all_gather, the shape taken from the gathered codes."""

    @staticmethod
    def __new__(cls, codes, scales, rows, legacy=False):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32, device=codes.device)

    def __init__(self, codes, scales, rows, legacy=False):
        self.codes, self.scales, self.rows, self.legacy = codes, scales, rows, legacy

    @classmethod
    def quantize(cls, w, rows, legacy=False):
        blocks = F.pad(w, (0, 0, 0, -w.shape[0] % rows)).view(-1, rows * w.shape[1])
        scales = blocks.abs().amax(1).clamp_min(1e-12) / 127
        codes = (blocks / scales[:, None]).round().to(torch.int8).view(-1, w.shape[1])[: w.shape[0]]
        return cls(codes.contiguous(), scales, rows, legacy)

    def dequantize(self):
        s = self.scales.repeat_interleave(self.rows)[: self.codes.shape[0]]
        return self.codes.float() * s[:, None]

    @property
    def ragged_granularity(self):
        return f"rows:{self.rows}"

    def _pre(self):
        return (self.codes, self.scales), (self.rows, self.legacy)

    def _post(self, outs, meta, shape=None):
        codes, scales = outs
        if shape is not None:
            codes = codes.view(shape)
        return type(self)(codes, scales, *meta), (codes, scales)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear:
            return F.linear(args[0], args[1].dequantize())
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w, aten = args[0], torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return type(w)(w.codes, w.scales, w.rows, w.legacy)
        if func is aten.split_with_sizes.default:
            out, at = [], 0
            for n in args[1]:
                assert at % w.rows == 0 or n == 0, "a block was cut"
                b0, b1 = at // w.rows, -(-(at + n) // w.rows)
                out.append(type(w)(w.codes[at:at + n], w.scales[b0:b1] if n else w.scales[:0], w.rows, w.legacy))
                at += n
            return out
        raise NotImplementedError(func)


class Int8RowsFive(Int8Rows):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        ins, meta = self._pre()
        return ins, (meta, tuple(outer_size), mesh.size(), type(module).__name__)

    def fsdp_post_all_gather(self, outs, metadata, param_dtype, *, out=None):
        meta, shape, _, _ = metadata
        if out is not None:
            return None
        full, inner = self._post(outs, meta, shape)
        return Int8RowsFive(full.codes, full.scales, *meta), inner


class Int8RowsOne(Int8Rows):
    def fsdp_pre_all_gather(self, mesh):
        return self._pre()

    def fsdp_post_all_gather(self, outs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None
        full, inner = self._post(outs, metadata)
        return Int8RowsOne(full.codes, full.scales, *metadata), inner


class QLinear(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(w.shape[0]))

    def forward(self, x):
        return F.linear(x, self.weight) + self.bias


def _meshes(rank):
    """(world size, mesh or None when this rank is outside it) for W = 1, 2, 3."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    solo = [dist.new_group([r]) for r in range(WORLD)]  # every rank creates every group
    pair = dist.new_group([0, 1])
    return [
        (1, DeviceMesh.from_group(solo[rank], "cpu")),
        (2, DeviceMesh.from_group(pair, "cpu") if rank < 2 else None),
        (3, init_device_mesh("cpu", (WORLD,))),
    ]


def case_subclass_round_trip(rank, world):
    from ragged_fsdp import fully_shard
    from ragged_fsdp.fsdp import trace

    for W, mesh in _meshes(rank):
        for kind in (Int8RowsFive, Int8RowsOne):
            torch.manual_seed(0)
            ws = [torch.randn(10, 8), torch.randn(7, 10), torch.randn(16, 7)]  # 10 and 7 rows: partial last blocks
            ref = [kind.quantize(w, 4) for w in ws]
            if mesh is None:
                continue
            model = nn.Sequential(*[QLinear(kind.quantize(w, 4)) for w in ws])
            fully_shard(model, mesh=mesh)
            for lin in model:
                local = lin.weight.to_local()
                assert type(local) is kind and local.codes.shape[0] % 4 in (0, lin.weight.shape[0] % 4)
            with trace() as t:
                model.unshard()
            for lin, r in zip(model, ref):
                g = lin.weight
                assert type(g) is kind and tuple(g.shape) == tuple(r.shape), (W, kind, type(g), g.shape)
                assert torch.equal(g.codes, r.codes) and torch.equal(g.scales, r.scales), (W, kind)
                assert torch.equal(g.dequantize(), r.dequantize())
            # one all-gather event for the subclass unit (its two dtypes: one collective each)
            assert sum(all(p.endswith("weight") for p in e.params) for e in t.of("all_gather")) == 1
            x = torch.randn(3, 8)
            y = model(x)  # the gathered weights compute
            want = x
            for r in ref:
                want = F.linear(want, r.dequantize())
            assert torch.equal(y, want), (W, kind)
            model.reshard()
            for lin in model:
                assert type(lin.weight.to_local()) is kind  # sharded again
            model.unshard()  # refilled in place (out=) after the free
            for lin, r in zip(model, ref):
                assert torch.equal(lin.weight.dequantize(), r.dequantize())
            model.reshard()


def case_subclass_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    bad = QLinear(Int8RowsFive.quantize(torch.randn(8, 8), 4))
    with pytest.raises(ValueError, match="granularity_fn returned 'row'"):
        fully_shard(bad, mesh=mesh, granularity_fn=lambda n, p: "row" if n == "weight" else None)
    # offload moves DBuffers; a subclass weight's gather inputs live in its own buffers
    from ragged_fsdp import OffloadPolicy, offload_to_host
    from ragged_fsdp.fsdp.offload.policy import force_host_copies

    force_host_copies(True)  # on a CPU mesh a policy moves nothing unless host copies are forced
    try:
        with pytest.raises(NotImplementedError, match="offload_policy is not implemented for tensor-subclass"):
            fully_shard(QLinear(Int8RowsFive.quantize(torch.randn(8, 8), 4)), mesh=mesh,
                        offload_policy=OffloadPolicy(optimizer_states=True))
    finally:
        force_host_copies(False)
    ok = fully_shard(QLinear(Int8RowsFive.quantize(torch.randn(8, 8), 4)), mesh=mesh)
    with pytest.raises(NotImplementedError, match="not implemented for models with tensor-subclass"):
        offload_to_host(ok)


def _qlora_model():
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from ragged_fsdp.models.qlora import qlora

    # wk/wv are 64 x 128 (half a scaler block); w1/w3 192 x 128 (1.5 scaler blocks)
    cfg = LlamaConfig(vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=192, max_seq_len=32)
    torch.manual_seed(0)
    return qlora(Llama(cfg), rank=8)


def case_qlora(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp import fully_shard
    from ragged_fsdp.fsdp.core.subclass_unit import SubclassUnit
    from ragged_fsdp.models.qlora import LoRALinear
    from ragged_fsdp.quant.nf4 import NF4Weight

    for W, mesh in _meshes(rank)[1:]:
        ref, model = _qlora_model(), _qlora_model()
        if mesh is None:
            continue
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for b in model.layers:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        # no quantisation block cut: every rank's rows start and end on a scaler block (or the end)
        span = 64 * 256
        units = [u for b in model.layers for u in b._fsdp_state().group.units if isinstance(u, SubclassUnit)]
        assert len(units) == 2
        for u in units:
            for s in u.buf.slots:
                for r in range(W):
                    a, b = s.placement.element_range(s.shape, r)
                    assert a == b or (a % span == 0 and (b % span == 0 or b == math.prod(s.shape))), (s.key, r, a, b)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" in n)
        # Every rank trains on the same batch. The bf16 adapters' gradients are averaged in fp32:
        # at W = 3, (g + g + g) / 3 is not always g in fp32, so an adapter's bf16 rounding can
        # differ by one ulp after a step; lr 1e-3 keeps that far inside the 1e-5 bound (at
        # lr 1e-2 step 3 differed by 1.3e-5 at W = 3).
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            data = torch.randint(0, 96, (2, 17), generator=g)
            tok, tgt = data[:, :-1], data[:, 1:]
            loss = model.loss(tok, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rloss = ref.loss(tok, tgt)
            rloss.backward()
            ropt.step()
            ropt.zero_grad()
            rel = abs(loss.item() - rloss.item()) / abs(rloss.item())
            assert rel <= 1e-5, (W, step, loss.item(), rloss.item())
        # the gathered base weights are the unsharded NF4 dequantisation, bit for bit
        for b, rb in zip(model.layers, ref.layers):
            b.unshard()
            lins = [m for m in b.modules() if isinstance(m, LoRALinear)]
            rlins = [m for m in rb.modules() if isinstance(m, LoRALinear)]
            for m, rm in zip(lins, rlins):
                assert type(m.weight) is NF4Weight and tuple(m.weight.shape) == tuple(rm.weight.shape)
                assert torch.equal(m.weight.dequantize(torch.float32), rm.weight.dequantize(torch.float32))
                assert torch.equal(m.weight.codes, rm.weight.codes)
            b.reshard()


# -- trainable subclass weights --------------------------------------------------------

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def qdq_rows(w: torch.Tensor) -> torch.Tensor:
    """The float8 round trip with one scale per row (what the test weight's all-gather does)."""
    scale = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


class Fp8RowWeight(torch.Tensor):
    """A trainable test weight like torchao's float8 training weight: an fp32 master tensor
    whose all-gather sends float8 codes and one fp32 scale per row, dequantised after the
    gather. Ops on it (the optimizer's) act on the master tensor."""

    _KEEP = None  # ops whose tensor outputs stay Fp8RowWeight (set below)

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device,
                                                   strides=data.stride())

    def __init__(self, data):
        self._data = data

    def __repr__(self):
        return f"Fp8RowWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8RowWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data if isinstance(t, Fp8RowWeight) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable or func is torch.ops.aten.copy_.default:
            return args[0]
        if func in cls._KEEP:
            return torch.utils._pytree.tree_map(lambda t: Fp8RowWeight(t) if isinstance(t, torch.Tensor) else t, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        scale = self._data.abs().amax(1).clamp_min(1e-12) / FP8_MAX
        codes = (self._data / scale[:, None]).to(torch.float8_e4m3fn)
        return (codes, scale), tuple(outer_size)

    def fsdp_post_all_gather(self, outs, metadata, param_dtype, *, out=None):
        codes, scale = outs
        full = codes.view(metadata).to(param_dtype) * scale[:, None].to(param_dtype)
        if out is not None:
            # the refill for backward: autograd saved views of ``out`` in forward, and the
            # values are the same ones (the master did not change in between)
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full)
            return None
        return full, (full,)


_a = torch.ops.aten
Fp8RowWeight._KEEP = {_a.detach.default, _a.alias.default, _a.split_with_sizes.default, _a.split.Tensor,
                      _a.slice.Tensor, _a.view.default, _a.clone.default, _a._to_copy.default}


class Block(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(b)

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight, self.bias))


class RefBlock(Block):
    def forward(self, x):  # the gathered weight is the per-row float8 round trip; its grad goes to the master
        w = self.weight + (qdq_rows(self.weight) - self.weight).detach()
        return torch.tanh(F.linear(x, w, self.bias))


SHAPES = [(8, 10), (7, 8), (5, 7)]  # 7 and 5 rows: uneven row splits at W = 2 and 3


def _models():
    torch.manual_seed(0)
    ps = [(torch.randn(o, i) / i ** 0.5, torch.randn(o) * 0.1) for o, i in SHAPES]
    ref = nn.Sequential(*[RefBlock(w.clone(), b.clone()) for w, b in ps])
    model = nn.Sequential(*[Block(Fp8RowWeight(w.clone()), b.clone()) for w, b in ps])
    return ref, model


def _rows(model, W, rank):
    from ragged_fsdp.fsdp.core.subclass_unit import SubclassUnit

    out = {}
    for blk in model:
        for u in blk._fsdp_state().group.units:
            if isinstance(u, SubclassUnit):
                for s in u.buf.slots:
                    a, b = s.placement.element_range(s.shape, rank)
                    out[id(blk)] = (a // s.shape[1], b // s.shape[1])
    return out


def case_trainable_subclass(rank, world):
    """AdamW steps, one of them accumulating two backwards (the second under no_sync), against
    the same model in one process. Each rank computes on its share of a batch of 6 and the
    gradients are averaged: the sum of 2 or 3 fp32 partial means differs from the one-process
    mean in the last bits, so losses and weights agree to 1e-5 relative, not bitwise."""
    from torch.distributed.tensor import DTensor

    from ragged_fsdp import fully_shard

    for W, mesh in _meshes(rank)[1:]:
        ref, model = _models()
        if mesh is None:
            continue
        for blk in model:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        r = mesh.get_local_rank()
        for step in range(3):
            micro = 2 if step == 1 else 1
            for m in range(micro):
                x = torch.randn(6, 10, generator=g)
                last = m == micro - 1
                model.set_requires_gradient_sync(last)
                loss = model(x.chunk(W)[r]).square().mean() / micro
                loss.backward()
                rloss = ref(x).square().mean() / micro
                rloss.backward()
            for blk in model:
                gw = blk.weight.grad
                assert isinstance(gw, DTensor) and type(gw.to_local()) is torch.Tensor, (W, type(gw))
                assert type(blk.weight.to_local()) is Fp8RowWeight
            for blk, rblk in zip(model, ref):
                a, b = _rows(model, W, r)[id(blk)]
                want = rblk.weight.grad[a:b]
                got = blk.weight.grad.to_local()
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (W, step, (got - want).abs().max())
            opt.step()
            opt.zero_grad()
            ropt.step()
            ropt.zero_grad()
        # set_gradient_divide_factor(1.0): the sum over ranks, W times the mean
        for blk in model:
            blk.set_gradient_divide_factor(1.0)
        model.set_gradient_divide_factor(1.0)
        x = torch.randn(6, 10, generator=g)
        model(x.chunk(W)[r]).square().mean().backward()
        ref(x).square().mean().backward()
        for blk, rblk in zip(model, ref):
            a, b = _rows(model, W, r)[id(blk)]
            got, want = blk.weight.grad.to_local(), W * rblk.weight.grad[a:b]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (W, "divide", (got - want).abs().max())
        for blk, rblk in zip(model, ref):
            a, b = _rows(model, W, r)[id(blk)]
            got = blk.weight.to_local()._data
            assert type(blk.weight.to_local()) is Fp8RowWeight
            assert torch.allclose(got, rblk.weight.detach()[a:b], rtol=1e-5, atol=1e-6), (W, (got - rblk.weight[a:b]).abs().max())


CASES = [case_subclass_round_trip, case_subclass_errors, case_qlora, case_trainable_subclass]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_case(results, case):
    check_case(results, case, WORLD)


# -- torchao's float8 training weights against torch's FSDP2 (only where torchao is installed) ---

def _float8_model():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return m


def case_torchao_float8(rank, world):
    """4 AdamW steps of torchao's Float8Linear (float8 all-gather, fp32 master weights) under
    ragged_fsdp and under torch's fully_shard: the same casts of the same values, and the
    gradient sums of 2 ranks (a + b is b + a), so losses agree to 1e-5 relative (measured: equal)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    from ragged_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    losses = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("ragged", fully_shard)):
        m = _float8_model()
        for k in (0, 2, 4):
            shard(m[k], mesh=mesh)
        shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses[name] = []
        for _ in range(4):
            x = torch.randn(8 * world, 32, generator=g).chunk(world)[rank]
            loss = m(x).square().mean()
            loss.backward()
            gw = m[0].weight.grad
            assert type(m[0].weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor", name
            assert isinstance(gw, DTensor) and type(gw.to_local()) is torch.Tensor, (name, type(gw))
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses[name].append(t.item() / world)
    for step, (a, b) in enumerate(zip(losses["fsdp2"], losses["ragged"])):
        assert abs(a - b) <= 1e-5 * abs(a), (step, a, b)


def test_torchao_float8_vs_fsdp2():
    pytest.importorskip("torchao")
    check_case(run_cases(2, [case_torchao_float8]), case_torchao_float8, 2)
