"""`python -m ragged_fsdp simulate`: per-rank memory, step time, MFU and tokens/s of
ragged_fsdp, FSDP2, FSDP1, DeepSpeed ZeRO-3 and Megatron-FSDP, from shapes only.

    python -m ragged_fsdp simulate --model gpt-oss-120b --gpus 1024 --gpu h100 \\
        --optimizer adamw --dtype bf16 --seq 4096 --micro-batch 1 --act-ckpt full \\
        [--mesh dp=1024 | hsdp=128x8 | tp=8,dp=128 | ep=8,dp=128 | pp=8,tp=8,dp=16 | cp=4,dp=256 | auto] \\
        [--compile] [--float8 tensorwise|rowwise|mxfp8|nvfp4 [--float8-allgather | --mxfp8-allgather]] [--async-tp] \\
        [--moe-dispatcher standard|deepep] [--moe-imbalance 1.1] \\
        [--pp-schedule 1f1b|interleaved_1f1b|zero_bubble] [--microbatches M] \\
        [--grad-wire bf16|int8|fp8 [--grad-wire-ef]] \\
        [--frameworks ragged,fsdp2,fsdp1,deepspeed,megatron] [--sweep gpus=64..16384] \\
        [--json] [--plot out.png]
    python -m ragged_fsdp simulate --calibrate [--profile-out out/cpu_profile.json]

Layouts come from the real planner; each framework differs only where it really does
(layout and padding, copies, buffer lifetimes, collective granularity), and the output names
each difference and, for every framework, where it differs from ragged_fsdp by cause.
hsdp=RxS means R replicas of S-rank shard groups. --model also takes a Hugging Face
config.json (Llama, Llama 4, Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3/Kimi-K2). The cost models and
their fitted constants: docs/simulate.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..models.catalog import list_models
from ..sim.mesh import Mesh, parse_mesh
from ..sim.options import (AC_MODES, FLOAT8_RECIPES, GRAD_WIRES, MAX_GPUS, MOE_DISPATCHERS, PP_SCHEDULES, Recipe,
                           check_finite)
from ..sim.profiles import PROFILES, UNCALIBRATED, get_profile, profile_sources
from ..sim.host import format_host
from ..sim.report import ASSUMPTIONS, format_sweep, format_table, plot_sweep, sweep
from ..sim.simulate import FRAMEWORKS, Scenario, simulate, simulate_auto
from ..sim.snapshot import format_snapshot, snapshot_cost

_OVERRIDES = [  # flag, profile field, scale, help (ranges: profiles.validate_profile)
    ("--gpu-hbm-gb", "hbm_bytes", 1e9, "device memory, GB"),
    ("--gpu-tflops", "flops", 1e12, "peak dense TFLOP/s in the compute dtype"),
    ("--gpu-mem-bw-gbs", "mem_bw", 1e9, "memory bandwidth, GB/s"),
    ("--gpu-nvlink-gbs", "nvlink_bw", 1e9, "NVLink bandwidth one way per GPU, GB/s"),
    ("--gpu-net-gbs", "net_bw", 1e9, "network bandwidth one way per GPU, GB/s (400 Gb/s = 50)"),
    ("--gpus-per-node", "gpus_per_node", 1, "GPUs per node"),
    ("--efficiency", "efficiency", 1, "fraction of peak flops the matmuls reach"),
    ("--overlap", "overlap", 1, "fraction of communication that can hide under compute"),
    ("--reserved-gb", "reserved_bytes", 1e9, "memory reserve for context/NCCL/allocator, GB"),
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="per-rank memory, step time, MFU, tokens/s of every framework at 64..16384 GPUs",
        description=__doc__.split("\n\n", 1)[1].strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-70b",
                   help="catalog id or a Hugging Face config.json path; ids: " + ", ".join(list_models(True)))
    p.add_argument("--gpus", type=int, default=1024, help="number of GPUs (default 1024)")
    p.add_argument("--gpu", default="h100", help=f"GPU profile: {', '.join(PROFILES)} (calibrated), "
                   f"{', '.join(UNCALIBRATED)} (no evidence: needs --efficiency) or a profile JSON")
    for flag, _, _, hlp in _OVERRIDES:
        p.add_argument(flag, type=float, default=None, help=f"override the profile: {hlp}")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw8bit", "muon"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="compute dtype")
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--act-ckpt", default="full", choices=AC_MODES,
                   help="none | selective (torchtitan's per-layer SAC, every 2nd block) | op (torchtitan's "
                        "per-op SAC) | full")
    p.add_argument("--mesh", default=None,
                   help="dp=N | hsdp=RxS | tp=T,dp=N | ep=E,dp=N | pp=P,... | cp=C,... | auto (default dp=GPUS)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the blocks and the loss (fused elementwise kernels; compiled cross-entropy)")
    p.add_argument("--eager-loss", action="store_true",
                   help="with --compile, keep the loss eager (torchtitan before 2025 compiled the blocks only)")
    p.add_argument("--float8", default=None, choices=FLOAT8_RECIPES,
                   help="torchao low-precision linears in the blocks: float8 tensorwise / rowwise, or MXFP8 / NVFP4 "
                        "(block-scaled; Blackwell only: --gpu b200 / gb200)")
    p.add_argument("--low-precision-layers", type=int, default=None, metavar="N",
                   help="the --float8 recipe on the first N decoder layers only, the rest and the head in bf16 "
                        "(torchtitan's NVFP4 'bf16 tail': 27 of Llama 3 8B's 32)")
    p.add_argument("--loss-chunks", type=int, default=1, metavar="C",
                   help="the loss over the vocabulary in C chunks of tokens (chunked / fused linear cross-entropy): "
                        "one chunk's logits live at a time")
    p.add_argument("--act-offload", action="store_true",
                   help="saved activations copied to host memory after each block's forward and back before its "
                        "backward; the copy's time beyond the block's compute is exposed")
    p.add_argument("--moe-dispatcher", default="standard", choices=MOE_DISPATCHERS,
                   help="MoE with EP: torchtitan's default all-to-all (standard) or DeepEP's kernels")
    p.add_argument("--moe-imbalance", type=float, default=None,
                   help="MoE routing imbalance, tokens on the most loaded EP rank / mean (>= 1; default 1.1, "
                        "an assumption; 1.0 = forced balance as in torchtitan's benchmarks)")
    p.add_argument("--float8-allgather", action="store_true",
                   help="all-gather the float8 linears' weights in 1 byte (FSDP2: torchao float8; ragged_fsdp: "
                        "its BlockFP8, 1 byte + an fp32 scale per 128x128 tile)")
    p.add_argument("--mxfp8-allgather", action="store_true",
                   help="with --float8 mxfp8: ragged_fsdp gathers those linears' weights as MXFP8 (1 + 1/32 byte "
                        "per element, one plane per gather); FSDP2 with torchao's recipe gathers them in bf16")
    p.add_argument("--async-tp", action="store_true", help="TP collectives as collective matmuls (needs tp > 1)")
    p.add_argument("--grad-wire", default=None, choices=GRAD_WIRES,
                   help="ragged_fsdp's gradient_reduce: gradients as bf16 or int8/fp8 codes + per-block scales "
                        "through an all-to-all, summed in fp32 (default: the fp32 reduce-scatter)")
    p.add_argument("--grad-wire-ef", action="store_true",
                   help="with --grad-wire: error feedback (a persistent residual of the pieces each rank sends, "
                        "(W-1)/W of the unsharded gradient)")
    p.add_argument("--grad-wire-residual", default=None, choices=("fp32", "bf16", "int8"),
                   help="with --grad-wire-ef: the residual's storage (default: int8 for the int8 wire, 1 byte + "
                        "4/128 per element; bf16 for the others)")
    p.add_argument("--grad-wire-block", type=int, default=None, metavar="N",
                   help="with --grad-wire int8|fp8: elements per fp32 scale block, 1 + 4/N bytes per element "
                        "(default 128, GradientReduce.block_size's default)")
    p.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES, help="pipeline schedule (with pp > 1)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline microbatches per step (default: --micro-batch, one sequence each)")
    p.add_argument("--pp-virtual-stages", type=int, default=2, help="stages per rank for interleaved_1f1b")
    p.add_argument("--granularity", default="auto",
                   help="ragged_fsdp's block rule (element, row, rows:K, block:N, tensor, matrix); "
                        "auto follows the optimizer")
    p.add_argument("--snapshot-every", type=int, default=None, metavar="K",
                   help="price a peer-memory snapshot every K steps (bytes per rank, copy and send time "
                        "against the step; docs/surviving-failures.md)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma list of " + ", ".join(FRAMEWORKS))
    p.add_argument("--sweep", default=None, help="gpus=LO..HI: weak and strong scaling tables (powers of two)")
    p.add_argument("--plot", default=None, help="with --sweep: write the scaling plot (PNG) here")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (gloo collectives at W=2, matmul, memcpy) and write a profile")
    p.add_argument("--profile-out", default="out/sim/cpu_profile.json", help="where --calibrate writes")
    return p


_RANGE = {"--efficiency": (0.0, 1.0, True), "--overlap": (0.0, 1.0, False), "--reserved-gb": (0.0, 1e6, False)}


def _profile(args):
    # a GPU without evidence is refused unless --efficiency supplies it (never borrowed)
    prof = get_profile(args.gpu, efficiency=args.efficiency)
    kw = {}
    for flag, field, scale, _ in _OVERRIDES:
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v is not None:
            lo, hi, lo_open = _RANGE.get(flag, (0.0, float("inf"), True))
            v = check_finite(flag, v, lo, hi, lo_open)
            if field == "gpus_per_node" and v != int(v):
                raise ValueError(f"--gpus-per-node must be a whole number (got {v:g})")
            kw[field] = int(v) if field == "gpus_per_node" else v * scale
    return prof.with_overrides(**kw)


def _check_args(args) -> None:
    """Bounds first, so nothing runs for minutes on a typo."""
    if not 1 <= args.gpus <= MAX_GPUS:
        raise ValueError(f"--gpus {args.gpus}: must be between 1 and {MAX_GPUS:,} (as `plan`)")
    if args.seq < 1 or args.micro_batch < 1:
        raise ValueError("--seq and --micro-batch must be >= 1")
    if args.plot:
        if not args.sweep:
            raise ValueError("--plot draws the --sweep tables; add --sweep gpus=LO..HI")
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--plot needs matplotlib ({e}); pip install matplotlib, or drop --plot") from e


def _sweep_mesh(spec: str, gpus: int) -> str:
    """With --sweep, an explicit dp= is recomputed per size: drop it so --gpus decides."""
    return ",".join(p for p in spec.split(",") if not p.strip().startswith("dp=")) or f"dp={gpus}"


def run(args) -> int:
    if args.calibrate:
        from ..sim.calibrate import calibrate

        calibrate(args.profile_out)
        return 0
    try:
        prof = _profile(args)
        frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
        for f in frameworks:
            if f not in FRAMEWORKS:
                raise ValueError(f"--frameworks: unknown {f!r}; known: {', '.join(FRAMEWORKS)}")
        _check_args(args)
        mesh = parse_mesh(args.mesh, args.gpus) if not args.sweep or args.mesh is None or "dp=" not in args.mesh \
            else parse_mesh(_sweep_mesh(args.mesh, args.gpus), args.gpus)
        gran = None if args.granularity == "element" else args.granularity
        if args.snapshot_every is not None and (args.snapshot_every < 1 or args.sweep):
            raise ValueError(f"--snapshot-every {args.snapshot_every}: must be >= 1 steps, and is priced for one "
                             "--gpus at a time (not with --sweep)")
        if args.eager_loss and not args.compile:
            raise ValueError("--eager-loss only applies with --compile (without it the loss is eager already)")
        recipe = Recipe(compile=args.compile, compile_loss=False if args.eager_loss else None, float8=args.float8, float8_allgather=args.float8_allgather, mxfp8_allgather=args.mxfp8_allgather,
                        async_tp=args.async_tp, pp_schedule=args.pp_schedule, microbatches=args.microbatches,
                        pp_virtual=args.pp_virtual_stages, grad_wire=args.grad_wire,
                        grad_wire_ef=args.grad_wire_ef, grad_wire_residual=args.grad_wire_residual,
                        grad_wire_block=args.grad_wire_block, moe_dispatcher=args.moe_dispatcher,
                        moe_imbalance=args.moe_imbalance, low_precision_layers=args.low_precision_layers,
                        loss_chunks=args.loss_chunks, act_offload=args.act_offload)
        sc = Scenario(args.model, args.gpus, prof, mesh if mesh is not None else parse_mesh(None, args.gpus),
                      args.optimizer, args.dtype, args.seq, args.micro_batch, args.act_ckpt, gran, recipe=recipe)
        why = {}
        if args.sweep:
            m0 = sc.mesh

            def mesh_fn(g, m0=m0):  # keep TP / EP / PP / CP / the HSDP shard size; dp (or replicas) grows
                fixed = m0.tp * m0.ep * m0.pp * m0.cp * (m0.dp if m0.replicate > 1 else 1)
                if g % fixed:
                    raise ValueError(f"--sweep: {g} GPUs is not a multiple of {fixed} (mesh {m0})")
                if m0.replicate > 1:
                    return Mesh(m0.dp, g // fixed, m0.tp, m0.ep, m0.pp, m0.cp)
                return Mesh(g // fixed, 1, m0.tp, m0.ep, m0.pp, m0.cp)

            if mesh is None:
                raise ValueError("--sweep needs a fixed --mesh shape (not auto)")
            from ..sim.report import gpu_range

            hi = gpu_range(args.sweep)[-1]
            if hi > MAX_GPUS:
                raise ValueError(f"--sweep {args.sweep}: at most {MAX_GPUS:,} GPUs (as `plan`)")
            weak, strong = sweep(sc, args.sweep, frameworks, mesh_fn)
            if args.json:
                print(json.dumps({"weak": {g: [r.to_json() for r in rs] for g, rs in weak.items()},
                                  "strong": {g: [r.to_json() for r in rs] for g, rs in strong.items()}},
                                 indent=1, default=str))
            else:
                print(f"{args.model} on {prof.name}, {args.optimizer}, seq {args.seq}, micro-batch "
                      f"{args.micro_batch}, act-ckpt {args.act_ckpt}\n")
                print(format_sweep(weak, strong, frameworks))
            if args.plot:
                plot_sweep(weak, strong, frameworks, args.plot,
                           f"{args.model}, {prof.name}, seq {args.seq} x {args.micro_batch}, {args.optimizer}")
                print(f"wrote {args.plot}", file=sys.stderr)
            return 0
        if mesh is None:
            results, why = simulate_auto(sc, frameworks)
        else:
            results = simulate(sc, frameworks)
    except ValueError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    snaps = {r.framework: snapshot_cost(r, prof, args.snapshot_every) for r in results if r.framework == "ragged"} \
        if args.snapshot_every else {}
    if args.json:
        print(json.dumps({"scenario": {"model": args.model, "gpus": args.gpus, "profile": prof.to_json(),
                                       "profile_sources": profile_sources(prof),
                                       "optimizer": args.optimizer, "dtype": args.dtype, "seq": args.seq,
                                       "micro_batch": args.micro_batch, "act_ckpt": args.act_ckpt,
                                       "recipe": recipe.__dict__},
                          "results": [r.to_json() for r in results], "auto": why,
                          **({"snapshot": snaps} if snaps else {}),
                          "assumptions": ASSUMPTIONS}, indent=1, default=str))
        return 0
    print(format_table(results, f"{args.model} on {args.gpus:,} x {prof.name} ({args.optimizer}, {args.dtype}, "
                                f"seq {args.seq} x {args.micro_batch}, act-ckpt {args.act_ckpt})"))
    print()
    for r in results:
        top = sorted(r.memory_items.items(), key=lambda kv: -kv[1])[:4]
        print(f"{r.framework} [{r.status}]: " + "; ".join(r.differences))
        print("    peak: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in top))
        print("    time: " + ", ".join(f"{k} {v:.3f}s" for k, v in r.time_parts.items() if v))
        gr = r.grad_reduce
        if gr:
            print(f"    gradient reduction: {gr['format']}, {gr['sent_bytes'] / 2**30:.2f} GiB sent per rank per step"
                  + (f", local quantise/sum {gr['wire_local_s']:.3f}s" if gr["wire_local_s"] else "")
                  + (f", error-feedback residuals ({gr['residual']}) {gr['feedback_bytes'] / 2**30:.1f} GiB"
                     if gr["feedback_bytes"]
                     else ""))
        if r.vs_ragged:
            d = r.vs_ragged
            t = ", ".join(f"{k} {v:+.1%}" for k, v in d["step_frac"].items() if abs(v) >= 5e-4)
            m = ", ".join(f"{k} {v / 2**30:+.2f} GiB" for k, v in d["memory_bytes"].items() if abs(v) >= 2**24)
            print(f"    vs ragged: step {t or 'same'}; memory {m or 'same'}")
        if r.framework in why:
            print(f"    mesh auto: {why[r.framework]}")
    if results and results[0].uncertainty:
        u = results[0].uncertainty  # the same terms for every framework
        print()
        print("what the prediction rests on: " + "; ".join(f"{k}: {v}" for k, v in u["terms"].items()))
        print(f"cross-validated error band: {u['validated_error_band']}")
        print("profile sources: " + "; ".join(f"{k}: {v}" for k, v in profile_sources(prof).items()))
        b = u["band"]
        if b["low"] is not None:
            print("tokens/s/GPU with its band: " + "; ".join(
                f"{r.framework} {r.tokens_per_s_per_gpu:,.0f} ({r.tokens_per_s_per_gpu * b['low']:,.0f} .. "
                f"{r.tokens_per_s_per_gpu * b['high']:,.0f})" for r in results))
    if snaps:
        print()
        print(format_snapshot(snaps))
    print()
    print(format_host({r.framework: {**r.host["startup"], **{k: v for k, v in r.host["checkpoint"].items()
                                                             if k != "startup_cpu_s"}} for r in results}))
    return 0
