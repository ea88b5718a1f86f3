"""Bytes each rank sends per collective kind, counted by wrapping ``torch.distributed``'s
collective functions for the duration of a ``with CommCounter(...)`` block.

Every module-level reference to an original function is swapped, not only the attribute of
``torch.distributed``: frameworks bind names at import (ragged_fsdp keeps
``_all_gather_single``), and a patch of ``dist.X`` alone would miss those calls. A call
made from inside another wrapped call (one collective implemented with another) counts once,
as the outer one.

The counting rule (what the collective's definition makes this rank contribute to the other
ranks of the group, each element counted once, however the backend routes it):

* all-gather: the input (this rank's piece, which every other rank receives);
* reduce-scatter: the input minus this rank's own piece ((W-1)/W of it);
* all-to-all: the input splits addressed to other ranks (its own split excluded);
* all-reduce: the buffer;
* broadcast: the tensor on the source rank, 0 elsewhere; reduce and gather: the tensor on
  every rank but the destination; scatter: the pieces for other ranks, on the source;
* send / isend: the tensor; recv / irecv: 0; ``batch_isend_irecv``: its sends;
* barrier and the ``*_object`` calls: counted as calls, 0 bytes (no step calls them).

Pure rules (``sent_bytes``) are apart from the patching (``CommCounter``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["KINDS", "KIND_OF", "CommCounter", "sent_bytes"]

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "other")

# every collective of torch.distributed a training step could reach, by kind
KIND_OF = {
    "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
    "all_gather": "all_gather", "all_gather_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "broadcast": "other", "reduce": "other", "gather": "other", "scatter": "other",
    "send": "other", "recv": "other", "isend": "other", "irecv": "other", "batch_isend_irecv": "other",
    "barrier": "other", "monitored_barrier": "other", "all_gather_object": "other",
    "broadcast_object_list": "other", "gather_object": "other", "scatter_object_list": "other",
}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _arg(args, kwargs, i: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def sent_bytes(name: str, args: tuple, kwargs: dict, world: int, rank: int) -> int:
    """Bytes this rank (``rank`` of ``world`` in the call's group) sends by the module rule."""
    if world <= 1:
        return 0
    if name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        return _nbytes(_arg(args, kwargs, 1, "input_tensor"))
    if name == "all_gather":
        return _nbytes(_arg(args, kwargs, 1, "tensor"))
    if name == "all_gather_coalesced":
        return sum(_nbytes(t) for t in _arg(args, kwargs, 1, "input_tensor_list"))
    if name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        inp = _arg(args, kwargs, 1, "input")
        return _nbytes(inp) - _nbytes(inp) // world
    if name == "reduce_scatter":
        return sum(_nbytes(t) for k, t in enumerate(_arg(args, kwargs, 1, "input_list")) if k != rank)
    if name == "all_to_all_single":
        inp = _arg(args, kwargs, 1, "input")
        splits = _arg(args, kwargs, 3, "input_split_sizes")
        if not splits:
            return _nbytes(inp) - _nbytes(inp) // world
        row = _nbytes(inp) // max(1, inp.shape[0]) if inp.dim() else 0
        return sum(int(s) for k, s in enumerate(splits) if k != rank) * row
    if name == "all_to_all":
        return sum(_nbytes(t) for k, t in enumerate(_arg(args, kwargs, 1, "input_tensor_list")) if k != rank)
    if name == "all_reduce":
        return _nbytes(_arg(args, kwargs, 0, "tensor"))
    if name == "all_reduce_coalesced":
        return sum(_nbytes(t) for t in _arg(args, kwargs, 0, "tensors"))
    if name in ("send", "isend"):
        return _nbytes(_arg(args, kwargs, 0, "tensor"))
    if name == "batch_isend_irecv":
        ops = _arg(args, kwargs, 0, "p2p_op_list")
        return sum(_nbytes(p.tensor) for p in ops if getattr(p.op, "__name__", "") == "isend")
    if name in ("broadcast", "reduce", "gather", "scatter"):
        # the root is a global rank (``src`` / ``dst``) or a group rank (``group_src`` / ``group_dst``)
        pos = {"broadcast": (1, "src"), "reduce": (1, "dst"), "gather": (2, "dst"), "scatter": (2, "src")}[name]
        root_group = kwargs.get("group_src", kwargs.get("group_dst"))
        if root_group is None:
            group = _group_of(name, args, kwargs) or c10d._get_default_group()
            root = _arg(args, kwargs, *pos)
            me_root = root == dist.get_global_rank(group, rank)
        else:
            me_root = root_group == rank
        t = _nbytes(_arg(args, kwargs, 0, "tensor"))
        if name == "broadcast":
            return t if me_root else 0
        if name == "scatter":
            pieces = _arg(args, kwargs, 1, "scatter_list") or []
            return sum(_nbytes(x) for k, x in enumerate(pieces) if k != rank) if me_root else 0
        return 0 if me_root else t
    return 0


def _group_of(name: str, args, kwargs):
    """The process group argument of a collective call (None: the default group)."""
    pos = {"all_reduce": 2, "broadcast": 2, "all_reduce_coalesced": 2, "barrier": 0, "reduce": 3, "gather": 3,
           "scatter": 3, "send": 2, "isend": 2, "recv": 2, "irecv": 2}.get(name)
    if "group" in kwargs:
        return kwargs["group"]
    if pos is None:
        # (out, in, [op | splits...], group=...) calls pass the group by keyword in both frameworks
        pos = {"all_to_all_single": 4, "reduce_scatter_single": 3, "reduce_scatter_tensor": 3,
               "_reduce_scatter_base": 3, "reduce_scatter": 3, "all_gather_single": 2,
               "all_gather_into_tensor": 2, "_all_gather_base": 2, "all_gather": 2, "all_to_all": 2}.get(name)
    return args[pos] if pos is not None and len(args) > pos else None


class CommCounter:
    """Counts calls and sent bytes of every collective in ``KIND_OF`` while active.

    ``label_group(group) -> str`` names the group of a call (e.g. "shard", "replicate");
    ``totals`` maps ``(name, kind, group label, dtype) -> [calls, bytes]``."""

    def __init__(self, label_group: Callable[[object], str] | None = None):
        self.label_group = label_group or (lambda g: f"size{dist.get_world_size(g)}")
        self.totals: dict[tuple[str, str, str, str], list[int]] = {}
        self._patched: list[tuple[object, str, object]] = []
        self._local = threading.local()

    def _wrap(self, name: str, orig):
        counter = self

        def wrapped(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                counter._record(name, args, kwargs)
            counter._local.depth = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                counter._local.depth = depth

        wrapped.__name__ = name
        wrapped.__wrapped__ = orig
        return wrapped

    def _record(self, name, args, kwargs) -> None:
        group = _group_of(name, args, kwargs)
        g = group if group is not None else c10d._get_default_group()
        world, rank = dist.get_world_size(g), dist.get_rank(g)
        first = args[0] if args else next(iter(kwargs.values()), None)
        t = first[0] if isinstance(first, (list, tuple)) and first else first
        dtype = str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else "-"
        key = (name, KIND_OF[name], self.label_group(g) if world > 1 else "size1", dtype)
        row = self.totals.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += sent_bytes(name, args, kwargs, world, rank)

    def __enter__(self) -> "CommCounter":
        originals = {id(getattr(c10d, n)): (n, getattr(c10d, n)) for n in KIND_OF if hasattr(c10d, n)}
        wrappers = {i: self._wrap(n, f) for i, (n, f) in originals.items()}
        for mod in list(sys.modules.values()):
            try:
                items = list(vars(mod).items())
            except TypeError:
                continue
            for attr, val in items:
                w = wrappers.get(id(val))
                if w is not None and val is originals[id(val)][1]:
                    try:
                        setattr(mod, attr, w)
                    except (AttributeError, TypeError):  # a read-only namespace: CommDebugMode's count shows a miss
                        continue
                    self._patched.append((mod, attr, val))
        return self

    def __exit__(self, *exc) -> None:
        for mod, attr, val in reversed(self._patched):
            setattr(mod, attr, val)
        self._patched.clear()

    def by_kind(self, float_only: bool = False) -> dict[str, int]:
        """Sent bytes per kind (``float_only``: floating-point payloads only)."""
        out = {k: 0 for k in KINDS}
        for (_, kind, _, dtype), (_, b) in self.totals.items():
            if float_only and not dtype.startswith(("float", "bfloat")):
                continue
            out[kind] += b
        return out

    def rows(self) -> list[dict]:
        return [{"fn": n, "kind": k, "group": g, "dtype": d, "calls": c, "bytes": b}
                for (n, k, g, d), (c, b) in sorted(self.totals.items())]
