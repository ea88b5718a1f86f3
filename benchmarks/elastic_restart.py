"""Losing one of four torchrun agents (kill -9 of the agent and its worker, as a node loss):
how many restarts succeed under which rendezvous settings, how many steps are lost and how
many seconds pass from the kill to the next step, for torch FSDP2 + DCP restarting from its
last checkpoint and for ragged_fsdp's peer snapshots (printed; JSON and logs under docs/data/).

    PYTHONPATH=src python benchmarks/elastic_restart.py --trials 2 --out docs/data/elastic_restart.json

Each trial starts four agents on this machine as four nodes:

    torchrun --nnodes=2:4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT
             --rdzv-id=ID --max-restarts=M [--rdzv-conf keep_alive_interval=1,keep_alive_max_attempt=3]
             benchmarks/elastic_restart.py --role train ...

agent 0 first (it hosts the c10d store: losing that host is out of scope), then, once every
rank has logged step ``--kill-after``, SIGKILLs agent 3's whole process group (agent and
worker). The trainer is the tiny Llama, gloo, a global batch of 12 sequences split over the
ranks (12 divides W = 2, 3, 4), ``--pace`` seconds of sleep per step standing in for compute.
``fsdp2_dcp``: torch's ``fully_shard`` and ``dcp.save`` every ``--every`` steps into one
shared directory, ``dcp.load`` of the newest complete save on start. ``snapshot``:
ragged_fsdp's ``fully_shard`` and ``Snapshots(every=1)`` into per-agent node directories
(no shared directory).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

from ragged_fsdp.bench.meta import run_meta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the trainer ---


def log_line(path, **row) -> None:
    row["t"] = time.time()
    with open(path, "a") as f:  # one short O_APPEND write per line: lines from ranks do not mix
        f.write(json.dumps(row) + "\n")


def train(a) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp.models import Llama, LlamaConfig

    torch.set_num_threads(1)
    t_proc = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, W = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (W,))
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    if a.mode == "fsdp2_dcp":
        from torch.distributed.fsdp import fully_shard
    else:
        from ragged_fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    start = 0
    if a.mode == "fsdp2_dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = sorted(int(p.split("-")[-1]) for p in glob.glob(os.path.join(a.ckpt, "step-*"))
                      if os.path.exists(os.path.join(p, ".metadata")))
        if done:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=os.path.join(a.ckpt, f"step-{done[-1]}"))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = done[-1] + 1
    else:
        from ragged_fsdp.checkpoint import Snapshots

        snap = Snapshots(model, opt, dir=a.node_dir, every=1)
        start = snap.restore()  # 0 on a fresh start; else the step after the newest snapshot
    log_line(a.log, event="start", rank=rank, W=W, restart=restart, resumed_at=start, t_proc=t_proc)

    data = torch.Generator().manual_seed(1234)
    tokens_all = torch.randint(0, 96, (a.steps, 12, 17), generator=data)
    per = 12 // W
    for step in range(start, a.steps):
        tokens = tokens_all[step, rank * per:(rank + 1) * per]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(a.pace)
        if a.mode == "fsdp2_dcp":
            if (step + 1) % a.every == 0:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(a.ckpt, f"step-{step}"))
        else:
            snap.snapshot(step + 1)
        log_line(a.log, event="step", rank=rank, W=W, restart=restart, step=step, loss=loss.item())
    dist.barrier()
    dist.destroy_process_group()


# -------------------------------------------------------------------------- the launcher ---


def agent_cmd(a, port, rdzv_id, node, name, max_restarts, work):
    conf, extra_env = CONFS[name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]
    if conf:
        cmd.append(f"--rdzv-conf={conf}")
    # the trainer's settings travel in the environment: torchrun's parser refuses script
    # arguments that abbreviate one of its own options (``--log``)
    cfg = {"mode": a.mode, "steps": a.steps, "every": a.every, "pace": a.pace, "timeout": a.timeout,
           "log": os.path.join(work, "steps.jsonl"), "ckpt": os.path.join(work, "shared_ckpt"),
           "node_dir": os.path.join(work, f"node{node}")}
    return cmd + [__file__], dict(os.environ, ELASTIC_RESTART_TRAIN=json.dumps(cfg), LOGLEVEL="INFO", **extra_env)


def trial(a, conf_name, max_restarts, index) -> dict:
    work = os.path.join(a.work, f"{a.mode}-{conf_name}-r{max_restarts}-{index}")
    shutil.rmtree(work, ignore_errors=True)  # a trial never resumes another trial's checkpoints
    os.makedirs(work)
    log = os.path.join(work, "steps.jsonl")
    port, rdzv_id = free_port(), f"t{os.getpid()}{index}{conf_name}{max_restarts}"
    agents = []
    for node in range(4):
        out = open(os.path.join(work, f"agent{node}.log"), "w")
        cmd, env = agent_cmd(a, port, rdzv_id, node, conf_name, max_restarts, work)
        agents.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        if node == 0:
            time.sleep(2.0)  # agent 0 binds the store first and so hosts it
    t_kill = None
    deadline = time.time() + a.deadline
    while time.time() < deadline:
        time.sleep(0.1)
        rows = read(log)
        if t_kill is None and sum(r.get("step") == a.kill_after for r in rows) >= 4:
            kill_node(agents[3].pid)
            t_kill = time.time()
            shutil.rmtree(os.path.join(work, "node3"), ignore_errors=True)  # its memory goes with it
            log_line(log, event="kill", node=3)
            deadline = t_kill + a.deadline
        if all(q.poll() is not None for q in (agents[:3] if t_kill else agents)):
            break
    for q in agents:
        if q.poll() is None:
            kill_node(q.pid)
            q.wait()
    rows = read(log)
    before = [r for r in rows if r.get("event") == "step" and t_kill and r["t"] <= t_kill]
    # after the kill: the world shrank (an agent restarted for a membership change keeps its
    # TORCHELASTIC_RESTART_COUNT, so the count does not tell)
    after = [r for r in rows if r.get("event") == "step" and t_kill and r["t"] > t_kill and r["W"] < 4]
    starts = [r for r in rows if r.get("event") == "start" and t_kill and r["t"] > t_kill]
    last_before = max((r["step"] for r in before if r["W"] == 4), default=None)
    resumed = min((r["resumed_at"] for r in starts), default=None)
    finished = any(r.get("step") == a.steps - 1 for r in after)
    return {
        "mode": a.mode, "settings": conf_name, "label": conf_label(conf_name), "max_restarts": max_restarts, "trial": index,
        "finished": finished,
        "agent_exit_codes": [q.returncode for q in agents[:3]],
        "restarts_used": max((r["restart"] for r in rows if r.get("event") == "start"), default=0),
        "world_after": sorted({r["W"] for r in after}),
        "last_step_before_kill": last_before,
        "resumed_at": resumed,
        "steps_lost": None if resumed is None or last_before is None else last_before + 1 - resumed,
        "s_kill_to_next_step": None if not after else round(min(r["t"] for r in after) - t_kill, 2),
        # the job is back where it was: the first step it had not finished at the kill, done
        "s_kill_to_caught_up": caught_up(after, last_before, t_kill),
        "s_kill_to_worker_start": None if not starts else round(min(r["t_proc"] for r in starts) - t_kill, 2),
        **agent_phases(work, t_kill),
        "work": work,
    }


def caught_up(after, last_before, t_kill):
    done = [r["t"] for r in after if last_before is not None and r["step"] == last_before + 1]
    return None if not done or t_kill is None else round(min(done) - t_kill, 2)


def recompute(path: str, logs: str) -> None:
    """Add ``s_kill_to_caught_up`` to a results JSON from the kept step logs (the kill time
    is the first step after it less ``s_kill_to_next_step``)."""
    d = json.load(open(path))
    for r in d["results"]:
        if not r["finished"]:
            continue
        rows = read(os.path.join(logs, os.path.basename(r["work"]), "steps.jsonl"))
        after = [x for x in rows if x.get("event") == "step" and x["W"] < 4]
        t_kill = min(x["t"] for x in after) - r["s_kill_to_next_step"]
        r["s_kill_to_caught_up"] = caught_up(after, r["last_step_before_kill"], t_kill)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)


def keep_logs(work: str, dest: str) -> None:
    """The trial's step log and the agents' log lines without C++ stack frames, for docs/data."""
    os.makedirs(dest, exist_ok=True)
    shutil.copy(os.path.join(work, "steps.jsonl"), os.path.join(dest, "steps.jsonl")) \
        if os.path.exists(os.path.join(work, "steps.jsonl")) else None
    for node in range(4):
        src = os.path.join(work, f"agent{node}.log")
        if os.path.exists(src):
            with open(src, errors="replace") as f, open(os.path.join(dest, f"agent{node}.log"), "w") as g:
                g.writelines(line for line in f if not line.startswith(("frame #", "Exception raised from")))


def agent_phases(work: str, t_kill: float | None) -> dict:
    """From the survivors' agent logs (LOGLEVEL=INFO): seconds from the kill until the first
    agent saw its worker group fail, and until the first rendezvous after that completed."""
    import datetime as _dt
    import re

    stamp = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) ")
    failed, rdzv, per_agent = [], [], []
    for node in range(3):
        path = os.path.join(work, f"agent{node}.log")
        per_agent.append(sum("Worker group FAILED" in line for line in open(path, errors="replace"))
                         if os.path.exists(path) else 0)
        path = os.path.join(work, f"agent{node}.log")
        if not os.path.exists(path) or t_kill is None:
            continue
        for line in open(path, errors="replace"):
            m = stamp.match(line)
            if not m:
                continue
            day = _dt.datetime.fromtimestamp(t_kill, _dt.timezone.utc)
            t = _dt.datetime.strptime(f"{day.year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            t = t.replace(tzinfo=_dt.timezone.utc).timestamp()
            if t < t_kill:
                continue
            if "Worker group FAILED" in line or "membership changes" in line.lower():
                failed.append(t)
            elif "Rendezvous complete" in line:
                rdzv.append(t)
    first_fail = min(failed, default=None)
    after = [t for t in rdzv if first_fail is not None and t > first_fail]
    return {"worker_group_failures_per_agent": per_agent,
            "s_kill_to_first_agent_failure": None if first_fail is None else round(first_fail - t_kill, 2),
            "s_kill_to_first_rendezvous": None if not after else round(min(after) - t_kill, 2)}


def kill_node(pid: int) -> None:
    """SIGKILL an agent and everything under it at once: torchrun starts its workers in their
    own sessions, so killing the agent's process group would leave the worker stepping."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for q in procs:
        try:
            q.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def read(path):
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


FAST = "keep_alive_interval=1,keep_alive_max_attempt=3"
# name -> (--rdzv-conf, extra environment of every agent). ``noshare``: torch's opt-out of the
# rendezvous TCPStore that the agents share with the workers across rounds (a fresh store per
# round, hosted by the new rank 0's worker).
CONFS = {
    "default": ("", {}),
    "fast": (FAST, {}),
    "noshare": ("", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "fast_noshare": (FAST, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    # and the last call for late nodes cut from 30 s to 5 s (the survivors join within it)
    "fast_lc5_noshare": (FAST + ",last_call_timeout=5", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    # the recipe's settings (docs/surviving-failures.md): a keep-alive that tolerates a stalled host
    "recipe": ("keep_alive_interval=2,keep_alive_max_attempt=5,last_call_timeout=5",
               {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}


def conf_label(name: str) -> str:
    conf, env = CONFS[name]
    return " + ".join([conf or "default keep-alive (5 s x 3)"] + [f"{k}={v}" for k, v in env.items()])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fsdp2_dcp", "snapshot"], default="fsdp2_dcp")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kill-after", type=int, default=8, help="kill once every rank logged this step")
    p.add_argument("--every", type=int, default=5, help="fsdp2_dcp: dcp.save every this many steps")
    p.add_argument("--pace", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=30.0, help="gloo collective timeout, seconds")
    p.add_argument("--deadline", type=float, default=150.0, help="give a trial this long after the kill")
    p.add_argument("--confs", default="default:3,fast:3,default:10,fast:10",
                   help="comma list of rdzv-conf name (default|fast) : --max-restarts")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--work", default="/tmp/elastic_restart")
    p.add_argument("--out", default="docs/data/elastic_restart.json")
    p.add_argument("--logs", default="", help="copy each trial's step log and agent logs under this directory")
    if "ELASTIC_RESTART_TRAIN" in os.environ:
        train(argparse.Namespace(**json.loads(os.environ["ELASTIC_RESTART_TRAIN"])))
        return
    p.add_argument("--recompute", default="", help="add the derived fields to this results JSON from --logs")
    a = p.parse_args()
    if a.recompute:
        recompute(a.recompute, a.logs)
        return
    results = []
    plan = [(c.split(":")[0], int(c.split(":")[1])) for c in a.confs.split(",")]
    for i in range(a.trials):  # alternate the settings inside each round
        for name, mr in plan:
            r = trial(a, name, mr, i)
            if a.logs:
                keep_logs(r["work"], os.path.join(a.logs, os.path.basename(r["work"])))
            print(json.dumps(r), flush=True)
            results.append(r)
            write(a, results)  # after every trial: a long matrix cut short keeps what it measured
    print(f"\n{a.mode}: kill -9 of one of four agents after step {a.kill_after} ({a.steps} steps, "
          f"{a.pace}s pace, gloo timeout {a.timeout}s)\n")
    print("| settings | max-restarts | finished | worker-group failures (max per agent, per trial) | steps lost (median) | s kill -> next step (median) |")
    print("|---|---|---|---|---|---|")
    for name, mr in plan:
        rs = [r for r in results if r["settings"] == name and r["max_restarts"] == mr]
        ok = [r for r in rs if r["finished"]]
        med = (lambda k: round(statistics.median([r[k] for r in ok if r[k] is not None]), 1) if ok else None)
        print(f"| {conf_label(name)} | {mr} | {len(ok)}/{len(rs)} | "
              f"{[max(r['worker_group_failures_per_agent'] or [0]) for r in rs]} | {med('steps_lost')} | {med('s_kill_to_next_step')} |")
    write(a, results)


def write(a, results) -> None:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": "PYTHONPATH=src python " + " ".join(sys.argv), "results": results,
                   "meta": run_meta("PYTHONPATH=src python " + " ".join(sys.argv))}, f, indent=1)


if __name__ == "__main__":
    main()
