"""``OffloadPolicy``: which of a group's states live in host memory between uses.

Three states, chosen one by one (torch's ``CPUOffloadPolicy`` is all three, torch's
``OffloadPolicy()`` none):

* ``params``: the sharded parameters live on the host; each unit's shard is copied to the
  device right before its all-gather (issued with it, so one group ahead, as the engine
  prefetches all-gathers) and the device copy is freed once the all-gather finished. The
  optimizer then steps on the host, which needs the gradients and states there too: so
  ``params=True`` requires ``grads=True`` and ``optimizer_states=True`` (what torch's
  policy does);
* ``grads``: each reduced gradient shard is copied to the host at the end of backward and the
  device segment freed; the sharded ``.grad`` are views of one host segment per buffer. On a
  CUDA mesh only with ``params=True`` (torch checks that a ``.grad`` is on its parameter's
  device type); alone it runs on a CPU mesh with host copies forced (the tests);
* ``optimizer_states``: the optimizer's states live on the host and ``ragged_fsdp.optim.AdamW``
  steps on the device, streaming each buffer's states (and host gradients) in and out one
  buffer ahead. Other optimizers are refused at their first step (see
  :mod:`.optimizers`).

This module is the pure part: the policy, its checks, and the test-only switch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["OffloadPolicy", "resolve_offload", "force_host_copies", "host_copies_forced"]

# Test-only: on a CPU mesh "host" and "device" are the same memory, so a policy moves
# nothing. With this switch (or RAGGED_FSDP_FORCE_HOST_COPIES=1) the host buffers are
# separate CPU storages and every copy really happens, so the CPU tests walk the GPU path.
_forced = [os.environ.get("RAGGED_FSDP_FORCE_HOST_COPIES") == "1"]


def force_host_copies(on: bool = True) -> None:
    """Test-only: make offload policies copy between separate CPU storages on a CPU mesh."""
    _forced[0] = bool(on)


def host_copies_forced() -> bool:
    return _forced[0]


@dataclass(frozen=True)
class OffloadPolicy:
    """Which states of a ``fully_shard`` group live in host memory (see the module docstring).

    ``pin_memory``: page-locked host buffers (needed for copies that overlap compute on
    CUDA). ``None`` (default): pinned on a CUDA mesh. ``True`` on a mesh without CUDA is an
    error (there is no device copy to speed up)."""

    params: bool = False
    grads: bool = False
    optimizer_states: bool = False
    pin_memory: bool | None = None

    def __post_init__(self):
        for name in ("params", "grads", "optimizer_states"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"OffloadPolicy: {name} must be True or False, got {type(v).__name__} {v!r}")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise TypeError(f"OffloadPolicy: pin_memory must be True, False or None, got {self.pin_memory!r}")
        if self.params and not (self.grads and self.optimizer_states):
            raise ValueError(
                "OffloadPolicy: params=True steps the optimizer on the host, so the gradients and "
                "optimizer states must be there too; pass params=True, grads=True, optimizer_states=True "
                "(torch's CPUOffloadPolicy), or offload only grads and/or optimizer_states")

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer_states


def resolve_offload(policy, device: torch.device) -> OffloadPolicy | None:
    """``fully_shard``'s ``offload_policy`` as an :class:`OffloadPolicy` that moves something
    on ``device`` (the mesh's), or None when nothing moves."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy

    forced = host_copies_forced()
    if isinstance(policy, CPUOffloadPolicy):
        if device.type == "cpu" and not forced:
            # accepted as before: on a CPU mesh everything already lives on the host (torch's
            # default pin_memory=True has nothing to pin for)
            return None
        pin = bool(policy.pin_memory) and device.type == "cuda"
        return OffloadPolicy(params=True, grads=True, optimizer_states=True, pin_memory=pin)
    if isinstance(policy, OffloadPolicy):
        if policy.pin_memory and device.type != "cuda":
            raise ValueError(
                f"fully_shard: offload_policy={policy} asks for pinned host memory on a {device.type} "
                "mesh; pinning only helps copies to a CUDA device: pass pin_memory=False (or None)")
        if not policy.any:
            return None
        if device.type == "cpu" and not forced:
            return None  # host and device are the same memory
        if policy.grads and not policy.params and device.type != "cpu":
            # torch refuses a .grad on another device type than its parameter's, and the
            # sharded parameters stay on the device here
            raise NotImplementedError(
                f"fully_shard: offload_policy={policy}: host gradients of parameters that stay on the "
                f"{device.type} device cannot be their .grad (torch checks the gradient's device); pass "
                "grads=True only together with params=True and optimizer_states=True (torch's "
                "CPUOffloadPolicy), or offload optimizer_states alone")
        pin = device.type == "cuda" if policy.pin_memory is None else policy.pin_memory
        return OffloadPolicy(policy.params, policy.grads, policy.optimizer_states, pin)
    if type(policy) is TorchOffloadPolicy:
        return None
    raise TypeError(
        f"fully_shard: offload_policy must be a ragged_fsdp.OffloadPolicy, torch's CPUOffloadPolicy or "
        f"OffloadPolicy(), got {type(policy).__name__}")
