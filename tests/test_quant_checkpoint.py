"""Checkpoints of models with tensor-subclass weights: QLoRA (frozen NF4 bases, bf16 adapters)
and a trainable float8-like weight, through DCP, the state-dict functions, ``TrainState`` and
``load_state_dict(assign=True)``; saved at one world size and loaded at others, bitwise.

One launch of 3 gloo ranks; sub-meshes give W = 1 (each rank alone), 2 (ranks 0, 1) and 3.
Every comparison here is ``torch.equal``: a checkpoint copies codes, scalers, factors and
values, and a resumed run does the same arithmetic on the same values as the uninterrupted one.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from _dist import check_case, run_cases

WORLD = 3


def _groups(rank):
    """(W, process group or None, mesh or None) for W = 1, 2, 3 (every rank makes every group)."""
    from torch.distributed.device_mesh import DeviceMesh

    solo = [dist.new_group([r]) for r in range(WORLD)]
    pair = dist.new_group([0, 1])
    out = {1: (solo[rank], DeviceMesh.from_group(solo[rank], "cpu"))}
    out[2] = (pair, DeviceMesh.from_group(pair, "cpu")) if rank < 2 else (None, None)
    out[3] = (dist.group.WORLD, DeviceMesh("cpu", torch.arange(WORLD)))
    return out


def _shared_dir(tag: str) -> str:
    box = [tempfile.mkdtemp(prefix=f"qlora-ck-{tag}-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def _qlora_model(seed=0):
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from ragged_fsdp.models.qlora import qlora

    # wk/wv 64 x 128 (half a scaler block), wq/wo 128 x 128 (one), w1/w3 192 x 128 (1.5): ranks
    # hold different numbers of rows (or none), and W = 2 and 3 cut at different blocks
    cfg = LlamaConfig(vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=192, max_seq_len=32)
    torch.manual_seed(seed)
    return qlora(Llama(cfg), rank=8, seed=seed)


def _wrap(model, mesh, param_dtype=torch.float32):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp import fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # LoRALinear computes and returns fp32 whatever its input (models/qlora.py), so under a
    # bf16 param_dtype the blocks' outputs are cast back for the root's bf16 norm and head
    block_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                    output_dtype=param_dtype if param_dtype != torch.float32 else None)
    for b in model.layers:
        fully_shard(b, mesh=mesh, mp_policy=block_mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _adapters(model):
    return [p for p in model.parameters() if p.requires_grad]


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, 96, (2, 17), generator=g)
    return data[:, :-1], data[:, 1:]


def _train(model, opt, steps, start=0):
    losses = []
    for s in range(start, start + steps):
        tok, tgt = _batch(s)
        loss = model.loss(tok, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _full_values(model):
    """Every parameter as full tensors: an NF4 weight as (codes, scalers, factors, mean,
    codebook) of the gathered weight, a plain one as its sharded parameter's full tensor
    (collective)."""
    from ragged_fsdp.quant.nf4 import NF4Weight

    out, nf4 = {}, []
    for n, p in model.named_parameters():
        if isinstance(p.to_local(), NF4Weight):
            nf4.append(n)
        else:
            out[n] = p.full_tensor().detach().clone()
    mods = [*model.layers, model]
    for m in mods:
        m.unshard()
    for n in nf4:
        mod_name, _, attr = n.rpartition(".")
        w = getattr(model.get_submodule(mod_name), attr)
        assert isinstance(w, NF4Weight), (n, type(w))
        out[n] = tuple(t.clone() for t in (w.codes, w.scalers, w.factors, w.mean, w.codebook))
    for m in mods:
        m.reshard()
    return out


def _assert_values(got, want, what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:5])
    for k in want:
        a, b = got[k], want[k]
        pairs = zip(a, b) if isinstance(b, tuple) else [(a, b)]
        for i, (x, y) in enumerate(pairs):
            assert x.dtype == y.dtype and torch.equal(x, y), (what, k, i, x.dtype, y.dtype, x.shape, y.shape,
                                                              (x != y).nonzero()[:3].tolist() if x.shape == y.shape else None)


def _unsharded_values(model):
    """As _full_values for a model that fully_shard did not wrap."""
    from ragged_fsdp.quant.nf4 import NF4Weight

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, NF4Weight):
            out[n] = tuple(t.clone() for t in (p.codes, p.scalers, p.factors, p.mean, p.codebook))
        else:
            out[n] = p.detach().clone()
    return out


# -- DCP: save at W = 2, load at W = 1 (wrapped and plain) and W = 3 -------------------------

def case_dcp_reshard(rank, world):
    groups = _groups(rank)
    path = _shared_dir("dcp")
    pg2, mesh2 = groups[2]
    want = None
    if mesh2 is not None:
        model = _wrap(_qlora_model(), mesh2)
        _train(model, torch.optim.AdamW(_adapters(model), lr=1e-2), 2)
        dcp.save(model.state_dict(), checkpoint_id=path, process_group=pg2)
        want = _full_values(model)
    box = [want]
    dist.broadcast_object_list(box)
    want = box[0]
    # W = 3 and W = 1 (fully_shard on one rank), from another seed: every value must come from the file
    for W in (3, 1):
        pg, mesh = groups[W]
        fresh = _wrap(_qlora_model(seed=5), mesh)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=path, process_group=pg)
        fresh.load_state_dict(sd)
        _assert_values(_full_values(fresh), want, f"W={W}")
    # a model fully_shard never wrapped, in one process
    plain = _qlora_model(seed=5)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path, process_group=groups[1][0])
    _assert_values(_unsharded_values(plain), want, "plain")
    # and plain tensors of the saved dtype: an NF4 entry dequantises into them
    if rank == 0:
        from ragged_fsdp.quant.nf4 import NF4Weight

        ref = _qlora_model(seed=5)
        ref.load_state_dict(sd)  # the NF4 weights, as saved
        flat = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in ref.state_dict().items()}
        dcp.load(flat, checkpoint_id=path, no_dist=True)
        for k, v in ref.state_dict().items():
            expect = v.dequantize() if isinstance(v, NF4Weight) else v
            assert torch.equal(flat[k], expect), k


# -- TrainState: save after k steps, resume, compare with the run that did not stop --------

def case_train_state_resume(rank, world):
    import ragged_fsdp.checkpoint as ck

    groups = _groups(rank)
    for W, param_dtype in ((2, torch.float32), (3, torch.float32), (2, torch.bfloat16), (1, torch.float32)):
        pg, mesh = groups[W]
        root = _shared_dir(f"ts{W}") if W > 1 else tempfile.mkdtemp(prefix="qlora-ts1-")  # W = 1: a root per rank
        if mesh is None:
            continue
        model = _wrap(_qlora_model(), mesh, param_dtype)
        opt = torch.optim.AdamW(_adapters(model), lr=1e-2)
        _train(model, opt, 2)
        ck.save({"train": ck.TrainState(model, opt), "step": 2}, root, process_group=pg)
        straight = _train(model, opt, 2, start=2)
        end = _full_values(model)

        resumed = _wrap(_qlora_model(seed=7), mesh, param_dtype)
        ropt = torch.optim.AdamW(_adapters(resumed), lr=1e-2)
        state = {"train": ck.TrainState(resumed, ropt), "step": 0}
        ck.load_latest(root, state, process_group=pg)
        assert state["step"] == 2
        again = _train(resumed, ropt, 2, start=2)
        for a, b in zip(again, straight):
            assert torch.equal(a, b), (W, param_dtype, a.item(), b.item())
        _assert_values(_full_values(resumed), end, f"W={W} {param_dtype}")


def case_unwrapped_save_load(rank, world):
    """ck.save / ck.load of a QLoRA model fully_shard did not wrap (each rank alone)."""
    import ragged_fsdp.checkpoint as ck

    pg = _groups(rank)[1][0]
    root = tempfile.mkdtemp(prefix="qlora-plain-")
    model = _qlora_model()
    opt = torch.optim.AdamW(_adapters(model), lr=1e-2)
    _train(model, opt, 1)
    ck.save({"train": ck.TrainState(model, opt)}, root, step=1, process_group=pg)
    want = _unsharded_values(model)
    fresh = _qlora_model(seed=3)
    fopt = torch.optim.AdamW(_adapters(fresh), lr=1e-2)
    ck.load_latest(root, {"train": ck.TrainState(fresh, fopt)}, process_group=pg)
    _assert_values(_unsharded_values(fresh), want, "unwrapped")


# -- full state dicts, load_state_dict(assign=True) ----------------------------------------

def case_full_state_dict(rank, world):
    from ragged_fsdp.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
    from ragged_fsdp.quant import dequantized_state_dict
    from ragged_fsdp.quant.nf4 import NF4Weight

    mesh = _groups(rank)[3][1]
    model = _wrap(_qlora_model(), mesh)
    _train(model, torch.optim.AdamW(_adapters(model), lr=1e-2), 1)
    want = _full_values(model)
    for offload in (False, True):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        if offload and rank != 0:
            assert full == {}
            continue
        plain = _qlora_model(seed=4)
        plain.load_state_dict(full)
        _assert_values(_unsharded_values(plain), want, f"full offload={offload}")
        assert isinstance(full["layers.0.attention.wq.weight"], NF4Weight)
        deq = dequantized_state_dict(full, torch.bfloat16)
        w = deq["layers.0.attention.wq.weight"]
        assert type(w) is torch.Tensor and w.dtype == torch.bfloat16
        assert torch.equal(w, full["layers.0.attention.wq.weight"].dequantize(torch.bfloat16))
    # full -> sharded, with the full state dict on every rank and from rank 0 only
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for bcast in (False, True):
        fresh = _wrap(_qlora_model(seed=6), mesh)
        sd = full if (not bcast or rank == 0) else {}
        set_model_state_dict(fresh, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast))
        _assert_values(_full_values(fresh), want, f"set full broadcast={bcast}")
    # a plain (dequantised) tensor for an NF4 weight is refused by name
    bad = dict(full)
    bad["layers.0.attention.wq.weight"] = full["layers.0.attention.wq.weight"].dequantize()
    with pytest.raises(TypeError, match=r"layers\.0\.attention\.wq\.weight.*NF4Weight"):
        set_model_state_dict(_wrap(_qlora_model(seed=6), mesh), bad, options=StateDictOptions(full_state_dict=True))


def case_assign(rank, world):
    mesh = _groups(rank)[3][1]
    src = _wrap(_qlora_model(), mesh)
    opt = torch.optim.AdamW(_adapters(src), lr=1e-2)
    _train(src, opt, 1)
    want = _full_values(src)
    dst = _wrap(_qlora_model(seed=9), mesh)
    dst.load_state_dict(src.state_dict(), assign=True)
    _assert_values(_full_values(dst), want, "assign")
    # both models train on from the same values (the adapters' optimizer is rebuilt for dst)
    dopt = torch.optim.AdamW(_adapters(dst), lr=1e-2)
    dopt.load_state_dict(opt.state_dict())
    a, b = _train(src, opt, 1, start=1), _train(dst, dopt, 1, start=1)
    assert torch.equal(a[0], b[0]), (a, b)
    # assign from a plain model's state dict (full NF4 weights)
    plain = _qlora_model()
    _train(plain, torch.optim.AdamW(_adapters(plain), lr=1e-2), 1)
    dst2 = _wrap(_qlora_model(seed=9), mesh)
    dst2.load_state_dict(plain.state_dict(), assign=True)
    got = _full_values(dst2)
    ref = _unsharded_values(plain)
    _assert_values(got, ref, "assign from plain")


# -- a trainable float8-like weight (fp32 master): the checkpoint holds the master values ---

def case_float8_weight(rank, world):
    from test_quantized_weights import _models

    import ragged_fsdp.checkpoint as ck
    from ragged_fsdp import fully_shard

    groups = _groups(rank)
    root = _shared_dir("fp8")
    pg2, mesh2 = groups[2]
    want = None
    if mesh2 is not None:
        _, model = _models()
        for blk in model:
            fully_shard(blk, mesh=mesh2)
        fully_shard(model, mesh=mesh2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 10)).square().mean().backward()
        opt.step()
        ck.save({"train": ck.TrainState(model, opt)}, root, step=1, process_group=pg2)
        want = {n: p.full_tensor() for n, p in model.named_parameters()}
    box = [want]
    dist.broadcast_object_list(box)
    want = box[0]
    pg3, mesh3 = groups[3]
    _, fresh = _models()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    for blk in fresh:
        fully_shard(blk, mesh=mesh3)
    fully_shard(fresh, mesh=mesh3)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ck.load_latest(root, {"train": ck.TrainState(fresh, fopt)}, process_group=pg3)
    for n, p in fresh.named_parameters():
        assert type(p.to_local()).__name__ == "Fp8RowWeight" or "bias" in n
        assert torch.equal(p.full_tensor(), want[n]), n
    # a full state dict holds the plain master values
    from ragged_fsdp.checkpoint import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
    for n, v in full.items():
        assert type(v) is torch.Tensor and torch.equal(v, want[n]), n


CASES = [case_dcp_reshard, case_train_state_resume, case_unwrapped_save_load, case_full_state_dict, case_assign,
         case_float8_weight]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_case(results, case):
    check_case(results, case, WORLD)
