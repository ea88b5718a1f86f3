"""Bad input at the command line and in the demo's optimizer, in this process.

Every refusal is one line on stderr that names the path or argument and the problem, with
a non-zero exit code and no traceback; nothing is launched or written first.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn as nn

import ragged_fsdp.checkpoint as ck
from ragged_fsdp.cli import main


def _refused(capsys, argv, *needles):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc != 0, f"{argv}: exit code 0\n{out}{err}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], f"{argv}: {n!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def ckpt_dir(tmp_path):
    state = {"model": {"w": torch.arange(2000, dtype=torch.float32).view(40, 50), "b": torch.ones(7)}, "step": 3}
    return ck.save(state, tmp_path / "root").path


# -- ckpt ------------------------------------------------------------------------------------

def test_ckpt_convert_to_missing_output_directory(capsys, ckpt_dir, tmp_path):
    out = tmp_path / "no" / "such" / "dir" / "model.pt"
    _refused(capsys, ["ckpt", "convert", ckpt_dir, str(out)], str(out.parent), "does not exist")
    assert not out.parent.exists()


def test_ckpt_convert_non_torch_file(capsys, tmp_path):
    src = tmp_path / "notes.txt"
    src.write_text("hello, this is not a checkpoint\n" * 10)
    _refused(capsys, ["ckpt", "convert", str(src), str(tmp_path / "out")], str(src), "torch.save file")
    assert not (tmp_path / "out").exists()


def test_ckpt_truncated_metadata(capsys, ckpt_dir):
    md = os.path.join(ckpt_dir, ".metadata")
    data = open(md, "rb").read()
    with open(md, "wb") as f:
        f.write(data[: len(data) // 3])
    for argv in (["ckpt", "info", ckpt_dir], ["ckpt", "convert", ckpt_dir, os.path.join(os.path.dirname(ckpt_dir), "x.pt")]):
        _refused(capsys, argv, md, "cannot be read")
    with pytest.raises(ck.CheckpointCorruptError, match="truncated"):
        ck.load_latest(os.path.dirname(ckpt_dir))


def test_ckpt_missing_paths(capsys, tmp_path):
    missing = str(tmp_path / "nothing")
    _refused(capsys, ["ckpt", "info", missing], missing, "does not exist")
    _refused(capsys, ["ckpt", "convert", missing, str(tmp_path / "x.pt")], missing, "does not exist")
    _refused(capsys, ["ckpt", "ls", missing], missing, "does not exist")


def test_ckpt_checksums_reported_and_verified(capsys, ckpt_dir, tmp_path):
    assert main(["ckpt", "info", ckpt_dir]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 stored items with a CRC-32" in out, out
    # flip one 4-byte word inside w's data: convert refuses, naming file and key
    md = ck.read_metadata(ckpt_dir)
    info = next(s for i, s in md.storage_data.items() if i.fqn == "model.w")
    path = os.path.join(ckpt_dir, info.relative_path)
    blob = bytearray(open(path, "rb").read())
    at = blob.find(torch.arange(2000, dtype=torch.float32).numpy().tobytes(), info.offset)
    assert at >= 0
    blob[at + 4000:at + 4004] = b"\x00\x00\xc0\x7f"  # a NaN where 1000.0 was
    open(path, "wb").write(blob)
    _refused(capsys, ["ckpt", "convert", ckpt_dir, str(tmp_path / "m.pt")], info.relative_path, "model.w", "CRC-32")
    assert not (tmp_path / "m.pt").exists()


def test_save_refuses_before_writing_without_a_process_group(tmp_path):
    root = tmp_path / "root"
    for kw, needle in [({"step": -3}, "negative"), ({"keep_last": 0}, "keep_last=0"), ({"step": "7"}, "integer")]:
        with pytest.raises(ValueError, match=needle):
            ck.save({"x": torch.zeros(2)}, root, **kw)
    assert not root.exists()


# -- demo and plan ---------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 0)
    return launched


@pytest.mark.parametrize("argv, needles", [
    (["demo", "--steps", "0"], ["--steps 0", "at least one"]),
    (["demo", "--nproc", "3"], ["--batch 16", "3 ranks", "--batch 15 or 18"]),
    (["demo", "--nproc", "0"], ["--nproc 0", "at least one rank"]),
    (["demo", "--nproc", "-2"], ["--nproc -2"]),
    (["demo", "--batch", "0"], ["--batch 0"]),
])
def test_demo_refuses_before_launching(capsys, no_launch, argv, needles):
    _refused(capsys, argv, *needles)
    assert no_launch == []


def test_demo_passes_batch_to_the_ranks(capsys, no_launch):
    assert main(["demo", "--nproc", "3", "--batch", "15", "--steps", "2"]) == 0
    (cmd,) = no_launch
    assert "--nproc_per_node=3" in cmd and cmd[cmd.index("--batch") + 1] == "15"


@pytest.mark.parametrize("world", ["10000000", "131073"])
def test_plan_bounds_the_world_size(capsys, world):
    _refused(capsys, ["plan", "--world", world], world, "131072", "grow linearly")


# -- Muon's weight decay: one rule, visible in the groups and in the update -----------------

def _groups():
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(6, 5)), nn.Parameter(torch.randn(5))
    return w, b, [{"params": [w]}, {"params": [b], "use_muon": False, "lr": 0.1}]


def _decay_after_one_step(opt, b):
    """AdamW with a zero gradient only decays: b <- b * (1 - lr * wd)."""
    before = b.detach().clone()
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    return 1 - (b.detach() / before).mean().item()


@pytest.mark.parametrize("kwargs, muon_wd, adamw_wd", [
    ({}, 0.1, 0.01),                                            # each optimizer's own default
    ({"weight_decay": 0.3}, 0.3, 0.3),                          # explicit: the whole model
    ({"weight_decay": 0.3, "adamw_defaults": {"weight_decay": 0.05}}, 0.3, 0.05),
])
def test_muon_weight_decay_rule(kwargs, muon_wd, adamw_wd):
    from ragged_fsdp.optim import Muon

    w, b, groups = _groups()
    opt = Muon(groups, lr=0.02, **kwargs)
    assert opt.param_groups[0]["weight_decay"] == muon_wd
    assert opt.param_groups[1]["weight_decay"] == adamw_wd
    assert _decay_after_one_step(opt, b) == pytest.approx(0.1 * adamw_wd, rel=1e-3)  # fp32


def test_muon_group_weight_decay_wins():
    from ragged_fsdp.optim import Muon

    w, b, groups = _groups()
    groups[1]["weight_decay"] = 0.0
    opt = Muon(groups, lr=0.02, weight_decay=0.3)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert _decay_after_one_step(opt, b) == 0.0


def test_demo_muon_decays_every_group_like_adamw():
    """The demo's --optimizer muon gives its AdamW groups the 0.1 of its --optimizer adamw."""
    from ragged_fsdp import train

    cfg = train.TrainConfig(dim=32, layers=1, hidden=64, seq_len=16)
    model = train.build_model(cfg)
    for name in ("muon", "adamw"):
        opt = train.build_optimizer(name, model, 1e-3)
        assert {g["weight_decay"] for g in opt.param_groups} == {0.1}, name
