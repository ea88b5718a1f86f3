"""fully_shard's API contract: what parameters and grads are, module methods, moving and
loading, and clear errors for bad input (W = 2, one launch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from _dist import check_case, compare_training, cpu_mesh, full, global_batch, run_cases

from ragged_fsdp.fsdp import FSDPModule, fully_shard
from ragged_fsdp.models.llama import Llama, LlamaConfig
from ragged_fsdp.placement import RaggedDTensor, RaggedShard


def _wrapped(mesh, cfg=None, **kw):
    torch.manual_seed(0)
    model = Llama(cfg or LlamaConfig.tiny())
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _wrap_blocks(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _in_buffer(p, model_or_block) -> bool:
    """Whether ``p``'s local tensor lies inside one of the group's sharded segments."""
    local = p.to_local()
    for buf in model_or_block.dbuffers:
        seg = buf.sharded
        lo = seg.data_ptr()
        hi = lo + seg.numel() * seg.element_size()
        if local.numel() == 0 or lo <= local.data_ptr() < hi:
            if local.untyped_storage().data_ptr() == seg.untyped_storage().data_ptr() or local.numel() == 0:
                return True
    return False


def _owner(model, name):
    """The FSDP module whose group holds parameter ``name``."""
    parts = name.split(".")
    if parts[0] == "layers":
        return model.layers[int(parts[1])]
    return model


def _step(model, rank, world, step=0):
    tokens, targets = global_batch(step, 2 * world, 8, model.cfg.vocab_size)
    loss = model.loss(tokens[rank * 2:rank * 2 + 2], targets[rank * 2:rank * 2 + 2])
    loss.backward()
    return loss


# -- what fully_shard returns ------------------------------------------------------------------
def case_params_are_ragged_views_before_forward(rank, world):
    model = _wrapped(cpu_mesh(world))
    assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
    assert isinstance(model, Llama)
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor) and isinstance(p, RaggedDTensor), name
        assert isinstance(p.placements[0], RaggedShard)
        assert _in_buffer(p, _owner(model, name)), name
    # optimizer and state_dict before the first forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sd = model.state_dict()
    assert all(isinstance(v, RaggedDTensor) for k, v in sd.items() if not k.startswith("rope")), list(sd)
    assert set(sd) == set(dict(Llama(LlamaConfig.tiny()).state_dict()))
    _step(model, rank, world)
    for name, p in model.named_parameters():
        assert isinstance(p.grad, RaggedDTensor), name
        assert p.grad.placements == p.placements
    opt.step()
    for name, p in model.named_parameters():  # the optimizer updated the buffer in place
        assert _in_buffer(p, _owner(model, name)), name


def case_one_collective_buffer_per_dtype(rank, world):
    model = _wrapped(cpu_mesh(world))
    assert len(model.layers[0].dbuffers) == 1
    buf = model.layers[0].dbuffers[0]
    assert buf.sharded.numel() == buf.layout.segment
    assert buf.layout.total == world * buf.layout.segment
    assert not buf.unsharded_allocated or buf.aliased  # freed between steps


def case_unshard_reshard(rank, world):
    model = _wrapped(cpu_mesh(world))
    block = model.layers[0]
    block.unshard()
    w = block.attention.wq.weight
    assert not isinstance(w, DTensor) and tuple(w.shape) == (48, 48)
    block.reshard()
    assert isinstance(block.attention.wq.weight, RaggedDTensor)
    handle = block.unshard(async_op=True)
    handle.wait()
    full_w = block.attention.wq.weight.detach().clone()
    block.reshard()
    torch.testing.assert_close(full(block.attention.wq.weight), full_w)
    torch.manual_seed(0)
    torch.testing.assert_close(full_w, Llama(LlamaConfig.tiny()).layers[0].attention.wq.weight.detach())


def case_manual_grad_is_honoured(rank, world):
    model = _wrapped(cpu_mesh(world))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(full(p), before[n] - 0.5)
    # an existing (hand-made) grad accumulates with the next backward's grad, as in torch
    opt.zero_grad()
    _step(model, rank, world)
    reduced = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    _step(model, rank, world)
    for n, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), reduced[n] + 1.0, rtol=1e-5, atol=1e-6)


def case_to_and_to_empty_keep_views(rank, world):
    model = _wrapped(cpu_mesh(world))
    ids = {n: id(p) for n, p in model.named_parameters()}
    vals = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    model.to("cpu")
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and _in_buffer(p, _owner(model, n)), n
        torch.testing.assert_close(full(p), vals[n])
    sd = {k: v.detach().clone() if isinstance(v, RaggedDTensor) else v for k, v in model.state_dict().items()}
    model.to_empty(device="cpu")
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and _in_buffer(p, _owner(model, n)), n
    model.load_state_dict(sd)
    for n, p in model.named_parameters():
        torch.testing.assert_close(full(p), vals[n])
    _step(model, rank, world)


def case_load_state_dict_assign(rank, world):
    model = _wrapped(cpu_mesh(world))
    torch.manual_seed(3)
    other = _wrapped(cpu_mesh(world), LlamaConfig.tiny())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    want = {n: full(p).detach().clone() for n, p in other.named_parameters()}
    model.load_state_dict(other.state_dict(), assign=True)
    for n, p in model.named_parameters():
        assert isinstance(p, RaggedDTensor) and _in_buffer(p, _owner(model, n)), n
        torch.testing.assert_close(full(p), want[n])
    # full (plain) tensors load too, with and without assign
    plain = {k: (full(v).detach().clone() - 1.0 if isinstance(v, DTensor) else v) for k, v in other.state_dict().items()}
    model.load_state_dict(plain, assign=True)
    for n, p in model.named_parameters():
        assert isinstance(p, RaggedDTensor) and _in_buffer(p, _owner(model, n)), n
        torch.testing.assert_close(full(p), want[n] - 1.0)
    model.load_state_dict({k: v + 2.0 if v.is_floating_point() and not k.startswith("rope") else v for k, v in plain.items()})
    for n, p in model.named_parameters():
        torch.testing.assert_close(full(p), want[n] + 1.0)
    _step(model, rank, world)
    assert all(isinstance(p.grad, RaggedDTensor) for p in model.parameters())


def case_explicit_prefetch(rank, world):
    def wrap(model, mesh):
        blocks = list(model.layers)
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for i, b in enumerate(blocks):
            if i + 1 < len(blocks):
                b.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                b.set_modules_to_backward_prefetch([blocks[i - 1]])
        return model

    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny(n_layers=3)), wrap, steps=3)


def case_implicit_prefetch(rank, world):
    """From the second step on, a block's forward starts the next block's all-gather, and a
    block's backward starts the previous block's."""
    from ragged_fsdp.fsdp import trace

    model = _wrapped(cpu_mesh(world), LlamaConfig.tiny(n_layers=3))
    seen = {}

    def gathered(tr, i, backward):
        return any(e.group == f"layers.{i}" and e.backward == backward for e in tr.of("all_gather"))

    for step in range(2):
        seen.clear()
        with trace() as tr:
            h0 = model.layers[0].register_forward_hook(lambda *a: seen.__setitem__("fwd", gathered(tr, 1, False)))
            h2 = model.layers[2].register_full_backward_hook(lambda *a: seen.__setitem__("bwd", gathered(tr, 1, True)))
            _step(model, rank, world, step)
            h0.remove()
            h2.remove()
    assert seen == {"fwd": True, "bwd": True}, seen


def case_no_sync_keep_unsharded(rank, world):
    """Accumulation without sync and without resharding after backward (torch's recipe)."""
    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny()), _wrap_blocks, micro=3, steps=2,
                     keep_unsharded_between_micro=True)


def case_ignored_params(rank, world):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    keep = model.norm.weight
    fully_shard(model, mesh=cpu_mesh(world), ignored_params={keep})
    assert model.norm.weight is keep and not isinstance(keep, DTensor)
    assert isinstance(model.output.weight, RaggedDTensor)
    _step(model, rank, world)
    assert keep.grad is not None and not isinstance(keep.grad, DTensor)


def case_set_is_last_backward_and_flags(rank, world):
    model = _wrapped(cpu_mesh(world))
    model.set_is_last_backward(True)
    model.set_reshard_after_forward(True)
    model.set_unshard_in_backward(True)
    model.set_requires_gradient_sync(True)
    _step(model, rank, world)


def _manual_step(model, rank, world, *, manual=True, async_op=False, finish=True):
    """Three micro-batches of two sequences per rank with gradient sync off, then (manual)
    finalize_backward, or (the usual recipe) sync back on for the last one."""
    tokens, targets = global_batch(0, 6 * world, 8, model.cfg.vocab_size)
    if manual:
        model.set_manual_backward_finalization(True)
    for m in range(3):
        model.set_requires_gradient_sync(not manual and m == 2)
        rows = slice((m * world + rank) * 2, (m * world + rank) * 2 + 2)
        (model.loss(tokens[rows], targets[rows]) / 3).backward()
    if not manual:
        return None
    model.set_requires_gradient_sync(True)
    handle = model.finalize_backward(async_op=async_op)
    if finish and handle is not None:
        handle.wait()
    return handle


def _grads(model):
    return {n: full(p.grad) for n, p in model.named_parameters()}


def case_manual_backward_finalization(rank, world):
    """torch 2.15's manual finalization (its pipeline schedules end their steps with it):
    what three micro-batches accumulated with sync off is reduced by finalize_backward. Checked
    against one process on the whole batch (fp32 summed in another order: within 1e-6) and
    bitwise against the usual recipe (sync back on for the last micro-batch: the same sums in
    the same order), with and without async_op."""
    torch.manual_seed(0)
    ref = Llama(LlamaConfig.tiny())
    tokens, targets = global_batch(0, 6 * world, 8, ref.cfg.vocab_size)
    ref.loss(tokens, targets).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}

    usual = _wrapped(cpu_mesh(world))
    _manual_step(usual, rank, world, manual=False)
    usual_grads = _grads(usual)
    for async_op in (False, True):
        model = _wrapped(cpu_mesh(world))
        _manual_step(model, rank, world, async_op=async_op)
        got = _grads(model)
        for n, g in got.items():
            torch.testing.assert_close(g, expected[n], rtol=0, atol=1e-6, msg=n)
            assert torch.equal(g, usual_grads[n]), n


def case_manual_finalization_cut_short(rank, world):
    """A step whose async finalization is reset before its wait() hands out nothing, and the
    next step starts clean: its gradients are those of a fresh model's first step, bitwise."""
    fresh = _wrapped(cpu_mesh(world))
    _manual_step(fresh, rank, world)
    want = _grads(fresh)

    model = _wrapped(cpu_mesh(world))
    handle = _manual_step(model, rank, world, async_op=True, finish=False)
    _raises(RuntimeError, "not waited on", lambda: _step(model, rank, world))
    model.reset_iter_state()
    _raises(RuntimeError, "was reset", handle.wait)
    assert all(p.grad is None for p in model.parameters())
    _manual_step(model, rank, world)
    got = _grads(model)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def case_manual_finalization_errors(rank, world):
    model = _wrapped(cpu_mesh(world))
    assert model.finalize_backward() is None  # before the first forward: nothing to do (as in torch)
    model.finalize_backward(async_op=True).wait()
    _raises(TypeError, "expected a bool", lambda: model.set_manual_backward_finalization(1))
    _raises(TypeError, "async_op", lambda: model.finalize_backward(async_op="yes"))
    _step(model, rank, world)
    _raises(RuntimeError, r"set_manual_backward_finalization\(True\)", model.finalize_backward)
    _raises(RuntimeError, "not the root", lambda: model.layers[0].set_manual_backward_finalization(True))
    _raises(RuntimeError, "not the root", lambda: model.layers[0].finalize_backward())
    _raises(NotImplementedError, "set_keep_unsharded_storage", lambda: model.set_keep_unsharded_storage(True))
    # the mode set on one rank only: every rank raises at the next forward, naming it (no hang)
    model.set_manual_backward_finalization(rank == 0)
    from ragged_fsdp.fsdp import SettingMismatchError

    _raises(SettingMismatchError, r"set_manual_backward_finalization \(the root\).*rank\(s\) \[0\]: True",
            lambda: _step(model, rank, world))
    model.set_manual_backward_finalization(True)
    _manual_step(model, rank, world)
    from torch.distributed.fsdp import share_comm_ctx

    _raises(NotImplementedError, "share_comm_ctx", lambda: share_comm_ctx([model, _wrapped(cpu_mesh(world))]))


# -- bad input ---------------------------------------------------------------------------------
def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def case_errors(rank, world):
    mesh = cpu_mesh(world)
    lin = nn.Linear(4, 4)
    fully_shard(lin, mesh=mesh)
    _raises(ValueError, "already wrapped", lambda: fully_shard(lin, mesh=mesh))

    parent = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(parent, mesh=mesh)
    _raises(ValueError, "bottom-up", lambda: fully_shard(parent[0], mesh=mesh))

    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    _raises(ValueError, "mixed devices", lambda: fully_shard(mixed, mesh=mesh))

    _raises(TypeError, "shard_placement_fn", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: "x"))
    _raises(ValueError, "mesh", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=object()))
    _raises(ValueError, "granularity", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, granularity_fn=lambda n, p: "bogus"))

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))

    _raises(ValueError, "0-d", lambda: fully_shard(Scalar(), mesh=mesh, granularity_fn=lambda n, p: "rows:2"))

    tied_a, tied_b = nn.Linear(4, 4), nn.Linear(4, 4)
    tied_b.weight = tied_a.weight
    holder = nn.Sequential(tied_a, tied_b)
    fully_shard(tied_b, mesh=mesh)
    _raises(ValueError, "shared", lambda: fully_shard(holder, mesh=mesh))

    _raises(ValueError, "reshard_after_forward", lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3 if world == 2 else 5))

    if world == 2:  # a mesh of rank 0 only: rank 1 is not in it
        from torch.distributed.device_mesh import DeviceMesh

        sub = DeviceMesh("cpu", [0])
        if rank == 1:
            _raises(ValueError, "not in the mesh", lambda: fully_shard(nn.Linear(4, 4), mesh=sub))
        two_d = DeviceMesh("cpu", [[0, 1]])
        _raises(ValueError, "mesh_dim_names", lambda: fully_shard(nn.Linear(4, 4), mesh=two_d))
        three_d = DeviceMesh("cpu", [[[0, 1]]], mesh_dim_names=("a", "b", "c"))
        _raises(ValueError, "dp_mesh_dims", lambda: fully_shard(nn.Linear(4, 4), mesh=three_d))

    meta = nn.Linear(4, 4, device="meta")
    fully_shard(meta, mesh=mesh)
    _raises(RuntimeError, "meta", lambda: meta(torch.ones(2, 4)))


CASES = [
    case_params_are_ragged_views_before_forward,
    case_one_collective_buffer_per_dtype,
    case_unshard_reshard,
    case_manual_grad_is_honoured,
    case_to_and_to_empty_keep_views,
    case_load_state_dict_assign,
    case_explicit_prefetch,
    case_implicit_prefetch,
    case_no_sync_keep_unsharded,
    case_ignored_params,
    case_set_is_last_backward_and_flags,
    case_manual_backward_finalization,
    case_manual_finalization_cut_short,
    case_manual_finalization_errors,
    case_errors,
]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_api(results, case):
    check_case(results, case)
