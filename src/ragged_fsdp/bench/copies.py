"""Count the bytes that ops which only move or cast data write during a region.

The engine claim is about bytes the *framework* copies or casts; user compute copies too
(``.contiguous()``, ``cat`` in the model), so the bench subtracts the count of the same step
run without any FSDP.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

COPY_OPS = {
    aten.copy_.default, aten._to_copy.default, aten.clone.default, aten.cat.default,
    aten.stack.default, aten.split_with_sizes_copy.default, aten._foreach_copy_.default,
    aten._chunk_cat.default, aten.chunk_cat.default if hasattr(aten, "chunk_cat") else aten.cat.default,
    aten.index_select.default, aten.constant_pad_nd.default,
}


def _bytes(out) -> int:
    flat, _ = tree_flatten(out)
    total = 0
    for t in flat:
        if isinstance(t, torch.Tensor):
            local = getattr(t, "_local_tensor", t)
            total += local.numel() * local.element_size()
    return total


class CopyCounter(TorchDispatchMode):
    """``with CopyCounter() as c: ...`` then ``c.bytes`` (total) and ``c.by_op``."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COPY_OPS:
            # in-place ops (copy_, _foreach_copy_) write into their first argument
            target = args[0] if func in (aten.copy_.default, aten._foreach_copy_.default) else out
            self.by_op[str(func)] += _bytes(target)
        return out

    @property
    def bytes(self) -> int:
        return sum(self.by_op.values())
