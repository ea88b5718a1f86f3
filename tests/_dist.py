"""Run many test cases on W gloo ranks with one process launch.

Starting a process group costs seconds, so each test module starts W workers once (a
module-scoped fixture calls ``run_cases``) and every case function runs inside them in turn.
A case is a module-level function ``case(rank, world)``; it raises to fail. A barrier
after each case keeps ranks in step, and a collective timeout turns a hang into an error.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp

CASE_TIMEOUT_S = int(os.environ.get("RAGGED_TEST_COLLECTIVE_TIMEOUT", "120"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cases, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S)
    )
    for fn in cases:
        name = f"{fn.__module__}.{fn.__name__}"
        try:
            fn(rank, world)
            queue.put((name, rank, None))
        except Exception:  # report every failure, keep going with the next case
            queue.put((name, rank, traceback.format_exc()))
        try:
            dist.barrier()
        except Exception:
            queue.put((name, rank, "barrier after case failed:\n" + traceback.format_exc()))
            return
    dist.barrier()
    dist.destroy_process_group()


def run_cases(world: int, cases, timeout: float = 900) -> dict[str, str | None]:
    """Run ``cases`` on ``world`` ranks; map each case name to None (passed) or the errors."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, list(cases), queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[str, list[str]] = {f"{c.__module__}.{c.__name__}": [] for c in cases}
    reports = dict.fromkeys(results, 0)
    pending = len(cases) * world
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    while pending:
        try:
            name, rank, err = queue.get(timeout=max(1.0, deadline - time.monotonic()))
        except _q.Empty:
            break
        pending -= 1
        reports[name] += 1
        if err is not None:
            results[name].append(f"[rank {rank}] {err}")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    out = {}
    for name, errs in results.items():
        out[name] = "\n".join(errs) if errs else None
    for name, n in reports.items():
        if n < world and not out[name]:
            out[name] = f"{world - n} rank(s) did not report (crash or timeout); exit codes {[p.exitcode for p in procs]}"
    return out
