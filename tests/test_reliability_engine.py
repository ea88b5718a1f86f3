"""Faults that would hang or fail deep inside torch, refused on every rank, and
torch's GradScaler on sharded gradients (against torch's FSDP2 and one process).

W=4: ranks whose ``shard_placement_fn`` answers differ, ``from_local(run_check=True)`` with a
wrong piece on one rank. Each case must raise on *every* rank: a rank that raised alone
would leave the others in a collective until the timeout (the harness's barrier after the
case then fails, so a hang shows as a failure, not a pass).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from _dist import check_case, full, global_batch, run_cases

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.fsdp import LayoutMismatchError
from ragged_fsdp.models.llama import Llama, LlamaConfig
from ragged_fsdp.placement import RaggedShard, from_local


def _raises(exc, text, fn):
    with pytest.raises(exc) as info:
        fn()
    assert text in str(info.value), f"{text!r} not in: {info.value}"
    return info.value


def _fsdp_mesh_info(mesh, dim=0):
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    return lambda: ShardPlacementResult(placement=Shard(0), mesh_info=FSDPMeshInfo(mesh, shard_mesh_dim=dim))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


# -- the mesh of every shard_placement_fn answer is checked across ranks -------------------

def case_mesh_answer_depends_on_rank(rank, world):
    """Ranks 0-1 keep the default 4-rank mesh for the weights, ranks 2-3 answer a 2-rank
    slice: before the check, ranks 0-1 returned from fully_shard and 2-3 hung."""
    world_mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    other = _fsdp_mesh_info(grid["b"])

    def fn(p):
        return other() if rank >= 2 and p.dim() == 2 else None

    err = _raises(LayoutMismatchError, "'0.weight'",
                  lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=fn))
    assert "must not depend on the rank" in str(err)


def case_mesh_answer_same_names_other_ranks(rank, world):
    """Same dim names and sizes, but the two meshes group the ranks differently: ranks 0-1
    shard over {0, 1} of one, ranks 2-3 over {0, 2} / {1, 3} of the other."""
    world_mesh = init_device_mesh("cpu", (world,))
    rows = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("x", "y"))
    cols = DeviceMesh("cpu", torch.arange(4).view(2, 2).t().contiguous(), mesh_dim_names=("x", "y"))
    mine = _fsdp_mesh_info((rows if rank < 2 else cols)["y"])

    _raises(LayoutMismatchError, "ranks disagree on the mesh of parameter '0.weight'",
            lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=lambda p: mine()))


def case_mesh_answer_raises_on_one_rank(rank, world):
    world_mesh = init_device_mesh("cpu", (world,))

    def fn(p):
        if rank == 3:
            raise KeyError("no answer on rank 3")
        return None

    if rank == 3:
        _raises(KeyError, "no answer on rank 3", lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=fn))
    else:
        _raises(ValueError, "failed on another rank",
                lambda: fully_shard(_model(), mesh=world_mesh, shard_placement_fn=fn))


def case_mesh_answer_same_slice_everywhere(rank, world):
    """The legitimate case: every rank answers its own slice grid['a'] (a different group on
    each rank, the same mesh): accepted, and the weights live on that slice."""
    world_mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    sub = _fsdp_mesh_info(grid["a"])
    ref = _model()
    m = fully_shard(_model(), mesh=world_mesh, shard_placement_fn=lambda p: sub() if p.dim() == 2 else None)
    assert m[0].weight.device_mesh == grid["a"] and m[0].bias.device_mesh == world_mesh
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)


# -- from_local(run_check=True) raises on every rank -------------------------------------

def case_run_check_wrong_piece_on_one_rank(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    p = RaggedShard((0,), (1, 2, 0, 1))
    rows = p.local_units[rank] + (1 if rank == 1 else 0)  # rank 1 passes one row too many
    local = torch.zeros(rows, 3)
    _raises(ValueError, "rank 1 holds 9 elements",
            lambda: from_local(local, mesh, [p], (4, 3), run_check=True))
    # the right pieces pass the check
    t = from_local(torch.full((p.local_units[rank], 3), float(rank)), mesh, [p], (4, 3), run_check=True)
    assert t.full_tensor()[:, 0].tolist() == [0.0, 1.0, 1.0, 3.0]


def case_run_check_wrong_piece_2d_mesh(rank, world):
    """HSDP-like (Replicate, RaggedShard): rank 3's piece is wrong; its RaggedShard group
    {2, 3} names it, and ranks 0-1 (another group) raise too instead of returning."""
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    p = RaggedShard((0,), (3, 1))
    r = mesh.get_local_rank(1)
    local = torch.zeros(p.local_units[r] - (1 if rank == 3 else 0), 2)
    text = "rank 1 holds 0 elements" if rank >= 2 else "another rank of the mesh"
    _raises(ValueError, text, lambda: from_local(local, mesh, [Replicate(), p], (4, 2), run_check=True))


# -- torch.amp.GradScaler on sharded gradients --------------------------------------------

def _inject_inf(model, rank):
    """Put an inf into one element of this rank's piece of the first gradient it holds any of."""
    for p in model.parameters():
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if local.numel():
            with torch.no_grad():
                local.view(-1)[0] = float("inf")
            return
    raise AssertionError(f"rank {rank} holds no gradient element")


def _scaled_step(model, opt, scaler, t, y, inject=False, rank=0):
    loss = model.loss(t, y)
    scaler.scale(loss).backward()
    if inject:
        _inject_inf(model, rank)
    scaler.unscale_(opt)
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return grads


def case_grad_scaler_fp16_against_fsdp2(rank, world):
    """fp16 compute (MixedPrecisionPolicy), ragged and torch's FSDP2 side by side: an inf in
    rank 1's piece of one gradient skips the step on every rank and halves the scale, for
    both; the next, finite step matches FSDP2's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    cfg = LlamaConfig.tiny()
    runs = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        m = Llama(cfg)
        for block in m.layers:
            shard(block, mesh=mesh, mp_policy=mp)
        shard(m, mesh=mesh, mp_policy=mp)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000)
        before = {n: full(p).detach().clone() for n, p in m.named_parameters()}
        tokens, targets = global_batch(0, 2 * world, 16, cfg.vocab_size)
        t, y = tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]
        _scaled_step(m, opt, scaler, t, y, inject=rank == 1, rank=rank)
        assert scaler.get_scale() == 2.0 ** 11, f"{shard.__module__}: scale {scaler.get_scale()}"
        for n, p in m.named_parameters():
            assert torch.equal(full(p), before[n]), f"{shard.__module__}: {n} changed in a skipped step"
        tokens, targets = global_batch(1, 2 * world, 16, cfg.vocab_size)
        t, y = tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]
        grads = _scaled_step(m, opt, scaler, t, y)
        assert scaler.get_scale() == 2.0 ** 11
        runs.append((grads, {n: full(p).detach() for n, p in m.named_parameters()}, before))
    (g_r, p_r, b_r), (g_t, p_t, b_t) = runs
    for n in g_t:
        assert torch.equal(b_r[n], b_t[n]), n
        scale = g_t[n].abs().max().item()
        err = (g_r[n] - g_t[n]).abs().max().item()
        assert err <= 2e-3 * scale + 1e-6, f"{n}: unscaled grad differs from FSDP2's by {err:.2e} (max {scale:.2e})"
        assert torch.isfinite(g_r[n]).all() and not torch.equal(p_r[n], b_r[n]), f"{n}: the finite step did not move it"
        err = (p_r[n] - p_t[n]).abs().max().item()
        assert err <= 0.5 * (2e-3 * scale + 1e-6), f"{n}: parameter differs from FSDP2's by {err:.2e}"


def case_grad_scaler_against_one_process(rank, world):
    """fp32 parameters with a GradScaler: three SGD steps, the middle one with an inf on one
    rank, against one process given the same global batches (and the inf, which skips its
    step too). Power-of-two scales are exact, so only the reduction order differs."""
    cfg = LlamaConfig.tiny()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Llama(cfg)
    torch.manual_seed(0)
    m = Llama(cfg)
    for block in m.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    pairs = []
    for model in (m, ref):
        pairs.append((torch.optim.SGD(model.parameters(), lr=0.5),
                      torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)))
    (opt, scaler), (ref_opt, ref_scaler) = pairs
    for step in range(3):
        tokens, targets = global_batch(step, 2 * world, 16, cfg.vocab_size)
        t, y = tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]
        _scaled_step(m, opt, scaler, t, y, inject=step == 1 and rank == world - 1, rank=rank)
        _scaled_step(ref, ref_opt, ref_scaler, tokens, targets, inject=step == 1)
        assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(), ref_scaler.get_scale())
        named = dict(ref.named_parameters())
        for n, p in m.named_parameters():
            err = (full(p) - named[n]).abs().max().item()
            assert err <= 1e-5, f"step {step}: {n} differs from one process by {err:.2e}"
    # grew after step 0, halved at the inf, grew again
    assert scaler.get_scale() == 2.0 ** 9, scaler.get_scale()


# -- refusals -----------------------------------------------------------------------------

def case_refuse_bad_shard_dims(rank, world):
    """A Shard(dim) the parameter has no dim for is refused naming it, as FSDP2 does."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    mesh = init_device_mesh("cpu", (world,))
    _raises(ValueError, "'weight' of shape (4, 8), which has no dim 5",
            lambda: fully_shard(nn.Linear(8, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(5)))
    _raises(ValueError, "no dim -3",
            lambda: fully_shard(nn.Linear(8, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(-3)))
    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    _raises(ValueError, "'bias' of shape (4,), which has no dim 1", lambda: fully_shard(
        nn.Linear(8, 4), mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(1), info)))
    # dims the parameters have are accepted (the planner still chooses the layout)
    fully_shard(nn.Linear(8, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(-1))
    fully_shard(nn.Linear(8, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))


def case_refuse_user_ragged_param(rank, world):
    """A RaggedShard DTensor the user made is not 'sharded by an enclosing fully_shard'."""
    from ragged_fsdp.placement import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    lin = nn.Linear(8, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [RaggedShard((0,), (3, 1))]))
    err = _raises(ValueError, "is a RaggedShard DTensor", lambda: fully_shard(lin, mesh=mesh))
    assert "no fully_shard made" in str(err) and "full_tensor()" in str(err) and "enclosing" not in str(err)
    parent = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(parent, mesh=mesh)
    _raises(ValueError, "already sharded by the fully_shard of an enclosing module",
            lambda: fully_shard(parent[0], mesh=mesh))


# -- an optimizer built before fully_shard (it holds the replaced parameters) ----------------

def _optimizers():
    """name -> (optimizer factory, the granularity_fn fully_shard needs for it)."""
    from ragged_fsdp.optim import AdamW, AdamW8bit, Muon, Shampoo, combined_granularity, muon_param_groups

    return {
        "torch.AdamW": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), lambda m: None),
        "torch.SGD": (lambda m: torch.optim.SGD(m.parameters(), lr=1e-1), lambda m: None),
        "AdamW": (lambda m: AdamW(m.parameters(), lr=1e-2), lambda m: None),
        "AdamW8bit": (lambda m: AdamW8bit(m.parameters(), lr=1e-2), lambda m: AdamW8bit.granularity),
        "Muon": (lambda m: Muon(muon_param_groups(m), lr=2e-2), lambda m: combined_granularity(m)),
        "Shampoo": (lambda m: Shampoo(m.parameters(), lr=1e-2, max_preconditioner_dim=32),
                    lambda m: Shampoo.granularity_for(max_preconditioner_dim=32)),
    }


def _llama(world, gran_fn=None, opt_fn=None):
    """A tiny Llama, each block and the root wrapped; ``opt_fn`` (if given) builds the
    optimizer before fully_shard, as a user who fell into the trap did."""
    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny())
    early = opt_fn(m) if opt_fn is not None else None
    gran = gran_fn(m) if gran_fn is not None else None
    mesh = init_device_mesh("cpu", (world,))
    for block in m.layers:
        fully_shard(block, mesh=mesh, granularity_fn=gran)
    fully_shard(m, mesh=mesh, granularity_fn=gran)
    return m, early


def _backward(m, rank):
    tokens, targets = global_batch(0, 4, 8, LlamaConfig.tiny().vocab_size)
    m.loss(tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]).backward()


def case_optimizer_built_before_fully_shard(rank, world):
    """Each optimizer built before fully_shard is refused at its first step, naming a
    parameter and the fix, before it changes anything; TrainState refuses it too. Unrefused,
    10 steps would move no parameter and the first save would fail with KeyError: 0."""
    from ragged_fsdp.checkpoint import TrainState
    from ragged_fsdp.fsdp.core.stale_optimizer import StaleOptimizerError

    for name, (make, gran) in _optimizers().items():
        m, opt = _llama(world, gran, make)
        before = {n: full(p).clone() for n, p in m.named_parameters()}
        _backward(m, rank)
        err = _raises(StaleOptimizerError, "Build the optimizer after fully_shard", opt.step)
        assert type(opt).__name__ in str(err) and "shape (" in str(err), f"{name}: {err}"
        _raises(StaleOptimizerError, "Build the optimizer after fully_shard", lambda: TrainState(m, opt).state_dict())
        assert all(torch.equal(full(p), before[n]) for n, p in m.named_parameters()), name


def case_optimizer_built_after_fully_shard(rank, world):
    """The same optimizers built after fully_shard step without a word and move every
    parameter that got a gradient; a parameter group added later, or a module wrapped
    later, is checked again at the next step."""
    from ragged_fsdp.checkpoint import TrainState
    from ragged_fsdp.fsdp.core.stale_optimizer import StaleOptimizerError

    for name, (make, gran) in _optimizers().items():
        m, _ = _llama(world, gran)
        opt = make(m)
        before = {n: full(p).clone() for n, p in m.named_parameters()}
        for _ in range(2):
            _backward(m, rank)
            opt.step()
            opt.zero_grad()
        TrainState(m, opt).state_dict()
        moved = [n for n, p in m.named_parameters() if not torch.equal(full(p), before[n])]
        assert len(moved) == len(before), f"{name}: only {moved} moved"
    # checked once, then again when a later fully_shard replaced what the optimizer holds
    m, _ = _llama(world)
    extra = nn.Linear(4, 4)
    opt = torch.optim.SGD([*m.parameters(), *extra.parameters()], lr=0.1)
    _backward(m, rank)
    opt.step()
    assert fully_shard(extra, mesh=init_device_mesh("cpu", (world,))) is extra  # it still returns the module
    err = _raises(StaleOptimizerError, "'weight' of the Linear given to fully_shard (shape (4, 4))", opt.step)
    assert "param group 0" in str(err)
    # ... and when a param group holding a replaced parameter is added after the first check
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.step()
    opt.add_param_group({"params": [nn.Linear(2, 2).weight]})
    opt.step()
    old = nn.Linear(3, 3)
    stale = old.weight
    fully_shard(old, mesh=init_device_mesh("cpu", (world,)))
    opt2 = torch.optim.SGD(m.parameters(), lr=0.1)
    opt2.step()
    opt2.add_param_group({"params": [stale]})
    _raises(StaleOptimizerError, "in param group 1", opt2.step)


def case_stale_recheck_compares_parameters(rank, world):
    """Issue 51 finding 13: a replaced parameter swapped into an existing param group (or
    appended to one) after the first check, the number of groups unchanged, is refused at
    the next step."""
    from ragged_fsdp.fsdp.core.stale_optimizer import StaleOptimizerError

    m, _ = _llama(world)
    old = nn.Linear(3, 3)
    stale = old.weight
    fully_shard(old, mesh=init_device_mesh("cpu", (world,)))
    for how in ("swap", "append"):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.step()
        params = opt.param_groups[0]["params"]
        if how == "swap":
            params[0] = stale
        else:
            params.append(stale)
        _raises(StaleOptimizerError, "in param group 0", opt.step)


class _Lora(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lora_a = nn.Linear(n, 2, bias=False)
        self.lora_b = nn.Linear(2, n, bias=False)


def case_adapter_added_after_fully_shard(rank, world):
    """Issue 51 finding 13: a LoRA-style adapter set on a wrapped block after fully_shard is
    refused at the next forward on every rank, naming the parameter and the fix; so is a
    bare parameter registered later. Adapters added before fully_shard train, and stay the
    same on every rank."""
    from ragged_fsdp.fsdp import LateParameterError

    for late in ("module", "parameter"):
        m, _ = _llama(world)
        _backward(m, rank)  # a forward before the adapter came
        if late == "module":
            m.layers[0].attention.lora = _Lora(LlamaConfig.tiny().dim)
            name = "layers.0.attention.lora.lora_a.weight"
        else:
            m.layers[1].register_parameter("scale", nn.Parameter(torch.ones(3)))
            name = "layers.1.scale"
        err = _raises(LateParameterError, "Add the adapters first and then call fully_shard", lambda: _backward(m, rank))
        assert repr(name) in str(err), str(err)
    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny())
    for block in m.layers:
        block.attention.lora = _Lora(LlamaConfig.tiny().dim)
        block.attention.register_forward_hook(lambda mod, i, o: o + mod.lora.lora_b(mod.lora.lora_a(i[0])))
        fully_shard(block, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = full(m.layers[0].attention.lora.lora_a.weight).clone()
    _backward(m, rank)
    opt.step()
    w = full(m.layers[0].attention.lora.lora_a.weight)
    got = [torch.zeros_like(w) for _ in range(world)]
    torch.distributed.all_gather(got, w)
    assert not torch.equal(w, before) and all(torch.equal(g, got[0]) for g in got)


# -- an all-reduce hook that raises on one rank ------------------------------------------------

def _hooked(mesh):
    m = _model()
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _grads(m):
    return {n: full(p.grad).clone() for n, p in m.named_parameters()}


class HookBoom(ValueError):
    pass


def case_all_reduce_hook_raises_on_one_rank(rank, world):
    """A set_all_reduce_hook hook raising on rank 1 only (before, after or without a
    collective of its own over another group): every rank raises at the end of that backward,
    rank 1 its own exception, the others a RuntimeError naming rank 1; with the hook removed
    the next backward's gradients are bitwise those of a model that never saw the fault.
    Unchecked, rank 0 would wait in the next collective until the process-group timeout. FSDP and
    HSDP (replicate 2 x shard 1: the hook runs after the replicate all-reduce)."""
    import torch.distributed as dist

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    side = dist.new_group(backend="gloo")  # the hook's own collective, as a user's would be
    for shape in ((world,), (world, 1)):
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for where in ("no collective", "after its collective"):
            def hook(t, where=where):
                if where == "after its collective":
                    dist.all_reduce(torch.ones(1), group=side)
                if rank == 1:
                    raise HookBoom("boom in the hook")

            m = _hooked(mesh)
            m.set_all_reduce_hook(hook)
            if rank == 1:
                err = _raises(HookBoom, "boom in the hook", lambda: m(x).sum().backward())
                assert any("raised on every rank" in n for n in getattr(err, "__notes__", [])), err
            else:
                _raises(RuntimeError, "hook raised on rank 1", lambda: m(x).sum().backward())
            m.zero_grad()
            m.set_all_reduce_hook(None)
            m(x).sum().backward()
            ref = _hooked(mesh)
            ref(x).sum().backward()
            got, want = _grads(m), _grads(ref)
            assert all(torch.equal(got[n], want[n]) for n in want), (shape, where)
    dist.destroy_process_group(side)


def case_rank_dependent_settings(rank, world):
    """fully_shard arguments and setters that change collectives, with a value that depends on
    the rank: an error on every rank naming the setting and each rank's value (unchecked: a
    gloo size mismatch aborts the process, or a rank waits until the timeout). fully_shard's
    arguments are refused by fully_shard; a setter at the next forward, before its first
    all-gather. With the setter put back, the next step's gradients are bitwise those of a
    model that never saw it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp.fsdp import SettingMismatchError

    mesh = init_device_mesh("cpu", (world,))
    other = {0: torch.float32, 1: torch.bfloat16}
    for kw, says in (({"mp_policy": MixedPrecisionPolicy(param_dtype=other[rank])}, "param_dtype"),
                     ({"mp_policy": MixedPrecisionPolicy(reduce_dtype=other[rank])}, "reduce_dtype"),
                     ({"reshard_after_forward": rank == 0}, "reshard_after_forward")):
        m = _model()
        err = _raises(SettingMismatchError, says, lambda: fully_shard(m[0], mesh=mesh, **kw))
        assert "rank 0:" in str(err) and "rank 1:" in str(err), str(err)
    m = _model()
    ignored = {m[0].bias} if rank == 1 else set()
    err = _raises(SettingMismatchError, "ignored_params", lambda: fully_shard(m[0], mesh=mesh, ignored_params=ignored))
    assert "0:bias (8,)" in str(err), str(err)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for setter, odd, back in (("set_reshard_after_backward", False, True),
                              ("set_requires_gradient_sync", False, True),
                              ("set_reshard_after_forward", False, True)):
        m = _hooked(mesh)
        m(x).sum().backward()
        if rank == 1:
            getattr(m[0], setter)(odd)
        err = _raises(SettingMismatchError, setter, lambda: m(x))
        assert "rank(s) [0]: True; rank(s) [1]: False" in str(err), str(err)
        if rank == 1:
            getattr(m[0], setter)(back)
        m.zero_grad()
        m(x).sum().backward()
        ref = _hooked(mesh)
        ref(x).sum().backward()
        got, want = _grads(m), _grads(ref)
        assert all(torch.equal(got[n], want[n]) for n in want), setter


CASES_2 = [
    case_rank_dependent_settings,
    case_grad_scaler_fp16_against_fsdp2, case_grad_scaler_against_one_process,
    case_refuse_bad_shard_dims, case_refuse_user_ragged_param,
    case_optimizer_built_before_fully_shard, case_optimizer_built_after_fully_shard,
    case_all_reduce_hook_raises_on_one_rank, case_stale_recheck_compares_parameters,
    case_adapter_added_after_fully_shard,
]


@pytest.fixture(scope="module")
def results2():
    return run_cases(2, CASES_2)


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.__name__)
def test_w2(results2, case):
    check_case(results2, case, 2)


CASES_4 = [
    case_mesh_answer_depends_on_rank, case_mesh_answer_same_names_other_ranks,
    case_mesh_answer_raises_on_one_rank, case_mesh_answer_same_slice_everywhere,
    case_run_check_wrong_piece_on_one_rank, case_run_check_wrong_piece_2d_mesh,
]


@pytest.fixture(scope="module")
def results4():
    return run_cases(4, CASES_4)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.__name__)
def test_w4(results4, case):
    check_case(results4, case, 4)


# -- BlockFP8's arguments (no process group) ----------------------------------------------

@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(tile=(True, True)), ValueError, "two positive ints"),
    (dict(tile=(128, False)), ValueError, "two positive ints"),
    (dict(min_numel=True), ValueError, "min_numel=True must be an int"),
    (dict(param_filter="x"), TypeError, "param_filter='x' must be a callable"),
])
def test_blockfp8_refuses(kwargs, exc, text):
    from ragged_fsdp.quant import BlockFP8

    _raises(exc, text, lambda: BlockFP8(**kwargs))


def test_blockfp8_accepts():
    from ragged_fsdp.quant import BlockFP8

    q = BlockFP8(tile=(2, 4), min_numel=0, param_filter=lambda n, p: n.startswith("w"))
    assert q.tile == (2, 4) and q.applies("w", torch.zeros(2, 4)) and not q.applies("v", torch.zeros(2, 4))
