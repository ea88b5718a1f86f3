"""A mixture-of-experts decoder: the LLaMA block with its MLP replaced by routed experts.

Expert weights come in two forms (``MoEConfig.fused_experts``):

* separate: ``experts`` is a ModuleList of SwiGLU MLPs, one parameter per expert and matrix
  (an expert that no token picks gets no gradient at all);
* fused: three 3-D parameters ``w1 [E, H, D]``, ``w2 [E, D, H]``, ``w3 [E, H, D]`` (what
  GPT-OSS / DeepSeek checkpoints use; ``granularity_fn`` can keep each expert's matrices
  whole on one rank with ``"row"`` on dim 0).

Both compute the same function in the same order, so they can be compared. Routing is
top-k over a softmax, computed in fp32, with no token dropping.

Fused experts can be sharded over an expert-parallel mesh with
``expert_parallel.apply_expert_parallel``; the layer then sends its tokens to the experts'
ranks (``ep_dispatch``) instead of looping over all experts locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .ep_dispatch import expert_parallel_experts
from .llama import FeedForward, Llama, LlamaConfig, TransformerBlock

__all__ = ["MoEConfig", "MoE", "MoELayer", "FusedExperts"]


@dataclass
class MoEConfig(LlamaConfig):
    n_experts: int = 16
    top_k: int = 2
    expert_hidden: int = 32
    fused_experts: bool = False
    n_shared_experts: int = 0  # always-on experts (DeepSeek style), hidden = expert_hidden

    @classmethod
    def tiny(cls, **kw) -> "MoEConfig":
        base = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    max_seq_len=64, n_experts=16, top_k=2, expert_hidden=24)
        base.update(kw)
        return cls(**base)


class FusedExperts(nn.Module):
    """All experts' SwiGLU weights as three 3-D parameters."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        if self.w1.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, ep_mesh=None) -> torch.Tensor:
        """The routed experts' weighted sum for tokens ``x`` (top-k ``weights``/``chosen``).
        The weights are read only in here, so ``fully_shard(experts)`` (its own group, as
        torchtitan wraps its grouped experts) gathers them around this call."""
        if ep_mesh is not None:
            return self._expert_parallel(x, weights, chosen, ep_mesh)
        return combine_experts(self.expert, self.n_experts, x, weights, chosen)

    def _expert_parallel(self, x, weights, chosen, ep) -> torch.Tensor:
        # a DTensor Shard(0) on the ep mesh (or FSDP's unsharded parameter, which is one too):
        # its local tensor holds this rank's experts
        local = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]
        want = self.n_experts // ep.size()
        if local[0].shape[0] != want:
            raise RuntimeError(
                f"MoELayer: expert weights hold {local[0].shape[0]} local experts, expected "
                f"n_experts / ep size = {want}; were they resharded after apply_expert_parallel?")
        return expert_parallel_experts(x, weights, chosen, *local, n_experts=self.n_experts,
                                       group=ep.get_group(), ep_size=ep.size())


def combine_experts(expert, n_experts: int, x, weights, chosen) -> torch.Tensor:
    """Run each expert on the tokens that chose it and add the weighted results."""
    out = torch.zeros_like(x)
    for e in range(n_experts):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue  # unused this step: its weights get no gradient
        y = expert(e, x[rows]) * weights[rows, slot].unsqueeze(-1)
        out = out.index_add(0, rows, y)
    return out


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.n_experts = cfg.n_experts
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        if cfg.fused_experts:
            self.experts = FusedExperts(cfg.n_experts, cfg.dim, cfg.expert_hidden)
        else:
            self.experts = nn.ModuleList(FeedForward(cfg.dim, cfg.expert_hidden) for _ in range(cfg.n_experts))
        self.shared = (
            FeedForward(cfg.dim, cfg.expert_hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        # set by apply_expert_parallel; kept here, not read from the weights' mesh, because
        # FSDP may later replace the expert parameters by DTensors on a larger mesh
        self.ep_mesh = None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.experts, FusedExperts):
            return self.experts.expert(e, x)
        return self.experts[e](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if isinstance(self.experts, FusedExperts):
            out = self.experts(x, weights, chosen, self.ep_mesh)
        else:
            out = combine_experts(self._expert, self.n_experts, x, weights, chosen)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)


class MoE(Llama):
    """LLaMA decoder whose blocks use :class:`MoELayer` as their MLP."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)

    def _block(self, cfg: MoEConfig, i: int) -> nn.Module:
        return TransformerBlock(cfg, mlp=MoELayer(cfg))
