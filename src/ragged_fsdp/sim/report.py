"""Tables, sweeps and the scaling plot."""

from __future__ import annotations

from .simulate import FRAMEWORKS, Scenario, simulate

__all__ = ["format_table", "sweep", "format_sweep", "plot_sweep", "ASSUMPTIONS"]

GiB = 2**30

ASSUMPTIONS = [
    "parameters, gradients and optimizer states fp32; compute (all-gather) in --dtype (block linears in float8 "
    "with --float8-allgather); reduce-scatter in fp32",
    "one FSDP group per transformer block, the embedding alone, final norm + head together and not resharded "
    "after forward (torchtitan's wrapping); all-gathers prefetched one group ahead; under PP a stage stays "
    "unsharded across its microbatches and reduces after the last",
    "compute per group: each linear's three GEMMs by roofline with per-rank M, N, K (compute roof peak x "
    "efficiency, x the float8 speed-up for block linears; memory roof HBM bandwidth), elementwise work as "
    "counted bytes at HBM bandwidth (divided by the compile speed-up), float8 casts memory-bound, causal flash "
    "attention at the fitted attention rate; constants in sim/fitted.py",
    "collectives: ring bandwidth term over the slowest link (NVLink inside a node, the per-GPU NIC across "
    "nodes) plus ring latency inside a node and tree latency across nodes; overlapped per phase one group ahead",
    "TP: 2 all-gathers + 2 reduce-scatters of the activations per block and pass (per-op SAC reruns the "
    "all-gathers), exposed with their dim-1 copies (vanilla) or each under its own matmul with the fused "
    "reduce-scatter's sum exposed (async); CP: K/V ring under each attention chunk; PP: the schedule's bubble",
    "copy-out / copy-in at memory bandwidth on the compute stream; optimizer memory-bound",
    "activations: the tensors a block keeps for backward under the AC policy (flash attention, no S^2 term; "
    "checked against MemTracker), split by CP and by TP except the sequence-parallel all-gathered norm outputs and "
    "row-parallel partial sums; compile keeps fewer (measured on CPU inductor); loss 12 bytes per logit eager "
    "(MemTracker: 11.7), 16 per local logit under TP's loss_parallel (MemTracker: 15.9), 4 compiled",
    "memory: peak allocated x (1 + the fitted allocator reserve) + a fixed reserve (profile reserved_bytes) for "
    "the CUDA context and NCCL",
    "ragged_fsdp's granularity follows the optimizer: element for adamw and muon (Muon's owners get the "
    "pieces by all-to-all; --granularity matrix keeps matrices whole instead), block:256 for adamw8bit; "
    "other frameworks ignore structure",
    "muon on the other frameworks: torch.optim.Muon on sharded parameters, every rank assembles and "
    "orthogonalises every matrix",
    "fsdp1, deepspeed and megatron are modelled from their documented buffer and collective behaviour "
    "and are unvalidated",
]


def format_table(results, title: str = "") -> str:
    head = ("framework", "status", "mesh", "memory GiB", "fits", "peak at", "padding", "step s", "MFU",
            "tokens/s/GPU", "vs ragged")
    base = next((r for r in results if r.framework == "ragged"), None)
    rows = []
    for r in results:
        rel = f"{r.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu:.2f}x" if base else "-"
        rows.append((r.framework, r.status, r.mesh, f"{r.memory_bytes / GiB:.1f}", "yes" if r.fits else "NO",
                     r.peak_phase, f"{r.padding:.2%}", f"{r.step_s:.3f}", f"{r.mfu:.1%}",
                     f"{r.tokens_per_s_per_gpu:,.0f}", rel))
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(n) for h, n in zip(head, w)))
    lines += ["  ".join(c.rjust(n) for c, n in zip(row, w)) for row in rows]
    return "\n".join(lines)


def gpu_range(spec: str) -> list[int]:
    key, sep, val = spec.partition("=")
    if key != "gpus" or not sep:
        raise ValueError(f"--sweep {spec!r}: expected gpus=LO..HI (powers of two), e.g. gpus=64..16384")
    lo, dots, hi = val.partition("..")
    if not dots or not lo.isdigit() or not hi.isdigit() or int(lo) < 1 or int(hi) < int(lo):
        raise ValueError(f"--sweep {spec!r}: expected gpus=LO..HI with 1 <= LO <= HI")
    out, g = [], int(lo)
    while g <= int(hi):
        out.append(g)
        g *= 2
    return out


def sweep(sc: Scenario, spec: str, frameworks=FRAMEWORKS, mesh_fn=None):
    """Weak scaling (per-GPU batch fixed) and strong scaling (the global batch of the
    smallest size fixed, split over more GPUs) over ``gpus=LO..HI``."""
    from .arch import resolve_model

    arch = resolve_model(sc.model)
    gpus = gpu_range(spec)
    weak, strong = {}, {}
    global_seqs = sc.micro_batch * gpus[0]
    from tqdm import tqdm  # a bar on a terminal only (disable=None): pipes and tests see none

    for g in tqdm(gpus, desc="simulate sweep", unit="size", disable=None):
        mesh = mesh_fn(g) if mesh_fn else type(sc.mesh)(g)
        weak[g] = simulate(Scenario(**{**sc.__dict__, "gpus": g, "mesh": mesh}), frameworks, arch)
        strong[g] = simulate(Scenario(**{**sc.__dict__, "gpus": g, "mesh": mesh,
                                         "micro_batch": global_seqs / g}), frameworks, arch)
    return weak, strong


def format_sweep(weak, strong, frameworks) -> str:
    lines = []
    for title, data, what in (("weak scaling (per-GPU batch fixed): tokens/s/GPU (memory GiB)", weak, "tps"),
                              ("strong scaling (global batch fixed): total tokens/s (memory GiB)", strong, "tot")):
        lines.append(title)
        head = ["GPUs"] + list(frameworks)
        rows = []
        for g, res in data.items():
            by = {r.framework: r for r in res}
            cells = [f"{g:,}"]
            for fw in frameworks:
                r = by[fw]
                v = r.tokens_per_s_per_gpu if what == "tps" else r.tokens_per_s_per_gpu * g
                cells.append(f"{v:,.0f} ({r.memory_bytes / GiB:.0f}{'' if r.fits else '!'})")
            rows.append(cells)
        w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines.append("  ".join(h.rjust(n) for h, n in zip(head, w)))
        lines += ["  ".join(c.rjust(n) for c, n in zip(r, w)) for r in rows]
        lines.append("(! = does not fit in the GPU's memory)")
        lines.append("")
    return "\n".join(lines)


def plot_sweep(weak, strong, frameworks, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for ax, data, ylabel, total in ((axes[0], weak, "tokens/s per GPU (weak scaling)", False),
                                    (axes[1], strong, "total tokens/s (strong scaling)", True)):
        gs = list(data)
        for fw in frameworks:
            ys, fits = [], []
            for g in gs:
                r = next(x for x in data[g] if x.framework == fw)
                ys.append(r.tokens_per_s_per_gpu * (g if total else 1))
                fits.append(r.fits)
            ax.plot(gs, ys, marker="o", label=fw)
            bad = [(g, y) for g, y, f in zip(gs, ys, fits) if not f]
            if bad:
                ax.scatter(*zip(*bad), marker="x", color="red", zorder=5, s=40)
        ax.set_xscale("log", base=2)
        if total:
            ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title + "  (red x: does not fit)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
