"""The training recipe beyond the mesh: torch.compile, float8 linears and all-gathers, async
TP, the pipeline schedule, and the activation-checkpointing policy. Pure data and checks.

Each option maps to one cost model (docs/simulate.md, "Cost models"):

- ``compile``: the elementwise (memory-bound) traffic of every block is divided by
  ``FITTED.compile_speedup`` (fused kernels); GEMMs and attention kernels are unchanged.
  ``compile_loss`` (default: follows ``compile``): the cross-entropy is compiled too, so its
  fp32 upcast and log-probabilities are not materialised (memory, :mod:`.simulate`).
- ``float8`` (``tensorwise`` / ``rowwise``, torchao's recipes): the matmuls of every linear
  inside the transformer blocks (not the output head, which torchtitan leaves in bf16, nor a
  MoE router) run ``FITTED.float8_speedup[recipe]`` times faster.
- ``float8_allgather``: FSDP2 all-gathers those linears' weights as torchao float8 tensors
  (1 byte per element; tensorwise only, as in torchao); ragged_fsdp uses its BlockFP8
  all-gather (1 byte per element plus one fp32 scale per 128 x 128 tile).
- ``async_tp``: TP's all-gathers and reduce-scatters run as collective matmuls; what the
  matmul they feed cannot hide stays exposed, plus one ring step (:mod:`.tensor_parallel`).
- ``pp_schedule`` with ``microbatches`` and ``pp_virtual``: the bubble and the microbatches
  each stage holds in flight (:mod:`.pipeline`).
- ``grad_wire`` (``bf16`` / ``int8`` / ``fp8``) with ``grad_wire_ef``: ragged_fsdp's
  ``fully_shard(gradient_reduce=GradientReduce(...))``. The shard dim's reduce-scatter becomes
  an all-to-all of :func:`wire_bytes_per_element` per element (codes plus one fp32 scale,
  4 bytes, per block of ``grad_wire_block`` elements: ``WIRE_BLOCK``, the engine's default,
  when left out; :data:`WIRE_BYTES` at that block), and the local work of the format (quantise, error feedback,
  dequantise and the fp32 sum) is memory traffic of :data:`WIRE_LOCAL_BYTES` per element of
  the unsharded gradient (:mod:`.timing`). Other frameworks are unchanged (they have no such
  option); the HSDP replicate all-reduce stays fp32, as in the engine. ``grad_wire_residual``:
  error feedback's residual storage (:data:`RESIDUAL_BYTES` per element of the pieces a rank
  sends, ``(W - 1) / W`` of each group's unsharded gradient; default as the engine's:
  int8 for the int8 wire, bf16 for the others; int8 storage carries one fp32 per block too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Recipe", "AC_MODES", "FLOAT8_RECIPES", "PP_SCHEDULES", "MAX_GPUS", "check_finite", "GRAD_WIRES",
           "WIRE_BYTES", "WIRE_BLOCK", "WIRE_LOCAL_BYTES", "RESIDUAL_BYTES", "DEFAULT_RESIDUAL",
           "feedback_bytes", "wire_bytes_per_element", "residual_bytes_per_element", "BLACKWELL_RECIPES",
           "MOE_DISPATCHERS"]

AC_MODES = ("none", "selective", "op", "full")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "mxfp8", "nvfp4")
# block-scaled recipes need Blackwell tensor cores (torchao: SM100+)
BLACKWELL_RECIPES = ("mxfp8", "nvfp4")
MOE_DISPATCHERS = ("standard", "deepep")
PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
GRAD_WIRES = ("bf16", "int8", "fp8")
# quant/grad_wire.py's DEFAULT_BLOCK (GradientReduce.block_size's default): blocks of 128
# elements (smaller units merged, larger ones cut), one fp32 scale each; the padding between
# tensors (a block per stretch) is left out here
WIRE_BLOCK = 128
# Memory traffic of the format's local work, bytes per element of the unsharded gradient,
# counted from the engine's torch ops as they run today (unfused; quant/grad_wire.py,
# fsdp/comms/wire_reduce.py), each op reading its inputs and writing its output once:
#   "quantise" (sender, before the all-to-all): int8: abs (4+4), segment max (4), scales
#     repeated (4), divide (4+4+4), round (4+4), clamp (4+4), cast (4+1) = 49; fp8: the same
#     without round and clamp = 33; bf16: one cast (4+2) = 6;
#   "feedback" (error feedback, sender): see feedback_bytes, which replaces this entry;
#   "sum" (receiver, on the reduction's lane): dequantise every piece (21; bf16 6) and the
#     fp32 sum over the pieces (4).
WIRE_LOCAL_BYTES = {
    "bf16": {"quantise": 6.0, "sum": 10.0},
    "int8": {"quantise": 49.0, "sum": 25.0},
    "fp8": {"quantise": 33.0, "sum": 25.0},
}
# error feedback's residual storage (quant/wire_residual.py), bytes per residual element: int8
# codes carry the fp32 scale of each block they were taken against; int8 only for the int8 wire
DEFAULT_RESIDUAL = {"int8": "int8", "fp8": "bf16", "bf16": "bf16"}


def wire_bytes_per_element(wire: str, block: int | None = None) -> float:
    """Bytes on the wire per gradient element: bf16 2; int8 and fp8 one code byte plus a
    4-byte scale per block of ``block`` elements (default :data:`WIRE_BLOCK`)."""
    if wire == "bf16":
        return 2.0
    return 1.0 + 4.0 / (block or WIRE_BLOCK)


def residual_bytes_per_element(store: str, block: int | None = None) -> float:
    """Error feedback's storage per residual element (int8: the codes plus the block's scale)."""
    return {"fp32": 4.0, "bf16": 2.0}[store] if store != "int8" else 1.0 + 4.0 / (block or WIRE_BLOCK)


WIRE_BYTES = {w: wire_bytes_per_element(w) for w in GRAD_WIRES}  # at the default block
RESIDUAL_BYTES = {r: residual_bytes_per_element(r) for r in ("fp32", "bf16", "int8")}


def feedback_bytes(wire: str, store: str) -> float:
    """Error feedback's traffic per element on the sender (quant/wire_residual.py, unfused):
    copy the gradient (4+4); decode the residual and add it (fp32: add 12; bf16: cast 2+4,
    add 12; int8: cast 1+4, scales repeated 4, multiply 12, add 12); dequantise the codes
    (int8/fp8: cast 1+4, scales repeated 4, multiply 12; bf16: cast 2+4); x - that (12);
    encode (fp32: copy 4+4; bf16: cast 4+2; int8: steps repeated 4, divide 12, round 8,
    clamp 8, cast 4+1)."""
    decode = {"fp32": 12.0, "bf16": 18.0, "int8": 33.0}[store]
    dequant = 6.0 if wire == "bf16" else 21.0
    encode = {"fp32": 8.0, "bf16": 6.0, "int8": 37.0}[store]
    return 8.0 + decode + dequant + 12.0 + encode


MAX_GPUS = 131072  # as `plan` (MAX_WORLD): beyond it the planner's per-rank tables grow without bound


@dataclass(frozen=True)
class Recipe:
    compile: bool = False
    # the loss compiled too (None: with ``compile``, as torchtitan since 2025 compiles the
    # loss function; its Dec 2024 version compiled the blocks only)
    compile_loss: bool | None = None
    float8: str | None = None  # None, "tensorwise" or "rowwise"
    float8_allgather: bool = False
    mxfp8_allgather: bool = False  # ragged_fsdp's MXFP8() gather of the mxfp8 linears (sim/mx_gather.py)
    async_tp: bool = False
    pp_schedule: str = "1f1b"
    microbatches: int | None = None  # None: one sequence per microbatch (torchtitan's default size 1)
    pp_virtual: int = 2  # stages per rank for interleaved_1f1b (torchtitan's default for looped schedules)
    grad_wire: str | None = None  # ragged_fsdp's gradient_reduce wire: None (fp32 reduce-scatter), bf16, int8, fp8
    grad_wire_ef: bool = False  # with grad_wire: error feedback
    grad_wire_residual: str | None = None  # with grad_wire_ef: the residual's storage (None: the engine's default)
    grad_wire_block: int | None = None  # with an int8 / fp8 grad_wire: elements per scale block (None: WIRE_BLOCK)
    # MoE with EP (sim/moe.py): the token dispatcher, and the routing imbalance (most loaded
    # EP rank / mean; None: moe.DEFAULT_IMBALANCE)
    moe_dispatcher: str = "standard"
    moe_imbalance: float | None = None
    # the low-precision recipe on the first N decoder layers only, the rest (and the head) in
    # bf16: torchtitan's NVFP4 "bf16 tail" (llama3_8b_nvfp4_mixed: 27 of 32 layers); None: all
    low_precision_layers: int | None = None
    # the loss over the vocabulary in this many chunks of tokens (a chunked / fused linear
    # cross-entropy): only one chunk's logits and their temporaries live at once
    loss_chunks: int = 1
    # each block's saved activations copied to host memory after its forward and back before
    # its backward (torch.autograd.graph.save_on_cpu style, prefetched one block ahead)
    act_offload: bool = False

    @property
    def residual_storage(self) -> str | None:
        if not self.grad_wire_ef:
            return None
        return self.grad_wire_residual or DEFAULT_RESIDUAL[self.grad_wire]

    def check(self, tp: int, pp: int, local_batch: int) -> None:
        lc = self.loss_chunks
        if isinstance(lc, bool) or not isinstance(lc, int) or lc < 1:
            raise ValueError(f"--loss-chunks {lc!r} must be an int >= 1 (1: the whole loss at once)")
        lp = self.low_precision_layers
        if lp is not None:
            if isinstance(lp, bool) or not isinstance(lp, int) or lp < 0:
                raise ValueError(f"--low-precision-layers {lp!r} must be an int >= 0 (the leading decoder layers "
                                 "in the --float8 recipe)")
            if self.float8 is None:
                raise ValueError("--low-precision-layers picks which layers run the --float8 recipe; add --float8 "
                                 "nvfp4 (or mxfp8, tensorwise, rowwise)")
        if self.grad_wire is not None and self.grad_wire not in GRAD_WIRES:
            raise ValueError(f"--grad-wire {self.grad_wire!r}: choose one of {', '.join(GRAD_WIRES)}")
        if self.grad_wire_ef and self.grad_wire is None:
            raise ValueError("--grad-wire-ef needs --grad-wire bf16|int8|fp8 (the residual is of the wire format)")
        blk = self.grad_wire_block
        if blk is not None:
            if isinstance(blk, bool) or not isinstance(blk, int) or blk < 1:
                raise ValueError(f"--grad-wire-block {blk!r} must be an int >= 1 (elements per scale block)")
            if self.grad_wire not in ("int8", "fp8"):
                raise ValueError("--grad-wire-block sets the scale blocks of the int8 and fp8 wires: add --grad-wire "
                                 "int8 (or fp8)" + ("; the bf16 wire has no scales" if self.grad_wire else ""))
        res = self.grad_wire_residual
        if res is not None:
            if not self.grad_wire_ef:
                raise ValueError("--grad-wire-residual is error feedback's storage: add --grad-wire-ef")
            if res not in RESIDUAL_BYTES:
                raise ValueError(f"--grad-wire-residual {res!r}: choose one of {', '.join(RESIDUAL_BYTES)}")
            if res == "int8" and self.grad_wire != "int8":
                raise ValueError(f"--grad-wire-residual int8 keeps codes of the int8 wire's block scale; the "
                                 f"{self.grad_wire} wire's rounding error is bounded per element: use "
                                 "--grad-wire-residual bf16 (or fp32)")
        if self.float8 is not None and self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"--float8 {self.float8!r}: choose one of {', '.join(FLOAT8_RECIPES)}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"--moe-dispatcher {self.moe_dispatcher!r}: choose one of {', '.join(MOE_DISPATCHERS)}")
        if self.moe_imbalance is not None:
            check_finite("--moe-imbalance", self.moe_imbalance, 1.0, 64.0, lo_open=False)
        if self.float8_allgather and self.float8 in BLACKWELL_RECIPES:
            raise ValueError(f"--float8-allgather: torchao's float8 all-gather supports the tensorwise recipe only; "
                             f"{self.float8} communicates in bf16. Drop --float8-allgather")
        if self.mxfp8_allgather and self.float8 != "mxfp8":
            raise ValueError("--mxfp8-allgather needs --float8 mxfp8 (ragged_fsdp gathers those linears as MXFP8)")
        if self.float8_allgather and self.float8 is None:
            raise ValueError("--float8-allgather needs --float8 tensorwise (the weights it gathers are float8)")
        if self.float8_allgather and self.float8 == "rowwise":
            raise ValueError("--float8-allgather: torchao's float8 all-gather supports the tensorwise recipe "
                             "only; use --float8 tensorwise or drop --float8-allgather")
        if self.async_tp and tp < 2:
            raise ValueError("--async-tp needs a TP mesh dim (e.g. --mesh tp=8,...)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"--pp-schedule {self.pp_schedule!r}: choose one of {', '.join(PP_SCHEDULES)}")
        if not isinstance(self.pp_virtual, int) or isinstance(self.pp_virtual, bool) or self.pp_virtual < 1:
            raise ValueError(f"--pp-virtual-stages {self.pp_virtual!r} must be an int >= 1")
        if self.microbatches is not None:
            m = self.microbatches
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ValueError(f"--microbatches {m!r} must be an int >= 1")
            if pp < 2:
                raise ValueError("--microbatches needs a PP mesh dim (e.g. --mesh pp=8,...)")
            if local_batch % m:
                raise ValueError(f"--microbatches {m} must divide --micro-batch {local_batch} "
                                 "(the sequences per GPU per step)")
            if m < pp:
                raise ValueError(f"--microbatches {m} is below the {pp} pipeline stages; the schedules "
                                 f"need at least one microbatch per stage (raise --micro-batch to >= {pp})")
        elif pp > 1 and local_batch < pp:
            raise ValueError(f"--mesh pp={pp} with --micro-batch {local_batch}: each stage needs a microbatch; "
                             f"use --micro-batch >= {pp}")

    @property
    def loss_compiled(self) -> bool:
        return self.compile if self.compile_loss is None else bool(self.compile_loss)

    def n_microbatches(self, local_batch: int) -> int:
        return self.microbatches or local_batch


def check_finite(name: str, value, lo: float, hi: float = math.inf, lo_open: bool = True) -> float:
    """A number in (lo, hi] (or [lo, hi]) that is finite; else a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f"{'>' if lo_open else '>='} {lo:g}"
        raise ValueError(f"{name} must be a finite number {rng} (got {value!r})")
    return v
