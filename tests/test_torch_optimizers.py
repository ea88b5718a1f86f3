"""Every optimizer in torch.optim, once, on fully_shard parameters at W = 2.

The element-by-element ones (SGD ... Rprop) train: parameters after 3 steps equal the same
optimizer on an unsharded copy in one process, bit for bit (every rank sees the same batch,
so the averaged gradient is the local one exactly, and each element's update is the same
float ops on the same values). The model has odd shapes (7 x 5, 1 x 7) and a 1-element bias
that leaves one rank empty. The ones that need whole tensors (torch.optim.Muon, Adafactor,
LBFGS, SparseAdam) are refused at their first step with a TypeError naming a parameter and
the optimizer to use instead, before any parameter moved; on an unsharded model they run.
"""
import inspect

import pytest
import torch
import torch.nn as nn

from _dist import check_case, run_cases

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
KWARGS = {"SGD": dict(momentum=0.9)}


def _model(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 1, bias=bias))


def _shard(model, world):
    from torch.distributed.device_mesh import init_device_mesh

    import ragged_fsdp as rf

    rf.fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _train(model, opt, steps=3):
    for s in range(steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(s))  # the same on every rank
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def case_elementwise_match_single_process(rank, world):
    for name in ELEMENTWISE:
        cls = getattr(torch.optim, name)
        ref = _model()
        _train(ref, cls(ref.parameters(), lr=0.05, **KWARGS.get(name, {})))
        model = _shard(_model(), world)
        _train(model, cls(model.parameters(), lr=0.05, **KWARGS.get(name, {})))
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_full(a).detach(), b.detach()), f"torch.optim.{name}: {n} differs from one process"


def _refused(world, name, make, fix):
    model = _shard(_model(bias=False), world)
    before = [_full(p).detach().clone() for p in model.parameters()]
    opt = make(model)
    with pytest.raises(TypeError) as e:
        _train(model, opt, steps=1)
    msg = str(e.value)
    assert f"torch.optim.{name}" in msg and fix in msg and "(7, 5)" in msg, msg
    for p, b in zip(model.parameters(), before):
        assert torch.equal(_full(p).detach(), b), "a refused optimizer changed a parameter"


def case_whole_tensor_optimizers_refused_first_step(rank, world):
    _refused(world, "Muon", lambda m: torch.optim.Muon(m.parameters(), lr=0.02), "ragged_fsdp.optim.Muon")
    _refused(world, "Adafactor", lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
             "ragged_fsdp.optim.AdamW8bit")
    _refused(world, "LBFGS", lambda m: torch.optim.LBFGS(m.parameters()), "unsharded")
    _refused(world, "SparseAdam", lambda m: torch.optim.SparseAdam(list(m.parameters())), "torch.optim.Adam")
    # names given to the optimizer show in the message
    model = _shard(_model(bias=False), world)
    opt = torch.optim.Muon(model.named_parameters(), lr=0.02)
    with pytest.raises(TypeError, match="'0.weight' \\(7, 5\\)"):
        _train(model, opt, steps=1)


def case_unsharded_muon_still_runs(rank, world):
    model = _model(bias=False)
    _shard(_model(), world)  # fully_shard has run in this process: the hook is registered
    _train(model, torch.optim.Muon(model.parameters(), lr=0.02), steps=1)


CASES = [case_elementwise_match_single_process, case_whole_tensor_optimizers_refused_first_step,
         case_unsharded_muon_still_runs]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_torch_optimizer(results, case):
    check_case(results, case, 2)


def test_every_torch_optimizer_is_classified():
    """A torch release that adds an optimizer fails here until it is tested above."""
    from ragged_fsdp.fsdp.core.torch_optimizers import NEEDS_WHOLE_TENSORS

    found = {n for n, c in vars(torch.optim).items()
             if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    assert found == set(ELEMENTWISE) | set(NEEDS_WHOLE_TENSORS), found ^ (set(ELEMENTWISE) | set(NEEDS_WHOLE_TENSORS))
