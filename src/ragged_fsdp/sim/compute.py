"""Compute time of one group for one microbatch on one rank, split by kind of work.

Three kinds of work, each with its own cost model:

- **Matmuls** (the block linears, the output head, a MoE router): every linear is three
  GEMMs per step (forward ``Y = X W``, input gradient, weight gradient) with its *per-rank*
  sizes: ``M`` tokens on the rank (after TP's all-gather for the column-parallel ones), and
  ``K x N`` the weight after TP (column-parallel q/k/v, gate/up and the head split ``N``,
  row-parallel o/down split ``K``, as :func:`.layout.split_for_mesh`). Each GEMM costs the
  roofline ``max(2 M N K / rate, bytes / mem_bw)`` (Williams et al., 2009), where ``rate =
  peak x EFFICIENCY x shape_factor(M, N, K)`` (:mod:`.gemm`; x ``FLOAT8_SPEEDUP`` for
  float8 / MXFP8 / NVFP4 linears) and ``bytes`` are its two
  inputs and its output in their dtypes (float8 inputs 1 byte, outputs bf16). So a skinny
  GEMM (Llama 3 8B's k/v projections under TP 8: ``N = 128``, arithmetic intensity ~124
  flop/byte against a ridge of several hundred on H100) is memory-bound, and a large one runs
  at the fitted rate: matmul speed depends on the sizes, not only on the flops.
- **Elementwise work** (RMSNorm, RoPE, SwiGLU, residual adds, the attention output's
  transpose): memory-bound, ``bytes / mem_bw`` from a count of the bytes torchtitan's Llama
  block moves per token (:data:`ELEMENTWISE_EAGER`); backward moves twice the forward's.
  ``torch.compile`` fuses each chain into one kernel: the eager bytes are divided by
  ``COMPILE_SPEEDUP`` (fitted; the fused kernels' own count gives ~3.2 x). Norms and
  residual adds run on ``tokens / tp`` (sequence parallel), the rest on the rank's slice.
  Float8 adds its casts here (:func:`_fp8_cast_bytes`): they are memory-bound, so float8's
  gain shrinks where the GEMMs are small next to the tensors cast (TP-sharded linears).
- **Attention** (causal flash attention): ``seq x heads x (d_qk + d_v)`` flops per token and
  layer (half of the non-causal 2x), at ``rate x ATTENTION_RATE``, backward 2.5 x the
  forward (it recomputes the scores); CP splits the tokens (torchtitan's load-balanced ring).

Recomputation: ``full`` reruns the whole forward; ``selective`` (torchtitan's per-layer SAC,
every 2nd block) half of it; ``op`` (per-op SAC: matmul outputs alternately saved and
recomputed, attention saved) reruns every second linear of a block and the elementwise
forward (its outputs are not in the save list).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .arch import Arch
from . import fitted
from .options import Recipe
from .gemm import saturation, shape_factor
from .profiles import GPUProfile

__all__ = ["GroupFlops", "Linear", "group_flops", "attention_rate", "low_precision_speedup", "grouped_mxfp8_speedup", "op_sac", "compute_times", "is_fp8_linear", "is_rowwise",
           "ELEMENTWISE_EAGER", "ELEMENTWISE_COMPILED", "linear_times", "op_sac_split",
           "tp_feed"]

# Bytes per element one block's elementwise chains move in forward (bf16 activations,
# torchtitan's RMSNorm and RoPE upcast to fp32), counted kernel by kernel:
# - RMSNorm eager: x.float() 2+4, pow 4+4, mean 4, x * rsqrt 4+4, type_as 4+2, * weight
#   2+2 = 36 per hidden element, two norms; residual adds 2+2+2 each, two;
# - RoPE eager: float() 2+4, complex multiply 4+4 (+ table), type_as 4+2 = 20 per q/k element;
# - SwiGLU eager: silu 2+2, multiply 2+2+2 = 10 per intermediate element;
# - the attention output's transpose to (tokens, heads x d_v): 2+2.
# Compiled (inductor fuses each chain into one kernel, reading inputs and writing outputs
# once): add + RMSNorm 2+2+2+2 = 8 per norm (the residual add folded in), RoPE 2+2, SwiGLU
# 2+2+2, the transpose 2+2. The eager/compiled ratio for Llama 3 8B is ~3.2.
ELEMENTWISE_EAGER = {"norm_and_residual": 2 * 36 + 2 * 6, "rope": 20, "swiglu": 10, "attn_out": 4}
ELEMENTWISE_COMPILED = {"norm_and_residual": 2 * 8, "rope": 4, "swiglu": 6, "attn_out": 4}
BACKWARD_ELEMENTWISE = 2.0  # backward of an elementwise op reads the gradient and its inputs, writes grads


def _is_routed(name: str) -> bool:
    return ".experts." in name and "shared_expert" not in name


def is_fp8_linear(name: str, shape) -> bool:
    """A weight torchtitan's float8 converter turns into a float8 linear: a block's >= 2-D
    weight other than the router (``output`` / the head and the embedding stay bf16)."""
    return (len(shape) >= 2 and ".layers." in f".{name}" and "router" not in name and "mlp.gate.weight" not in name
            and "embed" not in name)


def is_rowwise(name: str) -> bool:
    """Row-parallel under TP (the input dim split): o and down projections, as torchtitan's plan."""
    return any(k in name for k in ("o_proj", "down_proj", ".wo.", ".w2."))


@dataclass
class Linear:
    """One linear on one rank: ``count`` GEMMs of ``m x k`` by ``k x n`` (experts: one per expert)."""
    name: str
    m: float
    k: float
    n: float
    count: int
    fp8: bool
    op_rerun: bool  # per-op SAC recomputes its output in backward
    rowwise: bool

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


@dataclass
class GroupFlops:
    fp8able: float  # forward flops of linears float8 applies to (before TP)
    other_mm: float  # forward flops of the other matmuls (head, router)
    attention: float  # forward attention flops (causal, before TP)
    op_recompute_mm: float = 0.0  # forward flops per-op SAC reruns in backward
    linears: list = field(default_factory=list)  # per-rank GEMM shapes (:class:`Linear`)
    ew_fwd: dict = field(default_factory=dict)  # elements per kind of elementwise work, this rank
    tp: int = 1


def _op_sac_walk(tensors, top_k_frac: float):
    """torchtitan's per-op policy on one block, matmul by matmul in forward order: (name,
    weight elements, output elements per token, saved?) with every second output recomputed
    (1st, 3rd, ... saved). Vectors are no matmuls."""
    k = 0
    for n, s in tensors:
        if len(s) < 2 or "embed" in n:
            continue
        frac = top_k_frac if _is_routed(n) else 1.0
        k += 1
        yield n, math.prod(s) * frac, s[-2] * (s[0] * frac if len(s) == 3 else 1), k % 2 == 1


def op_sac(tensors, top_k_frac: float) -> tuple[float, float, float]:
    """(saved output elements per token, recomputed weight elements, all weight elements) of
    torchtitan's per-op policy on one block."""
    saved = recomputed = total = 0.0
    for _, el, out, kept in _op_sac_walk(tensors, top_k_frac):
        total += el
        if kept:
            saved += out
        else:
            recomputed += el
    return saved, recomputed, total


def op_sac_split(tensors, top_k_frac: float) -> tuple[float, float]:
    """:func:`op_sac`'s saved output elements per token, split into those of column-parallel
    linears (sharded under TP) and of row-parallel ones (full size)."""
    col = row = 0.0
    for n, _, out, kept in _op_sac_walk(tensors, top_k_frac):
        if kept:
            if is_rowwise(n):
                row += out
            else:
                col += out
    return col, row


def _layer_index(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def group_flops(arch: Arch, name: str, tensors, tokens: float, seq: int, cp: int, tp: int = 1, ep: int = 1,
                imbalance: float = 1.0, lp_layers: int | None = None) -> GroupFlops:
    """Forward flops of one group for ``tokens`` tokens on this rank (full tensors, before TP),
    and the per-rank GEMM shapes and elementwise sizes under ``tp``-way TP.

    Routed experts under ``ep``-way EP: the group holds ``E / ep`` experts and each receives
    the routed copies of all ``ep`` ranks' tokens, ``tokens x top_k x ep / E`` on average,
    times ``imbalance`` on the most loaded rank (the one the step waits for). ``lp_layers``:
    only decoder layers below this index run the low-precision recipe (a bf16 tail)."""
    frac = arch.top_k / arch.experts if arch.experts else 1.0
    gain = ep * imbalance if ep > 1 else 1.0  # routed tokens per local expert over the EP-free share
    fp8 = other = 0.0
    linears, k_mm = [], 0
    swiglu = 0.0
    for n, s in tensors:
        if len(s) < 2 or "embed" in n:
            continue
        routed = _is_routed(n)
        el = math.prod(s) * (frac * gain if routed else 1.0)
        is8 = is_fp8_linear(n, s)
        if is8 and lp_layers is not None:
            idx = _layer_index(n)
            is8 = idx is not None and idx < lp_layers
        if is8:
            fp8 += 2.0 * el * tokens
        else:
            other += 2.0 * el * tokens
        k_mm += 1
        if len(s) == 3:  # fused experts (E, out, in)
            count, out_d, in_d = s[0], s[1], s[2]
        else:
            count, out_d, in_d = 1, s[0], math.prod(s[1:])
        row = is_rowwise(n)
        split_ok = tp > 1 and "router" not in n and "mlp.gate.weight" not in n
        kk = in_d / tp if (split_ok and row) else in_d
        nn = out_d / tp if (split_ok and not row) else out_d
        m = tokens * frac * gain if routed else tokens  # an expert sees its share of the tokens
        linears.append(Linear(n, m, kk, nn, count, is8, k_mm % 2 == 0, row))
        if row and ("down" in n or ".w2." in n):
            swiglu += m * kk * count  # SwiGLU runs on the down projection's input
    attn = 0.0
    ew: dict = {}
    if name.startswith("layers") and not name.endswith(".experts"):
        # causal: each token attends to seq/2 keys on average; CP splits the tokens, not the keys
        attn = arch.heads * seq * (arch.qk_dim + arch.v_dim) * tokens
        ew = {"norm_and_residual": tokens / tp * arch.hidden,  # sequence parallel
              "rope": tokens * (arch.heads * arch.qk_dim + arch.kv_dim) / tp,
              "attn_out": tokens * arch.heads * arch.v_dim / tp}
    if swiglu:
        ew["swiglu"] = swiglu
    _, rec, tot = op_sac(tensors, frac)
    op_rec = (fp8 + other) * (rec / tot) if tot else 0.0
    return GroupFlops(fp8, other, attn, op_rec, linears, ew, tp)


def _gemm(flops: float, nbytes: float, rate: float, bw: float) -> float:
    return max(flops / rate, nbytes / bw)


def _fp8_cast_bytes(lin: Linear, recipe: str, tp: int, fp8_allgather: bool) -> tuple[float, float]:
    """(forward, backward) bytes of float8 casts for one linear (per step, memory-bound).

    Tensorwise (one scale per tensor): an amax pass (read 2 B) then the cast (read 2, write 1)
    = 5 B per element of the input in forward and of the output gradient in backward, plus a
    transposed fp8 copy (1 + 1) of each for the weight-gradient GEMM. Under TP torchtitan casts
    a column-parallel input on its sequence shard before the float8 all-gather (``/ tp``).
    Rowwise (one scale per row): the row amax fuses into the cast (3 B), but the weight
    gradient needs column scales, so input and output gradient are cast again from bf16
    (5 B each). Weights: cast per step unless float8 all-gather casts the shard before it.
    """
    mk, mn, kn = lin.m * lin.k * lin.count, lin.m * lin.n * lin.count, lin.k * lin.n * lin.count
    if recipe in ("mxfp8", "nvfp4"):
        # block scales (1 x 32 / 1 x 16): the amax fuses into the cast (read 2, write <= 1 +
        # the scales, ~3 B); forward casts input and weight along K, backward the output
        # gradient along N (input gradient) and output gradient and input along M (weight
        # gradient), and the weight along N
        return 3 * mk + 3 * kn, 3 * mn + 3 * kn + 3 * mn + 3 * mk
    if recipe == "tensorwise":
        x = mk / tp if (tp > 1 and not lin.rowwise) else mk
        w = 0.0 if fp8_allgather else 5 * kn
        return 5 * x + w, 5 * mn + 2 * mk + 2 * mn + 2 * kn
    return 3 * mk + 3 * kn, 3 * mn + 5 * mk + 5 * mn + 5 * kn


def low_precision_speedup(recipe: str) -> float:
    """The GEMM rate of a low-precision recipe over bf16's: fitted for tensorwise, rowwise and
    MXFP8 (:mod:`.fitted`); NVFP4 is MXFP8's times the data sheet's FP4 / FP8 dense ratio on
    Blackwell (B200: 9 / 4.5 PFLOP/s), not calibrated (no published NVFP4 training point)."""
    if recipe == "nvfp4":
        return fitted.FLOAT8_SPEEDUP["mxfp8"] * NVFP4_OVER_MXFP8
    return fitted.FLOAT8_SPEEDUP[recipe]


NVFP4_OVER_MXFP8 = 2.0

# MXFP8 on routed experts is torchao's own grouped-GEMM autograd function (it quantises
# inside), so its gain over bf16 ``torch._grouped_mm`` is taken from torchao's microbenchmark
# of that function, casts included, not from the dense fit: pytorch/ao
# ``torchao/prototype/moe_training/README.md`` at 36027d82, "Autograd function" tables, B200
# at 1,000 W, forward + backward, total M = 128,000, median over G = 1, 2, 4, 8 groups.
# Keyed by the expert weight's smaller dim (N, K): DeepSeek-V3's (2048, 7168) 1.188 / 1.321 /
# 1.595 / 1.440 -> 1.3805; Llama 4 Scout's (8192, 5120) 1.808 / 1.690 / 1.637 / 1.700 ->
# 1.695. Between them log-linear in that dim; outside them the nearest (not extrapolated:
# no published point for thinner experts such as Qwen3-30B-A3B's 768).
GROUPED_MXFP8_SPEEDUP = ((2048, 1.3805), (5120, 1.695))


def grouped_mxfp8_speedup(n: float, k: float) -> float:
    """MXFP8 over bf16 for one routed expert's grouped GEMMs (casts included), by shape."""
    (d0, g0), (d1, g1) = GROUPED_MXFP8_SPEEDUP
    d = min(n, k)
    if d <= d0:
        return g0
    if d >= d1:
        return g1
    return g0 + (g1 - g0) * math.log(d / d0) / math.log(d1 / d0)


def _grouped_mx(lin: "Linear", recipe: Recipe) -> bool:
    """True where the grouped-GEMM table above prices this linear (casts and all): a routed
    expert under MXFP8, or NVFP4 (its gain scaled from the table as the dense one is)."""
    return recipe.float8 in ("mxfp8", "nvfp4") and lin.fp8 and _is_routed(lin.name)


def attention_rate(prof: GPUProfile, seq: int, cp: int = 1, fp32: bool = False) -> float:
    """Flash attention's flop/s: the GEMMs' large-shape rate x ``ATTENTION_RATE`` (fitted) x
    the saturation of the query chunk a rank holds (``seq / cp`` tokens, :mod:`.gemm`)."""
    peak = (prof.fp32_flops or prof.flops) if fp32 and prof.fp32_flops else prof.flops
    return peak * prof.efficiency * fitted.ATTENTION_RATE * saturation(seq / max(1, cp))


def linear_times(lin: Linear, prof: GPUProfile, recipe: Recipe, fp32: bool = False) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) GEMM seconds of one linear on one rank;
    each GEMM at the rate of its own shape (:func:`.gemm.shape_factor`)."""
    rate = ((prof.fp32_flops or prof.flops) if fp32 and prof.fp32_flops else prof.flops) * prof.efficiency
    bw, cb = prof.mem_bw, 4 if fp32 else 2
    f8 = bool(recipe.float8) and lin.fp8
    gain = low_precision_speedup(recipe.float8) if f8 else 1.0
    if _grouped_mx(lin, recipe):  # torchao's grouped-GEMM gain, not the dense fit (NVFP4: x 2 of it, as dense)
        gain = grouped_mxfp8_speedup(lin.n, lin.k) * (NVFP4_OVER_MXFP8 if recipe.float8 == "nvfp4" else 1.0)
    r = rate * gain
    a = (0.5 if recipe.float8 == "nvfp4" else 1) if f8 else cb
    m, k, n, c, fl = lin.m, lin.k, lin.n, lin.count, lin.flops
    return (_gemm(fl, c * (m * k * a + k * n * a + m * n * cb), r * shape_factor(m, n, k), bw),
            _gemm(fl, c * (m * n * a + k * n * a + m * k * cb), r * shape_factor(m, k, n), bw),
            _gemm(fl, c * (m * k * a + m * n * a + k * n * cb), r * shape_factor(k, n, m), bw))


def compute_times(gf: GroupFlops, prof: GPUProfile, recipe: Recipe, act_ckpt: str, tp: int,
                  fp32: bool = False, seq: int = 0, cp: int = 1, extra_f: float = 0.0,
                  extra_b: float = 0.0) -> tuple[float, float]:
    """(forward seconds, backward seconds incl. recomputation) of one group on one rank.
    ``extra_f`` / ``extra_b``: memory-bound seconds of other work in the group (a MoE
    layer's permutation and router, :mod:`.moe`), recomputed with the forward under AC."""
    bw = prof.mem_bw
    cb = 4 if fp32 else 2
    mm_f = mm_b = mm_rerun = cast_f = cast_b = cast_rerun = 0.0
    for lin in gf.linears:
        f8 = bool(recipe.float8) and lin.fp8
        fwd, dgrad, wgrad = linear_times(lin, prof, recipe, fp32)
        mm_f += fwd
        mm_b += dgrad + wgrad
        cf = cbk = 0.0
        if f8 and not _grouped_mx(lin, recipe):  # the grouped table's gain has its casts in
            cf, cbk = _fp8_cast_bytes(lin, recipe.float8, tp, recipe.float8_allgather)
            cast_f, cast_b = cast_f + cf / bw, cast_b + cbk / bw
        if lin.op_rerun:
            mm_rerun += fwd
            cast_rerun += cf / bw
    table = ELEMENTWISE_EAGER
    ew_bytes = sum(table[kind] * elems for kind, elems in gf.ew_fwd.items()) * cb / 2
    ew_f = ew_bytes / bw / (fitted.COMPILE_SPEEDUP if recipe.compile else 1.0)
    att = gf.attention / tp / attention_rate(prof, seq, cp, fp32) if gf.attention else 0.0
    fwd = mm_f + cast_f + ew_f + att + extra_f
    bwd = mm_b + cast_b + BACKWARD_ELEMENTWISE * ew_f + 2.5 * att + extra_b
    if act_ckpt == "full":
        bwd += fwd
    elif act_ckpt == "selective":
        bwd += 0.5 * fwd
    elif act_ckpt == "op":
        bwd += mm_rerun + cast_rerun + ew_f + extra_f
    return fwd, bwd


def tp_feed(gf: GroupFlops, prof: GPUProfile, recipe: Recipe, fp32: bool = False) -> list[float]:
    """Forward GEMM seconds of the matmuls each of a block's four TP collectives feeds or
    is fed by: [q/k/v after the attention all-gather, o before its reduce-scatter, gate/up
    after the MLP all-gather, down before its reduce-scatter]. Backward pairs them the same
    way (the input-gradient GEMMs have the forward's sizes). Empty if the block is not
    Llama-shaped (then the whole block's matmuls are the bound)."""
    out = [0.0, 0.0, 0.0, 0.0]
    seen = 0
    for lin in gf.linears:
        n = lin.name
        slot = (0 if any(k in n for k in ("q_proj", "k_proj", "v_proj", ".wq.", ".wk.", ".wv.")) else
                1 if any(k in n for k in ("o_proj", ".wo.")) else
                2 if any(k in n for k in ("gate_proj", "up_proj", ".w1.", ".w3.")) else
                3 if any(k in n for k in ("down_proj", ".w2.")) else None)
        if slot is None:
            continue
        out[slot] += linear_times(lin, prof, recipe, fp32)[0]
        seen += 1
    return out if seen and all(out) else []
