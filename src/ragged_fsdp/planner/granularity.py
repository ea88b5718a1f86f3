"""What a tensor must keep whole (its granularity) and the planner's view of a tensor.

A granularity names the *block* of a tensor that no rank boundary may cut. Blocks start at the
tensor's first element and tile its row-major flattening; the last block may be partial.

=========  ==============================  ===================================================
spec       block (elements)                RaggedShard ``(dims, unit)``
=========  ==============================  ===================================================
element    1                               all dims, unit 1
row        ``shape[-1]``                   dims ``0..ndim-2``, unit 1
rows:K     ``K * shape[-1]``               dims ``0..ndim-2``, unit K
block:N    ``N`` (flat)                    all dims, unit N
tensor     ``numel`` (the whole tensor)    ``()``, unit 1
=========  ==============================  ===================================================

A 1-D tensor is a single row, so ``row`` and ``rows:K`` keep the whole vector (``dims=()``);
a 0-d tensor is one element, so ``row`` is that element and ``rows:K`` is an error. In every
case ``block_elems(shape) == unit * prod(shape[len(dims):])``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

__all__ = ["Granularity", "TensorSpec", "GRANULARITY_FORMS"]

GRANULARITY_FORMS = "element, row, rows:K (e.g. rows:16), block:N (e.g. block:256), tensor"
_KINDS = ("element", "row", "rows", "block", "tensor")


@dataclass(frozen=True)
class Granularity:
    """A block rule: ``kind`` in element/row/rows/block/tensor, ``n`` = K of rows:K or N of
    block:N (1 for the other kinds)."""

    kind: str
    n: int = 1

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"granularity kind {self.kind!r} is not one of {', '.join(_KINDS)}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"granularity {self.kind}:{self.n}: the count must be an integer >= 1")
        if self.kind in ("element", "row", "tensor") and self.n != 1:
            raise ValueError(f"granularity {self.kind!r} takes no count (got n={self.n})")

    @classmethod
    def parse(cls, spec: Union[str, "Granularity", None]) -> "Granularity | None":
        """``"element"``, ``"row"``, ``"rows:16"``, ``"block:256"``, ``"tensor"``; a
        Granularity passes through and None stays None."""
        if spec is None or isinstance(spec, Granularity):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"granularity {spec!r} must be a string; valid forms: {GRANULARITY_FORMS}")
        text = spec.strip().lower()
        if text in ("element", "row", "tensor"):
            return cls(text)
        kind, sep, count = text.partition(":")
        if sep and kind in ("rows", "block") and count.isdigit() and int(count) >= 1:
            return cls(kind, int(count))
        raise ValueError(f"granularity {spec!r} is not valid; valid forms: {GRANULARITY_FORMS}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.n}" if self.kind in ("rows", "block") else self.kind

    def placement_dims_unit(self, shape) -> tuple[tuple[int, ...], int]:
        """The RaggedShard ``(dims, unit)`` that keeps this granularity's blocks whole."""
        nd = len(shape)
        if self.kind == "element":
            return tuple(range(nd)), 1
        if self.kind == "block":
            return tuple(range(nd)), self.n
        if self.kind == "tensor":
            return (), 1
        if self.kind == "rows" and nd == 0:
            raise ValueError(f"granularity {self} cannot apply to a 0-d tensor (it has no rows)")
        if nd <= 1:  # a vector is one row; a scalar is one element
            return (), 1
        return tuple(range(nd - 1)), (self.n if self.kind == "rows" else 1)

    def block_elems(self, shape) -> int:
        """g_t: elements per block for a tensor of ``shape``."""
        dims, unit = self.placement_dims_unit(shape)
        return unit * math.prod(shape[len(dims):])


ELEMENT = Granularity("element")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the planner sees it. ``granularity=None`` means element granularity;
    a string is parsed. ``itemsize`` may be given as a ``torch.dtype``."""

    name: str
    shape: tuple
    itemsize: int = 4
    granularity: Granularity | None = None

    def __post_init__(self):
        shape = self.shape
        if type(shape) is not tuple or not all(type(s) is int and s >= 0 for s in shape):
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"tensor {self.name!r}: negative size in shape {shape}")
            object.__setattr__(self, "shape", shape)
        itemsize = self.itemsize
        if type(itemsize) is not int:  # a torch.dtype (or anything with .itemsize)
            itemsize = int(getattr(itemsize, "itemsize", itemsize))
            object.__setattr__(self, "itemsize", itemsize)
        if itemsize < 1:
            raise ValueError(f"tensor {self.name!r}: itemsize must be >= 1 byte (got {itemsize})")
        gran = self.granularity
        if gran is not None and type(gran) is not Granularity:
            gran = Granularity.parse(gran)
            object.__setattr__(self, "granularity", gran)
        if gran is not None and gran.kind == "rows" and not shape:
            raise ValueError(f"tensor {self.name!r} of shape (): granularity {gran} cannot apply "
                             "to a 0-d tensor (it has no rows)")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def gran(self) -> Granularity:
        """The effective granularity (element when none was given)."""
        return self.granularity or ELEMENT

    @property
    def block_elems(self) -> int:
        return self.gran.block_elems(self.shape)

    def placement_dims_unit(self) -> tuple[tuple[int, ...], int]:
        return self.gran.placement_dims_unit(self.shape)
