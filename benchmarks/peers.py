"""ragged_fsdp and torch's FSDP2 beside the peers published results compare with: DeepSpeed
ZeRO-3 and Megatron-FSDP, on the workloads of ``python -m ragged_fsdp bench`` (engine.build),
every framework in the same W-rank gloo launch on CPU.

Per (world size, workload, framework): the mean over ranks of each step's loss for a few AdamW
steps against a single process training the same model on all ranks' batches (same seed,
same data), the step time as a ratio to FSDP2 (rounds rotate the order of the frameworks; the
median over rounds of the per-round ratio), the peak of one step by torch's MemTracker, the
bytes of every tensor storage the framework keeps alive between steps (a garbage-collector
scan, so it sees tensors whatever holds them), and the bytes rank 0 sends in one step
(``comm_bytes``). A peer that is not installed is skipped with the pip line that installs it;
one that is installed but raises is recorded with its error, verbatim, and its version.

    python benchmarks/peers.py [--world 2,4] [--models dense,moe] [--out docs/data/peers.json]
    python benchmarks/peers.py --quick --md ''      # tiny models, a smoke test
    python benchmarks/peers.py --render docs/data/peers.json   # only rewrite docs/peers.md

The peers install into a venv of their own (``deepspeed`` and ``megatron-fsdp`` each bring
dependencies the library does not need): ``pip install torch==2.13.0`` first, then
``pip install torch==2.13.0 deepspeed megatron-fsdp`` and ``pip install torch==2.13.0 -e .``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from peers_frameworks import FRAMEWORKS, PEERS, availability, install_hint, reference_losses, setup
from peers_render import render_page, render_table

RTOL = 1e-4
WORKLOADS = ("dense", "moe", "dense-1024")


@dataclass
class PeersConfig:
    worlds: tuple[int, ...] = (2,)
    models: tuple[str, ...] = ("dense", "moe")
    frameworks: tuple[str, ...] = FRAMEWORKS
    check_steps: int = 5
    rounds: int = 5
    steps: int = 2
    quick: bool = False
    timeout_s: int = 180
    rtol: float = RTOL


def batch(kind: str, cfg: PeersConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the same on every framework, rebuilt by the reference."""
    from ragged_fsdp.bench.engine import BenchConfig, batch_shape

    b, s = batch_shape(kind, BenchConfig(quick=cfg.quick))
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 1)
    return torch.randint(0, 2048, (b, s), generator=g), torch.randint(0, 2048, (b, s), generator=g)


def _storages() -> dict[int, int]:
    """data pointer -> bytes of every live tensor storage in this process (each once)."""
    gc.collect()
    out = {}
    with warnings.catch_warnings():  # isinstance on some module-level objects warns of deprecations
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                    continue
                st = obj.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except Exception:  # wrapper subclasses (DTensor) and freed storages: their local tensor is seen
                continue
            if ptr:
                out[ptr] = max(out.get(ptr, 0), nbytes)
    return out


def compare(losses: list[float], ref: list[float], rtol: float) -> dict:
    """Largest relative error of a framework's per-step losses against the single process's,
    and whether every step is within ``rtol``."""
    if len(losses) != len(ref) or not ref:
        raise ValueError(f"peers: {len(losses)} losses against {len(ref)} reference steps: they must match")
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    return {"max_rel_err": max(rel), "agrees": all(r <= rtol for r in rel)}


def _peak_bytes(runner, x, y) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(*(o for o in (runner.model, runner.optimizer) if o is not None))
    with mt:
        runner.step(x, y)
    return sum(int(d.get("Total", 0)) for d in mt.get_tracker_snapshot("peak").values())


def _comm_bytes(runner, x, y) -> dict[str, int]:
    from ragged_fsdp.bench.comm_bytes import CommCounter

    with CommCounter() as c:
        runner.step(x, y)
    return c.by_kind()


def _short_error(exc: BaseException) -> str:
    """The last frames of the traceback and the message, paths shortened to the package."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines[-4:]) if len(lines) > 4 else "".join(lines)
    for p in sorted({os.path.dirname(torch.__path__[0])} | set(sys.path), key=len, reverse=True):
        if p and len(p) > 1:
            text = text.replace(p + os.sep, "")
    return text.strip("\n").rstrip()


def _rank_main(rank: int, world: int, cfg: PeersConfig, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.models.workloads import build

    # what torchrun sets (DeepSpeed asserts LOCAL_RANK is there); one host, so local = global
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for kind in cfg.models:
        data = [batch(kind, cfg, rank, s) for s in range(cfg.check_steps)]
        ref = None
        if rank == 0:
            whole = [tuple(torch.cat([batch(kind, cfg, r, s)[i] for r in range(world)]) for i in (0, 1))
                     for s in range(cfg.check_steps)]
            ref = reference_losses(build(kind, 128, cfg.quick), whole)
        runners = {}
        for fw in cfg.frameworks:
            ok, version = availability(fw)
            row = {"world": world, "workload": kind, "framework": fw, "version": version}
            rows.append(row)
            if not ok:
                row.update(status="skipped", reason=install_hint(fw))
                continue
            before = _storages()
            err = None
            try:
                runner = setup(fw, build(kind, 128, cfg.quick), mesh, data[0][0].shape[0])
                losses = []
                for x, y in data:
                    loss = runner.step(x, y).clone()
                    dist.all_reduce(loss)
                    losses.append(float(loss) / world)
                after = _storages()
                live = sum(b for p, b in after.items() if p not in before)
            except Exception as e:  # a peer that cannot run here: record why, verbatim
                err = f"{type(e).__module__}.{type(e).__qualname__} ({fw} {version}):\n{_short_error(e)}"
            errs: list = [None] * world
            dist.all_gather_object(errs, err)
            first = next((e for e in errs if e), None)
            if first is not None:
                row.update(status="error", reason=first)
                if rank == 0:
                    print(f"peers: W={world} {kind} {fw}: error (recorded)", flush=True)
                continue
            x, y = data[0]
            try:
                row["peak_bytes"] = _peak_bytes(runner, x, y)
            except Exception as e:
                row["peak_bytes"] = None
                row["peak_error"] = _short_error(e)
            comm = _comm_bytes(runner, x, y)
            row.update(status="ok", loss=losses, live_bytes=live, comm_by_kind=comm, comm_bytes=sum(comm.values()))
            if rank == 0:
                row.update(loss_ref=ref, **compare(losses, ref, cfg.rtol))
            runners[fw] = runner
            if rank == 0:
                print(f"peers: W={world} {kind} {fw}: {row['status']}", flush=True)
        names = list(runners)
        times = {fw: [] for fw in names}
        x, y = data[0]
        for r in range(cfg.rounds):
            k = r % max(1, len(names))
            for fw in names[k:] + names[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg.steps):
                    runners[fw].step(x, y)
                dist.barrier()
                times[fw].append((time.perf_counter() - t0) / cfg.steps)
        for row in rows:
            fw = row["framework"]
            if row["workload"] == kind and fw in times:
                row["step_s"] = times[fw]
                row["step_ms"] = statistics.median(times[fw]) * 1e3
                if "fsdp2" in times:
                    row["vs_fsdp2"] = statistics.median(a / b for a, b in zip(times[fw], times["fsdp2"]))
        del runners
    if rank == 0:
        queue.put(("ok", rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank, world, cfg, port, queue) -> None:
    try:
        _rank_main(rank, world, cfg, port, queue)
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cfg: PeersConfig) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, cfg, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    status, rank, rows = queue.get()
    if status != "ok":
        for p in procs:
            p.kill()
        raise RuntimeError(f"peers bench rank {rank} failed (W={world}):\n{rows}")
    for p in procs:
        p.join()
    return rows


def machine() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "gpu": gpu, "platform": f"{platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}"}


def metadata(cfg: PeersConfig, command: str, conditions: str) -> dict:
    versions = {"torch": torch.__version__}
    for fw in ("ragged_fsdp",) + tuple(PEERS):
        versions[fw] = availability(fw)[1]
    return {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "versions": versions, "machine": machine(), "conditions": conditions, "worlds": list(cfg.worlds),
            "models": list(cfg.models), "frameworks": list(cfg.frameworks), "check_steps": cfg.check_steps,
            "rounds": cfg.rounds, "steps": cfg.steps, "quick": cfg.quick, "rtol": cfg.rtol, "lr": 1e-4}


INTRO = """# ragged_fsdp beside DeepSpeed ZeRO-3 and Megatron-FSDP

The frameworks the published FSDP results compare with, on the workloads of
`python -m ragged_fsdp bench` (a small dense LLaMA and a MoE with fused experts, one FSDP unit
per block), each in the same gloo launch on CPU. This page is rendered from
[`data/peers.json`](data/peers.json) by `python benchmarks/peers.py --render
docs/data/peers.json`; re-running the bench rewrites both.

The peers are not dependencies of ragged_fsdp. To reproduce, install them into a separate
virtual environment, torch pinned so pip keeps the CPU build:

```bash
python3 -m venv .venv-peers
.venv-peers/bin/pip install torch==2.13.0
.venv-peers/bin/pip install torch==2.13.0 deepspeed megatron-fsdp
.venv-peers/bin/pip install torch==2.13.0 -e .
.venv-peers/bin/python benchmarks/peers.py --world 2 --models dense,moe
```"""


NOTES = """## How each framework is set up

- **ragged_fsdp** and **torch FSDP2**: `fully_shard` on each transformer block, then on the
  root; ragged_fsdp steps with `ragged_fsdp.optim.AdamW`, FSDP2 with
  `torch.optim.AdamW(foreach=True)` (the same set-up as `python -m ragged_fsdp bench`).
- **DeepSpeed ZeRO-3**: `deepspeed.initialize` with `zero_optimization.stage = 3`, torch's
  `AdamW` as the client optimizer (no compiled DeepSpeed ops), `DS_ACCELERATOR=cpu` (its CPU
  accelerator over the gloo process group already started), then `engine(x)`,
  `engine.backward(loss)`, `engine.step()`. The buckets are sized to the model as Hugging
  Face's `auto` ZeRO-3 values do (`reduce_bucket_size` = hidden², `stage3_prefetch_bucket_size`
  = 0.9 hidden², `stage3_param_persistence_threshold` = 10 hidden): DeepSpeed's default reduce
  bucket, 5e8 elements, is 1,907 MiB in fp32 per rank, larger than these models. Every other
  ZeRO-3 setting is DeepSpeed's default, among them `stage3_max_reuse_distance` = 1e9, under
  which a parameter gathered in forward is kept for backward on models this size: its
  all-gather bytes then equal its reduce-scatter bytes, where FSDP2 and ragged_fsdp gather the
  blocks again in backward. Measured once at W = 2 on the `--quick` dense model: setting it to
  0 raises DeepSpeed's all-gather bytes per step from 299,328 to 448,832 (FSDP2: 336,448). The
  launcher sets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`
  as `torchrun` would: DeepSpeed asserts that `LOCAL_RANK` is set.
- **Megatron-FSDP**: `megatron_fsdp.fully_shard(model, optimizer, device_mesh=...,
  dp_shard_dim="fsdp", tp_dim="tp", fsdp_unit_modules=[block], zero_dp_strategy=3,
  device=cpu)`, as its package documentation shows. Its `MegatronFSDP` constructor compares
  the device with `torch.cuda.current_device()` and creates `torch.cuda.Stream()`s, so on a
  torch built without CUDA it raises before any step whatever `device` is passed (the error
  above).

Ratios come from one launch on a machine shared with other work: read them as rough, and
re-run on your machine (the command above) for numbers that hold there."""


def write(doc: dict, out: str | None, md: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(render_page(doc, INTRO, NOTES))
        print(f"wrote {md}")


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python benchmarks/peers.py", description=__doc__.split("\n\n")[0])
    d = PeersConfig()
    ap.add_argument("--world", default=",".join(map(str, d.worlds)), help="world sizes, e.g. 2,4")
    ap.add_argument("--models", default=",".join(d.models), help=f"from {', '.join(WORKLOADS)}")
    ap.add_argument("--frameworks", default=",".join(d.frameworks))
    ap.add_argument("--check-steps", type=int, default=d.check_steps, help="steps compared with one process")
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--steps", type=int, default=d.steps, help="timed steps per framework per round")
    ap.add_argument("--quick", action="store_true", help="tiny models, one round of one step")
    ap.add_argument("--conditions", default="the machine ran other work at the same time (timings are noisy)",
                    help="what else the machine was doing, printed on the page")
    ap.add_argument("--out", default="out/peers.json")
    ap.add_argument("--md", default=None, help="Markdown page ('' for none; default out/peers.md, "
                    "with --render docs/peers.md)")
    ap.add_argument("--render", metavar="JSON", help="only render --md from this JSON (no run)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.render:
        write(json.loads(Path(args.render).read_text()), None, "docs/peers.md" if args.md is None else args.md)
        return 0
    fws = tuple(args.frameworks.split(","))
    for fw in fws:
        availability(fw)  # raises on a name it does not know
    models = tuple(args.models.split(","))
    bad = [m for m in models if m not in WORKLOADS]
    if bad:
        raise SystemExit(f"peers: --models {','.join(bad)}: expected names from {', '.join(WORKLOADS)}")
    cfg = PeersConfig(worlds=tuple(int(w) for w in args.world.split(",")), models=models, frameworks=fws,
                      check_steps=args.check_steps, rounds=args.rounds, steps=args.steps, quick=args.quick)
    if args.quick:
        cfg.rounds, cfg.steps, cfg.check_steps = 1, 1, 2
    command = "python benchmarks/peers.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None
                                                                                        else argv))
    for fw in fws:
        if fw in PEERS and not availability(fw)[0]:
            print(f"peers: skipping {fw}: {install_hint(fw)}")
    rows, load = [], [os.getloadavg()[0]]
    for w in cfg.worlds:
        rows += run_world(w, cfg)
        load.append(os.getloadavg()[0])
    doc = {"metadata": metadata(cfg, command.strip(), args.conditions), "rows": rows}
    # 1-minute load average at the start and after each launch: how busy the machine was
    doc["metadata"]["machine"]["load_average"] = [round(x, 1) for x in load]
    print(render_table(doc))
    write(doc, args.out, "out/peers.md" if args.md is None else args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
