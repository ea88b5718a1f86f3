"""RaggedDTensor: the DTensor subclass that carries RaggedShard placements.

torch's DTensor dispatch (C++) only knows Shard / Replicate / Partial, so a new placement
needs a subclass whose ``__torch_dispatch__`` is ours (see ``ops.py``). The subclass keeps
DTensor's fields (``_local_tensor``, ``_spec``) so ``isinstance(t, DTensor)``, ``placements``,
``device_mesh`` and ``to_local`` behave as users expect.

Exactly one mesh dimension carries the RaggedShard; the others must be Replicate (the
data-parallel layout; a second sharded mesh dim is future work).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .ragged_shard import RaggedShard

__all__ = ["RaggedDTensor", "ragged_dim", "make_spec", "wrap", "spec_mismatch", "rebuild_ragged"]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


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
    for i, p in enumerate(placements):
        if i != d and not isinstance(p, Replicate):
            raise NotImplementedError(
                f"placement {p} on mesh dim {i}: next to a RaggedShard only Replicate is supported"
            )
    shape = tuple(int(s) for s in shape)
    placements[d].check(shape, mesh.size(d))
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), dtype)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def local_rank_on(spec: DTensorSpec) -> int:
    return spec.mesh.get_local_rank(ragged_dim(spec.placements))


def expected_local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    d = ragged_dim(spec.placements)
    return spec.placements[d].local_shape(spec.shape, spec.mesh.get_local_rank(d))


def element_ranges(spec: DTensorSpec) -> tuple[tuple[int, int], ...]:
    d = ragged_dim(spec.placements)
    return _ranges(spec.placements[d], tuple(spec.shape))


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
        from ragged_fsdp.checkpoint.dcp_hooks import create_write_items

        return create_write_items(object, fqn)

    def __create_chunk_list__(self):
        from ragged_fsdp.checkpoint.dcp_hooks import create_chunk_list

        return create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        from ragged_fsdp.checkpoint.dcp_hooks import get_tensor_shard

        return get_tensor_shard(self, index)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self._local_tensor.shape)

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


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)
