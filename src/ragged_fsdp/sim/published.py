"""Published FSDP2 points (torchtitan ``docs/performance.md``) and the one fitted number.

One efficiency factor per GPU profile is fitted on one point (the first of that profile
below); every other number is predicted. ``python -m ragged_fsdp.sim.published`` prints the
table the README shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mesh import Mesh
from .profiles import PROFILES, GPUProfile
from .simulate import Scenario, simulate

__all__ = ["POINTS", "fit_efficiency", "evaluate"]

GiB = 2**30


@dataclass(frozen=True)
class Point:
    label: str
    model: str
    gpu: str
    gpus: int
    mesh: Mesh
    micro_batch: int
    seq: int
    act_ckpt: str
    tokens_per_s: float
    mfu: float | None = None
    memory_gib: float | None = None
    hbm_gb: float | None = None  # the published machine's memory, when it differs from the profile
    fit: bool = False


POINTS = [
    Point("Llama 3.1 8B, 8 H100, bs 2, selective AC", "llama3-8b", "h100", 8, Mesh(8), 2, 8192, "selective",
          5762, memory_gib=82.4, hbm_gb=96, fit=True),
    Point("Llama 3.1 405B, 128 H100, FSDP 16 x TP 8, bs 2, full AC", "llama3-405b", "h100", 128, Mesh(16, 1, 8),
          2, 8192, "full", 109, mfu=0.290, hbm_gb=96),
    Point("Llama 3 8B, 64 A100, bs 1, selective AC", "llama3-8b", "a100", 64, Mesh(64), 1, 8192, "selective",
          2904, mfu=0.568, fit=True),
    Point("Llama 3 70B, 64 A100, bs 1, full AC", "llama3-70b", "a100", 64, Mesh(64), 1, 8192, "full", 331, mfu=0.517),
]


def _run(p: Point, prof: GPUProfile):
    sc = Scenario(p.model, p.gpus, prof, p.mesh, "adamw", "bf16", p.seq, p.micro_batch, p.act_ckpt, None)
    return simulate(sc, ("fsdp2",))[0]


def _profile(p: Point, eff: float) -> GPUProfile:
    prof = PROFILES[p.gpu].with_overrides(efficiency=eff)
    if p.hbm_gb:
        prof = prof.with_overrides(hbm_bytes=p.hbm_gb * 1e9)
    return prof


def fit_efficiency(p: Point) -> float:
    """The efficiency at which the simulator gives the point's published tokens/s (bisection)."""
    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if _run(p, _profile(p, mid)).tokens_per_s_per_gpu < p.tokens_per_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def evaluate() -> list[dict]:
    effs = {p.gpu: fit_efficiency(p) for p in POINTS if p.fit}
    rows = []
    for p in POINTS:
        r = _run(p, _profile(p, effs[p.gpu]))
        # torchtitan's MFU counts 6 x all parameters (embedding included) + attention
        from .arch import resolve_model

        a = resolve_model(p.model)
        tt_flops = 6 * a.params + 12 * a.layers * a.heads * a.qk_dim * p.seq
        mfu_tt = r.tokens_per_s_per_gpu * tt_flops / PROFILES[p.gpu].flops
        rows.append({
            "point": p.label, "fitted here": p.fit, "efficiency": effs[p.gpu],
            "tokens/s published": p.tokens_per_s, "tokens/s predicted": r.tokens_per_s_per_gpu,
            "tokens/s error": r.tokens_per_s_per_gpu / p.tokens_per_s - 1,
            "MFU published": p.mfu, "MFU predicted": mfu_tt,
            "memory published GiB": p.memory_gib, "memory predicted GiB": r.memory_bytes / GiB,
            "memory error": (r.memory_bytes / GiB / p.memory_gib - 1) if p.memory_gib else None,
            "peak at": r.peak_phase, "time parts": r.time_parts,
        })
    return rows


def format_rows(rows) -> str:
    out = ["| point | efficiency (fitted on) | tokens/s/GPU published | predicted | error | MFU published | "
           "predicted | memory GiB published | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem_p = f"{r['memory published GiB']:.1f}" if r["memory published GiB"] else "-"
        mem_e = f"{r['memory error']:+.1%}" if r["memory error"] is not None else "-"
        mfu_p = f"{r['MFU published']:.1%}" if r["MFU published"] else "-"
        out.append(f"| {r['point']} | {r['efficiency']:.3f}{' (this point)' if r['fitted here'] else ''} | "
                   f"{r['tokens/s published']:,.0f} | {r['tokens/s predicted']:,.0f} | "
                   f"{'fitted' if r['fitted here'] else format(r['tokens/s error'], '+.1%')} | {mfu_p} | "
                   f"{r['MFU predicted']:.1%} | {mem_p} | {r['memory predicted GiB']:.1f} | {mem_e} |")
    return "\n".join(out)


if __name__ == "__main__":
    rows = evaluate()
    print(format_rows(rows))
    for r in rows:
        print(r["point"], "peak at", r["peak at"], {k: round(v, 3) for k, v in r["time parts"].items()})
