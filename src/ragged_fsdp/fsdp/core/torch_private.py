"""The private torch calls of the saved-tensor watch, one function each, with what it relies on.

The watch (``fsdp/core/backward.py``) needs three things torch documents no way to do: ask
which saved-tensor hooks are active, take its own pair off the stack and put it back out of
``with`` order (a nested group's forward pauses an outer group's watch), and tell whether
autograd saved a tensor, or a view of its storage, while the watch was off (reference
counts). Each function below names the private call it makes and the behaviour the engine
relies on. ``tests/test_torch_private.py`` checks each of those behaviours on every torch
the CI runs (2.13 and 2.15) and names the function whose contract broke.

A private call that torch no longer has raises :class:`TorchPrivateMissing`, and the engine
takes the safe branch: no watch (every unit is kept or gathered for backward, nothing is
freed early) or no pause (the outer watch stays on, one Python call per saved tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TorchPrivateMissing", "saved_tensors_hooks_top", "push_saved_tensors_hooks",
           "pop_saved_tensors_hooks", "storage_use_count", "tensor_use_count"]

Pack = Callable[[torch.Tensor], Any]
Unpack = Callable[[Any], torch.Tensor]


class TorchPrivateMissing(RuntimeError):
    """This torch lacks a private call the saved-tensor watch makes."""


def _private(owner, name: str, seam: str):
    f = getattr(owner, name, None)
    if f is None:
        raise TorchPrivateMissing(
            f"ragged_fsdp.fsdp.core.torch_private.{seam}: torch {torch.__version__} has no "
            f"{getattr(owner, '__name__', owner)}.{name}; the saved-tensor watch is off (safe, "
            f"less memory saved). tests/test_torch_private.py says what the engine relies on.")
    return f


def saved_tensors_hooks_top() -> tuple[Pack, Unpack] | None:
    """The (pack, unpack) pair autograd saves through right now, or None.

    Calls ``torch._C._autograd._top_saved_tensors_default_hooks(False)``. Relied on: it
    returns the very callables last pushed, by :func:`push_saved_tensors_hooks` or by
    ``torch.autograd.graph.saved_tensors_hooks`` (activation checkpointing's hooks are
    seen: they share one stack), so a bound method's ``__self__`` names its watch; and
    None when nothing is pushed."""
    top = _private(torch._C._autograd, "_top_saved_tensors_default_hooks", "saved_tensors_hooks_top")(False)
    return None if top is None else (top[0], top[1])


def push_saved_tensors_hooks(pack: Pack, unpack: Unpack) -> bool:
    """Put (pack, unpack) on top of autograd's saved-tensor hook stack; False, with nothing
    pushed, where the caller runs under ``torch.autograd.graph.disable_saved_tensors_hooks``.

    Calls ``torch._C._autograd._push_saved_tensors_default_hooks`` (what the public
    ``saved_tensors_hooks.__enter__`` calls). Relied on: from then on every tensor autograd
    saves goes through ``pack``, and :func:`saved_tensors_hooks_top` returns the pair; under
    ``disable_saved_tensors_hooks`` it raises RuntimeError and pushes nothing."""
    push = _private(torch._C._autograd, "_push_saved_tensors_default_hooks", "push_saved_tensors_hooks")
    try:
        push(pack, unpack)
    except RuntimeError:  # the user disabled saved-tensor hooks here: the watch stays off
        return False
    return True


def pop_saved_tensors_hooks() -> None:
    """Take the top pair off the stack (the caller checks it is its own).

    Calls ``torch._C._autograd._pop_saved_tensors_default_hooks`` (what
    ``saved_tensors_hooks.__exit__`` calls). Relied on: the pair under it is on top again,
    whoever pushed it; a pop need not come in the ``with`` order of the pushes."""
    _private(torch._C._autograd, "_pop_saved_tensors_default_hooks", "pop_saved_tensors_hooks")()


def storage_use_count(t: torch.Tensor) -> int:
    """Strong references to ``t``'s storage (one per tensor that views it, among others).

    Calls ``torch._C._storage_Use_Count(t.untyped_storage()._cdata)``. Relied on: when
    autograd saves a view of the storage (``w.t()``, a slice) that no other reference
    keeps, the count is higher while the graph holds it."""
    f = _private(torch._C, "_storage_Use_Count", "storage_use_count")
    return f(t.untyped_storage()._cdata)


def tensor_use_count(t: torch.Tensor) -> int:
    """Strong references to ``t`` itself (its TensorImpl), not to its storage.

    Calls ``torch.Tensor._use_count``. Relied on: when autograd saves ``t`` itself (a
    parameter that ``F.linear`` saves for the input's gradient), the count is higher while
    the graph holds it."""
    return _private(torch.Tensor, "_use_count", "tensor_use_count")(t)
