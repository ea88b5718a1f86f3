"""What other sharding schemes cost on the same tensors: padding and blocks cut.

Each baseline splits a group over ``W`` ranks its own way; ``blocks_cut`` counts the blocks
(of each tensor's granularity) that end up split between two ranks -- the structure a
block-wise optimizer or quantizer would have to gather back. The planner cuts none.

* ``fsdp2``: PyTorch FSDP2 ``Shard(0)`` per parameter, dim 0 padded to a multiple of ``W``
  (``torch.chunk`` sizes), so rank ``j`` holds rows ``[j*c, (j+1)*c)`` with ``c = ceil(d0/W)``.
* ``fsdp1``: FSDP1's flat parameter: the group flattened, padded to a multiple of ``W``,
  split equally.
* ``deepspeed``: ZeRO-3: each parameter flattened, padded to a multiple of ``W``, split
  equally.
* ``megatron``: Megatron-FSDP style chunking: the flat group split into ``W`` equal chunks
  whose size is a multiple of the LCM of the tensors' row sizes (``prod(shape[1:])``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .granularity import TensorSpec

__all__ = ["BaselineResult", "BASELINES", "baseline", "all_baselines", "count_cut_blocks"]


@dataclass(frozen=True)
class BaselineResult:
    name: str
    used: int  # elements of the tensors
    padding: int  # elements of padding over all ranks
    blocks_cut: int
    per_rank: int  # elements each rank holds (padded)

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.used if self.used else 0.0


def count_cut_blocks(x0: int, step: int, count: int, g: int, e: int) -> int:
    """Distinct blocks of ``g`` elements (tensor of ``e``, last block partial) that contain a
    cut strictly inside, for cuts at ``x0 + j*step``, ``0 <= j < count``, all in ``(0, e)``."""
    if count <= 0 or e <= 0:
        return 0
    if g >= e:
        return 1  # one block, and every cut is inside it
    if count == 1 or step >= g:
        # each cut lies in its own block; it cuts unless it sits on a block edge
        return count - _on_edges(x0, step, count, g)
    first, last = x0, x0 + (count - 1) * step
    b_lo, b_hi = first // g, last // g
    if b_lo == b_hi:
        return 1  # several cuts in one block: at least one is strictly inside
    inner = b_hi - b_lo - 1  # whole blocks between them: step < g puts a cut inside each
    lo_cut = 1 if first % g or (first + step) // g == b_lo else 0
    hi_cut = 1 if last % g else 0
    return inner + lo_cut + hi_cut


def _on_edges(x0: int, step: int, count: int, g: int) -> int:
    """How many ``j`` in ``[0, count)`` have ``(x0 + j*step) % g == 0``."""
    d = math.gcd(step, g)
    if x0 % d:
        return 0
    m = g // d
    j0 = (-(x0 // d) * pow(step // d, -1, m)) % m if m > 1 else 0
    return 0 if j0 >= count else (count - 1 - j0) // m + 1


def _rows(spec: TensorSpec) -> tuple[int, int]:
    """(dim-0 length, elements per dim-0 row); a 0-d tensor is one row of one element."""
    if not spec.shape:
        return 1, 1
    return spec.shape[0], math.prod(spec.shape[1:])


def _fsdp2(specs: Sequence[TensorSpec], W: int) -> BaselineResult:
    padding = cut = per_rank = 0
    for s in specs:
        d0, row = _rows(s)
        c = -(-d0 // W)
        padding += (c * W - d0) * row
        per_rank += c * row
        if c and row:
            cuts = -(-d0 // c) - 1  # rank edges j*c rows with 0 < j*c < d0
            cut += count_cut_blocks(c * row, c * row, cuts, s.block_elems, s.numel)
    return BaselineResult("fsdp2", sum(s.numel for s in specs), padding, cut, per_rank)


def _deepspeed(specs: Sequence[TensorSpec], W: int) -> BaselineResult:
    padding = cut = per_rank = 0
    for s in specs:
        e = s.numel
        c = -(-e // W)
        padding += c * W - e
        per_rank += c
        if c:
            cut += count_cut_blocks(c, c, -(-e // c) - 1, s.block_elems, e)
    return BaselineResult("deepspeed", sum(s.numel for s in specs), padding, cut, per_rank)


def _flat(name: str, specs: Sequence[TensorSpec], chunk: int, W: int) -> BaselineResult:
    """The group laid back to back from offset 0, rank k holding ``[k*chunk, (k+1)*chunk)``."""
    used = sum(s.numel for s in specs)
    cut, lo = 0, 0
    for s in specs:
        e = s.numel
        if e and chunk:
            k0, k1 = lo // chunk + 1, (lo + e - 1) // chunk
            if k1 >= k0:
                cut += count_cut_blocks(k0 * chunk - lo, chunk, k1 - k0 + 1, s.block_elems, e)
        lo += e
    return BaselineResult(name, used, chunk * W - used, cut, chunk)


def _fsdp1(specs: Sequence[TensorSpec], W: int) -> BaselineResult:
    total = sum(s.numel for s in specs)
    return _flat("fsdp1", specs, -(-total // W), W)


def _megatron(specs: Sequence[TensorSpec], W: int) -> BaselineResult:
    total = sum(s.numel for s in specs)
    step = 1
    for s in specs:
        row = _rows(s)[1]
        if row:
            step = step * row // math.gcd(step, row)
    chunk = -(-(-(-total // W)) // step) * step
    return _flat("megatron", specs, chunk, W)


BASELINES = {"fsdp2": _fsdp2, "fsdp1": _fsdp1, "deepspeed": _deepspeed, "megatron": _megatron}


def baseline(name: str, specs: Sequence[TensorSpec], world_size: int) -> BaselineResult:
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    return BASELINES[name](list(specs), int(world_size))


def all_baselines(specs: Sequence[TensorSpec], world_size: int) -> dict[str, BaselineResult]:
    return {name: baseline(name, specs, world_size) for name in BASELINES}
