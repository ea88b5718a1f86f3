"""The simulator's memory model against two real engines: for the reference
dense and MoE models at W = 1, 2, 4 on gloo, the predicted sharded parameter, gradient and
optimizer-state bytes per rank equal what torch's FSDP2 (and ragged_fsdp) allocate, and the
predicted peak of a training step is within 10% of MemTracker's peak for both.

The configurations are parameter-dominated (batch 1 x 32 tokens, as the bench's
``dense-wide``), so the check is on the buffers and their lifetimes; activations are a few
percent of the peak here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _dist import check_case, cpu_mesh, run_cases

PEAK_TOL = 0.10


def _build(kind):
    torch.manual_seed(0)
    if kind == "dense":
        from ragged_fsdp.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                                 ffn_hidden=704, max_seq_len=64))
    from ragged_fsdp.models.moe import MoE, MoEConfig

    return MoE(MoEConfig(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=32,
                         top_k=2, expert_hidden=128, max_seq_len=64, fused_experts=True))


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def _check(rank, world, kind):
    from torch.distributed._tools.mem_tracker import MemTracker

    from ragged_fsdp.bench.engine import wrap
    from ragged_fsdp.sim.reference import exact_rank_bytes, reference_arch, reference_memory

    mesh = cpu_mesh(world)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 2048, (1, 32), generator=g)
    y = torch.randint(0, 2048, (1, 32), generator=g)
    errors = []
    for variant, fw in (("fsdp2", "fsdp2"), ("ragged_fsdp", "ragged")):
        model = _build(kind)
        arch = reference_arch(model)
        model = wrap(model, variant, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step(keep_grads=False):
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
            if keep_grads:
                return
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        step()
        want = exact_rank_bytes(fw, arch, world, rank)
        params = list(model.parameters())
        got_params = _storage_bytes(params)
        got_states = _storage_bytes([v for st in opt.state.values() for v in st.values()])
        step(keep_grads=True)
        got_grads = _storage_bytes([p.grad for p in params if p.grad is not None])
        opt.zero_grad(set_to_none=True)
        got = {"params": got_params, "grads": got_grads, "optimizer": got_states}
        if got != want:
            errors.append(f"{kind}/{variant} W={world} rank {rank}: allocated {got}, predicted {want}")
        mt = MemTracker()
        mt.track_external(model, opt)  # count what exists before the step (parameters, states)
        with mt:
            step()
        peak = sum(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
        pred = reference_memory(fw, arch, world, 1, 32, rank=rank)
        err = pred.peak / peak - 1
        if abs(err) > PEAK_TOL:
            errors.append(f"{kind}/{variant} W={world} rank {rank}: peak {peak / 2**20:.2f} MiB measured, "
                          f"{pred.peak / 2**20:.2f} MiB predicted ({err:+.1%}, at {pred.peak_phase})")
    assert not errors, "\n".join(errors)


def case_dense(rank, world):
    _check(rank, world, "dense")


def case_moe(rank, world):
    _check(rank, world, "moe")


CASES = [case_dense, case_moe]


@pytest.fixture(scope="module", params=[1, 2, 4])
def results(request):
    return request.param, run_cases(request.param, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_memory_matches_engines(results, case):
    world, res = results
    check_case(res, case, world)
