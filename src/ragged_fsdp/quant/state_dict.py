"""Plain values for a state dict that holds quantised weights."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dequantized_state_dict"]


def dequantized_state_dict(state_dict: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``state_dict`` with every value that has a ``dequantize(dtype)`` method (an
    :class:`~ragged_fsdp.quant.nf4.NF4Weight`, e.g. from a full state dict of a QLoRA model)
    replaced by its plain values in ``dtype`` (default: the weight's own dtype); other entries
    as they are. For exporting a QLoRA model's weights to code that knows no NF4."""
    out = {}
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor and callable(getattr(v, "dequantize", None)):
            out[k] = v.dequantize(dtype or v.dtype)
        else:
            out[k] = v
    return out
