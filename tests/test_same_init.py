"""Ranks start from the same values (W = 2, one launch): ``check_same_init`` raises on every
rank naming exactly the parameters and buffers that differ, and ``sync_module_states`` makes
every rank hold rank 0's values (checked against a model built from rank 0's seed, bitwise),
after which ``fully_shard`` gathers rank 0's model. Sharded (DTensor) and meta tensors are
skipped by both."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import check_case, run_cases


def _model(seed_base=0, seed_head=0):
    torch.manual_seed(seed_base)
    base = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))
    torch.manual_seed(seed_head)
    head = nn.Linear(5, 3)  # an adapter or a new head, built from each rank's own random state
    return nn.Sequential(base, head)


def case_same_values_pass(rank, world):
    from ragged_fsdp import check_same_init

    assert check_same_init(_model()) == 9  # 6 parameters, 3 BatchNorm buffers


def case_differing_parameters_named_on_every_rank(rank, world):
    from ragged_fsdp import check_same_init
    from ragged_fsdp.agreement import DisagreementError

    model = _model(seed_head=rank)
    with pytest.raises(DisagreementError) as e:
        check_same_init(model)
    msg = str(e.value)
    assert "1.weight, 1.bias" in msg and "2 of 9" in msg and "sync_module_states" in msg, msg
    assert "0.0.weight" not in msg, msg
    # a buffer: BatchNorm's running statistics
    model = _model()
    if rank == 1:
        model[0][1].running_mean.add_(1.0)
    with pytest.raises(DisagreementError, match=r"1 of 9 .*: 0\.1\.running_mean\."):
        check_same_init(model)


def case_sync_gives_rank0_values(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_fsdp import check_same_init, fully_shard, sync_module_states

    model = _model(seed_head=rank)
    model[0][1].running_mean.add_(rank)
    assert sync_module_states(model) == 9
    ref = _model(seed_head=0)  # what rank 0 built
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n
    check_same_init(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    for (n, p), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), b), n
    assert check_same_init(model) == 3  # only the buffers are left plain: parameters are sharded now


def case_meta_skipped(rank, world):
    from ragged_fsdp import check_same_init

    with torch.device("meta"):
        model = _model()
    assert check_same_init(model) == 0
    assert dist.get_world_size() == world


CASES = [case_same_values_pass, case_differing_parameters_named_on_every_rank, case_sync_gives_rank0_values,
         case_meta_skipped]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_same_init(results, case):
    check_case(results, case, 2)
