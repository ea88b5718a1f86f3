"""Checkpoint patterns and bad input: argument checks on every rank, a missing
root, damaged files, checksums, strict=False shape mismatches, the DCP optimizer idiom, and
the demo's --batch at W=3.

One launch at W=3 (gloo, CPU): a rank that raised alone would leave the others waiting, so
every error case checks that *every* rank raised, and that nothing was written.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import check_case, run_cases

WORLD = 3


def _shared_dir():
    box = [tempfile.mkdtemp(prefix="ragged_ckpt_patterns_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 7))


def _sharded(seed=0):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _build(seed)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, steps=2):
    torch.manual_seed(5)
    for _ in range(steps):
        model(torch.randn(4, 40)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full_sd(model):
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _raises_everywhere(fn, exc, needle):
    """``fn`` raises ``exc`` whose message holds ``needle`` on this rank (every rank runs it).
    Failures are AssertionErrors: pytest's own are BaseExceptions, which would end the
    worker and hide the cases after this one."""
    try:
        fn()
    except exc as e:
        assert needle in str(e), str(e)
        assert "\n" not in str(e), f"one line expected: {e}"
        return e
    except BaseException as e:  # noqa: BLE001 - report whatever it was, keep the worker alive
        raise AssertionError(f"expected {exc.__name__} ({needle!r}), got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected {exc.__name__} ({needle!r}), nothing was raised")


# -- cases ----------------------------------------------------------------------------------

def case_save_validates_on_every_rank(rank, world):
    import ragged_fsdp.checkpoint as ck

    root = os.path.join(_shared_dir(), "root")
    model = _sharded()
    sd = {"model": model.state_dict()}
    for kwargs, needle in [
        ({"step": -3}, "step=-3 is negative"),
        ({"keep_last": 0}, "keep_last=0 would delete"),
        ({"step": 2.5}, "step=2.5 must be an integer"),
        ({"keep_last": True}, "keep_last=True must be an integer"),
    ]:
        _raises_everywhere(lambda: ck.save(sd, root, **kwargs), ValueError, needle)
    _raises_everywhere(lambda: ck.save([1], root), ValueError, "state must be a dict")
    # only one rank's argument is bad: every rank raises (before: the others hung)
    bad = {"keep_last": 0} if rank == 1 else {}
    _raises_everywhere(lambda: ck.save(sd, root, **bad), ValueError, "on rank(s) [1]")
    # ranks disagree on the step
    _raises_everywhere(lambda: ck.save(sd, root, step=rank), ValueError, "ranks passed different")
    dist.barrier()
    assert not os.path.exists(root) or not os.listdir(root), os.listdir(root)
    # and a good save still works afterwards, keep_last=1 keeps one
    for _ in range(2):
        ck.save(sd, root, keep_last=1)
    assert [c.step for c in ck.list_checkpoints(root)] == [1]


def case_load_latest_missing_root(rank, world):
    import ragged_fsdp.checkpoint as ck

    base = _shared_dir()
    state = {"model": _sharded().state_dict()}
    missing = os.path.join(base, "no_such_root")
    _raises_everywhere(lambda: ck.load_latest(missing, state), FileNotFoundError, "does not exist")
    assert ck.load_latest(missing, state, missing_ok=True) is None
    empty = os.path.join(base, "empty")
    if rank == 0:
        os.makedirs(empty)
    dist.barrier()
    _raises_everywhere(lambda: ck.load_latest(empty, state), FileNotFoundError, "no published checkpoint")
    assert ck.load_latest(empty, state, missing_ok=True) is None
    found = ck.save(state, os.path.join(base, "root"))
    _raises_everywhere(lambda: ck.load_latest(found.path, state), ValueError, "is a checkpoint directory itself")


def case_checksum_catches_a_flipped_word(rank, world):
    """4 bytes flipped inside one tensor's data: a clear error naming the file and key
    (before: loaded silently, NaN or garbage); untouched checkpoints load bitwise."""
    import ragged_fsdp.checkpoint as ck

    root = os.path.join(_shared_dir(), "root")
    model = _sharded()
    want = _full_sd(model)
    found = ck.save({"model": model.state_dict()}, root)
    md = ck.read_metadata(found.path)
    assert ck.count_checksums(md)[0] == ck.count_checksums(md)[1] > 0
    # an intact load at this W and, in one process, the whole checkpoint
    fresh = _sharded(seed=1)
    ck.load_latest(root, {"model": fresh.state_dict()})
    got = _full_sd(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want)
    if rank == 0:
        full = ck.read_full(found.path, "model")
        assert all(torch.equal(full[k], want[k]) for k in want)
        # flip 4 bytes in the middle of the first box of 0.weight (30x40) as stored
        key = "model.0.weight"
        index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == key)
        path = os.path.join(found.path, info.relative_path)
        blob = bytearray(open(path, "rb").read())
        off, size = tuple(index.offset), md.state_dict_metadata[key].chunks
        box = next(c for c in size if tuple(c.offsets) == off)
        raw = want["0.weight"][off[0]:off[0] + box.sizes[0], off[1]:off[1] + box.sizes[1]].contiguous()
        at = blob.find(raw.numpy().tobytes(), info.offset, info.offset + info.length)
        assert at >= 0, "test setup: tensor bytes not found in the item"
        mid = at + raw.numel() * 2 - 2
        blob[mid:mid + 4] = bytes(b ^ 0xFF for b in blob[mid:mid + 4])
        with open(path, "wb") as f:
            f.write(blob)
    dist.barrier()
    fresh = _sharded(seed=1)
    err = _raises_everywhere(lambda: ck.load_latest(root, {"model": fresh.state_dict()}),
                             ck.CheckpointCorruptError, "CRC-32")
    assert "model.0.weight" in str(err) and ".distcp" in str(err), str(err)
    if rank == 0:
        _raises_everywhere(lambda: ck.read_full(found.path), ck.CheckpointCorruptError, "model.0.weight")


def case_truncated_metadata(rank, world):
    import ragged_fsdp.checkpoint as ck

    root = os.path.join(_shared_dir(), "root")
    state = {"model": _sharded().state_dict()}
    found = ck.save(state, root)
    dist.barrier()
    if rank == 0:
        p = os.path.join(found.path, ".metadata")
        data = open(p, "rb").read()
        with open(p, "wb") as f:
            f.write(data[: len(data) // 2])
    dist.barrier()
    err = _raises_everywhere(lambda: ck.load_latest(root, state), ck.CheckpointCorruptError, ".metadata cannot be read")
    assert found.path in str(err)


def case_strict_false_shape_mismatch(rank, world):
    """load(strict=False) with a tensor of another shape: the library's error naming the key,
    not DCP's CheckpointException (a BaseException with tracebacks in its message)."""
    import ragged_fsdp.checkpoint as ck

    d = os.path.join(_shared_dir(), "root")
    found = ck.save({"model": _sharded().state_dict()}, d)
    other = nn.Sequential(nn.Linear(40, 31), nn.Tanh(), nn.Linear(31, 7))
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard

    fully_shard(other, mesh=init_device_mesh("cpu", (world,)))
    err = _raises_everywhere(lambda: ck.load({"model": other.state_dict()}, found.path, strict=False),
                             ck.CheckpointMismatchError, "model.0.weight")
    assert "saved (30, 40), here (31, 40)" in str(err), str(err)
    # keys on one side only are fine with strict=False: a model without the last layer
    part = {"model": {k: v for k, v in _sharded(seed=3).state_dict().items() if k.startswith("0.")}}
    ck.load(part, found.path, strict=False)


def case_dcp_idiom_drops_optimizer_state(rank, world):
    """What the README says: dcp.save of opt.state_dict() loaded into a *fresh* optimizer
    restores no state (torch's behaviour, no error); TrainState and load(strict=True) are the
    paths that restore it or say why not."""
    import torch.distributed.checkpoint as dcp

    import ragged_fsdp.checkpoint as ck

    base = _shared_dir()
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    n_states = sum(len(s) for s in opt.state.values())

    def states(m, o):
        return {n: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in o.state[p].items()}
                for n, p in m.named_parameters() if p in o.state}

    want = states(model, opt)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(base, "plain"))
    ck.save({"train": ck.TrainState(model, opt)}, os.path.join(base, "root"))

    fresh = _sharded(seed=1)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sd = {"model": fresh.state_dict(), "optim": fopt.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(base, "plain"))
    fopt.load_state_dict(sd["optim"])
    assert sum(len(s) for s in fopt.state.values()) == 0, "torch's idiom now restores state: update the README"
    _raises_everywhere(lambda: ck.load({"model": fresh.state_dict(), "optim": fopt.state_dict()},
                                       os.path.join(base, "plain")), ck.CheckpointMismatchError, "TrainState")

    fresh = _sharded(seed=1)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ck.load_latest(os.path.join(base, "root"), {"train": ck.TrainState(fresh, fopt)})
    assert sum(len(s) for s in fopt.state.values()) == n_states
    got = states(fresh, fopt)
    assert got.keys() == want.keys()
    for n in want:
        for k in want[n]:
            assert torch.equal(got[n][k], want[n][k]), (n, k)


def case_demo_batch_on_three_ranks(rank, world):
    """demo --nproc 3 --batch 15: the demo's own training loop, two steps."""
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import train

    os.environ["WORLD_SIZE"] = str(world)
    try:
        cfg = train.parse(["--batch", "15", "--steps", "2", "--optimizer", "muon"])
    except SystemExit as e:  # argparse; a BaseException would end the worker
        raise AssertionError(f"train.parse refused --batch 15 on 3 ranks (exit {e.code})") from None
    assert cfg.global_batch == 15
    cfg.dim, cfg.layers, cfg.hidden, cfg.seq_len = 32, 1, 64, 16
    batches = train.Batches(train.load_tokens(None), cfg.seq_len, cfg.global_batch, cfg.seed)
    x, _ = batches.local_batch_at(0, rank, world)
    assert x.shape[0] == 5
    out = train.train_one(cfg, "ragged_fsdp", init_device_mesh("cpu", (world,)), batches)
    assert len(out["losses"]) == 2 and all(l == l for l in out["losses"])


CASES = [
    case_save_validates_on_every_rank,
    case_load_latest_missing_root,
    case_checksum_catches_a_flipped_word,
    case_truncated_metadata,
    case_strict_false_shape_mismatch,
    case_dcp_idiom_drops_optimizer_state,
    case_demo_batch_on_three_ranks,
]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout=400)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_pattern(results, case):
    check_case(results, case, WORLD)
