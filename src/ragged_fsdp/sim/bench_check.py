"""Predict `python -m ragged_fsdp bench` step times at W=2 from a calibrated profile.

Local compute (the part that at scale is "flops x efficiency"): one step of the unsharded
reference model (forward, backward, foreach AdamW) is traced once for its op count, matmul
flops and bytes touched, and priced with the profile: ``max(flops / matmul rate, bytes /
memcpy rate) + op overhead`` per op. Nothing is timed here. The framework terms are the
simulator's own: layouts from the planner / FSDP2's per-parameter padding, the all-gathers
(forward, and backward for resharded blocks) and reductions priced by the calibrated gloo
alpha-beta lines (FSDP2's ``reduce_scatter_tensor``; ragged_fsdp's all-to-all plus local
sum), the copies from :mod:`.buffers` at memcpy speed, overlap as measured.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .buffers import LIFETIMES
from .comm import alltoall_time, collective_time
from .layout import group_layouts
from .profiles import GPUProfile, load_profile
from .reference import reference_arch

__all__ = ["trace_local", "predict_bench", "compare_with_bench"]

aten = torch.ops.aten
_MM = {aten.mm.default: lambda a, b: 2 * a.shape[0] * a.shape[1] * b.shape[1],
       aten.addmm.default: lambda c, a, b, *r, **k: 2 * a.shape[0] * a.shape[1] * b.shape[1],
       aten.bmm.default: lambda a, b: 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]}


class _Counter(TorchDispatchMode):
    def __init__(self, prof: GPUProfile):
        super().__init__()
        self.prof = prof
        self.ops = 0
        self.flops = 0.0
        self.bytes = 0.0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten.detach.default, aten.view.default, aten._unsafe_view.default, aten.t.default,
                    aten.transpose.int, aten.expand.default, aten.slice.Tensor, aten.select.int,
                    aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default, aten.as_strided.default):
            self.ops += 1
            self.seconds += self.prof.op_overhead
            return out
        flops = 0.0
        f = _MM.get(func)
        if f is not None:
            flops = f(*args)
        elif "scaled_dot_product" in str(func):
            q, k = args[0], args[1]
            B, H, T, D = q.shape
            flops = 4.0 * B * H * T * k.shape[2] * D * (2.5 if "backward" in str(func) else 1.0)
        nbytes = 0
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                nbytes += t.numel() * t.element_size()
        self.ops += 1
        self.flops += flops
        self.bytes += nbytes
        rate = self.prof.fp32_flops or self.prof.flops
        self.seconds += max(flops / rate, nbytes / self.prof.mem_bw) + self.prof.op_overhead
        return out


def trace_local(model, x, y, prof: GPUProfile) -> _Counter:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists in the timed steps
    c = _Counter(prof)
    with c:
        step()
    return c


def predict_bench(prof: GPUProfile, kind: str, world: int = 2) -> dict:
    """Predicted seconds per step for ``local``, ``ragged_fsdp`` and ``fsdp2``."""
    from ..models.workloads import build

    torch.set_num_threads(1)
    model = build(kind, 128)
    arch = reference_arch(model)
    batch, seq = (1, 32) if kind == "dense-wide" else (4, 128)
    g = torch.Generator().manual_seed(1000)
    x = torch.randint(0, 2048, (batch, seq), generator=g)
    y = torch.randint(0, 2048, (batch, seq), generator=g)
    local = trace_local(model, x, y, prof).seconds
    out = {"local": local}
    for variant, fw in (("ragged_fsdp", "ragged"), ("fsdp2", "fsdp2")):
        L = group_layouts(arch.groups, fw, world, itemsize=4)
        life = LIFETIMES[fw]
        comm = copies = 0.0
        for i, grp in enumerate(L):
            gathers = 1 if i == 0 else 2  # the root stays gathered; blocks re-gather in backward
            comm += gathers * collective_time(prof, "all_gather", grp.gathered * 4, world)
            if fw == "ragged":  # gloo: all-to-all of the other ranks' pieces + a local sum
                comm += alltoall_time(prof, (world - 1) * grp.segment * 4, world)
                copies += 3 * grp.segment * 4 / prof.mem_bw
            else:
                comm += collective_time(prof, "reduce_scatter", grp.gathered * 4, world)
            copies += 2 * (life.copy_out(grp, 4) * gathers + life.copy_in(grp, 4)) / prof.mem_bw
        # overlap as measured: what hides is bounded by the local compute
        exposed = comm - prof.overlap * min(comm, local)
        out[variant] = local + exposed + copies
        out[variant + "_parts"] = {"local": local, "comm": comm, "exposed": exposed, "copies": copies}
    return out


def _median_bench(paths) -> dict:
    """Per model: median over launches of each variant's median step, and of the ratios."""
    runs = [json.loads(Path(p).read_text())["report"] for p in paths]
    out = {}
    for kind in runs[0]:
        steps = {v: statistics.median(statistics.median(r[kind]["step_s"][v]) for r in runs)
                 for v in ("ragged_fsdp", "fsdp2", "local")}
        out[kind] = {"step": steps,
                     "ratio": statistics.median(r[kind]["ratio_vs_fsdp2"] for r in runs),
                     "peak_ratio": statistics.median(r[kind]["peak_bytes"]["ragged_fsdp"] / r[kind]["peak_bytes"]["fsdp2"]
                                                     for r in runs)}
    return out


def compare_with_bench(profile_path: str, bench_paths: list[str]) -> list[dict]:
    prof = load_profile(profile_path)
    measured = _median_bench(bench_paths)
    rows = []
    for kind, m in measured.items():
        p = predict_bench(prof, kind)
        row = {"model": kind}
        for v in ("ragged_fsdp", "fsdp2", "local"):
            row[f"{v} measured ms"] = m["step"][v] * 1e3
            row[f"{v} predicted ms"] = p[v] * 1e3
            row[f"{v} error"] = p[v] / m["step"][v] - 1
        row["ratio measured"] = m["ratio"]
        row["ratio predicted"] = p["ragged_fsdp"] / p["fsdp2"]
        row["parts"] = {k: p[k] for k in ("ragged_fsdp_parts", "fsdp2_parts")}
        rows.append(row)
    return rows


if __name__ == "__main__":
    import sys

    prof_path, *bench = sys.argv[1:]
    for r in compare_with_bench(prof_path, bench):
        print(json.dumps(r, default=lambda v: round(v, 4) if isinstance(v, float) else v))
