"""The local save refuses what it did not write, on every rank, and never mixes two saves.

One launch at W=2: a flipped byte in rank 1's part, a truncated part and a garbage ``.meta``
each raise a ``LocalCheckpointCorruptError`` naming the file and the saved rank on *both*
ranks (agreed: the rank that reads a good file does not go on alone) and change nothing on
either rank; a lost part (rank 1's part of a save lost, the next state saved into
the same directory) is refused on both ranks and loads nothing mixed; a part copied in from
another save is refused at load by its save id; a write that fails on one rank raises on both
and leaves no part behind; plain values that differ per rank come back per rank; a symlink and
its target name one root for ``checkpoint.save``. In-process: ``ckpt info / ls / convert`` on a
local save.
"""

from __future__ import annotations

import os
import shutil
import zipfile

import pytest
import torch
import torch.distributed as dist

from _dist import run_cases

ENV = "RAGGED_LOCAL_INTEGRITY_DIR"


def _model(seed):
    from ragged_fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    m = Llama(LlamaConfig.tiny(n_layers=1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(m, mesh=mesh, granularity_fn=lambda n, p: "row")
    return m


def _full(m):
    return {k: v.full_tensor() for k, v in m.state_dict().items()}


def _dir(name):
    return os.path.join(os.environ[ENV], name)


def _part(d, rank, ext, world=2):
    return os.path.join(d, f"part-{rank:05d}-of-{world:05d}.{ext}")


def _largest_record_offset(path):
    """(file offset, length) of the largest stored record of a torch.save zip: tensor data."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _damaged_load_raises(d, damage, match):
    """Save, let rank 0 damage the directory, load on both ranks: both raise ``match``, and
    neither rank's model changed."""
    from ragged_fsdp.checkpoint import CheckpointCorruptError, LocalCheckpointError, load_local, save_local

    save_local(_model(1).state_dict(), d)
    dist.barrier()
    if dist.get_rank() == 0:
        damage(d)
    dist.barrier()
    m = _model(2)
    before = _full(m)
    with pytest.raises(LocalCheckpointError, match=match) as info:
        load_local(m.state_dict(), d)
    after = _full(m)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed although the load raised"
    return info.value, CheckpointCorruptError


def case_flipped_byte_in_rank1_part(rank, world):
    def flip(d):
        p = _part(d, 1, "pt")
        off, n = _largest_record_offset(p)
        with open(p, "r+b") as f:
            f.seek(off + n // 2)
            b = f.read(1)
            f.seek(off + n // 2)
            f.write(bytes([b[0] ^ 0x40]))

    err, corrupt = _damaged_load_raises(_dir("flip"), flip, r"part-00001-of-00002\.pt \(saved rank 1\).*CRC-32")
    assert isinstance(err, corrupt)  # also a CheckpointCorruptError, as the DCP path raises


def case_truncated_part(rank, world):
    def truncate(d):
        p = _part(d, 1, "pt")
        os.truncate(p, os.path.getsize(p) // 2)

    _damaged_load_raises(_dir("trunc"), truncate, r"part-00001-of-00002\.pt \(saved rank 1\) cannot be read.*truncated")


def case_garbage_meta(rank, world):
    def garbage(d):
        with open(_part(d, 1, "meta"), "wb") as f:
            f.write(b"\x80\x04garbage" * 10)

    _damaged_load_raises(_dir("garbage1"), garbage, r"part-00001-of-00002\.meta \(saved rank 1\) is not a local-save")

    def edit(d):
        p = _part(d, 0, "meta")
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 1
        open(p, "wb").write(bytes(data))

    _damaged_load_raises(_dir("garbage0"), edit, r"part-00000-of-00002\.meta \(saved rank 0\): its bytes fail their CRC-32")

    def cut(d):
        p = _part(d, 0, "meta")
        os.truncate(p, os.path.getsize(p) - 7)

    _damaged_load_raises(_dir("cut0"), cut, r"part-00000-of-00002\.meta \(saved rank 0\) is truncated")


def case_lost_part_then_next_save_is_refused_everywhere(rank, world):
    """Rank 1's part of save A is lost, save B goes to the same directory."""
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local, save_local

    d = _dir("lost")
    save_local(_model(1).state_dict(), d)
    dist.barrier()
    if rank == 1:
        os.remove(_part(d, 1, "meta"))
        os.remove(_part(d, 1, "pt"))
    dist.barrier()
    with pytest.raises(LocalCheckpointError, match="a directory holds one save"):
        save_local(_model(2).state_dict(), d)  # refused on both ranks, not only where a part exists
    dist.barrier()
    assert sorted(os.listdir(d)) == ["part-00000-of-00002.meta", "part-00000-of-00002.pt"]  # nothing of save B
    m = _model(3)
    before = _full(m)
    with pytest.raises(LocalCheckpointError, match=r"incomplete: 1 of 2 parts missing \(ranks \[1\]"):
        load_local(m.state_dict(), d)
    assert all(torch.equal(before[k], v) for k, v in _full(m).items())


def case_part_of_another_save_is_refused_at_load(rank, world):
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local, save_local

    a, b = _dir("mix_a"), _dir("mix_b")
    save_local(_model(1).state_dict(), a)
    save_local(_model(2).state_dict(), b)
    dist.barrier()
    if rank == 0:  # rank 1's part of save B replaces save A's: every file whole and valid
        for ext in ("pt", "meta"):
            shutil.copyfile(_part(b, 1, ext), _part(a, 1, ext))
    dist.barrier()
    m = _model(3)
    before = _full(m)
    with pytest.raises(LocalCheckpointError, match=r"part-00001-of-00002\.meta is from another save .* mixes two saves"):
        load_local(m.state_dict(), a)
    assert all(torch.equal(before[k], v) for k, v in _full(m).items())


def case_only_the_pt_of_another_save(rank, world):
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local, save_local

    a, b = _dir("pt_a"), _dir("pt_b")
    save_local(_model(1).state_dict(), a)
    save_local(_model(2).state_dict(), b)
    dist.barrier()
    if rank == 0:
        shutil.copyfile(_part(b, 1, "pt"), _part(a, 1, "pt"))
    dist.barrier()
    with pytest.raises(LocalCheckpointError, match=r"part-00001-of-00002\.pt \(saved rank 1\) is from another save"):
        load_local(_model(3).state_dict(), a)


def case_write_failure_on_one_rank_raises_everywhere(rank, world):
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local, save_local

    d = _dir("wfail")
    os.makedirs(d, exist_ok=True)
    if rank == 1:  # rank 1 cannot create its temporary file: a directory is in the way
        os.makedirs(_part(d, 1, "pt") + f".tmp.{os.getpid()}")
    dist.barrier()
    with pytest.raises((LocalCheckpointError, OSError)) as info:
        save_local(_model(1).state_dict(), d)
    if rank == 0:
        assert "failed on rank 1" in str(info.value), info.value
    dist.barrier()
    assert not [n for n in os.listdir(d) if n.endswith((".pt", ".meta"))], os.listdir(d)  # rank 0 removed its part
    dist.barrier()
    if rank == 1:
        os.rmdir(_part(d, 1, "pt") + f".tmp.{os.getpid()}")
    dist.barrier()
    m = _model(1)
    save_local(m.state_dict(), d)  # the directory is usable again
    m2 = _model(2)
    load_local(m2.state_dict(), d)
    ref = _full(m)
    assert all(torch.equal(ref[k], v) for k, v in _full(m2).items())


def case_bad_value_on_one_rank_raises_everywhere(rank, world):
    from ragged_fsdp.checkpoint import LocalCheckpointError, save_local

    d = _dir("badvalue")
    sd = dict(_model(1).state_dict())
    if rank == 1:
        sd["pair"] = (torch.zeros(1), torch.ones(1))  # a tuple holding tensors: refused
    with pytest.raises(LocalCheckpointError, match="tuple holding tensors" if rank == 1 else "failed on rank 1"):
        save_local(sd, d)
    assert not os.path.exists(d) or not os.listdir(d)


def case_values_that_differ_per_rank(rank, world):
    from ragged_fsdp.checkpoint import load_local, save_local

    d = _dir("perrank")
    m = _model(1)
    sd = {"model": m.state_dict(), "rng": torch.tensor([10 + rank, 7]), "tag": f"rank{rank}", "lr": 0.5,
          "shared": torch.arange(4.0)}
    save_local(sd, d)
    m2 = _model(2)
    sd2 = {"model": m2.state_dict(), "rng": torch.zeros(2, dtype=torch.int64), "tag": "", "lr": 0.0,
           "shared": torch.zeros(4)}
    load_local(sd2, d)
    assert sd2["rng"].tolist() == [10 + rank, 7] and sd2["tag"] == f"rank{rank}" and sd2["lr"] == 0.5
    assert torch.equal(sd2["shared"], torch.arange(4.0))
    ref = _full(m)
    assert all(torch.equal(ref[k], v) for k, v in _full(m2).items())
    # the equal plain tensor is stored once (rank 0's part), the differing one by each rank
    from ragged_fsdp.checkpoint.local_save import HEADER_KEY

    part = torch.load(_part(d, rank, "pt"), weights_only=True)
    assert "rng" in part and (("shared" in part) == (rank == 0)) and HEADER_KEY in part


def case_symlink_and_target_are_one_root(rank, world):
    from ragged_fsdp.checkpoint import latest_checkpoint, save

    target = _dir("real_root")
    link = _dir("link_root")
    if rank == 0:
        os.makedirs(target, exist_ok=True)
        os.symlink(target, link)
    dist.barrier()
    m = _model(1)
    c = save({"model": m.state_dict()}, link if rank == 0 else target)
    assert os.path.realpath(c.path).startswith(os.path.realpath(target))
    assert latest_checkpoint(target).step == c.step


def _edit_part_pickle(d, edit):
    """Apply ``edit`` to the pickled record (tensor headers, the part header) of rank 1's part,
    in place, its length unchanged."""
    p = _part(d, 1, "pt")
    with zipfile.ZipFile(p) as z:
        name = next(n for n in z.namelist() if n.endswith("data.pkl"))
        pkl = z.read(name)
    data = bytearray(open(p, "rb").read())
    at = bytes(data).index(pkl)
    new = edit(bytearray(pkl))
    assert len(new) == len(pkl) and new != pkl
    data[at:at + len(pkl)] = new
    open(p, "wb").write(bytes(data))


def case_corrupt_tensor_header(rank, world):
    """Two bytes of a stored tensor's header (its size and stride), or of the part header's
    ``crc32`` key: a LocalCheckpointCorruptError naming the file and the saved rank, on both
    ranks (was a raw ``self.stride(-1) must be 1`` / ``KeyError: 'crc32'``, no file named)."""
    import re

    def stride(d):
        def edit(pkl):
            m = re.search(rb"K([\x04-\xff])\x85q.K\x01\x85", bytes(pkl), re.S)  # size (n,), stride (1,)
            pkl[m.start(1)] = pkl[m.start(1)] // 2
            pkl[m.end() - 2] = 2
            return pkl
        _edit_part_pickle(d, edit)

    def key(d):
        _edit_part_pickle(d, lambda pkl: bytearray(bytes(pkl).replace(b"crc32", b"crcXX")))

    for name, damage, says in (("hdr_stride", stride, r"stored tensor .* cannot be read back"),
                               ("hdr_key", key, r"no valid part header")):
        err, corrupt = _damaged_load_raises(_dir(name), damage, r"part-00001-of-00002\.pt")
        assert isinstance(err, corrupt), repr(err)
        import re as _re
        assert _re.search(says, str(err)) and ("saved rank 1" in str(err)), str(err)
        if rank == 0:
            assert "failed on rank 1" in str(err), str(err)


def case_save_into_dangling_symlink(rank, world):
    from ragged_fsdp.checkpoint import LocalCheckpointError, save_local

    link = _dir("dangling")
    if rank == 0:
        os.symlink(_dir("nowhere"), link)
    dist.barrier()
    with pytest.raises(LocalCheckpointError, match="symbolic link to .*nowhere.*which does not exist"):
        save_local(_model(1).state_dict(), link)
    assert not os.path.exists(_dir("nowhere"))


def case_directory_per_rank_refused(rank, world):
    """A different directory per rank (two unloadable halves before): refused on every rank,
    naming each rank's directory; nothing is written."""
    from ragged_fsdp.checkpoint import LocalCheckpointError, save_local

    with pytest.raises(LocalCheckpointError, match="different directories") as info:
        save_local(_model(1).state_dict(), _dir(f"half{rank}"))
    assert f"rank 0: {os.path.realpath(_dir('half0'))}" in str(info.value), str(info.value)
    assert f"rank 1: {os.path.realpath(_dir('half1'))}" in str(info.value), str(info.value)
    dist.barrier()
    for r in range(world):
        assert not os.path.exists(_dir(f"half{r}")) or not os.listdir(_dir(f"half{r}"))


def case_directory_another_job_writes_refused(rank, world):
    """Another job holds the directory's lock (its rank 0 is writing there): refused on every
    rank, nothing written; once it is released the save goes through."""
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local, lock, save_local

    d = _dir("locked")
    if rank == 0:
        os.makedirs(d)
        lock.acquire(d, lock.holder_record("other-job", d, 2))  # a live holder: this very process
    dist.barrier()
    m = _model(1)
    with pytest.raises(OSError if rank == 0 else LocalCheckpointError, match="locked by another writer"):
        save_local(m.state_dict(), d)
    assert not [n for n in os.listdir(d) if n.endswith((".pt", ".meta"))]
    dist.barrier()
    if rank == 0:
        lock.release(d, "other-job")
    dist.barrier()
    save_local(m.state_dict(), d)
    m2 = _model(2)
    load_local(m2.state_dict(), d)
    ref = _full(m)
    assert all(torch.equal(ref[k], v) for k, v in _full(m2).items())


CASES = [case_corrupt_tensor_header, case_save_into_dangling_symlink, case_directory_per_rank_refused,
         case_directory_another_job_writes_refused,
         case_flipped_byte_in_rank1_part, case_truncated_part, case_garbage_meta,
         case_lost_part_then_next_save_is_refused_everywhere, case_part_of_another_save_is_refused_at_load,
         case_only_the_pt_of_another_save, case_write_failure_on_one_rank_raises_everywhere,
         case_bad_value_on_one_rank_raises_everywhere, case_values_that_differ_per_rank,
         case_symlink_and_target_are_one_root]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ[ENV] = str(tmp_path_factory.mktemp("local_integrity"))
    res = run_cases(2, CASES, timeout=300)
    return {k.rsplit(".", 1)[1]: v for k, v in res.items()}


@pytest.mark.parametrize("case", [c.__name__ for c in CASES])
def test_local_save_integrity(results, case):
    if results[case]:
        pytest.fail(results[case], pytrace=False)


# -- the command line on a local save (one process, no process group) -----------------------
def _cli(*args):
    import argparse

    from ragged_fsdp.cli import ckpt as cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    return cli.run(parser.parse_args(["ckpt", *map(str, args)]))


def _shown_bars(monkeypatch) -> list:
    """Every tqdm bar made from now on, shown (as on a terminal) into a string, not stderr."""
    import io

    import tqdm

    made = []

    class Shown(tqdm.tqdm):
        def __init__(self, *a, **k):
            k.update(disable=False, file=io.StringIO())
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(tqdm, "tqdm", Shown)
    return made


def test_ckpt_info_ls_convert_on_a_local_save(tmp_path, capsys, monkeypatch):
    from ragged_fsdp.checkpoint import save_local

    lin = torch.nn.Linear(3, 5)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = {"model": lin.state_dict(), "optim": opt.state_dict(), "epoch": 4}
    root = tmp_path / "ckpt"
    save_local(state, root / "step-10")
    assert _cli("info", root / "step-10") == 0
    out = capsys.readouterr().out
    assert "local save" in out and "model.weight  (5, 3)  float32" in out and "optim.state.0.exp_avg" in out
    assert "1 of 1 parts" in out and "CRC-32" in out
    assert _cli("ls", root) == 0
    out = capsys.readouterr().out
    assert "step-10" in out and "local save" in out
    assert _cli("convert", root / "step-10", tmp_path / "out.pt") == 0
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(got["model"]["weight"], lin.weight.detach()) and got["epoch"] == 4
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], opt.state[lin.weight]["exp_avg"])
    opt2 = torch.optim.AdamW(lin.parameters())
    opt2.load_state_dict(got["optim"])  # int parameter ids and lists kept
    assert _cli("convert", root / "step-10", tmp_path / "model.pt", "--key", "model") == 0
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == {"weight", "bias"}
    # the progress bar convert shows on a terminal: it ends at every tensor byte of the save
    bars = _shown_bars(monkeypatch)
    from ragged_fsdp.checkpoint import local_to_torch_save

    again = local_to_torch_save(root / "step-10", tmp_path / "again.pt", progress=True)
    assert torch.equal(again["model"]["weight"], got["model"]["weight"]) and again["epoch"] == 4
    tensor_bytes = sum(t.numel() * t.element_size() for t in (lin.weight, lin.bias)) * 3  # model, exp_avg, exp_avg_sq
    tensor_bytes += 2 * 4  # each parameter's step (a float32 scalar tensor)
    assert [(b.n, b.total) for b in bars] == [(tensor_bytes, tensor_bytes)], [(b.n, b.total) for b in bars]
    # a damaged part: one line naming it, exit code 2
    p = root / "step-10" / "part-00000-of-00001.meta"
    p.write_bytes(b"nonsense")
    capsys.readouterr()
    assert _cli("info", root / "step-10") == 2
    err = capsys.readouterr().err
    assert "part-00000-of-00001.meta" in err and "not a local-save .meta" in err
