"""bitsandbytes 4-bit weights (``Params4bit``, what ``BitsAndBytesConfig(load_in_4bit=True)``
loads) as a tensor subclass that shards without cutting a quantisation block.

A ``Params4bit`` is a column ``[n, 1]`` of packed 4-bit codes (two per byte) in its
``quant_storage`` dtype (``uint8``, or ``bfloat16`` / ``float32`` holding 4 or 8 codes per
element), and its ``quant_state``: one ``absmax`` per ``blocksize`` values (64 by default),
the 16-value ``quant_map``, and with double quantisation (``compress_statistics``) the absmax
stored as ``uint8`` codes of a second blockwise quantisation, 256 absmax per block, with its own
``nested_absmax``, ``nested_quant_map`` and one ``offset`` (the mean absmax) for the tensor.

:class:`BnB4Weight` holds one rank's rows of the codes together with *their* absmax (and nested
absmax): its sharding unit is the fewest rows of whole blocks (whole nested blocks under double
quantisation), so each piece dequantises on its own and nothing is re-quantised. The quant_map,
nested quant_map and offset are the same on every rank (one copy each, shared by the pieces).
The FSDP2 all-gather protocol gathers the codes (as bytes: a code is never a number) and the
absmax; ``fsdp_post_all_gather`` returns a ``Params4bit`` over the gathered codes carrying a
``QuantState`` over the gathered absmax, the same object bitsandbytes built in one process, in
the storage dtype whatever ``param_dtype`` the mixed-precision policy asks for.

Also here, for one process: :func:`load_bnb4_state_dict` (a state dict with bitsandbytes'
statistic keys into a model of ``Params4bit`` weights, checked) and :func:`pad_bnb4_blobs`.
bitsandbytes is imported only when a ``Params4bit`` is seen (it is an optional dependency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

__all__ = ["BnB4Weight", "Bnb4Stats", "is_params4bit", "STAT_KEYS", "BLOB_BYTES", "pack_blob", "unpack_blob",
           "check_blob", "load_bnb4_state_dict", "pad_bnb4_blobs"]

# the statistic keys bitsandbytes writes next to ``weight`` (``Linear4bit._save_to_state_dict``)
STAT_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# The packed ``quant_state.bitsandbytes__<type>`` JSON, padded with spaces (valid JSON
# whitespace, which bitsandbytes' json.loads reads) to a fixed length: DCP loads a tensor only
# into one of the saved size, and the JSON's length varies with the offset's printed digits.
BLOB_BYTES = 512


def is_params4bit(t) -> bool:
    """A bitsandbytes ``Params4bit`` (matched by name: bitsandbytes is not a dependency)."""
    c = type(t)
    return c.__name__ == "Params4bit" and c.__module__.startswith("bitsandbytes")


@dataclass(eq=False)
class Bnb4Stats:
    """What every piece of one weight shares: the replicated statistics and the layout."""

    shape: torch.Size  # the unquantised weight's shape
    dtype: torch.dtype  # the unquantised weight's dtype
    storage: torch.dtype  # the codes' storage dtype
    blocksize: int
    quant_type: str
    code: torch.Tensor  # quant_map
    nested_blocksize: int | None = None
    nested_dtype: torch.dtype | None = None
    nested_code: torch.Tensor | None = None  # nested_quant_map
    offset: torch.Tensor | None = None  # 0-d, the mean absmax
    # the packed JSON a sharded state dict holds (one tensor, so in-place loads write into it),
    # and a copy of it as last applied: a gather refuses to run while the two differ
    blob: torch.Tensor | None = None
    applied: torch.Tensor | None = None

    def refresh_blob(self) -> torch.Tensor:
        packed = pack_blob(self.as_json())
        if self.blob is None:
            self.blob = packed
        else:
            self.blob.copy_(packed)
        self.applied = packed.clone()
        return self.blob

    def check_applied(self) -> None:
        if self.blob is not None and not torch.equal(self.blob, self.applied):
            raise RuntimeError(
                f"ragged_fsdp: a bitsandbytes 4-bit weight's {self.blob_key()!r} was loaded in place (dcp.load, "
                "load_local) but not applied: its offset and quantisation are read from it by load_state_dict. "
                "Call model.load_state_dict(state_dict) after the in-place load (or load through "
                "set_model_state_dict / TrainState)")

    @property
    def nested(self) -> bool:
        return self.nested_blocksize is not None

    @property
    def values_per_row(self) -> int:
        """4-bit values per element of the ``[n, 1]`` codes."""
        return 2 * torch.empty((), dtype=self.storage).element_size()

    def rows_unit(self) -> int:
        span = self.blocksize * (self.nested_blocksize or 1)
        return max(1, span // self.values_per_row)

    def blocks(self, r0: int, r1: int) -> tuple[int, int]:
        """The absmax range of code rows ``[r0, r1)`` (``r0`` on a block boundary)."""
        v = self.values_per_row
        return r0 * v // self.blocksize, -(-r1 * v // self.blocksize)

    def nested_blocks(self, b0: int, b1: int) -> tuple[int, int]:
        return b0 // self.nested_blocksize, -(-b1 // self.nested_blocksize)

    def as_json(self) -> dict:
        """The non-tensor items bitsandbytes packs (``QuantState.as_dict(packed=True)``)."""
        d = {"quant_type": self.quant_type, "blocksize": self.blocksize, "dtype": _dtype_name(self.dtype),
             "shape": tuple(self.shape)}
        if self.nested:
            d.update(nested_blocksize=self.nested_blocksize, nested_dtype=_dtype_name(self.nested_dtype),
                     nested_offset=self.offset.item())
        return d

    def blob_key(self) -> str:
        return "quant_state.bitsandbytes__" + self.quant_type


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def pack_blob(d: dict, pad: int | None = BLOB_BYTES) -> torch.Tensor:
    """bitsandbytes' packed JSON as a ``uint8`` tensor, padded with spaces to ``pad`` bytes."""
    raw = json.dumps(d).encode()
    if pad is not None:
        if len(raw) > pad:
            raise ValueError(f"bitsandbytes quant_state JSON of {len(raw)} bytes does not fit {pad}")
        raw = raw + b" " * (pad - len(raw))
    return torch.tensor(list(raw), dtype=torch.uint8)


def unpack_blob(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.detach().cpu().to(torch.uint8).numpy()).decode())


def check_blob(key: str, saved: dict, stats: Bnb4Stats) -> None:
    """Refuse statistics made for another quantisation (anything but the offset, which a load
    writes): loading codes under another block size, type, shape or nesting gives other values."""
    mine = stats.as_json()
    diff = {k: (saved.get(k), mine[k]) for k in mine if k != "nested_offset"
            and (list(saved[k]) if k == "shape" and k in saved else saved.get(k)) != (list(mine[k]) if k == "shape" else mine[k])}
    if set(saved) - set(mine):
        diff.update({k: (saved[k], None) for k in set(saved) - set(mine)})
    if diff:
        raise ValueError(
            f"cannot load {key!r}: the checkpoint's bitsandbytes quantisation differs from the model's "
            f"(saved, model): {diff}; load it into a model quantised with the same BitsAndBytesConfig")


def stats_of(p) -> Bnb4Stats:
    """The shared statistics of a ``Params4bit``, refusing what cannot be sharded."""
    qs = p.quant_state
    if qs is None or not getattr(p, "bnb_quantized", False):
        raise ValueError("fully_shard: a bitsandbytes Params4bit that is not quantised yet (no quant_state); "
                         "load the model with its BitsAndBytesConfig (or move it to its device) first")
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError(
            "fully_shard: a bitsandbytes Params4bit repacked for CPU inference (an eval() forward under "
            "no_grad on a CPU with avx512-bf16 repacks the codes and turns the absmax into bf16, so the "
            "statistics are no longer the checkpoint's): reload the model and shard it before any eval() "
            "forward")
    if p.dim() != 2 or p.shape[1] != 1:
        raise ValueError(f"fully_shard: a Params4bit of shape {tuple(p.shape)}; expected the packed [n, 1] column")
    nested = qs.state2 if qs.nested else None
    return Bnb4Stats(torch.Size(qs.shape), qs.dtype, p.dtype, int(qs.blocksize), str(qs.quant_type), qs.code,
                     int(nested.blocksize) if nested is not None else None,
                     nested.dtype if nested is not None else None,
                     nested.code if nested is not None else None,
                     qs.offset if nested is not None else None)


class BnB4Weight(torch.Tensor):
    """One rank's rows of a bitsandbytes 4-bit weight (see the module docstring): ``codes``
    ``[r, 1]`` in the storage dtype, their ``absmax`` and ``nested_absmax``, and the shared
    :class:`Bnb4Stats`. Its shape and dtype are the codes'."""

    @staticmethod
    def __new__(cls, codes, absmax, nested_absmax, stats):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(codes.shape), dtype=codes.dtype, device=codes.device,
                                                   requires_grad=False)

    def __init__(self, codes, absmax, nested_absmax, stats: Bnb4Stats):
        self.codes, self.absmax, self.nested_absmax, self.stats = codes, absmax, nested_absmax, stats

    @classmethod
    def from_params4bit(cls, p) -> "BnB4Weight":
        stats = stats_of(p)
        qs = p.quant_state
        return cls(p.data, qs.absmax, qs.state2.absmax if stats.nested else None, stats)

    @property
    def ragged_granularity(self) -> str:
        return f"rows:{self.stats.rows_unit()}"

    def rows(self, r0: int, r1: int) -> "BnB4Weight":
        """Rows ``[r0, r1)`` with their absmax (``r0`` on a unit boundary)."""
        s = self.stats
        if r1 > r0 and r0 % s.rows_unit():
            raise ValueError(f"BnB4Weight: rows [{r0}, {r1}) cut a quantisation block; split at multiples of "
                             f"{s.rows_unit()} rows")
        b0, b1 = s.blocks(r0, r1) if r1 > r0 else (0, 0)
        nb = self.absmax.numel()
        b0, b1 = min(b0, nb), min(b1, nb)
        nested = None
        if s.nested:
            n0, n1 = s.nested_blocks(b0, b1) if b1 > b0 else (0, 0)
            nested = self.nested_absmax.narrow(0, n0, n1 - n0)
        return BnB4Weight(self.codes.narrow(0, r0, r1 - r0), self.absmax.narrow(0, b0, b1 - b0), nested, s)

    def inner(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.absmax) + ((self.nested_absmax,) if self.stats.nested else ())

    def copy_from(self, src) -> None:
        """Codes from a plain tensor of this piece's shape and dtype, or codes and absmax from
        another piece with the same statistics layout."""
        if isinstance(src, BnB4Weight):
            for d, s_ in zip(self.inner(), src.inner()):
                d.copy_(s_)
            return
        if tuple(src.shape) != tuple(self.shape) or src.dtype != self.dtype:
            raise ValueError(f"BnB4Weight.copy_: the codes are {tuple(self.shape)} {self.dtype}, the source "
                             f"{tuple(src.shape)} {src.dtype}; packed codes are copied as they are, never cast")
        self.codes.copy_(src)

    # -- the FSDP2 all-gather protocol -----------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        self.stats.check_applied()
        # the codes travel as bytes whatever their storage dtype: never as numbers
        return tuple(t.reshape(-1).view(torch.uint8) if t is self.codes else t for t in self.inner()), (
            tuple(outer_size), self.stats)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        # param_dtype is not applied: the codes are bit patterns in their storage dtype, and
        # bitsandbytes dequantises to its compute dtype itself
        shape, stats = metadata
        codes = all_gather_outputs[0].view(stats.storage).view(shape)
        if out is not None:
            _check_unchanged(out, all_gather_outputs)
            return None
        full = to_params4bit(codes, all_gather_outputs[1],
                             all_gather_outputs[2] if stats.nested else None, stats)
        return full, tuple(all_gather_outputs)

    # -- tensor-subclass plumbing ------------------------------------------------------
    def __tensor_flatten__(self):
        return (["codes", "absmax", "nested_absmax"] if self.stats.nested else ["codes", "absmax"]), self.stats

    @staticmethod
    def __tensor_unflatten__(inner, stats, outer_size, outer_stride):
        return BnB4Weight(inner["codes"], inner["absmax"], inner.get("nested_absmax"), stats)

    def __repr__(self) -> str:
        s = self.stats
        return (f"BnB4Weight(rows={self.shape[0]}, storage={s.storage}, of {tuple(s.shape)} {s.quant_type}, "
                f"blocksize={s.blocksize}, nested={s.nested})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.data_ptr:
            return args[0].codes.data_ptr()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return BnB4Weight(w.codes, w.absmax, w.nested_absmax, w.stats)
        if func is aten.copy_.default:
            if not isinstance(w, BnB4Weight):
                raise TypeError("BnB4Weight: copying packed 4-bit codes into a plain tensor is refused; read "
                                "the state dict's 'weight' (the plain codes) instead")
            w.copy_from(args[1])
            return w
        if func is aten.slice.Tensor and (len(args) < 2 or args[1] == 0) and (len(args) < 5 or args[4] == 1):
            n = w.shape[0]
            start = 0 if len(args) < 3 or args[2] is None else args[2]
            end = n if len(args) < 4 or args[3] is None else args[3]
            start, end = (min(max(v + n if v < 0 else v, 0), n) for v in (start, end))
            return w.rows(start, max(end, start))
        if func is aten.split_with_sizes.default and (len(args) < 3 or args[2] == 0):
            out, at = [], 0
            for k in args[1]:
                out.append(w.rows(at, at + k))
                at += k
            return out
        if func is aten.is_pinned.default:
            return w.codes.is_pinned()
        if func is aten._to_copy.default and set(kwargs) <= {"device", "non_blocking"}:
            d = kwargs.get("device") or w.device
            return BnB4Weight(*(t.to(d) if t is not None else None for t in (w.codes, w.absmax, w.nested_absmax)),
                              w.stats)
        raise NotImplementedError(
            f"BnB4Weight does not implement {func}: it is a frozen bitsandbytes 4-bit weight, gathered into a "
            "Params4bit for the layer's forward; its codes are never cast or computed with")


def to_params4bit(codes, absmax, nested_absmax, stats: Bnb4Stats):
    """A ``Params4bit`` over ``codes`` with a ``QuantState`` over ``absmax`` (no copies)."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    state2 = None
    if stats.nested:
        state2 = QuantState(absmax=nested_absmax, blocksize=stats.nested_blocksize, code=stats.nested_code,
                            dtype=stats.nested_dtype)
    qs = QuantState(absmax=absmax, shape=stats.shape, code=stats.code, blocksize=stats.blocksize,
                    quant_type=stats.quant_type, dtype=stats.dtype, offset=stats.offset, state2=state2)
    return Params4bit(codes, requires_grad=False, quant_state=qs, blocksize=stats.blocksize,
                      compress_statistics=stats.nested, quant_type=stats.quant_type, quant_storage=stats.storage,
                      bnb_quantized=True)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_unchanged(p, outputs) -> None:
    """The gathered Params4bit still computes from the gathered tensors: bitsandbytes' CPU
    inference repack (``eval()`` under ``no_grad``) replaces ``.data`` and the quant_state's
    absmax, after which a refilled gather would not reach the layer."""
    qs = p.quant_state
    if (getattr(qs, "packing_format_for_cpu", False) or not _same_storage(p.data, outputs[0])
            or not _same_storage(qs.absmax, outputs[1])):
        raise RuntimeError(
            "ragged_fsdp: a bitsandbytes 4-bit weight was replaced during forward (its codes or absmax are no "
            "longer the gathered ones: bitsandbytes' CPU repack for eval() under no_grad does this); "
            "fully_shard turns that repack off (support_avx512bf16_for_cpu = False on each Linear4bit): "
            "do not turn it back on")


# -- one process: loading a state dict with bitsandbytes' statistic keys --------------------

def _params4bit_modules(model):
    for name, mod in model.named_modules():
        w = mod._parameters.get("weight") if hasattr(mod, "_parameters") else None
        if w is not None and is_params4bit(w):
            yield (name + "." if name else ""), mod, w


def pad_bnb4_blobs(state_dict: dict) -> dict:
    """``state_dict`` (a one-process model's) with each ``quant_state.bitsandbytes__*`` blob padded
    to :data:`BLOB_BYTES`, the size ``fully_shard``'s checkpoints store it at, so ``dcp.load``
    can read a sharded checkpoint into it (then :func:`load_bnb4_state_dict`)."""
    return {k: pack_blob(unpack_blob(v)) if ".quant_state.bitsandbytes__" in k else v for k, v in state_dict.items()}


@torch.no_grad()
def load_bnb4_state_dict(model, state_dict: dict, strict: bool = True):
    """Load ``state_dict`` (codes plus bitsandbytes' statistic keys, e.g. a full state dict saved
    under ``fully_shard``, or ``dcp.load`` into :func:`pad_bnb4_blobs` of this model's state
    dict) into a one-process ``model`` of ``Params4bit`` weights: codes, absmax, quant maps and
    offset are copied into each weight and its ``quant_state`` in place. A weight whose
    statistics are missing, or were made for another quantisation, is refused by name. The
    other keys go to ``model.load_state_dict(..., strict=strict)``, whose result is returned."""
    sd = dict(state_dict)
    for prefix, mod, w in _params4bit_modules(model):
        stats = stats_of(w)
        key = prefix + "weight"
        blob = sd.pop(prefix + "weight." + stats.blob_key(), None)
        got = {k: sd.pop(prefix + "weight." + k, None) for k in STAT_KEYS}
        if key not in sd:
            continue
        if blob is not None:  # first: another quantisation also lacks or adds statistic keys
            check_blob(key + "." + stats.blob_key(), unpack_blob(_full(blob)), stats)
        need = ("absmax", "quant_map") + (("nested_absmax", "nested_quant_map") if stats.nested else ())
        missing = [k for k in need if got[k] is None] + ([stats.blob_key()] if blob is None else [])
        if missing:
            raise ValueError(f"cannot load {key!r} without its bitsandbytes statistics {missing}: its codes mean "
                             "nothing under another weight's absmax")
        qs = w.quant_state
        pairs = [(qs.absmax, got["absmax"]), (qs.code, got["quant_map"])]
        if stats.nested:
            pairs += [(qs.state2.absmax, got["nested_absmax"]), (qs.state2.code, got["nested_quant_map"])]
        codes = _full(sd[key])  # also loaded by load_state_dict below (the same bits)
        pairs.append((w.data, codes))
        for dst, src in pairs:
            src = _full(src)
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"cannot load {key!r}: a statistic of shape {tuple(src.shape)} {src.dtype} into "
                                 f"{tuple(dst.shape)} {dst.dtype}")
        for dst, src in pairs:
            dst.copy_(_full(src))
        if stats.nested:
            qs.offset.fill_(float(unpack_blob(_full(blob))["nested_offset"]))
    return model.load_state_dict(sd, strict=strict) if sd else None


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t

