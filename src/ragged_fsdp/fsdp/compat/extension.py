"""FSDP2's extension points on ragged_fsdp modules: forward methods and the four comm hooks.

Each hook has torch 2.13's FSDP2 signature and meaning, translated to this design's unit
of communication: **one collective per DBuffer**. A group (one ``fully_shard`` call) holds
one DBuffer per (mesh, dtype, trainability, ...) kind of parameter, and every collective
moves a whole flat buffer (FSDP2 moves the concatenation of a group's padded parameters,
which is the same idea; here the buffer's layout is the planner's, not dim-0 chunks).

* ``set_custom_all_gather(comm)``: ``comm.allocate((W*S,), dtype=, device=)`` gives the
  unsharded buffer's memory and ``comm(output_tensor=, input_tensor=, group=, async_op=)``
  fills it from every rank's ``S``-element segment.
* ``set_custom_reduce_scatter(comm)``: ``comm.allocate`` gives the unsharded gradient buffer
  (``W*S``, the reduce dtype, autograd accumulates into it) and the reduced segment, and
  ``comm(output_tensor=, input_tensor=, group=, op=ReduceOp.SUM, async_op=)`` sums it over
  the shard dim; the engine divides afterwards.
* ``set_all_reduce_hook(hook, stream=)``: ``hook(segment)`` on each buffer's reduced
  gradient segment, in place, after the divide factor.
* ``set_post_optim_event(event)``: the next all-gather of every buffer under the root waits
  on ``event`` instead of the compute stream.

The settings live in one :class:`CommHooks` per group, shared with its units; the engine's
collectives (``comms/collectives.py``, ``core/reduction.py``) read them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["CommHooks", "HOOK_LANE", "register_fsdp_forward_method", "check_comm", "check_hook", "check_event",
           "check_stream", "adopt_memory", "checked_work", "run_all_reduce_hook"]


HOOK_LANE = "all_reduce_hook"  # the device lane set_all_reduce_hook(stream=...) binds to the user's stream


@dataclass
class CommHooks:
    """One group's custom comms and hook (None: the engine's own)."""

    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    hook_stream: Any = None  # the stream the hook runs on (CUDA, FSDP only)

    def allocate_grad(self) -> Callable[[int, torch.dtype, torch.device], torch.Tensor] | None:
        rs = self.reduce_scatter
        if rs is None:
            return None
        return lambda n, dtype, device: checked_alloc(rs, "set_custom_reduce_scatter", n, dtype, device)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like ``forward`` for FSDP: its parameters are
    all-gathered before the method and resharded after (as ``reshard_after_forward`` says).

    Use it for methods that compute with the module's own parameters without calling
    ``forward`` (``generate`` in RL rollouts: it calls the embedding, the blocks and the
    head directly). The blocks, if wrapped themselves, gather on their own forward; the
    root's parameters (embedding, head) are what this registration gathers. The same as
    ``torch.distributed.fsdp.register_fsdp_forward_method`` (which works on ragged_fsdp
    modules too: it calls our state's ``_pre_forward``/``_post_forward``); a module that
    ``fully_shard`` did not wrap is left as it is, as in torch."""
    if not isinstance(method_name, str):
        raise TypeError(f"register_fsdp_forward_method: method_name must be a str, got {type(method_name).__name__}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_fsdp_forward_method: module must be an nn.Module, got {type(module).__name__}")
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    if not callable(getattr(module, method_name, None)) and hasattr(module, method_name):
        raise TypeError(f"register_fsdp_forward_method: {type(module).__name__}.{method_name} is not a method")
    torch_register(module, method_name)


# -- validation (errors name the method and the parameter) -----------------------------------

def check_comm(method: str, comm, kind: str) -> None:
    if comm is None:
        return
    missing = [n for n in ("allocate", "__call__") if not callable(getattr(comm, n, None))]
    if missing:
        raise TypeError(
            f"{method}: comm must be a torch.distributed.fsdp {kind} (an object with allocate(size, *, dtype, "
            f"device) and __call__); {type(comm).__name__} has no callable {' or '.join(missing)}. Subclass "
            f"torch.distributed.fsdp._fully_shard._fsdp_api.{kind} or add the missing method")


def check_hook(hook) -> None:
    if hook is not None and not callable(hook):
        raise TypeError(
            f"set_all_reduce_hook: hook must be callable as hook(reduce_output: torch.Tensor) -> None, "
            f"got {type(hook).__name__}")


def checked_work(method: str, work, async_op: bool):
    """What a custom comm returned: for ``async_op=True`` the collective's work handle (or
    None when it finished before returning), waited for later; anything else would break
    that wait, after the unshard or reduction already started."""
    if async_op and work is not None and not callable(getattr(work, "wait", None)):
        raise TypeError(
            f"{method}: the comm returned {type(work).__name__} for async_op=True; return the collective's "
            "torch.distributed Work (what dist.all_gather_into_tensor(..., async_op=True) returns), or None "
            "if it has already finished")
    return work


def run_all_reduce_hook(hook: Callable[[torch.Tensor], None], segment: torch.Tensor) -> None:
    """Run the ``set_all_reduce_hook`` hook on a reduced segment: it works in place, so a
    hook that resizes or replaces the segment's memory is named here, not found later as a
    shape error in the copy into the gradients."""
    numel, dtype, ptr = segment.numel(), segment.dtype, segment.untyped_storage().data_ptr()
    hook(segment)
    if segment.numel() != numel or segment.dtype != dtype or segment.untyped_storage().data_ptr() != ptr:
        raise RuntimeError(
            f"set_all_reduce_hook: the hook changed the reduced gradient segment it was given ({numel} elements "
            f"of {dtype}) to {segment.numel()} elements of {segment.dtype}{' in other memory' if segment.numel() == numel else ''}; "
            "it must modify the tensor in place (e.g. dist.all_reduce(t) or t.div_(n)), keeping its size, dtype "
            "and storage")


def check_stream(stream, hsdp: bool) -> None:
    if stream is None:
        return
    duck = all(callable(getattr(stream, n, None)) for n in ("wait_stream", "wait_event", "record_event"))
    if not (isinstance(stream, torch.Stream) or duck):
        raise TypeError(f"set_all_reduce_hook: stream must be a torch.cuda.Stream (or None), got {type(stream).__name__}")
    if hsdp:
        raise ValueError(
            "set_all_reduce_hook: stream cannot be set when using HSDP (the hook runs on the replicate-dim "
            "all-reduce's own stream, after it); pass stream=None")


def check_event(event) -> None:
    duck = all(callable(getattr(event, n, None)) for n in ("wait", "synchronize"))  # torch.cuda.Event
    if not (isinstance(event, torch.Event) or duck):
        raise TypeError(
            f"set_post_optim_event: event must be a torch.Event (or torch.cuda.Event) recorded after the "
            f"optimizer step, got {type(event).__name__}")


def checked_alloc(comm, method: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = comm.allocate((n,), dtype=dtype, device=device)
    if not isinstance(t, torch.Tensor) or t.numel() != n or t.dtype != dtype or t.device != device \
            or not t.is_contiguous():
        got = (f"shape {tuple(t.shape)}, {t.dtype}, {t.device}, contiguous={t.is_contiguous()}"
               if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ValueError(
            f"{method}: {type(comm).__name__}.allocate(({n},), dtype={dtype}, device={device}) must return a "
            f"contiguous tensor of {n} elements of that dtype on that device; got {got}")
    return t


_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def _refs(flat, t) -> tuple[int, int]:
    return sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _probe(flat, t) -> tuple[int, int]:  # the same call depth as adopt_memory's check
    return _refs(flat, t)


def _baseline() -> tuple[int, int]:
    t = torch.empty(1)  # held by one local, as adopt_memory's caller holds the comm's tensor
    return _probe(None, t)


_SOLE = _baseline()  # (references, storage uses) of a tensor only its caller holds


def adopt_memory(flat: torch.Tensor, t: torch.Tensor) -> bool:
    """Move the memory of ``t`` (fresh from a comm's ``allocate``; the caller holds it in
    one local variable) into ``flat``'s storage, whose views the unsharded parameters are,
    so the collective writes straight into them. Only when nothing else holds ``t`` or its
    storage and it starts at its storage's first byte: a comm that hands out a persistent
    buffer of its own keeps it, and the caller gathers into it and copies out."""
    if _swap is None or t.storage_offset() != 0 or _refs(flat, t) != _SOLE:
        return False
    _swap(flat.untyped_storage(), t.untyped_storage())
    return True
