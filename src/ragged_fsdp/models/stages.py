"""A pipeline stage of the reference Llama, for torch.distributed.pipelining."""

from __future__ import annotations

import torch
import torch.nn as nn

from .llama import Llama

__all__ = ["LlamaStage"]


class LlamaStage(nn.Module):
    """Blocks ``lo..hi-1`` of ``whole``, with the embedding on the first stage and the norm and
    head on the last. The modules are shared with ``whole`` and keep its parameter names
    (``layers.<i>...``), so a stage's state dict lines up with the whole model's and a
    single-process reference can be compared name by name."""

    def __init__(self, whole: Llama, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = whole.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): whole.layers[i] for i in range(lo, hi)})
        self.norm = whole.norm if last else None
        self.output = whole.output if last else None
        self.register_buffer("rope_cos", whole.rope_cos, persistent=False)
        self.register_buffer("rope_sin", whole.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h)) if self.output is not None else h
