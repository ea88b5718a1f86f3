"""The device seam: how a collective is issued and waited for.

The engine never touches streams or work handles directly. It calls
``device.launch(lane, comm, post, keep)``:

* ``comm(async_op)`` issues the collective (plus any copy-in it needs) and returns a work
  handle or None;
* ``post()`` (optional) is the local work that must follow the collective (summing the
  pieces of an all-to-all, casting, scaling);
* ``keep`` are tensors the collective reads or writes, held until the wait;
* ``out`` (a subset of ``keep``) are the tensors it writes: nothing may read them before
  the wait (the test-only ordering-checking device fills them with NaN until then).

and gets a :class:`Pending` whose ``wait()`` makes the results usable by the compute that
follows.

``after`` (optional) is a launched collective this one must follow (HSDP's replicate
all-reduce after the shard-dim reduce-scatter); ``pre()`` (optional) is local work that
must run right before the collective, in the lane's order.

What users plug in (``fsdp/compat/extension.py``): ``use_stream(lane, stream)`` runs a lane on the
user's stream (``set_all_reduce_hook(stream=...)``); ``order_after(event, lane)`` makes the
lane's next launch follow ``event`` instead of the compute stream
(``set_post_optim_event``), and ``allocating(lane)`` is where memory that launch writes
first must be allocated (on the lane, then).

CPU (gloo): the collective runs on the process group's own threads (``async_op=True``); the
wait blocks on the work handle and then runs ``post`` on the calling thread.

CUDA (NCCL): each lane is a side stream that first waits for the compute stream (the
inputs are ready, and memory the compute stream freed is not reused early); ``comm`` and
``post`` run on it; an event marks the end, and the wait makes the compute stream wait for
that event. No ``record_stream``: the tensors in ``keep`` stay referenced until the wait, so
the caching allocator cannot hand their memory to someone else while the lane still uses it,
and after the wait their frees are ordered on the compute stream.

A buffer whose transfer is done and that nothing will read again goes back with
``device.release(t)``. CPU: its storage is freed in place (gloo's work object may hold a
reference a little after the wait returned). CUDA: nothing more than dropping the reference.

Host copies (offload, :mod:`ragged_fsdp.fsdp.offload.staging`): ``device.copy(lane, dst, src)`` copies between host
and device memory on its own lane (``"h2d"``, ``"d2h"``) and returns a :class:`Pending`. CPU:
the copy runs at once. CUDA: a non-blocking copy on the lane's stream (pinned host memory
makes it asynchronous), after the compute stream's work so far; ``wait()`` makes the compute
stream wait for it, and for a copy *to the host* also blocks the host until it landed (the
host reads the result: an optimizer step on the host, a checkpoint).
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Device", "Pending", "AllWork", "device_for", "drain", "in_flight"]

# Collectives launched and not yet waited for; ``ragged_fsdp.exit`` drains them at exit,
# before the interpreter's teardown, so no gloo work is still running then.
_in_flight: "weakref.WeakSet[Pending]" = weakref.WeakSet()


def in_flight() -> int:
    """How many collectives the engine launched that nobody has waited for yet (0 after a
    finished backward; a prefetch or ``unshard(async_op=True)`` not yet consumed counts)."""
    return len(_in_flight)


def drain() -> None:
    """Wait for every collective the engine launched and nobody waited for yet (an
    unconsumed prefetch, say). Runs at exit (``ragged_fsdp.exit``); call it before ``destroy_process_group()``
    if a run may end between an ``unshard(async_op=True)`` and its wait."""
    for p in list(_in_flight):
        try:
            p.wait()
        except Exception:  # the process group may already be gone: nothing left to save
            pass


# How long the main thread gives up the GIL at exit (why: ``ragged_fsdp.exit``): 0.05 s was
# enough in the plain-gloo reproduction (docs/reliability.md); twice that leaves a margin for a
# thread that waits for a core on a loaded machine, and only scripts that skip
# destroy_process_group pay it.
HAND_OFF_S = 0.1


def at_exit() -> None:
    """The exit hook ``ragged_fsdp.exit`` describes: drain, then hand the GIL to gloo's workers.
    Registered here, with the module every collective of the engine goes through, so that any
    import path to the engine registers it, while ``import ragged_fsdp`` alone imports no torch."""
    drain()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(HAND_OFF_S)


atexit.register(at_exit)

Comm = Callable[[bool], Any]


class AllWork:
    """Several work handles a collective's ``comm(async_op)`` issued, waited on as one
    (None entries: already finished)."""

    def __init__(self, *works):
        self.works = works

    def wait(self):
        for w in self.works:
            if w is not None:
                w.wait()


class Pending:
    """A launched collective; ``wait()`` once before using its outputs."""

    __slots__ = ("_work", "_event", "_post", "_keep", "done", "_host", "__weakref__")

    def __init__(self, work=None, event=None, post=None, keep: Sequence[torch.Tensor] = (), host: bool = False):
        self._work = work
        self._event = event
        self._post = post
        self._keep = tuple(keep)
        self._host = host  # the host reads the outputs: wait blocks the host on the event
        self.done = False
        if work is not None:
            _in_flight.add(self)

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        _in_flight.discard(self)
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            if self._host:
                self._event.synchronize()
            torch.cuda.current_stream().wait_event(self._event)
        if self._post is not None:
            self._post()
        self._work = self._event = self._post = None
        self._keep = ()


class Device:
    """CPU / gloo: async work handles stand in for streams."""

    type = "cpu"
    # Keep a group's gradient reduction in flight while the next group computes its
    # backward? On CPU the collective's copies run on the same cores as the compute, so
    # overlapping buys little time and holds the gradient and receive buffers of one more
    # group; the reduction completes before backward continues. Accelerators overlap.
    overlap_reductions = False

    def __init__(self, device: torch.device):
        self.device = device

    # -- what users plug in (set_all_reduce_hook's stream, set_post_optim_event) -------------
    def use_stream(self, lane: str, stream) -> None:
        """Run ``lane``'s work on ``stream`` (CPU: there are no streams; the host order is
        the order)."""

    def order_after(self, event, lane: str) -> None:
        """The next launch on ``lane`` follows ``event`` instead of the compute stream. On
        the host the event is waited for now (its work is already done when the engine
        runs: CPU ops are synchronous)."""
        event.synchronize()

    def allocating(self, lane: str):
        """Where to allocate memory that ``lane``'s next launch writes first."""
        return contextlib.nullcontext()

    def launch(self, lane: str, comm: Comm, post: Callable[[], None] | None = None,
               keep: Sequence[torch.Tensor] = (), after: Pending | None = None,
               pre: Callable[[], None] | None = None, out: Sequence[torch.Tensor] = ()) -> Pending:
        if after is not None:  # gloo: the host is the only order there is
            after.wait()
        if pre is not None:
            pre()
        work = comm(True)
        return Pending(work=work, post=post, keep=keep)

    def copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        """Copy ``src`` into ``dst`` (host <-> device) on ``lane``; wait before reading
        ``dst`` or writing ``src``. Goes through :meth:`launch`, so a checking device
        orders it like a collective."""

        def issue(async_op: bool):
            with torch.no_grad():
                dst.copy_(src)
            return None

        return self.launch(lane, issue, keep=(dst, src), out=(dst,))

    def release(self, t: torch.Tensor | None) -> None:
        """``t`` is a buffer whose transfer is done (its :class:`Pending` was waited for) and
        that nothing will read again: let its memory go now. gloo's work object may keep a
        reference a little after the wait returned (it drops it on its own thread), so
        dropping ours would free the memory late; the storage is freed in place instead (a
        host buffer only). ``t`` is unusable afterwards; None is ignored."""
        if t is not None and t.device.type == "cpu":
            t.untyped_storage().resize_(0)


class CudaDevice(Device):
    """CUDA / NCCL: one side stream per lane, events instead of ``record_stream``."""

    type = "cuda"
    overlap_reductions = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._events: dict[str, Any] = {}  # lane -> the event its next launch waits on

    def use_stream(self, lane: str, stream) -> None:
        if stream is None:
            self._streams.pop(lane, None)
        else:
            self._streams[lane] = stream

    def order_after(self, event, lane: str) -> None:
        self._events[lane] = event

    def allocating(self, lane: str):
        # A launch that waits on an event instead of the compute stream must not write
        # memory the caching allocator handed out in the compute stream's order (work
        # queued there after the event may still use it): allocate it on the lane.
        if lane in self._events:
            return torch.cuda.stream(self.stream(lane))
        return contextlib.nullcontext()

    def stream(self, lane: str) -> "torch.cuda.Stream":
        s = self._streams.get(lane)
        if s is None:
            # high priority so copy-in/out around collectives does not queue behind compute
            s = self._streams[lane] = torch.cuda.Stream(device=self.device, priority=-1)
        return s

    def launch(self, lane: str, comm: Comm, post: Callable[[], None] | None = None,
               keep: Sequence[torch.Tensor] = (), after: Pending | None = None,
               pre: Callable[[], None] | None = None, out: Sequence[torch.Tensor] = ()) -> Pending:
        stream = self.stream(lane)
        event = self._events.pop(lane, None)
        if event is not None:  # set_post_optim_event: after the optimizer step, not all compute
            stream.wait_event(event)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None and after._event is not None:
            stream.wait_event(after._event)  # the earlier collective's lane, not the host
        with torch.cuda.stream(stream):
            if pre is not None:
                pre()
            comm(False)  # NCCL orders itself after `stream` and `stream` after NCCL
            if post is not None:
                post()
            event = stream.record_event()
        return Pending(event=event, keep=keep)

    def copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        stream = self.stream(lane)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # src written, dst's memory free
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            event = stream.record_event()
        # both stay referenced until the wait: the caching allocators (device and pinned host)
        # cannot reuse their memory while the copy may still run
        return Pending(event=event, keep=(dst, src), host=dst.device.type == "cpu")

    def release(self, t: torch.Tensor | None) -> None:
        """Nothing beyond dropping the caller's reference: the launch kept ``t`` referenced
        until its wait, which ordered the compute stream after the lane's event, so the
        caching allocator reuses the memory only after the lane is done with it. Resizing the
        storage in place would add nothing, and before the wait it would free memory a NCCL
        stream may still read."""


def device_for(device: torch.device) -> Device:
    if device.type == "cuda":
        return CudaDevice(device)
    return Device(device)
