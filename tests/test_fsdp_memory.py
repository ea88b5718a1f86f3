"""Buffer lifetimes (gloo, W = 2, 3), each checked against single-process training.

- The gradient buffer of a group exists from its first gradient on, not from its
  pre-backward (the root's pre-backward fires on the loss, before the loss's own backward),
  and the root's backward prefetch waits for that first gradient too.
- Embedding weights live in their own buffer; their backward needs only the indices, so
  after forward that buffer is freed even where the group keeps its parameters
  (the root), and backward does not gather it again. Never with tied weights, with the
  embedding run under activation checkpointing, or when ``set_unshard_in_backward(True)``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from _dist import check_case, cpu_mesh, run_cases
from _patterns import _ce, _tiny, _wrap_blocks, compare_steps

from ragged_fsdp.fsdp import trace
from ragged_fsdp.models.llama import Llama


def _buffer_index(model, fqn):
    """Which of ``model``'s DBuffers holds parameter ``fqn``."""
    return next(i for i, b in enumerate(model.dbuffers) if any(s.key == fqn for s in b.slots))


def _step(m, t, y, distributed):
    _ce(m(t), y).backward()


def case_embedding_not_regathered(rank, world):
    with trace() as log:
        model = compare_steps(rank, world, lambda: Llama(_tiny()), _wrap_blocks, _step)
    emb = _buffer_index(model, "tok_embeddings.weight")
    name = log.buffer_of("tok_embeddings.weight")
    assert name == f"<root>#{emb}"
    assert len(model.dbuffers) == 2, "the root keeps norm/head and the embedding in separate buffers"
    gathers = log.of("all_gather", buffer=name)
    assert not [e for e in gathers if e.backward], "embedding gathered in backward"
    assert [e for e in gathers if not e.backward] or world == 1, "embedding never gathered"
    # after forward the root keeps its head, but not its embedding
    t = torch.randint(0, 96, (2, 8))
    loss = model.loss(t, t)
    assert not model.dbuffers[emb].unsharded_allocated or world == 1
    assert all(b.unsharded_allocated for i, b in enumerate(model.dbuffers) if i != emb)
    loss.backward()


def case_tied_embedding_always_gathered(rank, world):
    model = compare_steps(rank, world, lambda: Llama(_tiny(tie_embeddings=True)), _wrap_blocks, _step)
    assert len(model.dbuffers) == 1, "a tied embedding shares the head's buffer"


class _CheckpointedEmbedding(Llama):
    def forward(self, tokens):
        h = checkpoint(self.tok_embeddings, tokens, use_reentrant=False)
        h = h * 1.0  # keep the checkpoint's output out of the blocks' inputs
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def case_checkpointed_embedding_gathered(rank, world):
    """The embedding runs inside a checkpoint: its recomputation needs the weight."""
    compare_steps(rank, world, lambda: _CheckpointedEmbedding(_tiny()), _wrap_blocks, _step)


def case_embedding_group_recomputed_in_backward(rank, world):
    """A skipped buffer whose module is recomputed inside backward anyway (a checkpoint the
    watch could not see coming) gets gathered on the spot."""

    class Late(Llama):
        def forward(self, tokens):
            ids = tokens.float().requires_grad_(True)  # makes the checkpoint's output need grad

            def embed(x):
                return self.tok_embeddings(x.detach().long()) + 0 * x.unsqueeze(-1)

            h = embed(ids) if not self.training else checkpoint(embed, ids, use_reentrant=False)
            for layer in self.layers:
                h = layer(h, self.rope_cos, self.rope_sin)
            return self.output(self.norm(h))

    compare_steps(rank, world, lambda: Late(_tiny()), _wrap_blocks, _step)


class _CheckpointedFirst(_CheckpointedEmbedding):
    """The embedding under activation checkpointing while ``checkpointed`` is True."""

    checkpointed = True

    def forward(self, tokens):
        return super().forward(tokens) if self.checkpointed else Llama.forward(self, tokens)


def case_recomputation_ends_with_its_backward(rank, world):
    """A backward that recomputed the embedding needed its weight; the next step, run
    without the checkpoint, frees the embedding after forward and does not gather it in
    backward again."""
    model = compare_steps(rank, world, lambda: _CheckpointedFirst(_tiny()), _wrap_blocks, _step, steps=1)
    model.checkpointed = False
    emb = _buffer_index(model, "tok_embeddings.weight")
    t = torch.randint(0, 96, (2, 8))
    with trace() as log:
        loss = model.loss(t, t)
        assert not model.dbuffers[emb].unsharded_allocated, "embedding kept after forward for backward"
        loss.backward()
    name = log.buffer_of("tok_embeddings.weight")
    assert not [e for e in log.of("all_gather", buffer=name) if e.backward], "embedding gathered in backward"


class _PeekingBlock(torch.nn.Module):
    """A block that also reads the root's embedding weight through a reference the module
    tree does not show (a list attribute), and saves it for backward."""

    def __init__(self, block, embedding):
        super().__init__()
        self.block = block
        self._embedding = [embedding]

    def forward(self, h, cos, sin):
        w = self._embedding[0].weight
        return self.block(h, cos, sin) + 0.01 * torch.nn.functional.linear(h @ w.t(), w.t())


class _PeekingLlama(Llama):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = torch.nn.ModuleList(_PeekingBlock(b, self.tok_embeddings) for b in self.layers)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def case_embedding_saved_inside_a_block_gathered(rank, world):
    """The root's saved-tensor watch is off while a wrapped block runs forward; a block that
    saves the root's embedding weight (reached outside the module tree) still gets it
    gathered for backward, with the reference's gradients."""
    model = compare_steps(rank, world, lambda: _PeekingLlama(_tiny()), _wrap_blocks, _step)
    emb = _buffer_index(model, "tok_embeddings.weight")
    t = torch.randint(0, 96, (2, 8))
    loss = model.loss(t, t)
    assert model.dbuffers[emb].unsharded_allocated, "the root freed a weight a block saved"
    loss.backward()


def case_unshard_in_backward_forced(rank, world):
    def wrap(m, mesh):
        m = _wrap_blocks(m, mesh)
        m.set_unshard_in_backward(True)
        return m

    model = compare_steps(rank, world, lambda: Llama(_tiny()), wrap, _step, steps=2)
    emb = _buffer_index(model, "tok_embeddings.weight")
    t = torch.randint(0, 96, (2, 8))
    loss = model.loss(t, t)
    assert model.dbuffers[emb].unsharded_allocated, "kept for backward as asked"
    loss.backward()


def case_grad_buffer_from_first_gradient(rank, world):
    """When the loss's gradient reaches the logits, the root's pre-backward has run but no
    gradient buffer exists yet, and the last block is not being gathered yet."""
    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    model = _wrap_blocks(Llama(_tiny()), mesh)
    t = torch.randint(0, 96, (2, 8))
    last = f"layers.{len(model.layers) - 1}"
    for _ in range(2):  # the second step has a forward order to prefetch from
        seen = {}
        with trace() as tr:
            logits = model(t)

            def probe(grad):
                seen["root grads"] = [b.grad is not None for b in model.dbuffers]
                seen["last block gathering"] = [e for e in tr.of("all_gather") if e.backward and e.group == last]
                return grad

            logits.register_hook(probe)
            _ce(logits, t).backward()
        model.zero_grad()
    assert seen["root grads"] == [False, False], seen
    assert not seen["last block gathering"], seen
    # deferred, not dropped: the root's first gradient (the head's) issues the last block's
    # gather, before the head's own (early) reduction and so before that block's pre-backward
    ev = [e for e in tr if e.backward]
    head = tr.buffer_of("output.weight")
    first_gather = next(k for k, e in enumerate(ev) if e.kind == "all_gather" and e.group == last)
    head_reduced = next(k for k, e in enumerate(ev) if e.kind == "reduce_scatter" and e.buffer == head)
    assert first_gather < head_reduced, tr.table()


def case_gloo_reduction_chunked_same_bits(rank, world):
    """Above the receive bound the gloo reduction runs in column chunks: same bits."""
    import torch.distributed as dist

    import ragged_fsdp.fsdp.comms.collectives as col
    from ragged_fsdp.fsdp.comms.device import Device

    comm = col.Comm.of(dist.group.WORLD)
    dev = Device(torch.device("cpu"))
    S = 37
    for grad_dtype, target_dtype, accumulate, factor in [
        (torch.float32, torch.float32, False, None), (torch.bfloat16, torch.float32, False, None),
        (torch.float32, torch.float32, True, None), (torch.float32, torch.float32, False, 3.0),
    ]:
        g = torch.Generator().manual_seed(rank + 7)
        grad = torch.randn(world * S, generator=g).to(grad_dtype)
        start = torch.randn(S, generator=g).to(target_dtype)
        outs = []
        for bound in (col.GLOO_RECEIVE_BOUND_BYTES, 5 * grad.element_size() * (world - 1)):
            old, col.GLOO_RECEIVE_BOUND_BYTES = col.GLOO_RECEIVE_BOUND_BYTES, bound
            try:
                target = start.clone()
                col.reduce_scatter(dev, comm, grad, target, accumulate, factor).wait()
            finally:
                col.GLOO_RECEIVE_BOUND_BYTES = old
            outs.append(target)
        assert torch.equal(outs[0], outs[1]), (grad_dtype, accumulate, factor)


CASES = [
    case_embedding_not_regathered,
    case_tied_embedding_always_gathered,
    case_checkpointed_embedding_gathered,
    case_embedding_group_recomputed_in_backward,
    case_recomputation_ends_with_its_backward,
    case_embedding_saved_inside_a_block_gathered,
    case_unshard_in_backward_forced,
    case_grad_buffer_from_first_gradient,
    case_gloo_reduction_chunked_same_bits,
]


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    return request.param, run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_memory(results, case):
    world, res = results
    check_case(res, case, world)
