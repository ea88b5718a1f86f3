"""HSDP on torchft 0.2.0: ragged_fsdp's ``fully_shard`` on the shard dim, torchft on the
replicate dim, one replica group losing a rank and coming back (printed and written to JSON,
not asserted: torchft's behaviour, recorded in docs/surviving-failures.md).

    PYTHONPATH=src .venv-ft/bin/python benchmarks/torchft_hsdp.py --out docs/data/torchft_hsdp_local.json

(``.venv-ft``: the shared venv plus ``pip install torchft==0.2.0``; torchft 0.2.0 accepts
torch 2.13.0.) The launcher starts a torchft ``LighthouseServer`` and R replica groups of S
ranks each, every group its own ``torch.distributed`` world (gloo, its own TCPStore) in which
ragged_fsdp shards the tiny Llama. Each rank's torchft ``Manager`` joins the replicate
dimension through a reconfigurable ``ProcessGroupGloo``; the gradient every unit reduces over
the shard dim is averaged over the live replicas by ``set_all_reduce_hook`` ->
``Manager.allreduce``. At ``--kill-step`` one rank of the last group SIGKILLs itself: its group
partner's shard-dim collectives time out, the group exits, the lighthouse drops it, and the
other groups keep stepping. ``--down`` seconds later the launcher starts the group again; its
ranks heal from a live replica (torchft's HTTP checkpoint transport, each rank fetching the
same shard rank of a live group) and rejoin. Every rank logs each step (loss, the
participants, a checksum of its local shards) so the healed replica's shards can be compared
with the live one's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_digest(model, opt) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().contiguous().view(-1).view(torch_uint8()).numpy().tobytes())
    for st in opt.state.values():
        for k in sorted(st):
            v = st[k]
            v = v.to_local() if hasattr(v, "to_local") else v
            h.update(v.detach().contiguous().reshape(-1).view(torch_uint8()).numpy().tobytes())
    return h.hexdigest()[:16]


def torch_uint8():
    import torch

    return torch.uint8


def local_state(model, opt):
    """What a healing rank needs from the same shard rank of a live replica: its local shards
    (plain tensors; both groups run the same planner at the same S, so the layouts match)."""
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    state = {}
    for i, p in enumerate(model.parameters()):
        st = opt.state.get(p, {})
        state[i] = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in st.items()}
    return {"params": params, "optim": state}


def load_local_state(model, opt, sd) -> None:
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(sd["params"][n])
        for i, p in enumerate(model.parameters()):
            src = sd["optim"].get(i, {})
            if not src:
                continue
            st = opt.state.setdefault(p, {})
            for k, v in src.items():
                if k in st and hasattr(st[k], "to_local"):
                    st[k].to_local().copy_(v)
                elif k in st and isinstance(st[k], torch.Tensor) and st[k].shape == v.shape:
                    st[k].copy_(v)
                else:
                    st[k] = v.clone()


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from ragged_fsdp import fully_shard
    from ragged_fsdp.models import Llama, LlamaConfig

    torch.set_num_threads(1)
    g, rank, S = a.group, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the group's store waits long for its ranks (importing torch on a loaded machine takes a
    # while); the collectives keep the short timeout, so a lost peer fails them fast
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), S, is_master=rank == 0,
                          timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=S, timeout=timedelta(seconds=a.timeout))
    mesh = init_device_mesh("cpu", (S,))
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    base = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    # AdamW's state exists only after its first step; a healing rank loads into it, so make it
    # now with a zero-gradient step of lr 0 (the optimizer's state stays all zeros but step 1).
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = base.param_groups[0]["lr"]
    base.param_groups[0]["lr"] = 0.0
    base.step()
    base.param_groups[0]["lr"] = lr
    base.zero_grad()
    for st in base.state.values():
        st["step"].zero_()

    if a.state == "local":
        state_fn, load_fn = (lambda: local_state(model, base)), (lambda sd: load_local_state(model, base, sd))
    else:  # the state dicts as FSDP2 users write them: DTensors with RaggedShard placements
        state_fn = lambda: {"model": model.state_dict(), "optim": base.state_dict()}  # noqa: E731

        def load_fn(sd):
            model.load_state_dict(sd["model"])
            base.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout)),
        load_state_dict=load_fn,
        state_dict=state_fn,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=a.timeout),
        quorum_timeout=timedelta(seconds=3 * a.timeout),
        connect_timeout=timedelta(seconds=3 * a.timeout),
        rank=rank,
        world_size=S,
        lighthouse_addr=a.lighthouse,
        replica_id=f"replica_{g}",
        init_sync=False,
    )

    def all_reduce_hook(segment: torch.Tensor) -> None:
        manager.allreduce(segment).wait()

    for m in [*model.layers, model]:
        m.set_all_reduce_hook(all_reduce_hook)
    opt = Optimizer(manager, base)

    log = open(a.log, "a")
    t_start = time.time()
    log.write(json.dumps({"event": "ready", "group": g, "rank": rank, "gen": a.generation, "t": t_start}) + "\n")
    log.flush()
    stop_file = a.log + ".stop"
    while True:
        opt.zero_grad()  # torchft: starts the quorum (and heals here when this group is behind)
        step = manager.current_step()
        stop_at = int(open(stop_file).read()) if os.path.exists(stop_file) else a.steps
        if step >= min(a.steps, stop_at):
            break
        if g == a.groups - 1 and rank == S - 1 and step == a.kill_step and a.generation == 0:
            log.write(json.dumps({"event": "kill", "group": g, "rank": rank, "step": step, "t": time.time()}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        gen = torch.Generator().manual_seed(1000 * step + 10 * (manager.participating_rank() or 0) + rank)
        tokens = torch.randint(0, 96, (2, 17), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()  # torchft: should_commit over the group, then the step if every rank agrees
        committed = manager.current_step() > step
        log.write(json.dumps({
            "group": g, "rank": rank, "gen": a.generation, "step": step, "committed": committed,
            "participants": manager.num_participants(), "loss": loss.item(),
            "digest": shard_digest(model, base), "t": time.time(), "t0": t_start,
        }) + "\n")
        log.flush()
        time.sleep(a.pace)
    manager.shutdown(wait=False)
    log.close()
    os._exit(0)


def launch_group(a, g, generation, lighthouse, log):
    port = free_port()
    procs = []
    for r in range(a.shard):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.shard), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFT_MANAGER_PORT="0")
        cmd = [sys.executable, __file__, "--worker", "--group", str(g), "--generation", str(generation),
               "--lighthouse", lighthouse, "--log", log, "--groups", str(a.groups), "--shard", str(a.shard),
               "--steps", str(a.steps), "--kill-step", str(a.kill_step), "--timeout", str(a.timeout),
               "--pace", str(a.pace), "--state", a.state]
        out = os.path.join(a.logs, f"g{g}r{r}-gen{generation}.out")
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT))
    return procs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--log", default="")
    p.add_argument("--groups", type=int, default=2, help="replica groups (R)")
    p.add_argument("--shard", type=int, default=2, help="ranks per replica group (S)")
    p.add_argument("--steps", type=int, default=2000, help="at most this many steps")
    p.add_argument("--together", type=int, default=10,
                   help="stop once the healed group has taken this many steps with the others")
    p.add_argument("--kill-step", type=int, default=8)
    p.add_argument("--down", type=float, default=5.0, help="seconds the lost group stays down")
    p.add_argument("--timeout", type=float, default=10.0, help="collective / quorum timeout, seconds")
    p.add_argument("--pace", type=float, default=0.2, help="sleep after each step, seconds")
    p.add_argument("--state", choices=["local", "dtensor"], default="local",
                   help="what heals: local shards as plain tensors, or model/optimizer state_dict() as DTensors")
    p.add_argument("--out", default="docs/data/torchft_hsdp.json")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return

    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    log = os.path.splitext(a.out)[0] + ".jsonl"
    a.logs = os.path.splitext(a.out)[0] + "_logs"
    shutil.rmtree(a.logs, ignore_errors=True)
    os.makedirs(a.logs)
    for f in (log, log + ".stop"):
        if os.path.exists(f):
            os.remove(f)
    t0 = time.time()
    groups = {g: launch_group(a, g, 0, lh.address(), log) for g in range(a.groups)}
    lost = a.groups - 1
    relaunched_at = None
    deadline = t0 + 600
    while time.time() < deadline:
        time.sleep(0.2)
        if relaunched_at is None and all(q.poll() is not None for q in groups[lost]):
            down_at = time.time()
            time.sleep(a.down)
            relaunched_at = time.time()
            with open(log, "a") as f:
                f.write(json.dumps({"event": "group_exited", "group": lost, "t": down_at}) + "\n")
                f.write(json.dumps({"event": "relaunch", "group": lost, "t": relaunched_at}) + "\n")
            groups[lost] = launch_group(a, lost, 1, lh.address(), log)
        if relaunched_at is not None and not os.path.exists(log + ".stop"):
            # once the healed group has stepped with the others a while, every group stops at
            # one step a few ahead (the steps are the quorum's, the same in every group)
            rows = [json.loads(x) for x in open(log)]
            back = [r for r in rows if r.get("gen") == 1 and r.get("committed") and r.get("participants") == a.groups]
            if len({r["step"] for r in back}) >= a.together:
                with open(log + ".stop", "w") as f:
                    f.write(str(max(r["step"] for r in rows if "step" in r) + 3))
        if relaunched_at is not None and all(q.poll() is not None for qs in groups.values() for q in qs):
            break
    for qs in groups.values():
        for q in qs:
            if q.poll() is None:
                q.kill()
    lh.shutdown()
    if os.path.exists(log + ".stop"):
        os.remove(log + ".stop")
    report(a, log)


def max_gap(rows, since):
    """Longest wait between two steps of one live rank after ``since``: what healing a peer
    costs the replicas that kept going."""
    ts = sorted(r["t"] for r in rows if r["rank"] == 0 and r["group"] == 0 and since is not None and r["t"] > since)
    return round(max((b - c for c, b in zip(ts, ts[1:])), default=0.0), 2)


def report(a, log) -> None:
    rows = [json.loads(line) for line in open(log)]
    kill = next(r for r in rows if r.get("event") == "kill")
    relaunch = next((r for r in rows if r.get("event") == "relaunch"), None)
    steps = [r for r in rows if "event" not in r]
    live = [r for r in steps if r["group"] != a.groups - 1]
    after_kill = [r for r in live if r["t"] > kill["t"]]
    first_commit = min((r["t"] for r in after_kill if r["committed"] and r["participants"] < a.groups), default=None)
    back = [r for r in steps if r["group"] == a.groups - 1 and r["gen"] == 1]
    ready = [r["t"] for r in rows if r.get("event") == "ready" and r["gen"] == 1]
    # the healed group's shard digests against the live group's, at each step both committed
    by = {}
    for r in steps:
        if r["committed"]:
            by.setdefault((r["step"], r["rank"]), {}).setdefault((r["group"], r["gen"]), r["digest"])
    compared = [(k, v) for k, v in by.items() if (a.groups - 1, 1) in v and (0, 0) in v]
    equal = sum(v[(a.groups - 1, 1)] == v[(0, 0)] for _, v in compared)
    out = {
        "command": "PYTHONPATH=src .venv-ft/bin/python " + " ".join(sys.argv),
        "groups": a.groups, "shard": a.shard, "steps": a.steps, "kill_step": a.kill_step, "down_s": a.down,
        "timeout_s": a.timeout,
        "state": a.state,
        "live_steps_while_group_out": len({r["step"] for r in after_kill if r["committed"] and (not back or r["t"] < min(b["t"] for b in back))}),
        "max_live_gap_s_after_relaunch": max_gap(live, relaunch["t"] if relaunch else None),
        "s_kill_to_first_step_without_lost_group": None if first_commit is None else round(first_commit - kill["t"], 2),
        "uncommitted_steps_live_groups": sorted({r["step"] for r in live if not r["committed"]}),
        "healed_group_first_step": min((r["step"] for r in back), default=None),
        "s_relaunch_to_healed_step": None if not back or relaunch is None else round(min(r["t"] for r in back) - relaunch["t"], 2),
        # the part of that spent importing torch and building the model (slow on a loaded machine)
        "s_relaunch_to_ready": None if not ready or relaunch is None else round(max(ready) - relaunch["t"], 2),
        "s_ready_to_healed_step": None if not back or not ready else round(min(r["t"] for r in back) - max(ready), 2),
        "max_participants_after_heal": max((r["participants"] for r in back), default=None),
        "digests_compared": len(compared), "digests_equal": equal,
        "final_step": max((r["step"] for r in steps), default=None),
    }
    from ragged_fsdp.bench.meta import run_meta

    out["meta"] = run_meta(out["command"])
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("| measure | value |\n|---|---|")
    for k, v in out.items():
        if k != "command":
            print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
