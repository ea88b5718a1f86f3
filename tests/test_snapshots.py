"""``checkpoint.Snapshots`` on 4 gloo ranks, each its own "node" (``GROUP_RANK``) with its own
directory: a lost node's part comes back from its peer's copy, bitwise; two lost neighbours,
a torn snapshot, a foreign run and a snapshot off a step boundary are refused on every rank
(or fall back to DCP with a warning). The restart at another world size under torch elastic
is tests/test_snapshots_elastic.py. Pure parts (peer choice, snapshot choice, the micro-batch
RNG) are checked in one process."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from _dist import check_case, run_cases

W = 4
ENV = "RAGGED_TEST_SNAP_ROOT"


def _setup(rank):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    os.environ["GROUP_RANK"] = str(rank)  # one rank per "node"
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny(n_layers=1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.layers[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 96, (2, 9), generator=g)
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad()


def _full_state(model, opt):
    out = {k: p.detach().full_tensor().clone() for k, p in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def _dirs(name, shift=0):
    return os.path.join(os.environ[ENV], name, f"node-{(dist.get_rank() + shift) % dist.get_world_size()}")


def _train(name, steps, **kw):
    """Train ``steps`` steps with a snapshot after each; the full state after every step."""
    from ragged_fsdp.checkpoint import Snapshots

    model, opt = _setup(dist.get_rank())
    snaps = Snapshots(model, opt, dir=_dirs(name), **kw)
    states = {}
    for step in range(steps):
        _step(model, opt, step)
        snaps.snapshot(step + 1, extra={"data": step + 1})
        if kw.get("fallback"):
            snaps.checkpoint(step + 1, extra={"data": step + 1})
        states[step + 1] = _full_state(model, opt)
    return model, opt, snaps, states


def _lose(name, *nodes):
    dist.barrier()
    if dist.get_rank() in nodes:
        shutil.rmtree(_dirs(name))
    dist.barrier()


def _restored(name, shift=0, **kw):
    """A restarted worker: fresh model, optimizer with no state; ``shift``: the restart gave
    the node of rank ``r + shift`` the number ``r`` (torchrun numbers nodes anew each round)."""
    from ragged_fsdp.checkpoint import Snapshots

    model, opt = _setup(dist.get_rank())
    os.environ["GROUP_RANK"] = str((dist.get_rank() + shift) % dist.get_world_size())
    snaps = Snapshots(model, opt, dir=_dirs(name, shift), **kw)
    return model, opt, snaps, snaps.restore()


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _raises(fn, kind, *needles):
    with pytest.raises(kind) as e:
        fn()
    for n in needles:
        assert n in str(e.value), str(e.value)


def case_lost_node_restores_bitwise(rank, world):
    """Node 2 lost with its directory (a new node in its place), the ranks renumbered: its part
    comes from node 3's copy; every rank's state is the snapshot's, bitwise, and training goes
    on as if nothing happened."""
    model, opt, _, states = _train("lost", 3)
    _step(model, opt, 3)
    after = _full_state(model, opt)
    _lose("lost", 2)
    model, opt, snaps, step = _restored("lost", shift=1)
    assert step == 3 and snaps.extra == {"data": 3} and snaps.restored_from == 3
    _equal(_full_state(model, opt), states[3])
    _step(model, opt, 3)
    _equal(_full_state(model, opt), after)
    assert snaps.snapshot(4)  # the restored run snapshots again, over the old directories


def case_two_neighbours_lost(rank, world):
    """Nodes 1 and 2 lost together: part 1's copy was on node 2. Refused on every rank; with a
    fallback the newest DCP checkpoint loads, with a warning naming the steps lost."""
    from ragged_fsdp.checkpoint import CheckpointWarning, SnapshotLostError

    root = os.path.join(os.environ[ENV], "dcp")
    _, _, _, states = _train("two", 3, fallback=root)
    _lose("two", 1, 2)
    if rank == 0:  # the newest checkpoint lost too: the fallback is an older one
        shutil.rmtree(_newest(root))
    dist.barrier()
    _raises(lambda: _restored("two"), SnapshotLostError, "step 3", "part(s) [1]")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, opt, snaps, step = _restored("two", fallback=root)
    assert step == 2 and snaps.extra == {"data": 2}
    _equal(_full_state(model, opt), states[2])
    if rank == 0:
        text = " ".join(str(w.message) for w in seen if issubclass(w.category, CheckpointWarning))
        assert "steps 2 to 2 are lost" in text, text


def _newest(root):
    return os.path.join(root, sorted(n for n in os.listdir(root) if n.startswith("step-"))[-1])


def case_torn_snapshot_leaves_previous(rank, world):
    """A crash after the parts were written but before the commit markers: the previous
    snapshot is the one restored."""
    from ragged_fsdp.checkpoint.snapshot_store import snap_dir

    _, _, _, states = _train("torn", 2)
    dist.barrier()
    d = snap_dir(_dirs("torn"), 2)
    for n in os.listdir(d):
        if n.startswith("committed-"):
            os.remove(os.path.join(d, n))
    dist.barrier()
    model, opt, _, step = _restored("torn")
    assert step == 1
    _equal(_full_state(model, opt), states[1])


def case_foreign_and_off_boundary(rank, world):
    from ragged_fsdp.checkpoint import SnapshotError, SnapshotMismatchError, Snapshots

    model, opt, snaps, _ = _train("foreign", 1, run="a")
    _raises(lambda: _restored("foreign", run="b"), SnapshotMismatchError, "another run or configuration")
    if rank == 1:  # a gradient held on one rank only (a backward without opt.step): refused on every rank
        p = next(model.parameters())
        p.grad = torch.zeros_like(p)
    _raises(lambda: snaps.snapshot(2), SnapshotError, "step boundary")
    _raises(lambda: Snapshots(model, opt, dir=_dirs("x"), every=rank + 1), ValueError, "every")


CASES = [case_lost_node_restores_bitwise, case_two_neighbours_lost, case_torn_snapshot_leaves_previous,
         case_foreign_and_off_boundary]


@pytest.fixture(scope="module")
def results():
    root = tempfile.mkdtemp(prefix="snapshots-")
    old = os.environ.get(ENV)
    os.environ[ENV] = root
    try:
        return run_cases(W, CASES)
    finally:
        if old is None:
            os.environ.pop(ENV)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_snapshots(results, case):
    check_case(results, case, W)


# -- one process --------------------------------------------------------------------------------
def test_peer_is_on_another_node():
    from ragged_fsdp.checkpoint.snapshot_peers import peer_of

    assert peer_of(["a", "a", "b", "b"]) == [2, 3, 0, 1]  # torchrun --nproc-per-node=2: not rank + 1
    assert peer_of(["a", "b", "c"]) == [1, 2, 0]
    assert peer_of(["a", "a", "a", "b"]) == [3, 3, 3, 0]  # uneven nodes: every copy off the node
    assert peer_of(["a", "a"]) == [None, None]  # one node: no copy can survive it


def _report(step, holders, world, marked=True, run=1, id=5):
    steps = {}
    for r, kinds in holders.items():
        steps.setdefault(r, {})[step] = {"marked": marked, "own": {p: world for p in kinds.get("own", ())},
                                        "copy": {p: world for p in kinds.get("copy", ())},
                                        "info": {"run": run, "id": id, "world": world, "step": step}}
    return steps


def test_choose_snapshot():
    from ragged_fsdp.checkpoint import SnapshotLostError, SnapshotMismatchError, choose_snapshot

    def reports(per_rank):
        return [{"dir": f"d{r}", "node": str(r), "steps": s} for r, s in enumerate(per_rank)]

    a = _report(7, {0: {"own": [0], "copy": [2]}, 1: {"own": [1], "copy": [0]}}, 3)
    b = _report(6, {0: {"own": [0], "copy": [2]}, 1: {"own": [1], "copy": [0]}, 2: {"own": [2], "copy": [1]}}, 3)
    per_rank = [{**b.get(r, {}), **a.get(r, {})} for r in range(2)]
    assert choose_snapshot(reports(per_rank), 1) == (7, {0: 0, 1: 1, 2: 0}, 3)
    torn = [{**b.get(r, {}), **_report(7, {r: {"own": [r]}}, 3, marked=False).get(r, {})} for r in range(2)]
    assert choose_snapshot(reports(torn), 1)[0] == 6
    lost = [_report(7, {0: {"own": [0]}}, 3)[0], {}]
    with pytest.raises(SnapshotLostError, match=r"part\(s\) \[1, 2\]"):
        choose_snapshot(reports(lost), 1)
    with pytest.raises(SnapshotMismatchError, match="another run"):
        choose_snapshot(reports(per_rank), 2)
    assert choose_snapshot(reports([{}, {}]), 1) is None


def test_micro_batch_rng():
    from ragged_fsdp.fsdp.micro_rng import micro_batch_generator, micro_batch_rng, micro_batch_seed

    torch.manual_seed(3)
    before = torch.get_rng_state()
    with micro_batch_rng(1, 2, 3):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    torch.rand(10)  # whatever ran before on this rank does not matter
    with micro_batch_rng(1, 2, 3):
        assert torch.equal(torch.rand(4), a)
    assert torch.equal(torch.rand(4, generator=micro_batch_generator(1, 2, 3)), a)
    seeds = {micro_batch_seed(s, t, j) for s in range(3) for t in range(3) for j in range(3)}
    assert len(seeds) == 27
    with pytest.raises(ValueError, match="step"):
        micro_batch_seed(1, -1, 0)
