"""ragged_fsdp.optim.AdamW (grouped, chunked steps over flat segments) against torch.

Distributed cases (one launch per W = 1..4): a fully_shard model with odd shapes (ranks that
hold nothing at W = 3, 4), real backward so gradients are views of the reduce-scatter output,
then every gradient overwritten in place with the same full gradient on every rank so the
reference (torch.optim.AdamW(foreach=False) on plain copies) sees identical inputs: parameters
and states must be the same bits after several steps, for default settings, amsgrad, maximize,
no weight decay, several param groups over one buffer, parameters left out, gradients that are
None in some steps, bf16 parameters, tiny chunks (chunk edges inside tensors), and separate
gradient tensors. DCP: states are still flat views after a load, and training continues bitwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import ragged_fsdp as rf
from ragged_fsdp.optim import AdamW
from ragged_fsdp.optim._runs import Member, contiguous_runs

from _dist import check_case, run_cases


class Odd(nn.Module):
    """Odd shapes; two blocks and a root with its own parameters."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 6, bias=False), nn.LayerNorm(6))
            for _ in range(2))
        self.head = nn.Linear(6, 7)

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = h + b(h)
        return self.head(h).float().pow(2).mean()


def _models(world, dtype=torch.float32, per_block=True):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Odd().to(dtype)
    torch.manual_seed(0)
    model = Odd().to(dtype)
    if per_block:
        for b in model.layers:
            rf.fully_shard(b, mesh=mesh)
    rf.fully_shard(model, mesh=mesh)
    return model, ref


def _backward_then_set_grads(model, ref, step, drop=()):
    """Real backward (grads become segment views), then the same full gradient everywhere."""
    x = torch.arange(12).remainder(11).view(2, 6)
    model(x).backward()
    g = torch.Generator().manual_seed(100 + step)
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        full = torch.randn(r.shape, generator=g).to(r.dtype)
        if n in drop:
            p.grad, r.grad = None, None
            continue
        r.grad = full.clone()
        if p.grad is None:  # unused this step: give it a gradient of its own
            p.grad = rf.distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        else:
            a, b = p.ragged_placement.element_range(tuple(p.shape), p.device_mesh.get_local_rank(0))
            p.grad.to_local().copy_(full.reshape(-1)[a:b].view(p.grad.to_local().shape))


def _groups(model, split):
    named = list(model.named_parameters())
    if not split:
        return [p for _, p in named]
    # two groups interleaved over each buffer, and the embedding left out entirely
    a = [p for n, p in named if n.endswith("weight") and not n.startswith("emb")]
    b = [p for n, p in named if n.endswith("bias")]
    return [{"params": a}, {"params": b, "lr": 3e-3, "weight_decay": 0.0}]


def _check_same(model, ref, opt, ref_opt, what):
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        got = p.full_tensor()
        assert torch.equal(got, r.detach()), (what, n, (got.float() - r.float()).abs().max())
        st, rst = opt.state.get(p, {}), ref_opt.state.get(r, {})
        assert set(rst) <= set(st), (what, n, set(st), set(rst))
        for k in rst:
            a = st[k].full_tensor() if isinstance(st[k], rf.RaggedDTensor) else st[k]
            assert a.dtype == rst[k].dtype and torch.equal(a, rst[k]), (what, n, k)


def _train_pair(world, kw, *, split=False, dtype=torch.float32, steps=4, drop=None, chunk=None):
    model, ref = _models(world, dtype)
    extra = {"chunk_size": chunk} if chunk else {}
    opt = AdamW(_groups(model, split), lr=1e-2, **kw, **extra)
    ref_opt = torch.optim.AdamW(_groups(ref, split), lr=1e-2, foreach=False, **kw)
    for step in range(steps):
        _backward_then_set_grads(model, ref, step, drop=(drop(step) if drop else ()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return model, ref, opt, ref_opt


def case_bitwise_settings(rank, world):
    settings = [{}, {"amsgrad": True}, {"maximize": True, "weight_decay": 0.0},
                {"betas": (0.8, 0.9), "eps": 1e-6, "amsgrad": True, "maximize": True}]
    for kw in settings:
        model, ref, opt, ref_opt = _train_pair(world, kw, steps=3)
        _check_same(model, ref, opt, ref_opt, kw)
        st = opt.last_step_stats
        assert st["fallback"] == 0 and st["grouped"] == len(list(model.parameters())), st
        assert st["runs"] <= st["grouped"], st  # odd sizes: alignment padding splits runs


def case_one_run_per_buffer_on_llama(rank, world):
    """Real model shapes (no alignment padding): one run per DBuffer, parameters, gradients
    (the reduce-scatter output) and states adjacent throughout."""
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny())
    for b in m.layers:
        rf.fully_shard(b, mesh=mesh)
    rf.fully_shard(m, mesh=mesh)
    opt = AdamW(m.parameters(), chunk_size=1000)
    t = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    m.loss(t[:, :-1], t[:, 1:]).backward()
    opt.step()
    st = opt.last_step_stats
    assert st["grouped"] == len(list(m.parameters())) and st["fallback"] == 0, st
    segments = {p.to_local().untyped_storage().data_ptr() for p in m.parameters()}  # the DBuffers
    assert st["runs"] <= len(segments), (st, len(segments))


def case_bitwise_groups_left_out_and_none_grads(rank, world):
    drop = lambda step: ("layers.0.0.bias",) if step % 2 else ("head.weight", "layers.1.3.weight")  # noqa: E731
    model, ref, opt, ref_opt = _train_pair(world, {"amsgrad": True}, split=True, steps=5, drop=drop)
    _check_same(model, ref, opt, ref_opt, "groups")
    assert model.emb.weight not in opt.state


def case_bitwise_tiny_chunks_and_bf16(rank, world):
    for dtype, chunk in ((torch.float32, 5), (torch.bfloat16, 64), (torch.bfloat16, 3)):
        model, ref, opt, ref_opt = _train_pair(world, {"weight_decay": 0.1}, dtype=dtype, chunk=chunk, steps=3)
        _check_same(model, ref, opt, ref_opt, (dtype, chunk))
        assert all(v.dtype == dtype for st in opt.state.values() for k, v in st.items() if k != "step")


def case_separate_grads_and_plain_params(rank, world):
    """Gradients that are separate tensors (runs of one) and plain parameters (torch's code)."""
    mesh = init_device_mesh("cpu", (world,))
    g0 = torch.Generator().manual_seed(3)
    shapes = [(13, 7), (37,), (3, 5, 6), (1,)]
    full = [torch.randn(s, generator=g0) for s in shapes]
    cuts = [rf.RaggedShard((0,), _split(s[0], world), 1) for s in shapes]
    ours = [rf.distribute_tensor(x, mesh, [c], src_data_rank=None).requires_grad_() for x, c in zip(full, cuts)]
    plain = torch.randn(4, 3, generator=g0)
    ours.append(plain.clone().requires_grad_())
    ref = [x.clone().requires_grad_() for x in full] + [plain.clone().requires_grad_()]
    opt = AdamW(ours, lr=1e-2, amsgrad=True, chunk_size=8)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True, foreach=False)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for p, r in zip(ours, ref):
            gf = torch.randn(r.shape, generator=g)
            r.grad = gf.clone()
            p.grad = gf.clone() if not isinstance(p, rf.RaggedDTensor) else rf.distribute_tensor(
                gf, mesh, p.placements, src_data_rank=None)
        opt.step()
        ref_opt.step()
    for p, r in zip(ours, ref):
        got = p.full_tensor() if isinstance(p, rf.RaggedDTensor) else p
        assert torch.equal(got, r.detach())
    assert opt.last_step_stats["fallback"] == 1 and opt.last_step_stats["grouped"] == 4


def case_fused_close_to_torch_fused(rank, world):
    model, ref = _models(world)
    opt = AdamW(model.parameters(), lr=1e-2, fused=True, chunk_size=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        _backward_then_set_grads(model, ref, step)
        opt.step()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-6, atol=1e-7)
    assert opt.last_step_stats["fallback"] == 0


def case_dcp_load_keeps_views_and_continues_bitwise(rank, world):
    import torch.distributed.checkpoint as dcp

    from ragged_fsdp.checkpoint import get_state_dict, set_state_dict

    def build(per_block):
        model, _ = _models(world, per_block=per_block)
        return model, AdamW(model.parameters(), lr=1e-2, amsgrad=True)

    def train(model, opt, first, n):
        for step in range(first, first + n):
            x = (torch.arange(12) + step).remainder(11).view(2, 6)
            model(x).backward()
            opt.step()
            opt.zero_grad()

    a, oa = build(True)
    train(a, oa, 0, 2)
    path = _shared_tmpdir(rank)
    msd, osd = get_state_dict(a, oa)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    train(a, oa, 2, 2)
    for per_block in (True, False):  # the same layout, then another one (resharded load)
        b, ob = build(per_block)
        msd_b, osd_b = get_state_dict(b, ob)
        dcp.load({"model": msd_b, "optim": osd_b}, checkpoint_id=path)
        set_state_dict(b, ob, model_state_dict=msd_b, optim_state_dict=osd_b)
        for p in b.parameters():
            for k, view in ob._views[p].items():
                assert ob.state[p][k] is view, k
        # the states of one segment are still one flat buffer
        ptrs = {ob.state[p]["exp_avg"].to_local().untyped_storage().data_ptr()
                for p in b.layers[0].parameters()}
        assert len(ptrs) == 1, ptrs
        train(b, ob, 2, 2)
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            if per_block:
                assert torch.equal(pa.full_tensor(), pb.full_tensor()), n
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
                    x, y = oa.state[pa][k], ob.state[pb][k]
                    assert torch.equal(_full(x), _full(y)), (n, k)
            else:  # another reduction layout: the same up to reduction order
                torch.testing.assert_close(pa.full_tensor(), pb.full_tensor(), rtol=1e-4, atol=1e-5)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def case_load_state_dict_full_tensors(rank, world):
    """A plain (full-tensor) state dict, e.g. from torch.optim.AdamW in one process."""
    model, ref, opt, ref_opt = _train_pair(world, {}, steps=2)
    b, _ = _models(world)
    with torch.no_grad():
        for p, q in zip(b.parameters(), model.parameters()):
            p.copy_(q)
    ob = AdamW(b.parameters(), lr=1e-2)
    ob.load_state_dict(ref_opt.state_dict())
    for p in b.parameters():
        assert ob.state[p]["exp_avg"] is ob._views[p]["exp_avg"]
    for step in range(2, 4):
        _backward_then_set_grads(model, ref, step)
        _backward_then_set_grads(b, ref, step)  # same grads for both
        opt.step()
        ob.step()
    for p, q in zip(model.parameters(), b.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def case_muon_adamw_groups_bitwise(rank, world):
    """Muon's use_muon=False groups take the grouped path: torch.optim.AdamW's bits."""
    from ragged_fsdp.optim import Muon

    model, ref = _models(world)
    opt = Muon([{"params": list(model.parameters()), "use_muon": False, "lr": 1e-2}])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        _backward_then_set_grads(model, ref, step)
        opt.step()
        ref_opt.step()
    _check_same(model, ref, opt, ref_opt, "muon adamw")
    ptrs = {opt.state[p]["exp_avg"].to_local().untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1, "one flat exp_avg buffer for the group"


def case_adamw8bit_grouped_equals_per_parameter(rank, world):
    """AdamW8bit over runs in chunks of whole blocks == its per-parameter step, bit for bit
    (8-bit and fp32-state tensors, chunk edges inside tensors)."""
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from ragged_fsdp.optim import AdamW8bit

    mesh = init_device_mesh("cpu", (world,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Llama(LlamaConfig.tiny())
        fn = AdamW8bit.granularity_for(256, 1024)
        for b in m.layers:
            rf.fully_shard(b, mesh=mesh, granularity_fn=fn)
        rf.fully_shard(m, mesh=mesh, granularity_fn=fn)
        models.append(m)
    a, b = models
    oa = AdamW8bit(a.parameters(), lr=1e-2, min_8bit_size=1024)
    oa.chunk_size = 512
    ob = AdamW8bit(b.parameters(), lr=1e-2, min_8bit_size=1024)
    ob.grouped = False
    t = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        for m in (a, b):
            m.loss(t[:, :-1], t[:, 1:]).backward()
        g = torch.Generator().manual_seed(step)
        for pa, pb in zip(a.parameters(), b.parameters()):
            full = torch.randn(pa.shape, generator=g)
            r0, r1 = pa.ragged_placement.element_range(tuple(pa.shape), pa.device_mesh.get_local_rank(0))
            for p in (pa, pb):
                p.grad.to_local().copy_(full.reshape(-1)[r0:r1].view(p.grad.to_local().shape))
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    assert oa.last_step_stats["fallback"] == 0 and oa.last_step_stats["runs"] < oa.last_step_stats["grouped"]
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.full_tensor(), pb.full_tensor())
        for k, v in oa.state[pa].items():
            assert torch.equal(_full(v), _full(ob.state[pb][k])), k


def _full(t):
    return t.full_tensor() if isinstance(t, rf.RaggedDTensor) else t


def _split(n, world):
    base = [n // world] * world
    base[0] += n - sum(base)
    if world > 2:  # a rank holding nothing
        base[1] += base[2]
        base[2] = 0
    return tuple(base)


def _shared_tmpdir(rank):
    import tempfile

    obj = [tempfile.mkdtemp(prefix="rf_grouped_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


# -- single process ----------------------------------------------------------------------

def _m(i, n, *offs, tag=None, closes=False):
    return Member(i, n, tuple((k, o, o + n) for k, o in enumerate(offs)), tag, closes)


def test_runs_need_adjacency_everywhere():
    ms = [_m(0, 4, 0, 100, 0), _m(1, 3, 4, 104, 4), _m(2, 5, 8, 107, 7),  # gap in the params
          _m(3, 2, 13, 112, 12), _m(4, 0, 15, 114, 14), _m(5, 1, 15, 114, 14, tag="other")]
    runs = contiguous_runs(ms)
    assert [r.indices for r in runs] == [(0, 1), (2, 3), (5,)]
    assert [r.numel for r in runs] == [7, 7, 1]
    ms[0] = _m(0, 4, 0, 100, 0, closes=True)  # e.g. ends inside a quantisation block
    assert [r.indices for r in contiguous_runs(ms)] == [(0,), (1,), (2, 3), (5,)]


def test_plain_parameters_match_torch_exactly():
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [x.detach().clone().requires_grad_() for x in a]
    oa, ob = AdamW(a, lr=0.1, amsgrad=True), torch.optim.AdamW(b, lr=0.1, amsgrad=True, foreach=False)
    for s in range(3):
        for x, y in zip(a, b):
            x.grad = torch.full_like(x, 0.1 * (s + 1))
            y.grad = x.grad.clone()
        oa.step()
        ob.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert oa.state_dict()["state"].keys() == ob.state_dict()["state"].keys()


def test_loose_tensors_take_torchs_path():
    """Tensors that are not one flat range (a transposed view) step through torch's code."""
    from ragged_fsdp.optim._grouped import adamw_grouped

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(4, 6, generator=g), torch.randn(10, generator=g)]
    grads = [torch.randn(4, 6, generator=g).t(), torch.randn(10, generator=g)]
    ours = [base[0].clone().t(), base[1].clone()]
    ref = [base[0].clone().t(), base[1].clone()]
    st = [([torch.zeros_like(x) for x in ours], [torch.zeros_like(x) for x in ours], [torch.tensor(0.0) for _ in ours])
          for _ in range(2)]
    kw = dict(amsgrad=False, beta1=0.9, beta2=0.99, lr=0.1, weight_decay=0.1, eps=1e-8, maximize=False)
    stats = adamw_grouped(ours, grads, st[0][0], st[0][1], [], st[0][2], **kw)
    from torch.optim.adamw import adamw

    adamw(ref, grads, st[1][0], st[1][1], [], st[1][2], foreach=False, **kw)
    assert stats["loose"] == 1 and stats["runs"] == 1
    assert all(torch.equal(x, y) for x, y in zip(ours, ref))
    assert [s.item() for s in st[0][2]] == [1.0, 1.0]


def test_chunk_left_out_follows_the_device():
    """Left out, the chunk is cache-sized on the CPU and launch-bound (2^24) elsewhere; a step
    over one 200,000-element run takes ceil(200000 / 65536) = 4 chunks on the CPU, 1 with
    the accelerator chunk given explicitly, and both give the same bits."""
    from ragged_fsdp.optim._grouped import adamw_grouped, default_chunk

    assert default_chunk(torch.device("cpu")) == 1 << 16
    assert default_chunk(torch.device("cuda", 0)) == 1 << 24
    assert default_chunk("xpu") == 1 << 24
    g = torch.Generator().manual_seed(0)
    init = torch.randn(200_000, generator=g)
    grads = [torch.randn(200_000, generator=g) for _ in range(3)]
    out = {}
    for chunk in (None, 1 << 24):
        p, m, v, step = init.clone(), torch.zeros(200_000), torch.zeros(200_000), torch.tensor(0.0)
        for gr in grads:
            st = adamw_grouped([p], [gr], [m], [v], [], [step], amsgrad=False, beta1=0.9, beta2=0.95,
                               lr=1e-2, weight_decay=0.1, eps=1e-8, maximize=False, chunk=chunk)
        out[chunk] = (p, st["chunks"])
    assert out[None][1] == 4 and out[1 << 24][1] == 1
    assert torch.equal(out[None][0], out[1 << 24][0])
    assert AdamW([torch.zeros(2, requires_grad=True)]).chunk_size is None


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size=0 must be an integer >= 1"):
        AdamW([torch.zeros(2, requires_grad=True)], chunk_size=0)


# -- runner ------------------------------------------------------------------------------

CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def results(request):
    return request.param, run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_grouped(results, case):
    world, res = results
    check_case(res, case, world)
