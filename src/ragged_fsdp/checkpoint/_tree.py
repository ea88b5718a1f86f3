"""Flattening nested state dicts exactly as DCP does, so keys we report are DCP's keys.

DCP keys are the object paths joined by dots (``{"optim": {"state": {0: {"exp_avg": t}}}}``
becomes ``optim.state.0.exp_avg``; lists are walked only when they hold tensors or
containers). torch keeps that logic in a private module; we import it in one place and fail
loudly if a future torch moves it, rather than re-deriving the rules and drifting.
"""

from __future__ import annotations

from typing import Any

try:  # torch 2.4 .. 2.13 (the version this package pins)
    from torch.distributed.checkpoint._nested_dict import (
        flatten_state_dict as _flatten,
        unflatten_state_dict as _unflatten,
    )
    from torch.distributed.checkpoint._traverse import set_element
except ImportError as e:  # pragma: no cover - only on an unsupported torch
    raise ImportError(
        "ragged_fsdp.checkpoint needs torch.distributed.checkpoint._nested_dict "
        "(torch >= 2.4); this torch does not have it"
    ) from e

__all__ = ["flatten", "unflatten", "set_element"]


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``(flat, mapping)``: DCP's dotted keys to values, and each key's object path."""
    return _flatten(state)


def unflatten(flat: dict[str, Any], mapping: dict[str, tuple]) -> dict[str, Any]:
    return _unflatten(flat, mapping)
