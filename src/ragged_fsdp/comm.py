"""The collectives every layer uses, in one place: the process-group handle, the torch
version seam for collective names, the backend choice, and the flat collectives on
uneven contiguous runs that the placement needs.

Why a backend choice at all: on gloo, ``reduce_scatter`` is an all-reduce underneath (each
rank moves the whole buffer twice); an ``all_to_all_single`` moves only the pieces the other
ranks own, and a local sum finishes it. NCCL has a real reduce-scatter. ``Comm.gloo`` is the
one test for that, used by the engine (``fsdp/comms/collectives.py``, equal segments of a DBuffer,
asynchronous, chunked) and by the placement (``reduce_scatter_runs`` below, uneven runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
import weakref

import torch
import torch.distributed as dist

from ragged_fsdp.shapes import contiguous_stride  # noqa: F401 - re-exported (older imports)

__all__ = [
    "Comm", "backend_of", "all_gather_single", "reduce_scatter_single", "contiguous_stride",
    "all_gather_runs", "reduce_scatter_runs", "all_to_all_flat",
]

# torch 2.13 renamed the single-tensor collectives; 2.11 (the GPU image) has the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Ranges = Sequence[tuple[int, int]]


def backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


@dataclass
class Comm:
    """A process group and how to talk on it."""

    group: dist.ProcessGroup
    world_size: int
    rank: int
    backend: str

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "Comm":
        return cls(group, dist.get_world_size(group), dist.get_rank(group), backend_of(group))

    _host: Any = field(default=None, repr=False, compare=False)

    @property
    def gloo(self) -> bool:
        return "gloo" in self.backend and "nccl" not in self.backend

    @property
    def host_group(self) -> dist.ProcessGroup:
        """A gloo group over the same ranks, for flags only the host knows: a CPU tensor
        all-reduced there needs no device-to-host copy. Made on first use, by the group's
        ranks only (``use_local_synchronization``), so every rank of the group must reach
        its first use at the same collective point; on gloo it is the group itself."""
        if self.gloo:
            return self.group
        if self._host is None:
            # one per process group, shared by every Comm on it (each fully_shard call has its own)
            host = _HOST_GROUPS.get(self.group)
            if host is None:
                ranks = dist.get_process_group_ranks(self.group)
                host = _HOST_GROUPS[self.group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            self._host = host
        return self._host


# process group -> its gloo twin for host flags (weak: a destroyed group takes its twin along)
_HOST_GROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]" = weakref.WeakKeyDictionary()


def all_to_all_flat(flat: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    """Send ``send[r]`` consecutive elements of ``flat`` to rank ``r``; receive ``recv[r]``."""
    out = flat.new_empty(sum(recv))
    if dist.get_world_size(group) == 1:
        out.copy_(flat)
        return out
    dist.all_to_all_single(out, flat.contiguous(), list(recv), list(send), group=group)
    return out


def all_gather_runs(flat: torch.Tensor, ranges: Ranges, group) -> torch.Tensor:
    """Every rank's contiguous run ``ranges[r]`` gathered into the whole flat tensor (one
    all-gather of equal-size padded pieces: gloo and NCCL need equal sizes)."""
    world = len(ranges)
    if world == 1:
        return flat.clone()
    longest = max(b - a for a, b in ranges)
    send = flat.new_zeros(longest)
    send[: flat.numel()] = flat
    recv = flat.new_empty(world * longest)
    all_gather_single(recv, send, group=group)
    pieces = recv.view(world, longest)
    return torch.cat([pieces[r, : b - a] for r, (a, b) in enumerate(ranges)])


def reduce_scatter_runs(full: torch.Tensor, ranges: Ranges, group, avg: bool) -> torch.Tensor:
    """The sum (or mean) over ranks of ``full`` (flat), this rank's run ``ranges[rank]`` of it."""
    comm = Comm.of(group)
    world, rank = comm.world_size, comm.rank
    n = ranges[rank][1] - ranges[rank][0]
    if world == 1:
        out = full[ranges[0][0]: ranges[0][1]].clone()
    elif comm.gloo:
        recv = full.new_empty(world * n)
        dist.all_to_all_single(recv, full.contiguous(), [n] * world, [b - a for a, b in ranges], group=group)
        out = recv.view(world, n).sum(0)
    else:
        longest = max(b - a for a, b in ranges)
        send = full.new_zeros(world, longest)
        for r, (a, b) in enumerate(ranges):
            send[r, : b - a] = full[a:b]
        out = full.new_empty(longest)
        reduce_scatter_single(out, send.view(-1), group=group)
        out = out[:n]
    return out / world if avg else out
