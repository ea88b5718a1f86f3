"""Training patterns real trainers use, against single-process training (gloo, W = 2, 3).

Each case runs the same step function on the wrapped model (local batch) and on an
unwrapped copy (global batch): several backward passes per step (``retain_graph``, two
forwards then two backwards, torchtitan's chunked loss with and without its explicit
``unshard``/``reshard`` branch), and a wrapped model that is compiled. Checked: the first
step's full gradients per tensor (1e-5 relative; a gradient a group drops shows up here,
AdamW would hide it), and the parameters after a few SGD steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _dist import check_case, cpu_mesh, run_cases
from _patterns import HiddenLlama, _ce, _tiny, _wrap_blocks, compare_steps

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.fsdp.comms.device import drain, in_flight
from ragged_fsdp.models.llama import Llama



# -- the root's norm + head buffer, reduced and freed as soon as their backward ran ---------
def case_root_head_reduced_early(rank, world):
    from ragged_fsdp.fsdp import trace

    steps = []

    def step(m, t, y, distributed):
        if not distributed:
            return _ce(m(t), y).backward()
        with trace() as tr:
            logits = m(t)
            _ce(logits, y).backward()
        steps.append(tr)

    compare_steps(rank, world, lambda: Llama(_tiny()), _wrap_blocks, step)
    head = steps[0].buffer_of("output.weight")
    for tr in steps:
        ev = [e for e in tr if e.backward]
        reds = [e for e in ev if e.kind == "reduce_scatter"]
        # the first reduction of a step is the root's norm+head buffer, issued before any
        # block's, with its unsharded parameters freed right before; the embedding's comes last
        assert (reds[0].buffer, reds[0].early) == (head, True), tr.table()
        k = ev.index(reds[0])
        assert ev[k - 1].kind == "free" and ev[k - 1].buffer == head, tr.table()
        assert reds[-1].group == "<root>" and reds[-1].buffer != head and not reds[-1].early, tr.table()
        assert sum(1 for e in reds if e.buffer == head) == 1, "one head reduction per step"
    assert len(steps) == 3


class _CheckpointedHead(Llama):
    """Norm and head under activation checkpointing (recomputed inside backward)."""

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return checkpoint(lambda x: self.output(self.norm(x)), h, use_reentrant=False)


def case_checkpointed_head_early_reduction(rank, world):
    def step(m, t, y, distributed):
        _ce(m(t), y).backward()

    compare_steps(rank, world, lambda: _CheckpointedHead(_tiny()), _wrap_blocks, step)


def case_early_reduction_mismatch_is_an_error(rank, world):
    """If ranks disagree on which reductions ran early (an owner module run on some ranks
    only), the end-of-backward flag all-reduce sees it and every rank raises. Simulated:
    rank 0 labels the root's end-of-backward reductions as early."""
    from ragged_fsdp.fsdp.core.init import state_of

    torch.manual_seed(0)
    model = _wrap_blocks(Llama(_tiny()), cpu_mesh(world))
    t = torch.randint(0, model.cfg.vocab_size, (2, 8))
    logits = model(t)
    st = state_of(model)
    if rank == 0:
        reductions, root_units = st.ctx.reductions, set(map(id, st.group.units))
        orig = reductions.reduce
        reductions.reduce = lambda dev, u, grad, touched, settings, early=False: orig(
            dev, u, grad, touched, settings, early or id(u) in root_units)
    with pytest.raises(RuntimeError, match="ran early on some ranks"):
        _ce(logits, t).backward()


class _HeadRowScaled(Llama):
    """Reads ``output.weight`` outside the head module, at the start of forward, so that
    part of its gradient arrives at the very end of backward. ``saves``: by a multiply
    (autograd saves the weight slice: it must stay gathered) or an add (nothing saved)."""

    def __init__(self, cfg, saves: bool):
        super().__init__(cfg)
        self.saves = saves

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        row = self.output.weight[0, : h.shape[-1]]
        h = h + h * row if self.saves else h + row  # mul saves the slice of the weight
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def _late_head_grad(rank, world, saves: bool):
    def step(m, t, y, distributed):
        _ce(m(t), y).backward()

    compare_steps(rank, world, lambda: _HeadRowScaled(_tiny(), saves), _wrap_blocks, step)


def case_head_weight_read_outside_its_module_saved(rank, world):
    _late_head_grad(rank, world, saves=True)


def case_head_weight_read_outside_its_module_unsaved(rank, world):
    _late_head_grad(rank, world, saves=False)

# -- several backward passes per step -------------------------------------------------------
def _two_losses_retain_graph(m, t, y, distributed):
    logits = m(t)
    half = t.shape[1] // 2
    l1 = _ce(logits[:, :half], y[:, :half]) * 0.3
    l2 = _ce(logits[:, half:], y[:, half:]) * 0.7
    l1.backward(retain_graph=True)
    l2.backward()


def case_two_losses_retain_graph(rank, world):
    compare_steps(rank, world, lambda: Llama(_tiny()), _wrap_blocks, _two_losses_retain_graph)


def _two_forwards_two_backwards(m, t, y, distributed):
    b = t.shape[0] // 2
    la = _ce(m(t[:b]), y[:b]) / 2
    lb = _ce(m(t[b:]), y[b:]) / 2
    la.backward()
    lb.backward()


def case_two_forwards_two_backwards(rank, world):
    compare_steps(rank, world, lambda: Llama(_tiny()), _wrap_blocks, _two_forwards_two_backwards)


def case_three_backwards_tied(rank, world):
    def step(m, t, y, distributed):
        logits = m(t)
        third = t.shape[1] // 4
        parts = [(0, third), (third, 2 * third), (2 * third, t.shape[1])]
        for i, (a, b) in enumerate(parts):
            _ce(logits[:, a:b], y[:, a:b]).mul(1 / 3).backward(retain_graph=i < 2)

    compare_steps(rank, world, lambda: Llama(_tiny(tie_embeddings=True)), _wrap_blocks, step)


def _chunked(explicit: bool, chunks: int = 4):
    """torchtitan's chunked loss: the head runs once per chunk with its own backward, then
    the accumulated hidden-state gradient goes through the decoder in one more backward."""

    def step(m, t, y, distributed):
        h = m(t)
        hd = h.detach()
        acc = torch.zeros_like(hd)
        head = m.output
        fsdp_head = distributed and explicit
        if fsdp_head:
            head.set_reshard_after_forward(False)
            head.set_reshard_after_backward(False)
            head.set_requires_gradient_sync(False, recurse=False)
            head.unshard()
        n = t.shape[1] // chunks
        for i in range(chunks):
            if fsdp_head and i == chunks - 1:
                head.set_requires_gradient_sync(True, recurse=False)
            hc = hd[:, i * n:(i + 1) * n].contiguous().requires_grad_(True)
            loss = _ce(head(hc), y[:, i * n:(i + 1) * n]) / chunks
            loss.backward()
            acc[:, i * n:(i + 1) * n] = hc.grad
        if fsdp_head:
            head.set_reshard_after_forward(True)
            head.set_reshard_after_backward(True)
            head.set_requires_gradient_sync(True, recurse=False)
            head.reshard()
        h.backward(acc)

    return step


def case_chunked_loss(rank, world):
    compare_steps(rank, world, lambda: HiddenLlama(_tiny()), lambda m, mesh: _wrap_blocks(m, mesh, head_group=True),
                  _chunked(explicit=False))


def case_chunked_loss_torchtitan_branch(rank, world):
    compare_steps(rank, world, lambda: HiddenLlama(_tiny()), lambda m, mesh: _wrap_blocks(m, mesh, head_group=True),
                  _chunked(explicit=True))


def case_chunked_loss_norm_head_list_group(rank, world):
    """torchtitan's wrapping: [norm, head] as one list group; the decoder's forward runs only
    the norm, the head runs per chunk afterwards and is resharded explicitly before the
    decoder's backward, which needs the norm's weight again."""
    def wrap(m, mesh):
        for block in m.layers:
            fully_shard(block, mesh=mesh)
        fully_shard([m.norm, m.output], mesh=mesh, reshard_after_forward=False)
        fully_shard(m, mesh=mesh)
        return m

    compare_steps(rank, world, lambda: HiddenLlama(_tiny()), wrap, _chunked(explicit=True))


def case_chunked_loss_head_in_root(rank, world):
    """The head is part of the root's group (not wrapped on its own)."""
    compare_steps(rank, world, lambda: HiddenLlama(_tiny()), _wrap_blocks, _chunked(explicit=False))


def case_no_sync_then_sync_multi_backward(rank, world):
    """Deferred reduction: two backwards without sync, the last one with it."""

    def step(m, t, y, distributed):
        b = t.shape[0] // 2
        if distributed:
            m.set_requires_gradient_sync(False)
        _ce(m(t[:b]), y[:b]).div(2).backward()
        if distributed:
            m.set_requires_gradient_sync(True)
        _ce(m(t[b:]), y[b:]).div(2).backward()

    compare_steps(rank, world, lambda: Llama(_tiny()), _wrap_blocks, step)


# -- torch.compile of a wrapped model ----------------------------------------------------------
def _plain_step(m, t, y, distributed):
    _ce(m(t), y).backward()


def _compiled(backend, whole=True):
    def wrap(model, mesh):
        model = _wrap_blocks(model, mesh)
        if whole:
            return torch.compile(model, backend=backend)
        for block in model.layers:
            block.compile(backend=backend)
        return model

    return wrap


def case_compile_eager_and_aot_eager(rank, world):
    import torch._dynamo

    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compare_steps(rank, world, lambda: Llama(_tiny()), _compiled(backend), _plain_step, steps=2)
    # per-block compile (torchtitan's way): the engine's hooks cause no graph break, and each
    # identical block reuses one graph
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compare_steps(rank, world, lambda: Llama(_tiny()), _compiled("aot_eager", whole=False), _plain_step, steps=2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def case_compile_inductor(rank, world):
    """Inductor compiles C++ kernels per rank (about a minute on 2 cores): W = 2 only."""
    import torch._dynamo

    if world != 2:
        return
    torch._dynamo.reset()
    compare_steps(rank, world, lambda: Llama(_tiny(n_layers=1)), _compiled("inductor"), _plain_step,
                  steps=2, grad_rtol=1e-4, param_atol=1e-4)


# -- meta-device init of list groups -----------------------------------------------------------
def case_meta_init_list_group_to_empty(rank, world):
    """fully_shard([embedding, head]) on a meta-built model, then to_empty and init."""
    cfg = _tiny(tie_embeddings=False)

    def build():
        m = Llama(cfg)
        torch.manual_seed(1)
        m.init_weights()
        return m

    def wrap(_, mesh):
        with torch.device("meta"):
            m = Llama(cfg)
        for block in m.layers:
            fully_shard(block, mesh=mesh)
        fully_shard([m.tok_embeddings, m.output], mesh=mesh)
        fully_shard(m, mesh=mesh)
        m.to_empty(device="cpu")
        torch.manual_seed(1)
        m.init_weights()
        return m

    compare_steps(rank, world, build, wrap, _plain_step, steps=2)


def case_unconsumed_prefetch_is_drained(rank, world):
    """An async unshard nobody waits for, and a backward prefetch of a group that keeps its
    parameters after backward: nothing may stay in flight (gloo aborts at exit on it)."""
    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    model = _wrap_blocks(Llama(_tiny()), mesh)
    model.layers[0].set_reshard_after_backward(False)
    model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
    t = torch.randint(0, 96, (2, 8))
    model.loss(t, t).backward()
    assert not in_flight()
    model.reshard()
    for block in model.layers:
        block.reshard()
    handle = model.layers[1].unshard(async_op=True)
    assert in_flight()
    drain()
    assert not in_flight()
    handle.wait()


# -- input that must be refused --------------------------------------------------------------
def case_rank_dependent_granularity(rank, world):
    """Same buffer size on every rank but a different layout: must not train silently."""
    from ragged_fsdp.fsdp import LayoutMismatchError

    mesh = cpu_mesh(world)
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8))
    gran = (lambda n, p: "row") if rank == 0 else (lambda n, p: "tensor" if p.dim() == 2 else None)
    with pytest.raises(LayoutMismatchError, match="granularity_fn must not depend on the rank"):
        fully_shard(model, mesh=mesh, granularity_fn=gran)
    # different parameter shapes (buffer sizes differ): an error, not a gloo abort
    model = nn.Linear(16, 8 + rank)
    with pytest.raises(LayoutMismatchError, match="shape="):
        fully_shard(model, mesh=mesh)
    # one rank's granularity_fn is invalid: every rank raises, none hangs
    model = nn.Linear(16, 8)
    bad = (lambda n, p: "rows:0") if rank == world - 1 else None
    with pytest.raises(ValueError):
        fully_shard(model, mesh=mesh, granularity_fn=bad)


def case_dtensor_params_refused(rank, world):
    """A DTensor parameter on the data-parallel mesh itself (not a TP/EP sibling mesh)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = cpu_mesh(world)
    model = nn.Linear(8, 8 * world)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"'weight'.*Shard\(dim=0\).*does not compose"):
        fully_shard(model, mesh=mesh)


CASES = [
    case_two_losses_retain_graph,
    case_two_forwards_two_backwards,
    case_three_backwards_tied,
    case_chunked_loss,
    case_chunked_loss_torchtitan_branch,
    case_chunked_loss_head_in_root,
    case_chunked_loss_norm_head_list_group,
    case_no_sync_then_sync_multi_backward,
    case_rank_dependent_granularity,
    case_dtensor_params_refused,
    case_compile_eager_and_aot_eager,
    case_compile_inductor,
    case_meta_init_list_group_to_empty,
    case_unconsumed_prefetch_is_drained,
    case_root_head_reduced_early,
    case_head_weight_read_outside_its_module_saved,
    case_head_weight_read_outside_its_module_unsaved,
    case_early_reduction_mismatch_is_an_error,
    case_checkpointed_head_early_reduction,
]


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    return request.param, run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_pattern(results, case):
    world, res = results
    check_case(res, case, world)
