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

The hook is registered by ``ragged_fsdp.device`` (the module every collective the
engine launches goes through) when it is first imported: ``import ragged_fsdp`` loads its public
names on first use and imports no torch, so registering here at import would miss scripts that
reach the engine by ``from ragged_fsdp.fsdp import ...`` and cost every ``--help`` a torch import.
This module keeps the explanation and the public names.
"""

from __future__ import annotations

from .device import HAND_OFF_S, at_exit, drain

__all__ = ["HAND_OFF_S", "at_exit", "drain"]
