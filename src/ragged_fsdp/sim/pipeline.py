"""Pipeline parallelism: which layers each stage holds, the schedule's bubble, and the
microbatches a stage keeps in flight.

Stages split the blocks evenly (the first also holds the embedding, the last the final norm
and head). With ``m`` microbatches of forward+backward time ``t`` on the slowest stage:

- ``1f1b``: step = (m + P - 1) x t; stage ``s`` holds ``P - s`` microbatches' activations
  (the first stage P);
- ``interleaved_1f1b`` with ``v`` stages per rank: step = (m + (P - 1) / v) x t; the first
  rank holds P x (1 + (P - 1) / (P v)) microbatch-chunks of 1/v of its layers each
  (Narayanan et al., 2021);
- ``zero_bubble`` (ZB-H1, Qi et al., 2023, torchtitan's ``ZBVZeroBubble`` family): the weight
  gradients fill the cool-down, step = (m + (P - 1) / 3) x t, in-flight memory as 1F1B.

Each stage boundary sends one microbatch's activations forward and their gradient back
(point-to-point, bf16, the TP-sharded sequence when SP is on); the warm-up and cool-down
transfers, (P - 1) each way, sit on the critical path, the steady state overlaps them.
"""

from __future__ import annotations

__all__ = ["stage_layers", "bubble", "in_flight"]


def stage_layers(layers: int, pp: int) -> list[int]:
    """Blocks per stage, the remainder on the first stages."""
    if pp > layers:
        raise ValueError(f"--mesh pp={pp} exceeds the model's {layers} layers; use pp <= {layers}")
    base, extra = divmod(layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def bubble(schedule: str, pp: int, virtual: int) -> float:
    """Idle time in units of one microbatch's forward+backward on a stage."""
    if pp <= 1:
        return 0.0
    if schedule == "1f1b":
        return float(pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / virtual
    if schedule == "zero_bubble":
        return (pp - 1) / 3.0
    raise ValueError(f"--pp-schedule {schedule!r}: choose one of 1f1b, interleaved_1f1b, zero_bubble")


def in_flight(schedule: str, pp: int, virtual: int, stage: int, microbatches: int) -> float:
    """Microbatches' worth of this stage's activations held at the peak (in units of the
    whole stage's activations for one microbatch)."""
    if pp <= 1:
        return 1.0
    if schedule == "interleaved_1f1b":
        held = pp * (1 + (pp - 1) / (pp * virtual)) if stage == 0 else (pp - stage) * (1 + (pp - 1) / (pp * virtual))
    else:
        held = pp - stage
    return float(min(held, microbatches))
