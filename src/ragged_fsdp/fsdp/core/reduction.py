"""The one owner of gradient reductions, in the order a gradient goes through them.

Per root there is one :class:`Reductions` (in the root's context). A group asks it to
reduce some units now (:meth:`Reductions.reduce_now`: its post-backward, and an early
reduction from :mod:`.backward`, run that one sequence: finish the reduction in flight,
take every gradient buffer, free the unsharded parameters, reduce each unit). Per unit
(:meth:`Reductions.reduce`) the variant is picked once, by what the unit's group set:
global order (:mod:`.global_order`: fold this micro-step's pieces, land on the step's
last), HSDP (a replicate dim), or FSDP. Every variant then goes through the same stages,
each a function of its own below, in this order:

1. **Where the sum lands** (:func:`choose_landing` -> :class:`Landing`): the sharded
   gradient segment and whether to add into it, chosen once for every variant: a new
   segment; the one existing grads live in (accumulation without ``zero_grad``); the early
   reduction's segment when late gradients of an early-reduced unit arrive; or, FSDP at
   ``W == 1`` with nothing to cast or divide, the unsharded gradient buffer itself.
2. **The shard-dim collective** (:func:`shard_reduce`): the wire format's all-to-all and
   fp32 sum (``fully_shard(gradient_reduce=...)``), else the engine's reduce-scatter, which
   picks by backend in one dispatcher (:func:`~..comms.collectives.reduce_scatter`: ``W ==
   1``, the user's custom reduce-scatter, gloo, NCCL). Global order's collective is its own
   fold (:func:`~..comms.ordered_reduce.ordered_reduce`).
3. **What follows it**: HSDP's all-reduce over the replicate dim on its own lane of the
   device seam (launched as soon as the reduce-scatter completes, waited for at the end of
   backward or when the unit is next reduced; with ``set_requires_all_reduce(False)`` the
   shard-dim sums pile up in the unit instead, as :class:`PartialSum`), and the unit's
   all-reduce hook (:class:`~..comms.custom.CommHooks`), which runs on this reduction's
   divided result alone (FSDP: a stage of its own after the reduce-scatter; HSDP: after the
   all-reduce) before it is cast or added into the sharded grads.

Every divide, cast, write and add of a reduced sum is :func:`~..comms.landing.land`'s
(NCCL's ``AVG`` is the one divide a collective does itself).

Every reduction is a typed state in the queue (:class:`Reduction`, :class:`PartialSum`);
``in_flight`` is the order the shard-dim collectives were issued in, ``issued`` what this
backward hands out at its end. The end of backward (:meth:`Reductions.end_backward`), per
set of data-parallel process groups, is three stages again:

4. :func:`exchange_flags`: the flags only the host knows (which slots got a gradient on any
   rank, which reductions ran early, whether the all-reduce hook raised on this rank:
   :class:`HookFailure`) in one ``agreement.agree_flags`` all-reduce of a CPU tensor over a
   gloo group beside the device's process group (``Comm.host_group``): no device-to-host
   copy in backward. A hook that raised on any rank, or a reduction that ran early on some
   ranks only, raises here on every rank, and none waits for the failed one in a collective;
5. :func:`hand_out`: each unit points its sharded grads into its reduced segment (under
   grads offload, after the copy to the host);
6. :func:`commit_residuals`: the backward completed, so error feedback's staged residuals
   become the residuals (a backward that raised discards them instead).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ragged_fsdp.agreement import agree_flags
from ragged_fsdp.quant.grad_wire import GradientReduce, wire_bytes

from .. import tracing as trace
from ..comms.collectives import all_reduce, reduce_scatter
from ...device import Device, Pending
from ..comms.landing import land
from ..comms.ordered_reduce import ordered_reduce
from ..comms.wire_reduce import wire_reduce_scatter
from ..comms.custom import HOOK_LANE, checked_alloc, run_all_reduce_hook
from .global_order import Fold, GlobalOrder, Step, check_unit
from .mesh_info import DPMesh
from .unit import Unit

__all__ = ["Phase", "Reduction", "PartialSum", "Reductions", "Settings", "HandedOut", "Landing", "choose_landing",
           "shard_reduce", "exchange_flags", "hand_out", "commit_residuals"]


class HandedOut(Protocol):
    """What the end of backward reads of a group (a :class:`~.param_group.ParamGroup`)."""

    units: list[Unit]

    def describe(self) -> str: ...


@dataclass
class Settings:
    """What a group's reductions depend on (the group's public setters change them)."""

    divide_factor: float | None = None
    requires_all_reduce: bool = True
    wire: GradientReduce | None = None  # fully_shard(gradient_reduce=...): low-precision pieces, fp32 sum
    order: GlobalOrder | None = None  # ragged_fsdp.global_order: the step's sum in one order at any W


# -- 1. where the sum lands ------------------------------------------------------------
@dataclass(frozen=True, eq=False, slots=True)
class Landing:
    """Where one reduction's sum lands: ``target`` (+)= sum / factor."""

    target: torch.Tensor  # the sharded gradient segment written (or added into)
    accumulate: bool  # add into the gradients already in ``target``
    had_grad: list[bool]  # per slot: had a sharded grad before this reduction (read at hand-out)
    adopted: bool = False  # ``target`` is the unsharded gradient buffer itself: nothing to reduce


def choose_landing(unit: Unit, settings: Settings, prev: "Reduction | None" = None,
                   grad: torch.Tensor | None = None) -> Landing:
    """The one choice of target, for every variant. ``prev``: this backward's early
    reduction of ``unit``, whose segment late gradients are added into. ``grad``: the
    unsharded gradient buffer, which FSDP at ``W == 1`` adopts as the sharded one when there
    is nothing to cast, divide or accumulate (None: not adoptable, e.g. a step's landing
    from its global-order fold)."""
    if prev is not None:
        return Landing(prev.target, True, prev.had_grad)
    had, existing = unit.existing_grads()
    if existing:  # accumulation without zero_grad: add into the segment they live in
        return Landing(unit.accumulation_target(existing), True, had)
    buf = unit.buf
    if (grad is not None and buf.world_size == 1 and unit.dp.replicate is None and settings.order is None
            and grad.dtype == buf.dtype and settings.divide_factor is None and settings.wire is None):
        return Landing(grad, False, had, adopted=True)
    return Landing(buf.new_sharded_grad(), False, had)


# -- 2. the shard-dim collective ---------------------------------------------------------
def shard_reduce(dev: Device, unit: Unit, grad: torch.Tensor, out: torch.Tensor, accumulate: bool,
                 factor: float | None, settings: Settings) -> tuple[Pending, int]:
    """Issue the shard-dim reduction of ``unit``'s gradient buffer ``grad`` into ``out``
    (``out`` (+)= sum / factor); returns its launch and the bytes this rank sends (trace's
    ``sent``). The wire format's all-to-all plus fp32 sum when the group has one, else the
    engine's reduce-scatter (chosen there by backend, or the user's custom one): the other
    ranks' pieces in the reduce dtype are what the gloo all-to-all and a ring reduce-scatter
    both send."""
    shard, rs = unit.dp.shard, unit.hooks.reduce_scatter
    if settings.wire is None or not grad.is_floating_point():
        pending = reduce_scatter(dev, shard, grad, out, accumulate, factor, custom=rs)
        return pending, (shard.world_size - 1) * unit.buf.segment * grad.element_size()
    if rs is not None:
        raise ValueError(
            f"ragged_fsdp: {unit!r} has both set_custom_reduce_scatter and fully_shard(gradient_reduce=...); "
            "the custom comm replaces the collective the wire format needs: remove one of them")
    state = unit.wire_state(settings.wire)
    pending = wire_reduce_scatter(dev, shard, grad, out, accumulate, factor, state)
    return pending, (wire_bytes(state.blocks, settings.wire, shard.rank)[0] if shard.world_size > 1 else 0)


# -- 3. after the collective: the all-reduce hook ----------------------------------------
@dataclass
class HookFailure:
    """An exception the all-reduce hook raised on this rank, kept until the end of backward.

    Raising it where it happened would leave the other ranks in the engine's next
    collective until the process-group timeout (30 minutes by default). Instead the rank
    goes on issuing the same collectives as its peers (the failed step's gradients are
    never handed out), and the end-of-backward flag exchange, which every rank reaches,
    carries it: every rank raises there."""

    unit: Unit
    error: Exception


def _run_hook(hook: Callable[[torch.Tensor], None], segment: torch.Tensor, unit: Unit,
              failed: list[HookFailure]) -> bool:
    """Run the hook; False (and the exception in ``failed``) when it raised: the segment is
    then not used (it may be half-written or resized)."""
    try:
        run_all_reduce_hook(hook, segment)
    except Exception as e:  # not KeyboardInterrupt: that one stops this rank at once
        failed.append(HookFailure(unit, e))
        return False
    return True


def _segment(unit: Unit, dtype: torch.dtype) -> torch.Tensor:
    """A segment-sized staging tensor for a reduction's result (from the custom
    reduce-scatter's ``allocate`` when one is set)."""
    buf, rs = unit.buf, unit.hooks.reduce_scatter
    if rs is not None:
        return checked_alloc(rs, "set_custom_reduce_scatter", buf.segment, dtype, buf.device)
    return torch.empty(buf.segment, dtype=dtype, device=buf.device)


def _hook_stage(dev: Device, unit: Unit, out: torch.Tensor, landing: Landing, after: Pending | None,
                failed: list[HookFailure]) -> Pending:
    """FSDP (no replicate dim): run the all-reduce hook on the reduced segment ``out`` once
    the reduction ``after`` finished, then land it (cast or add) in the landing's target if
    it is not that target. Its own lane (the user's stream, when set_all_reduce_hook got
    one), as FSDP2 runs its hook on the all-reduce stream. An exception of the hook goes to
    ``failed``."""
    hooks = unit.hooks
    hook = hooks.all_reduce_hook
    target, accumulate = landing.target, landing.accumulate

    def run() -> None:
        if not _run_hook(hook, out, unit, failed):
            return
        land(out, target, accumulate, cast_first=True)

    lane = HOOK_LANE if hooks.hook_stream is not None else "all_reduce"
    return dev.launch(lane, lambda async_op: None, post=run, keep=(out, target), after=after, out=(target,))


# -- the queue's states -------------------------------------------------------------------
class Phase(enum.Enum):
    SCATTERING = "scattering"  # the shard-dim reduce-scatter is in flight
    ALL_REDUCING = "all_reducing"  # HSDP's replicate-dim all-reduce (or FSDP's all-reduce hook) is in flight
    DONE = "done"


@dataclass(eq=False)
class Reduction:
    """One gradient reduction of one unit, handed out at the end of backward."""

    unit: Unit
    scatter: Pending  # the shard-dim reduce-scatter
    target: torch.Tensor  # the sharded gradient segment being written (its Landing's)
    touched: list[bool]  # per slot: got a gradient on this rank
    had_grad: list[bool]  # per slot: already had a sharded grad before this reduction
    dp: DPMesh  # the ranks it reduced over (its flags are combined over them)
    early: bool = False  # issued before the group's post-backward
    replicate: Pending | None = None  # after `scatter`: HSDP's replicate all-reduce, or FSDP's all-reduce hook
    phase: Phase = Phase.SCATTERING
    sent: int = 0  # bytes this rank sends for the shard-dim reduction (trace's `sent`)

    def finish_scatter(self) -> None:
        if self.phase is Phase.SCATTERING:
            self.scatter.wait()
            self.phase = Phase.ALL_REDUCING if self.replicate is not None else Phase.DONE

    def wait(self) -> None:
        self.finish_scatter()
        if self.phase is Phase.ALL_REDUCING:
            self.replicate.wait()
            self.phase = Phase.DONE


@dataclass(eq=False)
class PartialSum:
    """HSDP without the replicate all-reduce (a shard-dim sum that the unit keeps), or a
    global-order micro-step that folds into the step's running sum: nothing to hand out."""

    unit: Unit
    scatter: Pending
    then: Callable[[], None]  # HSDP: keeps the sum (plus the earlier ones) in the unit; global order: the fold's wait
    phase: Phase = Phase.SCATTERING

    def finish_scatter(self) -> None:
        if self.phase is Phase.SCATTERING:
            self.scatter.wait()
            self.then()
            self.phase = Phase.DONE

    wait = finish_scatter


@dataclass(eq=False)
class Reductions:
    in_flight: list = field(default_factory=list)  # Reduction | PartialSum, issue order
    issued: list[Reduction] = field(default_factory=list)  # this backward's, to hand out
    hook_failures: list[HookFailure] = field(default_factory=list)  # this backward's, raised at hand-out
    folds: dict[int, Fold] = field(default_factory=dict)  # global order: id(unit) -> the step's running sum
    step: Step = field(default_factory=Step)  # global order: the micro-steps of the step that completed
    reduced: set[int] = field(default_factory=set)  # global order: units this backward folded
    staged: dict[int, Unit] = field(default_factory=dict)  # error feedback: units with a staged residual

    # -- the queue ---------------------------------------------------------------------
    def retire(self, keep: int = 0) -> None:
        """Finish the shard-dim collectives until at most ``keep`` are in flight (an HSDP
        all-reduce launched behind one stays in flight on its own lane)."""
        while len(self.in_flight) > keep:
            self.in_flight.pop(0).finish_scatter()

    def wait_all(self) -> None:
        self.retire(0)
        for r in self.issued:
            r.wait()

    def clear(self) -> None:
        """Wait for everything and drop this backward's states (a step that raised). Global
        order: when the backward that raised had folded some units' pieces, the step's sums
        are no longer whole: they go, and the step is broken until :meth:`drop_step`; a
        forward or backward that raised before any unit folded leaves the step as it was (run
        that micro-step again, or the optimizer step finds it missing)."""
        self.wait_all()
        self.issued = []
        self.hook_failures = []
        if self.reduced:
            names = sorted({self.folds[k].name for k in self.reduced if k in self.folds} or {"?"})
            self.step.break_(f"micro-step {self.step.done} raised in its backward after {', '.join(names[:4])}"
                             f"{' ...' if len(names) > 4 else ''} had folded its gradients")
            self.folds = {}
        self.reduced = set()
        self.staged = {}  # the units drop their staged residuals (Unit.drop_grads)

    def drop_step(self) -> None:
        """``abort_step()``: forget the step in progress (its running sums, its count, why it
        broke); the next micro-step is the first of a step."""
        self.folds = {}
        self.reduced = set()
        self.step = Step()

    def discard_staged(self) -> None:
        """A backward raised at its end: drop error feedback's staged residuals."""
        for u in self.staged.values():
            u.discard_residual()
        self.staged = {}

    def forget(self) -> None:
        """Drop this backward's states without waiting (a backward that raised: its
        reductions are never handed out; the collectives stay queued to be waited for)."""
        self.issued = []
        self.hook_failures = []

    def _take_earlier(self, unit: Unit) -> Reduction | None:
        for k, r in enumerate(self.issued):
            if r.unit is unit:
                r.wait()
                self.in_flight = [x for x in self.in_flight if x is not r]
                del self.issued[k]
                return r
        return None

    def _add(self, red: Reduction, queued: bool = True) -> None:
        self.issued.append(red)
        if queued:
            self.in_flight.append(red)
        trace.record("reduce_scatter", red.unit, red.target.numel() * red.target.element_size(), early=red.early,
                     sent=red.sent)

    # -- issuing -----------------------------------------------------------------------
    def reduce_now(self, dev: Device, units: list[Unit], settings: Settings,
                   release: Callable[[], None] | None = None, early: bool = False) -> None:
        """Reduce the gradient buffers of ``units`` now. First the reduction in flight is
        finished (one stays in flight while the next group computes its backward), then every
        buffer is taken, then ``release`` frees the unsharded parameters (before the
        reductions allocate their segments), then one reduction per unit; a device that does
        not overlap them finishes it before backward goes on."""
        self.retire(0)
        taken = [(u, *u.take_grad()) for u in units]
        if release is not None:
            release()
        with record_function("ragged_fsdp::reduce"):
            for u, grad, touched in taken:
                self.reduce(dev, u, grad, touched, settings, early=early)
        if not dev.overlap_reductions:
            self.retire(0)

    def reduce(self, dev: Device, unit: Unit, grad: torch.Tensor, touched: list[bool], settings: Settings,
               early: bool = False) -> None:
        """Reduce ``unit``'s gradient buffer ``grad`` over its data-parallel ranks: the
        variant is picked here, once; each variant runs the stages in order."""
        if settings.wire is not None and settings.wire.error_feedback and grad.is_floating_point():
            self.staged[id(unit)] = unit  # committed at hand-out, discarded when the backward raised
        prev = self._take_earlier(unit)
        if prev is not None:  # late gradients of an early-reduced unit: added into its segment
            touched = [x or y for x, y in zip(touched, prev.touched)]
            early = True
        if settings.order is not None:
            return self._reduce_global(dev, unit, grad, touched, settings, prev, early)
        if unit.dp.replicate is not None:
            return self._reduce_hsdp(dev, unit, grad, touched, settings, prev, early)
        return self._reduce_fsdp(dev, unit, grad, touched, settings, prev, early)

    def _reduce_fsdp(self, dev: Device, unit: Unit, grad: torch.Tensor, touched: list[bool], settings: Settings,
                     prev: Reduction | None, early: bool) -> None:
        """FSDP: one reduce-scatter over the shard dim into the landing's target, or (an
        all-reduce hook) into a segment the hook sees alone, landed after it."""
        landing = choose_landing(unit, settings, prev, grad)
        hooked = unit.hooks.all_reduce_hook is not None
        if landing.adopted:  # nothing to reduce: the unsharded gradient buffer is the sharded one
            stage = _hook_stage(dev, unit, grad, landing, None, self.hook_failures) if hooked else None
            return self._add(Reduction(unit, Pending(), grad, touched, landing.had_grad, unit.dp, early=early,
                                       replicate=stage), queued=False)
        target, factor = landing.target, settings.divide_factor
        if not hooked:
            pending, sent = shard_reduce(dev, unit, grad, target, landing.accumulate, factor, settings)
            return self._add(Reduction(unit, pending, target, touched, landing.had_grad, unit.dp, early=early,
                                       sent=sent))
        # the hook sees this reduction's result alone (before it is cast or added into
        # gradients accumulated earlier), as FSDP2's hook sees its reduce-scatter output
        out = target if not landing.accumulate and grad.dtype == target.dtype else _segment(unit, grad.dtype)
        pending, sent = shard_reduce(dev, unit, grad, out, False, factor, settings)
        stage = _hook_stage(dev, unit, out, landing, pending, self.hook_failures)
        self._add(Reduction(unit, pending, target, touched, landing.had_grad, unit.dp, early=early, replicate=stage,
                            sent=sent))

    def _reduce_hsdp(self, dev: Device, unit: Unit, grad: torch.Tensor, touched: list[bool], settings: Settings,
                     prev: Reduction | None, early: bool) -> None:
        """HSDP: sum over the shard dim (one reduce-scatter), then sum over the replicate dim
        (one all-reduce, its own lane) and divide by every data-parallel rank as it lands.
        With ``set_requires_all_reduce(False)`` the shard-dim sums pile up instead and the
        sharded grads stay as they are, until a reduction that all-reduces (as torch's HSDP:
        the replicate all-reduce is what gradient accumulation skips)."""
        buf, dp = unit.buf, unit.dp
        earlier, earlier_touched = unit.take_partial()
        if earlier_touched is not None:
            touched = [x or y for x, y in zip(touched, earlier_touched)]
        if not settings.requires_all_reduce:
            partial = _segment(unit, grad.dtype)

            def keep():
                if earlier is not None:
                    partial.add_(earlier)
                unit.keep_partial(partial, touched)

            first, sent = shard_reduce(dev, unit, grad, partial, False, 1.0, settings)
            self.in_flight.append(PartialSum(unit, first, keep))
            trace.record("reduce_scatter", unit, partial.numel() * partial.element_size(), early=early, sent=sent)
            return
        landing = choose_landing(unit, settings, prev)
        target, accumulate = landing.target, landing.accumulate
        # the common case (nothing accumulates, same dtype): reduce straight into the new
        # sharded gradient segment and all-reduce it in place: no second segment, no copy
        direct = earlier is None and not accumulate and grad.dtype == buf.dtype
        partial = target if direct else _segment(unit, grad.dtype)
        factor = float(settings.divide_factor or dp.size)
        first, sent = shard_reduce(dev, unit, grad, partial, False, 1.0, settings)

        def before() -> None:
            if earlier is not None:
                partial.add_(earlier)

        hook = unit.hooks.all_reduce_hook
        failed = self.hook_failures

        def after() -> None:
            if hook is None:
                land(partial, target, accumulate, factor, scratch=True)
                return
            # the hook sees the divided sum (divided in place, in the reduce dtype) before it
            # lands in the grads, cast first
            land(partial, partial, False, factor)
            if _run_hook(hook, partial, unit, failed):
                land(partial, target, accumulate, cast_first=True)

        keep = (partial, target) + ((earlier,) if earlier is not None else ())
        second = all_reduce(dev, dp.replicate, partial, pre=before, post=after, after=first, keep=keep, out=(target,))
        self._add(Reduction(unit, first, target, touched, landing.had_grad, dp, early=early, replicate=second,
                            sent=sent))
        trace.record("all_reduce", unit, 0 if direct else partial.numel() * partial.element_size())

    def _reduce_global(self, dev: Device, unit: Unit, grad: torch.Tensor, touched: list[bool], settings: Settings,
                       prev: Reduction | None, early: bool) -> None:
        """Global order (:mod:`.global_order`): fold this micro-step's pieces into the
        unit's running sum; the step's last micro-step lands it in the sharded grads."""
        check_unit(unit, settings.wire)
        if prev is not None:
            raise RuntimeError(
                f"ragged_fsdp.global_order: {unit!r} got gradients after its early reduction in the same backward "
                "(a parameter used after its owner module ran), so this micro-step would be folded in two parts; "
                "wrap the module that uses it in the same fully_shard as its owner")
        dp, order = unit.dp, settings.order
        last = self.step.done == order.micro_steps(dp.size) - 1
        fold = self.folds.get(id(unit))
        first = fold is None
        if first:
            fold = self.folds[id(unit)] = Fold(torch.empty(unit.buf.segment, dtype=torch.float32, device=grad.device),
                                               0, touched, unit.group_name())
        else:
            fold.touched = [x or y for x, y in zip(fold.touched, touched)]
        fold.done += 1
        self.reduced.add(id(unit))
        if not last:
            scatter, second = ordered_reduce(dev, dp.shard, dp.replicate, grad, fold.acc, first, None)
            self.in_flight.append(PartialSum(unit, scatter, (second.wait if second is not None else lambda: None)))
            trace.record("reduce_scatter", unit, fold.acc.numel() * 4, early=early)
            return
        del self.folds[id(unit)]
        landing = choose_landing(unit, settings)
        factor = float(settings.divide_factor or order.micro_batches)
        scatter, second = ordered_reduce(dev, dp.shard, dp.replicate, grad, fold.acc, first,
                                         (landing.target, landing.accumulate, factor))
        self._add(Reduction(unit, scatter, landing.target, fold.touched, landing.had_grad, dp, early=early,
                            replicate=second))

    def end_micro_step(self, groups: list) -> None:
        """Global order, at the end of every backward (before :meth:`end_backward`): one more
        micro-step of the step completed. A unit this backward did not reduce (its modules
        did not run) folds nothing for it; on the step's last micro-step its sum lands now,
        from what it folded (no collective: its pieces are all in), so every unit's step
        ends together and nothing carries into the next step."""
        ordered = [(g, u) for g in groups if g.global_order is not None for u in g.units if u.trainable]
        if not ordered:
            return
        reduced, self.reduced = self.reduced, set()
        g0, u0 = ordered[0]
        last = self.step.done == g0.global_order.micro_steps(u0.dp.size) - 1
        if last:
            for g, u in ordered:
                fold = self.folds.get(id(u))
                if fold is None or id(u) in reduced:
                    continue
                settings = g.settings()
                del self.folds[id(u)]
                landing = choose_landing(u, settings)
                factor = float(settings.divide_factor or settings.order.micro_batches)
                pending = g.dev.launch("reduce_scatter", lambda async_op: None,
                                       post=lambda a=fold.acc, t=landing.target, acc=landing.accumulate, f=factor:
                                       land(a, t, acc, f, scratch=True),
                                       keep=(fold.acc, landing.target), out=(landing.target,))
                self._add(Reduction(u, pending, landing.target, fold.touched, landing.had_grad, u.dp))
        self.step.done = 0 if last else self.step.done + 1

    # -- the end of backward -------------------------------------------------------------
    def end_backward(self, groups: list[HandedOut]) -> None:
        """After every reduction finished, per set of data-parallel process groups: exchange
        the flags (:func:`exchange_flags`, which raises on every rank when a hook raised on
        any rank of it, before its gradients are handed out), hand the gradients out
        (:func:`hand_out`); then commit error feedback's residuals (:func:`commit_residuals`).
        ``groups`` (in the root's order) orders the flags the same on every rank."""
        self.wait_all()
        order = {id(u): k for k, g in enumerate(groups) for u in g.units}
        describe = {id(u): g.describe() for g in groups for u in g.units}
        issued = sorted(self.issued, key=lambda r: order.get(id(r.unit), len(order)))
        self.issued = []
        failures, self.hook_failures = self.hook_failures, []
        # one flag all-reduce per set of process groups, not per DPMesh object: every
        # fully_shard call makes its own DPMesh over the same groups, and a blocking host
        # all-reduce per group and step is a round trip per block at the end of backward
        by_dp: dict[tuple, list[Reduction]] = {}
        for r in issued:
            by_dp.setdefault(_dp_key(r.dp), []).append(r)
        for key, items in by_dp.items():
            here = [f for f in failures if _dp_key(f.unit.dp) == key]
            got = exchange_flags(items, here, describe)
            hand_out(items, got)
        # the backward completed and no rank's hook failed (a raise above leaves the
        # residuals staged, and the abort drops them)
        commit_residuals(groups)
        self.staged = {}


# -- 4-6. the end of backward ----------------------------------------------------------------
def exchange_flags(items: list[Reduction], failures: list[HookFailure], describe: dict[int, str]) -> list[int]:
    """One all-reduce (MAX) over the data-parallel mesh of ``items`` (its shard dim, and its
    replicate dim under HSDP), on the host: per slot of every reduction "got a gradient on
    some rank", returned in ``items``' order. The same exchange carries, per reduction,
    (early, not early): every rank must have issued it at the same point, or the collectives
    paired different buffers (MAX makes a mismatch (1, 1)); and last, 1 + the global rank of
    the highest rank whose all-reduce hook raised (``failures``: this rank's). Either one
    raises here, on every rank of the mesh."""
    dp = items[0].dp
    early = [v for r in items for v in (int(r.early), 1 - int(r.early))]
    failed_on = [dist.get_rank() + 1 if failures and dist.is_initialized() else int(bool(failures))]
    got = agree_flags([int(f) for r in items for f in r.touched] + early + failed_on,
                      [c.group for c in (dp.shard, dp.replicate) if c is not None])
    failed_rank = got.pop()
    if failed_rank:
        _raise_hook_failure(failures, got_rank=failed_rank - 1, describe=describe)
    n_touched = len(got) - len(early)
    mixed = [r for k, r in enumerate(items) if got[n_touched + 2 * k: n_touched + 2 * k + 2] == [1, 1]]
    if mixed:
        raise RuntimeError(
            f"ragged_fsdp: the gradient reduction of {describe.get(id(mixed[0].unit), '?')} (buffer {mixed[0].unit.index}) "
            "ran early on some ranks and at the end of backward on others, so the collectives of that "
            "backward paired different buffers. The modules owning its parameters must run (with inputs "
            "that need grad) on every rank; wrap the ones that run on some ranks only in their own fully_shard.")
    del got[n_touched:]
    return got


def hand_out(items: list[Reduction], got: list[int]) -> None:
    """Each unit points its sharded grads into its finished reduction's segment; ``got``: per
    slot of every reduction, in order, "got a gradient on some rank" (:func:`exchange_flags`).
    A parameter no rank produced a gradient for keeps ``.grad = None``."""
    # grads offload: every copy to the host is issued before the first is waited for
    moved = [r.unit.grads_to_host(r.target) for r in items]
    k = 0
    for r, (target, copy) in zip(items, moved):
        n = len(r.touched)
        if copy is not None:
            copy.wait()
        r.unit.hand_out(target, [bool(x) for x in got[k:k + n]], r.had_grad)
        if copy is not None:
            r.unit.forget_grad_segment()  # accumulate into a device segment, never the host one
            r.target = target  # the device segment has no other owner: freed here
        k += n


def commit_residuals(groups: list[HandedOut]) -> None:
    """The backward completed and no rank's hook failed: error feedback's staged residuals
    are the residuals now."""
    for g in groups:
        for u in g.units:
            u.commit_residual()


def _dp_key(dp: DPMesh) -> tuple:
    return id(dp.shard.group), id(dp.replicate.group) if dp.replicate is not None else None


def _raise_hook_failure(failures: list[HookFailure], got_rank: int, describe: dict[int, str]) -> None:
    """Every rank of a mesh where an all-reduce hook raised in this backward raises here:
    the ranks where it raised their own exception, the others a RuntimeError naming a rank
    where it did. None of the backward's gradients are handed out."""
    if failures:
        f = failures[0]
        f.error.add_note(
            f"ragged_fsdp: raised by the set_all_reduce_hook hook of {describe.get(id(f.unit), '?')} (buffer "
            f"{f.unit.index}); kept until the end of backward and raised on every rank, so that no rank waits "
            "for this one in a collective. This backward's gradients were not handed out")
        raise f.error
    raise RuntimeError(
        f"ragged_fsdp: the set_all_reduce_hook hook raised on rank {got_rank} in this backward (the highest rank "
        "where it raised; its own exception is raised there); every rank raises at the end of that backward "
        "instead of waiting for it in a collective. This backward's gradients were not handed out: call "
        "zero_grad() and go on, or stop on every rank")
