"""What the library does when the interpreter exits.

A gloo collective issued from Python holds C++ references to the Python tensors it read or
wrote. The gloo worker thread that ran it drops them after the caller's ``wait()`` has
returned, and dropping the last C++ reference to a tensor that has a Python object
decrefs that object, which needs the GIL. While the main thread runs Python without
blocking (raising and catching an exception, formatting a message) the worker waits for
the GIL. If the main thread reaches interpreter finalization first, the worker's GIL
acquisition ends its thread, and unwinding a gloo worker thread aborts the process:
``terminate called without an active exception``. ``dist.destroy_process_group()`` at the
end of a script avoids it (the main thread blocks while the workers are joined); a script
that skips it exits cleanly or aborts depending on thread timing. A failed checkpoint save
makes it likely: its last collective is followed only by Python code up to the exit.

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

from .fsdp.device import drain

__all__ = ["HAND_OFF_S", "at_exit"]

# How long the main thread gives up the GIL at exit. Handing the GIL to a waiting thread
# takes a scheduler slice; on a loaded 2-core machine a runnable thread waited up to tens
# of milliseconds, so this leaves a margin without making exits noticeably slower.
HAND_OFF_S = 0.1


def at_exit() -> None:
    drain()
    if dist.is_available() and dist.is_initialized():
        time.sleep(HAND_OFF_S)


atexit.register(at_exit)
