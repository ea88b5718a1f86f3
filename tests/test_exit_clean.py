"""A script that ends without barrier() + destroy_process_group() exits cleanly (issue 19,
item 7). The script (tests/_exit_script.py) makes the race between a gloo worker thread
and interpreter finalization deterministic (see its docstring), so without the exit hook
in ragged_fsdp/exit.py both of these launches abort."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "_exit_script.py")
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str]) -> list[subprocess.Popen]:
    port = _port()
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return [subprocess.Popen([sys.executable, SCRIPT, *args], env=dict(env, RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def test_exit_without_destroy_is_clean(tmp_path):
    # both launches at once: each process's start-up (importing torch) dominates
    runs = {"failsave": _launch(["failsave", str(tmp_path / "ck")]), "allreduce": _launch(["allreduce"])}
    problems = []
    for name, procs in runs.items():
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=240)
            if p.returncode != 0 or "terminate called" in err:
                problems.append(f"{name} rank {rank}: exit code {p.returncode}\n{err[-1500:]}")
    assert not problems, "\n\n".join(problems)
