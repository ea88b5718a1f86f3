"""Everyday patterns on state dicts and parameters of a fully_shard model.

One launch at W=3 (gloo, CPU). The model is wrapped per block, so most ranks hold pieces
that start at a non-zero offset of their group's flat buffer: the case that broke
``torch.save`` / ``copy.deepcopy`` / ``async_save`` ("invalid python storage"). Every case
checks values against the unsharded reference (bitwise: bytes only move).
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
import zipfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import check_case, run_cases

WORLD = 3


def _build():
    """Odd shapes so cuts fall inside tensors; two blocks and a root group."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7)),
        nn.Sequential(nn.Linear(7, 11), nn.Linear(11, 3)),
        nn.Linear(3, 2),
    )


def _sharded():
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _build()
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def _shared_dir():
    box = [tempfile.mkdtemp(prefix="ragged_patterns_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _assert_same_full(sd, ref_sd, what):
    from ragged_fsdp import RaggedDTensor

    assert sd.keys() == ref_sd.keys(), f"{what}: keys {sorted(sd)} vs {sorted(ref_sd)}"
    for k, v in sd.items():
        assert isinstance(v, RaggedDTensor), f"{what}: {k} is {type(v).__name__}, not a RaggedDTensor"
        assert torch.equal(v.full_tensor(), ref_sd[k]), f"{what}: {k} differs from the reference"


def _some_rank_has_offset_views(model) -> None:
    """The precondition of the bug: some local piece starts inside a shared buffer."""
    n = sum(p.to_local().storage_offset() > 0 for p in model.parameters())
    t = torch.tensor([n])
    dist.all_reduce(t)
    assert t.item() > 0, "test setup: no parameter piece starts at a non-zero buffer offset"


# -- cases (run on every rank) -----------------------------------------------------------

def case_torch_save_load_weights_only(rank, world):
    """Per-rank torch.save(model.state_dict()) and torch.load with its default
    weights_only=True: same placements, same values, pieces saved compactly."""
    from ragged_fsdp import RaggedDTensor

    model, _ = _sharded()
    ref = _build().state_dict()
    _some_rank_has_offset_views(model)
    sd = model.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    # Only this rank's elements are written: the archive's tensor data is exactly the sum of
    # the local pieces, not the flat buffers they are views of.
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data = sum(i.file_size for i in z.infolist() if "/data/" in i.filename)
    local_bytes = sum(v.to_local().numel() * v.to_local().element_size() for v in sd.values())
    mesh = next(iter(sd.values())).device_mesh.mesh  # the mesh's rank table is pickled once
    local_bytes += mesh.numel() * mesh.element_size()
    assert data == local_bytes, f"saved {data} bytes of tensor data for {local_bytes} bytes of local pieces"
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True is torch's default
    for k, v in loaded.items():
        assert isinstance(v, RaggedDTensor), k
        assert v.placements == sd[k].placements and v.shape == sd[k].shape, k
        assert torch.equal(v.to_local(), sd[k].to_local()), k
    _assert_same_full(loaded, ref, "torch.load")
    # the "save the best model, restore it later" pattern
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(loaded)
    _assert_same_full(model.state_dict(), ref, "load_state_dict(torch.load(...))")
    # a file on disk, weights_only spelled out
    path = os.path.join(tempfile.mkdtemp(), f"rank{rank}.pt")
    torch.save(model.state_dict(), path)
    _assert_same_full(torch.load(path, weights_only=True), ref, "torch.load(path)")


def case_deepcopy_state_dict(rank, world):
    """copy.deepcopy(model.state_dict()) is an independent snapshot."""
    model, _ = _sharded()
    ref = _build().state_dict()
    _some_rank_has_offset_views(model)
    snap = copy.deepcopy(model.state_dict())
    _assert_same_full(snap, ref, "deepcopy")
    params = dict(model.named_parameters())
    for k, v in snap.items():
        assert v.to_local().untyped_storage().data_ptr() != params[k].to_local().untyped_storage().data_ptr() \
            or v.to_local().numel() == 0, f"{k}: the copy shares storage with the parameter"
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    _assert_same_full(snap, ref, "deepcopy after the model changed")
    model.load_state_dict(snap)
    _assert_same_full(model.state_dict(), ref, "load_state_dict(deepcopy)")
    # parameters themselves (keep_vars) deep-copy too, keeping requires_grad
    pcopy = copy.deepcopy(model.state_dict(keep_vars=True))
    assert all(v.requires_grad for v in pcopy.values())
    _assert_same_full({k: v.detach() for k, v in pcopy.items()}, ref, "deepcopy(keep_vars=True)")


def case_async_save(rank, world):
    """ragged_fsdp.checkpoint.async_save(model.state_dict()) writes what dcp.load reads back."""
    import torch.distributed.checkpoint as dcp

    from ragged_fsdp.checkpoint import async_save

    model, _ = _sharded()
    ref = _build().state_dict()
    _some_rank_has_offset_views(model)
    d = os.path.join(_shared_dir(), "async")
    async_save(model.state_dict(), checkpoint_id=d).result()
    dist.barrier()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=d)
    _assert_same_full(sd, ref, "async_save then dcp.load")


def case_copy_from_replicate_dtensor(rank, world):
    """param.copy_(Replicate DTensor) copies this rank's slice (torchtitan's fused-QKV
    state-dict hooks); also Shard(0) DTensors and plain full tensors, and load_state_dict
    of a state dict of Replicate DTensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model, mesh = _sharded()
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in _build().state_dict().items()}
    params = dict(model.named_parameters())
    kinds = [
        ("Replicate", lambda t: distribute_tensor(t, mesh, [Replicate()])),
        ("Shard(0)", lambda t: distribute_tensor(t, mesh, [Shard(0)])),
        ("plain", lambda t: t),
    ]
    for i, (name, make) in enumerate(kinds):
        with torch.no_grad():
            for k, p in params.items():
                out = p.copy_(make(new[k] + i))
                assert out is p
        for k, p in params.items():
            assert torch.equal(p.full_tensor(), new[k] + i), f"copy_ from {name}: {k}"
    model.load_state_dict({k: distribute_tensor(v, mesh, [Replicate()]) for k, v in new.items()})
    for k, p in params.items():
        assert torch.equal(p.full_tensor(), new[k]), f"load_state_dict(Replicate): {k}"
    try:
        with torch.no_grad():
            params["0.0.weight"].copy_(distribute_tensor(torch.zeros(3, 3), mesh, [Replicate()]))
    except ValueError as e:
        assert "shape" in str(e), str(e)
    else:
        raise AssertionError("copy_ from a Replicate DTensor of another shape was accepted")


def case_distribute_tensor_excluding_rank(rank, world):
    """A mesh without this rank: an empty local tensor, as torch gives."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate

    from ragged_fsdp import RaggedShard, distribute_tensor, from_local

    sub = DeviceMesh("cpu", torch.tensor([0, 1]))  # collective: every rank builds it
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    pl = [RaggedShard((0,), (2, 1), unit=2)]  # rows 0-3 on rank 0, rows 4-5 on rank 1
    for src in (0, None):
        t = distribute_tensor(full, sub, pl, src_data_rank=src)
        assert tuple(t.shape) == (6, 4)
        if rank == 2:
            assert t.to_local().numel() == 0
        else:
            assert torch.equal(t.to_local(), full[:4] if rank == 0 else full[4:])
    f = from_local(full[:0] if rank == 2 else (full[:4] if rank == 0 else full[4:]), sub, pl, shape=(6, 4))
    if rank == 2:
        assert f.to_local().numel() == 0
    else:
        assert torch.equal(f.redistribute(sub, [Replicate()]).to_local(), full)


CASES = [
    case_torch_save_load_weights_only,
    case_deepcopy_state_dict,
    case_async_save,
    case_copy_from_replicate_dtensor,
    case_distribute_tensor_excluding_rank,
]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_pattern(results, case):
    check_case(results, case, WORLD)


# -- pure: the placement refuses what it would otherwise round ----------------------------

@pytest.mark.parametrize("kwargs, needle", [
    (dict(dims=(0,), local_units=(1, 2), unit=2.5), "unit must be an integer"),
    (dict(dims=(0,), local_units=(1.7, 2)), r"local_units\[0\] must be an integer"),
    (dict(dims=(0,), local_units="12"), "local_units must be a sequence of integers"),
    (dict(dims=(0,), local_units=(True, 2)), r"local_units\[0\] must be an integer, got True"),
    (dict(dims=(0,), local_units=(1, 2), unit=True), "unit must be an integer, got True"),
    (dict(dims=(0.0,), local_units=(1,)), r"dims\[0\] must be an integer"),
    (dict(dims=(0,), local_units=3), "local_units must be a sequence"),
])
def test_ragged_shard_refuses_non_integers(kwargs, needle):
    from ragged_fsdp import RaggedShard

    with pytest.raises(TypeError, match=needle):
        RaggedShard(**kwargs)


def test_ragged_shard_accepts_integer_likes():
    import numpy as np

    from ragged_fsdp import RaggedShard

    a = RaggedShard((0,), (np.int64(1), torch.tensor(2)), unit=np.int32(3))
    assert a == RaggedShard((0,), (1, 2), unit=3)
    assert type(a.unit) is int and all(type(u) is int for u in a.local_units)
