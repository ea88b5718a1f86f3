"""Launch ``elastic_snapshot_train.py`` under torch elastic, four agents as four nodes.

The c10d rendezvous store is hosted here (``is_host=false`` on every agent), as a cluster
hosts it on a node that is not lost (losing the rendezvous host is out of scope). Settings
that make restarts reliable (see docs/surviving-failures.md): a keep-alive of 1 s x 3 (the
default 5 s x 3 keeps a dead node in the next round long enough for its restart attempts to
fail) and ``--max-restarts`` above the number of membership changes plus failures expected.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "elastic_snapshot_train.py")
SRC = os.path.join(os.path.dirname(HERE), "src")
RDZV_CONF = ("is_host=false,keep_alive_interval=2,keep_alive_max_attempt=5,join_timeout=300,last_call_timeout=5,"
             "read_timeout=300")
MAX_RESTARTS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(port: int, node: str, out: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=snapshots-test",
           f"--rdzv-conf={RDZV_CONF}", f"--max-restarts={MAX_RESTARTS}", "--monitor-interval=0.5", SCRIPT]
    e = dict(env, NODE=node, SNAP_DIR=os.path.join(out, "nodes", node))
    log = open(os.path.join(out, f"agent-{node}.log"), "w")
    return subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT)


def run_scenario(out: str, steps: int = 6, die: str = "", wait_at: str = "", grow: int = 0, fallback: bool = False,
                 nodes: int = 4, timeout_s: float = 400) -> dict:
    """Run one launch; returns the log (per step, every (W, loss, norm) logged), the events,
    the final state and the agents' exit codes."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "nodes"))
    port = _free_port()
    env = dict(os.environ, OUT=out, STEPS=str(steps), DIE=die, WAIT_AT=f"0:{nodes};{wait_at}", PYTHONPATH=SRC + os.pathsep + HERE,
               OMP_NUM_THREADS="1", PG_TIMEOUT="60", LOGLEVEL="INFO",
               # torchrun's default shares the first round's rank-0 agent store with the workers of
               # every later round: a dead rank-0 node leaves them a dead store, and the old
               # rounds' gloo keys (no per-round prefix) point the new group at dead workers
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    if fallback:
        env["FALLBACK"] = os.path.join(out, "dcp")
    t0, grown = time.time(), False
    agents = {f"n{i}": _agent(port, f"n{i}", out, env) for i in range(nodes)}
    # the store opens once every agent has imported torch (seconds apart on a loaded machine),
    # so the first round has all of them: agents wait for it to appear (read_timeout)
    while time.time() - t0 < 120 and not all(
            "Starting elastic_operator" in open(os.path.join(out, f"agent-{n}.log")).read() for n in agents):
        time.sleep(0.2)
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    events = os.path.join(out, "events.txt")
    try:
        while any(a.poll() is None for a in agents.values()):
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"scenario in {out} did not finish in {timeout_s} s")
            if grow and not grown and os.path.exists(events) and any(
                    ln.startswith("waiting") and not ln.endswith("step=0") for ln in open(events).read().splitlines()):
                for i in range(grow):
                    agents[f"g{i}"] = _agent(port, f"g{i}", out, env)
                grown = True
            time.sleep(0.2)
    finally:
        for a in agents.values():
            if a.poll() is None:
                a.kill()
        del store
    log: dict[int, list] = {}
    if os.path.exists(os.path.join(out, "log.txt")):
        for line in open(os.path.join(out, "log.txt")):
            s, w, loss, norm = line.split()
            log.setdefault(int(s), []).append((int(w), loss, norm))
    final = os.path.join(out, "final.pt")
    killed = sorted(open(os.path.join(out, n)).read() for n in os.listdir(out) if n.startswith("died-"))
    per_agent = {n[len("agent-"):-len(".log")]: open(os.path.join(out, n), errors="replace").read()
                 for n in sorted(os.listdir(out)) if n.startswith("agent-")}
    logs = "".join(per_agent.values())
    tails = {n: "\n".join(text.splitlines()[-40:]) for n, text in per_agent.items()}
    return {"killed_nodes": killed, "agent_logs": logs, "agent_tails": tails, "log": log, "events": open(events).read().splitlines() if os.path.exists(events) else [],
            "codes": {n: a.returncode for n, a in agents.items()}, "seconds": time.time() - t0,
            "final": torch.load(final) if os.path.exists(final) else None}
