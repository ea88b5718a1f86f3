"""The simulator's per-block activation count against what a real block keeps for backward
(MemTracker), on one process and under TP 2 with sequence parallelism (torchtitan's Llama
plan), with no checkpointing and with torchtitan's per-op selective policy (one launch of
two gloo ranks), and under ``torch.compile`` on one process (inductor's partitioner decides
what is kept; read with saved-tensor hooks). Exact up to the RoPE tables (not per token)."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from _dist import check_case, run_cases

TOL = 0.01  # the RoPE tables and the lse rounding: ~0.5% of a block here


def _op_policy():
    """torchtitan's per-op SAC policy: save mm (every second one recomputed), attention,
    reduce-scatter and max outputs."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.max.default}
    count = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            count[mode] += 1
        keep = func in save and not (func == aten.mm.default and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _tp_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return {"attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


def _measure(rank, world, tp, mode):
    """Bytes one block keeps after its forward (beyond its input and output) on this rank."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import checkpoint

    from ragged_fsdp.models.llama import LlamaConfig, TransformerBlock, rope_tables

    cfg = LlamaConfig(dim=128, n_heads=8, n_kv_heads=4, ffn_hidden=352, max_seq_len=48)
    B, T = 2, 48
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta)
    torch.manual_seed(0)
    blk = TransformerBlock(cfg).to(torch.bfloat16)
    x = torch.randn(B, T, cfg.dim, dtype=torch.bfloat16)
    if tp > 1:
        parallelize_module(blk, init_device_mesh("cpu", (world,)), _tp_plan())
        x = x[:, rank * T // tp:(rank + 1) * T // tp].clone()  # sequence-parallel residual stream
    x.requires_grad_()
    mt = MemTracker()
    mt.track_external(blk, x, cos, sin)
    with mt:
        before = sum(d["Total"] for d in mt.get_tracker_snapshot("current").values())
        if mode == "op":
            y = checkpoint(blk, x, cos, sin, use_reentrant=False, context_fn=_op_policy)
        else:
            y = blk(x, cos, sin)
        held = sum(d["Total"] for d in mt.get_tracker_snapshot("current").values()) - before - y.numel() * 2
    return held, cfg, B * T


def _predicted(cfg, tokens, tp, mode, compiled=False):
    from ragged_fsdp.sim.activations import saved_bytes_per_token
    from ragged_fsdp.sim.arch import Arch

    h, hd, kv = cfg.dim, cfg.head_dim, cfg.kv_heads * cfg.head_dim
    # the block's matmuls in the order they run (w1, w3, w2), as the policy counts them
    tensors = [("layers.0.attention.wq.weight", (cfg.n_heads * hd, h)), ("layers.0.attention.wk.weight", (kv, h)),
               ("layers.0.attention.wv.weight", (kv, h)), ("layers.0.attention.wo.weight", (h, cfg.n_heads * hd)),
               ("layers.0.feed_forward.w1.weight", (cfg.hidden, h)), ("layers.0.feed_forward.w3.weight", (cfg.hidden, h)),
               ("layers.0.feed_forward.w2.weight", (h, cfg.hidden))]
    arch = Arch("block", [("layers.0", tensors)], 1, h, cfg.vocab_size, cfg.n_heads, hd, hd, kv, cfg.hidden)
    got = saved_bytes_per_token(arch, tensors, False, mode, 0, 2, tp, compiled) * tokens
    if mode == "op" or compiled:  # the block's input, kept too, is allocated before the block
        got -= h * 2 * tokens / tp
    return got


def _case(rank, world, mode):
    for tp in (1, world):
        held, cfg, tokens = _measure(rank, world, tp, mode)
        want = _predicted(cfg, tokens, tp, mode)
        assert abs(held / want - 1) < TOL, (mode, tp, held, want)


def case_no_checkpointing(rank, world):
    _case(rank, world, "none")


def case_per_op_sac(rank, world):
    _case(rank, world, "op")


CASES = [case_no_checkpointing, case_per_op_sac]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_activation_count_matches_memtracker(results, case):
    check_case(results, case)


@pytest.mark.parametrize("mode", ["none", "op"])
def test_compiled_block_activation_count(mode):
    """Under torch.compile the norms' fp32 copies and SwiGLU's activation are recomputed, and
    per-op SAC's saved outputs that backward never reads are dropped (CPU inductor)."""
    from torch.utils.checkpoint import checkpoint

    from ragged_fsdp.models.llama import LlamaConfig, TransformerBlock, rope_tables

    cfg = LlamaConfig(dim=128, n_heads=8, n_kv_heads=4, ffn_hidden=352, max_seq_len=48)
    B, T = 2, 48
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta)
    torch.manual_seed(0)
    blk = TransformerBlock(cfg).to(torch.bfloat16)
    if mode == "op":
        fn = torch.compile(lambda x: checkpoint(blk, x, cos, sin, use_reentrant=False, context_fn=_op_policy))
    else:
        fn = torch.compile(lambda x: blk(x, cos, sin))
    x = torch.randn(B, T, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in [*blk.parameters(), cos, sin, x]}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    held = sum(kept.values())
    want = _predicted(cfg, B * T, 1, mode, compiled=True)
    assert abs(held / want - 1) < TOL, (mode, held, want)
    # and it is not the eager count
    assert held < 0.9 * _predicted(cfg, B * T, 1, mode)
