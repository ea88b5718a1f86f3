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

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ragged_fsdp.shapes import numel_of  # noqa: F401 - re-exported

from .ragged_shard import RaggedShard
from .spec import (  # noqa: F401 - the spec math, re-exported where it used to live
    element_ranges, expected_local_shape, has_outer_shards, local_range, local_rank_on, make_spec, my_piece,
    outer_offsets, outer_piece, outer_placements, outer_shape, ragged_dim, spec_mismatch, split_groups,
)

__all__ = [
    "RaggedDTensor", "ragged_dim", "make_spec", "wrap", "spec_mismatch", "rebuild_ragged",
    "outer_shape", "outer_offsets", "outer_placements", "outer_piece", "my_piece", "local_range",
    "split_groups", "has_outer_shards",
]




class RaggedDTensor(DTensor):
    """A DTensor whose data-parallel placement is a RaggedShard.

    Build one with :func:`ragged_fsdp.from_local` or :func:`ragged_fsdp.distribute_tensor`;
    the class constructor is internal (it trusts its arguments).
    """

    # DTensor.__new__ is the C++ constructor; it accepts any Placement object.
    __new__ = DTensor.__new__

    def __init__(self, *args, **kwargs):
        # DTensor's __init__ only calls Tensor's (which does nothing) from behind two
        # decorators (dynamo off, export marking) that cost more than an elementwise op on
        # a small parameter; every out-of-place op on a RaggedDTensor builds one of these.
        pass
    # __torch_dispatch__, full_tensor, redistribute and the DCP hooks are bound in
    # binding.py: they are ops.py, redistribute.py and dcp.py, which build on this class.

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
