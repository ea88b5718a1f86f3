"""How a parameter is laid out over ranks, as the optimizers need it.

Every layout the optimizers accept gives each rank one contiguous run of the row-major
flattened tensor:

* a plain tensor (unsharded module): one "rank" holding everything, no process group;
* a RaggedDTensor: the RaggedShard's element ranges on its mesh dimension. On an n-D mesh
  the other dims are Replicate (HSDP: each replica does the same work) or even ``Shard(k)``
  (TP/EP): the RaggedShard then splits the *outer-local* tensor those leave (the TP/EP-local
  tensor), so the ranges are runs of the outer-local tensor, not of the global one;
* a torch DTensor with ``Shard(0)`` on one mesh dim (FSDP2) — contiguous chunks too —, or
  all-Replicate (every rank holds everything, treated as unsharded).

``Layout`` keeps the element ranges, the process group of the sharded mesh dim and this
rank's index in it, the outer-local shape and this rank's offset of it in the global tensor,
and builds state tensors of the same kind as the parameter. Pointwise optimizers only touch
local tensors and need none of it; what needs it: Muon (which ranks hold a matrix), the 8-bit
blocks (defined on the outer-local tensor) and state loading (which slice of a full state is
this rank's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..placement.dtensor import (
    RaggedDTensor, element_ranges, my_piece, outer_offsets, outer_shape, ragged_dim, wrap,
)
from ..placement.ragged_shard import RaggedShard

__all__ = ["Layout", "layout_of", "local_of", "param_name", "load_scalars", "block_shape"]


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]  # element range of each rank of the sharded dim
    rank: int  # this rank's index on the sharded mesh dim (0 when unsharded)
    group: object | None  # process group of the sharded mesh dim; None when unsharded
    kind: str  # "plain" | "ragged" | "shard0" | "replicate"
    mesh: object | None = None
    mesh_dim: int | None = None
    # n-D RaggedDTensors: every placement, the outer-local shape the RaggedShard splits (None:
    # the global shape) and this rank's offset of it in the global tensor
    placements: tuple = ()
    outer: tuple[int, ...] | None = None
    outer_offset: tuple[int, ...] | None = None
    spec: object | None = field(default=None, compare=False)  # the RaggedDTensor's DTensorSpec

    @property
    def numel(self) -> int:
        """Elements of the *global* tensor."""
        return math.prod(self.shape)

    @property
    def outer_shape(self) -> tuple[int, ...]:
        """Shape of the tensor the ranges cut (the TP/EP-local one; the global one without
        TP/EP)."""
        return self.outer if self.outer is not None else self.shape

    @property
    def outer_numel(self) -> int:
        return math.prod(self.outer_shape)

    @property
    def outer_shards(self) -> bool:
        """Whether other mesh dims (TP/EP ``Shard(k)``) split the tensor besides the RaggedShard."""
        return self.outer is not None

    def parts(self) -> tuple[int, ...]:
        """Per tensor dim, the number of outer-local pieces the ``Shard`` mesh dims cut it into."""
        out = [1] * len(self.shape)
        for i, p in enumerate(self.placements):
            if type(p) is Shard:
                out[p.dim % len(self.shape)] *= self.mesh.size(i)
        return tuple(out)

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def sharded(self) -> bool:
        return self.group is not None and self.world > 1

    @property
    def local_range(self) -> tuple[int, int]:
        return self.ranges[self.rank]

    def key(self):
        """Hashable identity of the layout (for plan caches)."""
        return (self.shape, self.ranges, self.rank, self.kind, id(self.group), self.placements, self.outer,
                self.outer_offset)

    def holder(self, start: int, end: int) -> int | None:
        """The rank whose run holds all of ``[start, end)``, or None if it is split."""
        for r, (a, b) in enumerate(self.ranges):
            if a <= start and end <= b and b > a:
                return r
        return None


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a (Ragged)DTensor, or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def layout_of(p: torch.Tensor, what: str = "parameter") -> Layout:
    shape = tuple(int(s) for s in p.shape)
    n = math.prod(shape)
    if isinstance(p, RaggedDTensor):
        spec = p._spec
        d = ragged_dim(spec.placements)
        mesh = spec.mesh
        placements = tuple(spec.placements)
        outer = offset = None
        if any(type(q) is Shard for q in placements):
            outer, offset = outer_shape(spec), outer_offsets(spec)
        return Layout(shape, element_ranges(spec), mesh.get_local_rank(d), mesh.get_group(d), "ragged",
                      mesh, d, placements, outer, offset, spec)
    if isinstance(p, DTensor):
        placements = tuple(p.placements)
        mesh = p.device_mesh
        if all(isinstance(q, Replicate) for q in placements):
            return Layout(shape, ((0, n),), 0, None, "replicate", mesh, None)
        sharded = [i for i, q in enumerate(placements) if not isinstance(q, Replicate)]
        if len(sharded) == 1 and isinstance(placements[sharded[0]], Shard) and placements[sharded[0]].dim == 0:
            d = sharded[0]
            from ..placement.redistribute import chunk_ranges

            world = mesh.size(d)
            return Layout(shape, tuple(chunk_ranges(shape, world)), mesh.get_local_rank(d),
                          mesh.get_group(d), "shard0", mesh, d)
        raise ValueError(
            f"{what} of shape {shape} is a DTensor with placements {placements}; the optimizer "
            "needs each rank to hold one contiguous run: use RaggedShard (ragged_fsdp.fully_shard), "
            "Shard(0) on one mesh dim, or Replicate"
        )
    return Layout(shape, ((0, n),), 0, None, "plain")


def like_param(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrap ``local`` (this rank's run, any dtype) as a tensor of ``p``'s kind and layout."""
    if isinstance(p, RaggedDTensor):
        return wrap(local.view(p._local_tensor.shape), p._spec)
    if isinstance(p, DTensor):
        return DTensor.from_local(local.view(p._local_tensor.shape), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())
    return local.view(p.shape)


def blocks_like(local: torch.Tensor, p: torch.Tensor, lay: Layout, block: int) -> torch.Tensor:
    """Wrap per-block values ``local`` (this rank's blocks) as a tensor over all blocks of
    ``p``: a RaggedDTensor over blocks when ``p`` is sharded, else a plain tensor."""
    if lay.kind in ("plain", "replicate"):
        return local
    from ..placement.api import from_local

    return from_local(local, lay.mesh, _block_placements(lay, block), shape=block_shape(lay, block))


def block_shape(lay: Layout, block: int) -> tuple[int, ...]:
    """Global shape of a per-block state. Blocks are cut from the *outer-local* tensor (the
    tensor the RaggedShard splits), so without TP/EP it is ``(blocks,)``; with TP/EP it is
    ``parts + (blocks of one outer-local tensor,)``: one row of blocks per outer-local piece,
    indexed like the pieces (a checkpoint saved under another TP/EP degree has another shape
    and is refused instead of silently mapping blocks to the wrong elements)."""
    nb = -(-lay.outer_numel // block)
    return lay.parts() + (nb,) if lay.outer_shards else (nb,)


def _block_placements(lay: Layout, block: int) -> tuple:
    """The per-block state's placements: the parameter's ``Shard(k)`` stay on dim ``k`` (one
    piece per rank), Replicate stays, the RaggedShard splits the blocks as the parameter's
    ranges split the elements."""
    units = tuple(-(-(b - a) // block) for a, b in lay.ranges)
    nd = len(block_shape(lay, block))
    out = []
    for i in range(lay.mesh.ndim):
        q = lay.placements[i] if lay.placements else Replicate()
        if i == lay.mesh_dim:
            out.append(RaggedShard(tuple(range(nd)), units, 1))
        elif type(q) is Shard and lay.outer_shards:
            out.append(Shard(q.dim % len(lay.shape)))
        else:
            out.append(Replicate())
    return tuple(out)


def param_name(group: dict, index: int, p: torch.Tensor, group_index: int | None = None) -> str:
    """A readable name for error messages: the group's param_names entry when the optimizer
    was given named parameters, else its position and shape."""
    names = group.get("param_names")
    if names is not None and index < len(names):
        return repr(names[index])
    where = f"group {group_index}, " if group_index is not None else ""
    return f"#{index} ({where}shape {tuple(p.shape)})"


def _placements_for(lay: Layout, p: torch.Tensor, per_block: int | None):
    """Placements of a state tensor: ``p``'s own, or RaggedShard over blocks."""
    if per_block is None:
        return tuple(p.placements)
    return _block_placements(lay, per_block)


def place_state(value, p: torch.Tensor, lay: Layout, name: str, key: str, per_block: int | None = None):
    """Lay a loaded state tensor out like the optimizer would have made it.

    ``value`` may be a tensor of the state's global shape (a full state dict: this rank keeps
    its slice, no communication), a DTensor of any layout on the parameter's mesh (a resharded
    checkpoint: redistributed), or already in place. ``per_block`` marks per-block states
    (one entry per ``per_block`` elements of ``p``). The dtype of ``value`` is kept.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if per_block is None:
        gshape = tuple(p.shape)
    else:
        gshape = block_shape(lay, per_block)
    if tuple(value.shape) != gshape:
        why = ("another model or optimizer setting" if per_block is None or not lay.outer_shards else
               "another model, optimizer setting or TP/EP degree (8-bit blocks are cut from the "
               "TP/EP-local tensor, so they move between data-parallel sizes, not TP/EP degrees)")
        raise ValueError(
            f"load_state_dict: state {key!r} of parameter {name} has shape {tuple(value.shape)}, "
            f"expected {gshape}; the checkpoint was saved for {why}"
        )
    # Loaded tensors are never aliased: the caller's dict may hold another optimizer's live state.
    if lay.kind in ("plain", "replicate"):
        full = value.full_tensor() if isinstance(value, DTensor) else value.clone()
        if lay.kind == "replicate":
            return DTensor.from_local(full, p.device_mesh, p.placements, run_check=False)
        return full
    placements = _placements_for(lay, p, per_block)
    if isinstance(value, DTensor):
        if value.device_mesh != lay.mesh:
            full = value.full_tensor()
        else:
            from ..placement.redistribute import redistribute

            if tuple(value.placements) == placements:
                return value.clone()
            return redistribute(value, lay.mesh, placements)
    else:
        full = value
    if per_block is None:
        if lay.kind == "ragged":  # the outer-local piece, then this rank's run of it
            return like_param(my_piece(full, p._spec).clone(), p)
        a, b = lay.local_range
        local = full.reshape(-1)[a:b].clone()
        return like_param(local, p)
    a, b = lay.local_range
    lo, hi = a // per_block, -(-b // per_block) if b > a else a // per_block
    if lay.outer_shards:  # this rank's row of blocks
        full = full[tuple(o // n if n else 0 for o, n in zip(lay.outer_offset, lay.outer_shape))]
    return blocks_like(full.reshape(-1)[lo:hi].clone(), p, lay, per_block)


def load_scalars(opt, state_dict: dict) -> tuple[dict, list]:
    """Load a state dict's param groups and non-tensor / ``step`` states through torch's
    ``Optimizer.load_state_dict``; return the tensor states it held back (saved param id ->
    {key: value}) and the saved param ids in param-group order, for the caller to lay out
    like its parameters. Step counters are copied (torch would share them with the dict)."""
    from itertools import chain

    from torch.optim import Optimizer

    held, stripped = {}, {}
    for pid, st in state_dict["state"].items():
        held[pid] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"}
        stripped[pid] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in st.items() if k not in held[pid]}
    Optimizer.load_state_dict(opt, dict(state_dict, state=stripped))
    return held, list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
