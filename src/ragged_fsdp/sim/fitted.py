"""The simulator's fitted constants, each fitted once on named published points (never on a
validation point). ``python -m ragged_fsdp.sim.validate --fit`` refits them from
``published_points.json`` and prints the values; the validation run checks they still match.
What each one scales is in :mod:`.compute` (GEMM roofline, elementwise traffic, attention).

- ``EFFICIENCY[profile]``: the fraction of peak dense bf16 flops a large GEMM reaches (the
  compute roof of each GEMM's roofline; memory-bound GEMMs and the elementwise work are
  costed separately at ``mem_bw``), one per built-in profile, each fitted on a bf16 run *on
  that GPU* (issue 56: none borrowed; a GPU without such a run has no entry and
  :func:`.profiles.get_profile` refuses it). h100-gt: torchtitan Llama 3.1 8B on 8 Grand
  Teton H100 (peak taken as 912 TFLOP/s, see :mod:`.profiles`), FSDP, per-op SAC (5,762
  tok/s); h100 (SXM, 700 W): the AWS p5 blog's baseline (Llama 3 8B, 32 H100 SXM, 6,475
  tok/s); h200: Trainy's 4-node run (Llama 3 8B, 32 H200, 10,938 tok/s; float8 tensorwise,
  so its efficiency rests on the tensorwise gain fitted on h100-gt); a100: torchtitan Llama 3
  8B on 64 A100, FSDP, per-layer SAC (2,904 tok/s); b200 (power-limited, as torchtitan's
  published B200 runs): mxfp8.md, Llama 3 8B on 8 power-limited B200, bf16 (8,307.5 tok/s);
  b200-1000w: torchtitan PR #1196's log (Llama 3 8B, 8 B200, 12,211 tok/s; configuration
  inferred, see published_points_issue56.json); gb200: torchtitan nvfp4.md, Llama 3 8B on 4
  GB200, bf16 (21,919 tok/s); mi300x: torchao's float8 training table, Llama 3 8B on 8
  MI300X, bf16 (5,376.5 tok/s). Large GEMMs only: smaller shapes lose to :mod:`.gemm`'s
  saturation.
- ``FLOAT8_SPEEDUP["mxfp8"]``: the same B200 table's ``mxfp8_cublas`` row (9,969 tok/s);
  it prices dense linears. Routed experts' grouped GEMMs take torchao's microbenchmarked
  gain instead (:func:`.compute.grouped_mxfp8_speedup`, not fitted).
- ``A2A_EFFICIENCY["standard"]``: torchtitan's default EP all-to-all, achieved over link
  bandwidth (:mod:`.moe`), on the DeepEP README's default-EP figure (Qwen3-30B-A3B, 8 B200,
  EP 8, 9,930 tok/s).
- ``COMPILE_SPEEDUP``: how many times fewer elementwise bytes the blocks move under
  ``torch.compile`` (fused kernels); fitted on the same 8-GPU table's "FSDP +
  torch.compile" row (6,667 tok/s). The kernel-by-kernel count in
  :data:`.compute.ELEMENTWISE_EAGER` / ``ELEMENTWISE_COMPILED`` gives ~3.2 for Llama 3 8B.
- ``FLOAT8_SPEEDUP["tensorwise"]``: the float8 GEMM's compute rate over bf16's (the
  casts are costed separately, memory-bound), fitted on that table's "FSDP +
  torch.compile + Float8" row (8,532 tok/s); the H100 data sheet's ratio is 2.
  ``["rowwise"]``: fitted on torchtitan's async-TP table, Llama 3 70B, 256 H100, FSDP 32 x
  TP 8, float8 rowwise, vanilla TP (599.6 tok/s).
- ``ATTENTION_RATE``: flash attention's rate as a fraction of the GEMMs' rate (causal,
  backward = 2.5 x forward), fitted on torchtitan's CP table row "FSDP 8, CP 1, sequence
  32768" (3,890 tok/s).
- ``ALLOCATOR_RESERVE``: what the CUDA caching allocator reserves beyond the peak allocated,
  as a fraction of it (torchtitan reports ``max_memory_reserved``; the simulator counts
  allocated bytes). Fitted on the memory of the 8-GPU table's "FSDP" row (82.4 GiB).
"""

from __future__ import annotations

__all__ = ["A2A_EFFICIENCY", "EFFICIENCY", "COMPILE_SPEEDUP", "FLOAT8_SPEEDUP", "ATTENTION_RATE", "ALLOCATOR_RESERVE", "FIT_POINTS"]

EFFICIENCY = {"h100-gt": 0.5391, "h100": 0.5447, "h200": 0.5780, "a100": 0.7626, "b200": 0.2613, "b200-1000w": 0.4357,
              "gb200": 0.5204, "mi300x": 0.2908}
A2A_EFFICIENCY = {"standard": 0.3918}
COMPILE_SPEEDUP = 3.6854
FLOAT8_SPEEDUP = {"tensorwise": 1.7724, "rowwise": 1.3528, "mxfp8": 1.3877}
ATTENTION_RATE = 0.4851
ALLOCATOR_RESERVE = 0.2121

# constant -> id of the point in published_points.json it is fitted on (in fit order)
FIT_POINTS = {
    "efficiency:h100-gt": "tt-2412-t1-fsdp",
    "efficiency:a100": "tt-perf-a100-l3-8b-layer",
    "compile_speedup": "tt-2412-t1-compile",
    "float8_speedup:tensorwise": "tt-2412-t1-compile-fp8",
    "attention_rate": "tt-2412-t2-cp1",
    "float8_speedup:rowwise": "tt-atp-70b-rowwise-vanilla",
    "allocator_reserve": "tt-2412-t1-fsdp",  # on its memory (GiB), the only constant fitted on memory
    # issue 45 (Blackwell, MXFP8, MoE with EP)
    "efficiency:b200": "tt-mx-b200-8b-bf16",
    "float8_speedup:mxfp8": "tt-mx-b200-8b-mxfp8-cublas",
    "a2a_efficiency:standard": "tt-deepep-qwen3-default-8",
    # issue 56: every other GPU on a run of its own (published_points*.json)
    "efficiency:h100": "aws-p5-8b-baseline",
    "efficiency:h200": "trainy-h200-4n",
    "efficiency:b200-1000w": "tt-pr1196-b200-8b",
    "efficiency:gb200": "tt-nvfp4-gb200-llama-bf16",
    "efficiency:mi300x": "ao-mi300x-8b-bf16",
}
