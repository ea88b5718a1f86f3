"""The named training workloads that ``ragged-fsdp bench`` and the simulator's bench check
(``sim.bench_check``) build: the same model and seed for every framework compared.

``dense`` (a small LLaMA), ``moe`` (32 fused experts per layer), ``dense-1024`` and ``dense-wide``
(parameter-dominated LLaMAs) and ``deep`` (48 small blocks); ``quick=True`` builds the same
architectures tiny, for smoke tests.
"""

from __future__ import annotations

import torch

VOCAB = {"deep": 512}  # token ids are drawn below each workload's vocabulary (2048 unless listed)


def build(kind: str, seq_len: int, quick: bool = False) -> torch.nn.Module:
    """The workload ``kind``, seeded (0) so that every framework trains the same weights."""
    torch.manual_seed(0)
    if quick:  # the same architectures, tiny
        from .llama import Llama, LlamaConfig
        from .moe import MoE, MoEConfig

        if kind == "moe":
            return MoE(MoEConfig(vocab_size=2048, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8,
                                 top_k=2, expert_hidden=16, max_seq_len=seq_len, fused_experts=True))
        if kind == "deep":
            return Llama(LlamaConfig(vocab_size=VOCAB["deep"], dim=32, n_layers=6, n_heads=4, n_kv_heads=2,
                                     ffn_hidden=64, max_seq_len=seq_len))
        if kind in ("dense", "dense-wide", "dense-1024"):
            return Llama(LlamaConfig(vocab_size=2048, dim=32 if kind == "dense" else 64, n_layers=2,
                                     n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=seq_len))
    if kind == "dense":
        from .llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                                 ffn_hidden=704, max_seq_len=seq_len))
    if kind in ("dense-wide", "dense-1024"):
        # Parameters and gradients dominate (as with activation checkpointing at scale):
        # this is where what the framework does with parameter memory shows. dense-1024 is the
        # issue-10 target workload; dense-wide (dim 512) is what earlier reports measured.
        from .llama import Llama, LlamaConfig

        if kind == "dense-wide":
            return Llama(LlamaConfig(vocab_size=2048, dim=512, n_layers=4, n_heads=8, n_kv_heads=4,
                                     ffn_hidden=1408, max_seq_len=seq_len))
        return Llama(LlamaConfig(vocab_size=2048, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8,
                                 ffn_hidden=2816, max_seq_len=seq_len))
    if kind == "deep":
        # Many small blocks: the per-block host work of the engine's hooks decides the step
        # (benchmarks/host_cost.py splits it by hook).
        from .llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=VOCAB["deep"], dim=64, n_layers=48, n_heads=4, n_kv_heads=2,
                                 ffn_hidden=128, max_seq_len=max(seq_len, 16)))
    if kind == "moe":
        # Fused 3-D experts: with separate expert modules, an expert that gets no token on
        # one rank has no gradient there, and FSDP2 then reduce-scatters a different set
        # of tensors on each rank (a collective mismatch; ragged_fsdp handles it).
        from .moe import MoE, MoEConfig

        return MoE(MoEConfig(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                             n_experts=32, top_k=2, expert_hidden=128, max_seq_len=seq_len,
                             fused_experts=True))
    raise ValueError(f"unknown model kind {kind!r}: expected dense, moe, dense-1024, dense-wide or deep")
