"""Models and a training comparison for the multi-dimensional mesh tests (HSDP, TP, EP).

``compare_mesh_training`` trains a wrapped model on W ranks, each rank on the tokens of its
data-parallel index (TP ranks of one group see the same tokens), and the unwrapped model in
one process on the whole batch; it checks the first step's full gradients per tensor, the
losses and the parameters after a few AdamW steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist import full, global_batch

VOCAB = 96


def hf_llama(tie: bool = False):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def hf_loss(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def moe(**kw):
    from ragged_fsdp.models.moe import MoE, MoEConfig

    cfg = MoEConfig.tiny(fused_experts=True, n_experts=8, **kw)
    return MoE(cfg)


def moe_loss(model, tokens, targets):
    return model.loss(tokens, targets)


def tp_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(2):
        p = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{p}.{n}"] = RowwiseParallel()
    return plan


def named_full(model) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.named_parameters()}


def compare_mesh_training(rank, build, wrap, loss_fn, *, dp_index, dp_size, steps=3, batch=2, seq=8,
                          lr=1e-2, grad_rtol=1e-4, loss_rtol=1e-5, param_atol=5e-4, micro=1,
                          before_backward=None, clip=None):
    """``wrap(model) -> model`` shards it; rank ``r`` trains on slice ``dp_index`` of
    ``dp_size`` slices of every global batch (``micro`` micro-batches per step)."""
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = wrap(build())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    B = batch * dp_size * micro
    for step in range(steps):
        tokens, targets = global_batch(step, B, seq, VOCAB)
        ref_loss = loss_fn(ref, tokens, targets)
        ref_loss.backward()
        total = torch.zeros(())
        for m in range(micro):
            lo = (m * dp_size + dp_index) * batch
            if before_backward is not None:
                before_backward(model, m, micro)
            loss = loss_fn(model, tokens[lo:lo + batch], targets[lo:lo + batch]) / micro
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        got = total.item() / dist.get_world_size()  # every dp slice counted W/dp_size times
        want = ref_loss.item()
        assert abs(got - want) <= loss_rtol * abs(want) + 1e-7, f"step {step}: loss {got} vs {want}"
        if step == 0:
            grads = {k: (full(v.grad) if v.grad is not None else None) for k, v in model.named_parameters()}
            for name, q in ref.named_parameters():
                g = grads[name]
                assert (g is None) == (q.grad is None), f"{name}: grad None mismatch"
                if g is None:
                    continue
                err = (g - q.grad).norm().item() / max(q.grad.norm().item(), 1e-12)
                assert err <= grad_rtol, f"{name}: first-step gradient relative error {err:.2e}"
        if clip is not None:
            a = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            b = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            a = a.full_tensor() if hasattr(a, "full_tensor") else a
            assert torch.allclose(a, b, rtol=1e-5), f"step {step}: grad norm {a} vs {b}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    params = named_full(model)
    for name, q in ref.named_parameters():
        err = (params[name].detach() - q.detach()).abs().max().item()
        assert err <= param_atol, f"{name}: max |param - reference| = {err:.2e}"
    return model, ref
