"""What the engine did in a step, in order: ``with ragged_fsdp.fsdp.trace() as t:``.

Each :class:`Event` is one thing that moved or freed memory of a DBuffer: an all-gather
issued (``all_gather``), its unsharded parameters freed (``free``; ``reshard_after_forward=k``
keeps a part: ``keep``), a gradient reduction issued (``reduce_scatter``, with ``early`` when it
ran before its group's post-backward, and ``all_reduce`` for HSDP's replicate dim). Events
carry the buffer's name (``"<group fqn>#<index>"``, the root's group named ``"<root>"``), the
bytes the event allocates or frees on this rank, whether it happened inside backward, and
the fully-qualified names of the parameters in the buffer; a ``reduce_scatter`` also carries
``sent``, the bytes this rank puts on the wire for it (``gradient_reduce``'s codes and scales,
or the reduce dtype's pieces of the other ranks' segments). Recording costs one list append
per event and nothing when no trace is open. See ``docs/trace.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from .torch_private import in_backward

__all__ = ["Event", "Trace", "trace", "record", "active"]


@dataclass(frozen=True)
class Event:
    kind: str  # all_gather | free | keep | reduce_scatter | all_reduce | h2d | d2h | unstage (offload)
    buffer: str  # "<group fqn>#<buffer index>"
    group: str  # the group's fqn ("<root>" for the root's)
    index: int  # the buffer's index in its group
    bytes: int  # bytes this rank allocates (all_gather, reduce_scatter) or frees (free)
    backward: bool  # inside a backward pass
    early: bool = False  # reduce_scatter: issued before the group's post-backward
    params: tuple[str, ...] = ()  # the parameters the buffer holds
    sent: int | None = None  # reduce_scatter: bytes this rank sends for it (None for the other kinds)
    wire: int | None = None  # an MXFP8 / NVFP4 all_gather: bytes it moves into this rank (codes + scales, own share included)
    plane: str | None = None  # an MXFP8 / NVFP4 all_gather: the plane it moved, "rows" (forward) or "cols" (backward)


@dataclass
class Trace:
    events: list[Event] = field(default_factory=list)

    def of(self, kind: str | None = None, buffer: str | None = None, group: str | None = None) -> list[Event]:
        return [e for e in self.events if (kind is None or e.kind == kind) and (buffer is None or e.buffer == buffer)
                and (group is None or e.group == group)]

    def buffer_of(self, param: str) -> str:
        """The name of the buffer holding parameter ``param`` (as ``named_parameters()``
        of its group's module spells it)."""
        for e in self.events:
            if param in e.params:
                return e.buffer
        raise KeyError(f"trace: no recorded event touches a buffer holding {param!r}")

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def table(self) -> str:
        rows = [f"{'kind':<22} {'buffer':<24} {'MiB':>9} {'sent MiB':>9}  phase"]
        for e in self.events:
            phase = "backward" if e.backward else "forward"
            sent = "" if e.sent is None else f"{e.sent / 2**20:.3f}"
            if e.wire is not None:  # MXFP8 / NVFP4: what the gather moved, and which plane
                sent, phase = f"{e.wire / 2**20:.3f}", f"{phase} ({e.plane} plane)"
            rows.append(f"{e.kind + (' (early)' if e.early else ''):<22} {e.buffer:<24} {e.bytes / 2**20:>9.3f} "
                        f"{sent:>9}  {phase}")
        return "\n".join(rows)


_open: list[Trace] = []


def active() -> bool:
    return bool(_open)


def record(kind: str, unit, nbytes: int, early: bool = False, sent: int | None = None,
           wire: int | None = None, plane: str | None = None) -> None:
    """Append an event for ``unit`` (a :class:`~ragged_fsdp.fsdp.core.unit.Unit`) to every open trace."""
    if not _open:
        return
    group = unit.group_name()
    ev = Event(kind, f"{group}#{unit.index}", group, unit.index, int(nbytes),
               in_backward(), early, tuple(i.fqn for i in unit.infos),
               None if sent is None else int(sent), None if wire is None else int(wire), plane)
    for t in _open:
        t.events.append(ev)


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record the engine's all-gathers, frees and reductions (on this rank) until the
    block exits. Nests: every open trace gets every event."""
    t = Trace()
    _open.append(t)
    try:
        yield t
    finally:
        _open.remove(t)
