"""torchao's own ``NF4Tensor`` weights (what torchtune shards) under ``fully_shard``: adopted as
``NF4Weight`` on the way in and trained against one process (W = 1, 2, 3) and against torch's
FSDP2 on the same torchao weights (W = 2; FSDP2 cannot shard them at W = 3). Only where
torchao is installed (the ``quant`` extra).

One launch of 3 gloo ranks; sub-meshes give W = 1 (each rank alone), 2 (ranks 0, 1) and 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import check_case, run_cases

WORLD = 3
STEPS = 3

pytest.importorskip("torchao", reason="torchao is not installed (pip install torch==2.13.0 -e '.[quant]')")


def _model(dtype):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from ragged_fsdp.models.qlora import qlora

    # 256 x 256 and 512 x 256 weights: 4 and 8 scaler blocks, so FSDP2's two dim-0 chunks at
    # W = 2 are whole blocks (at W = 3 FSDP2 fails on these weights: docs/quantized-weights.md)
    cfg = LlamaConfig(vocab_size=96, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=512, max_seq_len=32)
    torch.manual_seed(0)
    return qlora(Llama(cfg), rank=8, base=lambda w: to_nf4(w.detach().to(dtype), 64, 256))


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        data = torch.randint(0, 96, (6, 17), generator=g)  # 6 rows: an equal share at W = 1, 2, 3
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _losses(model, W, r, group=None):
    """Per-step losses (the mean over the ranks' equal shares: the global batch's mean)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    out = []
    for tok, tgt in _batches():
        n = tok.shape[0] // W
        loss = model.loss(tok[r * n:(r + 1) * n], tgt[r * n:(r + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.detach().clone())
    t = torch.stack(out)
    if W > 1:
        dist.all_reduce(t, group=group)
        t /= W
    return t.tolist()


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def case_torchao_nf4(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ragged_fsdp import fully_shard
    from ragged_fsdp.quant.nf4 import NF4Weight

    solo = [dist.new_group([r]) for r in range(WORLD)]
    pair = dist.new_group([0, 1])
    meshes = {1: (solo[rank], DeviceMesh.from_group(solo[rank], "cpu")),
              2: (pair, DeviceMesh.from_group(pair, "cpu") if rank < 2 else None),
              3: (dist.group.WORLD, DeviceMesh("cpu", torch.arange(WORLD)))}
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        one = _losses(_model(dtype), 1, 0)  # torchao's NF4Tensor in one process
        for W in (1, 2, 3):
            group, mesh = meshes[W]
            if mesh is None:
                continue
            runs = {}
            for name, shard in (("ragged", fully_shard), ("fsdp2", torch_fully_shard)):
                if name == "fsdp2" and W != 2:
                    continue
                model = _model(dtype)
                for b in model.layers:
                    shard(b, mesh=mesh, mp_policy=mp)
                shard(model, mesh=mesh, mp_policy=mp)
                if name == "ragged":
                    w = model.layers[0].attention.wq.weight
                    assert type(w.to_local()) is NF4Weight, type(w.to_local())
                runs[name] = _losses(model, W, mesh.get_local_rank(), group)
            got = runs["ragged"]
            if rank == 0:
                line = f"MEASURE {dtype} W={W} ragged-vs-1proc={_rel(got, one):.2e}"
                if "fsdp2" in runs:
                    line += f" fsdp2-vs-1proc={_rel(runs['fsdp2'], one):.2e} ragged-vs-fsdp2={_rel(got, runs['fsdp2']):.2e}"
                print(line, flush=True)
            if W == 1:
                assert got == one, (dtype, got, one)  # the same ops on the same bits
            else:
                # the bf16 adapters' gradient mean over W ranks is not the one-process mean in
                # the last bits; ragged_fsdp's reduction rounds differently from FSDP2's (measured
                # and explained in docs/quantized-weights.md)
                assert _rel(got, one) <= 1e-5, (dtype, W, got, one)
            if "fsdp2" in runs:
                assert _rel(got, runs["fsdp2"]) <= 1e-5, (dtype, W, runs)


CASES = [case_torchao_nf4]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_case(results, case):
    check_case(results, case, WORLD)
