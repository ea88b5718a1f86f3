"""fully_shard training equals single-process training (gloo, W = 1..4).

Every case trains the wrapped model on W ranks and an unwrapped copy in one process on the
same global batches (5 AdamW steps): fp32 losses within 1e-5 relative, parameters within
5e-4 absolute. One process launch per W runs all cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from _dist import check_case, compare_training, run_cases

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.models.llama import Llama, LlamaConfig
from ragged_fsdp.models.moe import MoE, MoEConfig


def _wrap(reshard=None, granularity_fn=None, **kw):
    def wrap(model, mesh):
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, granularity_fn=granularity_fn, **kw)
        fully_shard(model, mesh=mesh, granularity_fn=granularity_fn, **kw)
        return model

    return wrap


# -- cases -------------------------------------------------------------------------------
def case_llama(rank, world):
    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny()), _wrap())


def case_llama_tied(rank, world):
    def check(step, model, ref):
        assert model.output.weight is model.tok_embeddings.weight

    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny(tie_embeddings=True)), _wrap(), after_step=check)


def case_reshard_variants(rank, world):
    variants = [False, True]
    if world == 4:
        variants.append(2)
    for r in variants:
        model, _ = compare_training(rank, world, lambda: Llama(LlamaConfig.tiny(n_layers=3)), _wrap(reshard=r), steps=3)
        if r == 2:  # after forward each rank keeps half of a block's buffer; backward gathers in pairs
            from ragged_fsdp.fsdp import trace

            tokens = torch.randint(0, 96, (1, 8))
            buf = model.layers[0].dbuffers[0]
            full = buf.layout.total * buf.compute_dtype.itemsize
            with trace() as fwd:
                loss = model.loss(tokens, tokens)
            assert [e.bytes for e in fwd.of("keep", buffer="layers.0#0")] == [full // 2], fwd.table()
            assert not buf.unsharded_allocated
            with trace() as bwd:
                loss.backward()
            gathers = bwd.of("all_gather", buffer="layers.0#0")
            assert len(gathers) == 1 and gathers[0].backward, bwd.table()
            assert bwd.of("free", buffer="layers.0#0") and not buf.unsharded_allocated, bwd.table()


def case_list_group_tied(rank, world):
    """Tied embedding and head grouped with fully_shard([embedding, head]) under the root."""
    def wrap(model, mesh):
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard([model.tok_embeddings, model.output], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert model._fsdp_state().group is not None  # the root keeps the final norm
        return model

    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny(tie_embeddings=True)), wrap, steps=3)


def case_root_only(rank, world):
    """One group for the whole model (no per-block wrapping)."""
    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny()),
                     lambda m, mesh: fully_shard(m, mesh=mesh), steps=3)


def case_grad_accum_no_sync(rank, world):
    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny()), _wrap(), micro=2, steps=3)


def case_grad_accum_sync(rank, world):
    compare_training(rank, world, lambda: Llama(LlamaConfig.tiny()), _wrap(), micro=2, sync_each_micro=True, steps=3)


class _CheckpointedLlama(Llama):
    reentrant = False

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=self.reentrant)
        return self.output(self.norm(h))


def case_activation_checkpointing(rank, world):
    compare_training(rank, world, lambda: _CheckpointedLlama(LlamaConfig.tiny()), _wrap(), steps=3)


def case_moe_separate_experts_unused(rank, world):
    """Top-1 routing over 16 experts with few tokens: some experts get no token on any
    rank (their grads stay None, as in the reference), others only on some ranks."""
    cfg = dict(n_experts=16, top_k=1)
    compare_training(rank, world, lambda: MoE(MoEConfig.tiny(**cfg)), _wrap(), batch_per_rank=1, seq=4, steps=3)


def case_moe_fused_expert_rows(rank, world):
    """Fused 3-D experts ``[E, H, D]`` kept whole per expert (``rows:H``: H rows of D)."""
    def gran(name, p):
        return f"rows:{p.shape[1]}" if p.dim() == 3 else None

    def check(step, model, ref):
        for layer in model.layers:
            for w in (layer.feed_forward.experts.w1, layer.feed_forward.experts.w2):
                (pl,) = w.placements
                expert = w.shape[1] * w.shape[2]
                for a, b in pl.element_ranges(tuple(w.shape)):
                    assert a % expert == 0 and b % expert == 0, (pl, a, b)  # whole experts

    compare_training(rank, world, lambda: MoE(MoEConfig.tiny(fused_experts=True)), _wrap(granularity_fn=gran),
                     steps=3, after_step=check)


def case_frozen_params(rank, world):
    def build():
        m = Llama(LlamaConfig.tiny())
        m.tok_embeddings.weight.requires_grad_(False)
        for layer in m.layers:
            layer.attention_norm.weight.requires_grad_(False)
        return m

    compare_training(rank, world, build, _wrap(), steps=3)


def case_module_called_twice(rank, world):
    """Weight sharing across depth: one block applied twice per step (reduce once)."""
    class Twice(Llama):
        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, self.rope_cos, self.rope_sin)
                h = layer(h, self.rope_cos, self.rope_sin)
            return self.output(self.norm(h))

    compare_training(rank, world, lambda: Twice(LlamaConfig.tiny()), _wrap(), steps=3)


def case_unused_module(rank, world):
    class WithUnused(Llama):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.unused = nn.Linear(cfg.dim, 7)

    def check(step, model, ref):
        assert model.unused.weight.grad is None and model.unused.bias.grad is None

    compare_training(rank, world, lambda: WithUnused(LlamaConfig.tiny()), _wrap(), steps=2, after_step=check)


def _meta_built(cfg, mesh, seed):
    with torch.device("meta"):
        model = Llama(cfg)
    _wrap()(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _seeded(cfg, seed):
    model = Llama(cfg)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def case_meta_init(rank, world):
    """Build on meta, wrap, materialise only the shards, init: the same values as a
    single-process model initialised with the same seed, at every W; then it trains alike."""
    from _dist import cpu_mesh, full

    cfg = LlamaConfig.tiny(tie_embeddings=True)
    ref = _seeded(cfg, 7)
    model = _meta_built(cfg, cpu_mesh(world), 7)
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.device.type == "cpu"
        local = p.to_local()
        assert local.numel() <= p.numel()
        torch.testing.assert_close(full(p), named[name], rtol=0, atol=0, msg=name)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], b)
    compare_training(rank, world, lambda: _seeded(cfg, 7),
                     lambda m, mesh: _meta_built(cfg, mesh, 7), steps=2)


CASES = [
    case_llama,
    case_llama_tied,
    case_reshard_variants,
    case_root_only,
    case_list_group_tied,
    case_grad_accum_no_sync,
    case_grad_accum_sync,
    case_activation_checkpointing,
    case_moe_separate_experts_unused,
    case_moe_fused_expert_rows,
    case_frozen_params,
    case_module_called_twice,
    case_unused_module,
    case_meta_init,
]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def results(request):
    return run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_training_matches_single_process(results, case):
    check_case(results, case)
