"""Refusing optimizers that cannot step with host-resident gradients or states.

Under ``OffloadPolicy(grads=True)`` or ``OffloadPolicy(optimizer_states=True)`` without
``params=True`` the parameters stay on the device and the step must run there with what
lives on the host streamed in. ``ragged_fsdp.optim.AdamW`` does that (it says so with
``streams_host_states = True``). A plain torch optimizer creates its states lazily, on the
parameter's device, inside its own step, and would read host gradients from device kernels:
it is refused at its first step, with the fix in the message, instead of silently keeping
its states on the device. (Its states can still go to the host between phases:
``offload_to_host(model, optimizer)``.)
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .staging import policy_of

__all__ = ["require_streaming_optimizers", "check_optimizer"]

_handle = []


def check_optimizer(opt: torch.optim.Optimizer) -> None:
    if getattr(opt, "streams_host_states", False):
        return
    for group in opt.param_groups:
        for p in group["params"]:
            pol = policy_of(p)
            if pol is not None and not pol.params and (pol.grads or pol.optimizer_states):
                what = "optimizer_states" if pol.optimizer_states else "grads"
                raise TypeError(
                    f"ragged_fsdp: {type(opt).__name__} cannot step on the device with its {what} on the "
                    f"host (fully_shard(offload_policy=OffloadPolicy({what}=True))). Use "
                    "ragged_fsdp.optim.AdamW, which streams them in per buffer; or offload everything "
                    "(torch's CPUOffloadPolicy: the step runs on the host); or drop the policy and call "
                    "ragged_fsdp.offload_to_host(model, optimizer) between phases")


def _pre_step(opt, args, kwargs) -> None:
    check_optimizer(opt)


def require_streaming_optimizers() -> None:
    """Install the check (once per process) on every optimizer's step."""
    if not _handle:
        _handle.append(register_optimizer_step_pre_hook(_pre_step))
