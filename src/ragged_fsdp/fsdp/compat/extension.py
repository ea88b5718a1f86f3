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

The settings live in one :class:`~..comms.custom.CommHooks` per group, shared with its units;
the engine's collectives read them there (``comms/`` is below this layer). This module checks
what the user passes to the setters and registers forward methods.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["register_fsdp_forward_method", "check_comm", "check_hook", "check_event", "check_stream"]


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


# -- validation of the setters' arguments (errors name the method and the parameter) --------

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
