"""Every ```python block of the README and the docs is checked (tests/_doc_blocks.py has the
markers): whole programs are saved to a file and run exactly as a reader runs them,
``torchrun --nproc_per_node 2 FILE`` for the W=2 ones and ``python FILE`` for the rest, with
no process group or seed set up by the harness; fragments are compiled.

The launches run a few at a time (each one spends seconds importing torch in its agent and in
every rank), all from one module fixture.
"""

import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _doc_blocks import FRAGMENT, RANKS, all_blocks

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.kind != FRAGMENT]
FRAGMENTS = [b for b in BLOCKS if b.kind == FRAGMENT]

# The venv's own launcher (dev: the shared .venv; CI: the repository's .venv/bin/torchrun),
# beside the interpreter running the tests, so the examples get the same torch and packages.
TORCHRUN = Path(sys.executable).parent / "torchrun"
LAUNCH_TIMEOUT_S = 300  # one launch; a hang (a rank waiting in a collective) fails, not blocks
# Launches at once. Each keeps about two cores busy (its ranks importing torch) and holds
# three processes' memory, so: half the cores, at least 2 (one launch's start overlaps the
# previous one's idle tail), at most 6 (memory on many-core runners).
JOBS = min(6, max(2, (os.cpu_count() or 2) // 2))


# gloo's worker thread can lose a race with interpreter shutdown and abort the process after
# the program finished, even after barrier() + destroy_process_group() (torch's own race,
# docs/reliability.md "Exit without barrier"; seen once in a full run here): such a launch is
# run once more, and only a second abort fails the example
_EXIT_ABORT = "terminate called without an active exception"


def _launch(block, workdir: Path) -> tuple[int | None, str]:
    code, out = _launch_once(block, workdir, "")
    if code not in (0, None) and _EXIT_ABORT in out:
        code, again = _launch_once(block, workdir, "-again")
        out = f"{out}\n(aborted at exit: launched once more)\n{again}"
    return code, out


def _launch_once(block, workdir: Path, suffix: str) -> tuple[int | None, str]:
    """Run one block from its own file in its own directory: (exit code or None, output)."""
    d = workdir / (block.filename.removesuffix(".py") + suffix)
    d.mkdir()
    path = d / block.filename
    path.write_text(block.code)
    cmd = block.command(path, sys.executable, str(TORCHRUN))
    # Own session: on a timeout the agent and its ranks are killed together.
    p = subprocess.Popen(cmd, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=LAUNCH_TIMEOUT_S)
        return p.returncode, f"$ {' '.join(cmd)}\n{out}"
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, f"$ {' '.join(cmd)}\n(killed after {LAUNCH_TIMEOUT_S} s)\n{out}"


@pytest.fixture(scope="module")
def ran():
    """Block id -> (exit code, output) of every whole program, run JOBS at a time."""
    if any(b.kind == RANKS for b in RUN) and not TORCHRUN.exists():
        pytest.fail(f"no torchrun beside {sys.executable} ({TORCHRUN}); install torch into this venv", pytrace=False)
    with tempfile.TemporaryDirectory(prefix="doc-examples-") as tmp, ThreadPoolExecutor(JOBS) as pool:
        # the rank programs first: they take longest
        order = sorted(RUN, key=lambda b: b.kind != RANKS)
        futures = {b.id: pool.submit(_launch, b, Path(tmp)) for b in order}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_example_runs_as_printed(block, ran):
    code, out = ran[block.id]
    if code != 0:
        pytest.fail(f"{block.id} exited with {code}:\n{out}", pytrace=False)


@pytest.mark.parametrize("block", [b for b in RUN if b.kind == RANKS], ids=lambda b: b.id)
def test_rank_programs_set_up_and_tear_down_their_process_group(block):
    """What torchrun does not do for a program (and the old harness did): the reason a copy
    fails, named before running it. ``destroy_process_group`` after a barrier: gloo may abort
    at exit otherwise."""
    code = block.code
    # Lightning's Trainer initialises the process group itself (its strategy's setup), so a
    # Lightning program is the one kind that does not call it
    assert "init_process_group(" in code or "pl.Trainer(" in code, \
        f"{block.id}: call dist.init_process_group(...) first"
    assert "destroy_process_group()" in code, f"{block.id}: end with dist.destroy_process_group()"
    assert code.rfind("barrier()") < code.rfind("destroy_process_group()"), \
        f"{block.id}: call dist.barrier() before dist.destroy_process_group()"


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.id)
def test_fragment_compiles(block):
    compile(block.code, block.id, "exec")


def test_few_blocks_are_fragments():
    """Fragments are for code that continues an example or needs GPUs or a cluster; most
    examples must run."""
    frags = [b.id for b in FRAGMENTS]
    assert len(frags) <= max(3, len(BLOCKS) // 2), f"{len(frags)} of {len(BLOCKS)} blocks are fragments: {frags}"
