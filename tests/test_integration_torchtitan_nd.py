"""torchtitan 0.3.0 with HSDP, TP, EP and CP trains through
``--module ragged_fsdp.integrations.torchtitan`` as with torchtitan's own FSDP2 (4 gloo CPU
ranks, fp32, debug models).

One process group of 4 ranks runs every configuration in turn. For each, torchtitan's own
``Trainer`` writes a seed checkpoint with FSDP2, then trains ``STEPS`` steps from it with
FSDP2 (stock config function) and with ragged_fsdp (the ragged module's config function of
the same name), both with torchtitan's parallelism settings for that configuration; losses and gradient norms (float64 norms of the full gradients, and
torchtitan's logged norm) are compared step by step. For HSDP each framework also resumes the other's full checkpoint
(model, optimizer, data loader, step) for one more step. CPU stand-ins: ragged_fsdp's CPU
mode (``ragged_fsdp.integrations.torchtitan.cpu``).

``RAGGED_TT_ND=hsdp,ep`` runs only those configurations; ``RAGGED_TT_REPORT=PREFIX`` writes
each configuration's numbers (and step times) to ``PREFIX.<name>.json``.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torchtitan")

from _dist import check_case, run_cases  # noqa: E402

WORLD = 4
STEPS = 3
LOSS_RTOL = 1e-5  # fp32
NORM_RTOL = 1e-3  # the bound; measured values are in docs/integrations.md
# torchtitan's logged norm: FSDP2 sums fp32 per-shard norms; ragged_fsdp accumulates in
# float64, so the logged values differ by the FSDP2 side's fp32 rounding
LOGGED_NORM_RTOL = 1e-3
BOUNDS = dict(loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL, logged_rtol=LOGGED_NORM_RTOL)

# name: (model, torchtitan parallelism settings, sequence length, cross-framework resume)
CONFIGS = {
    "hsdp": ("llama3", dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2), 64, True),
    "tp": ("llama3", dict(data_parallel_shard_degree=2, tensor_parallel_degree=2), 64, False),
    "ep": ("deepseek_v3", dict(data_parallel_shard_degree=4, expert_parallel_degree=2), 64, False),
    # torch's CP FlexAttention needs seq_len divisible by cp * 128
    "cp": ("llama3", dict(data_parallel_shard_degree=2, context_parallel_degree=2), 256, False),
    # torch 2.13's FSDP2 fails under full_dtensor with TP ("Expected param's DTensor mesh to
    # be the same mesh passed to fully_shard"), so the backend is matched on FSDP alone
    "full_dtensor": ("llama3", dict(spmd_backend="full_dtensor", data_parallel_shard_degree=4), 64, False),
}


def _selected():
    only = os.environ.get("RAGGED_TT_ND")
    return [n for n in CONFIGS if not only or n in only.split(",")]


def _run_config(name: str, rank: int) -> None:
    import _torchtitan_cpu as h

    model, par, seq_len, resume = CONFIGS[name]
    root = os.environ["RAGGED_TT_ROOT"]
    base = os.path.join(root, name)
    fsdp2_fn, ragged_fn = h.registries(model)
    common = dict(assets=os.path.join(root, "assets"), parallelism=par, seq_len=seq_len)

    # the seed comes from FSDP2 with partial_dtensor: under full_dtensor, a second FSDP2
    # trainer in the same process fails in FSDP2's fully_shard ("different mesh objects")
    seed_par = {**par, "spmd_backend": "partial_dtensor"}
    h.train(h.build_config(fsdp2_fn, dump=f"{base}/seed", steps=0, **{**common, "parallelism": seed_par}),
            save_seed=True)
    seed = f"{base}/seed/checkpoint/step-0"
    a = h.train(h.build_config(fsdp2_fn, dump=f"{base}/fsdp2", steps=STEPS, load_path=seed, **common))
    b = h.train(h.build_config(ragged_fn, dump=f"{base}/ragged", steps=STEPS, load_path=seed, **common))
    rep = {"config": [model, par], "steps": h.compare_runs(name, a, b, range(1, STEPS + 1), **BOUNDS),
           "losses": {"fsdp2": a.losses, "ragged": b.losses},
           "exact_grad_norms": {"fsdp2": a.exact_grad_norms, "ragged": b.exact_grad_norms},
           "logged_grad_norms": {"fsdp2": a.grad_norms, "ragged": b.grad_norms},
           "seconds": {"fsdp2": a.seconds, "ragged": b.seconds}}
    if resume:
        full = dict(model_only=False, steps=STEPS + 1, **common)
        c = h.train(h.build_config(ragged_fn, dump=f"{base}/ragged_from_fsdp2",
                                   load_path=f"{base}/fsdp2/checkpoint/step-{STEPS}", **full))
        d = h.train(h.build_config(fsdp2_fn, dump=f"{base}/fsdp2_from_ragged",
                                   load_path=f"{base}/ragged/checkpoint/step-{STEPS}", **full))
        assert list(c.losses) == list(d.losses) == [STEPS + 1], (c.losses, d.losses)
        rep["resume"] = h.compare_runs(f"{name} resume", d, c, [STEPS + 1], **BOUNDS)
    out = os.environ.get("RAGGED_TT_REPORT")
    if out and rank == 0:
        with open(f"{out}.{name}.json", "w") as f:
            json.dump(rep, f, indent=1, default=str)


def case_hsdp(rank, world):
    _run_config("hsdp", rank)


def case_tp(rank, world):
    _run_config("tp", rank)


def case_ep(rank, world):
    _run_config("ep", rank)


def case_cp(rank, world):
    _run_config("cp", rank)


def case_full_dtensor(rank, world):
    _run_config("full_dtensor", rank)


CASES = {"hsdp": case_hsdp, "tp": case_tp, "ep": case_ep, "cp": case_cp, "full_dtensor": case_full_dtensor}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_nd")
    os.environ["RAGGED_TT_ROOT"] = str(root)
    try:
        return run_cases(WORLD, [CASES[n] for n in _selected()], timeout=1500)
    finally:
        os.environ.pop("RAGGED_TT_ROOT", None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torchtitan_nd(results, name):
    if name not in _selected():
        pytest.skip(f"RAGGED_TT_ND={os.environ.get('RAGGED_TT_ND')}")
    check_case(results, CASES[name], WORLD)
