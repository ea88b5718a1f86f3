"""FSDP2's extension points on ragged_fsdp modules, W = 2, one launch.

* ``register_fsdp_forward_method``: a ``generate`` that calls the submodules directly (never
  ``forward``) under ``torch.no_grad()`` gives exactly the unsharded model's tokens, on FSDP
  and on HSDP ((replicate=2, shard=1)), through ours and through torch's function; without
  the registration FSDP2 raises and so do we, naming the fix.
* ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: counting comms that delegate to
  torch's collectives are called exactly once per DBuffer per collective the trace records,
  with the trace's bytes, and training is bitwise the same as without them.
* ``set_all_reduce_hook``: the hook sees each buffer's flat reduced segment (the mean), once
  per reduction; an identity hook is bitwise neutral, a x2 hook doubles the gradients
  exactly (and matches the one-process gradients x2), on FSDP and HSDP.
* ``set_post_optim_event``: waited on once per buffer by the next forward's all-gathers,
  then discarded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import check_case, run_cases

V, D, BLOCKS = 32, 16, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)

    def generate(self, ids, n: int):
        """Greedy decoding that never calls ``forward`` (as RL rollouts' generate)."""
        for _ in range(n):
            h = self.embed(ids)
            for b in self.blocks:
                h = b(h)
            nxt = self.head(h[:, -1]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids


def _model():
    torch.manual_seed(0)
    return TinyLM()


def _mesh(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "hsdp":
        return init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _wrap(model, mesh, shard=None, **kw):
    shard = shard or __import__("ragged_fsdp").fully_shard
    for b in model.blocks:
        shard(b, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    return model


def _fsdp_modules(model):
    from ragged_fsdp.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


PROMPT = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])


# -- item 1: forward methods ----------------------------------------------------------------

def _check_generate(kind, rank, world):
    import torch.distributed.fsdp as tfsdp

    import ragged_fsdp

    with torch.no_grad():
        want = _model().generate(PROMPT, 5)
    for register in (ragged_fsdp.register_fsdp_forward_method, tfsdp.register_fsdp_forward_method):
        model = _wrap(_model(), _mesh(kind, world))
        register(model, "generate")
        with ragged_fsdp.fsdp.trace() as t, torch.no_grad():
            got = model.generate(PROMPT, 5)
        assert torch.equal(got, want), (register.__module__, got, want)
        # the root's buffer was gathered for generate (its blocks gather on their own forward)
        assert t.of("all_gather", group="<root>") or kind == "hsdp", t.table()


def case_generate_fsdp(rank, world):
    _check_generate("fsdp", rank, world)


def case_generate_hsdp(rank, world):
    _check_generate("hsdp", rank, world)


def case_generate_unregistered(rank, world):
    """Without the registration the root's parameters stay sharded: FSDP2 raises (mixed
    Tensor/DTensor); ours raises too and names register_fsdp_forward_method."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch_model = _wrap(_model(), _mesh("fsdp", world), shard=torch_fully_shard)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"), torch.no_grad():
        torch_model.generate(PROMPT, 1)
    model = _wrap(_model(), _mesh("fsdp", world))
    with pytest.raises(NotImplementedError, match="register_fsdp_forward_method"), torch.no_grad():
        model.generate(PROMPT, 1)


# -- item 4: the comm hooks -------------------------------------------------------------------

def _comm_classes():
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from ragged_fsdp.comm import all_gather_single, reduce_scatter_single

    class CountingAllGather(AllGather):
        def __init__(self, keep: bool = False):
            self.calls = self.bytes = self.allocs = self.in_place = 0
            self.buffers = []  # the DBuffers it serves: is the output their unsharded buffer?
            self.keep = keep  # hand out a persistent buffer it keeps (FSDP2 allows that)
            self.kept: dict = {}

        def allocate(self, size, *, dtype, device):
            self.allocs += 1
            if self.keep:
                key = (tuple(size), dtype)
                if key not in self.kept:
                    self.kept[key] = torch.empty(*size, dtype=dtype, device=device)
                return self.kept[key]
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            self.calls += 1
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            self.in_place += any(output_tensor is b.unsharded for b in self.buffers)
            assert output_tensor.dim() == 1 and input_tensor.numel() * 2 == output_tensor.numel()
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def __init__(self):
            self.calls = self.allocs = 0
            self.ops = set()

        def allocate(self, size, *, dtype, device):
            self.allocs += 1
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.calls += 1
            self.ops.add(op)
            return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return CountingAllGather, CountingReduceScatter


def _train(model, rank, steps=2, setup=None, zero_grad=True):
    """A few SGD steps on this rank's tokens; returns (losses, grads of the last step as
    local tensors, the traces of each step)."""
    import ragged_fsdp

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, traces = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + 10 * step + rank)
        ids = torch.randint(0, V, (2, 8), generator=g)
        if setup is not None:
            setup(model, step)
        with ragged_fsdp.fsdp.trace() as t:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        traces.append(t)
        losses.append(loss.detach())
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        if zero_grad:
            opt.zero_grad()
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params, traces


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def case_custom_all_gather(rank, world):
    CountingAllGather, _ = _comm_classes()
    base = _train(_wrap(_model(), _mesh("fsdp", world)), rank)
    for keep in (False, True):
        comm = CountingAllGather(keep=keep)
        model = _wrap(_model(), _mesh("fsdp", world))
        for m in _fsdp_modules(model):
            m.set_custom_all_gather(comm)
            comm.buffers += m.dbuffers
        counts = []

        def setup(model, step, comm=comm):
            counts.append((comm.calls, comm.bytes))

        losses, grads, params, traces = _train(model, rank, setup=setup)
        counts.append((comm.calls, comm.bytes))
        for step, t in enumerate(traces):  # one call per all-gather the trace records, same bytes
            gathers = t.of("all_gather")
            assert gathers and counts[step + 1][0] - counts[step][0] == len(gathers), t.table()
            assert counts[step + 1][1] - counts[step][1] == sum(e.bytes for e in gathers)
        assert comm.allocs == comm.calls  # every gather asked allocate for its buffer
        # a fresh tensor's memory is moved into the DBuffer (the collective writes the
        # parameters' views); a buffer the comm keeps is gathered into and copied out of
        assert comm.in_place == (0 if keep else comm.calls)
        _same(dict(enumerate(losses)), dict(enumerate(base[0])))
        _same(grads, base[1])
        _same(params, base[2])


def case_custom_reduce_scatter(rank, world):
    import torch.distributed as dist

    _, CountingReduceScatter = _comm_classes()
    base = _train(_wrap(_model(), _mesh("fsdp", world)), rank)
    comm = CountingReduceScatter()
    model = _wrap(_model(), _mesh("fsdp", world))
    for m in _fsdp_modules(model):
        m.set_custom_reduce_scatter(comm)
    losses, grads, params, traces = _train(model, rank)
    assert comm.calls == sum(len(t.of("reduce_scatter")) for t in traces) > 0
    assert comm.ops == {dist.ReduceOp.SUM}
    assert comm.allocs >= comm.calls  # the gradient buffers come from allocate
    # W = 2: a + b is b + a in floating point, so gloo's sum and the engine's agree bitwise
    _same(dict(enumerate(losses)), dict(enumerate(base[0])))
    _same(grads, base[1])
    _same(params, base[2])


def _hooked(kind, world, rank, hook_factory, **train):
    model = _wrap(_model(), _mesh(kind, world))
    seen = []
    for m in _fsdp_modules(model):
        m.set_all_reduce_hook(hook_factory(seen))
    return _train(model, rank, **train), seen, model


def _check_hook(kind, rank, world):
    import torch.distributed as dist

    base = _train(_wrap(_model(), _mesh(kind, world)), rank)

    def identity(seen):
        def hook(t):
            seen.append((t.dim(), t.dtype, t.numel(), t.clone()))
        return hook

    (losses, grads, params, traces), seen, model = _hooked(kind, world, rank, identity)
    coll = "all_reduce" if kind == "hsdp" else "reduce_scatter"
    assert len(seen) == sum(len(t.of(coll)) for t in traces) > 0  # once per buffer per reduction
    segments = sorted(b.segment for m in _fsdp_modules(model) for b in m.dbuffers)
    assert len(seen) == 2 * len(segments)  # two steps, every buffer trainable
    assert all(d == 1 and dt == torch.float32 for d, dt, _, _ in seen)
    assert sorted(n for _, _, n, _ in seen[len(segments):]) == segments  # flat DBuffer segments
    # what it saw in the last step is what the sharded grads hold (padding aside): the
    # reduced mean, after the divide factor
    saw = torch.cat([s for _, _, _, s in seen[len(segments):]])
    held = torch.cat([g.reshape(-1) for g in grads.values()])
    assert torch.equal(torch.sort(saw[saw != 0]).values, torch.sort(held[held != 0]).values)
    _same(dict(enumerate(losses)), dict(enumerate(base[0])))
    _same(grads, base[1])
    _same(params, base[2])

    def double(seen):
        def hook(t):
            seen.append(t.numel())
            t.mul_(2.0)  # exact in binary floating point
        return hook

    (_, grads2, _, _), seen2, _ = _hooked(kind, world, rank, double, steps=1)
    ref1 = _train(_wrap(_model(), _mesh(kind, world)), rank, steps=1)[1]
    for k in grads2:
        assert torch.equal(grads2[k], 2 * ref1[k]), k
    # the same scaling on the one-process gradient of the global batch
    torch.manual_seed(0)
    single = _model()
    ids = [torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    loss = sum(F.cross_entropy(single(i[:, :-1]).flatten(0, 1), i[:, 1:].flatten()) for i in ids) / world
    loss.backward()
    model = _wrap(_model(), _mesh(kind, world))
    for m in _fsdp_modules(model):
        m.set_all_reduce_hook(lambda t: t.mul_(2.0))
    g = torch.Generator().manual_seed(100 + rank)
    mine = torch.randint(0, V, (2, 8), generator=g)
    F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten()).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), single.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), 2 * q.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert dist.get_world_size() == world


def case_all_reduce_hook_fsdp(rank, world):
    _check_hook("fsdp", rank, world)


def case_all_reduce_hook_hsdp(rank, world):
    _check_hook("hsdp", rank, world)


def case_all_reduce_hook_accumulation(rank, world):
    """Gradients accumulated over two backwards (no zero_grad): the hook sees each
    backward's own reduced gradient, the grads are their sum, as without the hook."""
    base = _train(_wrap(_model(), _mesh("fsdp", world)), rank, zero_grad=False)
    fresh = _train(_wrap(_model(), _mesh("fsdp", world)), rank)[1]  # step 2's gradient alone
    (_, grads, params, traces), seen, model = _hooked(
        "fsdp", world, rank, lambda seen: (lambda t: seen.append(t.clone())), zero_grad=False)
    assert len(seen) == sum(len(t.of("reduce_scatter")) for t in traces)
    n = sum(len(m.dbuffers) for m in _fsdp_modules(model))
    saw = torch.cat(seen[n:])
    alone = torch.cat([g.reshape(-1) for g in fresh.values()])
    assert torch.equal(torch.sort(saw[saw != 0]).values, torch.sort(alone[alone != 0]).values)
    for k in grads:  # (g1 + g2) vs g1 + (g2): the order of one addition differs
        torch.testing.assert_close(grads[k], base[1][k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(params[k], base[2][k], rtol=1e-6, atol=1e-7)


def case_all_reduce_hook_mixed_precision(rank, world):
    """bf16 compute, fp32 reduction: the hook sees the fp32 segment; identity is neutral."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = _train(_wrap(_model(), _mesh("fsdp", world), mp_policy=mp), rank, steps=1)
    model = _wrap(_model(), _mesh("fsdp", world), mp_policy=mp)
    dtypes = []
    for m in _fsdp_modules(model):
        m.set_all_reduce_hook(lambda t: dtypes.append(t.dtype))
    _, grads, params, traces = _train(model, rank, steps=1)
    assert dtypes and set(dtypes) == {torch.float32} and len(dtypes) == len(traces[0].of("reduce_scatter"))
    _same(grads, base[1])
    _same(params, base[2])


class _Event:
    """A CPU stand-in for torch.Event: counts how often the engine waits on it."""

    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1

    def wait(self, stream=None):
        raise AssertionError("a CPU mesh never waits a stream on the event")


def case_post_optim_event(rank, world):
    base = _train(_wrap(_model(), _mesh("fsdp", world)), rank, steps=3)
    events = []

    def setup(model, step):
        if step == 1:  # after the first optimizer step only
            ev = _Event()
            model.set_post_optim_event(ev)
            events.append(ev)

    model = _wrap(_model(), _mesh("fsdp", world))
    losses, grads, params, traces = _train(model, rank, steps=3, setup=setup)
    buffers = sum(len(m.dbuffers) for m in _fsdp_modules(model))
    # each buffer's gather in step 2's forward waited on it once; step 3's did not again
    assert events[0].synced == buffers
    assert len([e for e in traces[1].of("all_gather") if not e.backward]) == buffers
    _same(grads, base[1])
    _same(params, base[2])


def case_bad_input(rank, world):
    CountingAllGather, CountingReduceScatter = _comm_classes()
    model = _wrap(_model(), _mesh("fsdp", world))

    class NoAllocate:
        def __call__(self, *a, **k):
            return None

    with pytest.raises(TypeError, match="set_custom_all_gather: comm .* allocate"):
        model.set_custom_all_gather(NoAllocate())
    with pytest.raises(TypeError, match="set_custom_reduce_scatter: comm .* allocate"):
        model.set_custom_reduce_scatter(lambda *a, **k: None)
    with pytest.raises(TypeError, match="set_all_reduce_hook: hook must be callable"):
        model.set_all_reduce_hook(3)
    with pytest.raises(TypeError, match="set_all_reduce_hook: stream must be"):
        model.set_all_reduce_hook(lambda t: None, stream="side")
    with pytest.raises(TypeError, match="set_post_optim_event: event must be"):
        model.set_post_optim_event(object())
    hsdp = _wrap(_model(), _mesh("hsdp", world))
    with pytest.raises(ValueError, match="stream cannot be set when using HSDP"):
        hsdp.set_all_reduce_hook(lambda t: None, stream=torch.Stream(device="cpu"))

    class WrongSize(CountingAllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size[0] + 1, dtype=dtype, device=device)

    model.set_custom_all_gather(WrongSize())
    with pytest.raises(ValueError, match=r"set_custom_all_gather: WrongSize.allocate\(.*must return"):
        model(PROMPT)
    model.set_custom_all_gather(None)  # back to the engine's own
    model(PROMPT).sum().backward()  # the failed forward left nothing behind (no reshard() needed)

    class NotAWork(CountingAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            super().__call__(output_tensor, input_tensor, group, async_op=False)
            return "done"  # not a Work: the engine's wait for it would fail later

    model.set_custom_all_gather(NotAWork())
    with pytest.raises(TypeError, match=r"set_custom_all_gather: the comm returned str for async_op=True"):
        model(PROMPT)
    model.set_custom_all_gather(None)
    model(PROMPT).sum().backward()  # before: the module stayed broken (every forward failed)

    def shrink(t):
        t.resize_(t.numel() // 2)

    model.set_all_reduce_hook(shrink)
    with pytest.raises(RuntimeError, match=r"set_all_reduce_hook: the hook changed the reduced gradient segment"):
        model(PROMPT).sum().backward()
    model.set_all_reduce_hook(None)
    model(PROMPT).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


CASES = [
    case_generate_fsdp,
    case_generate_hsdp,
    case_generate_unregistered,
    case_custom_all_gather,
    case_custom_reduce_scatter,
    case_all_reduce_hook_fsdp,
    case_all_reduce_hook_hsdp,
    case_all_reduce_hook_accumulation,
    case_all_reduce_hook_mixed_precision,
    case_post_optim_event,
    case_bad_input,
]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_extension(results, case):
    check_case(results, case)
