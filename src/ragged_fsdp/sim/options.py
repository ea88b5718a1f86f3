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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Recipe", "AC_MODES", "FLOAT8_RECIPES", "PP_SCHEDULES", "MAX_GPUS", "check_finite"]

AC_MODES = ("none", "selective", "op", "full")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
MAX_GPUS = 131072  # as `plan` (MAX_WORLD): beyond it the planner's per-rank tables grow without bound


@dataclass(frozen=True)
class Recipe:
    compile: bool = False
    # the loss compiled too (None: with ``compile``, as torchtitan since 2025 compiles the
    # loss function; its Dec 2024 version compiled the blocks only)
    compile_loss: bool | None = None
    float8: str | None = None  # None, "tensorwise" or "rowwise"
    float8_allgather: bool = False
    async_tp: bool = False
    pp_schedule: str = "1f1b"
    microbatches: int | None = None  # None: one sequence per microbatch (torchtitan's default size 1)
    pp_virtual: int = 2  # stages per rank for interleaved_1f1b (torchtitan's default for looped schedules)

    def check(self, tp: int, pp: int, local_batch: int) -> None:
        if self.float8 is not None and self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"--float8 {self.float8!r}: choose one of {', '.join(FLOAT8_RECIPES)}")
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
