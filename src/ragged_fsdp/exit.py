"""What the library does when the interpreter exits.

A gloo collective issued from Python holds C++ references to the Python tensors it read or
wrote. The gloo worker thread that ran it drops them after the caller's ``wait()`` has
returned, and dropping the last C++ reference to a tensor that has a Python object
decrefs that object, which needs the GIL. While the main thread runs Python without
blocking (raising and catching an exception, formatting a message) the worker waits for
the GIL. If the main thread reaches interpreter finalization first, the worker's GIL
acquisition ends its thread, and unwinding a gloo worker thread aborts the process:
``terminate called without an active exception`` (pytorch/pytorch#190489 has the
backtrace). torch's documented ending, ``dist.destroy_process_group()``, shuts the groups
down while the interpreter is alive; a script that skips it exits cleanly or aborts
depending on thread timing (docs/reliability.md has the counts).

So at exit, if a process group is still initialized, the hook first waits for the
collectives the engine launched and nobody waited for (``device.drain``), then releases the
GIL for a short, bounded time so a worker thread still waiting to drop a finished
collective's tensors can do so while the interpreter is fully alive. No collective is
issued and nothing waits on a peer; a script that destroyed its process groups pays
nothing.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

from .device import drain

__all__ = ["HAND_OFF_S", "at_exit"]

# How long the main thread gives up the GIL at exit: 0.05 s was enough in the plain-gloo
# reproduction (docs/reliability.md); twice that leaves a margin for a thread that waits
# for a core on a loaded machine, and only scripts that skip destroy_process_group pay it.
HAND_OFF_S = 0.1


def at_exit() -> None:
    drain()
    if dist.is_available() and dist.is_initialized():
        time.sleep(HAND_OFF_S)


atexit.register(at_exit)
