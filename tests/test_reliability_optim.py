"""Optimizers refuse state they cannot load correctly, naming what differs, before loading.

* another optimizer's state dict (AdamW8bit's into AdamW, Shampoo's into Muon, ...): a
  ``ValueError`` naming the group or parameter, the keys and the saver, and nothing changes
  (before: zero moments loaded silently, or ``KeyError: 'block_size'``); compatible ones
  (torch's AdamW into ours) still load;
* per-rank files (``torch.save(opt.state_dict())`` on each rank) loaded at another world size
  (W = 2 -> 3) or on swapped ranks: every rank raises a ``ValueError`` naming the world sizes
  / ranks and pointing at DCP, before any collective (before: gloo ``invalid tensor size``
  deep in a reshard, or another rank's piece loaded); the same ranks load them exactly;
* bools where the constructors take integers are refused.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from ragged_fsdp.optim import AdamW, AdamW8bit, Muon, Shampoo

from _dist import check_case, run_cases

OURS = (AdamW, AdamW8bit, Muon, Shampoo)


def _kw(cls):
    return {AdamW8bit: {"min_8bit_size": 16}, Shampoo: {"max_preconditioner_dim": 32}}.get(cls, {})


def _trained(cls, params, steps=2, seed=0):
    opt = cls(params, lr=1e-2, **_kw(cls))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = _like(p, torch.randn(p.shape, generator=g))
        opt.step()
    return opt


def _like(p, full):
    from ragged_fsdp import RaggedDTensor

    if isinstance(p, RaggedDTensor):
        import ragged_fsdp as rf

        return rf.distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return full


def _plain_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80, 64))]


def _snapshot(opt):
    out = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for k, v in opt.state[p].items():
            out[(i, k)] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    return out, [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(OURS + (torch.optim.AdamW,), OURS)
                                     if a is not b and not (a is torch.optim.AdamW and b is AdamW)],
                         ids=lambda c: c.__name__)
def test_foreign_state_dict_is_refused_and_nothing_changes(src, dst):
    sd = _trained(src, _plain_params()).state_dict()
    opt = _trained(dst, _plain_params(1), seed=1)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="Nothing was loaded") as e:
        opt.load_state_dict(sd)
    msg = str(e.value)
    assert msg.startswith(f"{dst.__name__}.load_state_dict:"), msg
    assert "lacks" in msg or "does not keep" in msg, msg
    assert "start the new optimizer fresh" in msg, msg
    after = _snapshot(opt)
    assert before[1] == after[1] and before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])


def test_compatible_and_own_state_dicts_still_load():
    ref = _trained(torch.optim.AdamW, _plain_params())
    ours = AdamW(_plain_params(), lr=1e-2)
    ours.load_state_dict(ref.state_dict())
    for p, q in zip(ours.param_groups[0]["params"], ref.param_groups[0]["params"]):
        assert torch.equal(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"])
    for cls in OURS:
        a = _trained(cls, _plain_params())
        b = cls(_plain_params(), lr=1e-2, **_kw(cls))
        b.load_state_dict(a.state_dict())
        assert _snapshot(a)[0].keys() == _snapshot(b)[0].keys()
        assert all(torch.equal(x, y) for x, y in zip(_snapshot(a)[0].values(), _snapshot(b)[0].values()))


def test_adamw8bit_state_of_another_min_8bit_size_is_refused():
    sd = _trained(AdamW8bit, _plain_params()).state_dict()    # 8-bit states (min_8bit_size=16)
    for g in sd["param_groups"]:
        g["min_8bit_size"] = 1 << 20                              # as if saved with fp32 states
    with pytest.raises(ValueError, match=r"exp_avg_codes.*keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        AdamW8bit(_plain_params(), min_8bit_size=16).load_state_dict(sd)


def test_muon_groups_of_another_kind_are_refused():
    ps = _plain_params()
    opt = Muon([{"params": ps[:1]}, {"params": ps[1:], "use_muon": False}], lr=1e-2)
    sd = opt.state_dict()
    sd["param_groups"][0]["use_muon"], sd["param_groups"][1]["use_muon"] = False, True
    with pytest.raises(ValueError, match="Muon here but AdamW"):
        Muon([{"params": _plain_params()[:1]}, {"params": _plain_params()[1:], "use_muon": False}]).load_state_dict(sd)


@pytest.mark.parametrize("make", [
    lambda p: AdamW8bit(p, block_size=True), lambda p: AdamW8bit(p, min_8bit_size=False),
    lambda p: AdamW(p, chunk_size=True), lambda p: Muon(p, ns_steps=True),
    lambda p: Shampoo(p, max_preconditioner_dim=True), lambda p: Shampoo(p, precondition_frequency=True),
    lambda p: AdamW8bit([{"params": p, "block_size": True}]),
    lambda p: AdamW8bit.granularity_for(True, 4096), lambda p: AdamW8bit.granularity_for(256, True),
    lambda p: Shampoo.granularity_for(True),
], ids=["8bit.block_size", "8bit.min_8bit_size", "adamw.chunk_size", "muon.ns_steps", "shampoo.B",
        "shampoo.freq", "8bit.group.block_size", "8bit.gran.block", "8bit.gran.min", "shampoo.gran"])
def test_bools_are_not_integers(make):
    with pytest.raises(ValueError, match=r"=(True|False) must be an integer"):
        make(_plain_params())


# -- per-rank files across world sizes and ranks (gloo) -------------------------------------

def _dir() -> str:
    return os.environ["RAGGED_TEST_TMP"]


def _sharded_params(world, seed=0):
    """Two matrices, RaggedShard over rows, the same global values at every world size."""
    import ragged_fsdp as rf
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    out = []
    for shape in ((64, 80), (96, 64)):
        rows = shape[0]
        # multiples of 32 rows: 8-bit blocks and 32-row Shampoo tiles stay whole
        units = [rows // 32 // world + (1 if r < (rows // 32) % world else 0) for r in range(world)]
        out.append(torch.nn.Parameter(rf.distribute_tensor(
            torch.randn(shape), mesh, [rf.RaggedShard((0,), tuple(u * 32 for u in units), 1)], src_data_rank=None)))
    return out


def case_save_per_rank_files(rank, world):
    for cls in OURS:
        opt = _trained(cls, _sharded_params(world))
        torch.save(opt.state_dict(), os.path.join(_dir(), f"{cls.__name__}-rank{rank}.pt"))
        torch.save(_snapshot(opt)[0], os.path.join(_dir(), f"{cls.__name__}-rank{rank}.ref"))


def case_same_ranks_load_exactly(rank, world):
    for cls in OURS:
        opt = cls(_sharded_params(world, seed=3), lr=1e-2, **_kw(cls))
        opt.load_state_dict(torch.load(os.path.join(_dir(), f"{cls.__name__}-rank{rank}.pt"), weights_only=False))
        want = torch.load(os.path.join(_dir(), f"{cls.__name__}-rank{rank}.ref"), weights_only=False)
        got = _snapshot(opt)[0]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), cls.__name__


def case_swapped_ranks_are_refused_on_every_rank(rank, world):
    for cls in OURS:
        opt = cls(_sharded_params(world, seed=3), lr=1e-2, **_kw(cls))
        sd = torch.load(os.path.join(_dir(), f"{cls.__name__}-rank{1 - rank}.pt"), weights_only=False)
        with pytest.raises(ValueError, match=f"saved by rank {1 - rank}, loaded on rank {rank}") as e:
            opt.load_state_dict(sd)
        assert "DCP" in str(e.value) and "Nothing was loaded" in str(e.value), str(e.value)


def case_other_world_size_is_refused_on_every_rank(rank, world):
    for cls in OURS:
        opt = cls(_sharded_params(world, seed=3), lr=1e-2, **_kw(cls))
        sd = torch.load(os.path.join(_dir(), f"{cls.__name__}-rank{rank % 2}.pt"), weights_only=False)
        before = _snapshot(opt)
        with pytest.raises(ValueError, match="world size 2 -> 3") as e:
            opt.load_state_dict(sd)
        assert "DCP" in str(e.value), str(e.value)
        after = _snapshot(opt)
        assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    torch.distributed.barrier()  # nobody is left in a collective: every rank got here


def case_torch_dtensor_params_round_trip(rank, world):
    """AdamW steps torch DTensors of any layout by torch's own code; their state dict (with
    the fingerprint) still saves and reloads on the same rank."""
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)]))
    opt = AdamW([p])
    p.grad = distribute_tensor(torch.full((4, 6), 0.5), mesh, [Shard(1)])
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    want = opt.state[p]["exp_avg"].to_local().clone()
    opt.load_state_dict(torch.load(buf, weights_only=False))
    assert torch.equal(opt.state[p]["exp_avg"].to_local(), want)


W2 = [case_save_per_rank_files, case_same_ranks_load_exactly, case_swapped_ranks_are_refused_on_every_rank,
      case_torch_dtensor_params_round_trip]
W3 = [case_other_world_size_is_refused_on_every_rank]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ["RAGGED_TEST_TMP"] = str(tmp_path_factory.mktemp("rel_optim"))
    out = run_cases(2, W2)
    out.update(run_cases(3, W3))
    return out


@pytest.mark.parametrize("case", W2 + W3, ids=lambda c: c.__name__)
def test_dist(results, case):
    check_case(results, case, 2 if case in W2 else 3)
