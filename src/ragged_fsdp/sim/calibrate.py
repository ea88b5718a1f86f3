"""`simulate --calibrate`: measure this machine with microbenchmarks only and write a profile.

Measured (1 compute thread per rank, as the bench runs): gloo ``all_gather_single``,
``reduce_scatter_tensor``, ``all_to_all_single`` and ``all_reduce`` at W=2 over sizes from
4 KiB to 32 MiB (median of repeats), fp32 matmul throughput, memcpy throughput, the cost of
one dispatched op on a tiny tensor, and how much of a collective hides under a matmul
running at the same time. Nothing here runs a model; :mod:`.bench_check` then predicts the
bench's step times with this profile.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch

__all__ = ["calibrate", "measure_local", "SIZES"]

SIZES = [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeit(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fit_alpha_beta(rows) -> tuple[float, float]:
    """``t = alpha + bytes / beta``: alpha is the median time of the small sizes (<= 64 KiB),
    beta the least-squares bandwidth through the large ones (>= 512 KiB) after alpha. Robust
    to the odd slow small transfer on a shared machine (a plain fit is not)."""
    small = [t for b, t in rows if b <= (64 << 10)] or [rows[0][1]]
    alpha = statistics.median(small)
    big = [(float(b), max(0.0, t - alpha)) for b, t in rows if b >= (512 << 10)] or [(float(b), t) for b, t in rows]
    sxx = sum(x * x for x, _ in big)
    sxy = sum(x * y for x, y in big)
    beta = sxx / sxy if sxy > 0 else float("inf")
    return alpha, beta


def measure_local() -> dict:
    """Matmul flop/s (fp32, one thread), memcpy bytes/s, seconds per tiny op."""
    torch.set_num_threads(1)
    out = {}
    rates = []
    for n in (128, 256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = _timeit(lambda: torch.mm(a, b), 9)
        rates.append(2 * n ** 3 / t)
    out["fp32_flops"] = statistics.median(rates)
    src = torch.randn(4 << 20)  # 16 MiB
    dst = torch.empty_like(src)
    t = _timeit(lambda: dst.copy_(src), 9)
    out["mem_bw"] = src.numel() * 4 * 2 / t  # read + write
    # per-op cost on tiny tensors as a training step sees it: a chain of small ops, forward
    # and backward (autograd's per-node work included), divided by the ops dispatched
    x = torch.randn(8, requires_grad=True)
    n_chain = 300

    def chain():
        h = x
        for _ in range(n_chain):
            h = h * 1.0001 + 0.0001
        h.sum().backward()

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        chain()
    out["op_overhead"] = _timeit(chain, 7) / max(1, _Count.n)
    return out


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    table = {"all_gather": [], "reduce_scatter": [], "all_to_all": [], "all_reduce": []}
    for size in SIZES:
        n = size // 4
        reps = 11 if size <= (2 << 20) else 7
        full = torch.randn(n)
        piece = torch.randn(n // world)

        def sync(fn):
            def run():
                fn()
                dist.barrier()
            return run

        # keyed by the all-gather output / reduce-scatter input / all-to-all input bytes
        table["all_gather"].append([size, _timeit(sync(lambda: ag(full, piece)), reps)])
        table["reduce_scatter"].append(
            [size, _timeit(sync(lambda: dist.reduce_scatter_tensor(piece, full)), reps)])
        a2a_out = torch.empty(n)
        table["all_to_all"].append([size, _timeit(sync(lambda: dist.all_to_all_single(a2a_out, full)), reps)])
        table["all_reduce"].append([size, _timeit(sync(lambda: dist.all_reduce(full)), reps)])
    # a barrier costs something too: subtract the median barrier time from each entry
    bar = _timeit(lambda: dist.barrier(), 15)
    for op in table:
        table[op] = [[b, max(1e-6, t - bar)] for b, t in table[op]]
    # overlap: a matmul loop alone, an all-gather alone, and both at once
    a = torch.randn(256, 256)
    big = torch.randn((8 << 20) // 4)
    part = torch.randn(big.numel() // world)

    def mm_loop():
        for _ in range(20):
            torch.mm(a, a)

    t_mm = _timeit(mm_loop, 5)
    t_ag = _timeit(lambda: ag(big, part), 5)

    def both():
        w = ag(big, part, async_op=True)
        mm_loop()
        w.wait()

    t_both = _timeit(both, 5)
    hidden = max(0.0, t_mm + t_ag - t_both)
    overlap = min(1.0, hidden / max(1e-9, min(t_mm, t_ag)))
    local = measure_local()
    if rank == 0:
        queue.put({"collectives": table, "overlap": overlap, "barrier_s": bar, **local})
    dist.barrier()
    dist.destroy_process_group()


def calibrate(path: str | Path = "out/sim/cpu_profile.json", world: int = 2) -> dict:
    import torch.multiprocessing as mp

    from .profiles import GPUProfile

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = queue.get(timeout=900)
    for p in procs:
        p.join()
    for op, rows in got["collectives"].items():
        got.setdefault("alpha_beta", {})[op] = fit_alpha_beta(rows)
    prof = GPUProfile(
        name="cpu-gloo", hbm_bytes=64e9, flops=got["fp32_flops"], mem_bw=got["mem_bw"],
        nvlink_bw=1e9, net_bw=1e9, gpus_per_node=world, efficiency=1.0, overlap=got["overlap"],
        reserved_bytes=0.0, op_overhead=got["op_overhead"], collectives=got["collectives"],
        calibrated_world=world, fp32_flops=got["fp32_flops"], alpha_beta=got["alpha_beta"])
    data = prof.to_json()
    data["measured_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data["load_average"] = os.getloadavg()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))
    print(f"matmul {got['fp32_flops'] / 1e9:.1f} GFLOP/s fp32 (1 thread), memcpy {got['mem_bw'] / 1e9:.2f} GB/s, "
          f"op overhead {got['op_overhead'] * 1e6:.1f} us, overlap {got['overlap']:.2f}, load {os.getloadavg()[0]:.1f}")
    for op, rows in got["collectives"].items():
        a, bw = got["alpha_beta"][op]
        print(f"  {op:15s} alpha {a * 1e3:.3f} ms, beta {bw / 1e9:.2f} GB/s;  "
              + "  ".join(f"{b >> 10}KiB:{t * 1e3:.2f}ms" for b, t in rows))
    print(f"wrote {path}")
    return data
