"""Which ranks a parameter is sharded and replicated over, and the DTensor it becomes.

A :class:`DPMesh` is the data-parallel part of a mesh: the dim the RaggedShard splits
(``shard``) and, for HSDP, the dim the sharded segments are replicated over
(``replicate``). A :class:`ParamPlacement` says, for one parameter, what data the planner
packs (the TP/EP-local tensor when the parameter is already a DTensor), the mesh and
placements of its sharded DTensor (the RaggedShard slot left as None) and the DTensor spec
its unsharded parameter has (None for a plain tensor).

The three ways a mesh reaches ``fully_shard``, as with torch's FSDP2:

* ``mesh`` 1-D: FSDP; 2-D: HSDP, dims (replicate, shard);
* a parameter that is a DTensor of TP/EP on another mesh of the same root mesh: the
  sharded parameter lives on the two meshes concatenated, (dp dims..., its dims...);
* ``dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)`` with ``mesh`` the full SPMD
  mesh: every parameter is a DTensor on that mesh, Replicate on the named dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...quant.foreign import adopt_foreign
from ..comms.collectives import Comm
from ..torch_private import DTensorSpec

__all__ = [
    "CallMesh", "DPMesh", "ParamPlacement", "resolve_mesh", "mesh_device", "place_param", "shard_placement_mesh",
    "place_params", "describe_dp", "check_shard_answer", "is_default_mesh",
]


@dataclass(eq=False)
class DPMesh:
    mesh: DeviceMesh  # the data-parallel mesh: (shard,) or (replicate, shard)
    shard: Comm
    replicate: Comm | None = None
    spmd_mesh: DeviceMesh | None = None  # dp_mesh_dims: the full mesh parameters live on
    shard_index: int | None = None  # dp_mesh_dims: the shard dim's index in spmd_mesh
    replicate_index: int | None = None

    @property
    def size(self) -> int:
        """Data-parallel ranks a gradient is averaged over (shard x replicate)."""
        return self.shard.world_size * (self.replicate.world_size if self.replicate else 1)

    def dp_placements(self) -> tuple:
        """Placements of the dp dims, the RaggedShard slot as None."""
        return (None,) if self.replicate is None else (Replicate(), None)


def _comm(mesh: DeviceMesh, dim: int) -> Comm:
    return Comm.of(mesh.get_group(dim))


@dataclass(eq=False)
class CallMesh:
    """What one ``fully_shard`` call's ``mesh``/``dp_mesh_dims`` resolve to, checked once."""
    mesh: DeviceMesh  # as passed (or the default 1-D world mesh)
    dp: DPMesh  # its data-parallel dims
    device: torch.device  # where the sharded state lives


def resolve_mesh(mesh: DeviceMesh | None, dp_mesh_dims=None) -> CallMesh:
    """The one place a ``fully_shard`` mesh is defaulted, validated and split into its
    data-parallel dims; the group is handed the result and never looks at the raw mesh."""
    mesh = mesh if mesh is not None else _default_mesh()
    _validate(mesh, dp_mesh_dims)
    return CallMesh(mesh, _dp_mesh_of(mesh, dp_mesh_dims), mesh_device(mesh))


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: initialise torch.distributed (or pass mesh=) first")
    kind = "cuda" if torch.cuda.is_available() and "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def _validate(mesh: DeviceMesh, dp_mesh_dims=None) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if dp_mesh_dims is None and mesh.ndim > 2:
        raise ValueError(
            f"fully_shard: got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; pass the 1-D data-parallel "
            "mesh (FSDP), a 2-D (replicate, shard) mesh (HSDP), or the full mesh together with "
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)"
        )
    if dp_mesh_dims is None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            "fully_shard: a 2-D mesh means HSDP (dims: replicate, shard); build it with "
            "init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard: this rank ({dist.get_rank()}) is not in the mesh {mesh}")
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        if dist.get_world_size(group) != mesh.size(d):
            raise ValueError(
                f"fully_shard: mesh dim {d} has {mesh.size(d)} ranks but its process group has "
                f"{dist.get_world_size(group)}; build the mesh from the process group you train on"
            )
        backend = str(dist.get_backend(group)).lower()
        if mesh.device_type == "cpu" and "gloo" not in backend and "cpu:" not in backend:
            raise ValueError(
                f"fully_shard: the mesh is on cpu but its process group uses {backend!r}, which "
                "cannot move CPU tensors; use a gloo process group or a cuda mesh"
            )
        if mesh.device_type == "cuda" and "nccl" not in backend and "gloo" not in backend:
            raise ValueError(f"fully_shard: the mesh is on cuda but its process group uses {backend!r}")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)



def _dp_mesh_of(mesh: DeviceMesh, dp_mesh_dims=None) -> DPMesh:
    if dp_mesh_dims is None:  # _validate refused more than 2 dims
        if mesh.ndim == 1:
            return DPMesh(mesh, _comm(mesh, 0))
        return DPMesh(mesh, _comm(mesh, 1), _comm(mesh, 0))
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("fully_shard: dp_mesh_dims needs a mesh with mesh_dim_names")
    shard, rep = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    if len(shard) != 1 or len(rep) > 1:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dp_mesh_dims} names {len(shard)} shard and {len(rep)} "
            "replicate dims; ragged_fsdp takes exactly one shard dim and at most one replicate "
            "dim (flatten several into one mesh dim when you build the mesh)"
        )
    for n in shard + rep:
        if n not in names:
            raise ValueError(f"fully_shard: dp_mesh_dims names {n!r}, which is not a dim of the mesh {names}")
    s = names.index(shard[0])
    r = names.index(rep[0]) if rep else None
    dp = mesh[(rep[0], shard[0])] if rep else mesh[shard[0]]
    return DPMesh(dp, _comm(mesh, s), _comm(mesh, r) if rep else None, spmd_mesh=mesh,
                  shard_index=s, replicate_index=r)


def shard_placement_mesh(result, default: DPMesh, cache: dict) -> DPMesh:
    """The DPMesh a ``shard_placement_fn`` result asks for. A ``Shard(dim)`` or None keeps
    the default (the planner decides the layout; FSDP2's dim choice is about padding, which
    RaggedShard does not need); torch's ``ShardPlacementResult`` may name another mesh."""
    if result is None or isinstance(result, Shard):
        return default
    info = getattr(result, "mesh_info", None)
    if info is None or not hasattr(info, "mesh"):
        raise TypeError(
            f"fully_shard: shard_placement_fn returned {result!r}; expected None, a Shard or "
            "torch's ShardPlacementResult(placement, mesh_info)"
        )
    if is_default_mesh(info, default):
        # torchtitan's EP layout answers a ShardPlacementResult for every parameter, the
        # call's own mesh for the non-experts: those stay in the call's buffers
        return default
    mesh = info.mesh
    key = id(mesh)
    if key not in cache:
        rep = getattr(info, "replicate_mesh_dim", None)
        if getattr(info, "dp_mesh_dims", None) is not None:
            cache[key] = resolve_mesh(info.spmd_mesh, info.dp_mesh_dims).dp
        elif rep is None:
            cache[key] = DPMesh(mesh, _comm(mesh, info.shard_mesh_dim))
        else:
            cache[key] = DPMesh(mesh, _comm(mesh, info.shard_mesh_dim), _comm(mesh, rep))
    return cache[key]


def is_default_mesh(info, default: DPMesh) -> bool:
    """Whether FSDP2 mesh info ``info`` (a ``ShardPlacementResult.mesh_info``) names the same
    data-parallel mesh, shard dim and replicate dim as ``default``, the mesh of the call."""
    if default.spmd_mesh is not None or getattr(info, "dp_mesh_dims", None) is not None:
        return False
    if info.mesh is not default.mesh and info.mesh != default.mesh:
        return False
    rep = getattr(info, "replicate_mesh_dim", None)
    if default.replicate is None:
        return rep is None and info.shard_mesh_dim == 0
    return rep == 0 and info.shard_mesh_dim == 1


@dataclass
class ParamPlacement:
    # what the planner packs: the parameter, or its TP/EP-local tensor; a foreign quantised
    # weight already adopted (ragged_fsdp.quant.foreign's table)
    data: torch.Tensor
    dp: DPMesh
    mesh: DeviceMesh  # the sharded DTensor's mesh
    placements: tuple  # its placements, None where the RaggedShard goes
    unsharded_spec: DTensorSpec | None  # the unsharded parameter's DTensor spec, or None
    dp_dims: tuple[int, ...] = ()  # dp_mesh_dims: dims of unsharded_spec's mesh that are data-parallel

    def with_ragged(self, ragged) -> tuple:
        return tuple(ragged if p is None else p for p in self.placements)


def _check_dtensor_placements(fqn: str, p: DTensor) -> None:
    for i, q in enumerate(p.placements):
        if isinstance(q, Replicate) or type(q) is Shard:
            continue
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a DTensor with placements {tuple(p.placements)} on "
            f"mesh {p.device_mesh.mesh_dim_names or tuple(p.device_mesh.shape)}; next to the "
            f"data-parallel RaggedShard only Replicate() and even Shard(k) placements are supported "
            f"({q} on mesh dim {i} is not: reduce a Partial, or use Shard instead of _StridedShard)"
        )
    shape = list(p.shape)
    for i, q in enumerate(p.placements):
        if type(q) is Shard:
            n = p.device_mesh.size(i)
            if shape[q.dim] % n:
                raise NotImplementedError(
                    f"fully_shard: parameter {fqn!r} of shape {tuple(p.shape)} is split by {q} over "
                    f"{n} ranks unevenly; fully_shard composes with even TP/EP splits (pick sizes "
                    "the TP/EP degree divides)"
                )
            shape[q.dim] //= n


def _concatenate(dp_mesh: DeviceMesh, other: DeviceMesh, fqn: str, p: DTensor) -> DeviceMesh:
    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is None:
        raise NotImplementedError("fully_shard: this torch has no DeviceMesh._concatenate; TP/EP composition needs torch >= 2.11")
    if dp_mesh.mesh_dim_names is None or other.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor on mesh {tuple(other.shape)} with placements "
            f"{tuple(p.placements)}, which does not compose with the data-parallel mesh: TP/EP "
            "composition needs named meshes sliced from one root mesh: build it with "
            "init_device_mesh(..., mesh_dim_names=(...)) and pass mesh['dp'] and mesh['tp']"
        )
    try:
        return concat([dp_mesh, other])
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/ValueError/AssertionError
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor on mesh {other.mesh_dim_names} with "
            f"placements {tuple(p.placements)}, which does not compose with the data-parallel mesh "
            f"{dp_mesh.mesh_dim_names} ({e}). Slice both from the same root mesh, e.g. "
            "mesh = init_device_mesh('cpu', (dp, tp), mesh_dim_names=('dp', 'tp')); "
            "parallelize_module(model, mesh['tp'], plan); fully_shard(block, mesh=mesh['dp'])"
        ) from None


def place_param(fqn: str, p: nn.Parameter, dp: DPMesh) -> ParamPlacement:
    if dp.spmd_mesh is not None:  # dp_mesh_dims: DTensors on the full mesh
        if not isinstance(p, DTensor):
            raise ValueError(
                f"fully_shard: with dp_mesh_dims every parameter must be a DTensor on the full mesh "
                f"(e.g. via distribute_module); {fqn!r} is a plain tensor"
            )
        if p.device_mesh != dp.spmd_mesh:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} lives on mesh {p.device_mesh.mesh_dim_names}, not on "
                f"the mesh passed with dp_mesh_dims ({dp.spmd_mesh.mesh_dim_names})"
            )
        for i in (dp.shard_index, dp.replicate_index):
            if i is not None and not isinstance(p.placements[i], Replicate):
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} has {p.placements[i]} on the data-parallel dim "
                    f"{dp.spmd_mesh.mesh_dim_names[i]!r}; it must be Replicate() there"
                )
        _check_dtensor_placements(fqn, p)
        placements = tuple(None if i == dp.shard_index else q for i, q in enumerate(p.placements))
        dp_dims = tuple(i for i in (dp.shard_index, dp.replicate_index) if i is not None)
        return ParamPlacement(adopt_foreign(p._local_tensor), dp, dp.spmd_mesh, placements, p._spec, dp_dims)
    if isinstance(p, DTensor):
        _check_dtensor_placements(fqn, p)
        mesh = _concatenate(dp.mesh, p.device_mesh, fqn, p)
        placements = dp.dp_placements() + tuple(p.placements)
        return ParamPlacement(adopt_foreign(p._local_tensor), dp, mesh, placements, p._spec)
    return ParamPlacement(adopt_foreign(p), dp, dp.mesh, dp.dp_placements(), None)


# -- what every rank must agree on (checked by consistency.check_same_answers) -------------

def mesh_signature(mesh: DeviceMesh) -> str:
    """A mesh as a string that is the same on every rank of it: device, dim names, sizes and
    the ranks of every group (torch's layout over the root rank map; a slice's own ``mesh``
    tensor differs from rank to rank, its layout does not)."""
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None:
        groups = f"layout={layout} ranks={tuple(int(r) for r in rank_map.tolist())}"
    else:  # older torch: the root mesh and this mesh's dim names say which slice it is
        groups = f"root={mesh._get_root_mesh().mesh.tolist()}"
    return f"{mesh.device_type} dims={mesh.mesh_dim_names} shape={tuple(mesh.shape)} {groups}"


def _dim_of(mesh: DeviceMesh, comm: Comm) -> str:
    """Which dim of ``mesh`` a group is (rank-independent, unlike the group's ranks)."""
    for d in range(mesh.ndim):
        if mesh.get_group(d) is comm.group:
            return str(d)
    return f"a group of {comm.world_size} outside it"


def describe_dp(dp: DPMesh) -> str:
    """What must be identical on every rank about the data-parallel mesh a parameter uses."""
    out = f"mesh {mesh_signature(dp.mesh)} shard dim {_dim_of(dp.mesh, dp.shard)}"
    if dp.replicate is not None:
        out += f" replicate dim {_dim_of(dp.mesh, dp.replicate)}"
    if dp.spmd_mesh is not None:
        out += f" spmd {mesh_signature(dp.spmd_mesh)} dp dims ({dp.shard_index}, {dp.replicate_index})"
    return out


def check_shard_answer(fqn: str, p: torch.Tensor, result) -> None:
    """Refuse a ``Shard(dim)`` the parameter has no such dim for, as torch's FSDP2 does (a
    0-d parameter takes ``Shard(0)``: it is kept whole)."""
    if isinstance(result, Shard):
        placement = result
    elif hasattr(result, "mesh_info"):
        placement = result.placement
        if placement is not None and not isinstance(placement, Shard):
            raise TypeError(
                f"fully_shard: shard_placement_fn returned placement {placement!r} for {fqn!r}; "
                "expected ShardPlacementResult(Shard(dim) or None, mesh_info)"
            )
    else:
        return  # None keeps the default; anything else is refused by shard_placement_mesh
    if placement is None:
        return
    n = max(p.dim(), 1)
    if not -n <= placement.dim < n:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned {placement} for parameter {fqn!r} of shape "
            f"{tuple(p.shape)}, which has no dim {placement.dim}; return Shard(k) with "
            f"-{n} <= k < {n}, or None for the default"
        )


def place_params(params, shard_placement_fn, dp: DPMesh):
    """Every parameter's placement, and with a ``shard_placement_fn`` one line per parameter
    naming the mesh its answer chose, for the cross-rank check.

    A failure (the user's function raising, a bad answer, a DTensor that does not compose)
    is handed back instead of raised, so the check can raise it on every rank: raised here
    on one rank only, the others would wait in the check's collective until the timeout.
    Returns ``(placed, lines, error)``."""
    meshes: dict = {}
    placed, lines = [], []
    try:
        for name, p, _ in params:
            own = dp
            if shard_placement_fn is not None:
                result = shard_placement_fn(p)
                check_shard_answer(name, p, result)
                own = shard_placement_mesh(result, dp, meshes)
                lines.append(f"{name}: {describe_dp(own)}")
            placed.append(place_param(name, p, own))
    except Exception as e:  # noqa: BLE001 - the user's function may raise anything; re-raised by the check
        return None, lines, e
    return placed, lines, None
