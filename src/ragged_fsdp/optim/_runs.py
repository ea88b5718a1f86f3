"""Contiguous runs: which parameters an optimizer can step as one flat range.

A ragged_fsdp group's sharded parameters are views of one flat segment, their gradients views
of one flat gradient segment, and the grouped optimizers' states views of flat state buffers
packed in the same order. Parameters that sit next to each other in *every* one of those
storages (and share everything that decides the arithmetic: hyperparameters, step count,
dtype) can be updated with one op per chunk over the concatenated range instead of one op per
parameter. This module finds those runs from storage addresses alone (pure: no process group,
no tensor data is read), so it works for any layout and degrades to runs of one parameter
when gradients or states are separate tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Member", "Run", "contiguous_runs", "member_of", "where_of", "flat_view"]


@dataclass(frozen=True)
class Member:
    """One tensor family (parameter, gradient, states) of one parameter, by address.

    ``where[k]`` is ``(storage key, start, end)`` (element offsets) of the k-th tensor of the
    family (the parameter first; per-block states span fewer elements than the parameter),
    ``tag`` what must be equal along a run (hyperparameters, step, dtype), and ``closes`` says
    nothing may follow this member in a run (e.g. it ends inside a quantisation block).
    """

    index: int
    numel: int
    where: tuple[tuple[Hashable, int, int], ...]
    tag: Hashable = None
    closes: bool = False

    def with_tag(self, tag: Hashable) -> "Member":
        return Member(self.index, self.numel, self.where, tag, self.closes)


@dataclass(frozen=True)
class Run:
    """Parameters ``indices`` (in storage order) forming one flat range of ``numel`` elements."""

    indices: tuple[int, ...]
    numel: int


def contiguous_runs(members: Sequence[Member]) -> list[Run]:
    """Group members into maximal runs that are adjacent in every storage, in order.

    Members of zero elements are left out (nothing to compute); each other member is in exactly
    one run.
    """
    rank: dict = {}  # storages in order of first appearance (keys themselves do not sort)
    for m in members:
        rank.setdefault(m.where[0][0], len(rank))
    live = sorted((m for m in members if m.numel > 0), key=lambda m: (rank[m.where[0][0]], m.where[0][1], m.index))
    runs: list[Run] = []
    cur: list[Member] = []
    for m in live:
        prev = cur[-1] if cur else None
        if prev is not None and not prev.closes and m.tag == prev.tag and len(m.where) == len(prev.where) and all(
            w[0] == e[0] and w[1] == e[2] for w, e in zip(m.where, prev.where)
        ):
            cur.append(m)
        else:
            if cur:
                runs.append(Run(tuple(x.index for x in cur), sum(x.numel for x in cur)))
            cur = [m]
    if cur:
        runs.append(Run(tuple(x.index for x in cur), sum(x.numel for x in cur)))
    return runs


def where_of(t: torch.Tensor) -> tuple[Hashable, int, int] | None:
    """(storage key, start, end) of a contiguous tensor, or None when it is not one flat range."""
    if not t.is_contiguous():
        return None
    st = t.untyped_storage()
    o = t.storage_offset()
    return ((t.device, t.dtype, st.data_ptr()), o, o + t.numel())


def member_of(index: int, tensors: Sequence[torch.Tensor], tag: Hashable = None, *,
              extra: Sequence[torch.Tensor] = (), closes: bool = False) -> Member | None:
    """A :class:`Member` for local tensors ``tensors`` (parameter first, all of its numel) and
    ``extra`` ones of any size (per-block states), or None when one of them is not contiguous
    or a tensor's size differs (the caller steps that parameter on its own)."""
    where = []
    n = tensors[0].numel()
    for t in tensors:
        if t.numel() != n:
            return None
        w = where_of(t)
        if w is None:
            return None
        where.append(w)
    for t in extra:
        w = where_of(t)
        if w is None:
            return None
        where.append(w)
    return Member(index, n, tuple(where), tag, closes)


def flat_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D view of ``numel`` elements starting at contiguous tensor ``t``'s first element
    (reaching into the tensors that follow it in the same storage)."""
    return t.as_strided((numel,), (1,), t.storage_offset())
