"""Saves and loads that overlap.

* two ``async_save`` calls of one process on one ``checkpoint_id``: the second is refused
  while the first runs (made repeatable by holding the first inside its write on an event),
  so a failing first save cannot delete what a second one wrote, and a future that reports
  success has a whole checkpoint behind it;
* a reader looping ``load_latest`` while another process saves with ``keep_last=1``: every
  load returns a whole checkpoint or raises the library's own error, never a raw
  ``AssertionError`` / ``FileNotFoundError`` from inside DCP.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ragged_fsdp.checkpoint as ck

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


class _Held:
    """Makes the next ``FileSystemWriter.write_data`` wait on an event, then fail or go on."""

    def __init__(self, monkeypatch, fail: bool):
        self.entered, self.release, self.fail = threading.Event(), threading.Event(), fail
        real = dcp.FileSystemWriter.write_data
        held = self

        def write_data(writer, plan, planner):
            if not held.entered.is_set():  # only the first save waits
                held.entered.set()
                assert held.release.wait(60), "the test never released the first save"
                if held.fail:
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real(writer, plan, planner)

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)


@pytest.mark.parametrize("first_fails", [True, False], ids=["first-fails", "first-succeeds"])
def test_overlapping_async_saves_on_one_id_are_refused(tmp_path, monkeypatch, first_fails):
    where = tmp_path / "ckpt"
    held = _Held(monkeypatch, fail=first_fails)
    first = ck.async_save({"w": torch.full((64,), 1.0)}, checkpoint_id=where, no_dist=True)
    assert held.entered.wait(60)  # the first save is inside its write, on the event
    for spelled in (where, str(where) + "/", os.path.relpath(where)):  # one target, however named
        with pytest.raises(ck.CheckpointSaveError) as e:
            ck.async_save({"w": torch.full((64,), 2.0)}, checkpoint_id=spelled, no_dist=True)
        msg = str(e.value)
        assert str(where) in msg and "wait for the first future" in msg and "Nothing was written" in msg, msg
    held.release.set()
    if first_fails:
        with pytest.raises(ck.CheckpointSaveError, match="No space left"):
            first.result(timeout=120)
        assert not where.exists()  # the first save created it; nobody else wrote there
    else:
        first.result(timeout=120)
        assert torch.equal(ck.read_full(where)["w"], torch.full((64,), 1.0))
    # once the first future is done, the id takes a new save, and its success means a whole
    # checkpoint
    ck.async_save({"w": torch.full((64,), 3.0)}, checkpoint_id=where, no_dist=True).result(timeout=120)
    assert torch.equal(ck.read_full(where)["w"], torch.full((64,), 3.0))


def test_a_failed_async_save_keeps_files_it_did_not_write(tmp_path, monkeypatch):
    where = tmp_path / "ckpt"
    where.mkdir()
    (where / "notes.txt").write_text("someone else's")
    held = _Held(monkeypatch, fail=True)
    held.release.set()
    with pytest.raises(ck.CheckpointSaveError):
        ck.async_save({"w": torch.ones(4)}, checkpoint_id=where, no_dist=True).result(timeout=120)
    assert (where / "notes.txt").read_text() == "someone else's"


# -- a reader during retention --------------------------------------------------------------

_WRITER = """
import os, sys, time
import torch
import ragged_fsdp.checkpoint as ck
root, sync, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ck.save({"w": torch.full((256, 64), -1.0), "step": -1}, root, keep_last=1)
open(os.path.join(sync, "ready.writer"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):
    time.sleep(0.001)
for i in range(n):
    ck.save({"w": torch.full((256, 64), float(i)), "step": i}, root, keep_last=1)
open(os.path.join(sync, "done"), "w").close()
"""

_READER = """
import json, os, sys, time, warnings
import torch
import ragged_fsdp.checkpoint as ck
warnings.simplefilter("ignore")
root, sync, limit_s, max_loads = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
open(os.path.join(sync, "ready.reader"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):
    time.sleep(0.001)
out = {"ok": 0, "library": [], "raw": [], "wrong": []}
t0 = time.monotonic()
while len(out["library"]) + len(out["raw"]) + out["ok"] < max_loads and time.monotonic() - t0 < limit_s:
    writer_done = os.path.exists(os.path.join(sync, "done"))
    state = {"w": torch.empty(256, 64), "step": 0}
    try:
        c = ck.load_latest(root, state)
    except (ck.CheckpointCorruptError, ck.CheckpointMismatchError, ck.CheckpointSaveError) as e:
        out["library"].append(f"{type(e).__name__}: {e}"[:300])
    except FileNotFoundError as e:
        # load_latest's own "no published checkpoint under ..." is a clear answer; one from
        # inside DCP (a file vanishing mid-read) is not
        (out["library"] if str(e).startswith("load_latest:") else out["raw"]).append(f"FileNotFoundError: {e}"[:300])
    except BaseException as e:
        out["raw"].append(f"{type(e).__name__}: {e}"[:300])
    else:
        if not torch.equal(state["w"], torch.full((256, 64), float(state["step"]))):
            out["wrong"].append(c.path)
        else:
            out["ok"] += 1
    if writer_done:
        break
print(json.dumps(out))
"""


def test_reader_during_retention_gets_whole_checkpoints_or_clear_errors(tmp_path):
    root, sync = tmp_path / "r", tmp_path / "sync"
    sync.mkdir()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(sync), "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(root), str(sync), "240", "3000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = [writer, reader]
    try:
        # both go together once both have imported torch (and the first checkpoint exists)
        deadline = time.monotonic() + 300
        while len(list(sync.glob("ready.*"))) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.01)
        (sync / "go").touch()
        w_out, w_err = writer.communicate(timeout=300)
        r_out, r_err = reader.communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert writer.returncode == 0, w_err[-3000:]
    assert reader.returncode == 0, r_err[-3000:]
    out = json.loads(r_out.strip().splitlines()[-1])
    print(f"reader: {out['ok']} whole loads, {len(out['library'])} library errors, {len(out['raw'])} raw")
    assert out["raw"] == [] and out["wrong"] == [], (out["raw"][:5], out["wrong"][:5])
    assert out["ok"] >= 1
    # there is always a published checkpoint; the one clear error allowed is the reader's
    # "removed while it was being read N times in a row" (a loaded machine can have the
    # writer retire the reader's pick several times over)
    others = [e for e in out["library"] if "removed while it was being read" not in e]
    assert others == [], others[:5]
    assert [c.step for c in ck.list_checkpoints(root)] == [60]
    assert sorted(n for n in os.listdir(root) if n.startswith(".")) == []


def _retention_during_first_read(monkeypatch, root):
    """On the first item read, do what a concurrent ``save(keep_last=1)`` does: publish a
    newer step, then rename the one being read out of the listing and delete it."""
    real = ck.ChecksummedReader.read_data
    calls = []

    def read_data(reader, plan, planner):
        calls.append(os.fspath(reader.path))
        if len(calls) == 1:
            monkeypatch.setattr(ck.ChecksummedReader, "read_data", real)
            ck.save({"w": torch.full((8,), 2.0)}, root, keep_last=1)
        return real(reader, plan, planner)

    monkeypatch.setattr(ck.ChecksummedReader, "read_data", read_data)
    return calls


def test_checkpoint_removed_mid_read_is_retried_from_a_new_listing(tmp_path, monkeypatch):
    root = tmp_path / "r"
    ck.save({"w": torch.full((8,), 1.0)}, root)
    calls = _retention_during_first_read(monkeypatch, root)
    state = {"w": torch.zeros(8)}
    c = ck.load_latest(root, state)
    assert c.step == 1 and torch.equal(state["w"], torch.full((8,), 2.0))
    assert [os.path.basename(p) for p in calls] == ["step-0000000000"]  # the first pick vanished
    # strict=False may leave entries of the vanished one: a clear error, no retry
    calls = _retention_during_first_read(monkeypatch, root)
    with pytest.raises(FileNotFoundError, match="removed while it was being read .* Call load_latest again"):
        ck.load_latest(root, {"w": torch.zeros(8)}, strict=False)


def test_retry_without_state_and_its_bound(tmp_path, monkeypatch):
    root = tmp_path / "r"
    ck.save({"w": torch.full((8,), 1.0)}, root)
    _retention_during_first_read(monkeypatch, root)
    c = ck.load_latest(root)  # no state: read_full, retried the same way
    assert c.step == 1 and torch.equal(c.state["w"], torch.full((8,), 2.0))
    # a writer that always deletes the pick before it is read: 5 listings, then a clear error
    real = ck.ChecksummedReader.read_data
    picks = []

    def always(reader, plan, planner):
        picks.append(os.path.basename(os.fspath(reader.path)))
        ck.save({"w": torch.full((8,), 3.0)}, root, keep_last=1)
        return real(reader, plan, planner)

    monkeypatch.setattr(ck.ChecksummedReader, "read_data", always)
    with pytest.raises(FileNotFoundError, match="removed while it was being read 5 times in a row"):
        ck.load_latest(root, {"w": torch.zeros(8)})
    assert len(set(picks)) == len(picks) == 5
