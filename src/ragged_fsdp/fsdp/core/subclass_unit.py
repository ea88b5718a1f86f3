"""Parameters whose data is a tensor subclass with its own all-gather (FSDP2's extension
protocol: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, torch 2.13 signatures).

A unit kind of the engine. Such a parameter is sharded by whole rows in units the subclass
asks for (``ragged_fsdp.quant.foreign`` reads the protocol), so each rank's piece,
``torch.split`` of the subclass along dim 0, is a subclass value of its own: the planner's
RaggedShard units never cut a quantisation block, and nothing is re-quantised.

Gathering one unit: every rank calls ``fsdp_pre_all_gather`` on its piece, with the 1- or
5-argument signature exactly as FSDP2 calls it (``mesh``, the unsharded ``outer_size`` and
``outer_stride``, the owner ``module``, the ``mp_policy``). The all-gather inputs are packed
by dtype: one flat ``W * S_d`` buffer per input dtype (``uint8`` for packed 4-bit codes,
``int8`` for scalers, ``float32`` for factors, ...), each rank writing its slot, and one
in-place all-gather per buffer. The input sizes of every rank are exchanged once, at the
first gather (a small int64 all-gather), and every later gather checks they are unchanged.
After the wait, each tensor's outputs are its ranks' pieces in rank order, viewed as
``(-1, *input.shape[1:])`` as FSDP2 does, and go to ``fsdp_post_all_gather(outputs,
metadata, param_dtype)``; from the second gather on the outputs are refilled in place and the
call gets ``out=`` the unsharded tensor it returned the first time, so tensors autograd saved
see the new data. Freeing resizes the outputs (and the inner tensors the hook returned) to
zero bytes, as FSDP2 does.

Trainable subclass parameters (torchao's float8 training weights) get their gradients as
FSDP2 gives them: the unsharded parameter is the ``fsdp_post_all_gather`` output wrapped as an
``nn.Parameter``; its gradient, a plain tensor of the full shape, accumulates into a plain
gradient buffer of the unit's layout in the reduce dtype (``SubclassStore`` has the gradient
half of a DBuffer), which the engine's reductions reduce-scatter like any other unit's; each
sharded parameter's ``.grad`` is a plain RaggedShard DTensor of its rows (the optimizer then
updates the subclass piece through the subclass's own ops). Such units are never reduced
early (their unsharded data is not one flat buffer that the early-reduction watch can see).

Foreign quantised weights are adopted when they are placed, through the one adapter table
(``ragged_fsdp.quant.foreign.ADAPTERS``): bitsandbytes' ``Params4bit`` (Hugging Face 4-bit
models) as a :class:`~ragged_fsdp.quant.bnb4.BnB4Weight` (its codes with their absmax, in whole
quantisation blocks; gathered back into a ``Params4bit``), wired into its ``Linear4bit`` by the
adapter's attach (``quant/bnb4_owner.py``); torchao's own ``NF4Tensor`` as an ``NF4Weight`` (the
same codes, scalers and factors, and the same dequantisation): its ops split only into equal pieces
and its one-argument ``fsdp_pre_all_gather`` rebuilds the shape as local rows x world size,
neither of which fits pieces of different sizes. ``load_state_dict(assign=True)`` of a subclass
parameter copies the assigned value into the rank's piece (a hook on the owner module) and
puts the sharded parameter back, so the unit keeps gathering from its own pieces.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ragged_fsdp.comm import all_gather_single
from ragged_fsdp.dbuffer import GradientHalf
from ragged_fsdp.placement import RaggedShard

from .. import tracing as trace
from ...device import AllWork, Device, Pending
from ...quant.foreign import adopt_foreign, attach_foreign, call_pre_all_gather, rows_of
from .sharded_param import make_sharded_param
from .unit import Building, ParamInfo, Unit

__all__ = ["SubclassStore", "SubclassUnit", "build_subclass_unit"]

# gloo and NCCL reduce nothing here, so 1-byte types without a collective dtype travel as uint8
_WIRE = {torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8, torch.bool: torch.uint8}
for _name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"):
    if hasattr(torch, _name):
        _WIRE[getattr(torch, _name)] = torch.uint8
_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64, torch.bool, *(d for d in _WIRE if d is not torch.bool)]


def build_subclass_unit(group: Building, index, dp, layout, items, mp_policy, post_forward_comm) -> "SubclassUnit":
    """A unit for ``items`` (``(name, param, owners, placement)``, the slot order of ``layout``):
    each rank keeps its rows of every subclass value, split along dim 0."""
    dtype = items[0][1].dtype
    compute = mp_policy.param_dtype or dtype
    store = SubclassStore(layout, group.device, dtype, compute, mp_policy.reduce_dtype or compute)
    infos = []
    unit = SubclassUnit(index, store, dp, infos, hooks=group.hooks, post_forward_comm=post_forward_comm,
                        group_name=group.name, mp_policy=mp_policy, mesh=dp.mesh, after_grad=group.after_grad)
    store.pieces = unit.locals
    rank = dp.shard.rank
    for j, (name, p, owners, pl) in enumerate(items):
        s = layout.slots[j]
        data = pl.data.detach()  # a foreign weight was adopted when it was placed
        cols = math.prod(s.shape[1:])
        a, b = s.placement.element_range(s.shape, rank)
        if a % cols or b % cols:
            raise ValueError(f"fully_shard: the layout gives rank {rank} elements [{a}, {b}) of {name!r}, not whole rows")
        r0, r1 = (a // cols, b // cols) if b > a else (0, 0)
        piece = rows_of(name, data, r0, r1)
        sharded = make_sharded_param(piece, pl.mesh, pl.with_ragged(RaggedShard.of(s.placement)),
                                     tuple(p.shape), p.requires_grad)
        attach_foreign(sharded, piece, s, owners, pl.mesh, dp.shard.world_size)
        info = ParamInfo(name, index, j, owners, sharded)
        info.register(sharded)
        infos.append(info)  # the unit's own list: it holds every info before any is read
        unit.locals.append(piece)
        unit.rows.append((r0, r1))
        unit.modules.append(owners[0][0])
        for module, _ in owners:
            module.register_load_state_dict_post_hook(functools.partial(_reclaim_assigned, unit, j))
    return unit


def _reclaim_assigned(unit: "SubclassUnit", j: int, module: nn.Module, incompatible_keys) -> None:
    """After ``load_state_dict(assign=True)`` replaced a subclass parameter: copy the new value
    (a sharded parameter of the same layout, or the full tensor) into this rank's piece and
    register the sharded parameter again. Runs before the FSDP module's own post hook
    (children's hooks run first; on the module itself this one was registered first)."""
    info = unit.infos[j]
    for mod, name in info.owners:
        cur = mod._parameters.get(name)
        if cur is None or cur is info.sharded:
            continue
        if isinstance(cur, DTensor):
            if tuple(cur.placements) != tuple(info.sharded.placements):
                raise ValueError(
                    f"load_state_dict(assign=True): {info.fqn!r} is laid out {cur.placements}, the model "
                    f"{info.sharded.placements}; load the values with copy (assign=False) or a state dict "
                    "of this layout")
            new = cur._local_tensor
        else:
            if tuple(cur.shape) != tuple(info.sharded.shape):
                raise ValueError(
                    f"load_state_dict(assign=True): {info.fqn!r} has shape {tuple(cur.shape)}, expected "
                    f"{tuple(info.sharded.shape)}")
            new = rows_of(info.fqn, adopt_foreign(cur.detach()), *unit.rows[j])
        with torch.no_grad():
            unit.locals[j].copy_(new.detach())
        if cur.requires_grad != info.sharded.requires_grad:
            info.sharded.requires_grad_(cur.requires_grad)
        mod._parameters[name] = info.sharded


class SubclassStore(GradientHalf):
    """What the group reads from a unit's ``buf`` when the unit holds subclass parameters:
    the layout (which rows are whose), no flat parameter storage of its own (the pieces keep
    theirs), and a DBuffer's gradient half: a plain unsharded gradient buffer in the reduce
    dtype with per-slot aliases, and plain sharded gradient segments of ``dtype`` (the
    parameters' outer dtype), which the reductions fill."""

    quant = None
    aliased = False
    host_sharded = False
    staged = None

    def __init__(self, layout, device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype):
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.wire_bytes = 0  # bytes one gather receives on this rank (set at the first gather)
        self.grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._grad_versions: list[int] = []
        self.pieces: list[torch.Tensor] = []  # the unit's subclass piece per slot (its ``locals``)

    @property
    def unsharded_allocated(self) -> bool:
        return False

    # What re-pointing after load_state_dict(assign=True) reads (fsdp/core/moving.py): a slot's
    # "sharded view" is its piece, and copying a new local copies into the piece's own tensors.
    def sharded_view(self, i: int) -> torch.Tensor:
        return self.pieces[i]

    @torch.no_grad()
    def copy_local_(self, i: int, src: torch.Tensor) -> None:
        self.pieces[i].copy_(src)

    def rebuild(self, device, dtype):
        raise NotImplementedError(
            "ragged_fsdp: moving a group that holds tensor-subclass parameters (.to(), to_empty(), "
            "load_state_dict(assign=True)) is not implemented; build the subclass weights on their "
            "device before fully_shard"
        )

    def __repr__(self) -> str:
        return f"SubclassStore({len(self.slots)} tensors, {self.wire_bytes} bytes gathered)"


class SubclassUnit(Unit):
    """A unit of subclass parameters (see the module docstring)."""

    reduces_early = False

    def __init__(self, index, store: SubclassStore, dp, infos, *, hooks, post_forward_comm, group_name, mp_policy,
                 mesh, after_grad):
        super().__init__(index, store, dp, infos, embedding=False, hooks=hooks, post_forward_comm=post_forward_comm,
                         group_name=group_name, after_grad=after_grad)
        self.mp_policy = mp_policy
        self.mesh = mesh  # what fsdp_pre_all_gather gets as its mesh (FSDP2: the shard mesh)
        self.locals: list[torch.Tensor] = []  # this rank's subclass piece per slot
        self.rows: list[tuple[int, int]] = []  # per slot: this rank's rows [r0, r1)
        self.modules: list[nn.Module] = []  # the owner module per slot (the hook's ``module``)
        self._sizes: list[list[tuple[int, int]]] | None = None  # [rank][input] -> (numel, dtype code)
        self._outputs: list[list[torch.Tensor]] = []  # per slot: the flat all-gather outputs
        self._full: list[torch.Tensor | None] = []
        self._inner: list[tuple[torch.Tensor, ...]] = []
        self._hooked: set[int] = set()  # slots whose unsharded parameter has the gradient hooks

    def unsharded_bytes(self) -> int:
        return self.buf.wire_bytes

    # -- gather ------------------------------------------------------------------------
    def _inputs(self):
        ins, metas = [], []
        for info, local, module in zip(self.infos, self.locals, self.modules):
            shape = tuple(info.sharded.shape)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            got, meta = call_pre_all_gather(local, self.mesh, torch.Size(shape), stride, module, self.mp_policy)
            ins.append(tuple(got))
            metas.append(meta)
        return ins, metas

    def _exchange_sizes(self, ins) -> None:
        comm = self.comm
        mine = [(t.numel(), _DTYPES.index(t.dtype)) for per in ins for t in per]
        flat = torch.tensor([v for pair in mine for v in pair], dtype=torch.int64, device=self.buf.device)
        if comm.world_size > 1:
            out = torch.empty(comm.world_size * flat.numel(), dtype=torch.int64, device=flat.device)
            all_gather_single(out, flat, group=comm.group, async_op=False)
        else:
            out = flat
        rows = out.view(comm.world_size, -1, 2).tolist()
        for r, row in enumerate(rows):
            if [c for _, c in row] != [c for _, c in mine]:
                raise RuntimeError(
                    f"ragged_fsdp: {self!r}: rank {r}'s fsdp_pre_all_gather returned inputs of other dtypes "
                    f"than rank {comm.rank}'s; every rank's piece must give the same kinds of inputs"
                )
        self._sizes = [[tuple(p) for p in row] for row in rows]

    def gather(self, dev: Device, from_kept: bool, for_backward: bool = False) -> Pending | None:
        # (for_backward picks an MXFP8 plane in Unit.gather; a subclass gathers what its hooks return)
        if from_kept:
            raise NotImplementedError("tensor-subclass parameters with reshard_after_forward=<int>")
        comm, W, r = self.comm, self.comm.world_size, self.comm.rank
        ins, metas = self._inputs()
        if self._sizes is None:
            self._exchange_sizes(ins)
        flat_ins = [t for per in ins for t in per]
        mine = [(t.numel(), _DTYPES.index(t.dtype)) for t in flat_ins]
        if mine != [tuple(p) for p in self._sizes[r]]:
            raise RuntimeError(f"ragged_fsdp: {self!r}: fsdp_pre_all_gather returned other input sizes than at the first gather")
        # per dtype: each rank's slot size and where each input sits in its owner's slot
        codes = sorted({c for _, c in mine})
        seg, at = {c: 0 for c in codes}, []
        for rr in range(W):
            offs, used = [], {c: 0 for c in codes}
            for n, c in self._sizes[rr]:
                offs.append(used[c])
                used[c] += n
            at.append(offs)
            for c in codes:
                seg[c] = max(seg[c], used[c])
        dev_ = self.buf.device
        wires = {c: torch.empty(W * seg[c], dtype=_DTYPES[c], device=dev_) for c in codes}
        self.buf.wire_bytes = sum(w.numel() * w.element_size() for w in wires.values())

        def issue(async_op: bool):
            for c, w in wires.items():
                w.narrow(0, r * seg[c], seg[c]).zero_()  # padding: defined bytes on the wire
            for j, t in enumerate(flat_ins):
                c = mine[j][1]
                wires[c].narrow(0, r * seg[c] + at[r][j], t.numel()).copy_(t.reshape(-1))
            if W == 1:
                return None
            works = []
            for c, w in wires.items():
                send = w.narrow(0, r * seg[c], seg[c])
                wire_dtype = _WIRE.get(w.dtype)
                if wire_dtype is not None:
                    w, send = w.view(wire_dtype), send.view(wire_dtype)
                works.append(all_gather_single(w, send, group=comm.group, async_op=async_op))
            return AllWork(*works)

        def post():
            j = 0
            for k, per in enumerate(ins):
                outs = self._outputs[k] if k < len(self._outputs) else None
                new = []
                for q, t in enumerate(per):
                    c = mine[j][1]
                    pieces = [wires[c].narrow(0, rr * seg[c] + at[rr][j], self._sizes[rr][j][0]) for rr in range(W)]
                    n = sum(p.numel() for p in pieces)
                    if outs is None:
                        o = torch.empty(n, dtype=t.dtype, device=dev_)
                    else:
                        o = outs[q]
                        o.untyped_storage().resize_(n * o.element_size())
                    torch.cat(pieces, out=o)
                    new.append(o)
                    j += 1
                if outs is None:
                    self._outputs.append(new)
                self._post(k, ins[k], metas[k])

        keep = tuple(wires.values())
        trace.record("all_gather", self, self.buf.wire_bytes)
        return dev.launch("all_gather", issue, post=post, keep=keep, out=keep)

    def _post(self, k: int, ins, meta) -> None:
        info, local = self.infos[k], self.locals[k]
        outs = tuple(o.view(-1, *t.shape[1:]) for o, t in zip(self._outputs[k], ins))
        dtype = self.mp_policy.param_dtype or info.sharded.dtype
        if k < len(self._full) and self._full[k] is not None:
            for t in self._inner[k]:  # as FSDP2: the inner tensors have storage again before the hook refills
                _alloc(t)
            with torch.no_grad():
                local.fsdp_post_all_gather(outs, meta, dtype, out=self._full[k])
            return
        with torch.no_grad():
            full, inner = local.fsdp_post_all_gather(outs, meta, dtype)
        if tuple(full.shape) != tuple(info.sharded.shape):
            raise RuntimeError(
                f"ragged_fsdp: {info.fqn!r}: {type(local).__name__}.fsdp_post_all_gather returned shape "
                f"{tuple(full.shape)}, expected {tuple(info.sharded.shape)}. Its metadata must carry the full "
                "shape (the 5-argument fsdp_pre_all_gather gets it as outer_size): ranks hold different "
                "numbers of rows here, so local rows x world size is not the full shape"
            )
        # FSDP2 refills with out= the unsharded *parameter*: for a subclass, nn.Parameter(full)
        # is another wrapper over the same inner tensors, and hooks that refresh wrapper
        # attributes (torchao's float8 scale) must reach the one the module computes with
        # a hook that returns a parameter (bitsandbytes' Params4bit, which layers read
        # quant_state from) is used as it is: wrapping it again would drop its attributes
        info.set_unsharded(full if isinstance(full, nn.Parameter) else nn.Parameter(full, requires_grad=False))
        self._full.append(info.unsharded)
        self._inner.append(tuple(inner))

    # -- registration / free -------------------------------------------------------------
    def unsharded_param(self, info) -> nn.Parameter:
        p = info.unsharded
        if p.requires_grad != info.sharded.requires_grad:
            p.requires_grad_(info.sharded.requires_grad)
        if p.requires_grad and info.slot not in self._hooked:
            # as Unit.unsharded_param: the gradient lands in the plain gradient buffer's alias
            if self.buf.reduce_dtype != p.dtype:
                p.grad_dtype = self.buf.reduce_dtype
            p.register_hook(functools.partial(self._on_grad, info))
            p.register_post_accumulate_grad_hook(self._after_grad)
            self._hooked.add(info.slot)
        return p

    def free(self) -> None:
        freed = False
        for outs in self._outputs:
            for o in outs:
                freed |= o.untyped_storage().size() > 0
                o.untyped_storage().resize_(0)
        for inner in self._inner:
            for t in inner:
                t.untyped_storage().resize_(0)
        if freed:
            trace.record("free", self, sum(o.numel() * o.element_size() for outs in self._outputs for o in outs))

    def keep_part(self) -> None:
        raise NotImplementedError("tensor-subclass parameters with reshard_after_forward=<int>")


def _alloc(t: torch.Tensor) -> None:
    need = (t.storage_offset() + t.numel()) * t.element_size()
    if t.untyped_storage().size() < need:
        t.untyped_storage().resize_(need)
