"""AdamW8bit's step over contiguous runs, in chunks of whole quantisation blocks.

Per parameter, AdamW8bit dequantises both moments, runs torch's single-tensor AdamW in fp32 and
quantises them again, block by block (blocks start at the tensor's first element). Every one of
those operations is per element or per block, so a run of parameters that are adjacent in the
parameter, gradient, code and absmax buffers can be processed as one range, as long as each
parameter but the last holds whole blocks only (its local numel a multiple of the block size;
:class:`._runs.Member` ``closes`` marks the others), and chunks of whole blocks keep the
temporaries (fp32 moments, normalised values, code indices) to one chunk instead of one
parameter. fp32-state parameters (fewer than ``min_8bit_size`` elements) run the AdamW math over
runs the same way, with the fp32 cast of low-precision parameters done per chunk.
"""

from __future__ import annotations

import torch

from ._grouped import _chunks
from ._runs import contiguous_runs, flat_view, member_of
from .quant import dequantize_blockwise, quantize_blockwise, signed_map, unsigned_map

__all__ = ["Item", "adamw8bit_grouped"]


class Item:
    """One parameter's local tensors for a step: ``states`` are (exp_avg, exp_avg_sq) for fp32
    states, or (m codes, v codes, m absmax, v absmax) for 8-bit ones."""

    __slots__ = ("param", "grad", "states", "step", "eight_bit")

    def __init__(self, param, grad, states, step, eight_bit):
        self.param, self.grad, self.states, self.step, self.eight_bit = param, grad, states, step, eight_bit


def adamw8bit_grouped(items: list[Item], *, block: int, chunk: int, beta1: float, beta2: float,
                      lr: float, weight_decay: float, eps: float) -> tuple[list[Item], dict]:
    """Step every item that forms part of a run; returns the items it could not take (a
    tensor not contiguous) for the caller's per-parameter path, and counts for reports."""
    members, loose = [], []
    for i, it in enumerate(items):
        if it.eight_bit:
            m = member_of(i, [it.param, it.grad, it.states[0], it.states[1]], extra=it.states[2:],
                          closes=it.param.numel() % block != 0)
        else:
            m = member_of(i, [it.param, it.grad, it.states[0], it.states[1]])
        (loose if m is None else members).append(it if m is None else m)
    stats = {"runs": 0, "chunks": 0}
    if not members:
        return loose, stats
    steps = [items[m.index].step for m in members]
    torch._foreach_add_(steps, 1)
    values = [s.item() for s in steps]
    members = [m.with_tag((v, items[m.index].eight_bit)) for m, v in zip(members, values)]
    kw = dict(beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    chunk = max(block, chunk // block * block)  # whole blocks
    tag_of = {m.index: m.tag for m in members}
    for run in contiguous_runs(members):
        first = items[run.indices[0]]
        run_step = tag_of[run.indices[0]][0]
        n = run.numel
        p, g = flat_view(first.param, n), flat_view(first.grad, n)
        stats["runs"] += 1
        stats["chunks"] += -(-n // chunk)
        if not first.eight_bit:
            m_, v_ = flat_view(first.states[0], n), flat_view(first.states[1], n)
            for a in range(0, n, chunk):
                k = min(chunk, n - a)
                _math32(p.narrow(0, a, k), g.narrow(0, a, k), m_.narrow(0, a, k), v_.narrow(0, a, k),
                        run_step, kw)
            continue
        nb = -(-n // block)
        mc, vc = flat_view(first.states[0], n), flat_view(first.states[1], n)
        ma, va = flat_view(first.states[2], nb), flat_view(first.states[3], nb)
        smap, umap = signed_map(p.device), unsigned_map(p.device)
        for a in range(0, n, chunk):
            k = min(chunk, n - a)
            b0, b1 = a // block, -(-(a + k) // block)
            codes_m, codes_v = mc.narrow(0, a, k), vc.narrow(0, a, k)
            am, av = ma.narrow(0, b0, b1 - b0), va.narrow(0, b0, b1 - b0)
            m32 = dequantize_blockwise(codes_m, am, smap, block)
            v32 = dequantize_blockwise(codes_v, av, umap, block)
            _math32(p.narrow(0, a, k), g.narrow(0, a, k), m32, v32, run_step, kw)
            quantize_blockwise(m32, smap, block, codes_out=codes_m, absmax_out=am)
            quantize_blockwise(v32, umap, block, codes_out=codes_v, absmax_out=av)
    return loose, stats


def _math32(p, g, m, v, step, kw) -> None:
    """torch's single-tensor AdamW on one chunk in fp32 (low-precision params cast and back)."""
    p32 = p if p.dtype == torch.float32 else p.float()
    g32 = g if g.dtype == torch.float32 else g.float()
    buf = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
    _chunks(p32, g32, m, v, None, step, max(1, p.numel()), buf, **kw)
    if p32 is not p:
        p.copy_(p32)
