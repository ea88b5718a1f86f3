"""ragged_fsdp's Muon beside torchtitan's DistMuon and torch.optim.Muon on FSDP2 (issue 46).

Not part of the installed package: it imports torchtitan (0.3.0's
``torchtitan.distributed.flex_shard.build_dist_muon``). Run from the repository root:

    PYTHONPATH=src python benchmarks/muon_peers.py --world 2,4 --out docs/data/muon_peers.json

Model: the bench's ``dense`` Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, FFN 704,
vocabulary 2048): 28 Muon matrices, 2.95M elements; AdamW for the embedding, the head and
the norms (``muon_param_groups``). Every implementation starts from the same weights and
gets the same gradients (full gradients drawn per step from one seed, laid out like each
framework's parameters), W gloo ranks on CPU, one thread each.

Per implementation:

* **exact**: after 5 steps (Muon lr 0.02, AdamW lr 3e-3), the full parameters against a
  single process running ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same tensors:
  "bitwise" or the largest absolute difference and that over the largest update;
* **time**: rounds alternate the order of the implementations; per round, each one's step
  time (wall ``perf_counter`` and this process's CPU ``process_time``) over the first row's
  (ragged_fsdp, matrices whole, bounded); the median of those ratios over rounds;
* **bytes**: what this rank sends in one step (``ragged_fsdp.bench.comm_bytes.CommCounter``:
  every torch.distributed collective wrapped), mean over ranks;
* **memory**: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, which counts
  tensor storages through a dispatch mode: torch's CPU allocator has no peak counter and
  tracemalloc does not see tensor memory) around one step: *peak* = the largest live tensor
  bytes during the step, *transient* = peak minus the live bytes after the step. Rank means,
  and the spread (max - min) of the per-rank peaks.

DistMuon insists on CUDA (``_validate_parameter_storage``); on CPU the check is bypassed and
its streams are torch.cpu's no-op streams, which is what makes it run on gloo. DeepSpeed is
not installed in this environment, so its row is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MUON_LR, ADAMW_LR, STEPS = 0.02, 3e-3, 5
TIME_STEPS = int(os.environ.get("MUON_PEERS_TIME_STEPS", "3"))  # timed steps per row before the rounds
IMPLS = ("ragged whole, bounded", "ragged whole, one wave", "FSDP2 + DistMuon", "ragged no policy, bounded",
         "ragged no policy, one wave", "FSDP2 + torch Muon")


def _model():
    from ragged_fsdp.models.workloads import build

    return build("dense", 64)


def _grads(model, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in model.named_parameters()}


def _groups(model):
    from ragged_fsdp.optim import muon_param_groups

    return muon_param_groups(model)


def _reference(steps: int):
    model = _model()
    groups = _groups(model)
    muon = torch.optim.Muon([p for _, p in groups[0]["params"]], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for _, p in groups[1]["params"]], lr=ADAMW_LR)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for s in range(steps):
        gs = _grads(model, s)
        for n, p in model.named_parameters():
            p.grad = gs[n].clone()
        muon.step()
        adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, before


# -- the implementations ---------------------------------------------------------------

class Impl:
    def __init__(self, name, model, opts, set_grads, full):
        self.name, self.model, self.opts, self._set, self._full = name, model, opts, set_grads, full

    def set_grads(self, step):
        self._set(self.model, _grads(self.model, step))

    def step(self):
        for o in self.opts:
            o.step()

    def full(self) -> dict[str, torch.Tensor]:
        return {n: self._full(p).detach() for n, p in self.model.named_parameters()}


def _blocks(model):
    return list(model.layers)


def _ragged(name, mesh, policy: bool, wave_bytes):
    import ragged_fsdp as rf
    from ragged_fsdp.optim import Muon

    model = _model()
    kw = {"granularity_fn": Muon.granularity} if policy else {}
    for b in _blocks(model):
        rf.fully_shard(b, mesh=mesh, **kw)
    rf.fully_shard(model, mesh=mesh, **kw)
    groups = _groups(model)
    groups[0]["lr"], groups[1]["lr"] = MUON_LR, ADAMW_LR
    extra = {} if wave_bytes == "default" else {"wave_bytes": wave_bytes}
    try:
        opt = Muon(groups[:1], **extra)
    except TypeError:  # an older ragged_fsdp (before the bounded step): one wave only
        if wave_bytes not in (None, "default"):
            raise
        opt = Muon(groups[:1])
    # the AdamW groups in an optimizer of their own (the same math as inside one Muon), so
    # the Muon part's memory is measured alone, as for the peers
    opts = [opt, Muon(groups[1:])]

    def set_grads(m, gs):
        for n, p in m.named_parameters():
            p.grad = rf.distribute_tensor(gs[n], mesh, list(p.placements), src_data_rank=None)

    return Impl(name, model, opts, set_grads, lambda p: p.full_tensor())


def _fsdp2(mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for b in _blocks(model):
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _dtensor_grads(mesh):
    from torch.distributed.tensor import distribute_tensor

    def set_grads(m, gs):
        for n, p in m.named_parameters():
            p.grad = distribute_tensor(gs[n], mesh, list(p.placements), src_data_rank=None)

    return set_grads


def _fsdp2_torch_muon(mesh):
    model = _fsdp2(mesh)
    groups = _groups(model)
    opts = [torch.optim.Muon([p for _, p in groups[0]["params"]], lr=MUON_LR),
            torch.optim.AdamW([p for _, p in groups[1]["params"]], lr=ADAMW_LR)]
    return Impl("FSDP2 + torch Muon", model, opts, _dtensor_grads(mesh), lambda p: p.full_tensor())


def _cpu_stream_shim():
    """Let torchtitan's runtime build its transfer stream on CPU (benchmark-only shim).

    It calls ``torch.get_device_module(device).Stream(device=device, priority=0)``; torch.cpu's
    Stream takes no arguments (CPU streams are no-ops: work runs in program order). This
    swaps in a subclass that accepts and ignores them, and makes ``record_stream`` a no-op
    on CPU tensors, so DistMuon's step runs on gloo.
    """
    if getattr(torch.cpu.Stream, "_ragged_bench_shim", False):
        return

    class _Stream(torch.cpu.Stream):
        _ragged_bench_shim = True

        def __new__(cls, device=None, priority=0, **kwargs):
            return super().__new__(cls)

        def __init__(self, device=None, priority=0, **kwargs):
            super().__init__()

    torch.cpu.Stream = _Stream
    # it also calls Tensor.record_stream, which has no CPU kernel; CPU memory is freed in
    # program order, so recording is a no-op there
    record = torch.Tensor.record_stream

    def _record_stream(t, stream):
        return None if t.device.type == "cpu" else record(t, stream)

    torch.Tensor.record_stream = _record_stream


def _fsdp2_dist_muon(mesh):
    from torchtitan.distributed.flex_shard import dist_muon
    from torchtitan.distributed.flex_shard.optimizer_reshard import BucketConfig, ComputeLayout, Owned

    # DistMuon refuses non-CUDA parameters; its runtime runs on torch.cpu's streams
    _cpu_stream_shim()
    dist_muon.DistMuon._validate_parameter_storage = lambda self: next(
        p.to_local().device for g in self.param_groups for p in g["params"])
    model = _fsdp2(mesh)
    groups = _groups(model)
    names = [n for n, _ in groups[0]["params"]]
    muon = dist_muon.build_dist_muon(
        [{"params": [p for _, p in groups[0]["params"]], "param_names": names}],
        compute_sharding_by_fqn={n: ComputeLayout({"dp": Owned()}) for n in names},
        bucket_configs=[BucketConfig(("*",))], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for _, p in groups[1]["params"]], lr=ADAMW_LR)
    return Impl("FSDP2 + DistMuon", model, [muon, adamw], _dtensor_grads(mesh), lambda p: p.full_tensor())


def _build(name, mesh):
    if name.startswith("ragged"):
        return _ragged(name, mesh, "whole" in name, None if "one wave" in name else "default")
    if name == "FSDP2 + DistMuon":
        return _fsdp2_dist_muon(mesh)
    return _fsdp2_torch_muon(mesh)


# -- measurements ----------------------------------------------------------------------

def _memory(impl, step) -> tuple[int, int]:
    """(peak, transient) tensor bytes of ``step()`` by MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(impl.model, *impl.opts)
    with mt:
        step()
        peak = sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("peak").values())
        after = sum(d.get("Total", 0) for d in mt.get_tracker_snapshot("current").values())
    return int(peak), int(peak - after)


def _times(impl, n: int, first: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of ``n`` steps (ranks start each together)."""
    wall, cpu = [], []
    for i in range(n):
        impl.set_grads(first + i)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        impl.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _bytes(impl) -> int:
    from ragged_fsdp.bench.comm_bytes import CommCounter

    with CommCounter() as c:
        impl.step()
    return int(sum(c.by_kind().values()))


def _worker(rank, world, port, rounds, names, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    want, before = _reference(STEPS)
    scale = max(float((want[n] - before[n]).abs().max()) for n in want)
    out = {}
    impls = []
    for name in names:
        try:
            impl = _build(name, mesh)
            for s in range(STEPS):
                impl.set_grads(s)
                impl.step()
            got = impl.full()
            diff = max(float((got[n] - want[n]).abs().max()) for n in want)
            bitwise = all(torch.equal(got[n], want[n]) for n in want)
            impl.set_grads(STEPS)
            sent = _bytes(impl)
            impl.set_grads(STEPS)
            peak, transient = _memory(impl, impl.step)
            impl.set_grads(STEPS)
            muon_peak, muon_transient = _memory(impl, impl.opts[0].step)
            wall, cpu = _times(impl, TIME_STEPS, STEPS + 1)
            out[name] = {"bitwise": bitwise, "max_abs_diff": diff, "diff_over_update": diff / scale,
                         "bytes_sent": sent, "peak": peak, "transient": transient, "muon_peak": muon_peak,
                         "muon_transient": muon_transient, "wall_s": wall, "cpu_s": cpu}
            if hasattr(impl.opts[0], "last_step_stats") and "waves" in impl.opts[0].last_step_stats:
                st = impl.opts[0].last_step_stats
                out[name]["waves"] = st["waves"]
                out[name]["estimate_step_bytes_per_rank"] = st["step_bytes_per_rank"]
            impls.append(impl)
        except Exception as e:  # recorded verbatim; the other rows still run
            out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        gathered = [None] * world
        dist.all_gather_object(gathered, out[name])
        if rank == 0:
            print("ROW " + json.dumps({"world": world, "name": name, "per_rank": gathered}), file=sys.stderr, flush=True)
    ratios = {i.name: ([], []) for i in impls}
    for r in range(rounds if impls else 0):
        order = impls[r % len(impls):] + impls[:r % len(impls)]
        wall, cpu = {}, {}
        for impl in order:
            impl.set_grads(STEPS + 1 + r)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            impl.step()
            wall[impl.name], cpu[impl.name] = time.perf_counter() - t0, time.process_time() - c0
        base = impls[0].name
        for n in wall:
            ratios[n][0].append(wall[n] / wall[base])
            ratios[n][1].append(cpu[n] / cpu[base])
        if rank == 0:
            print(f"W={world} round {r}: {wall}", file=sys.stderr, flush=True)
    for n, (w, c) in ratios.items():
        if w:
            out[n]["time_ratio_wall"] = statistics.median(w)
            out[n]["time_ratio_cpu"] = statistics.median(c)
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, rounds: int, names) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, rounds, names, q)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = q.get()
    for p in procs:
        p.join()
    return _aggregate(names, {name: [pr[name] for pr in per_rank] for name in names})


def _aggregate(names, by_name) -> dict:
    rows = {}
    for name in names:
        rs = by_name[name]
        if "error" in rs[0]:
            rows[name] = rs[0]
            continue
        peaks = [r["peak"] for r in rs]
        rows[name] = {
            "bitwise": all(r["bitwise"] for r in rs), "max_abs_diff": rs[0]["max_abs_diff"],
            "diff_over_update": rs[0]["diff_over_update"],
            "time_ratio_wall": rs[0].get("time_ratio_wall"), "time_ratio_cpu": rs[0].get("time_ratio_cpu"),
            "wall_s_max": max(r["wall_s"] for r in rs), "cpu_s_max": max(r["cpu_s"] for r in rs),
            "muon_transient_mib_mean": statistics.mean(r["muon_transient"] for r in rs) / 2**20,
            "muon_transient_mib_max": max(r["muon_transient"] for r in rs) / 2**20,
            "bytes_sent_mean": statistics.mean(r["bytes_sent"] for r in rs),
            "peak_mib_mean": statistics.mean(peaks) / 2**20,
            "transient_mib_mean": statistics.mean(r["transient"] for r in rs) / 2**20,
            "transient_mib_max": max(r["transient"] for r in rs) / 2**20,
            "peak_mib_per_rank": [p / 2**20 for p in peaks],
            "peak_spread_mib": (max(peaks) - min(peaks)) / 2**20,
        }
        if "waves" in rs[0]:
            rows[name]["waves"] = rs[0]["waves"]
            rows[name]["estimate_step_mib_per_rank"] = [b / 2**20 for b in rs[0]["estimate_step_bytes_per_rank"]]
    return rows


def from_log(path: str) -> dict:
    """The rows a (possibly unfinished) run printed as ``ROW`` lines on stderr. Rows that
    finished before the alternating rounds have no round ratio; their time ratio is then the
    median of their own timed steps (slowest rank) over the first row's, marked as such."""
    worlds: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("ROW "):
            r = json.loads(line[4:])
            worlds.setdefault(str(r["world"]), {})[r["name"]] = r["per_rank"]
    out = {}
    for w, by_name in worlds.items():
        rows = _aggregate(list(by_name), by_name)
        base = next(iter(rows.values()))
        for r in rows.values():
            if "error" not in r and r.get("time_ratio_wall") is None and "error" not in base:
                r["time_ratio_wall"] = r["wall_s_max"] / base["wall_s_max"]
                r["time_ratio_cpu"] = r["cpu_s_max"] / base["cpu_s_max"]
                r["time_ratio_from"] = "timed steps of each row, not alternating rounds"
        out[w] = rows
    return out


def render(report: dict) -> str:
    lines = ["| W | implementation | exact after 5 steps | step time (wall / CPU, x ragged whole bounded) "
             "| bytes sent per rank | peak MiB, rank mean (step transient; Muon-step transient) | spread of per-rank peaks MiB |",
             "|---|---|---|---|---|---|---|"]
    for w, rows in report["worlds"].items():
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {w} | {name} | error: {r['error'][:80]} | | | | |")
                continue
            exact = "bitwise" if r["bitwise"] else f"{r['max_abs_diff']:.1e} off ({100 * r['diff_over_update']:.1f}% of the update)"
            b = r["bytes_sent_mean"]
            bs = "0" if b == 0 else (f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} KB")
            t = ("-" if r.get("time_ratio_wall") is None
                 else f"{r['time_ratio_wall']:.2f} / {r['time_ratio_cpu']:.2f}")
            lines.append(f"| {w} | {name} | {exact} | {t} | {bs} "
                         f"| {r['peak_mib_mean']:.1f} ({r['transient_mib_mean']:.2f}; {r['muon_transient_mib_mean']:.2f}) "
                         f"| {r['peak_spread_mib']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="2,4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--impls", default=";".join(IMPLS), help="semicolon-separated names")
    ap.add_argument("--out", default="out/muon_peers.json")
    ap.add_argument("--from-log", help="render the ROW lines of an unfinished run's stderr instead of running")
    a = ap.parse_args(argv)
    if a.from_log:
        report = {"command": "PYTHONPATH=src python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
                  "torch": torch.__version__, "partial": True, "worlds": from_log(a.from_log)}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(render(report))
        return 0
    names = [n.strip() for n in a.impls.split(";") if n.strip()]
    report = {"command": "PYTHONPATH=src python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
              "torch": torch.__version__, "worlds": {}}
    try:
        import torchtitan

        report["torchtitan"] = getattr(torchtitan, "__version__", "?")
    except ImportError:
        names = [n for n in names if n != "FSDP2 + DistMuon"]
    try:
        import deepspeed  # noqa: F401
        report["deepspeed"] = "installed, not run by this script"
    except ImportError:
        report["deepspeed"] = "not installed"
    for w in [int(x) for x in a.world.split(",")]:
        report["worlds"][str(w)] = run(w, a.rounds, names)
        print(render({"worlds": {str(w): report["worlds"][str(w)]}}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
