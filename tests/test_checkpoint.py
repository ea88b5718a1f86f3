"""Checkpoint tools that need no process group, and a save killed part-way (2 gloo ranks).

* atomic ``save`` / ``load_latest`` / ``list_checkpoints``: new directory per save, publish by
  rename, leftovers of dead saves ignored and cleaned, ``keep_last``;
* ``load``: keys and shapes checked both ways, the keys named, nothing loaded on a mismatch;
* ``python -m ragged_fsdp ckpt convert`` both ways, ``ls``, ``info``;
* a rank SIGKILLed while it writes the second checkpoint: the first stays the latest and
  loads, the partial one is never listed, and the surviving rank 0 removes it.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ragged_fsdp.checkpoint as ck


def _model_and_optim(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _equal_trees(a, b, where="state"):
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            _equal_trees(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_trees(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _dead_writer_record(partial):
    """Mark ``partial`` as written by a process of this host that has exited."""
    import json

    from ragged_fsdp.checkpoint import lock

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    rec = lock.holder_record("deadbeef", partial.name, 1)
    rec["pid"] = proc.pid
    (partial / lock.WRITER).write_text(json.dumps(rec))


def test_atomic_save_publish_list_keep(tmp_path):
    root = tmp_path / "root"
    model, opt = _model_and_optim()
    steps = [ck.save({"model": model.state_dict(), "n": i}, root).step for i in range(3)]
    assert steps == [0, 1, 2]
    # debris a dead save leaves (its writer record names a process that has exited), and a
    # step directory without the completion marker
    debris = root / ".partial-step-0000000003-deadbeef"
    debris.mkdir()
    (debris / "__0_0.distcp").write_bytes(b"half")
    _dead_writer_record(debris)
    (root / "step-0000000009").mkdir()
    assert [c.step for c in ck.list_checkpoints(root)] == [0, 1, 2]
    with pytest.warns(ck.CheckpointWarning, match="skipped .*step-0000000009.*lacks the completion marker"):
        found = ck.load_latest(root)
    assert found.step == 2 and found.state["n"] == 2
    assert [p for p, _ in found.skipped] == [str(root / "step-0000000009")]
    _equal_trees(found.state["model"], model.state_dict())
    with pytest.raises(FileExistsError):
        ck.save({"n": 0}, root, step=1)
    last = ck.save({"model": model.state_dict(), "n": 3}, root, keep_last=2)
    assert last.step == 3 and last.path.endswith("step-0000000003")
    assert [c.step for c in ck.list_checkpoints(root)] == [2, 3]
    assert not [n for n in os.listdir(root) if n.startswith(".")], os.listdir(root)
    # a plain, unpublished directory is still a DCP checkpoint
    assert os.path.isfile(os.path.join(last.path, ".metadata"))
    assert ck.load_latest(tmp_path / "empty", missing_ok=True) is None
    with pytest.raises(FileNotFoundError, match="missing_ok=True"):
        ck.load_latest(tmp_path / "empty")


def test_load_names_every_mismatch_and_loads_nothing(tmp_path):
    model, opt = _model_and_optim()
    path = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    other = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.Linear(3, 3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    state = {"model": other.state_dict()}
    with pytest.raises(ck.CheckpointMismatchError) as e:
        ck.load(state, path)
    msg = str(e.value)
    for key in ("model.0.weight", "model.2.weight", "model.3.weight", "optim.*"):
        assert key in msg, msg
    assert e.value.missing == ["model.3.bias", "model.3.weight"]
    assert any("model.0.weight" in m and "(7, 5)" in m and "(8, 5)" in m for m in e.value.mismatched)
    _equal_trees(other.state_dict(), before)
    # a fresh optimizer has no state to load into: say so instead of skipping it
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(ck.CheckpointMismatchError, match="has not stepped"):
        ck.load({"model": fresh, "optim": fresh_opt}, path)
    # strict=False loads what matches (the model); Stateful values get load_state_dict
    ck.load({"model": fresh}, path, strict=False)
    _equal_trees(fresh.state_dict(), model.state_dict())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ragged_fsdp", "ckpt", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_cli_convert_both_ways(tmp_path):
    import argparse

    from ragged_fsdp.cli import ckpt as cli

    def run(*args):
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        cli.add_parser(sub)
        return cli.run(parser.parse_args(["ckpt", *map(str, args)]))

    model, opt = _model_and_optim()
    root = tmp_path / "root"
    ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4}, root)
    # DCP (a root: its newest checkpoint) -> one torch.save file
    assert run("convert", root, tmp_path / "all.pt") == 0
    full = torch.load(tmp_path / "all.pt", weights_only=True)
    _equal_trees(full["model"], model.state_dict())
    assert full["epoch"] == 4
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt2.load_state_dict(full["optim"])  # integer parameter ids are restored
    _equal_trees(opt2.state_dict(), opt.state_dict())
    # only the model: a plain load_state_dict input
    assert run("convert", root, tmp_path / "model.pt", "--key", "model") == 0
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    _equal_trees(plain.state_dict(), model.state_dict())
    # torch.save file -> DCP directory, nested under "model", then dcp.load
    assert run("convert", tmp_path / "model.pt", tmp_path / "back", "--key", "model") == 0
    again = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    state = {"model": again.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "back")
    _equal_trees(state["model"], model.state_dict())
    # ... or published as a new step of a root
    assert run("convert", tmp_path / "all.pt", root, "--root") == 0
    assert [c.step for c in ck.list_checkpoints(root)] == [0, 1]
    _equal_trees(ck.load_latest(root).state["model"], model.state_dict())
    # errors are one line, exit code 2
    assert run("convert", tmp_path / "missing", tmp_path / "x.pt") == 2
    assert run("convert", tmp_path / "model.pt", tmp_path / "back") == 2  # already a checkpoint
    # the real entry point
    out = _cli("ls", root)
    assert out.returncode == 0 and "step-0000000001" in out.stdout, out.stderr
    out = _cli("info", tmp_path / "back")
    assert out.returncode == 0 and "model.0.weight  (7, 5)  float32  1 chunk(s)" in out.stdout, out.stderr


# -- a rank killed during a save -----------------------------------------------------------
def _kill_worker(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import RaggedShard, distribute_tensor

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (world,))
    placement = [RaggedShard((0, 1), (23, 37))]
    t = torch.arange(60, dtype=torch.float32).view(6, 10)
    ck.save({"w": distribute_tensor(t, mesh, placement), "step": 0}, root)
    if rank == 1:  # die right after writing this rank's files of the next checkpoint
        write = dcp.FileSystemWriter.write_data

        def write_and_die(self, plan, planner):
            fut = write(self, plan, planner)
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.FileSystemWriter.write_data = write_and_die
    ck.save({"w": distribute_tensor(t + 1000, mesh, placement), "step": 1}, root)
    raise AssertionError("the second save must not complete")


def test_save_killed_part_way_leaves_previous_checkpoint(tmp_path):
    from _dist import worker_context

    root = str(tmp_path / "root")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = worker_context()  # a real process: SIGKILL is real
    procs = [ctx.Process(target=_kill_worker, args=(r, 2, port, root)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    assert procs[1].exitcode == -signal.SIGKILL, [p.exitcode for p in procs]
    assert procs[0].exitcode != 0
    # the surviving rank 0 saw its peer die in a collective: it removed the partial directory
    # and dropped the lock (a job killed whole leaves both: tests/test_reliability_checkpoint.py)
    names = os.listdir(root)
    assert not [n for n in names if n.startswith(".")], names
    assert [c.step for c in ck.list_checkpoints(root)] == [0]
    t = torch.arange(60, dtype=torch.float32).view(6, 10)
    found = ck.load_latest(root)
    assert found.step == 0 and found.state["step"] == 0 and torch.equal(found.state["w"], t)
    state = {"w": torch.zeros(6, 10), "step": -1}
    ck.load_latest(root, state)
    assert torch.equal(state["w"], t) and state["step"] == 0
    # the next save publishes step 1 and removes the debris
    assert ck.save({"w": t + 1, "step": 1}, root).step == 1
    assert not [n for n in os.listdir(root) if n.startswith(".")]


def test_cli_convert_refuses_to_overwrite_without_force(tmp_path, capsys):
    import argparse

    from ragged_fsdp.cli import ckpt as cli

    def run(*args):
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        cli.add_parser(sub)
        return cli.run(parser.parse_args(["ckpt", *map(str, args)]))

    root = tmp_path / "root"
    ck.save({"w": torch.arange(4.0)}, root)
    # DCP -> file: an existing file is kept, byte for byte, and the error names --force
    out = tmp_path / "existing.pt"
    out.write_bytes(b"precious")
    assert run("convert", root, out) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--force" in err, err
    assert out.read_bytes() == b"precious"
    assert run("convert", root, out, "--force") == 0
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(4.0))
    # file -> DCP: an existing checkpoint is kept, and the error names --force too
    torch.save({"w": torch.ones(4)}, tmp_path / "ones.pt")
    back = tmp_path / "back"
    assert run("convert", tmp_path / "ones.pt", back) == 0
    torch.save({"w": torch.zeros(4)}, tmp_path / "zeros.pt")
    before = {p.name: p.read_bytes() for p in back.iterdir()}
    assert run("convert", tmp_path / "zeros.pt", back) == 2
    err = capsys.readouterr().err
    assert str(back) in err and "--force" in err, err
    assert {p.name: p.read_bytes() for p in back.iterdir()} == before
    assert run("convert", tmp_path / "zeros.pt", back, "--force") == 0
    assert torch.equal(ck.read_full(back)["w"], torch.zeros(4))
    assert sorted(os.listdir(tmp_path)) == ["back", "existing.pt", "ones.pt", "root", "zeros.pt"]


def test_read_full_in_pieces_equals_one_read(tmp_path, monkeypatch):
    """``ckpt convert``'s progress reads the checkpoint in pieces (one DCP load each): with a
    piece size smaller than one tensor, every entry (tensors, optimizer ids, a plain value) is
    what a single read gives."""
    import ragged_fsdp.checkpoint.convert as conv

    model, opt = _model_and_optim()
    root = tmp_path / "root"
    ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4}, root)
    whole = ck.read_full(root)
    monkeypatch.setattr(conv, "PIECE_BYTES", 16)  # smaller than any tensor: one DCP load per entry
    _equal_trees(ck.read_full(root, progress=True), whole)
