"""Calibrate a profile on the device at hand in about a minute: GEMM efficiency by shape,
flash attention's rate, memory bandwidth and the host's cost per dispatched op; writes a
profile JSON that ``simulate --gpu PATH`` loads (``benchmarks/gpu_calibrate.py`` runs it).

What is measured and how: each GEMM of :data:`GEMM_SHAPES` (Llama 3 8B / 70B projection
sizes at 1k-16k tokens) in bf16, median of CUDA-event-timed repeats after a warm-up;
``efficiency`` is the median over the shapes whose every dim is >= 4096 of achieved / peak,
where peak is the data sheet's dense bf16 rate of the matched built-in profile (or
``--peak-tflops``). Attention: ``scaled_dot_product_attention``, causal, 32 heads of 128,
forward and backward, at 2k and 8k tokens; reported as its rate over the large-GEMM rate
(the simulator's ``ATTENTION_RATE`` is fitted on published runs and is not replaced).
Memory bandwidth: a 1 GiB device copy (read + write). Host overhead: CPU seconds per op of
a chain of tiny ops (dispatch, no kernel wait). One device cannot measure NVLink or the
network: those and the GPUs per node come from the matched built-in profile's data sheet
(or a 1-GPU placeholder, said so in the file).

On a CPU (``--device cpu``, the dry run the tests do) the same code runs in fp32 with small
shapes, and the "peak" is the best rate measured, so ``efficiency`` is relative to that.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from .calibrate import _timeit
from .profiles import PROFILES, UNCALIBRATED, GPUProfile, validate_profile

__all__ = ["GEMM_SHAPES", "match_profile", "measure", "calibrate_device"]

# (M tokens, N out, K in): Llama 3 8B's q/o (4096 x 4096), gate/up (14336 x 4096), down
# (4096 x 14336), k/v (1024 x 4096); Llama 3 70B's gate/up (28672 x 8192)
GEMM_SHAPES = [(m, n, k) for m in (1024, 4096, 16384)
               for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (28672, 8192))]
CPU_SHAPES = [(64, 128, 128), (256, 256, 256), (128, 512, 256)]
ATTN_SEQS = (2048, 8192)

# device-name fragments -> built-in profile (longest first: "H100 NVL" is not matched to SXM)
_NAMES = (("gb200", "gb200"), ("b200", "b200-1000w"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
          ("mi325", "mi325x"), ("mi300", "mi300x"))


def match_profile(device_name: str) -> GPUProfile | None:
    low = device_name.lower()
    for frag, key in _NAMES:
        if frag in low:
            return PROFILES.get(key) or UNCALIBRATED.get(key)
    return None


def _timer(dev: str):
    if dev == "cuda":
        def run(fn, reps: int) -> float:
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            return statistics.median(ts)
    else:
        run = _timeit  # the CPU fit's own timer: the host clock around each call
    return run


def _host_overhead(dev: str, n: int = 2000) -> float:
    """CPU seconds per dispatched op (a chain of tiny in-place adds, not waited on)."""
    x = torch.zeros(8, device=dev)
    for _ in range(50):
        x.add_(1.0)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    dt = time.perf_counter() - t0
    if dev == "cuda":
        torch.cuda.synchronize()
    return dt / n


def measure(dev: str = "cuda", quick: bool = False) -> dict:
    """The raw measurements (no profile): GEMM table, attention, memory copy, host overhead."""
    timeit = _timer(dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    reps = 3 if quick else 10
    shapes = CPU_SHAPES if dev == "cpu" else GEMM_SHAPES
    gemm = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype)
        t = timeit(lambda: a @ w.t(), reps)
        gemm.append({"m": m, "n": n, "k": k, "seconds": t, "flops_per_s": 2.0 * m * n * k / t})
        del a, w
    attn = []
    heads, hd = (32, 128) if dev == "cuda" else (2, 32)
    for seq in (ATTN_SEQS if dev == "cuda" else (128,)):
        batch = max(1, 16384 // seq) if dev == "cuda" else 1
        q, k_, v = (torch.randn(batch, heads, seq, hd, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            o = torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True)
            o.sum().backward()

        t = timeit(step, reps)
        fwd = 2 * 2 * batch * heads * seq * seq * hd / 2  # QK^T and PV, causal half
        attn.append({"seq": seq, "batch": batch, "seconds": t, "flops_per_s": 3.5 * fwd / t})
        del q, k_, v
    nbytes = (1 << 30) if dev == "cuda" and not quick else (16 << 20)
    src = torch.empty(nbytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), reps)
    del src, dst
    return {"gemm": gemm, "attention": attn, "mem_bw": 2 * nbytes / t, "host_op_overhead_s": _host_overhead(dev)}


def calibrate_device(path: str | Path, dev: str = "cuda", peak_tflops: float | None = None,
                     quick: bool = False) -> dict:
    """Measure, build a profile, write it as JSON (extra measured tables alongside the
    profile's fields; ``load_profile`` reads the fields and ignores the rest)."""
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    raw = measure(dev, quick)
    base = match_profile(name) if dev == "cuda" else None
    best = max(g["flops_per_s"] for g in raw["gemm"])
    if peak_tflops:
        peak, peak_src = peak_tflops * 1e12, "--peak-tflops"
    elif base is not None:
        peak, peak_src = base.flops, f"data sheet of built-in profile {base.name!r}"
    else:
        peak, peak_src = best, "the best rate measured here (no data sheet matched)"
    big = [g["flops_per_s"] for g in raw["gemm"] if min(g["m"], g["n"], g["k"]) >= 4096] or [best]
    eff = min(1.0, statistics.median(big) / peak)
    hbm = torch.cuda.get_device_properties(0).total_memory if dev == "cuda" else 64e9
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    if base is not None:
        prof = replace(base, name=f"measured-{slug}", hbm_bytes=float(hbm), flops=peak, mem_bw=raw["mem_bw"],
                       efficiency=eff)
        links = f"nvlink_bw, net_bw, gpus_per_node, latencies: data sheet of {base.name!r} (not measurable on one device)"
    else:
        prof = GPUProfile(f"measured-{slug}", float(hbm), peak, raw["mem_bw"], 1e9, 1e9, 1, efficiency=eff)
        links = "nvlink_bw, net_bw: 1 GB/s placeholders, gpus_per_node 1 (one device measures no links)"
    validate_profile(prof, f"calibration of {name}")
    large_rate = statistics.median(big)
    doc = {**prof.to_json(),
           "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": name, "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1),
           "sources": {"efficiency": f"median achieved / peak over GEMMs with every dim >= 4096 (gemm table); peak: "
                                     f"{peak_src}",
                       "mem_bw": "1 GiB device copy, read + write" if dev == "cuda" and not quick else
                                 "16 MiB copy, read + write",
                       "hbm_bytes": "device properties" if dev == "cuda" else "placeholder", "links": links},
           "gemm": raw["gemm"], "attention": raw["attention"],
           "attention_over_gemm": [a["flops_per_s"] / large_rate for a in raw["attention"]],
           "host_op_overhead_s": raw["host_op_overhead_s"]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc
