"""The engine side of ``fully_shard(offload_policy=...)``: host buffers per DBuffer and the
copies between them and the device, all through the device seam (:mod:`ragged_fsdp.device`).
A unit is handed its :class:`UnitOffload` (``Unit.attach_offload``) and calls it; ``core/``
does not import this layer.

One :class:`UnitOffload` per unit of a group with a policy. What it does per state:

* ``params``: at ``fully_shard`` the sharded segment moves to one host buffer (pinned on
  CUDA) and the sharded parameters become views of it. Each all-gather of the unit first
  copies the segment to a device buffer of the segment's size (``stage``, lane ``"h2d"``);
  the all-gather is ordered after that copy on the device (``after``), not on the host, and
  since the engine issues a group's all-gathers one group ahead (forward and backward
  prefetch), the copy is issued one group ahead too. The device copy is dropped as soon as
  the all-gather has been waited for (``release_staged``);
* ``grads``: when backward hands out the reduced gradient segment, it is copied to one new
  host segment per unit (lane ``"d2h"``), the sharded ``.grad`` become views of it, and the
  device segment is dropped (nothing else refers to it). A later backward that accumulates
  into host grads starts from a fresh device segment holding them.

Trace events (``ragged_fsdp.fsdp.trace()``): ``h2d`` / ``d2h`` (bytes copied, allocated at
the destination) and ``unstage`` (the device copy of a host segment freed).
"""

from __future__ import annotations

import weakref

import torch

from ragged_fsdp.dbuffer import DBuffer
from ragged_fsdp.quant.mxfp8 import MXFP8
from ragged_fsdp.quant.nvfp4 import NVFP4

from .. import tracing as trace
from ...device import Device, Pending
from ..core.init import group_of
from ..core.param_group import ParamGroup
from ..core.sharded_param import repoint
from ..core.unit import Unit
from .policy import OffloadPolicy

__all__ = ["UnitOffload", "attach", "policy_of", "host_empty"]

# group -> its offload policy; a parameter's group is found by core's one map (group_of)
_policies: "weakref.WeakKeyDictionary[object, OffloadPolicy]" = weakref.WeakKeyDictionary()


def policy_of(param) -> OffloadPolicy | None:
    """The offload policy of the group that made sharded parameter ``param``, or None."""
    group = group_of(param)
    return None if group is None else _policies.get(group)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


class UnitOffload:
    """One unit's host side under a policy."""

    def __init__(self, policy: OffloadPolicy, dev: Device):
        self.policy = policy
        self.dev = dev

    # -- params ------------------------------------------------------------------------
    def params_to_host(self, unit: Unit) -> None:
        buf = unit.buf
        host = host_empty(buf.segment, buf.dtype, bool(self.policy.pin_memory))
        self.dev.copy("d2h", host, buf.sharded).wait()
        trace.record("d2h", unit, host.numel() * host.element_size())
        buf.keep_on_host(host)
        for info in unit.infos:
            repoint(info.sharded, buf.sharded_view(info.slot))
            info.register(info.sharded)

    def stage(self, unit: Unit) -> Pending | None:
        """Copy the host segment to the device for the all-gather; returns the copy (the
        all-gather goes after it) or None when the segment is not on the host."""
        buf = unit.buf
        if not buf.host_sharded:
            return None
        staged = torch.empty(buf.segment, dtype=buf.dtype, device=buf.device)
        pending = self.dev.copy("h2d", staged, buf.sharded)
        buf.stage(staged)
        trace.record("h2d", unit, staged.numel() * staged.element_size())
        return pending

    def release_staged(self, unit: Unit) -> None:
        """Drop the device copy of the host segment once its all-gather was waited for."""
        staged = unit.buf.unstage()
        if staged is not None:
            trace.record("unstage", unit, staged.numel() * staged.element_size())

    def grads_to_host(self, unit: Unit, target: torch.Tensor) -> tuple[torch.Tensor, Pending | None]:
        """Start copying a reduced gradient segment to a new host segment (grads policy);
        returns what the sharded grads should point into and the copy to wait for."""
        if not self.policy.grads:
            return target, None
        host = host_empty(target.numel(), target.dtype, bool(self.policy.pin_memory))
        trace.record("d2h", unit, host.numel() * host.element_size())
        return host, self.dev.copy("d2h", host, target)


def attach(group: ParamGroup, policy: OffloadPolicy) -> None:
    """Give every unit of ``group`` its host side and move what lives on the host there."""
    if policy.params and group.all_gather_quant is not None and not isinstance(group.all_gather_quant, (MXFP8, NVFP4)):
        raise NotImplementedError(
            "fully_shard: offload_policy with params=True and all_gather_quant together are not "
            "implemented (the block-fp8 gather quantises the device segment; MXFP8() and NVFP4() compose with it); "
            "drop one of them")
    for u in group.units:
        if not isinstance(u.buf, DBuffer):
            raise NotImplementedError(
                "fully_shard: offload_policy is not implemented for tensor-subclass weights "
                "(fsdp_pre_all_gather / fsdp_post_all_gather, e.g. NF4 or float8): their gather "
                "inputs live in the subclass's own buffers; wrap those modules without offload_policy")
        u.attach_offload(UnitOffload(policy, group.dev))
        if policy.params:
            u.offload.params_to_host(u)
    _policies[group] = policy
