"""Checkpoint saves under faults: retention, the per-root lock, save failures, skipped steps.

* retention never deletes the checkpoint just written (whatever its step);
* one writer per root: a live holder (or one on another host) makes a second save fail with
  ``CheckpointLockedError`` before anything is written or deleted; a lock left by a dead
  process of this host is broken with a warning and its debris removed; two processes
  saving at once: every save either publishes a checkpoint that stays, or is refused;
* a job killed whole during a save leaves a stale lock and a partial directory; the next
  save breaks the one and removes the other;
* a full disk (``RLIMIT_FSIZE`` in a subprocess, and an injected ``ENOSPC``) and a rank that
  cannot write (W = 2 gloo): ``CheckpointSaveError`` (an ``Exception``) naming the rank and
  the ``OSError``, no partial directory left, the previous checkpoint intact, lock dropped;
* ``load_latest`` falls back past a newer step directory that lacks its marker or
  ``.metadata`` with a warning naming it and why (also in ``Checkpoint.skipped``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import ragged_fsdp.checkpoint as ck
from ragged_fsdp.checkpoint import lock

from _dist import check_case, run_cases

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _py(code: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def _dot_entries(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


# -- retention ---------------------------------------------------------------------------

def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    root = tmp_path / "r"
    ck.save({"w": torch.ones(3)}, root, step=10)
    c = ck.save({"w": torch.zeros(3)}, root, step=6, keep_last=1)
    assert os.path.isdir(c.path), os.listdir(root)
    assert [x.step for x in ck.list_checkpoints(root)] == [6]
    assert torch.equal(ck.load_latest(root).state["w"], torch.zeros(3))
    # keep_last=n: the new one plus the n - 1 highest others; a lower step than a kept one
    # is saved, with a warning that load_latest will pick the higher one
    for s in (7, 8, 9):
        ck.save({"w": torch.full((3,), float(s))}, root, step=s)
    with pytest.warns(ck.CheckpointWarning, match="below the newest published step 9"):
        c = ck.save({"w": torch.full((3,), 2.0)}, root, step=2, keep_last=2)
    assert [x.step for x in ck.list_checkpoints(root)] == [2, 9]
    assert os.path.isdir(c.path)
    c = ck.save({"w": torch.full((3,), 10.0)}, root, keep_last=2)  # default step: newest + 1
    assert c.step == 10 and [x.step for x in ck.list_checkpoints(root)] == [9, 10]
    assert _dot_entries(root) == []


# -- the lock ------------------------------------------------------------------------------

def _fake_holder(root, pid: int, host: str | None = None, token: str = "feedc0de"):
    """A lock and a partial directory written by ``pid`` (on ``host``)."""
    os.makedirs(root, exist_ok=True)
    name = f".partial-step-0000000099-{token}"
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, "__0_0.distcp"), "wb") as f:
        f.write(b"half a checkpoint")
    rec = lock.holder_record(token, name, 4)
    rec["pid"] = pid
    rec["start_ticks"] = lock._start_ticks(pid)
    if host is not None:
        rec["host"] = host
    for path in (os.path.join(root, lock.LOCK), os.path.join(root, name, lock.WRITER)):
        with open(path, "w") as f:
            json.dump(rec, f)
    return name


def _tree(root) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def test_second_writer_is_refused_and_deletes_nothing(tmp_path):
    root = str(tmp_path / "r")
    ck.save({"w": torch.ones(2)}, root, step=0)
    ck.save({"w": torch.ones(2)}, root, step=1)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        partial = _fake_holder(root, holder.pid)
        before = _tree(root)
        for kw in ({}, {"step": 5, "keep_last": 1}):
            with pytest.raises(ck.CheckpointLockedError) as e:
                ck.save({"w": torch.zeros(2)}, root, **kw)
            msg = str(e.value)
            assert isinstance(e.value, Exception)
            assert f"pid {holder.pid}" in msg and socket.gethostname() in msg and partial in msg, msg
            assert "Nothing was written or deleted" in msg and "wait for that save" in msg, msg
            assert _tree(root) == before  # the holder's partial directory and every checkpoint
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale; the next save breaks it (warning naming it) and,
    # once published, removes the dead holder's partial directory
    with pytest.warns(ck.CheckpointWarning, match=f"broke the stale lock of host .* pid {holder.pid}"):
        c = ck.save({"w": torch.zeros(2)}, root, keep_last=2)
    assert c.step == 2 and [x.step for x in ck.list_checkpoints(root)] == [1, 2]
    assert _dot_entries(root) == [], os.listdir(root)


def test_lock_of_another_host_is_not_broken(tmp_path):
    root = str(tmp_path / "r")
    ck.save({"w": torch.ones(2)}, root, step=0)
    partial = _fake_holder(root, 12345, host="some-other-host")
    before = _tree(root)
    with pytest.raises(ck.CheckpointLockedError, match="some-other-host pid 12345") as e:
        ck.save({"w": torch.zeros(2)}, root)
    msg = str(e.value)
    assert f"remove {os.path.join(root, lock.LOCK)} by hand and {os.path.join(root, partial)}" in msg, msg
    assert _tree(root) == before
    # removed by hand (the lock only): the other host's partial directory is kept and reported
    os.unlink(os.path.join(root, lock.LOCK))
    with pytest.warns(ck.CheckpointWarning, match=f"{partial} by host some-other-host"):
        ck.save({"w": torch.zeros(2)}, root, keep_last=1)
    assert os.path.isdir(os.path.join(root, partial))


_WRITER = """
import json, os, sys, time, warnings
import torch
import ragged_fsdp.checkpoint as ck
root, sync, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
open(os.path.join(sync, f"ready.{{os.getpid()}}"), "w").close()  # torch imported
while not os.path.exists(os.path.join(sync, "go")):
    time.sleep(0.001)
out = []
for i in range(n):
    try:
        c = ck.save({{"w": torch.full((64, 64), float(os.getpid())), "pid": os.getpid()}}, root, keep_last={keep})
        out.append(["ok", c.path])
    except ck.CheckpointLockedError as e:
        out.append(["locked", str(e)])
    except BaseException as e:
        out.append(["error", f"{{type(e).__name__}}: {{e}}"])
print(json.dumps(out))
"""


@pytest.mark.parametrize("keep", [None, 3])
def test_two_writers_at_once_publish_or_are_refused(tmp_path, keep):
    import time

    root = str(tmp_path / "r")
    sync = tmp_path / "sync"
    sync.mkdir()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER.format(keep=keep), root, str(sync), "6"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    # both start saving together once both have imported torch (a fixed start time either
    # waits longer than the imports take or, on a loaded machine, not long enough)
    deadline = time.monotonic() + 300
    while len(list(sync.glob("ready.*"))) < 2 and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    (sync / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results += json.loads(out.strip().splitlines()[-1])
    kinds = [k for k, _ in results]
    assert "error" not in kinds, [r for r in results if r[0] == "error"]
    assert kinds.count("ok") >= 1, results
    published = {c.path for c in ck.list_checkpoints(root)}
    oks = [p for k, p in results if k == "ok"]
    if keep is None:
        assert set(oks) == published, (oks, sorted(published))
    else:  # each save kept what it wrote; the last published ones are there
        assert len(published) == min(keep, len(oks)) and published <= set(oks)
    for c in ck.list_checkpoints(root):  # every published checkpoint is whole and one writer's
        st = ck.read_full(c.path)
        assert torch.equal(st["w"], torch.full((64, 64), float(st["pid"]))), c.path
    assert _dot_entries(root) == [], os.listdir(root)


_KILLED = """
import os, signal, sys
import torch
import torch.distributed.checkpoint as dcp
import ragged_fsdp.checkpoint as ck
root = sys.argv[1]
ck.save({"w": torch.arange(6.0)}, root)
real = dcp.FileSystemWriter.write_data
def write_and_die(self, plan, planner):
    real(self, plan, planner).wait()
    os.kill(os.getpid(), signal.SIGKILL)
dcp.FileSystemWriter.write_data = write_and_die
ck.save({"w": torch.zeros(6)}, root)
"""


def test_job_killed_whole_during_a_save(tmp_path):
    root = str(tmp_path / "r")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _KILLED, root], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    left = _dot_entries(root)
    assert lock.LOCK in left and any(n.startswith(".partial-step-0000000001") for n in left), left
    found = ck.load_latest(root)
    assert found.step == 0 and torch.equal(found.state["w"], torch.arange(6.0))
    with pytest.warns(ck.CheckpointWarning, match="broke the stale lock"):
        c = ck.save({"w": torch.ones(6)}, root)
    assert c.step == 1 and _dot_entries(root) == [], os.listdir(root)


# -- save failures -----------------------------------------------------------------------

_DISK_FULL = """
import json, os, resource, sys
import torch
import ragged_fsdp.checkpoint as ck
root = sys.argv[1]
ck.save({"w": torch.ones(4)}, root)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    ck.save({"w": torch.ones(1 << 18)}, root)   # 1 MiB > 64 KiB: the write fails with EFBIG
    print(json.dumps(["saved"]))
except Exception as e:                          # not only BaseException
    print(json.dumps([type(e).__name__, str(e), isinstance(e, OSError),
                      type(e.__cause__).__name__, getattr(e, "ranks", None)]))
"""


def test_disk_full_raises_a_library_error_and_leaves_nothing(tmp_path):
    root = str(tmp_path / "r")
    r = _py(_DISK_FULL.replace("sys.argv[1]", repr(root)))
    assert r.returncode == 0, r.stderr[-3000:]
    name, msg, is_oserror, cause, ranks = json.loads(r.stdout.strip().splitlines()[-1])
    assert name == "CheckpointSaveError" and is_oserror, (name, msg)
    assert "rank(s) [0]: OSError: [Errno 27] File too large" in msg and cause == "OSError", msg
    assert "Traceback" not in msg and len(msg) < 600, msg
    assert ranks == [0]
    assert [c.step for c in ck.list_checkpoints(root)] == [0] and _dot_entries(root) == [], os.listdir(root)
    assert torch.equal(ck.load_latest(root).state["w"], torch.ones(4))


def test_injected_enospc_and_publish_failure(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "r")
    ck.save({"w": torch.ones(4)}, root)

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    with pytest.raises(ck.CheckpointSaveError, match=r"rank\(s\) \[0\]: OSError: \[Errno 28\] No space left"):
        ck.save({"w": torch.zeros(4)}, root, keep_last=1)
    monkeypatch.undo()
    assert [c.step for c in ck.list_checkpoints(root)] == [0] and _dot_entries(root) == []
    # the rename that publishes fails: the same error type, nothing left behind
    real = os.rename

    def no_publish(a, b, *args, **kw):
        if os.path.basename(str(a)).startswith(".partial-"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(a, b, *args, **kw)

    monkeypatch.setattr(os, "rename", no_publish)
    with pytest.raises(ck.CheckpointSaveError, match="publishing .* failed on rank 0: .*Read-only"):
        ck.save({"w": torch.zeros(4)}, root, keep_last=1)
    monkeypatch.undo()
    assert [c.step for c in ck.list_checkpoints(root)] == [0] and _dot_entries(root) == []


# -- load_latest falls back with a warning --------------------------------------------------

def test_load_latest_says_which_directory_it_skipped(tmp_path):
    root = tmp_path / "r"
    for s in range(3):
        ck.save({"n": torch.tensor(s)}, root)
    os.unlink(root / "step-0000000002" / ck.atomic.MARKER)   # lost its completion marker
    shutil.copytree(root / "step-0000000001", root / "step-0000000005")
    os.unlink(root / "step-0000000005" / ".metadata")        # lost its metadata
    with pytest.warns(ck.CheckpointWarning) as w:
        found = ck.load_latest(root)
    assert found.step == 1 and int(found.state["n"]) == 1
    texts = [str(x.message) for x in w]
    assert any("step-0000000002" in t and "completion marker" in t for t in texts), texts
    assert any("step-0000000005" in t and ".metadata" in t for t in texts), texts
    assert [os.path.basename(p) for p, _ in found.skipped] == ["step-0000000002", "step-0000000005"]


# -- W = 2: a rank that cannot write -----------------------------------------------------

def _shared(name: str) -> str:
    return os.path.join(os.environ["RAGGED_TEST_TMP"], name)


def case_rank_cannot_write(rank, world):
    import resource

    from torch.distributed.device_mesh import init_device_mesh

    import ragged_fsdp as rf

    mesh = init_device_mesh("cpu", (world,))
    root = _shared("cannot_write")
    t = torch.arange(1 << 16, dtype=torch.float32).view(256, 256)
    w = rf.distribute_tensor(t, mesh, [rf.RaggedShard((0,), (64, 192), 1)])
    ck.save({"w": w}, root)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    try:
        with pytest.raises(ck.CheckpointSaveError) as e:
            ck.save({"w": rf.distribute_tensor(t + 1, mesh, [rf.RaggedShard((0,), (64, 192), 1)])}, root, keep_last=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    msg = str(e.value)
    assert "rank(s) [1]: OSError: [Errno 27] File too large" in msg and e.value.ranks == [1], msg
    assert "Traceback" not in msg, msg
    torch.distributed.barrier()
    assert [c.step for c in ck.list_checkpoints(root)] == [0], os.listdir(root)
    assert _dot_entries(root) == [], os.listdir(root)
    back = {"w": rf.distribute_tensor(torch.zeros(256, 256), mesh, [rf.RaggedShard((0,), (64, 192), 1)])}
    ck.load_latest(root, back)
    assert torch.equal(back["w"].full_tensor(), t)
    ck.save({"w": w}, root)  # the group still works and the lock was dropped


def case_ranks_pass_different_roots(rank, world):
    # each rank names its own directory: refused on every rank before anything is written,
    # naming both directories (never published under rank 0's root with rank 1 handed a
    # Checkpoint pointing there)
    roots = [_shared(f"roots_differ_{r}") for r in range(world)]
    with pytest.raises(ValueError) as e:
        ck.save({"w": torch.ones(4)}, roots[rank], step=0)
    msg = str(e.value)
    assert all(r in msg for r in roots) and "same root on every rank" in msg and "nothing was written" in msg, msg
    torch.distributed.barrier()
    assert not any(os.path.exists(r) for r in roots), [os.listdir(r) for r in roots if os.path.exists(r)]
    # the same directory spelled differently (relative on one rank) is one root
    same = _shared("roots_same")
    spelled = same if rank == 0 else os.path.relpath(same)
    c = ck.save({"w": torch.ones(4)}, spelled, step=0)
    assert os.path.abspath(c.path) == os.path.join(same, "step-0000000000")


def case_checkpoint_removed_mid_read_in_a_group(rank, world):
    # rank 0 moves the checkpoint out of the listing as it starts reading (what a concurrent
    # save's retention does): every rank gets the same clear FileNotFoundError, none hangs
    from torch.distributed.device_mesh import init_device_mesh

    import ragged_fsdp as rf

    mesh = init_device_mesh("cpu", (world,))
    root = _shared("removed_mid_read")
    t = torch.arange(64.0).view(8, 8)
    c = ck.save({"w": rf.distribute_tensor(t, mesh, [rf.RaggedShard((0,), (3, 5), 1)])}, root)
    own = vars(ck.ChecksummedReader).get("read_data")
    real = ck.ChecksummedReader.read_data

    def read_data(reader, plan, planner):
        os.rename(c.path, os.path.join(root, ".deleting-by-test"))
        return real(reader, plan, planner)

    back = {"w": rf.distribute_tensor(torch.zeros(8, 8), mesh, [rf.RaggedShard((0,), (3, 5), 1)])}
    if rank == 0:
        ck.ChecksummedReader.read_data = read_data
    try:
        with pytest.raises(FileNotFoundError, match="removed while it was being read .* Call load_latest again"):
            ck.load_latest(root, back)
    finally:
        if rank == 0:
            if own is None:
                del ck.ChecksummedReader.read_data
            else:
                ck.ChecksummedReader.read_data = own
    torch.distributed.barrier()


CASES = [case_rank_cannot_write, case_ranks_pass_different_roots, case_checkpoint_removed_mid_read_in_a_group]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ["RAGGED_TEST_TMP"] = str(tmp_path_factory.mktemp("rel_ckpt"))
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_dist(results, case):
    check_case(results, case, 2)


def test_async_save_failure_is_a_library_error(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full)
    where = tmp_path / "async"
    fut = ck.async_save({"w": torch.ones(8)}, checkpoint_id=where, no_dist=True)
    with pytest.raises(ck.CheckpointSaveError, match=r"rank\(s\) \[0\]: OSError: \[Errno 28\] No space") as e:
        fut.result(timeout=120)
    assert "Traceback" not in str(e.value) and isinstance(e.value.__cause__, OSError)
    assert not where.exists()  # this call created it: removed
    monkeypatch.undo()
    ck.async_save({"w": torch.ones(8)}, checkpoint_id=where, no_dist=True).result(timeout=120)
    assert torch.equal(ck.read_full(where)["w"], torch.ones(8))
