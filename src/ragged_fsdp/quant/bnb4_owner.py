"""What a bitsandbytes ``Linear4bit`` needs around its sharded 4-bit weight (a RaggedShard
DTensor of :class:`~ragged_fsdp.quant.bnb4.BnB4Weight` pieces, gathered into a ``Params4bit``).

* **State dicts.** bitsandbytes writes ``weight`` and, from ``weight.quant_state``, the keys
  ``weight.absmax``, ``.quant_map``, ``.nested_absmax``, ``.nested_quant_map`` and
  ``.quant_state.bitsandbytes__<type>``. The sharded parameter gets a ``quant_state`` whose
  ``as_dict(packed=True)`` gives them: the absmax and nested absmax as RaggedShard DTensors of
  each rank's blocks (laid out with the codes' rows), the quant maps as the plain tensors
  every rank holds, the packed JSON padded to :data:`~ragged_fsdp.quant.bnb4.BLOB_BYTES`. It
  also carries them as attributes, which torch's ``get_model_state_dict`` resolves the keys
  through. A state-dict hook makes ``weight`` the plain codes (a RaggedShard DTensor in the
  storage dtype), so a checkpoint holds what a one-process bitsandbytes model writes.
* **Loads.** A load pre-hook takes the statistic keys out of the state dict, refuses missing
  ones or a packed JSON made for another quantisation (by key), and copies absmax (this rank's
  blocks of a sharded or full value), quant maps and offset into the weight's own tensors; the
  codes load through the parameter's ``copy_``.
* **eval() on CPU.** bitsandbytes repacks a Linear4bit's weight for avx512-bf16 inference on
  an ``eval()`` forward under ``no_grad``, replacing its data and changing its quant_state (the
  nested absmax dequantised to bf16): later forwards, training too, then differ from the
  checkpoint's weights. ``fully_shard`` turns that repack off on each owner
  (``support_avx512bf16_for_cpu = False``; the unpacked kernel gives the same values) and the
  gather refuses a weight that was replaced anyway.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ragged_fsdp.placement import RaggedDTensor, RaggedShard, from_local
from ragged_fsdp.placement.dtensor import wrap
from ragged_fsdp.quant.bnb4 import STAT_KEYS, BnB4Weight, check_blob, unpack_blob

__all__ = ["attach_bnb4"]


class ShardedQuantState:
    """The ``quant_state`` of a sharded 4-bit weight, as far as saving reads it."""

    packing_format_for_cpu = False

    def __init__(self, stats, absmax: DTensor, nested_absmax: DTensor | None):
        self.stats = stats
        self.absmax, self.code, self.nested_absmax = absmax, stats.code, nested_absmax

    def as_dict(self, packed: bool = False) -> dict:
        s = self.stats
        d = {"absmax": self.absmax, "quant_map": s.code}
        if s.nested:
            d.update(nested_absmax=self.nested_absmax, nested_quant_map=s.nested_code)
        d[s.blob_key()] = s.blob
        return d

    def __getattr__(self, name):
        if name.startswith("bitsandbytes__"):
            return self.as_dict()["quant_state." + name]
        raise AttributeError(name)


def _ranges(slot, stats, world: int) -> list[tuple[int, int]]:
    """Each rank's absmax block range (its code rows' blocks)."""
    nb = _n_blocks(stats, slot.shape[0])
    out = []
    for r in range(world):
        a, b = slot.placement.element_range(slot.shape, r)
        b0, b1 = stats.blocks(a, b) if b > a else (0, 0)
        out.append((min(b0, nb), min(b1, nb)))
    return out


def _n_blocks(stats, rows: int) -> int:
    return -(-rows * stats.values_per_row // stats.blocksize)


def _ragged(local: torch.Tensor, mesh, counts: list[int]) -> DTensor:
    return from_local(local, mesh, (RaggedShard((0,), counts, 1),), (sum(counts),))


def attach_bnb4(sharded: nn.Parameter, piece: BnB4Weight, slot, owners, mesh, world: int) -> None:
    """Wire the sharded parameter ``sharded`` of ``piece``'s weight into its owner modules."""
    stats = piece.stats
    blocks = _ranges(slot, stats, world)
    absmax = _ragged(piece.absmax, mesh, [b - a for a, b in blocks])
    nested = None
    nested_ranges = None
    if stats.nested:
        nested_ranges = [stats.nested_blocks(a, b) if b > a else (0, 0) for a, b in blocks]
        nested = _ragged(piece.nested_absmax, mesh, [b - a for a, b in nested_ranges])
    stats.refresh_blob()
    qs = ShardedQuantState(stats, absmax, nested)
    sharded.quant_state = qs
    sharded.absmax, sharded.quant_map = absmax, stats.code
    if stats.nested:
        sharded.nested_absmax, sharded.nested_quant_map = nested, stats.nested_code
    layout = ([b - a for a, b in blocks], [b - a for a, b in nested_ranges] if stats.nested else None)
    for module, name in owners:
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        if hasattr(module, "quant_state"):
            module.quant_state = None  # the full absmax would stay replicated here otherwise
        module._register_state_dict_hook(functools.partial(_plain_codes, name, sharded))
        module._register_load_state_dict_pre_hook(functools.partial(_load_stats, name, sharded, piece, layout),
                                                  with_module=True)


def _plain_codes(name, sharded, module, state_dict, prefix, local_metadata) -> None:
    key = prefix + name
    v = state_dict.get(key)
    if isinstance(v, RaggedDTensor) and isinstance(v._local_tensor, BnB4Weight):
        state_dict[key] = wrap(v._local_tensor.codes, sharded._spec)


def _my_part(key: str, value, like: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """This rank's part of a saved statistic: a RaggedShard DTensor laid out as ours (the same
    ``counts`` on every rank, so every rank takes the same branch), else the full value (any
    DTensor gathered first: collective) cut to this rank's range; ``counts`` None: replicated."""
    rank = _rank(value)
    rng = (0, like.numel()) if counts is None else (sum(counts[:rank]), sum(counts[:rank + 1]))
    if isinstance(value, RaggedDTensor) and counts is not None and len(value.placements) == 1 \
            and isinstance(value.placements[0], RaggedShard) and value.placements[0].unit == 1 \
            and list(value.placements[0].local_units) == list(counts):
        part = value._local_tensor
    else:
        full = value.full_tensor() if isinstance(value, DTensor) else value
        part = full.narrow(0, rng[0], rng[1] - rng[0]) if full.dim() == 1 and full.numel() >= rng[1] else full
    if tuple(part.shape) != tuple(like.shape) or part.dtype != like.dtype:
        raise ValueError(f"cannot load {key!r}: this rank's part is {tuple(part.shape)} {part.dtype}, the "
                         f"model's {tuple(like.shape)} {like.dtype}")
    return part


def _rank(value) -> int:
    if isinstance(value, DTensor):
        return value.device_mesh.get_local_rank()
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _load_stats(name, sharded, piece, layout, module, state_dict, prefix, local_metadata, strict, missing_keys,
                unexpected_keys, error_msgs) -> None:
    stats = piece.stats
    key = prefix + name
    blob_key = key + "." + stats.blob_key()
    got = {k: state_dict.pop(key + "." + k, None) for k in STAT_KEYS}
    blob = state_dict.pop(blob_key, None)
    if key not in state_dict:
        return
    if blob is not None:  # first: another quantisation also lacks or adds statistic keys
        check_blob(blob_key, unpack_blob(blob.full_tensor() if isinstance(blob, DTensor) else blob), stats)
    need = ("absmax", "quant_map") + (("nested_absmax", "nested_quant_map") if stats.nested else ())
    missing = [k for k in need if got[k] is None] + ([stats.blob_key()] if blob is None else [])
    if missing:
        raise ValueError(
            f"cannot load {key!r} without its bitsandbytes statistics {[key + '.' + m for m in missing]}: "
            "the codes mean nothing under another weight's absmax (a checkpoint of a 4-bit model saved "
            "before fully_shard kept them lacks them; save it again from the model)")
    saved = unpack_blob(blob.full_tensor() if isinstance(blob, DTensor) else blob)
    check_blob(blob_key, saved, stats)
    counts, nested_counts = layout
    parts = [(piece.absmax, _my_part(key + ".absmax", got["absmax"], piece.absmax, counts)),
             (stats.code, _my_part(key + ".quant_map", got["quant_map"], stats.code, None))]
    if stats.nested:
        parts += [(piece.nested_absmax, _my_part(key + ".nested_absmax", got["nested_absmax"], piece.nested_absmax,
                                                 nested_counts)),
                  (stats.nested_code, _my_part(key + ".nested_quant_map", got["nested_quant_map"], stats.nested_code,
                                               None))]
    with torch.no_grad():
        for dst, src in parts:
            if dst.data_ptr() != src.data_ptr() or dst.numel() == 0:
                dst.copy_(src)
        if stats.nested:
            stats.offset.fill_(float(saved["nested_offset"]))
        stats.refresh_blob()
