"""The conditions a benchmark ran under, recorded beside its numbers.

Every bench that writes JSON puts ``"meta": run_meta()`` at the top level, so a table rendered
from the file (``python benchmarks/render.py`` in a checkout) can say which command produced it, when,
with which torch, and on what machine. Load average is recorded because timings taken on a
shared machine move with it; byte counts and MemTracker peaks do not.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys


def _gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none"
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    return f"{torch.cuda.device_count()} x {', '.join(sorted(names))}"


def _load() -> str | None:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # not available on every platform
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: ``python -m <module> args`` for a module, and for a
    script its path from the working directory (``python benchmarks/grad_wire.py args``, run from
    the checkout's root), so that the recorded command can be run again as written."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    elif argv:
        path = os.path.relpath(argv[0])
        head = ["python", os.path.basename(argv[0]) if path.startswith("..") else path]
    else:
        head = ["python", "?"]
    return shlex.join(head + argv[1:])


def run_meta(command: str | None = None) -> dict:
    """The ``meta`` block: command, UTC date, torch and Python versions, CPU cores, GPU, load."""
    import torch

    return {
        "command": command or command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "gpu": _gpu(),
        "load_average": _load(),
    }
