"""sim.muon_step: the bounded step's model agrees with the optimizer's own plan."""

import torch

from ragged_fsdp.optim import Muon
from ragged_fsdp.sim.muon_step import matrices_of_arch, muon_step
from ragged_fsdp.sim import get_profile, resolve_model


def test_waves_match_the_optimizer_and_bounded_is_smaller():
    shapes = [(13, 7), (64, 48), (7, 13), (96, 32), (40, 40)]
    ps = [torch.zeros(s, requires_grad=True) for s in shapes]
    opt = Muon(ps, lr=0.02, wave_bytes=8192)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    prof = get_profile("h100")
    s = muon_step(shapes, 1, prof, 8192)
    assert s.waves == opt.last_step_stats["waves"]
    assert muon_step(shapes, 1, prof, None).waves == 1


def test_llama70b_at_256_gpus():
    mats = matrices_of_arch(resolve_model("llama3-70b"))
    assert len(mats) == 80 * 7
    prof = get_profile("h100")
    one = muon_step(mats, 256, prof, None)
    bounded = muon_step(mats, 256, prof, 2**30)
    # the bounded step holds one wave, not every local matrix: below the one-wave step, and
    # at least the largest matrix plus its Newton-Schulz workspace (an owner needs it whole)
    assert bounded.transient_bytes < one.transient_bytes
    assert bounded.transient_bytes >= 2 * 28672 * 8192 * 2
    assert abs(bounded.compute_s - one.compute_s) < 1e-9 * max(1.0, one.compute_s)
