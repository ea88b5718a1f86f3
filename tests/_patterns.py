"""Shared by the training-pattern and memory tests: compare a step function on a wrapped
model (local batch) with the same step on an unwrapped copy (global batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _dist import cpu_mesh, full, global_batch

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.fsdp.comms.device import in_flight
from ragged_fsdp.models.llama import Llama, LlamaConfig


def _ce(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _hidden(m, tokens):
    h = m.tok_embeddings(tokens)
    for layer in m.layers:
        h = layer(h, m.rope_cos, m.rope_sin)
    return m.norm(h)


class HiddenLlama(Llama):
    """forward returns the final hidden states; the head runs outside (chunked losses)."""

    def forward(self, tokens):
        return _hidden(self, tokens)


def _wrap_blocks(model, mesh, head_group=False, **kw):
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    if head_group:
        fully_shard(model.output, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def compare_steps(rank, world, build, wrap, step_fn, *, steps=3, lr=0.05, batch_per_rank=2, seq=8,
                  grad_rtol=1e-5, param_atol=1e-5):
    """``step_fn(model, tokens, targets, distributed)`` runs forward(s) and backward(s)."""
    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = wrap(build(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    B = batch_per_rank * world
    for step in range(steps):
        tokens, targets = global_batch(step, B, seq, ref.cfg.vocab_size)
        step_fn(ref, tokens, targets, False)
        lo = rank * batch_per_rank
        step_fn(model, tokens[lo:lo + batch_per_rank], targets[lo:lo + batch_per_rank], True)
        assert not in_flight(), f"step {step}: collectives still in flight after backward"
        named = {k.replace("_orig_mod.", ""): v for k, v in model.named_parameters()}
        for name, q in ref.named_parameters():
            p = named[name]
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name}.grad None mismatch"
            if q.grad is None or step > 0:
                continue
            g = full(p.grad)
            err = (g - q.grad).norm().item() / max(q.grad.norm().item(), 1e-12)
            assert err <= grad_rtol, f"{name}: gradient relative error {err:.2e} > {grad_rtol}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    named = {k.replace("_orig_mod.", ""): v for k, v in model.named_parameters()}
    for name, q in ref.named_parameters():
        err = (full(named[name]).detach() - q.detach()).abs().max().item()
        assert err <= param_atol, f"{name}: max |param - reference| = {err:.2e}"
    return model


def _tiny(**kw):
    return LlamaConfig.tiny(**{"n_layers": 2, **kw})
