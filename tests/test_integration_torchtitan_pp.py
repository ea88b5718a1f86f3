"""torchtitan 0.3.0 with pipeline parallelism: PP 2 x FSDP 2 with 1F1B on 4 gloo CPU ranks
(llama3 debug model, fp32), ``--module ragged_fsdp.integrations.torchtitan`` against
torchtitan's own FSDP2 from the same seed checkpoint.

torchtitan 0.3.0's trainer calls ``pp_schedule.step(arg_mbs=..., kwarg_mbs=...,
target_mbs=...)``, which torch 2.13's schedules lack; ragged_fsdp's CPU mode
(``ragged_fsdp.integrations.torchtitan.cpu``) adapts that call for both frameworks alike.
Losses, float64 norms of this rank's full gradients and torchtitan's logged norm are
compared step by step, and the final parameters of this rank's stage. ``RAGGED_TT_REPORT=PREFIX``
writes the numbers to ``PREFIX.pp_1f1b.json``.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torchtitan")

from _dist import check_case, run_cases  # noqa: E402

WORLD = 4
STEPS = 3
BOUNDS = dict(loss_rtol=1e-5, norm_rtol=1e-3, logged_rtol=1e-3, param_atol=1e-5)
PARALLELISM = dict(pipeline_parallel_degree=2, data_parallel_shard_degree=2, pipeline_parallel_schedule="1F1B")


def case_pp_1f1b(rank, world):
    from ragged_fsdp.integrations.torchtitan import compare as h

    root = os.environ["RAGGED_TT_ROOT"]
    fsdp2_fn, ragged_fn = h.registries("llama3")
    common = dict(assets=os.path.join(root, "assets"), parallelism=PARALLELISM, seq_len=64)
    h.train(h.build_config(fsdp2_fn, dump=f"{root}/seed", steps=0, **common), save_seed=True)
    seed = f"{root}/seed/checkpoint/step-0"
    a = h.train(h.build_config(fsdp2_fn, dump=f"{root}/fsdp2", steps=STEPS, load_path=seed, **common))
    b = h.train(h.build_config(ragged_fn, dump=f"{root}/ragged", steps=STEPS, load_path=seed, **common))
    rep = {"config": PARALLELISM, "steps": h.compare_runs("pp_1f1b", a, b, range(1, STEPS + 1), **BOUNDS),
           "losses": {"fsdp2": a.losses, "ragged": b.losses},
           "exact_grad_norms": {"fsdp2": a.exact_grad_norms, "ragged": b.exact_grad_norms},
           "seconds": {"fsdp2": a.seconds, "ragged": b.seconds}}
    out = os.environ.get("RAGGED_TT_REPORT")
    if out:
        with open(f"{out}.pp_1f1b.rank{rank}.json", "w") as f:
            json.dump(rep, f, indent=1, default=str)


CASES = [case_pp_1f1b]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_pp")
    os.environ["RAGGED_TT_ROOT"] = str(root)
    try:
        return run_cases(WORLD, CASES, timeout=900)
    finally:
        os.environ.pop("RAGGED_TT_ROOT", None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_torchtitan_pp(results, case):
    check_case(results, case, WORLD)
