"""The local save (``checkpoint.save_local`` / ``load_local``): no coordinator to save, any
world size to load, bitwise.

Launches, in order: W=4 saves the tiny LLaMA (row granularity) plus optimizer-like extras
(a plain tensor, a plain value) and a copy of the full tensors as the reference; W=3 (another
granularity) and W=1 load it and compare every tensor bitwise; W=2 checks that a partial save
(one part missing) is refused by name and that a second save into the same directory is
refused. Nested state (the model and torch's AdamW state dict, plain tensors in lists, RaggedShard
tensors with ranks holding nothing, bf16) saved at W=4 loads bitwise at W=4, 3, 2 and 1. The
layout math (runs, pieces) is checked here in-process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _dist import run_cases
from ragged_fsdp.checkpoint.local_layout import RunLayout, decode_runs, encode_runs
from ragged_fsdp.ragged_units import RaggedUnits

ENV = "RAGGED_LOCAL_SAVE_DIR"


def _model(granularity):
    from ragged_fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(7 if granularity == "row" else 99)  # the loaders start from other values
    m = Llama(LlamaConfig.tiny())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in m.layers:
        fully_shard(block, mesh=mesh, granularity_fn=lambda n, p: granularity)
    fully_shard(m, mesh=mesh, granularity_fn=lambda n, p: granularity)
    return m


def _state(m):
    sd = m.state_dict()
    sd["extra.step_tensor"] = torch.tensor([3.5, -1.0])  # a plain (replicated) tensor
    sd["extra.step"] = 12  # a plain value
    return sd


def _full(sd):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}


def case_save_w4(rank, world):
    from ragged_fsdp.checkpoint import save_local

    root = os.environ[ENV]
    sd = _state(_model("row"))
    full = _full(sd)
    if rank == 0:
        torch.save(full, os.path.join(root, "reference.pt"))
    save_local(sd, os.path.join(root, "ckpt"))
    # a half-written save: every rank saves into "partial", then ranks 1-3 lose their parts
    # (save_local agrees across ranks, so one rank cannot save alone)
    save_local(sd, os.path.join(root, "partial"))
    if rank != 0:
        for ext in ("meta", "pt"):
            os.remove(os.path.join(root, "partial", f"part-{rank:05d}-of-{world:05d}.{ext}"))


def _load_and_compare(granularity):
    from ragged_fsdp.checkpoint import load_local

    root = os.environ[ENV]
    m = _model(granularity)
    sd = _state(m)
    sd["extra.step_tensor"] = torch.zeros(2)
    sd["extra.step"] = 0
    load_local(sd, os.path.join(root, "ckpt"))
    ref = torch.load(os.path.join(root, "reference.pt"), weights_only=True)
    got = _full(sd)
    assert set(got) == set(ref)
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{k} differs after load"
        else:
            assert got[k] == v, k
    # the model's own parameters were filled (state_dict values alias them)
    for k, p in m.named_parameters():
        assert torch.equal(p.full_tensor(), ref[k]), k


def case_load_w3(rank, world):
    _load_and_compare("rows:4")


def case_load_w1(rank, world):
    _load_and_compare(None)


def case_refusals_w2(rank, world):
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local, save_local

    root = os.environ[ENV]
    sd = _state(_model("row"))
    with pytest.raises(LocalCheckpointError, match=r"incomplete: 3 of 4 parts missing \(ranks \[1, 2, 3\]"):
        load_local(sd, os.path.join(root, "partial"))
    with pytest.raises(LocalCheckpointError, match="exists; a directory holds one save"):
        save_local(sd, os.path.join(root, "ckpt_w2"))
        save_local(sd, os.path.join(root, "ckpt_w2"))
    sd2 = _state(_model("row"))
    sd2["extra.only_here"] = torch.zeros(1)
    with pytest.raises(LocalCheckpointError, match="keys differ"):
        load_local(sd2, os.path.join(root, "ckpt"))
    sd3 = _state(_model("row"))
    sd3["extra.step_tensor"] = torch.zeros(3)
    with pytest.raises(LocalCheckpointError, match="'extra.step_tensor' was saved with shape"):
        load_local(sd3, os.path.join(root, "ckpt"))
    # no tmp file is left behind by a save
    assert not [n for n in os.listdir(os.path.join(root, "ckpt")) if ".tmp." in n]


# -- nested state: a model and torch's AdamW state dict, plus nested extras ------------------
def _odd(world, fill, dtype=torch.float32):
    """A (7, 5) RaggedShard tensor with ranks holding nothing and unequal counts."""
    from ragged_fsdp import RaggedShard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    counts = {1: [7], 2: [7, 0], 3: [3, 0, 4], 4: [3, 0, 4, 0]}[world]
    full = (torch.arange(35.0).reshape(7, 5) * 0.37 + fill).to(dtype)
    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(full, mesh, [RaggedShard((0,), counts)], src_data_rank=None)


def _trained(granularity, seed, steps):
    m = _model(granularity)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)  # the same batches on every rank
    for _ in range(steps):
        tokens = torch.randint(0, 96, (2, 8), generator=g)
        m(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _nested(m, opt, world, fill):
    return {"model": m.state_dict(), "optim": opt.state_dict(),
            "extra": {"step": 7 + fill, "hist": [torch.arange(3.0) + fill, {"w": torch.full((2,), 2.5 + fill)}],
                      "odd": _odd(world, fill), "odd16": _odd(world, fill, torch.bfloat16)}}


def _full_nested(obj):
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _full_nested(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full_nested(v) for v in obj]
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    return obj.clone() if isinstance(obj, torch.Tensor) else obj


def _assert_same(got, ref, where="state"):
    if isinstance(ref, dict):
        assert isinstance(got, dict) and set(got) == set(ref), (where, sorted(map(str, got)), sorted(map(str, ref)))
        for k in ref:
            _assert_same(got[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, list):
        assert len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref)):
            _assert_same(a, b, f"{where}.{i}")
    elif isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and torch.equal(got, ref), f"{where} differs"
    else:
        assert got == ref, (where, got, ref)


def case_nested_save_w4(rank, world):
    from ragged_fsdp.checkpoint import save_local

    root = os.environ[ENV]
    m, opt = _trained("row", seed=5, steps=2)
    sd = _nested(m, opt, world, 0.0)
    ref = _full_nested(sd)
    if rank == 0:
        torch.save(ref, os.path.join(root, "nested_reference.pt"))
    save_local(sd, os.path.join(root, "nested"))


def _nested_load(granularity):
    """Load the W=4 nested save into a model and AdamW trained differently (other values,
    same keys), at this W; every tensor bitwise, incl. the optimizer's after load_state_dict."""
    from ragged_fsdp.checkpoint import load_local

    root = os.environ[ENV]
    world = dist.get_world_size()
    m, opt = _trained(granularity, seed=11, steps=1)
    sd = _nested(m, opt, world, 1.0)
    load_local(sd, os.path.join(root, "nested"))
    opt.load_state_dict(sd["optim"])
    ref = torch.load(os.path.join(root, "nested_reference.pt"), weights_only=True)
    _assert_same(_full_nested(sd), ref)
    # through the objects themselves, not the dict that was loaded into
    params = list(m.parameters())
    for k, p in m.named_parameters():
        assert torch.equal(p.full_tensor(), ref["model"][k]), k
    for i, p in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            v = opt.state[p][name]
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(v, ref["optim"]["state"][i][name]), (i, name)
    assert opt.param_groups[0]["lr"] == ref["optim"]["param_groups"][0]["lr"]


def case_per_rank_save_w4(rank, world):
    from ragged_fsdp.checkpoint import save_local

    save_local({"rng": torch.tensor([rank, 1]), "lr": 0.1}, os.path.join(os.environ[ENV], "per_rank"))


def case_per_rank_refused_at_w2(rank, world):
    """A plain value that differed per rank has no answer at another W: refused by name."""
    from ragged_fsdp.checkpoint import LocalCheckpointError, load_local

    sd = {"rng": torch.zeros(2, dtype=torch.int64), "lr": 0.0}
    with pytest.raises(LocalCheckpointError, match=r"\['rng'\] differed between the ranks .* W = 4"):
        load_local(sd, os.path.join(os.environ[ENV], "per_rank"))
    assert sd["lr"] == 0.0 and not sd["rng"].any()  # nothing loaded, not even the equal value


def case_nested_load_w4(rank, world):
    _nested_load("row")


def case_nested_load_w3(rank, world):
    _nested_load("rows:4")


def case_nested_load_w2(rank, world):
    _nested_load(None)


def case_nested_load_w1(rank, world):
    _nested_load("row")


PHASES = [(4, [case_save_w4, case_nested_save_w4, case_nested_load_w4, case_per_rank_save_w4]),
          (3, [case_load_w3, case_nested_load_w3]), (1, [case_load_w1, case_nested_load_w1]),
          (2, [case_refusals_w2, case_nested_load_w2, case_per_rank_refused_at_w2])]
CASES = [c.__name__ for _, cs in PHASES for c in cs]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ[ENV] = str(tmp_path_factory.mktemp("local_save"))
    out = {}
    for world, cases in PHASES:
        res = run_cases(world, cases, timeout=300)
        out.update({k.rsplit(".", 1)[1]: v for k, v in res.items()})
    return out


@pytest.mark.parametrize("case", CASES)
def test_local_save_phases(results, case):
    if results[case]:
        pytest.fail(results[case], pytrace=False)


# -- the pure layout math -------------------------------------------------------------------
def test_runs_round_trip_and_stay_small():
    counts = [0] * 700 + [3] + [8] * 5000 + [2] + [0] * 3000
    runs = encode_runs(counts)
    assert decode_runs(runs) == counts
    assert len(runs) == 5  # zeros, head, interior, tail, zeros: independent of W


@pytest.mark.parametrize("shape,dims,unit", [((10, 7), (0,), 1), ((10, 7), (0,), 3), ((5, 4, 3), (0, 1), 2),
                                             ((23,), (0,), 1), ((6, 5), (), 1)])
def test_pieces_cover_every_element_once(shape, dims, unit):
    import itertools
    import math

    n_units = -(-math.prod(shape[: len(dims)]) // unit)
    for save_w, load_w in itertools.product((1, 3, 4), (1, 2, 5)):
        save_counts = [n_units * (r + 1) // save_w - n_units * r // save_w for r in range(save_w)]
        load_counts = [n_units * (r + 1) // load_w - n_units * r // load_w for r in range(load_w)]
        saved, target = RaggedUnits(dims, save_counts, unit), RaggedUnits(dims, load_counts, unit)
        layout = RunLayout(shape, dims, unit, tuple(map(tuple, encode_runs(save_counts))))
        layout.check()
        seen = []
        for r in range(load_w):
            a, b = target.element_range(shape, r)
            for pc in layout.pieces(a, b):
                sa, _ = saved.element_range(shape, pc.rank)
                # the piece's source elements are the target's, at the same global index
                assert sa + pc.src_lo == a + pc.dst_lo
                seen += range(sa + pc.src_lo, sa + pc.src_hi)
        assert seen == list(range(math.prod(shape))), (shape, dims, unit, save_w, load_w)
