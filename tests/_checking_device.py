"""A test-only device that checks the engine's collective ordering discipline on CPU.

``RAGGED_FSDP_CHECK_ORDER=1`` makes every engine test worker (``_dist._worker``) build its
groups on :class:`CheckingDevice` instead of the gloo device. It

* runs no collective (and no ``pre``/``post`` work) at ``launch``; all of it runs at ``wait()``,
  as late as a CUDA stream could run it;
* fills every tensor the collective writes (``out``) with NaN bytes from ``launch`` until the
  ``wait()`` (their contents are put back right before the collective runs, since a
  reduction may accumulate into them), so compute that reads an output before its wait
  poisons the step and the comparison with single-process training fails;
* checks at ``wait()`` that no tensor in ``keep`` was freed or resized since ``launch`` (the
  memory a collective reads or writes must stay allocated until its wait);
* keeps reductions in flight while the next group computes (``overlap_reductions``), as the
  CUDA device does, so the CPU tests walk the GPU's order of events.

What it proves: the engine waits for every collective before it uses the outputs and keeps
the memory alive until then, in every order the tests exercise. On CUDA a missing wait is
a missing stream wait, which this catches; what only a GPU run shows is whether the stream
and event plumbing itself (``CudaDevice``) does what the seam promises, and timing.
"""

from __future__ import annotations

import torch

from ragged_fsdp.fsdp.comms import device as _device

# data_ptr of each poisoned tensor -> (the snapshot of its contents, the version it had)
_poisoned: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}


def _key(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def _poison(t: torch.Tensor) -> tuple[int, int] | None:
    if t.numel() == 0 or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
        return None
    k = _key(t)
    if k in _poisoned:  # an earlier launch writing the same tensor restores it first
        return None
    version = t._version
    _poisoned[k] = (t, t.detach().clone(), version)
    with torch.no_grad():
        try:
            t.view(torch.uint8).fill_(255)  # all-ones bytes: NaN in every float format
        except RuntimeError:
            t.fill_(float("nan"))
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    return k


def _restore(k: tuple[int, int]) -> None:
    t, saved, version = _poisoned.pop(k)
    with torch.no_grad():
        t.copy_(saved)
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


class CheckingPending(_device.Pending):
    __slots__ = ("_run", "_after", "_pre", "_poisoned", "_kept", "_lane")

    def __init__(self, lane, comm, post, keep, after, pre, out):
        super().__init__(work=None, post=post, keep=keep)
        self._run, self._after, self._pre, self._lane = comm, after, pre, lane
        self._kept = [(t, t.untyped_storage().nbytes(), t.data_ptr(), tuple(t.shape)) for t in keep]
        self._poisoned = [k for k in (_poison(t) for t in out) if k is not None]
        _device._in_flight.add(self)

    def wait(self) -> None:
        if self.done:
            return
        if self._after is not None:
            self._after.wait()
        for t, nbytes, ptr, shape in self._kept:
            if t.untyped_storage().nbytes() != nbytes or t.data_ptr() != ptr or tuple(t.shape) != shape:
                raise AssertionError(
                    f"ordering check ({self._lane}): a tensor the collective uses was freed or resized "
                    f"before its wait ({nbytes} -> {t.untyped_storage().nbytes()} bytes)")
        for k in self._poisoned:
            _restore(k)
        self._poisoned = []
        if self._pre is not None:
            self._pre()
        work = self._run(True)
        if work is not None:
            work.wait()
        self._kept = []
        super().wait()


class CheckingDevice(_device.Device):
    type = "cpu"
    overlap_reductions = True

    def launch(self, lane, comm, post=None, keep=(), after=None, pre=None, out=()):
        return CheckingPending(lane, comm, post, tuple(keep), after, pre, tuple(out))


def install() -> None:
    """Make ``fully_shard`` build its groups on :class:`CheckingDevice` (this process)."""
    import ragged_fsdp.fsdp.api as api

    api.device_for = lambda device: CheckingDevice(device)
