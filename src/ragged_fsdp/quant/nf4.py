"""NF4 weights as in QLoRA, as a tensor subclass that shards without cutting a block.

Storage (the layout torchao's ``NF4Tensor`` uses, so its weights can be adopted as they are):

* ``codes``: ``uint8``, two 4-bit indices into the 16-value NF4 codebook per byte (the
  first element of a pair in the high nibble);
* ``scalers``: ``int8``, one per 64-value block: the block's absmax minus the tensor's mean
  absmax, quantised per scaler block of 256 blocks;
* ``factors``: ``float32``, one per scaler block (``scaler = q / factor + mean``);
* ``mean``: the tensor's mean absmax (one value; every shard keeps a copy, and the all-gather
  takes it from a rank that holds rows, see ``fsdp_pre_all_gather``).

A run of whole scaler blocks (``64 * 256`` values) is an NF4 weight of its own with no
re-quantisation, which is why :attr:`NF4Weight.ragged_granularity` asks the planner for
whole scaler blocks, in whole rows. The weight implements the FSDP2 all-gather protocol
(``fsdp_pre_all_gather`` with the five-argument signature, ``fsdp_post_all_gather``); the
full shape travels in the metadata (``outer_size``), so ranks may hold different numbers
of rows, or none. ``F.linear`` dequantises to the input's dtype, which is all a frozen
QLoRA base weight needs; beyond it the weight supports what sharding and checkpoints use
(``split`` / ``narrow`` on whole scaler blocks of rows, ``copy_``, ``.to(device)``, ``.to(dtype)``
to dequantise, pickling) and refuses other ops by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["NF4Weight", "NF4_CODEBOOK", "nf4_quantize", "nf4_dequantize", "nf4_rows_unit"]

# The 16 NF4 levels of the QLoRA paper (quantiles of N(0, 1) scaled to [-1, 1], with an exact 0).
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


def nf4_rows_unit(cols: int, block: int = 64, scaler_block: int = 256) -> int:
    """Rows per sharding unit of a ``(rows, cols)`` NF4 weight: the fewest whole rows that
    hold whole scaler blocks (``block * scaler_block`` values)."""
    span = block * scaler_block
    return span // math.gcd(span, cols)


def nf4_quantize(w: torch.Tensor, block: int = 64, scaler_block: int = 256, codebook=None):
    """QLoRA's quantisation of ``w`` (any shape, ``numel % block == 0``): returns
    ``(codes, scalers, factors, mean, codebook)`` (see the module docstring)."""
    n = w.numel()
    if n % block or n % 2:
        raise ValueError(f"nf4_quantize: {n} values is not a multiple of the block size {block}")
    flat = w.detach().reshape(-1).float()
    cb = torch.tensor(NF4_CODEBOOK if codebook is None else codebook, dtype=torch.float32, device=w.device)
    absmax = flat.view(-1, block).abs().amax(dim=1)
    mean = absmax.mean()
    centred = absmax - mean
    nb = centred.numel()
    n_sb = -(-nb // scaler_block)
    padded = F.pad(centred, (0, n_sb * scaler_block - nb)).view(n_sb, scaler_block)
    sb_absmax = padded.abs().amax(dim=1)
    factors = 256 / (2 * sb_absmax.clamp_min(torch.finfo(torch.float32).tiny))
    scalers = (padded * factors[:, None]).round().clamp(-128, 127).reshape(-1)[:nb].to(torch.int8)
    scaled = flat.view(-1, block) / torch.where(absmax > 0, absmax, 1.0)[:, None]
    mids = (cb[1:] + cb[:-1]) / 2
    idx = torch.bucketize(scaled.reshape(-1), mids).to(torch.uint8)
    codes = (idx[0::2] << 4) | idx[1::2]
    return codes, scalers, factors.float(), mean.reshape(1).float(), cb


def nf4_dequantize(codes, scalers, factors, mean, codebook, shape, dtype, block: int = 64, scaler_block: int = 256):
    """The values of an NF4 weight in ``dtype``. The math runs in the dtype the factors are
    stored in, then one cast to ``dtype``: fp32 for :meth:`NF4Weight.from_float`; for a weight
    adopted from torchao, torchao's own dtype and order of operations (a bf16 ``NF4Tensor``
    keeps bf16 factors, mean and codebook and dequantises in bf16), so the values are
    torchao's ``get_original_weight()`` bit for bit (fp32 math on bf16 factors differs from
    it in about 1 of 5 values, by up to one bf16 ulp)."""
    nb = scalers.numel()
    n_sb = factors.numel()
    q = F.pad(scalers.to(factors.dtype), (0, n_sb * scaler_block - nb)).view(n_sb, scaler_block)
    absmax = ((q / factors[:, None]).reshape(-1)[:nb] + mean).repeat_interleave(block // 2)
    hi = codebook[(codes >> 4).long()] * absmax
    lo = codebook[(codes & 0xF).long()] * absmax
    return torch.stack([hi, lo], dim=-1).reshape(shape).to(dtype)


class _LinearNF4(torch.autograd.Function):
    """``x @ W.T`` keeping the NF4 weight (not its dequantised copy) for backward: the
    weight is frozen, backward needs it only for the input's gradient. Under FSDP the saved
    object is the gathered weight, whose storage is refilled in place before backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return F.linear(x, w.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.w.dequantize(grad.dtype), None


class NF4Weight(torch.Tensor):
    """A frozen NF4 weight (see the module docstring). Make one with :meth:`from_float` or
    :meth:`from_torchao`; ``dequantize()`` gives its values."""

    @staticmethod
    def __new__(cls, codes, scalers, factors, mean, codebook, shape, dtype, block=64, scaler_block=256):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=codes.device,
                                                   requires_grad=False)

    def __init__(self, codes, scalers, factors, mean, codebook, shape, dtype, block=64, scaler_block=256):
        self.codes, self.scalers, self.factors, self.mean, self.codebook = codes, scalers, factors, mean, codebook
        self.block, self.scaler_block = block, scaler_block

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_float(cls, w: torch.Tensor, block: int = 64, scaler_block: int = 256, dtype=None) -> "NF4Weight":
        parts = nf4_quantize(w, block, scaler_block)
        return cls(*parts, tuple(w.shape), dtype or w.dtype, block, scaler_block)

    @classmethod
    def from_torchao(cls, t) -> "NF4Weight":
        """Adopt a torchao ``NF4Tensor``'s codes, scalers, factors, mean and codebook
        unchanged, in their dtypes (so :meth:`dequantize` is torchao's, bit for bit)."""
        return cls(t.quantized_data, t.quantized_scalers, t.quantization_factor,
                   t.scaler_mean.reshape(1), t.nf4, tuple(t.shape), t.dtype,
                   t.block_size, t.scaler_block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return nf4_dequantize(self.codes, self.scalers, self.factors, self.mean, self.codebook,
                              self.shape, dtype or self.dtype, self.block, self.scaler_block)

    def get_original_weight(self) -> torch.Tensor:
        """``dequantize()`` under the name torchao's ``NF4Tensor`` gives it, so model code
        written for torchao weights (adopted by ``fully_shard``) keeps working."""
        return self.dequantize()

    @property
    def ragged_granularity(self) -> str:
        """What the planner keeps whole (ragged_fsdp reads this): whole scaler blocks, in rows."""
        return f"rows:{nf4_rows_unit(self.shape[-1] if self.dim() else 1, self.block, self.scaler_block)}"

    def _like(self, codes, scalers, factors, shape, dtype=None) -> "NF4Weight":
        return NF4Weight(codes, scalers, factors, self.mean, self.codebook, shape, dtype or self.dtype,
                         self.block, self.scaler_block)

    def split_rows(self, sizes: list[int]) -> list["NF4Weight"]:
        """Pieces of whole scaler blocks along dim 0 (each an NF4 weight, no re-quantisation)."""
        cols = math.prod(self.shape[1:])
        span = self.block * self.scaler_block
        out, at = [], 0
        for rows in sizes:
            a, n = at * cols, rows * cols
            if n and (a % span or (n % span and at + rows != self.shape[0])):
                raise ValueError(
                    f"NF4Weight.split_rows: rows [{at}, {at + rows}) cut a scaler block of {span} values; "
                    f"split at multiples of {nf4_rows_unit(cols, self.block, self.scaler_block)} rows"
                )
            b0, bn = a // self.block, n // self.block
            s0, sn = a // span, -(-n // span)
            out.append(self._like(self.codes.narrow(0, a // 2, n // 2), self.scalers.narrow(0, b0, bn),
                                  self.factors.narrow(0, s0, sn), (rows, *self.shape[1:])))
            at += rows
        return out

    def copy_from(self, src: "NF4Weight") -> None:
        """Copy ``src``'s codes, scalers, factors, mean and codebook into this weight's own
        tensors (views into a shard's storage stay views: a load lands in the shard)."""
        if not isinstance(src, NF4Weight):
            raise TypeError(
                f"NF4Weight.copy_: the source is a {type(src).__name__}, not an NF4Weight; copying plain "
                "values would need re-quantising: build the weight with NF4Weight.from_float(values) instead"
            )
        if tuple(src.shape) != tuple(self.shape) or (src.block, src.scaler_block) != (self.block, self.scaler_block):
            raise ValueError(
                f"NF4Weight.copy_: source {tuple(src.shape)} in blocks of {src.block}/{src.scaler_block}, "
                f"destination {tuple(self.shape)} in blocks of {self.block}/{self.scaler_block}"
            )
        for name in ("codes", "scalers", "factors", "mean", "codebook"):
            getattr(self, name).copy_(getattr(src, name))

    def to_device(self, device) -> "NF4Weight":
        return NF4Weight(*(getattr(self, n).to(device) for n in ("codes", "scalers", "factors", "mean", "codebook")),
                         tuple(self.shape), self.dtype, self.block, self.scaler_block)

    # -- pickling (torch.save, DCP's files) -------------------------------------------
    def __reduce_ex__(self, protocol):
        # The inner tensors, each with only its own bytes: a shard's codes are views into the
        # unsharded weight's storage, which torch.save would otherwise write whole. The rebuild
        # function is on torch.load's weights_only allow-list (registered below).
        own = [t if t.untyped_storage().nbytes() == t.nbytes else t.clone()
               for t in (self.codes, self.scalers, self.factors, self.mean, self.codebook)]
        return _rebuild_nf4, (*own, tuple(self.shape), self.dtype, self.block, self.scaler_block)

    # -- the FSDP2 all-gather protocol -----------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        # The mean and the codebook travel too, from the ranks that hold rows only (the others
        # send none): a rank without rows has nothing a checkpoint load writes into, so its
        # own copies may be stale, and the gathered weight must not depend on them.
        held = self.numel() > 0
        mean, codebook = (self.mean, self.codebook) if held else (self.mean[:0], self.codebook[:0])
        return (self.codes, self.scalers, self.factors, mean, codebook), (tuple(outer_size), self.block,
                                                                         self.scaler_block)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        codes, scalers, factors, means, codebooks = all_gather_outputs
        shape, block, scaler_block = metadata
        if out is not None:
            if not (out.codes.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
                    and out.scalers.untyped_storage().data_ptr() == scalers.untyped_storage().data_ptr()):
                raise RuntimeError("NF4Weight.fsdp_post_all_gather: out= must wrap the all-gather outputs")
            return None
        # every holder sent the same mean and codebook: the first holder's
        n = codebooks.numel() // means.numel()
        full = NF4Weight(codes, scalers, factors, means[:1], codebooks[:n], shape, param_dtype, block, scaler_block)
        return full, (codes, scalers, factors, means, codebooks)

    # -- tensor-subclass plumbing ------------------------------------------------------
    def __tensor_flatten__(self):
        return ["codes", "scalers", "factors", "mean", "codebook"], (tuple(self.shape), self.dtype, self.block,
                                                                      self.scaler_block)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        shape, dtype, block, scaler_block = meta
        return NF4Weight(inner["codes"], inner["scalers"], inner["factors"], inner["mean"], inner["codebook"],
                         shape, dtype, block, scaler_block)

    def __repr__(self) -> str:
        return f"NF4Weight(shape={tuple(self.shape)}, dtype={self.dtype}, block={self.block}, scaler_block={self.scaler_block})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.data_ptr:
            # a wrapper has no storage of its own (data_ptr 0 for every NF4Weight): its data is
            # its codes, which is what "is this the same data" comparisons need
            return args[0].codes.data_ptr()
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = _LinearNF4.apply(x, w)
            return out if bias is None else out + bias
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return w._like(w.codes, w.scalers, w.factors, w.shape)
        if func is aten.clone.default:
            return w._like(w.codes.clone(), w.scalers.clone(), w.factors.clone(), w.shape)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype", "device", "non_blocking"}:
            # .to(dtype) dequantises (as torchao's NF4Tensor does); .to(device) moves the codes
            if kwargs.get("dtype") is not None:
                return w.dequantize(kwargs["dtype"]).to(kwargs.get("device") or w.device)
            return w.to_device(kwargs.get("device") or w.device)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, NF4Weight):
                dst.copy_from(src)
            else:  # into a plain tensor (a plain model loading an NF4 checkpoint): the values
                dst.copy_(src.dequantize(dst.dtype))
            return dst
        if func is aten.slice.Tensor and (len(args) < 2 or args[1] == 0) and (len(args) < 5 or args[4] == 1):
            n = w.shape[0]
            start = 0 if len(args) < 3 or args[2] is None else args[2]
            end = n if len(args) < 4 or args[3] is None else args[3]
            start, end = (min(max(v + n if v < 0 else v, 0), n) for v in (start, end))
            end = max(end, start)
            return w.split_rows([start, end - start, n - end])[1]
        if func is aten.split_with_sizes.default and (len(args) < 3 or args[2] == 0):
            return w.split_rows(list(args[1]))
        if func is aten.split.Tensor and (len(args) < 3 or args[2] == 0):
            n, step = w.shape[0], args[1]
            return w.split_rows([min(step, n - a) for a in range(0, n, step)])
        if func is aten.is_pinned.default:
            return w.codes.is_pinned()
        raise NotImplementedError(
            f"NF4Weight does not implement {func}: it is a frozen weight for F.linear; call "
            f".dequantize() for its values"
        )


def _rebuild_nf4(codes, scalers, factors, mean, codebook, shape, dtype, block, scaler_block) -> NF4Weight:
    return NF4Weight(codes, scalers, factors, mean, codebook, shape, dtype, block, scaler_block)


# DCP loads with torch.load(weights_only=True), which refuses any callable not allow-listed
torch.serialization.add_safe_globals([_rebuild_nf4])

