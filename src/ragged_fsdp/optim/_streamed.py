"""An optimizer step on the device over states (and gradients) that live on the host.

Under ``fully_shard(offload_policy=OffloadPolicy(optimizer_states=True))`` (and/or
``grads=True``) the parameters stay on the device. Per step, the parameters are taken one
*bucket* at a time, a bucket being the parameters of one DBuffer (one parameter storage)
whose host tensors share one storage each: for each host operand (a state, the gradients)
the bucket's span of its host storage is one copy to the device (lane ``"h2d"``), the step
runs on the device copies, and each state span is one copy back (lane ``"d2h"``). The copy
in of bucket ``k + 1`` is issued before bucket ``k`` is stepped, and at most two buckets'
copies back are in flight, so the device holds the host operands of about three buckets,
never the whole model's.

The arithmetic is the caller's (``step(bucket_indices, operands)``) on plain device
tensors laid out as on the host, so the bits are those of the same step with everything on
the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from ragged_fsdp.device import Device, Pending

__all__ = ["step_streamed"]


def _flat_of(t: torch.Tensor) -> torch.Tensor:
    s = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(s, 0, (s.nbytes() // t.element_size(),), (1,))


class _Span:
    """One host operand of one bucket, copied to the device as one range."""

    def __init__(self, dev: Device, tensors: Sequence[torch.Tensor], device: torch.device):
        base = _flat_of(tensors[0])
        self.lo = min(t.storage_offset() for t in tensors)
        hi = max(t.storage_offset() + t.numel() for t in tensors)
        self.host = base.narrow(0, self.lo, hi - self.lo)
        self.dev_flat = torch.empty(hi - self.lo, dtype=base.dtype, device=device)
        self.copy_in: Pending = dev.copy("h2d", self.dev_flat, self.host)
        self.views = [self.dev_flat.narrow(0, t.storage_offset() - self.lo, t.numel()).view(t.shape) for t in tensors]
        # the span holds nothing but the bucket's tensors (flat states are packed per buffer)
        self.tight = sum(t.numel() for t in tensors) == hi - self.lo
        self.tensors = list(tensors)

    def copy_back(self, dev: Device) -> list[Pending]:
        if self.tight:
            return [dev.copy("d2h", self.host, self.dev_flat)]
        # other tensors sit between the bucket's in the host storage: never overwrite them
        return [dev.copy("d2h", t, v) for t, v in zip(self.tensors, self.views)]


def step_streamed(dev: Device, device: torch.device, buckets: list[list[int]],
                  operands: dict[str, list[torch.Tensor]], host: dict[str, bool], write_back: set[str],
                  step: Callable[[list[int], dict[str, list[torch.Tensor]]], None]) -> dict:
    """Run ``step`` per bucket with every ``host[name]`` operand staged on ``device``.

    ``operands[name][i]`` is the local tensor of operand ``name`` of parameter ``i``;
    ``buckets`` lists parameter indices whose host operands share one storage each (see
    :func:`buckets_of`); operands in ``write_back`` are copied back to the host after the
    bucket's step. Returns ``{"buckets", "bytes_in", "bytes_out"}``."""
    stats = {"buckets": len(buckets), "bytes_in": 0, "bytes_out": 0}

    def stage(b: list[int]) -> dict[str, _Span]:
        spans = {}
        for name, on_host in host.items():
            if on_host:
                sp = spans[name] = _Span(dev, [operands[name][i] for i in b], device)
                stats["bytes_in"] += sp.dev_flat.numel() * sp.dev_flat.element_size()
        return spans

    back: deque[Pending] = deque()
    nxt = stage(buckets[0]) if buckets else None
    for k, b in enumerate(buckets):
        spans, nxt = nxt, (stage(buckets[k + 1]) if k + 1 < len(buckets) else None)
        for sp in spans.values():
            sp.copy_in.wait()
        ops = {name: (spans[name].views if name in spans else [operands[name][i] for i in b]) for name in operands}
        step(b, ops)
        for name, sp in spans.items():
            if name in write_back:
                back.extend(sp.copy_back(dev))
                stats["bytes_out"] += sp.dev_flat.numel() * sp.dev_flat.element_size()
        del spans, ops
        while len(back) > 2:
            back.popleft().wait()
    while back:
        back.popleft().wait()
    return stats


def buckets_of(operands: dict[str, list[torch.Tensor]], n: int) -> list[list[int]]:
    """Parameter indices grouped by the storages of all their operands (a bucket is one
    DBuffer's parameters with one state buffer and one gradient segment each), in first-seen
    order."""
    out: dict[tuple, list[int]] = {}
    for i in range(n):
        key = tuple(ts[i].untyped_storage().data_ptr() for ts in operands.values())
        out.setdefault(key, []).append(i)
    return list(out.values())
