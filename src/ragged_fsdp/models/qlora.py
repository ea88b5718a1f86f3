"""QLoRA on the LLaMA-style model: frozen NF4 base weights plus trainable low-rank adapters.

``qlora(model, rank=8)`` replaces every attention and feed-forward ``nn.Linear`` by a
:class:`LoRALinear` whose ``weight`` is an :class:`~ragged_fsdp.quant.nf4.NF4Weight` (frozen)
and whose adapters ``lora_a`` (``rank x in``) and ``lora_b`` (``out x rank``, zero at start, as
in LoRA) are ``adapter_dtype`` parameters computed in fp32. Every other parameter is frozen.
``base=`` chooses how a weight becomes NF4 (default: :meth:`NF4Weight.from_float`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ragged_fsdp.quant.nf4 import NF4Weight

__all__ = ["LoRALinear", "qlora"]


class LoRALinear(nn.Module):
    def __init__(self, weight: torch.Tensor, rank: int, alpha: float, adapter_dtype: torch.dtype, seed: int):
        super().__init__()
        out_f, in_f = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        g = torch.Generator().manual_seed(seed)
        a = torch.empty(rank, in_f)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        self.lora_a = nn.Parameter(a.to(adapter_dtype))
        self.lora_b = nn.Parameter(torch.zeros(out_f, rank, dtype=adapter_dtype))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # computed in fp32, returned in the caller's dtype (bf16 under param_dtype=bf16)
        x = x.float()
        base = F.linear(x, self.weight)  # NF4: dequantised to fp32 for the product
        out = base + F.linear(F.linear(x, self.lora_a.float()), self.lora_b.float()) * self.scale
        return out.to(dtype)


def qlora(model: nn.Module, rank: int = 8, alpha: float = 16.0, adapter_dtype: torch.dtype = torch.bfloat16,
          base: Callable[[torch.Tensor], torch.Tensor] | None = None, seed: int = 0) -> nn.Module:
    """Turn ``model``'s attention and feed-forward linears into :class:`LoRALinear` (in place)."""
    make = base or (lambda w: NF4Weight.from_float(w.detach().float()))
    for p in model.parameters():
        p.requires_grad_(False)
    k = 0
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None and name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
                setattr(mod, name, LoRALinear(make(child.weight), rank, alpha, adapter_dtype, seed + k))
                k += 1
    return model
