"""``ragged_fsdp.global_order``: a training step whose result is the same bits at every
data-parallel world size.

One launch per W (1, 3, 4; the W=4 launch also runs HSDP 2x2): a tiny Llama with tied
embeddings and odd shapes, V = 12 micro-batches per step, 5 steps with
``deterministic.clip_grad_norm_``, for torch AdamW (foreach and single-tensor), AdamW8bit,
Muon (Shampoo: 2 steps). Every launch writes the full parameters, optimizer states, norms and logged losses;
the last test compares them bitwise across W and against a single-process reference written
with plain torch (autograd's own accumulation of the V backward passes, ``math.fsum`` for
the norm): bitwise because the mode adds the micro-batches in autograd's order, one fp32
add each, and the norm's exact sum rounds once. The W=4 launch saves a checkpoint after
step 2; the others load it and continue: bitwise W=4's continuation.

The step's state between micro-steps (issue 51), in every launch: a partial step (a break,
a micro-step that raised and was skipped, a partial step followed by a full one) is refused
at the optimizer step and the next forward until ``abort_step``, after which the run equals
a straight one bitwise; a checkpoint between micro-steps is refused and the step goes on
unharmed; a separately wrapped head run in every other micro-step equals a single-process
run bitwise; ``total_norm`` counts an ``ignored_params`` gradient once (against ``math.fsum``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from _dist import check_case, run_cases

ENV = "RAGGED_GLOBAL_ORDER_DIR"
V, STEPS, SAVE_AT, MB, SEQ, MAX_NORM = 12, 5, 2, 2, 8, 0.5
OPTS = ("adamw", "adamw_single", "adamw8bit", "muon", "shampoo")
STEPS_OF = {"shampoo": 2}  # its eigendecompositions are most of this file's CPU time: 2 preconditioned steps


def _cfg():
    from ragged_fsdp.models.llama import LlamaConfig

    # odd shapes: vocab 97, ffn 75; tied embeddings (one parameter used twice)
    return LlamaConfig(vocab_size=97, dim=40, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=75, max_seq_len=SEQ,
                       tie_embeddings=True)


def _micro_batch(step: int, j: int):
    g = torch.Generator().manual_seed(1000 * step + j)
    data = torch.randint(0, 97, (MB, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _granularity(name, model):
    from ragged_fsdp.optim import AdamW8bit, Shampoo, combined_granularity

    if name == "shampoo":
        return Shampoo.granularity_for(max_preconditioner_dim=32)
    if name == "adamw8bit":
        return AdamW8bit.granularity_for(block_size=64, min_8bit_size=256)
    if name == "muon":
        return combined_granularity(model)
    return None


def _optimizer(name, model):
    from ragged_fsdp.optim import AdamW8bit, Muon, Shampoo, muon_param_groups

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    if name == "adamw_single":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if name == "adamw8bit":
        return AdamW8bit(model.parameters(), lr=1e-2, block_size=64, min_8bit_size=256)
    if name == "shampoo":
        return Shampoo(model.parameters(), lr=1e-2, max_preconditioner_dim=32)
    return Muon(muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 1e-2}))


def _build(name, mesh):
    from ragged_fsdp import fully_shard, global_order
    from ragged_fsdp.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(_cfg())
    gran = _granularity(name, model)
    kw = {} if gran is None else {"granularity_fn": gran}
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    global_order(model, micro_batches=V)
    return model, _optimizer(name, model)


def _train(model, opt, steps):
    from ragged_fsdp.fsdp import deterministic as det

    out = []
    for step in steps:
        losses = []
        for j in det.micro_batches(model):
            loss = model.loss(*_micro_batch(step, j))
            loss.backward()
            losses.append(loss.detach())
        norm = det.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        out.append((norm.item(), det.mean_loss(model, losses).item()))
    return out


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model, opt, log):
    params = {k: _full(p.detach()).clone() for k, p in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    states = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                states[f"{names[id(p)]}.{k}"] = _full(v).clone()
    return {"params": params, "states": states, "log": log}


def _save(tag, snap):
    if dist.get_rank() == 0:
        torch.save(snap, os.path.join(os.environ[ENV], f"{tag}.pt"))


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def case_train(rank, world):
    """Every optimizer, 5 steps at this W."""
    for name in OPTS:
        model, opt = _build(name, _mesh(world))
        _save(f"{name}_w{world}", _snapshot(model, opt, _train(model, opt, range(STEPS_OF.get(name, STEPS)))))


def case_hsdp(rank, world):
    """HSDP 2x2 (replicate x shard), AdamW: compared with 1-D W=4 and W=1."""
    from torch.distributed.device_mesh import init_device_mesh

    if world != 4:
        return
    model, opt = _build("adamw", init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    _save("hsdp_2x2", _snapshot(model, opt, _train(model, opt, range(STEPS))))


def case_checkpoint(rank, world):
    """W=4 saves after step SAVE_AT and continues; other W load that save and continue."""
    import ragged_fsdp.checkpoint as ck

    root = os.path.join(os.environ[ENV], "ckpt")
    model, opt = _build("adamw", _mesh(world))
    state = {"train": ck.TrainState(model, opt), "step": 0}
    if world == 4:
        _train(model, opt, range(SAVE_AT))
        state["step"] = SAVE_AT
        ck.save(state, root, step=SAVE_AT)
    else:
        ck.load_latest(root, state)
        assert state["step"] == SAVE_AT
    log = _train(model, opt, range(state["step"], STEPS))
    _save(f"replay_w{world}", _snapshot(model, opt, log))


def case_refusals(rank, world):
    """What the mode cannot order raises, naming the fix."""
    from ragged_fsdp import GradientReduce, fully_shard, global_order
    from ragged_fsdp.models.llama import Llama

    def fresh(**kw):
        torch.manual_seed(0)
        m = Llama(_cfg())
        fully_shard(m, mesh=_mesh(world), **kw)
        return m

    if world > 1:
        with pytest.raises(ValueError, match="does not divide"):
            global_order(fresh(), micro_batches=world * 3 + 1)
    m = fresh()
    global_order(m, micro_batches=V)
    with pytest.raises(ValueError, match="set_requires_gradient_sync"):
        m.set_requires_gradient_sync(False)
    m.set_all_reduce_hook(lambda g: None)
    with pytest.raises(ValueError, match="set_all_reduce_hook"):
        m.loss(*_micro_batch(0, 0)).backward()
    m = fresh()
    m.set_requires_gradient_sync(False)
    with pytest.raises(ValueError, match="gradient sync turned off"):
        global_order(m, micro_batches=V)
    with pytest.raises(ValueError, match="gradient_reduce"):
        global_order(fresh(gradient_reduce=GradientReduce(torch.bfloat16)), micro_batches=V)
    if world > 1:
        with pytest.raises(ValueError, match="different micro_batches"):
            global_order(fresh(), micro_batches=V if rank == 0 else 2 * V)


def case_refuses_expert_parallel(rank, world):
    """EP token routing (experts sharded over an ep mesh dim): refused by name."""
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard, global_order
    from ragged_fsdp.models.expert_parallel import apply_expert_parallel
    from ragged_fsdp.models.moe import MoE, MoEConfig

    if world != 4:
        return
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny(fused_experts=True, n_experts=8))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dp_ep = mesh["dp", "ep"]._flatten("dp_ep")
    apply_expert_parallel(model, mesh["ep"])
    for block in model.layers:
        fully_shard(block.feed_forward.experts, mesh=mesh["dp"])
        fully_shard(block, mesh=dp_ep)
    fully_shard(model, mesh=dp_ep)
    with pytest.raises(ValueError, match="TP/EP layout"):
        global_order(model, micro_batches=V)


# -- the step's state between micro-steps (issue 51: findings 1-5) -------------------------

class Boom(torch.autograd.Function):
    """Identity whose backward raises while ``armed[0]`` (after the blocks above it reduced)."""

    armed = [False]

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed[0]:
            raise RuntimeError("simulated fault in backward")
        return g


def _small(world, boom=False):
    """The tiny Llama (SGD, global order V): with ``boom``, block 0's output goes through
    :class:`Boom` (a fault in backward after block 1 and the head folded their pieces)."""
    from ragged_fsdp import fully_shard, global_order
    from ragged_fsdp.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(_cfg())
    if boom:
        model.layers[0].register_forward_hook(lambda m, i, o: Boom.apply(o))
    for block in model.layers:
        fully_shard(block, mesh=_mesh(world))
    fully_shard(model, mesh=_mesh(world))
    global_order(model, micro_batches=V)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _micro(model, step, j):
    model.loss(*_micro_batch(step, j)).backward()


def _full_params(model):
    return {k: _full(p.detach()).clone() for k, p in model.named_parameters()}


def _expect_boundary(fn, *needles):
    """``fn`` raises StepBoundaryError (a checkpoint save raises its own error, caused by it)."""
    from ragged_fsdp.fsdp import StepBoundaryError

    with pytest.raises(Exception) as e:
        fn()
    err = e.value if isinstance(e.value, StepBoundaryError) else e.value.__cause__
    assert isinstance(err, StepBoundaryError), repr(e.value)
    for n in needles:
        assert n in str(err), (n, str(err))


_STRAIGHT: dict = {}


def _straight(world):
    """The parameters after steps 0 and 1 run straight (SGD), once per launch."""
    if world not in _STRAIGHT:
        model, opt = _small(world)
        _train(model, opt, range(2))
        _STRAIGHT[world] = _full_params(model)
    return _STRAIGHT[world]


def _same_params(a, b, what):
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} off by {(a[k] - b[k]).abs().max().item():.3e}"


def case_partial_step_is_refused(rank, world):
    """Finding 1: a step that stops early (a break) and goes on: the optimizer step raises
    on every rank (naming the units and abort_step), so does the next forward; after
    ``abort_step`` + ``zero_grad`` the run equals one that never saw the partial step. A
    partial step followed by a full one without an optimizer step between is caught too."""
    from ragged_fsdp import abort_step
    from ragged_fsdp.fsdp import deterministic as det

    want = _straight(world)
    for variant in ("step_after_break", "no_step_between"):
        model, opt = _small(world)
        mine = det.micro_batches(model)
        for j in mine[:-1]:  # the last micro-step never runs (end of data, a break)
            _micro(model, 7, j)
        if variant == "step_after_break":
            _expect_boundary(opt.step, "step() in the middle of a step", f"{len(mine) - 1} of its {len(mine)}",
                             "abort_step", "layers.0")
            _expect_boundary(lambda: model.loss(*_micro_batch(0, mine[0])), "broken", "abort_step")
        else:
            opt.zero_grad()
            for j in mine:  # a full step on top of the partial one: its sums mixed two steps
                _micro(model, 0, j)
            _expect_boundary(opt.step, "partial")
        abort_step(model)
        opt.zero_grad()
        _train(model, opt, range(2))
        _same_params(_full_params(model), want, variant)


def case_micro_step_that_raised(rank, world):
    """Finding 2: a micro-step's forward or backward raises, is caught, and the loop goes
    on. Forward (nothing folded): skipping the micro-batch leaves the step short and the
    optimizer step refuses it; running it again gives the straight run's bits. Backward,
    after block 1 and the head folded their pieces: the next forward refuses the broken
    step; after ``abort_step`` the step runs again and equals the straight run."""
    from ragged_fsdp import abort_step
    from ragged_fsdp.fsdp import deterministic as det

    want = _straight(world)
    for where in ("forward_skip", "forward_retry", "backward"):
        model, opt = _small(world, boom=where == "backward")
        mine = det.micro_batches(model)
        fail = [True]

        def bad_forward(m, i):
            if fail[0]:
                fail[0] = False
                raise RuntimeError("simulated fault in forward")

        handle = model.layers[1].register_forward_pre_hook(bad_forward) if where != "backward" else None
        Boom.armed[0] = where == "backward"
        for k, j in enumerate(mine):
            try:
                _micro(model, 0, j)
            except RuntimeError as e:
                assert "simulated" in str(e) and k == 0, (k, e)
                Boom.armed[0] = False
                if where == "forward_retry":
                    _micro(model, 0, j)
                if where == "backward":
                    break
        if handle is not None:
            handle.remove()
        if where == "forward_skip":
            _expect_boundary(opt.step, "partial", "abort_step")
        elif where == "backward":
            _expect_boundary(lambda: _micro(model, 0, mine[1]), "broken", "raised in its backward", "abort_step")
            _expect_boundary(opt.step, "broken")
        if where != "forward_retry":
            abort_step(model)
            opt.zero_grad()
            _train(model, opt, range(2))
        else:
            det.clip_grad_norm_(model, MAX_NORM)  # as _train does
            opt.step()
            opt.zero_grad()
            _train(model, opt, range(1, 2))
        _same_params(_full_params(model), want, where)


def case_checkpoint_between_micro_steps_is_refused(rank, world):
    """Finding 4: TrainState / save_local of the model's or the optimizer's state dict
    between micro-steps raises (naming abort_step), and the step goes on unharmed: the run
    equals the straight one. At a step boundary the same saves pass."""
    import ragged_fsdp.checkpoint as ck
    from ragged_fsdp.fsdp import deterministic as det

    want = _straight(world)
    model, opt = _small(world)
    _train(model, opt, range(1))
    mine = det.micro_batches(model)
    _micro(model, 1, mine[0])
    _expect_boundary(lambda: ck.save({"train": ck.TrainState(model, opt)}, "/nonexistent/never"), "state_dict()")
    _expect_boundary(lambda: ck.save_local(model.state_dict(), "/nonexistent/never"), "partial")
    _expect_boundary(opt.state_dict, "SGD.state_dict()", "abort_step")
    _expect_boundary(lambda: det.check_step_boundary(model, "snapshot"), "snapshot in the middle of a step")
    for j in mine[1:]:
        _micro(model, 1, j)
    det.check_step_boundary(model)
    model.state_dict()
    opt.state_dict()
    det.clip_grad_norm_(model, MAX_NORM)  # as _train does
    opt.step()
    opt.zero_grad()
    _same_params(_full_params(model), want, "refused saves in the middle of step 1")


class _Trunk(torch.nn.Module):
    """A trunk every micro-step runs and a head (its own fully_shard) only some run."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(10, 13)
        self.head = torch.nn.Linear(13, 3)
        self.out = torch.nn.Linear(13, 1)

    def forward(self, x, use_head):
        h = torch.tanh(self.body(x))
        loss = self.out(h).square().mean()
        return loss + self.head(h).square().mean() if use_head else loss


def _trunk_batch(step, j):
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + j))


def _uses_head(step, j, world):
    return (j // world + step) % 2 == 0  # by micro-step: every rank runs the head together


def case_unit_unused_in_some_micro_steps(rank, world):
    """Finding 3: a separately wrapped head that runs in every other micro-step (the first
    micro-step in one step, the last in the other): the steps equal a single-process run
    (autograd accumulating the V micro-batches it ran, times 1/V) bitwise, and nothing
    carries into the next step."""
    from ragged_fsdp import fully_shard, global_order
    from ragged_fsdp.fsdp import deterministic as det

    def build():
        torch.manual_seed(0)
        return _Trunk()

    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = build()
    fully_shard(model.head, mesh=_mesh(world))
    fully_shard(model, mesh=_mesh(world))
    global_order(model, micro_batches=V)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for j in range(V):
            ref(_trunk_batch(step, j), _uses_head(step, j, world)).backward()
        for p in ref.parameters():
            p.grad.mul_(1.0 / V)
        ref_opt.step()
        ref_opt.zero_grad()
        for j in det.micro_batches(model):
            model(_trunk_batch(step, j), _uses_head(step, j, world)).backward()
        opt.step()
        opt.zero_grad()
        got = _full_params(model)
        for k, p in ref.named_parameters():
            assert torch.equal(got[k], p.detach()), (step, k, (got[k] - p.detach()).abs().max().item())


def case_norm_counts_replicated_grads_once(rank, world):
    """Finding 5: a parameter in ``ignored_params`` whose gradient the user all-reduces:
    ``total_norm`` counts it once (not once per rank), equal to math.fsum over the full
    gradients (bitwise in fp32: the exact sum rounds once), and ``clip_grad_norm_`` scales by it."""
    import torch.distributed as dist

    from ragged_fsdp import fully_shard
    from ragged_fsdp.fsdp import deterministic as det

    torch.manual_seed(0)
    model = _Trunk()
    fully_shard(model, mesh=_mesh(world), ignored_params={model.out.weight})
    x = _trunk_batch(0, rank)
    model(x, True).backward()
    g = model.out.weight.grad
    dist.all_reduce(g)  # the user's own reduction of the ignored parameter: the same on every rank
    g.div_(world)
    grads = [_full(p.grad).clone() for p in model.parameters()]
    want = torch.tensor(math.sqrt(math.fsum(v * v for t in grads for v in t.double().flatten().tolist())),
                        dtype=torch.float64).to(torch.float32)
    norm = det.total_norm(model)
    assert torch.equal(norm, want), (world, norm.item(), want.item(), [type(p.grad) for p in model.parameters()])
    det.clip_grad_norm_(model, 0.5 * float(want))
    clipped = [_full(p.grad) for p in model.parameters()]
    coef = torch.clamp(0.5 * float(want) / (want + 1e-6), max=1.0)
    for a, b in zip(clipped, grads):
        assert torch.equal(a, b * coef)



def case_micro_batches_agreed(rank, world):
    """``micro_batches`` invalid on one rank (0, True, None, one W does not divide), or
    ``global_order`` called on one rank only: a clear error on every rank, never a hang (the
    harness's barrier after the case would fail on a rank left waiting). Afterwards every rank
    is back in step: the mode turns on and a micro-step runs."""
    from ragged_fsdp import fully_shard, global_order
    from ragged_fsdp.fsdp import SettingMismatchError
    from ragged_fsdp.models.llama import Llama

    if world == 1:
        return
    torch.manual_seed(0)
    m = Llama(_cfg())
    fully_shard(m, mesh=_mesh(world))
    for bad, says in ((0, "positive int, got 0"), (True, "positive int, got True"),
                      (None, "positive int, got None"), (world * 3 + 1, "does not divide")):
        with pytest.raises(ValueError) as info:
            global_order(m, micro_batches=bad if rank == 1 else V)
        assert says in str(info.value), str(info.value)
        if rank != 1:
            assert "failed on rank(s) [1]" in str(info.value), str(info.value)
    # rank 0 calls global_order, the others go on to their forward: the two exchanges pair
    if rank == 0:
        with pytest.raises(SettingMismatchError, match="different points") as info:
            global_order(m, micro_batches=V)
    else:
        with pytest.raises(SettingMismatchError, match="different points") as info:
            m.loss(*_micro_batch(0, 0))
    assert "rank(s) [0] called global_order" in str(info.value), str(info.value)
    global_order(m, micro_batches=V)
    with torch.no_grad():  # a forward's all-gathers: every rank issues the same ones again
        m.loss(*_micro_batch(0, rank))



CASES = [case_train, case_hsdp, case_checkpoint, case_refusals, case_refuses_expert_parallel,
         case_partial_step_is_refused, case_micro_step_that_raised, case_checkpoint_between_micro_steps_is_refused,
         case_unit_unused_in_some_micro_steps, case_norm_counts_replicated_grads_once, case_micro_batches_agreed]


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("global_order"))


# W=4 first: it writes the checkpoint the others load. W=2 is left out for the suite's time: W=3
# (uneven cuts, a rank count that divides nothing) and W=4 (HSDP 2x2) cover what it would.
WORLDS = (1, 3, 4)


@pytest.mark.parametrize("world", [4, 1, 3])
def test_launch(outdir, world, monkeypatch):
    monkeypatch.setenv(ENV, outdir)
    results = run_cases(world, CASES)
    for case in CASES:
        check_case(results, case, world)


# -- the single-process reference (plain torch) -------------------------------------------

def _reference(name):
    from ragged_fsdp.models.llama import Llama
    from ragged_fsdp.optim import AdamW8bit

    torch.manual_seed(0)
    model = Llama(_cfg())
    if name.startswith("adamw") and name != "adamw8bit":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=name == "adamw")
    elif name == "adamw8bit":
        opt = AdamW8bit(model.parameters(), lr=1e-2, block_size=64, min_8bit_size=256)
    else:
        return None
    log = []
    for step in range(STEPS):
        losses = []
        for j in range(V):
            loss = model.loss(*_micro_batch(step, j))
            loss.backward()  # autograd adds micro-batch j's gradient into .grad: the order to match
            losses.append(loss.detach().float())
        for p in model.parameters():
            p.grad.mul_(1.0 / V)
        sq = math.fsum(x * x for p in model.parameters() for x in p.grad.double().flatten().tolist())
        norm = torch.tensor(math.sqrt(sq), dtype=torch.float64).to(torch.float32)
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad()
        total = losses[0].clone()
        for x in losses[1:]:
            total += x
        log.append((norm.item(), (total / V).item()))
    return _snapshot(model, opt, log)


def _same(a, b, what):
    assert a["log"] == b["log"], f"{what}: norms/losses {a['log']} != {b['log']}"
    for part in ("params", "states"):
        assert a[part].keys() == b[part].keys(), (what, part)
        for k in a[part]:
            x, y = a[part][k], b[part][k]
            assert x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8) if x.dtype.is_floating_point
                                                      else x, y.view(-1).view(torch.uint8) if y.dtype.is_floating_point
                                                      else y), f"{what}: {part} {k} differ"


def _load(outdir, tag):
    return torch.load(os.path.join(outdir, f"{tag}.pt"), weights_only=True)


@pytest.mark.parametrize("name", OPTS)
def test_bitwise_across_world_sizes(outdir, name):
    base = _load(outdir, f"{name}_w1")
    for w in WORLDS[1:]:
        _same(_load(outdir, f"{name}_w{w}"), base, f"{name}: W={w} vs W=1")
    ref = _reference(name)
    if ref is not None:
        _same(base, ref, f"{name}: W=1 vs single-process torch")


def test_hsdp_equals_1d(outdir):
    _same(_load(outdir, "hsdp_2x2"), _load(outdir, "adamw_w4"), "HSDP 2x2 vs 1-D W=4")
    _same(_load(outdir, "hsdp_2x2"), _load(outdir, "adamw_w1"), "HSDP 2x2 vs W=1")


@pytest.mark.parametrize("world", [1, 3])
def test_checkpoint_replay(outdir, world):
    _same(_load(outdir, f"replay_w{world}"), _load(outdir, "replay_w4"), f"W=4 save, W={world} continuation")


def test_exact_sum_of_squares_does_not_depend_on_the_split():
    """The norm's sum: the same bits however the elements are split into tensors (ranks add
    their partial sums the same way), within 1e-15 of ``math.fsum``; an fp32 sum of per-part
    sums, as torch's clipping makes, does depend on the split (so the check can fail)."""
    from ragged_fsdp.fsdp.deterministic import exact_sum_of_squares

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(10007, generator=g) * torch.logspace(-6, 6, 10007)).float()
    want = math.fsum(v * v for v in x.double().tolist())
    whole = exact_sum_of_squares([x], x.numel())
    assert abs(float(whole) - want) <= 1e-15 * want
    plain = set()
    for sizes in ([10007], [1, 5000, 5006], [3333, 3334, 3340], [7] * 1429 + [4]):
        parts = list(torch.split(x, sizes))
        assert torch.equal(exact_sum_of_squares(parts, x.numel()), whole), sizes
        plain.add(float(torch.stack([p.square().sum() for p in parts]).sum()))  # fp32, as torch's clip
    assert len(plain) > 1
