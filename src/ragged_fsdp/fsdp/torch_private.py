"""Every private torch call of the engine, one function each, with what it relies on.

The engine needs a few things torch documents no way to do:

* the saved-tensor watch (``fsdp/core/backward.py``): ask which saved-tensor hooks are
  active, take its own pair off the stack and put it back out of ``with`` order (a nested
  group's forward pauses an outer group's watch), and tell whether autograd saved a tensor,
  or a view of its storage, while the watch was off (reference counts);
* the collectives (``fsdp/comms/``): put a gathered buffer's version counter back where it
  was, so autograd does not see the all-gather as an in-place change of the parameters it
  saved, and count a custom comm's tensor's storage references before adopting its memory;
* the hooks and the trace (``fsdp/core/``, ``fsdp/tracing.py``): tell whether the autograd
  engine is running (activation-checkpoint recomputation, events recorded in backward), and
  queue the end-of-backward callback.

It also re-exports the names of torch's private modules the engine uses as they are (pytree,
``DTensorSpec``, the composable contract's ``STATE_KEY``), so no other engine module imports
a private torch module (``tests/test_torch_private_names.py`` checks it). The engine reads a
few private *attributes* of public objects besides (a DTensor's ``_local_tensor`` and
``_spec``, a tensor's ``_version``, a module's ``_apply`` and state-dict hook registration);
that test lists them, and a new one fails it.

Each function below names the private call it makes and the behaviour the engine relies on.
``tests/test_torch_private.py`` checks each of those behaviours on every torch the CI runs
(2.13 and 2.15) and names the function whose contract broke. This module is the lowest layer
of ``ragged_fsdp.fsdp`` (``tests/_layers.py``): every layer of the engine may call it, and it
imports nothing of the engine.

A private call that torch no longer has raises :class:`TorchPrivateMissing`. The watch's
callers take the safe branch: no watch (every unit is kept or gathered for backward, nothing
is freed early) or no pause (the outer watch stays on, one Python call per saved tensor).
The other callers have no such branch: the error names the call and stops the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

try:
    from torch.distributed._composable.contract import STATE_KEY
except ImportError:  # pragma: no cover - a torch without the composable contract
    STATE_KEY = None

__all__ = ["DTensorSpec", "tree_flatten", "tree_map", "tree_unflatten", "STATE_KEY", "queue_callback",
           "TorchPrivateMissing", "saved_tensors_hooks_top", "push_saved_tensors_hooks",
           "pop_saved_tensors_hooks", "storage_use_count", "tensor_use_count", "set_version_counter",
           "graph_task_id", "in_backward", "preserve_version_counter", "swap_storage", "has_swap_storage"]

Pack = Callable[[torch.Tensor], Any]
Unpack = Callable[[Any], torch.Tensor]

_WATCH_OFF = "the saved-tensor watch is off (safe, less memory saved)"


class TorchPrivateMissing(RuntimeError):
    """This torch lacks a private call the engine makes."""


def _private(owner, name: str, seam: str, consequence: str = _WATCH_OFF):
    f = getattr(owner, name, None)
    if f is None:
        raise TorchPrivateMissing(
            f"ragged_fsdp.fsdp.torch_private.{seam}: torch {torch.__version__} has no "
            f"{getattr(owner, '__name__', owner)}.{name}; {consequence}. "
            f"tests/test_torch_private.py says what the engine relies on.")
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
    keeps, the count is higher while the graph holds it; and a tensor only one local
    variable holds has the same count as any other such tensor (a custom comm's tensor whose
    memory ``fsdp/comms/custom.py`` may adopt)."""
    f = _private(torch._C, "_storage_Use_Count", "storage_use_count",
                 _WATCH_OFF + ", and a custom all-gather's memory is never adopted (safe: gathered into "
                 "the comm's tensor and copied out)")
    return f(t.untyped_storage()._cdata)


def tensor_use_count(t: torch.Tensor) -> int:
    """Strong references to ``t`` itself (its TensorImpl), not to its storage.

    Calls ``torch.Tensor._use_count``. Relied on: when autograd saves ``t`` itself (a
    parameter that ``F.linear`` saves for the input's gradient), the count is higher while
    the graph holds it."""
    return _private(torch.Tensor, "_use_count", "tensor_use_count")(t)


def set_version_counter(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Set each tensor's version counter to the matching value (read before with the public
    ``t._version``).

    Calls ``torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))``.
    Relied on: afterwards ``t._version`` is that value, so a tensor autograd saved before an
    in-place write into its memory (a collective's output, written when the op is issued and,
    on gloo, again when its work is waited on) unpacks in backward without the "modified by
    an inplace operation" error, and views of the tensor share the restored counter."""
    f = _private(torch._C._autograd, "_unsafe_set_version_counter", "set_version_counter",
                 "the collectives cannot hide their writes from autograd")
    f(tuple(tensors), tuple(versions))


def graph_task_id() -> int:
    """The id of the backward pass the autograd engine runs on this thread, or -1.

    Calls ``torch._C._current_graph_task_id()``. Relied on: -1 outside backward (forward,
    the optimizer step, between steps), and not -1 while the engine runs a node or a hook of
    a backward pass on this thread (a tensor hook, a ``torch.autograd.Function.backward``,
    the forward that non-reentrant activation checkpointing recomputes)."""
    return _private(torch._C, "_current_graph_task_id", "graph_task_id",
                    "the engine cannot tell forward from backward")()


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (activation-
    checkpoint recomputation, hooks in backward): ``graph_task_id() != -1``."""
    return graph_task_id() != -1


def preserve_version_counter(t: torch.Tensor):
    """A context manager under which in-place writes into ``t`` leave its version counter
    where it was on entry.

    Calls ``torch.autograd._unsafe_preserve_version_counter(t)``. Relied on: after the
    ``with`` block ``t._version`` equals its value at entry whatever was written into ``t``
    inside (the all-gather writing the unsharded parameters when it is issued), so autograd
    does not see the collective as an in-place change of a tensor it saved."""
    return _private(torch.autograd, "_unsafe_preserve_version_counter", "preserve_version_counter",
                    "the collectives cannot hide their writes from autograd")(t)


def has_swap_storage() -> bool:
    """Whether this torch can exchange two storages' memory (:func:`swap_storage`)."""
    return getattr(torch.UntypedStorage, "_swap_data_ptr_", None) is not None


def swap_storage(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages of the same size in place.

    Calls ``torch.UntypedStorage._swap_data_ptr_(a, b)``. Relied on: afterwards every tensor
    viewing ``a`` reads what ``b`` held and the reverse, with no copy, and each storage keeps
    its own identity (views made of ``a`` before the swap are still views of ``a``). A custom
    all-gather's own tensor becomes the memory the unsharded parameters view
    (``fsdp/comms/custom.py``); callers check :func:`has_swap_storage` first."""
    _private(torch.UntypedStorage, "_swap_data_ptr_", "swap_storage",
             "a custom all-gather's memory is never adopted (gathered into the comm's tensor and copied out)")(a, b)


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the autograd engine finishes the current backward pass.

    Calls ``torch.autograd.Variable._execution_engine.queue_callback(fn)`` (what torch's own
    FSDP2 calls). Relied on: called from inside a backward pass (a hook), ``fn`` runs on this
    thread after every node and hook of that pass, before ``backward()`` returns."""
    _private(torch.autograd.Variable._execution_engine, "queue_callback", "queue_callback",
             "the end-of-backward reduction cannot run")(fn)
