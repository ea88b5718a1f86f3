"""What backward needs from forward: which buffers it must gather, and which it may reduce early.

Contract (what a group gets from this module, and what it must do in return):

* **The saved-tensor watch.** While a group's forward runs (``start``/``stop`` around it), a
  saved-tensor pack hook records the storage of every tensor autograd saves. A unit none of
  whose storage was saved need not be gathered again for backward. Storage, not tensor
  identity: views (``weight.t()``, slices) share it. The watch is pushed only where no
  foreign saved-tensor hooks are active (activation checkpointing installs its own and the
  watch would no longer see the tensors); a forward that ran without the watch, saw opaque
  tensors or saw no saved tensor at all (its forward ran inside a checkpoint) learns
  nothing (``ForwardRecord.unknown`` / ``seen == 0``), and then nothing is skipped.
* **Skipping embedding gathers** (:meth:`BackwardNeeds.skip_in_backward`): a unit holding only
  untied ``nn.Embedding`` weights (their backward reads only the indices) whose storage was
  not saved is neither kept after forward nor gathered for backward. Never after the
  group's forward ran again inside backward (a recomputation reads the weights: each call of
  such an embedding inside backward gathers its group on the spot), nor with
  ``set_unshard_in_backward(True)``.
* **Early reduction of the root's norm+head.** A group with several trainable units (the
  root: embedding apart from the norm and head) whose modules registering a unit's
  parameters are not the group's top modules gets a PostBackward node on those owner
  modules' inputs. When every owner call of such a unit finished its backward, its
  gradients are complete: a group whose own post-backward cannot fire before the end of
  backward (a call whose inputs needed no grad: token ids) reduces that unit now and frees
  its unsharded parameters, instead of holding both through the rest of backward. It is
  not freed when the watch saw its storage saved outside its owner modules (a weight read
  by another module's code: autograd may still read it) or could not see every save. A
  gradient that still arrives later is reduced again and added into the early segment.
  Every rank must reduce early at the same point (the owner modules must run, with inputs
  that need grad, on every rank); the end-of-backward flag all-reduce checks it.

A group holds one :class:`BackwardNeeds` and calls it at its forward (``begin_forward``,
``stop``), at a recomputation (``recompute``) and when a backward ended (``end_backward``).
Everything it learns lives in two records, each replaced whole: a :class:`ForwardRecord`
(the group's forward calls and what autograd saved of each unit, replaced at the group's
first forward after a backward ended) and a :class:`BackwardRecord` (the owner-module calls
whose backward finished, the units reduced early; replaced at the end of every backward).
Units are named by their index in the group. The group itself is reached through
:class:`Group`, the part of it this module reads; the reduction goes through its
``reduce_units``, the same sequence as its post-backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from .common import TrainingState
from .hooks import attach_post_backward, eager, in_backward
from .unit import Unit

__all__ = ["ForwardRecord", "BackwardRecord", "BackwardNeeds", "Group", "SavedWatch", "start_watch", "stop_watch",
           "watching"]

_hooks = torch._C._autograd


# -- the saved-tensor watch ----------------------------------------------------------------
class SavedWatch:
    def __init__(self, storages: dict[int, int]):
        self.storages = storages  # untyped storage data_ptr -> unit index
        self.seen = 0  # tensors saved while the watch was on top
        self.hit: set[int] = set()  # units a saved tensor lives in
        self.opaque = False  # a saved tensor whose storage could not be read
        self.inside: dict[int, int] = {}  # unit -> depth of its owner-module calls running now
        self.outside: set[int] = set()  # units saved while none of their owner modules ran

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


# -- the group's record of its forward calls -------------------------------------------------
@dataclass
class ForwardRecord:
    """What the forward calls since the group's last backward left for backward to use.

    Reset at the group's next forward after a backward ended, not at the end of a backward:
    a step may run several backward passes over one forward (``retain_graph``, chunked
    losses), and each needs to know how many calls its graph holds."""

    ran: bool = False  # ran forward with grad enabled
    calls: int = 0  # forward calls with a PostBackward node on their inputs
    blind: bool = False  # a call whose inputs needed no grad: only the final callback sees it
    stale: bool = False  # a backward ended since: the next forward starts a new count
    seen: int = 0  # tensors autograd saved during the group's forward calls (the watch)
    unknown: bool = False  # a call ran without the watch (other hooks active) or saw opaque tensors
    # per unit (by index)
    saved: set[int] = field(default_factory=set)  # the watch saw autograd save its storage
    saved_outside: set[int] = field(default_factory=set)  # ... while none of its owner modules ran
    owner_calls: dict[int, int] = field(default_factory=dict)  # owner-module calls with a PostBackward node
    owner_blind: set[int] = field(default_factory=set)  # an owner-module call whose inputs needed no grad


@dataclass
class BackwardRecord:
    """What one backward pass did to the units that may be reduced early (replaced when it ends)."""

    owner_fired: dict[int, int] = field(default_factory=dict)  # owner-module PostBackward nodes that ran
    reduced_early: set[int] = field(default_factory=set)  # reduced before the group's post-backward


class Group(Protocol):
    """What this module reads of its group (a :class:`~.param_group.ParamGroup`)."""

    units: list[Unit]
    modules: tuple[nn.Module, ...]
    training_state: TrainingState
    unshard_in_backward: bool | None
    reduce_grads: bool
    requires_all_reduce: bool
    reshard_after_backward: bool

    @property
    def is_unsharded(self) -> bool: ...

    def recompute_forward(self) -> None: ...

    def free_units(self, units: list[Unit]) -> None: ...

    def reduce_units(self, units: list[Unit], release: Callable[[], None] | None, early: bool = False) -> None: ...


class BackwardNeeds:
    """The per-group side of the contract in the module docstring (the group's lifecycle
    calls in here; it calls back through :class:`Group`)."""

    def __init__(self, group: Group):
        self.g = group
        self.fwd = ForwardRecord()
        self.bwd = BackwardRecord()
        self.early: frozenset[int] = frozenset()  # units that may be reduced early (hook_owner_modules)
        self.watch: SavedWatch | None = None  # the watch of the forward call running now
        self.recomputed = False  # forward ran again inside backward (activation checkpointing)

    # -- construction ------------------------------------------------------------------
    def hook_embedding(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(eager(self._embedding_pre_forward))

    def hook_owner_modules(self) -> None:
        """PostBackward nodes on the owner modules of the units that may be reduced early."""
        g = self.g
        trainable = [u for u in g.units if u.trainable and u.reduces_early]
        if len(trainable) < 2:
            return
        tops = {id(m) for m in g.modules}
        by_module: dict[int, tuple[nn.Module, list[Unit]]] = {}
        for u in trainable:
            if u.embedding:
                continue
            owners = {id(m): m for i in u.infos for m, _ in i.owners}
            if tops & owners.keys():
                continue
            for k, m in owners.items():
                by_module.setdefault(k, (m, []))[1].append(u)
        early = set()
        for m, us in by_module.values():
            m.register_forward_pre_hook(eager(functools.partial(self._owner_pre_forward, tuple(us))), with_kwargs=True)
            m.register_forward_hook(eager(functools.partial(self._owner_post_forward, tuple(us))), always_call=True)
            early.update(u.index for u in us)
        self.early = frozenset(early)

    # -- forward -------------------------------------------------------------------------
    def begin_forward(self, args: tuple, kwargs: dict, on_backward: Callable[[], None]) -> tuple[tuple, dict]:
        """The group's forward call starts (with grad enabled, its first module): a new
        record after a backward ended, the watch, and ``on_backward`` as a PostBackward node
        on the inputs."""
        if self.fwd.stale:
            self.fwd = ForwardRecord()
        f = self.fwd
        f.ran = True
        self._start()
        args, kwargs, attached = attach_post_backward(on_backward, args, kwargs)
        if attached:
            f.calls += 1
        else:
            f.blind = True
        return args, kwargs

    def recompute(self) -> None:
        """Forward runs again inside backward: from now on backward gathers everything."""
        self.recomputed = True
        f = self.fwd
        if torch.is_grad_enabled() and not f.ran:
            # reentrant checkpoint: the first forward ran without grad
            f.ran = True
            f.blind = True

    def _start(self) -> None:
        g = self.g
        watched = [u for u in g.units if (u.embedding or u.index in self.early)]
        if not watched or self.watch is not None:
            return
        storages = {u.buf.unsharded.untyped_storage().data_ptr(): u.index for u in watched if not u.freed}
        self.watch = start_watch(storages)
        if self.watch is None:
            self.fwd.unknown = True

    def stop(self) -> None:
        w, self.watch = self.watch, None
        if w is None:
            return
        stop_watch(w)
        f = self.fwd
        f.seen += w.seen
        f.unknown |= w.opaque
        f.saved |= w.hit
        f.saved_outside |= w.outside

    def _embedding_pre_forward(self, module, args) -> None:
        """Each call of an embedding whose unit backward might skip: the watch must be what
        sees its saved tensors (not an activation checkpoint's hooks), and a recomputation
        inside backward gets its weights gathered on the spot."""
        if in_backward():
            self.g.recompute_forward()
            return
        if not torch.is_grad_enabled():
            return
        w = self.watch
        if w is None or not watching(w):
            self.fwd.unknown = True

    def _owner_pre_forward(self, units: tuple[Unit, ...], module, args, kwargs):
        if in_backward() or not torch.is_grad_enabled():
            return None  # a recomputation, or no backward will follow this call
        w = self.watch
        if w is not None:
            for u in units:
                w.inside[u.index] = w.inside.get(u.index, 0) + 1
            if not watching(w):  # someone else's saved-tensor hooks (a checkpoint) hide the saves
                self.fwd.saved_outside.update(u.index for u in units)
        attached = False
        if self.g.training_state is TrainingState.FORWARD:
            args, kwargs, attached = attach_post_backward(functools.partial(self._units_done, units), args, kwargs)
        f = self.fwd
        for u in units:
            if attached:
                f.owner_calls[u.index] = f.owner_calls.get(u.index, 0) + 1
            else:  # outside the group's forward, or inputs that need no grad: unseen
                f.owner_blind.add(u.index)
        return (args, kwargs) if attached else None

    def _owner_post_forward(self, units: tuple[Unit, ...], module, args, output) -> None:
        w = self.watch
        if w is not None and not in_backward() and torch.is_grad_enabled():
            for u in units:
                if w.inside.get(u.index):
                    w.inside[u.index] -= 1

    # -- backward ------------------------------------------------------------------------
    def skip_in_backward(self) -> set[int]:
        """Indices of the units the coming backward need not gather."""
        g = self.g
        if g.unshard_in_backward is False:
            return {u.index for u in g.units}
        f = self.fwd
        if g.unshard_in_backward is True or self.recomputed or not f.ran or f.unknown or f.seen == 0:
            return set()
        return {u.index for u in g.units if u.embedding and u.index not in f.saved}

    def reduced_early(self, u: Unit) -> bool:
        """``u`` was reduced in this backward before its group's post-backward."""
        return u.index in self.bwd.reduced_early

    def end_backward(self) -> None:
        """A backward ended: a new backward record; the next forward starts a new forward record."""
        self.bwd = BackwardRecord()
        self.fwd.stale = True

    def _units_done(self, units: tuple[Unit, ...]) -> None:
        """One owner-module call of ``units`` finished its backward."""
        f, fired = self.fwd, self.bwd.owner_fired
        for u in units:
            i = u.index
            fired[i] = fired.get(i, 0) + 1
            if fired[i] == f.owner_calls.get(i, 0) and i not in f.owner_blind:
                self._reduce_early(u)

    def _reduce_early(self, u: Unit) -> None:
        g, f = self.g, self.fwd
        if (not f.blind or g.training_state is not TrainingState.PRE_BACKWARD
                or not g.reduce_grads or u.index in self.bwd.reduced_early or u.buf.grad is None
                or (u.dp.replicate is not None and not g.requires_all_reduce)):
            return
        with record_function("ragged_fsdp::reduce_early"):
            u.fold_foreign_grads()
            # free its unsharded parameters too, unless autograd may still read them: saved
            # outside the owner modules, or the watch could not see every save
            free = (g.reshard_after_backward and g.is_unsharded and f.seen > 0 and not f.unknown
                    and u.index not in f.saved_outside)
            self.bwd.reduced_early.add(u.index)
            g.reduce_units([u], functools.partial(g.free_units, [u]) if free else None, early=True)
