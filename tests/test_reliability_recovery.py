"""A step stopped by an exception that the training loop catches (the OOM-skip pattern:
catch, ``zero_grad()``, go on with the next batch), W=2 gloo, every rank raising at the same
point as a bad batch makes them.

The run that met the bad batches must train exactly like one that never saw them: the
same losses and the same parameters, bit for bit (the same ops on the same data in the same
order), with torch's AdamW and with ragged_fsdp's Muon. Before, an exception inside
backward left the model unsharded for good (every parameter a plain ``Parameter`` after a
few steps, losses 3.6e-2 off a clean run) and one inside forward left that block's
unsharded parameters registered, so an optimizer built next missed them.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from _dist import check_case, full, global_batch, run_cases

from ragged_fsdp.fsdp import fully_shard
from ragged_fsdp.models.llama import Llama, LlamaConfig
from ragged_fsdp.optim import Muon, muon_param_groups


class SimulatedOOM(RuntimeError):
    pass


def _model(world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny())
    mesh = init_device_mesh("cpu", (world,))
    for block in m.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _arm_faults(model, fault: dict):
    """``fault["at"]``: "forward" raises inside block 1's forward (after its all-gather);
    "backward" raises when the gradient reaches block 1's output (after the blocks above
    it were reduced: reductions are in flight)."""
    block = model.layers[1]

    def in_forward(module, args):
        if fault.get("at") == "forward":
            raise SimulatedOOM("simulated OOM in forward")

    def out_hook(module, args, out):
        if fault.get("at") == "backward" and out.requires_grad:
            def boom(grad):
                raise SimulatedOOM("simulated OOM in backward")
            out.register_hook(boom)

    block.register_forward_pre_hook(in_forward)
    block.register_forward_hook(out_hook)


def _train(world, rank, opt_cls, schedule):
    """``schedule``: per step, None (a good batch, the next one) or "forward"/"backward"
    (a bad batch that raises there and is skipped)."""
    model = _model(world)
    fault: dict = {}
    _arm_faults(model, fault)
    opt = opt_cls(model)
    cfg = LlamaConfig.tiny()
    losses, good = [], 0
    for where in schedule:
        batch = good if where is None else 1000 + len(losses)
        tokens, targets = global_batch(batch, 2 * world, 16, cfg.vocab_size)
        t, y = tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2]
        fault["at"] = where
        try:
            loss = model.loss(t, y)
            loss.backward()
        except SimulatedOOM:
            assert where is not None
            opt.zero_grad()
            if where == "forward":
                # the model is sharded again as soon as the exception leaves forward
                bad = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
                assert not bad, f"unsharded after a caught forward exception: {bad}"
            continue
        assert where is None, f"the fault at {where} did not raise"
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        good += 1
    bad = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not bad, f"parameters left unsharded: {bad}"
    return losses, {n: full(p).clone() for n, p in model.named_parameters()}


CLEAN = [None, None, None, None]
FAULTY = [None, "forward", None, "backward", "backward", None, "forward", None]


def _check(world, rank, opt_cls):
    want_losses, want = _train(world, rank, opt_cls, CLEAN)
    got_losses, got = _train(world, rank, opt_cls, FAULTY)
    assert got_losses == want_losses, f"losses {got_losses} vs a clean run's {want_losses}"
    for n, p in got.items():
        assert torch.equal(p, want[n]), f"{n}: differs from a clean run by {(p - want[n]).abs().max().item():.2e}"


def case_oom_skip_adamw(rank, world):
    _check(world, rank, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))


def case_oom_skip_muon(rank, world):
    _check(world, rank, lambda m: Muon(muon_param_groups(m), lr=2e-2))


def case_optimizer_and_state_dict_after_forward_fault(rank, world):
    """An optimizer and a state dict made right after a caught forward exception see every
    parameter, sharded (before: the failed block's were plain tensors, and
    ``get_state_dict(model, opt)`` crashed)."""
    from ragged_fsdp.checkpoint import get_state_dict

    model = _model(world)
    fault = {"at": "forward"}
    _arm_faults(model, fault)
    tokens, targets = global_batch(0, 2 * world, 16, LlamaConfig.tiny().vocab_size)
    with pytest.raises(SimulatedOOM):
        model.loss(tokens[:2], targets[:2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fault["at"] = None
    model.loss(tokens[:2], targets[:2]).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    names = {n for n, _ in model.named_parameters()}
    assert set(msd) == names, set(msd) ^ names
    assert len(osd["state"]) == len(names), (len(osd["state"]), len(names))


CASES = [case_oom_skip_adamw, case_oom_skip_muon, case_optimizer_and_state_dict_after_forward_fault]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("case_"))
def test_recovery_w2(results, case):
    check_case(results, case, 2)
