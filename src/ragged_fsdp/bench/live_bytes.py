"""Live tensor bytes, op by op: which storages are alive at the peak of a block of code,
their sizes and where they were made.

``torch.distributed._tools.mem_tracker.MemTracker`` gives the peak but not what makes it;
this mode counts every storage an operator creates inside the ``with`` block (a storage
that an op only reads, writes in place or views is not new) until it is freed, and keeps
the set that was alive at the largest total, each with the op and the innermost frames of
the caller that made it. A storage resized to 0 in place counts as freed from the next op. Storages that existed before the block are not counted, so
``peak`` is the block's transient: what a step needs beyond what it was given.

    with LiveBytes() as lb:
        opt.step()
    print(lb.peak, lb.report())
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "Alloc"]


@dataclass(frozen=True)
class Alloc:
    nbytes: int
    op: str
    where: str  # innermost frames under ragged_fsdp / torch.optim / the caller's script


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() or id(t.untyped_storage())


class LiveBytes(TorchDispatchMode):
    """Counts storages created by operators while active; ``peak`` bytes, ``at_peak`` the
    allocations alive then, ``current`` bytes still alive."""

    def __init__(self, frames: int = 3, keep: tuple[str, ...] = ("ragged_fsdp", "torch/optim", "torchtitan", "benchmarks",
                                                                   "tests")):
        super().__init__()
        self.frames, self.keep = frames, keep
        self.live: dict[int, Alloc] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.at_peak: list[Alloc] = []

    def _where(self) -> str:
        out = []
        for fr in reversed(traceback.extract_stack()[:-3]):
            if any(k in fr.filename for k in self.keep) and "live_bytes" not in fr.filename:
                out.append(f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} {fr.name}")
                if len(out) == self.frames:
                    break
        return " < ".join(out)

    def _freed(self, key: int) -> None:
        self._refs.pop(key, None)
        a = self.live.pop(key, None)
        if a is not None:
            self.current -= a.nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for k, ref in list(self._refs.items()):  # storages resized to 0 (freed in place)
            st = ref()
            if st is not None and st.nbytes() == 0:
                self._freed(k)
        seen = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            k = _key(t)
            if k in seen or k in self.live or st.nbytes() == 0:
                continue
            self.live[k] = Alloc(st.nbytes(), str(func.overloadpacket.__name__), self._where())
            self.current += st.nbytes()
            weakref.finalize(st, self._freed, k)
            self._refs[k] = weakref.ref(st)
            if self.current > self.peak:
                self.peak = self.current
                self.at_peak = list(self.live.values())
        return out

    def report(self, unit: float = 2**20) -> str:
        """The allocations alive at the peak, largest first."""
        lines = [f"peak {self.peak / unit:.4f} MiB ({self.peak} B), {len(self.at_peak)} storages alive:"]
        for a in sorted(self.at_peak, key=lambda a: -a.nbytes):
            lines.append(f"  {a.nbytes / unit:8.4f} MiB  {a.op:<22} {a.where}")
        return "\n".join(lines)
