"""The DTensorSpec math of RaggedShard specs: which part of the global tensor a rank holds.

Pure functions of a ``DTensorSpec`` (its mesh's shape and coordinates, its placements and
shape): no tensor subclass, no collective. ``dtensor.py`` (the class), ``ops.py``,
``redistribute.py``, ``dcp.py`` and the optimizers build on them. See ``dtensor.py`` for the
definition of the outer-local tensor the RaggedShard splits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_fsdp.shapes import contiguous_stride

from .ragged_shard import RaggedShard

__all__ = ["ragged_dim", "make_spec", "outer_shape", "has_outer_shards", "outer_placements", "outer_offsets", "outer_piece", "local_range", "my_piece", "split_groups", "local_rank_on", "expected_local_shape", "element_ranges", "spec_mismatch"]


def ragged_dim(placements: Sequence) -> int:
    """Index of the (single) RaggedShard among ``placements``."""
    dims = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(dims) != 1:
        raise ValueError(
            f"placements={tuple(placements)} must hold exactly one RaggedShard; "
            "use torch.distributed.tensor for layouts without one"
        )
    return dims[0]


def make_spec(
    mesh: DeviceMesh, placements: Sequence, shape: Sequence[int], dtype: torch.dtype
) -> DTensorSpec:
    """Validate ``placements`` against ``mesh`` and ``shape`` and build the spec."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements has {len(placements)} entries but the mesh has {mesh.ndim} dims; "
            "give one placement per mesh dimension"
        )
    d = ragged_dim(placements)
    shape = tuple(int(s) for s in shape)
    for i, p in enumerate(placements):
        if i == d or isinstance(p, Replicate) or type(p) is Shard:
            continue
        raise NotImplementedError(
            f"placement {p} on mesh dim {i}{_dim_name(mesh, i)}: next to a RaggedShard only "
            "Replicate() and Shard(k) are supported (reduce a Partial first; a _StridedShard "
            "is what RaggedShard replaces: the RaggedShard always splits the tensor left by "
            "the other placements)"
        )
    placements[d].check(_outer_shape(mesh, placements, shape), mesh.size(d))
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _dim_name(mesh: DeviceMesh, i: int) -> str:
    names = mesh.mesh_dim_names
    return f" ({names[i]!r})" if names else ""


def _outer_shape(mesh: DeviceMesh, placements: Sequence, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = list(shape)
    for i, p in enumerate(placements):
        if type(p) is not Shard:
            continue
        k = p.dim % len(shape) if shape else p.dim
        if k >= len(shape):
            raise ValueError(f"Shard({p.dim}) on mesh dim {i}: the tensor of shape {shape} has no dim {p.dim}")
        n = mesh.size(i)
        if out[k] % n:
            raise NotImplementedError(
                f"Shard({p.dim}) on mesh dim {i}{_dim_name(mesh, i)} splits a dim of size {out[k]} "
                f"(tensor shape {shape}) over {n} ranks unevenly; next to a RaggedShard the other "
                "placements must split evenly (pad that dim, or choose a mesh size that divides it)"
            )
        out[k] //= n
    return tuple(out)


def outer_shape(spec: DTensorSpec) -> tuple[int, ...]:
    """Shape of the tensor the RaggedShard splits: the global tensor cut by the other
    placements (the TP/EP-local tensor; the global shape when they are all Replicate)."""
    return _outer_shape(spec.mesh, spec.placements, tuple(spec.shape))


def has_outer_shards(spec: DTensorSpec) -> bool:
    return any(type(p) is Shard for p in spec.placements)


def outer_placements(spec: DTensorSpec) -> tuple:
    """The placements once the RaggedShard dim is gathered (Replicate there)."""
    d = ragged_dim(spec.placements)
    return tuple(Replicate() if i == d else p for i, p in enumerate(spec.placements))


def outer_offsets(spec: DTensorSpec, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
    """Global offset of this rank's outer-local tensor (left-to-right chunking, even)."""
    mesh, shape = spec.mesh, tuple(spec.shape)
    coord = coordinate if coordinate is not None else mesh.get_coordinate()
    off, size = [0] * len(shape), list(shape)
    for i, p in enumerate(spec.placements):
        if type(p) is not Shard:
            continue
        k = p.dim % len(shape)
        size[k] //= mesh.size(i)
        off[k] += coord[i] * size[k]
    return tuple(off)


def outer_piece(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's outer-local part of a global tensor (a view; ``full`` itself when the
    other placements are all Replicate)."""
    if not has_outer_shards(spec):
        return full
    out = full
    for k, (o, n) in enumerate(zip(outer_offsets(spec), outer_shape(spec))):
        if n != full.shape[k]:
            out = out.narrow(k, o, n)
    return out


def local_range(spec: DTensorSpec) -> tuple[int, int]:
    """[a, b) of this rank's elements in the row-major flattened outer-local tensor."""
    return element_ranges(spec)[local_rank_on(spec)]


def my_piece(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's local elements of a global tensor, flat (a view when possible)."""
    a, b = local_range(spec)
    return outer_piece(full, spec).reshape(-1)[a:b]


def split_groups(spec: DTensorSpec) -> list:
    """Process groups of every mesh dim that splits the tensor (the RaggedShard's and each
    Shard's): a global reduction all-reduces over each of them, never over Replicate dims."""
    return [spec.mesh.get_group(i) for i, p in enumerate(spec.placements)
            if isinstance(p, RaggedShard) or type(p) is Shard]


def local_rank_on(spec: DTensorSpec) -> int:
    return spec.mesh.get_local_rank(ragged_dim(spec.placements))


def expected_local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    d = ragged_dim(spec.placements)
    return spec.placements[d].local_shape(outer_shape(spec), spec.mesh.get_local_rank(d))


def element_ranges(spec: DTensorSpec) -> tuple[tuple[int, int], ...]:
    """Every rank's [a, b) of the flattened outer-local tensor, by RaggedShard rank."""
    d = ragged_dim(spec.placements)
    return _ranges(spec.placements[d], outer_shape(spec))


@functools.lru_cache(maxsize=65536)
def _ranges(placement: RaggedShard, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return placement.element_ranges(shape)


def spec_mismatch(a: DTensorSpec, b: DTensorSpec) -> str | None:
    """Why two ragged specs cannot be combined locally, or None when they can.

    Layouts are compared by element range per rank, not by the placement's fields, so
    ``rows:8`` and an equivalent flat-block placement are the same layout."""
    if a is b or (a.placements == b.placements and a.shape == b.shape and a.mesh is b.mesh):
        return None  # the common case (a param, its grad and its optimizer states)
    if a.mesh != b.mesh:
        return f"meshes differ ({a.mesh} vs {b.mesh})"
    if tuple(a.shape) != tuple(b.shape):
        return f"shapes differ ({tuple(a.shape)} vs {tuple(b.shape)})"
    if ragged_dim(a.placements) != ragged_dim(b.placements):
        return "RaggedShard sits on different mesh dims"
    if outer_placements(a) != outer_placements(b):
        return f"the other placements differ ({a.placements} vs {b.placements})"
    if element_ranges(a) != element_ranges(b):
        return f"layouts differ ({a.placements} vs {b.placements})"
    return None
