"""RaggedShard DTensors on W = 1..4 gloo ranks, always against the same math on full tensors.

Exactness: round trips and redistributes move bytes, so they are compared bitwise.
Optimizer steps are pointwise on each element, so sharded and full runs are bitwise equal
too. Norms sum per-rank partial sums in another order than one device does, so
``clip_grad_norm_`` results are compared to 1e-6 relative.
"""
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import ragged_fsdp as rf
from ragged_fsdp import RaggedShard

from _dist import check_case, run_cases


def _cuts(units, world, seed):
    """Split ``units`` into ``world`` counts, some of them zero, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, units + 1, (world - 1,), generator=g).tolist())
    counts = [b - a for a, b in zip([0] + cuts, cuts + [units])]
    if world > 2:  # make sure some rank holds nothing
        counts[1] += counts[2]
        counts[2] = 0
    return tuple(counts)


# (shape, dims, unit): row / multi-row / flat-block with a partial last block / whole tensor
LAYOUTS = [
    ((37,), (0,), 1),
    ((37,), (0,), 8),
    ((13, 7), (0,), 1),
    ((13, 7), (0,), 4),
    ((13, 7), (0, 1), 16),
    ((13, 7), (), 1),
    ((5, 6, 7), (0, 1), 1),
    ((5, 6, 7), (0, 1), 4),
    ((5, 6, 7), (0, 1, 2), 32),
    ((5, 6, 7), (0,), 2),
]


def _layouts(world):
    out = []
    for i, (shape, dims, unit) in enumerate(LAYOUTS):
        p = RaggedShard(dims, (1,), unit)
        units = p.num_units(shape)
        out.append((shape, RaggedShard(dims, _cuts(units, world, i), unit)))
    return out


def case_round_trip(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for dtype in (torch.float32, torch.bfloat16):
        for i, (shape, p) in enumerate(_layouts(world)):
            full = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)
            t = rf.distribute_tensor(full, mesh, [p])
            assert isinstance(t, rf.RaggedDTensor) and t.shape == full.shape and t.dtype == dtype
            assert tuple(t.to_local().shape) == p.local_shape(shape, rank)
            assert torch.equal(t.full_tensor(), full), (shape, p)
            # from_local wraps without a copy
            u = rf.from_local(t.to_local(), mesh, [p], shape)
            assert u.to_local().data_ptr() == t.to_local().data_ptr()
            assert torch.equal(u.full_tensor(), full)


def case_redistribute(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for i, (shape, p) in enumerate(_layouts(world)):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(100 + i))
        t = rf.distribute_tensor(full, mesh, [p])
        # ragged -> another ragged (other granularity)
        q = RaggedShard(tuple(range(len(shape))), _cuts(full.numel(), world, 7 + i), 1)
        tq = t.redistribute(mesh, [q])
        assert torch.equal(tq.to_local().reshape(-1), full.reshape(-1)[slice(*q.element_range(shape, rank))])
        assert torch.equal(tq.redistribute(mesh, [p]).to_local(), t.to_local())
        # ragged <-> torch placements
        for target in ([Replicate()], [Shard(0)], [Shard(len(shape) - 1)]):
            d = t.redistribute(mesh, target)
            assert type(d) is DTensor and d.placements == tuple(target)
            assert torch.equal(d.full_tensor(), full)
            back = rf.redistribute(d, mesh, [p])
            assert torch.equal(back.to_local(), t.to_local())
        # Partial -> ragged is a reduce-scatter of the ranks' contributions
        part = DTensor.from_local(full * (rank + 1), mesh, [Partial()], run_check=False)
        r = rf.redistribute(part, mesh, [p])
        expect = full * sum(range(1, world + 1))
        assert torch.allclose(r.full_tensor(), expect, rtol=0, atol=1e-5)
        avg = rf.redistribute(DTensor.from_local(full * (rank + 1), mesh, [Partial("avg")]), mesh, [p])
        assert torch.allclose(avg.full_tensor(), expect / world, atol=1e-5)


def case_redistribute_autograd(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    shape, p = _layouts(world)[3]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    t = rf.distribute_tensor(full, mesh, [p]).requires_grad_()
    (t.full_tensor() * 3).sum().backward()
    assert isinstance(t.grad, rf.RaggedDTensor)
    assert torch.equal(t.grad.full_tensor(), torch.full(shape, 3.0))


def _params(world, mesh, dtype=torch.float32):
    ps, refs = [], []
    for i, (shape, p) in enumerate(_layouts(world)):
        g = torch.Generator().manual_seed(200 + i)
        full = torch.randn(shape, generator=g).to(dtype)
        grad = torch.randn(shape, generator=g).to(dtype)
        prm = torch.nn.Parameter(rf.distribute_tensor(full, mesh, [p]))
        prm.grad = rf.distribute_tensor(grad, mesh, [p])
        ref = torch.nn.Parameter(full.clone())
        ref.grad = grad.clone()
        ps.append(prm)
        refs.append(ref)
    return ps, refs


def _bitwise(a, b, msg):
    assert torch.equal(a, b), msg


def _one_ulp(a, b, msg):
    torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-12, msg=str(msg))


OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-2, foreach=False)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, foreach=True)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.01, foreach=False)),
]


def case_optimizers_match_full_tensors(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for cls, kw in OPTIMIZERS:
        ps, refs = _params(world, mesh)
        opt, ref_opt = cls(ps, **kw), cls(refs, **kw)
        for step in range(3):
            opt.step()
            ref_opt.step()
        # foreach and single-tensor kernels are bitwise; torch's fused CPU kernels vectorise
        # with a scalar tail, so an element's rounding (FMA or not) depends on where a
        # tensor piece starts: allow one ulp there.
        same = _bitwise if not kw.get("fused") else _one_ulp
        for p, r in zip(ps, refs):
            assert isinstance(p, rf.RaggedDTensor)
            same(p.full_tensor(), r.detach(), (cls.__name__, kw, tuple(r.shape)))
            for k, v in opt.state[p].items():
                if isinstance(v, rf.RaggedDTensor):
                    same(v.full_tensor(), ref_opt.state[r][k], (cls.__name__, kw, k))


def case_bf16_optimizer(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    ps, refs = _params(world, mesh, torch.bfloat16)
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    ref_opt = torch.optim.AdamW(refs, lr=1e-2, foreach=True)
    for _ in range(2):
        opt.step()
        ref_opt.step()
    for p, r in zip(ps, refs):
        assert p.dtype == torch.bfloat16 and torch.equal(p.full_tensor(), r.detach())


def case_clip_grad_norm(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for norm_type in (2.0, 1.0, float("inf")):
        for foreach in (True, False):
            ps, refs = _params(world, mesh)
            total = torch.nn.utils.clip_grad_norm_(ps, 0.5, norm_type=norm_type, foreach=foreach)
            ref_total = torch.nn.utils.clip_grad_norm_(refs, 0.5, norm_type=norm_type, foreach=foreach)
            total = total.full_tensor() if isinstance(total, DTensor) else total
            torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
            for p, r in zip(ps, refs):
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)


def case_reductions_and_factories(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for i, (shape, p) in enumerate(_layouts(world)):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(300 + i))
        t = rf.distribute_tensor(full, mesh, [p])
        torch.testing.assert_close(t.sum().full_tensor(), full.sum(), rtol=1e-6, atol=1e-5)
        assert torch.equal(t.max().full_tensor(), full.max())
        assert torch.equal(t.min().full_tensor(), full.min())
        assert torch.equal(t.abs().amax().full_tensor(), full.abs().amax())
        torch.testing.assert_close(t.norm().full_tensor(), full.norm(), rtol=1e-6, atol=0)
        torch.testing.assert_close(t.mean().full_tensor(), full.mean(), rtol=1e-5, atol=1e-6)
        for make in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.clone):
            z = make(t)
            assert isinstance(z, rf.RaggedDTensor) and z.to_local().shape == t.to_local().shape
        z = torch.zeros_like(t)
        z.copy_(t)
        assert torch.equal(z.full_tensor(), full)
        z.fill_(2.0)
        assert torch.equal(z.full_tensor(), torch.full(shape, 2.0))
        z.zero_().add_(full.new_tensor(1.5))
        assert torch.equal(z.full_tensor(), torch.full(shape, 1.5))
        z.copy_(full * 2)  # from a full plain tensor, as load_state_dict does
        assert torch.equal(z.full_tensor(), full * 2)
        assert torch.equal(t, rf.distribute_tensor(full, mesh, [p]))
        h = t.to(torch.bfloat16)
        assert h.dtype == torch.bfloat16 and torch.equal(h.full_tensor(), full.to(torch.bfloat16))


def case_random_init_is_world_size_independent(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for i, (shape, p) in enumerate(_layouts(world)):
        t = rf.distribute_tensor(torch.zeros(shape), mesh, [p])
        ref = torch.zeros(shape)
        for init in (
            lambda x: x.normal_(0, 0.02),
            lambda x: x.uniform_(-1, 1),
            lambda x: torch.nn.init.trunc_normal_(x, std=0.02),
            lambda x: torch.nn.init.kaiming_uniform_(x, a=5 ** 0.5) if x.dim() > 1 else x.uniform_(),
        ):
            torch.manual_seed(i)
            init(t)
            torch.manual_seed(i)
            init(ref)
            assert torch.equal(t.full_tensor(), ref), (shape, p)


def case_bad_input(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(8, 3)
    bad = RaggedShard((0,), (8,) + (0,) * world)  # one count too many
    with pytest.raises(ValueError, match="one count per rank"):
        rf.distribute_tensor(full, mesh, [bad])
    with pytest.raises(ValueError, match="cover the tensor exactly"):
        rf.distribute_tensor(full, mesh, [RaggedShard((0,), (7,) + (0,) * (world - 1))])
    p = RaggedShard((0,), (8,) + (0,) * (world - 1))
    q = RaggedShard((0, 1), (0,) * (world - 1) + (24,))
    a = rf.distribute_tensor(full, mesh, [p])
    b = rf.distribute_tensor(full, mesh, [q])
    if world > 1:
        with pytest.raises(ValueError, match="layouts differ"):
            a + b
    with pytest.raises(ValueError, match="shapes differ"):
        a + rf.distribute_tensor(torch.randn(4, 6), mesh, [RaggedShard((0,), (4,) + (0,) * (world - 1))])
    with pytest.raises(ValueError, match="plain tensor"):
        a * torch.randn(8, 3)
    with pytest.raises(NotImplementedError, match=r"full_tensor\(\)"):
        a @ a.t()
    with pytest.raises(ValueError, match="shape= "):
        rf.from_local(torch.randn(3), mesh, [p])
    with pytest.raises(ValueError, match="elements"):
        rf.from_local(torch.randn(100), mesh, [p], (8, 3))
    other = init_device_mesh("cpu", (world,))
    if other != mesh:
        with pytest.raises(ValueError, match="meshes differ"):
            a + rf.distribute_tensor(full, other, [p])


def case_detach_is_a_new_tensor(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    shape, p = _layouts(world)[2]
    prm = torch.nn.Parameter(rf.distribute_tensor(torch.randn(shape), mesh, [p]))
    d = prm.detach()
    assert d is not prm and isinstance(d, rf.RaggedDTensor) and not d.requires_grad
    assert prm.requires_grad  # state_dict() detaches every parameter; it must stay trainable
    assert d.to_local().data_ptr() == prm.to_local().data_ptr()


def case_local_op_results(rank, world):
    """What a local op hands back: ``out=`` gets the out tensor, foreach ops a list whose i-th
    result has the i-th input's layout, out-of-place ops a new tensor; a mismatch is named."""
    mesh = init_device_mesh("cpu", (world,))
    layouts = _layouts(world)
    fulls = [torch.rand(shape, generator=torch.Generator().manual_seed(400 + i)) + 0.5
             for i, (shape, _) in enumerate(layouts)]
    ts = [rf.distribute_tensor(f, mesh, [p]) for f, (_, p) in zip(fulls, layouts)]
    out = torch.zeros_like(ts[0])
    got = torch.sqrt(ts[0], out=out)
    assert got is out and torch.equal(out.full_tensor(), fulls[0].sqrt())
    sums = torch._foreach_add(ts, ts)
    assert all(s.placements == t.placements and torch.equal(s.full_tensor(), 2 * f)
               for s, t, f in zip(sums, ts, fulls))
    r = torch.addcmul(ts[1], ts[1], ts[1], value=0.5)
    assert r is not ts[1] and torch.equal(r.full_tensor(), torch.addcmul(fulls[1], fulls[1], fulls[1], value=0.5))
    ts[2].mul_(torch.tensor(2.0))  # a 0-d plain tensor joins a ragged op
    assert torch.equal(ts[2].full_tensor(), fulls[2] * 2)
    with pytest.raises(ValueError, match="plain tensor of shape"):
        ts[3].add_(torch.ones(ts[3].shape))
    with pytest.raises(ValueError, match="shapes differ"):
        torch._foreach_add_([ts[0], ts[0]], [ts[0], ts[2]])


def case_torch_distribute_tensor_points_to_ours(rank, world):
    """torch's own distribute_tensor cannot lay out a RaggedShard; its error names ours."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = RaggedShard((0,), (1,) * world)
    with pytest.raises(RuntimeError, match=r"ragged_fsdp\.distribute_tensor"):
        torch_distribute_tensor(torch.ones(world, 3), mesh, [p])
    assert f"{p}" == repr(p) == str(p)  # the pointer is for that error only
    t = rf.distribute_tensor(torch.ones(world, 3), mesh, [p])
    assert t.to_local().shape == (1, 3)


CASES = [
    case_detach_is_a_new_tensor, case_local_op_results,
    case_round_trip, case_redistribute, case_redistribute_autograd,
    case_optimizers_match_full_tensors, case_bf16_optimizer, case_clip_grad_norm,
    case_reductions_and_factories, case_random_init_is_world_size_independent, case_bad_input,
    case_torch_distribute_tensor_points_to_ours,
]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def results(request):
    return request.param, run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_placement_dist(results, case):
    world, res = results
    check_case(res, case, world)
