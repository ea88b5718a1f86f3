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
  A nested group's forward takes an outer group's watch off the stack while it runs (its
  cost is per saved tensor, and a block saves many) and tells afterwards, from reference
  counts, whether any watched unit was saved meanwhile (:func:`pause_outer_watch`); not
  when an owner module of the outer units runs inside the nested group.
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

from ..torch_private import (TorchPrivateMissing, in_backward, pop_saved_tensors_hooks, push_saved_tensors_hooks,
                             saved_tensors_hooks_top, storage_use_count, tensor_use_count)
from .common import TrainingState
from .hooks import attach_post_backward, eager
from .unit import Unit

__all__ = ["ForwardRecord", "BackwardRecord", "BackwardNeeds", "Group", "PausedWatch", "SavedWatch",
           "pause_outer_watch", "resume_outer_watch", "start_watch", "stop_watch", "watching"]

# -- the saved-tensor watch ----------------------------------------------------------------
class SavedWatch:
    def __init__(self, storages: dict[int, int], units: list[Unit] = ()):
        self.storages = storages  # untyped storage data_ptr -> unit index
        self.units = units  # the watched units (gathered), for a nested group's pause
        self.seen = 0  # tensors saved while the watch was on top
        self.hit: set[int] = set()  # units a saved tensor lives in
        self.opaque = False  # a saved tensor whose storage could not be read
        self.inside: dict[int, int] = {}  # unit -> depth of its owner-module calls running now
        self.outside: set[int] = set()  # units saved while none of their owner modules ran
        self.paused = False  # popped by a nested group's forward (see pause_outer_watch)
        self.closed = False  # its group's forward call ended: never pushed back

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
    # torch's private calls live in fsdp/torch_private.py; without the stack's top the watch
    # cannot know whose hooks are on, and reads as someone else's: no watch, nothing skipped
    try:
        return saved_tensors_hooks_top()
    except TorchPrivateMissing:
        return (None, None)


def watching(w: SavedWatch) -> bool:
    """Whether ``w`` is the hook autograd saves through right now."""
    top = _top()
    return top is not None and getattr(top[0], "__self__", None) is w


def start_watch(storages: dict[int, int], units: list[Unit] = ()) -> SavedWatch | None:
    """Push a watch, unless someone else's saved-tensor hooks are active."""
    top = _top()
    if top is not None and not isinstance(getattr(top[0], "__self__", None), SavedWatch):
        return None
    w = SavedWatch(storages, units)
    try:
        pushed = push_saved_tensors_hooks(w.pack, w.unpack)
    except TorchPrivateMissing:
        return None
    return w if pushed else None  # not pushed: saved-tensor hooks disabled by the user


def stop_watch(w: SavedWatch | None) -> None:
    """Pop ``w`` if it is on top (a forward that raised may have left the stack uneven)."""
    if w is None:
        return
    if watching(w):
        pop_saved_tensors_hooks()
    w.closed = True


# -- pausing an outer group's watch while a nested group runs forward --------------------------
# A watch is a Python pack and unpack call plus a detach (autograd's, for every saved tensor
# while any hook is set) per saved tensor: the root's watch, left on through every block's
# forward, was 1,205 extra detach per step on the 48-block bench model. A nested group's forward
# pops it instead. What the watch would have seen there is still seen, by reference counts:
# a tensor autograd saves that aliases a watched unit either is one of its parameters (their
# use count grows) or is another view of its unsharded buffer (the storage's use count grows).
# A count that grew marks the unit saved outside its owner modules, as a hit of the watch
# would have; it can also grow for other reasons (an AccumulateGrad node made, a view kept),
# which only costs the optimisation for that step. Counts that fall are not read: a
# collective's work object, dropped after its wait, can release its references from gloo's
# thread at any time (seen on the first block's forward), and reading that would make the
# decision depend on timing, where every rank must take the same one.
# The hook stack and the counts are torch internals, reached only through fsdp/torch_private.py,
# which tests/test_torch_private.py pins on every torch the CI runs.
@dataclass
class PausedWatch:
    watch: SavedWatch
    below: tuple | None  # the hooks under it: on top while it is paused
    counts: list[tuple[Unit, int]]  # references to each watched unit when paused


def _references(u: Unit) -> int:
    n = storage_use_count(u.buf.unsharded)
    for i in u.infos:
        if i.unsharded is not None:
            n += tensor_use_count(i.unsharded)
    return n


def pause_outer_watch(modules: tuple[nn.Module, ...]) -> PausedWatch | None:
    """Pop the watch of an outer group if it is on top and none of its units' owner modules
    runs inside ``modules`` (an owner module's own hooks need the watch on the stack)."""
    top = _top()
    w = getattr(top[0], "__self__", None) if top is not None else None
    if not isinstance(w, SavedWatch) or not w.units:
        return None
    inner = {id(m) for top_m in modules for m in top_m.modules()}
    if any(id(m) in inner for u in w.units for i in u.infos for m, _ in i.owners):
        return None
    try:
        counts = [(u, _references(u)) for u in w.units]
    except Exception:  # a subclass parameter without these counts: keep watching
        return None
    pop_saved_tensors_hooks()
    w.paused = True
    return PausedWatch(w, _top(), counts)


def _same_hooks(a: tuple | None, b: tuple | None) -> bool:
    return a is b or (a is not None and b is not None and a[0] is b[0] and a[1] is b[1])


def resume_outer_watch(p: PausedWatch) -> None:
    """Push the paused watch back, recording what the nested forward saved of its units."""
    w = p.watch
    w.paused = False
    if w.closed:
        return
    for u, n in p.counts:
        if _references(u) > n:
            w.hit.add(u.index)
            w.outside.add(u.index)
    if not _same_hooks(_top(), p.below):
        # someone's hooks were left on the stack: the watch could not see what comes next
        w.opaque = True
        return
    if not push_saved_tensors_hooks(w.pack, w.unpack):
        w.opaque = True


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
        self.paused: PausedWatch | None = None  # an outer group's watch, off during this forward
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
        if self.paused is None and self.watch is None and len(g.modules) == 1:
            # (a list group's post-forward may come after the outer forward ended)
            self.paused = pause_outer_watch(g.modules)
        watched = [u for u in g.units if (u.embedding or u.index in self.early)]
        if not watched or self.watch is not None:
            return
        gathered = [u for u in watched if not u.freed]
        storages = {u.buf.unsharded.untyped_storage().data_ptr(): u.index for u in gathered}
        self.watch = start_watch(storages, gathered)
        if self.watch is None:
            self.fwd.unknown = True

    def stop(self, resume: bool = True) -> None:
        """End the watch of this forward call; with ``resume``, put back an outer group's
        watch it paused (not when a step is aborted: the outer forward is over)."""
        w, self.watch = self.watch, None
        stop_watch(w)
        p, self.paused = self.paused, None
        if p is not None and resume:
            resume_outer_watch(p)
        if w is None:
            return
        f = self.fwd
        f.seen += w.seen
        f.unknown |= w.opaque or w.paused  # still paused: it missed the rest of this forward
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
        """A backward ended: a new backward record; the next forward starts a new forward
        record, and a recomputation ends with the backward that ran it (a later step without
        activation checkpointing skips the embedding's gather again)."""
        self.bwd = BackwardRecord()
        self.fwd.stale = True
        self.recomputed = False

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
