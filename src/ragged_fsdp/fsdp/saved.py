"""Which of a group's unsharded buffers autograd saved for backward.

A group's backward needs its unsharded parameters only if some backward formula reads
them: ``linear`` saves its weight (or a view of it, e.g. ``weight.t()``), ``embedding`` saves
only the indices. During the group's forward a saved-tensor pack hook records the storage of
every tensor autograd saves; a buffer none of whose storage was saved need not be gathered
again for backward. Storage, not tensor identity: views (``weight.t()``, slices) share it.

The same watch tells whether a buffer was saved *outside* the modules that own its
parameters (a weight read directly by another module's code): such a buffer must stay
gathered until the end of backward, even when its owners' backward has finished.

The watch is pushed only where no foreign saved-tensor hooks are active (activation
checkpointing installs its own and would no longer see the tensors), and a group that saw
no saved tensor at all (its forward ran inside a checkpoint: the checkpoint's hooks took
everything) learns nothing, so nothing is skipped.
"""

from __future__ import annotations

import torch

__all__ = ["SavedWatch", "start_watch", "stop_watch", "watching", "eager"]

_hooks = torch._C._autograd


class SavedWatch:
    def __init__(self, storages: dict[int, int]):
        self.storages = storages  # untyped storage data_ptr -> buffer index
        self.seen = 0  # tensors saved while the watch was on top
        self.hit: set[int] = set()  # buffers a saved tensor lives in
        self.opaque = False  # a saved tensor whose storage could not be read
        self.inside: dict[int, int] = {}  # buffer -> depth of its owner-module calls running now
        self.outside: set[int] = set()  # buffers saved while none of their owner modules ran

    def pack(self, t: torch.Tensor):
        self.seen += 1
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # tensor subclasses without storage: assume the worst
            self.opaque = True
            return t
        b = self.storages.get(ptr)
        if b is not None:
            self.hit.add(b)
            if not self.inside.get(b):
                self.outside.add(b)
        return t

    @staticmethod
    def unpack(t):
        return t


def _top():
    return _hooks._top_saved_tensors_default_hooks(False)


def watching(w: SavedWatch) -> bool:
    """Whether ``w`` is the hook autograd saves through right now."""
    top = _top()
    return top is not None and getattr(top[0], "__self__", None) is w


def eager(fn):
    """``fn`` never traced by torch.compile (a graph break where it is called)."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn, recursive=True) if disable is not None else fn


def start_watch(storages: dict[int, int]) -> SavedWatch | None:
    """Push a watch, unless someone else's saved-tensor hooks are active."""
    top = _top()
    if top is not None and not isinstance(getattr(top[0], "__self__", None), SavedWatch):
        return None
    w = SavedWatch(storages)
    _hooks._push_saved_tensors_default_hooks(w.pack, w.unpack)
    return w


def stop_watch(w: SavedWatch | None) -> None:
    """Pop ``w`` if it is on top (a forward that raised may have left the stack uneven)."""
    if w is not None and watching(w):
        _hooks._pop_saved_tensors_default_hooks()
