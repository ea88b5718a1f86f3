"""`bench`: ragged_fsdp beside torch FSDP2, FSDP1 and DDP, side by side in one launch per world size.

The command line is read and checked here, in the parent, before any rank is spawned; the
launches, the measurements and the report are :mod:`ragged_fsdp.bench.engine`'s.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..bench.config import MESH_VARIANTS, VARIANTS, WORKLOADS, BenchConfig
from ..bench.meta import run_meta
from ._args import UsageError, choices, output_path, positive_int, whole_number


# --quick: enough rounds that a median ratio and its per-round range can be read at all on
# tiny models, few enough for a check (docs/benchmarks.md: 57 s on a quiet 2-core machine)
QUICK_ROUNDS, QUICK_STEPS = 5, 2


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="step time / memory / copies of ragged_fsdp vs torch FSDP2, FSDP1, DDP")
    d = BenchConfig()
    p.add_argument("--world", default=None, help=f"world sizes, e.g. 2,4 (default {','.join(map(str, d.worlds))}; "
                   "with --mesh RxS: R*S)")
    p.add_argument("--mesh", default=None, metavar="RxS",
                   help="HSDP on an R x S (replicate, shard) mesh for ragged_fsdp and FSDP2, e.g. 2x2 "
                        "(FSDP1 and DDP take no 2-D mesh and are left out)")
    p.add_argument("--rounds", type=int, default=None, help=f"default {d.rounds}; with --quick {QUICK_ROUNDS}")
    p.add_argument("--steps", type=int, default=None, help=f"steps per round (default {d.steps}; with --quick "
                                                           f"{QUICK_STEPS})")
    p.add_argument("--models", default=",".join(d.models))
    p.add_argument("--frameworks", default=None,
                   help=f"default {','.join(VARIANTS)}; with --mesh {','.join(MESH_VARIANTS)}")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny models at W=2 (unless --world), {QUICK_ROUNDS} rounds of {QUICK_STEPS} steps after a "
                        "2-step warm-up: a check that runs end to end; its ratios carry their per-round range")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", default=None, metavar="BACKEND", choices=("eager", "aot_eager", "inductor"),
                   help="torch.compile every block (each framework the same way) with this backend")
    p.add_argument("--out", default=None,
                   help=f"JSON (default {d.out}; with --mesh RxS: out/bench_engine_meshRxS.json)")
    p.add_argument("--png", default=None, help=f"PNG (default {d.png}; with --mesh, beside the JSON)")


def parse_mesh(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        r, s = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--mesh {text!r}: expected RxS, the replicate and shard sizes, e.g. 2x2") from None
    if r < 1 or s < 1:
        raise UsageError(f"--mesh {text!r}: both sizes must be at least 1")
    return r, s


def parse_worlds(text: str) -> tuple[int, ...]:
    worlds = tuple(whole_number("--world", t, text) for t in str(text).split(","))
    for w in worlds:
        if w < 1:  # zero ranks would leave the parent waiting for a report no rank sends
            raise UsageError(f"--world {text}: {w} ranks; every world size must be at least 1")
    if len(set(worlds)) < len(worlds):
        raise UsageError(f"--world {text}: a world size listed twice; name each once")
    return worlds


def check_args(args) -> tuple:
    """(worlds, mesh, frameworks, models, out, png) of the command line, or a UsageError naming the flag:
    all in the parent, before any rank is spawned (a rank's error arrives only after its torch
    import, and a world of 0 ranks never reports at all)."""
    mesh = parse_mesh(getattr(args, "mesh", None))
    d = BenchConfig()
    if args.world is None:
        worlds = (mesh[0] * mesh[1],) if mesh else d.worlds
    else:
        worlds = parse_worlds(args.world)
    if mesh and any(w != mesh[0] * mesh[1] for w in worlds):
        raise UsageError(f"--world {args.world} does not match --mesh {args.mesh}: the mesh needs "
                         f"{mesh[0] * mesh[1]} ranks (pass --world {mesh[0] * mesh[1]} or leave --world out)")
    if args.frameworks is None:
        frameworks = MESH_VARIANTS if mesh else VARIANTS
    else:
        frameworks = choices("--frameworks", args.frameworks, VARIANTS, "frameworks")
        if mesh and set(frameworks) - set(MESH_VARIANTS):
            raise UsageError(f"--frameworks {args.frameworks} with --mesh: "
                             f"{', '.join(sorted(set(frameworks) - set(MESH_VARIANTS)))} take no 2-D mesh; "
                             f"choose from {', '.join(MESH_VARIANTS)}")
    # dense-wide: the dim-512 workload of earlier reports, built on request only
    models = choices("--models", args.models, WORKLOADS + ("dense-wide",), "workloads")
    quick = getattr(args, "quick", False)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if quick else d.rounds
    if args.steps is None:
        args.steps = QUICK_STEPS if quick else d.steps
    positive_int("--rounds", args.rounds)
    positive_int("--steps", args.steps)
    tag = f"_mesh{mesh[0]}x{mesh[1]}" if mesh else ""
    out = args.out or (f"out/bench_engine{tag}.json" if mesh else d.out)
    png = args.png if args.png is not None else (str(Path(out).with_suffix(".png")) if mesh else d.png)
    # written after every launch has run: a path that cannot be written would lose them all
    output_path("--out", out)
    if png:
        output_path("--png", png)
    return worlds, mesh, frameworks, models, out, png


def run(args) -> int:
    from ..bench import engine  # torch: after the command line is read and checked

    worlds, mesh, frameworks, models, out, png = check_args(args)
    base = dict(rounds=args.rounds, steps=args.steps, models=models,
                frameworks=frameworks, profile=args.profile, out=out,
                png=png, quick=args.quick, worlds=worlds, mesh=mesh, compile=getattr(args, "compile", None))
    if args.quick and args.world is None and not mesh:
        worlds = (2,)
        base["worlds"] = worlds
    reports, configs = {}, {}
    for w in worlds:
        cfg = BenchConfig(world=w, **base)
        reports[w] = engine.run(cfg)
        configs[w] = cfg
        engine.print_report(cfg, reports[w])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    # "report" keeps its shape (per workload) for readers of earlier files (sim.bench_check):
    # the W=2 launch when there is one; every launch is under "by_world".
    first = 2 if 2 in reports else worlds[0]
    rows = [row for w, r in reports.items() for row in engine.summary_rows(w, r)]
    Path(out).write_text(json.dumps({"meta": run_meta(), "config": asdict(configs[first]), "rows": rows,
                                     "report": reports[first], "by_world": {str(w): r for w, r in reports.items()}},
                                    indent=1, default=str))
    print(f"\nwrote {out}")
    if png:
        made = engine.plot(reports, configs[worlds[0]], png)
        print(f"wrote {made}" if made else "(install matplotlib for the PNG)")
    return 0

