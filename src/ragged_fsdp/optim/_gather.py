"""Which ranks hold a piece of a parameter's matrices, and the process group over them.

Muon's owner must see a *whole global* matrix. On a 1-D layout (or HSDP: RaggedShard next to
Replicate dims) the pieces of a matrix live on the ranks of the RaggedShard's mesh dim. With
tensor parallelism a ``Shard`` on one of the last two tensor dims cuts every matrix into
*tiles* (one outer-local matrix per TP coordinate), and the RaggedShard cuts each tile's
row-major elements over its dim: the owner needs the pieces from the ranks of the RaggedShard
dim *and* of those TP dims. A ``Shard`` on a leading dim (expert parallelism over stacked
``(E, H, I)`` experts) puts whole matrices on different ranks, so it does not widen the set:
an expert's pieces stay on the RaggedShard ranks of its EP rank. Replicate dims do not either:
each replica gathers and orthogonalises the same matrices (same bits on every replica).

:func:`gather_set` returns, for one layout, the members of this rank's set in group-rank
order: each member's rank on the RaggedShard dim (which run of the outer-local tensor it
holds) and the offset of its tile in the global matrix. The math (:func:`members`) is pure;
:func:`subgroup` creates process groups spanning several mesh dims, once per mesh and dims.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..placement.dtensor import outer_offsets
from ._layout import Layout

__all__ = ["GatherSet", "gather_set", "matrix_dims", "members", "subgroup"]


@dataclass(frozen=True)
class GatherSet:
    group: object | None  # None: nothing is split (one member, this rank)
    me: int  # this rank's index among the members (its rank in ``group``)
    ragged: tuple[int, ...]  # per member: its rank on the RaggedShard mesh dim
    offsets: tuple[tuple[int, int], ...]  # per member: (row, col) of its tile in the global matrix
    tile: tuple[int, int]  # (rows, cols) of one tile: the outer-local matrix

    @property
    def world(self) -> int:
        return len(self.ragged)

    @property
    def tiled(self) -> bool:
        return any(o != (0, 0) for o in self.offsets)


def matrix_dims(lay: Layout) -> list[int]:
    """Mesh dims whose ``Shard`` cuts the last two tensor dims (tensor parallelism)."""
    nd = len(lay.shape)
    return [i for i, p in enumerate(lay.placements) if type(p) is Shard and p.dim % nd >= nd - 2]


def members(lay: Layout, coordinate: tuple[int, ...], dims: list[int]) -> tuple[list, list, list]:
    """Pure: for this rank at mesh ``coordinate``, every coordinate that differs only on
    ``dims``, in global-rank order, with its RaggedShard rank and tile offset."""
    sizes = [lay.mesh.size(i) for i in dims]
    out = []
    for combo in itertools.product(*(range(n) for n in sizes)):
        c = list(coordinate)
        for i, v in zip(dims, combo):
            c[i] = v
        out.append((int(lay.mesh.mesh[tuple(c)]), tuple(c)))
    out.sort()
    return [r for r, _ in out], [c for _, c in out], sizes


_GROUPS: dict = {}


def subgroup(mesh, dims: tuple[int, ...]):
    """(group, sorted global ranks) of this rank's set of ranks that differ only on mesh
    ``dims``. Creating groups is collective over the whole job: every rank creates every set,
    in the same order (as DeviceMesh does); cached per mesh and dims."""
    t = mesh.mesh
    key = (mesh.device_type, tuple(t.shape), tuple(t.flatten().tolist()), dims)
    hit = _GROUPS.get(key)
    if hit is not None:
        return hit
    other = [i for i in range(t.ndim) if i not in dims]
    n = math.prod(t.shape[i] for i in dims)
    rows = t.permute(other + list(dims)).reshape(-1, n).tolist()
    me = dist.get_rank()
    mine = None
    world = dist.get_world_size()
    for row in rows:
        ranks = sorted(row)
        if ranks == list(range(world)):
            g = dist.group.WORLD  # the set is the whole job: no new group needed
        else:
            g = dist.new_group(ranks)
        if me in ranks:
            mine = (g, ranks)
    if mine is None:
        raise RuntimeError(f"rank {me} is not in the mesh {mesh}; call the optimizer on the mesh's ranks")
    _GROUPS[key] = mine
    return mine


def gather_set(lay: Layout) -> GatherSet:
    """The ranks that hold pieces of ``lay``'s matrices next to this rank (see the module
    docstring), with the process group to move them over."""
    outer = lay.outer_shape
    tile = (outer[-2], outer[-1])
    single = GatherSet(None, 0, (lay.rank,), ((0, 0),), tile)
    if lay.kind in ("plain", "replicate") or lay.group is None:
        return single
    tp = matrix_dims(lay) if lay.outer_shards else []
    if not tp:
        if lay.world <= 1:
            return single
        return GatherSet(lay.group, lay.rank, tuple(range(lay.world)), ((0, 0),) * lay.world, tile)
    dims = tuple(sorted([lay.mesh_dim] + tp))
    ranks, coords, _ = members(lay, tuple(lay.mesh.get_coordinate()), list(dims))
    if len(ranks) == 1:
        return single
    group, granks = subgroup(lay.mesh, dims)
    if granks != ranks:  # cannot happen: both enumerate the same mesh entries
        raise RuntimeError(f"gather_set: group ranks {granks} differ from the layout's {ranks}")
    offsets = tuple(tuple(outer_offsets(lay.spec, c)[-2:]) for c in coords)
    return GatherSet(group, ranks.index(dist.get_rank()), tuple(c[lay.mesh_dim] for c in coords), offsets, tile)
