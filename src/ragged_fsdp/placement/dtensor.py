"""RaggedDTensor: the DTensor subclass that carries RaggedShard placements.

torch's DTensor dispatch (C++) only knows Shard / Replicate / Partial, so a new placement
needs a subclass whose ``__torch_dispatch__`` is ours (see ``ops.py``). The subclass keeps
DTensor's fields (``_local_tensor``, ``_spec``) so ``isinstance(t, DTensor)``, ``placements``,
``device_mesh`` and ``to_local`` behave as users expect.

Exactly one mesh dimension carries the RaggedShard. Every other mesh dimension is
``Replicate()`` (HSDP's replicate dim) or an even ``Shard(k)`` (tensor or expert parallelism).
The RaggedShard always applies *last*, whatever its position in the placements: the other
placements first cut the global tensor into the "outer-local" tensor (the TP/EP-local
tensor, by DTensor's left-to-right chunking), and the RaggedShard splits that tensor's
row-major elements over its mesh dim. That is what ``fully_shard`` after
``parallelize_module`` produces (TP first, then FSDP on the TP-local tensor), for
ColwiseParallel (both split dim 0: torch needs ``_StridedShard`` to say this) and
RowwiseParallel alike. Splits of the outer placements must be even, so that every rank of
the RaggedShard's mesh dim sees the same outer-local shape and one placement describes them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_fsdp.shapes import contiguous_stride, numel_of  # noqa: F401 - numel_of re-exported

from .ragged_shard import RaggedShard

__all__ = [
    "RaggedDTensor", "ragged_dim", "make_spec", "wrap", "spec_mismatch", "rebuild_ragged",
    "outer_shape", "outer_offsets", "outer_placements", "outer_piece", "my_piece", "local_range",
    "split_groups", "has_outer_shards",
]




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


class RaggedDTensor(DTensor):
    """A DTensor whose data-parallel placement is a RaggedShard.

    Build one with :func:`ragged_fsdp.from_local` or :func:`ragged_fsdp.distribute_tensor`;
    the class constructor is internal (it trusts its arguments).
    """

    # DTensor.__new__ is the C++ constructor; it accepts any Placement object.
    __new__ = DTensor.__new__

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .ops import dispatch

        return dispatch(func, args, kwargs or {})

    def __repr__(self):
        return (
            f"RaggedDTensor(local_tensor={self._local_tensor}, shape={tuple(self.shape)}, "
            f"device_mesh={self._spec.mesh}, placements={self._spec.placements})"
        )

    def __tensor_flatten__(self):
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        spec, requires_grad = flatten_spec
        return RaggedDTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    # -- pickling and copying (torch.save, copy.deepcopy, multiprocessing) -------------
    # torch's generic path pickles a wrapper subclass by its own storage when its data
    # pointer is non-zero, and a wrapper built over a local piece that starts at a
    # non-zero offset of a shared flat buffer has a non-zero (fake) pointer and no real
    # storage: "invalid python storage". So we reduce to (local piece, spec) ourselves,
    # with the piece copied out compactly: the shared buffer behind it is not saved.
    def __reduce_ex__(self, proto):
        state = dict(self.__dict__)
        for key in ("_sym_size_cache", "_sym_stride_cache"):  # torch's per-object caches
            state.pop(key, None)
        return (rebuild_ragged, (_compact(self._local_tensor), self._spec, self.requires_grad, state or None))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "RaggedDTensor: only leaf tensors (parameters, state-dict entries, detached "
                "tensors) can be deep-copied, as for torch.Tensor; detach() it first"
            )
        with torch.no_grad():
            local = self._local_tensor.detach().clone()
        out = RaggedDTensor(local, self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = out
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        out.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return out

    # -- user-facing conversions (differentiable) --------------------------------------
    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local_tensor
        return _ToLocal.apply(self)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        from .redistribute import redistribute

        out = redistribute(self, self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return out.to_local()

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False, **kwargs):
        from .redistribute import redistribute

        if placements is None:
            raise ValueError("redistribute: placements is required")
        return redistribute(self, device_mesh or self.device_mesh, placements)

    # -- torch.distributed.checkpoint hooks (the local run as a few boxes) --------------
    def __create_write_items__(self, fqn: str, object):
        from .dcp import create_write_items

        return create_write_items(object, fqn)

    def __create_chunk_list__(self):
        from .dcp import create_chunk_list

        return create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        from .dcp import get_tensor_shard

        return get_tensor_shard(self, index)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self._local_tensor.shape)

    @property
    def local_range(self) -> tuple[int, int]:
        """[a, b) of this rank's elements in the flattened outer-local tensor (the global
        tensor when the other placements are Replicate)."""
        return local_range(self._spec)

    @property
    def ragged_placement(self) -> RaggedShard:
        return self._spec.placements[ragged_dim(self._spec.placements)]


def _compact(local: torch.Tensor) -> torch.Tensor:
    """``local`` detached, in storage of its own size (a copy when it is a view into a
    larger buffer), so pickling writes this rank's elements and nothing else."""
    local = local.detach()
    if local.device.type == "meta" or isinstance(local, torch._subclasses.fake_tensor.FakeTensor):
        return local
    whole = local.storage_offset() == 0 and local.untyped_storage().nbytes() == local.numel() * local.element_size()
    if whole and local.is_contiguous():
        return local
    with torch.no_grad():
        return local.clone(memory_format=torch.contiguous_format)


def rebuild_ragged(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool, state=None) -> RaggedDTensor:
    """Unpickling: the inverse of ``RaggedDTensor.__reduce_ex__`` (registered with
    ``torch.serialization.add_safe_globals`` so ``torch.load(weights_only=True)`` accepts it)."""
    out = RaggedDTensor(local, spec, requires_grad=bool(requires_grad))
    if state:
        out.__dict__.update(state)
    return out


def wrap(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> RaggedDTensor:
    """Wrap ``local`` (no copy) with ``spec``; dtype in the spec follows ``local``."""
    if spec.tensor_meta.dtype != local.dtype:
        spec = DTensorSpec(
            spec.mesh,
            spec.placements,
            tensor_meta=TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, local.dtype),
        )
    return RaggedDTensor(local, spec, requires_grad=requires_grad)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt):
        ctx.spec = dt._spec
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        return wrap(grad.contiguous(), ctx.spec)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, spec):
        return wrap(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad):
        return (grad._local_tensor if isinstance(grad, RaggedDTensor) else grad), None
