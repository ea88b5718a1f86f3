"""Mixed precision: ragged fully_shard vs torch's FSDP2 under the same MixedPrecisionPolicy
(bf16 parameters for compute, fp32 or bf16 gradient reduction), side by side in one launch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from _dist import check_case, cpu_mesh, full, global_batch, run_cases

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.models.llama import Llama, LlamaConfig


def _train_pair(rank, world, mp, steps=5, cfg=None):
    cfg = cfg or LlamaConfig.tiny()
    mesh = cpu_mesh(world)
    models = []
    for shard in (fully_shard, torch_fully_shard):
        torch.manual_seed(0)
        m = Llama(cfg)
        for block in m.layers:
            shard(block, mesh=mesh, mp_policy=mp)
        shard(m, mesh=mesh, mp_policy=mp)
        models.append(m)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses = [[], []]
    grads = [{}, {}]  # first step's reduced gradients, full
    for step in range(steps):
        tokens, targets = global_batch(step, 2 * world, 16, cfg.vocab_size)
        t, y = tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]
        for k, (m, o) in enumerate(zip(models, opts)):
            loss = m.loss(t, y)
            loss.backward()
            for name, p in m.named_parameters():
                assert p.grad is not None and p.grad.dtype == torch.float32
                if step == 0:
                    grads[k][name] = full(p.grad).clone()
            o.step()
            o.zero_grad()
            lt = loss.detach().float()
            dist.all_reduce(lt)
            losses[k].append(lt.item() / world)
    return models, losses, grads


def _compare(models, losses, grads, loss_rtol, param_atol, grad_rtol):
    for step, (a, b) in enumerate(zip(*losses)):
        assert abs(a - b) <= loss_rtol * abs(b), f"step {step}: ragged loss {a} vs FSDP2 {b}"
    for name, g in grads[0].items():
        ref = grads[1][name]
        err = (g - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= grad_rtol * scale, f"{name}: first-step grad differs by {err:.2e} (max |g| {scale:.2e})"
    named = dict(models[1].named_parameters())
    for name, p in models[0].named_parameters():
        assert p.dtype == torch.float32, name
        err = (full(p) - full(named[name])).abs().max().item()
        assert err <= param_atol, f"{name}: |ragged - FSDP2| = {err:.2e}"


def case_bf16_params_fp32_reduce(rank, world):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models, losses, grads = _train_pair(rank, world, mp)
    buf = models[0].layers[0].dbuffers[0]
    assert buf.dtype == torch.float32 and buf.compute_dtype == torch.bfloat16 and buf.reduce_dtype == torch.float32
    _compare(models, losses, grads, loss_rtol=2e-3, param_atol=2e-3, grad_rtol=1e-3)


def case_bf16_params_bf16_reduce(rank, world):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    models, losses, grads = _train_pair(rank, world, mp)
    # both sum in bf16 (the reduce dtype), but FSDP2's gloo reduce-scatter and our all-to-all
    # plus local sum round in different places: first-step grads differ by about one bf16
    # ulp (measured: 1.5e-5 where |g| <= 3.1e-3); AdamW's first steps move each weight by about
    # lr * sign(grad), so weights with near-zero grads may drift up to steps * lr apart.
    _compare(models, losses, grads, loss_rtol=5e-3, param_atol=5 * 1e-2 + 1e-3, grad_rtol=1e-2)


def case_output_dtype_and_input_cast(rank, world):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny())
    fully_shard(m, mesh=cpu_mesh(world), mp_policy=mp)
    tokens, _ = global_batch(0, 2, 8, 96)
    out = m(tokens)
    assert out.dtype == torch.float32
    inner = torch.nn.Linear(4, 4)
    fully_shard(inner, mesh=cpu_mesh(world), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert inner(torch.ones(2, 4)).dtype == torch.bfloat16  # fp32 input cast to bf16


def _bf16_storage_grads(mesh, shard, rows, hook=False):
    """One backward of a model stored in bf16 (QLoRA-like), computed in fp32 and reduced in
    fp32; returns its full gradients (bf16, as the parameters are stored)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    for layer in (m[0], m[2], m):
        shard(layer, mesh=mesh, mp_policy=mp)
    if hook:
        for layer in (m[0], m[2], m):
            layer.set_all_reduce_hook(lambda t: None)  # an identity hook must not change the numbers
    x, y = rows
    torch.nn.functional.mse_loss(m(x), y).backward()
    return {n: full(p.grad).clone() for n, p in m.named_parameters()}


def _bf16_storage_reference(world):
    """The fp32 single-process gradient of the same bf16 weights on the whole batch."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    m = m.float()
    x, y = _bf16_storage_batch(world)
    torch.nn.functional.mse_loss(m(x), y).backward()
    return {n: p.grad for n, p in m.named_parameters()}


def _bf16_storage_batch(world):
    g = torch.Generator().manual_seed(7)
    return torch.randn(4 * world, 64, generator=g), torch.randn(4 * world, 8, generator=g)


def _check_bf16_storage(mesh, dp_rank, dp_size, world, hsdp=False):
    x, y = _bf16_storage_batch(world)
    # every data-parallel rank (replicas and shards alike under HSDP) takes 4 rows
    rows = (x[4 * dp_rank:4 * dp_rank + 4], y[4 * dp_rank:4 * dp_rank + 4])
    ours = _bf16_storage_grads(mesh, fully_shard, rows)
    hooked = _bf16_storage_grads(mesh, fully_shard, rows, hook=True)
    theirs = _bf16_storage_grads(mesh, torch_fully_shard, rows)
    ref = _bf16_storage_reference(dp_size)
    for name, g in ours.items():
        assert g.dtype == torch.bfloat16, name
        assert torch.equal(g, hooked[name]), f"{name}: an identity all-reduce hook changed the gradient"
        # fp32 sums of the same per-rank fp32 gradients: each element is the fp32 mean rounded
        # to bf16 once; a different sum order can move the fp32 mean by an ulp, so the bf16
        # result is the reference's bf16 rounding or its neighbour
        want = ref[name].to(torch.bfloat16)
        ulp = (want.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
        err = (g.float() - want.float()).abs()
        assert (err <= ulp).all(), f"{name}: {int((err > ulp).sum())} elements off the fp32 reference by more than one bf16 ulp"
        if dp_size == 2 or hsdp:  # sums of two addends (HSDP 2x2: two of two): any order gives FSDP2's bits
            assert torch.equal(g, theirs[name]), (
                f"{name}: {int((g != theirs[name]).sum())} of {g.numel()} elements differ from FSDP2")


def case_bf16_storage_fp32_reduce(rank, world):
    _check_bf16_storage(cpu_mesh(world), rank, world, world)


def case_bf16_storage_fp32_reduce_hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    _check_bf16_storage(mesh, rank, world, world, hsdp=True)


CASES = [case_bf16_params_fp32_reduce, case_bf16_params_bf16_reduce, case_output_dtype_and_input_cast,
         case_bf16_storage_fp32_reduce]
HSDP_CASES = [case_bf16_storage_fp32_reduce_hsdp]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"W{w}")
def results(request):
    return run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_mixed_precision_matches_fsdp2(results, case):
    check_case(results, case)


@pytest.fixture(scope="module")
def results_hsdp():
    return run_cases(4, HSDP_CASES)


@pytest.mark.parametrize("case", HSDP_CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_mixed_precision_hsdp_matches_fsdp2(results_hsdp, case):
    check_case(results_hsdp, case)
