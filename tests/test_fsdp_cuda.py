"""The CUDA / NCCL side of the device seam (side streams, events): one GPU, W = 1.

Skipped without CUDA. With one rank the all-gather and reduce-scatter are local, but the
stream/event plumbing (cast on the all-gather stream, reduction on its own stream, waits
on the compute stream) runs exactly as at larger W.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def nccl():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_cuda_training_matches_single_device(nccl, mixed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp.fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    torch.manual_seed(0)
    ref = Llama(LlamaConfig.tiny()).cuda()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert model.output.weight.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 96, (2, 17), generator=g).cuda()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if mixed:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ref_loss = ref.loss(tokens[:, :-1], tokens[:, 1:])
        else:
            ref_loss = ref.loss(tokens[:, :-1], tokens[:, 1:])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        tol = 5e-2 if mixed else 1e-5
        assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    torch.cuda.synchronize()
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        atol = 5e-2 if mixed else 5e-4
        torch.testing.assert_close(p.full_tensor(), named[name].detach(), rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_backward_has_no_device_sync(nccl, mixed):
    """Backward (with its final callback: the 'got a gradient' flags, handing out the sharded
    grads) issues no device-to-host copy: the host queues the optimizer's kernels while the
    GPU still runs backward. ``set_sync_debug_mode("error")`` raises on any synchronizing
    call (``.item()``, ``.tolist()``, ``.cpu()`` of a CUDA tensor, a blocking copy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp.fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    tokens = torch.randint(0, 96, (2, 17)).cuda()
    for step in range(2):  # the second step runs with prefetching from the first's order
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(p.grad is not None for p in model.parameters()), step
        model.zero_grad()


def test_all_reduce_hook_stream_and_post_optim_event(nccl):
    """set_all_reduce_hook(stream=...) runs the hook on that stream (after the reduction,
    x2 doubles the gradients exactly); set_post_optim_event's event is consumed by the next
    forward's all-gathers (bf16 compute: the buffers are gathered even at W = 1) and the
    result is the same as without it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp.fsdp import FSDPModule, fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build():
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny())
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, [m for m in model.modules() if isinstance(m, FSDPModule)]

    tokens = torch.randint(0, 96, (2, 17)).cuda()
    ref, _ = build()
    model, wrapped = build()
    side = torch.cuda.Stream()
    on = []

    def hook(t):
        on.append(torch.cuda.current_stream() == side)
        t.mul_(2.0)

    for m in wrapped:
        m.set_all_reduce_hook(hook, stream=side)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(2):
        for m, opt in zip((ref, model), opts):
            m.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        torch.cuda.synchronize()
        assert on and all(on), on
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad.full_tensor(), 2 * q.grad.full_tensor())
            p.grad.mul_(0.5)  # same update as the reference from here on
        for m, opt in zip((ref, model), opts):
            opt.step()
            opt.zero_grad()
        event = torch.cuda.Event()
        event.record()
        model.set_post_optim_event(event)
        torch.cuda._sleep(1_000_000)  # work queued after the event: the gathers need not wait for it
        on.clear()
    groups = [m._fsdp_state().group for m in wrapped]
    assert all(g.post_optim_event is not None for g in groups)
    model.loss(tokens[:, :-1], tokens[:, 1:])  # the event is consumed by this forward's gathers
    assert all(g.post_optim_event is None and not g.dev._events for g in groups)
    torch.cuda.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def test_cuda_offload_memory(nccl):
    """Device memory with and without each offload policy (W = 1, a Llama of ~16M
    parameters, ragged AdamW): the peak of a step and what stays allocated between steps.
    Losses: bitwise equal to the no-policy run where the step runs on the GPU (optimizer
    states streamed, the phase switch); within 1e-5 relative with CPUOffloadPolicy (the step
    runs on the CPU, whose rounding of AdamW's ops may differ). Prints the table
    (``make gpu-check`` shows it with ``-s``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from ragged_fsdp import OffloadPolicy, load_to_device, offload_to_host
    from ragged_fsdp.fsdp import fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig
    from ragged_fsdp.optim import AdamW

    mesh = init_device_mesh("cuda", (1,))
    cfg = LlamaConfig.tiny(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1408, vocab_size=4096)
    policies = {"none": None, "CPUOffloadPolicy": CPUOffloadPolicy(),
                "optimizer_states": OffloadPolicy(optimizer_states=True), "offload_to_host between steps": None}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, 129), generator=g) for _ in range(3)]
    rows, losses = [], {}
    for name, policy in policies.items():
        torch.manual_seed(0)
        model = Llama(cfg)
        kw = {} if policy is None else {"offload_policy": policy}
        for block in model.layers:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = AdamW(model.parameters(), lr=1e-3)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        got, between = [], []
        for tokens in batches:
            tokens = tokens.cuda()
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            got.append(loss.detach().cpu())
            if name.startswith("offload_to_host"):
                offload_to_host(model, opt)
                torch.cuda.synchronize()
                between.append(torch.cuda.memory_allocated())
                load_to_device(model, opt)
            else:
                torch.cuda.synchronize()
                between.append(torch.cuda.memory_allocated())
        losses[name] = torch.stack(got)
        rows.append((name, torch.cuda.max_memory_allocated() / 2**20, max(between) / 2**20))
        del model, opt
        torch.cuda.empty_cache()
    print("\npolicy                          peak MiB   between steps MiB")
    for name, peak, between in rows:
        print(f"{name:<30} {peak:>9.1f}   {between:>9.1f}")
    for name, v in losses.items():
        if name == "CPUOffloadPolicy":
            torch.testing.assert_close(v, losses["none"], rtol=1e-5, atol=0)
        else:
            assert torch.equal(v, losses["none"]), (name, v, losses["none"])
    peak = {r[0]: r[1] for r in rows}
    held = {r[0]: r[2] for r in rows}
    assert peak["optimizer_states"] < peak["none"]
    assert held["CPUOffloadPolicy"] < held["none"] and held["offload_to_host between steps"] < held["none"]


def test_cuda_mxfp8_planes_bitwise_torchao(nccl):
    """MXFP8 all-gather on CUDA: the forward's row plane and the backward's column plane are
    bitwise torchao's ``to_mx`` (eager, on the same device) of the full fp32 master."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ragged_fsdp import MXFP8, fully_shard
    from ragged_fsdp.models.llama import Llama, LlamaConfig

    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny(dim=96, ffn_hidden=200))  # 200: a tail block in both planes
    masters = {n: p.detach().cuda() for n, p in model.named_parameters()}
    seen = []

    def at(prefix):
        return lambda n, plane, c, s: seen.append((prefix + n, plane, c.clone(), s.clone()))

    for i, block in enumerate(model.layers):
        fully_shard(block, mesh=mesh, mp_policy=mp, all_gather_quant=MXFP8(on_gathered=at(f"layers.{i}.")),
                    reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, all_gather_quant=MXFP8(on_gathered=at("")),
                reshard_after_forward=True)
    tokens = torch.randint(0, 96, (2, 17)).cuda()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    torch.cuda.synchronize()
    assert {p for _, p, _, _ in seen} == {"rows", "cols"}
    for name, plane, codes, scales in seen:
        w = masters[name]
        src = w if plane == "rows" else w.t()
        K = src.shape[-1]
        s, d = mx.to_mx(F.pad(src, (0, -K % 32)).contiguous(), torch.float8_e4m3fn, 32)
        d, s = d[..., :K].view(torch.uint8), s.view(torch.uint8)
        if plane == "cols":
            d, s = d.t(), s.t()
        assert codes.is_cuda and torch.equal(codes, d), (name, plane)
        assert torch.equal(scales, s), (name, plane)
