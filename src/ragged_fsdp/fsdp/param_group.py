"""ParamGroup: the parameters of one ``fully_shard`` call and their life in a step.

Data: one :class:`DBuffer` per (dtype, trainable) kind of parameter, laid out by the planner,
and one :class:`ParamInfo` per parameter (its slot, where the module registers it, the
sharded RaggedShard parameter and, once made, the unsharded parameter).

Sharded state (which parameters the modules hold)::

    SHARDED --unshard()--> (all-gather in flight) --wait_for_unshard()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED

Training state (where the step is)::

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE --pre_backward--> PRE_BACKWARD
    PRE_BACKWARD --post_backward (last use)--> POST_BACKWARD --final callback--> IDLE

Gradients: at pre-backward the group zeroes one unsharded gradient buffer per DBuffer and
makes the unsharded parameters' ``.grad`` aliases into it, so autograd accumulates in place
(in the reduce dtype, via ``grad_dtype``). After the group's last use in backward, one
reduce-scatter per DBuffer produces the sharded gradient segment; the sharded parameters'
``.grad`` become views into it when the backward ends.
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.autograd.profiler import record_function
from torch.distributed.tensor import DTensor

from ragged_fsdp.dbuffer import DBuffer, plan_layout
from ragged_fsdp.dbuffer.planning import parse_granularity
from ragged_fsdp.placement import RaggedDTensor
from ragged_fsdp.placement.dtensor import my_piece, spec_mismatch

from .collectives import Comm, all_gather, all_reduce_sum, reduce_scatter
from .consistency import check_same_layout
from .device import Device, Pending
from .hooks import attach_post_backward, in_backward
from .mesh_info import DPMesh, ParamPlacement
from .quant_gather import attach_quant, fp8_granularity, quant_all_gather
from .saved import eager as _eager
from .saved import start_watch, stop_watch, watching
from .sharded_param import local_of, make_sharded_grad, make_sharded_param, repoint

__all__ = ["ParamGroup", "ParamInfo", "ShardedState", "TrainingState"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"
    # reshard_after_forward=k: each rank keeps 1/k of the unsharded buffer after forward;
    # the backward all-gather runs within the k ranks of its node
    SHARDED_POST_FORWARD = "sharded_post_forward"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclass
class ParamInfo:
    fqn: str  # as in the wrapped module's named_parameters()
    buffer: int  # index into ParamGroup.buffers
    slot: int  # index into that buffer's layout
    owners: list[tuple[nn.Module, str]]  # every (module, attribute) registering it (tied params)
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    unsharded_spec: Any = None  # DTensorSpec of a TP/EP parameter's unsharded DTensor, or None
    dp_dims: tuple[int, ...] = ()  # dims of that spec's mesh that are data-parallel (dp_mesh_dims)

    def register(self, param: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = param


@dataclass
class _Reduction:
    """One in-flight gradient reduction of one DBuffer."""

    buffer: int
    pending: Any  # Pending or _ThenAllReduce: .wait() finishes the reduction
    target: torch.Tensor  # the sharded gradient segment being written
    touched: list[bool]  # per slot: got a gradient on this rank
    had_grad: list[bool]  # per slot: already had a sharded grad before this reduction
    dp: DPMesh | None = None  # the ranks it reduced over (its flags are combined over them)
    early: bool = False  # issued before the group's post-backward (see ParamGroup._buffer_done)


class _ThenAllReduce:
    """HSDP: the reduce-scatter over the shard dim, then (when it is done) the sum over the
    replicate dim and the divide, into the sharded gradient segment."""

    def __init__(self, first: Pending, then: Callable[[], None]):
        self.first, self.then = first, then

    def wait(self) -> None:
        if self.first is not None:
            self.first.wait()
            self.first = None
            self.then()


@dataclass
class _Forward:
    """What the forward calls since the group's last backward left for backward to use.

    Reset at the group's next forward after a backward ended, not at the end of a backward:
    a step may run several backward passes over one forward (``retain_graph``, chunked
    losses), and each needs to know how many calls its graph holds."""

    ran: bool = False  # ran forward with grad enabled
    calls: int = 0  # forward calls with a PostBackward node on their inputs
    blind: bool = False  # a call whose inputs needed no grad: only the final callback sees it
    stale: bool = False  # a backward ended since: the next forward starts a new count
    # what the saved-tensor watch saw (see saved.py): decides which buffers backward needs
    seen: int = 0  # tensors autograd saved during the group's forward calls
    saved: set[int] = field(default_factory=set)  # buffers whose storage was saved
    unknown: bool = False  # a call ran without the watch (other hooks active) or saw opaque tensors
    outside: set[int] = field(default_factory=set)  # buffers saved outside their owner modules' calls
    # per buffer reduced on its own (see ParamGroup._buffer_done): calls of its owner
    # modules with a PostBackward node on their inputs, and buffers some call left blind
    buffer_calls: dict[int, int] = field(default_factory=dict)
    buffer_blind: set[int] = field(default_factory=set)


@dataclass
class _Backward:
    """One backward pass (reset by the final callback after every ``backward()``)."""

    fired: int = 0  # PostBackward nodes of this group that ran in this backward
    deferred_prefetch: "ParamGroup | None" = None  # the root's: issued at its first gradient
    post_forward_indices: list[int] = field(default_factory=list)
    reduced: list[_Reduction] = field(default_factory=list)  # reductions issued in it
    buffer_fired: dict[int, int] = field(default_factory=dict)  # owner-module PostBackward firings
    early: set[int] = field(default_factory=set)  # buffers reduced before the group's post-backward


def _local_grad(g: DTensor, spec, dp_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """A TP/EP parameter's DTensor gradient as a local tensor in the parameter's own
    placements (a Partial gradient, e.g. of a norm weight under SequenceParallel, is summed
    over its TP ranks first, as torch's FSDP2 does). Data-parallel dims are left as they
    are: a Partial there is exactly what the reduction sums."""
    with torch.no_grad():
        want = tuple(g.placements[i] if i in dp_dims else p for i, p in enumerate(spec.placements))
        if tuple(g.placements) != want:
            g = g.redistribute(g.device_mesh, want)
        local = g.to_local()
        if type(local).__name__ == "AsyncCollectiveTensor":
            local = local.wait()
    return local


def _embedding_only(owners) -> bool:
    """A parameter only one nn.Embedding registers, as its weight (not tied to a head)."""
    return len(owners) == 1 and isinstance(owners[0][0], nn.Embedding) and owners[0][1] == "weight"


class ParamGroup:
    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        modules: tuple[nn.Module, ...],
        placed: list[ParamPlacement],
        device: torch.device,
        dev: Device,
        mp_policy,
        granularity_fn: Callable[[str, nn.Parameter], Any] | None,
        reshard_after_forward: bool | int,
        all_gather_quant=None,
    ):
        self.modules = modules
        self.dps: list[DPMesh] = []  # the data-parallel meshes of its buffers, in first-use order
        for pl in placed:
            if not any(pl.dp is d for d in self.dps):
                self.dps.append(pl.dp)
        self.buffer_dp: list[DPMesh] = []  # per buffer
        self.device = device
        self.dev = dev
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.unshard_in_backward: bool | None = None  # None: skip buffers backward provably needs not
        self.gradient_divide_factor: float | None = None
        self.requires_all_reduce = True  # HSDP: sum over the replicate dim after the reduce-scatter
        self._partial: dict[int, torch.Tensor] = {}  # HSDP, per buffer: reduced over shard only
        self._partial_touched: dict[int, list[bool]] = {}
        self.fqn = ""  # module path from the root, for messages
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.ctx = None  # the root's shared context (set at lazy init)
        self._gathering: list[Pending] | None = None
        self.post_forward_comms: list[Comm | None] = []  # per buffer, for reshard_after_forward=int
        self._kept: list[torch.Tensor | None] = []  # per buffer: the part kept after forward
        self._last_grad_seg: list[weakref.ref | None] = []
        self.fwd = _Forward()
        self.bwd = _Backward()
        self._freed: set[int] = set()  # buffers freed while the group counts as unsharded
        self._gathered_now: list[int] = []  # buffers the all-gathers in flight fill
        self._embedding_buffers: set[int] = set()  # buffers of untied nn.Embedding weights only
        self._watch = None  # the saved-tensor watch of the forward call running now
        self._recomputed = False  # forward ran again inside backward (activation checkpointing)
        self.buffers: list[DBuffer] = []
        self.infos: list[ParamInfo] = []
        self.all_gather_quant = all_gather_quant  # a BlockFP8 policy or None
        self._build(params, placed, granularity_fn)

    @property
    def comm(self) -> Comm:
        """The shard-dim communicator of the group's (first) data-parallel mesh."""
        return self.dps[0].shard

    @property
    def mesh(self) -> DeviceMesh:
        return self.dps[0].mesh

    def comm_of(self, b: int) -> Comm:
        return self.buffer_dp[b].shard

    # -- construction ----------------------------------------------------------------------
    def _build(self, params, placed: list[ParamPlacement], granularity_fn) -> None:
        # One DBuffer per (dtype, trainable, fp8-gathered, embedding) kind. Embedding weights
        # get their own: their gradients arrive at the very end of backward (the others' near
        # the start), and their backward needs only the indices, so that buffer is neither
        # kept unsharded nor re-gathered for backward (see _skip_in_backward).
        # (A shard_placement_fn may give some parameters another data-parallel mesh, e.g.
        # experts over the dp ranks of their EP group: those get their own buffers.)
        kinds: dict[tuple[int, torch.dtype, bool, bool, bool], list[int]] = {}
        quant = self.all_gather_quant
        dp_index = {id(d): k for k, d in enumerate(self.dps)}
        for i, (name, p, owners) in enumerate(params):
            fp8 = quant is not None and quant.applies(name, placed[i].data)  # fp8-gathered tensors: own buffer
            key = (dp_index[id(placed[i].dp)], p.dtype, p.requires_grad, fp8, _embedding_only(owners))
            kinds.setdefault(key, []).append(i)
        layouts: list = [None] * len(kinds)
        for k, dp in enumerate(self.dps):
            mine = [(j, key, idx) for j, (key, idx) in enumerate(kinds.items()) if key[0] == k]
            error = None
            try:
                for j, (_, dtype, _, fp8, _), idx in mine:
                    layouts[j] = self._plan(params, placed, idx, dtype, granularity_fn, dp.shard.world_size,
                                            dp.shard.rank, fp8)
            except (ValueError, NotImplementedError, TypeError) as e:
                error = e
            # Every rank must have planned the same layout, or the all-gathers silently mix
            # different tensors (or hang when the sizes differ): one small all-reduce to check.
            check_same_layout(dp.shard, dp.mesh, [layouts[j] for j, _, _ in mine],
                              [params[idx[0]][1].dtype for _, _, idx in mine], error, self._describe())
        for layout, ((dpk, dtype, _, fp8, embedding), idx) in zip(layouts, kinds.items()):
            compute, reduce_ = self._mp_dtypes(dtype)
            buf = DBuffer(layout, device=self.device, dtype=dtype, compute_dtype=compute, reduce_dtype=reduce_)
            if fp8:
                attach_quant(buf, quant)
            b = len(self.buffers)
            if embedding:
                self._embedding_buffers.add(b)
                for i in idx:
                    for module, _ in params[i][2]:
                        module.register_forward_pre_hook(_eager(self._embedding_pre_forward))
            self.buffers.append(buf)
            self.buffer_dp.append(self.dps[dpk])
            self.post_forward_comms.append(None)
            self._last_grad_seg.append(None)
            for j, i in enumerate(idx):
                name, p, owners = params[i]
                pl = placed[i]
                data = pl.data.detach()
                buf.copy_full_(j, data.to(self.device) if data.device.type not in ("meta", self.device.type) else data)
                s = buf.slots[j]
                sharded = make_sharded_param(buf.sharded_view(j), pl.mesh, pl.with_ragged(s.placement),
                                             tuple(p.shape), p.requires_grad)
                info = ParamInfo(name, b, j, owners, sharded, unsharded_spec=pl.unsharded_spec, dp_dims=pl.dp_dims)
                info.register(sharded)
                self.infos.append(info)
        self._hook_owner_modules()

    def _hook_owner_modules(self) -> None:
        """A group with several trainable buffers (the root: embedding apart from the norm and
        head) may finish one long before the others. Each owner module of such a buffer gets
        a PostBackward node on its inputs, so the buffer can be reduced and freed as soon as
        all its owners' backward ran (see :meth:`_buffer_done`). Buffers that a top module of
        the group registers directly, or an embedding weight (whose input is token ids), are
        left to the group's post-backward."""
        self._early_buffers: set[int] = set()  # buffers _buffer_done may reduce before the post-backward
        trainable = [b for b in range(len(self.buffers))
                     if any(i.buffer == b and i.sharded.requires_grad for i in self.infos)]
        if len(trainable) < 2:
            return
        tops = {id(m) for m in self.modules}
        by_module: dict[int, tuple[nn.Module, list[int]]] = {}
        for b in trainable:
            if b in self._embedding_buffers:
                continue
            owners = {id(m): m for i in self.infos if i.buffer == b for m, _ in i.owners}
            if tops & owners.keys():
                continue
            for k, m in owners.items():
                by_module.setdefault(k, (m, []))[1].append(b)
        for m, bs in by_module.values():
            hook = _eager(functools.partial(self._owner_pre_forward, tuple(bs)))
            m.register_forward_pre_hook(hook, with_kwargs=True)
            m.register_forward_hook(_eager(functools.partial(self._owner_post_forward, tuple(bs))), always_call=True)
        self._early_buffers = {b for _, bs in by_module.values() for b in bs}

    def _plan(self, params, placed, idx, dtype, granularity_fn, W, rank, fp8=False):
        """Plan one buffer over ``W`` ranks. The shapes packed are the tensors the data-
        parallel split applies to (TP/EP-local for DTensor parameters); ``granularity_fn``
        is asked about the parameter and applies to that local tensor."""
        tensors, keys = [], set()
        for j, i in enumerate(idx):
            name, p, _ = params[i]
            shape = tuple(placed[i].data.shape)
            spec = None
            if granularity_fn is not None:
                raw = granularity_fn(name, p)
                try:
                    spec = parse_granularity(raw)
                except ValueError as e:
                    raise ValueError(f"fully_shard: granularity_fn returned {raw!r} for {name!r}: {e}") from e
            if fp8:
                spec = fp8_granularity(self.all_gather_quant, name, shape, spec)
            key = name if name not in keys else f"{name}#{j}"  # list groups may repeat names
            keys.add(key)
            tensors.append((key, shape, spec))
        try:
            return plan_layout(tensors, W, rank, itemsize=torch.empty((), dtype=dtype).element_size())
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"fully_shard: cannot lay out the parameters of {self._describe()}: {e}") from e

    def _mp_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        if not dtype.is_floating_point:
            return dtype, dtype
        compute = self.mp_policy.param_dtype or dtype
        reduce_ = self.mp_policy.reduce_dtype or compute
        return compute, reduce_

    def _describe(self) -> str:
        return self.fqn or ", ".join(type(m).__name__ for m in self.modules)

    # -- views ---------------------------------------------------------------------------
    def _unsharded_param(self, info: ParamInfo) -> nn.Parameter:
        buf = self.buffers[info.buffer]
        p = info.unsharded
        if p is None:
            view = buf.unsharded_views()[info.slot]
            spec = info.unsharded_spec
            if spec is not None:
                # a TP/EP parameter: the module computes with a DTensor of its own mesh and
                # placements whose local tensor is the gathered view (as before fully_shard)
                view = DTensor.from_local(view, spec.mesh, spec.placements, run_check=False,
                                          shape=spec.shape, stride=spec.stride)
            p = info.unsharded = nn.Parameter(view, requires_grad=info.sharded.requires_grad)
            if buf.reduce_dtype != buf.compute_dtype and spec is None:
                p.grad_dtype = buf.reduce_dtype
            if p.requires_grad:
                p.register_hook(functools.partial(self._on_grad, info))
                p.register_post_accumulate_grad_hook(self._after_grad)
        elif p.requires_grad != info.sharded.requires_grad:
            p.requires_grad_(info.sharded.requires_grad)
        return p

    def check_materialized(self) -> None:
        meta = [i.fqn for i in self.infos if self.buffers[i.buffer].device.type == "meta"]
        if meta:
            raise RuntimeError(
                f"fully_shard: parameters of {self._describe()} are still on the meta device "
                f"({', '.join(meta[:5])}{'...' if len(meta) > 5 else ''}); materialise them first, "
                "e.g. model.to_empty(device=...) and then reset_parameters()/init_weights()"
            )

    # -- unshard / reshard -------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @property
    def holds_unsharded(self) -> bool:
        """Unsharded parameters exist or an all-gather filling them is in flight."""
        return self.is_unsharded or self._gathering is not None

    def _to_gather(self) -> list[int]:
        if self.sharded_state is ShardedState.UNSHARDED:
            todo = sorted(self._freed)
        else:
            todo = list(range(len(self.buffers)))
        if self.training_state is TrainingState.PRE_BACKWARD:
            skip = self._skip_in_backward()
            todo = [b for b in todo if b not in skip]
        return todo

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gathers (no-op when unsharded or already in flight)."""
        if self._gathering is not None:
            return
        if self.training_state is TrainingState.PRE_BACKWARD and self.unshard_in_backward is False:
            return
        todo = self._to_gather()
        if not todo:
            return
        self.check_materialized()
        with record_function("ragged_fsdp::all_gather"):
            if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                pend = [all_gather(self.dev, self.post_forward_comms[b], self.buffers[b], inp=self._kept[b]) for b in todo]
            else:
                pend = [(quant_all_gather if self.buffers[b].quant else all_gather)(self.dev, self.comm_of(b), self.buffers[b])
                        for b in todo]
        self._gathering = [p for p in pend if p is not None]
        self._gathered_now = todo

    def wait_for_unshard(self) -> None:
        if self._gathering is None:
            return
        with record_function("ragged_fsdp::wait_all_gather"):
            for p in self._gathering:
                p.wait()
        self._gathering = None
        gathered = set(self._gathered_now)
        if self.sharded_state is ShardedState.UNSHARDED:
            self._freed -= gathered
        else:
            self._freed = set(range(len(self.buffers))) - gathered
        for info in self.infos:
            if info.buffer in gathered:
                info.register(self._unsharded_param(info))
        self.sharded_state = ShardedState.UNSHARDED
        self._kept = []

    def reshard(self) -> None:
        if self._gathering is not None:  # never free memory a collective still writes
            for p in self._gathering:
                p.wait()
            self._gathering = None
            if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                self.sharded_state = ShardedState.UNSHARDED  # the gathered data is there
        if self.sharded_state is not ShardedState.SHARDED:
            for info in self.infos:
                info.register(info.sharded)
            self.sharded_state = ShardedState.SHARDED
        self._kept = []
        self._freed = set()
        for buf in self.buffers:
            buf.free_unsharded()

    def _free_buffers(self, which) -> None:
        """Free some buffers while the group stays unsharded (the next unshard re-gathers
        them); their parameters are registered sharded meanwhile."""
        which = set(which) - self._freed
        if not which:
            return
        for b in which:
            self.buffers[b].free_unsharded()
        for info in self.infos:
            if info.buffer in which:
                info.register(info.sharded)
        self._freed |= which

    def _skip_in_backward(self) -> set[int]:
        """Buffers the coming backward need not gather: embedding weights (their backward
        reads only the indices) whose storage autograd provably did not save. Never for a
        group whose forward ran without the watch, under activation checkpointing (the
        recompute reads the weights) or with tied weights (not in an embedding buffer)."""
        if self.unshard_in_backward is False:
            return set(range(len(self.buffers)))
        f = self.fwd
        if self.unshard_in_backward is True or self._recomputed or not f.ran or f.unknown or f.seen == 0:
            return set()
        return {b for b in self._embedding_buffers if b not in f.saved}

    def reshard_post_forward(self) -> None:
        """Keep this rank's 1/k part of each unsharded buffer (k = reshard_after_forward),
        free the rest; the next unshard gathers within the node."""
        if not self.post_forward_comms or any(c is None for c in self.post_forward_comms):
            return self.reshard()
        if not self.is_unsharded:
            self.wait_for_unshard()
        kept = []
        for b, buf in enumerate(self.buffers):
            k, j = self.post_forward_comms[b].world_size, self.post_forward_comms[b].rank
            part = buf.layout.total // k
            kept.append(buf.unsharded.narrow(0, j * part, part).clone())
            buf.free_unsharded()
        for info in self.infos:
            info.register(info.sharded)
        self._kept = kept
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    # -- forward -------------------------------------------------------------------------
    def pre_forward(self, args: tuple, kwargs: dict, first_module: bool) -> tuple[tuple, dict]:
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_for_unshard()
        if torch.is_grad_enabled() and first_module:
            if self.fwd.stale:
                self.fwd = _Forward()
            self.fwd.ran = True
            self._start_watch()
            args, kwargs, attached = attach_post_backward(self._post_backward_from_autograd, args, kwargs)
            if attached:
                self.fwd.calls += 1
            else:
                self.fwd.blind = True
        return args, kwargs

    def recompute_forward(self) -> None:
        """Forward run again inside backward (activation-checkpoint recomputation)."""
        self._recomputed = True  # from now on backward always gathers everything
        self.unshard()
        self.wait_for_unshard()
        if torch.is_grad_enabled() and not self.fwd.ran:
            # reentrant checkpoint: the first forward ran without grad
            self.fwd.ran = True
            self.fwd.blind = True

    def _embedding_pre_forward(self, module, args) -> None:
        """Each call of an embedding whose buffer backward might skip: the watch must be what
        sees its saved tensors (not an activation checkpoint's hooks), and a recomputation
        inside backward gets its weights gathered on the spot."""
        if in_backward():
            self.recompute_forward()
            return
        if not torch.is_grad_enabled():
            return
        w = self._watch
        if w is None or not watching(w):
            self.fwd.unknown = True

    def _start_watch(self) -> None:
        if not (self._embedding_buffers or self._early_buffers) or self._watch is not None:
            return
        storages = {self.buffers[b].unsharded.untyped_storage().data_ptr(): b
                    for b in sorted(self._embedding_buffers | self._early_buffers) if b not in self._freed}
        self._watch = start_watch(storages)
        if self._watch is None:
            self.fwd.unknown = True

    def _stop_watch(self) -> None:
        w, self._watch = self._watch, None
        if w is None:
            return
        stop_watch(w)
        self.fwd.seen += w.seen
        self.fwd.saved |= w.hit
        self.fwd.outside |= w.outside
        self.fwd.unknown |= w.opaque

    def post_forward(self) -> None:
        self._stop_watch()
        raf = self.reshard_after_forward
        if raf is True or (raf is not False and not torch.is_grad_enabled()):
            self.reshard()  # (no backward follows a no-grad forward: keep nothing)
        elif raf is not False:
            self.reshard_post_forward()
        elif torch.is_grad_enabled():
            self._free_buffers(self._skip_in_backward())  # kept for backward, which needs them not
        if torch.is_grad_enabled():
            order = self.ctx.post_forward_order
            self.bwd.post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE

    # -- backward ------------------------------------------------------------------------
    def pre_backward(self, implicit_prefetch: bool) -> None:
        if self.training_state is TrainingState.PRE_BACKWARD and self.is_unsharded:
            return  # another output of the same group: already prepared
        self.training_state = TrainingState.PRE_BACKWARD
        with record_function("ragged_fsdp::pre_backward"):
            self.unshard()
            self.wait_for_unshard()
        if implicit_prefetch and self.bwd.post_forward_indices:
            i = self.bwd.post_forward_indices.pop()
            if i > 0:
                nxt = self.ctx.post_forward_order[i - 1]
                if self._is_root_group() and any(x.sharded.requires_grad for x in self.infos):
                    # the root's pre-backward fires on its output's gradient, while the loss's
                    # logits-sized temporaries may still be live: gather the next group once
                    # the root's first gradient is in (see _after_grad)
                    self.bwd.deferred_prefetch = nxt
                else:
                    nxt.prefetch(TrainingState.PRE_BACKWARD)

    def _is_root_group(self) -> bool:
        states = self.ctx.all_states if self.ctx is not None else []
        return bool(states) and states[0].group is self

    def prefetch(self, state: TrainingState) -> None:
        if self.is_unsharded or self._gathering is not None:
            return
        prev = self.training_state
        self.training_state = state if prev is TrainingState.IDLE else prev
        try:
            self.unshard(async_op=True)
        finally:
            self.training_state = prev

    def _on_grad(self, info: ParamInfo, grad: torch.Tensor) -> torch.Tensor:
        """Runs before autograd accumulates a gradient into an unsharded parameter: the
        group's gradient buffer exists from its first gradient on (not from pre-backward),
        and the parameter's ``.grad`` becomes an alias into it, so the accumulation that
        follows writes into the buffer in place."""
        buf = self.buffers[info.buffer]
        if buf.grad is None:
            buf.alloc_grad()
        p = info.unsharded
        alias = buf.grad_view(info.slot)
        if info.unsharded_spec is not None:
            # a TP/EP DTensor: autograd keeps its own DTensor gradient (its placements may
            # be Partial); post_backward moves it to the parameter's placements and adds it in
            pass
        elif p is not None and p.grad is not alias:
            if p.grad is None:
                p.grad = alias
            else:
                self._fold_foreign_grad(info)
        return grad

    def _after_grad(self, param: torch.Tensor) -> None:
        """After autograd added a gradient into the buffer: issue the backward prefetch this
        group deferred (see pre_backward)."""
        nxt, self.bwd.deferred_prefetch = self.bwd.deferred_prefetch, None
        if nxt is not None:
            nxt.prefetch(TrainingState.PRE_BACKWARD)

    def _fold_foreign_grads(self, b: int | None = None) -> None:
        """Add into the gradient buffers (of buffer ``b``, or all) every gradient autograd
        made on its own instead of accumulating into the alias."""
        for info in self.infos:
            p = info.unsharded
            if p is None or p.grad is None or (b is not None and info.buffer != b):
                continue
            buf = self.buffers[info.buffer]
            if buf.grad is None or info.unsharded_spec is not None or p.grad is not buf.grad_view(info.slot):
                self._fold_foreign_grad(info)

    def _take_grad(self, b: int) -> tuple[torch.Tensor, list[bool]]:
        """Hand over buffer ``b``'s gradient buffer to be reduced, with which slots were
        written; the unsharded parameters' ``.grad`` aliases into it are dropped."""
        buf = self.buffers[b]
        touched = [buf.grad_touched(i) for i in range(len(buf.slots))]
        grad = buf.take_grad()
        for info in self.infos:
            if info.buffer == b and info.unsharded is not None:
                info.unsharded.grad = None
        return grad, touched

    def _fold_foreign_grad(self, info: ParamInfo) -> None:
        """A gradient autograd made on its own (no alias was set): add it into the buffer."""
        p = info.unsharded
        buf = self.buffers[info.buffer]
        if buf.grad is None:
            buf.alloc_grad()
        alias = buf.grad_view(info.slot)
        g = p.grad
        p.grad = None
        if isinstance(g, DTensor):
            g = _local_grad(g, info.unsharded_spec, info.dp_dims)
        with torch.no_grad():
            alias.add_(g.reshape(alias.shape).to(alias.dtype))
        if info.unsharded_spec is None:
            p.grad = alias

    def _owner_pre_forward(self, bs: tuple[int, ...], module, args, kwargs):
        """A call of a module owning parameters of buffers ``bs`` (see _hook_owner_modules)."""
        if in_backward() or not torch.is_grad_enabled():
            return None  # a recomputation, or no backward will follow this call
        f = self.fwd
        w = self._watch
        if w is not None:
            for b in bs:
                w.inside[b] = w.inside.get(b, 0) + 1
            if not watching(w):  # someone else's saved-tensor hooks (a checkpoint) hide the saves
                f.outside.update(bs)
        attached = False
        if self.training_state is TrainingState.FORWARD:
            args, kwargs, attached = attach_post_backward(functools.partial(self._buffer_done, bs), args, kwargs)
        for b in bs:
            if attached:
                f.buffer_calls[b] = f.buffer_calls.get(b, 0) + 1
            else:  # outside the group's forward, or inputs that need no grad: unseen
                f.buffer_blind.add(b)
        return (args, kwargs) if attached else None

    def _owner_post_forward(self, bs: tuple[int, ...], module, args, output) -> None:
        w = self._watch
        if w is not None and not in_backward() and torch.is_grad_enabled():
            for b in bs:
                if w.inside.get(b):
                    w.inside[b] -= 1

    def _buffer_done(self, bs: tuple[int, ...]) -> None:
        """One owner-module call of buffers ``bs`` finished its backward. When every such
        call of a buffer did, its gradients are complete: a blind group (the root, whose own
        post-backward waits for the end of backward) reduces it now and frees its unsharded
        parameters, instead of holding both through the rest of backward."""
        for b in bs:
            n = self.bwd.buffer_fired[b] = self.bwd.buffer_fired.get(b, 0) + 1
            if n == self.fwd.buffer_calls.get(b, 0) and b not in self.fwd.buffer_blind:
                self._reduce_early(b)

    def _reduce_early(self, b: int) -> None:
        buf = self.buffers[b]
        if (not self.fwd.blind or self.training_state is not TrainingState.PRE_BACKWARD
                or not self.reduce_grads or b in self.bwd.early or buf.grad is None
                or (self.buffer_dp[b].replicate is not None and not self.requires_all_reduce)):
            return
        with record_function("ragged_fsdp::reduce_early"):
            self._fold_foreign_grads(b)
            self.ctx.retire_reductions(keep=0)
            grad, touched = self._take_grad(b)
            f = self.fwd
            # free its unsharded parameters too, unless autograd may still read them: saved
            # outside the owner modules, or the watch could not see every save
            if (self.reshard_after_backward and self.is_unsharded and f.seen > 0 and not f.unknown
                    and b not in f.outside):
                self._free_buffers({b})
            self.bwd.early.add(b)
            self._reduce(b, grad, touched, early=True)
            if not self.dev.overlap_reductions:
                self.ctx.retire_reductions(keep=0)

    def _take_earlier(self, b: int) -> _Reduction | None:
        """This backward's earlier reduction of buffer ``b`` (finished now), if any: a
        gradient that arrived after an early reduction is added into its segment."""
        for k, r in enumerate(self.bwd.reduced):
            if r.buffer == b:
                r.pending.wait()
                self.ctx.in_flight = [x for x in self.ctx.in_flight if x is not r]
                del self.bwd.reduced[k]
                return r
        return None

    def _post_backward_from_autograd(self) -> None:
        self.bwd.fired += 1
        if self.bwd.fired < self.fwd.calls or self.fwd.blind:
            # more uses of the group may still come in this backward (or in a later one,
            # when the step runs several): the final callback reduces what has arrived
            return
        self.post_backward()

    def has_pending_grads(self) -> bool:
        """Unsharded gradients autograd produced that no reduction has taken yet."""
        return any(i.unsharded is not None and i.unsharded.grad is not None for i in self.infos)

    def end_backward(self) -> None:
        """The final callback of one ``backward()``: reduce what this backward produced and
        has not reduced yet; free what it gathered."""
        if self.training_state is TrainingState.PRE_BACKWARD or (
            self.training_state is not TrainingState.POST_BACKWARD and self.has_pending_grads()
        ):
            self.post_backward()
        elif self.reshard_after_backward and (self.sharded_state is not ShardedState.SHARDED or self._gathering is not None):
            self.reshard()
        elif self._gathering is not None:  # a prefetch nobody used: finish it, keep the result
            self.wait_for_unshard()

    def post_backward(self) -> None:
        """The group's gradients are complete: reduce them (or keep accumulating)."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        with record_function("ragged_fsdp::post_backward"):
            self._post_backward()

    def _post_backward(self) -> None:
        self.training_state = TrainingState.POST_BACKWARD
        self.bwd.deferred_prefetch = None
        self._fold_foreign_grads()
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            return
        # Wait for the previous group's reduction before issuing this one: one in flight
        # while the next group computes its backward.
        self.ctx.retire_reductions(keep=0)
        starts = []
        for b, buf in enumerate(self.buffers):
            if buf.grad is None:
                if b in self.bwd.early or not any(i.buffer == b and i.sharded.requires_grad for i in self.infos):
                    continue
                buf.alloc_grad()  # every rank reduces the same buffers, used here or not
            starts.append((b, *self._take_grad(b)))
        if self.reshard_after_backward:
            self.reshard()
        with record_function("ragged_fsdp::reduce"):
            for b, grad, touched in starts:
                self._reduce(b, grad, touched)
        if not self.dev.overlap_reductions:
            self.ctx.retire_reductions(keep=0)

    def _reduce(self, b: int, grad: torch.Tensor, touched: list[bool], early: bool = False) -> None:
        buf = self.buffers[b]
        dp = self.buffer_dp[b]
        prev = self._take_earlier(b)
        if prev is not None:  # late gradients of an early-reduced buffer: add them in
            touched = [x or y for x, y in zip(touched, prev.touched)]
        if dp.replicate is not None:
            return self._reduce_hsdp(b, grad, touched, prev, early)
        if prev is not None:
            pending = reduce_scatter(self.dev, dp.shard, grad, prev.target, True, self.gradient_divide_factor)
            red = _Reduction(b, pending, prev.target, touched, prev.had_grad, dp, early=True)
            self.bwd.reduced.append(red)
            self.ctx.in_flight.append(red)
            return
        had, existing = self._existing_grads(b)
        if not existing:
            if buf.world_size == 1 and grad.dtype == buf.dtype and self.gradient_divide_factor is None:
                # nothing to reduce: the unsharded gradient buffer is the sharded one
                red = _Reduction(b, Pending(), grad, touched, had, dp, early=early)
                self.bwd.reduced.append(red)
                return
            target, accumulate = buf.new_sharded_grad(), False
        else:
            target = self._accumulation_target(b, existing)
            accumulate = True
        pending = reduce_scatter(self.dev, dp.shard, grad, target, accumulate, self.gradient_divide_factor)
        red = _Reduction(b, pending, target, touched, had, dp, early=early)
        self.bwd.reduced.append(red)
        self.ctx.in_flight.append(red)

    def _existing_grads(self, b: int) -> tuple[list[bool], dict[int, torch.Tensor]]:
        had = [False] * len(self.buffers[b].slots)
        existing = {}
        for info in self.infos:
            if info.buffer == b and info.sharded.grad is not None:
                had[info.slot] = True
                existing[info.slot] = info.sharded.grad
        return had, existing

    def _reduce_hsdp(self, b: int, grad: torch.Tensor, touched: list[bool], prev: _Reduction | None = None,
                     early: bool = False) -> None:
        """HSDP: sum over the shard dim into a fresh segment (one reduce-scatter), then, once
        that is done, sum over the replicate dim (one all-reduce) and divide by every data-
        parallel rank. With ``set_requires_all_reduce(False)`` the shard-dim sums pile up
        instead and the sharded grads stay as they are, until a reduction that all-reduces
        (as torch's HSDP: the replicate all-reduce is what gradient accumulation skips)."""
        buf, dp = self.buffers[b], self.buffer_dp[b]
        earlier = self._partial.pop(b, None)
        earlier_touched = self._partial_touched.pop(b, None)
        if earlier_touched is not None:
            touched = [x or y for x, y in zip(touched, earlier_touched)]
        if not self.requires_all_reduce:
            partial = torch.empty(buf.segment, dtype=grad.dtype, device=grad.device)

            def keep():
                if earlier is not None:
                    partial.add_(earlier)
                self._partial[b] = partial
                self._partial_touched[b] = touched

            first = reduce_scatter(self.dev, dp.shard, grad, partial, False, 1.0)
            self.ctx.in_flight.append(_Reduction(b, _ThenAllReduce(first, keep), partial, touched, [], dp))
            return
        had, existing = self._existing_grads(b)
        if prev is not None:  # late gradients: add into the early reduction's segment
            had, existing, early = prev.had_grad, {-1: prev.target}, True
            target = prev.target
        else:
            target = self._accumulation_target(b, existing) if existing else buf.new_sharded_grad()
        # the common case (nothing accumulates, same dtype): reduce straight into the new
        # sharded gradient segment and all-reduce it in place: no second segment, no copy
        direct = earlier is None and not existing and grad.dtype == buf.dtype
        partial = target if direct else torch.empty(buf.segment, dtype=grad.dtype, device=grad.device)
        factor = float(self.gradient_divide_factor or dp.size)
        first = reduce_scatter(self.dev, dp.shard, grad, partial, False, 1.0)

        def finish():
            if earlier is not None:
                partial.add_(earlier)
            all_reduce_sum(dp.replicate, partial)
            if existing:
                target.add_(partial.to(target.dtype), alpha=1.0 / factor)
                return
            if partial is not target:
                target.copy_(partial)
            target.mul_(1.0 / factor)

        red = _Reduction(b, _ThenAllReduce(first, finish), target, touched, had, dp, early=early)
        self.bwd.reduced.append(red)
        self.ctx.in_flight.append(red)

    def _accumulation_target(self, b: int, existing: dict[int, torch.Tensor]) -> torch.Tensor:
        """The sharded gradient segment to add into: the last one we made if every existing
        grad still lives in it, else a fresh one holding the existing grads."""
        buf = self.buffers[b]
        ref = self._last_grad_seg[b]
        last = ref() if ref is not None else None
        if last is not None:
            ptr = last.untyped_storage().data_ptr()
            if all(local_of(g).untyped_storage().data_ptr() == ptr for g in existing.values()):
                with torch.no_grad():
                    for i in range(len(buf.slots)):
                        if i not in existing and buf.slots[i].local_numel:
                            buf.local_view(last, i).zero_()
                return last
        target = buf.new_sharded_grad(zero=True)
        with torch.no_grad():
            for i, g in existing.items():
                buf.local_view(target, i).copy_(local_of(g).reshape(buf.slots[i].local_shape))
        return target

    def assign_grads(self, red: _Reduction, got_grad: list[bool]) -> None:
        """Point the sharded grads into the reduced segment (after the reduction finished).
        A parameter no rank produced a gradient for keeps ``.grad = None``."""
        buf = self.buffers[red.buffer]
        self._last_grad_seg[red.buffer] = weakref.ref(red.target)
        for info in self.infos:
            if info.buffer != red.buffer or not info.sharded.requires_grad:
                continue
            i = info.slot
            if not (got_grad[i] or red.had_grad[i]):
                info.sharded.grad = None
                continue
            info.sharded.grad = make_sharded_grad(buf.local_view(red.target, i), info.sharded)

    def finish_backward(self) -> None:
        self.training_state = TrainingState.IDLE
        self.bwd = _Backward()
        self.fwd.stale = True

    # -- moving (nn.Module._apply, load_state_dict(assign=True)) ------------------------------
    def adopt_locals(self, locals_: list[torch.Tensor | None]) -> None:
        """Rebuild the sharded segments from new local tensors (one per info, None = keep
        the current data) and re-point the sharded parameters into them."""
        for b, buf in enumerate(self.buffers):
            mine = [(k, info) for k, info in enumerate(self.infos) if info.buffer == b]
            new = [locals_[k] for k, _ in mine]
            known = [t for t in new if t is not None]
            device = known[0].device if known else buf.device
            dtype = known[0].dtype if known else buf.dtype
            old = [local_of(info.sharded).detach() for _, info in mine]
            if device != buf.device or dtype != buf.dtype:
                buf.rebuild(device, dtype)
                for info in self.infos:
                    if info.buffer == b:
                        info.unsharded = None
            for (k, info), t, o in zip(mine, new, old):
                src = t if t is not None else o
                if src.device.type == "meta" and buf.device.type != "meta":
                    pass  # no data to keep (to_empty of a list group moves its modules one by one)
                elif src.data_ptr() != buf.sharded_view(info.slot).data_ptr() or src.device != buf.device:
                    buf.copy_local_(info.slot, src.to(device=buf.device, dtype=buf.dtype))
                repoint(info.sharded, buf.sharded_view(info.slot))
                info.register(info.sharded)

    def adopt_registered(self) -> None:
        """After ``load_state_dict(assign=True)`` replaced registered parameters: copy their
        data into the DBuffer and point the sharded parameters back into it."""
        self.reshard()
        changed = False
        new_locals: list[torch.Tensor | None] = []
        for info in self.infos:
            mod, name = info.owners[0]
            cur = mod._parameters.get(name)
            if cur is None or cur is info.sharded:
                new_locals.append(None)
                continue
            changed = True
            if isinstance(cur, RaggedDTensor) and spec_mismatch(cur._spec, info.sharded._spec) is None:
                local = cur._local_tensor
            else:
                full = cur.full_tensor() if isinstance(cur, DTensor) else cur
                if tuple(full.shape) != tuple(info.sharded.shape):
                    raise ValueError(f"load_state_dict: {info.fqn} has shape {tuple(full.shape)}, expected {tuple(info.sharded.shape)}")
                local = my_piece(full.detach(), info.sharded._spec)
            if cur.requires_grad != info.sharded.requires_grad:
                info.sharded.requires_grad_(cur.requires_grad)
            new_locals.append(local.detach())
        if changed:
            self.adopt_locals(new_locals)


def hand_out_grads(groups: list[ParamGroup]) -> None:
    """End of a backward, after every reduction finished: one all-reduce of the 'got a
    gradient' flags of every reduced tensor per data-parallel mesh (over its shard dim, and
    its replicate dim under HSDP), then each group points its sharded grads into the
    reduced segments. Collectives run in group order, the same on every rank."""
    by_dp: dict[int, list] = {}
    for g in groups:
        for r in g.bwd.reduced:
            by_dp.setdefault(id(r.dp), []).append((g, r))
    for items in by_dp.values():
        dp = items[0][1].dp
        g0 = items[0][0]
        device = g0.device if g0.device.type != "meta" else None
        # per reduction, also (early, not early): every rank must have issued it at the same
        # point, or the collectives paired different buffers; MAX makes a mismatch show as (1, 1)
        early = [v for _, r in items for v in (int(r.early), 1 - int(r.early))]
        flags = torch.tensor([int(f) for _, r in items for f in r.touched] + early, dtype=torch.int32, device=device)
        for comm in (dp.shard, dp.replicate):
            if comm is not None and comm.world_size > 1 and flags.numel():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=comm.group)
        got = flags.tolist()
        mixed = [r for k, (_, r) in enumerate(items) if got[len(got) - len(early) + 2 * k: len(got) - len(early) + 2 * k + 2] == [1, 1]]
        if mixed:
            g = next(g for g, r in items if r is mixed[0])
            raise RuntimeError(
                f"ragged_fsdp: the gradient reduction of {g._describe()} (buffer {mixed[0].buffer}) ran early on some "
                "ranks and at the end of backward on others, so the collectives of that backward paired different "
                "buffers. The modules owning its parameters must run (with inputs that need grad) on every rank; "
                "wrap the ones that run on some ranks only in their own fully_shard.")
        k = 0
        for g, r in items:
            n = len(r.touched)
            g.assign_grads(r, [bool(x) for x in got[k:k + n]])
            k += n
