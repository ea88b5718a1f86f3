"""torchtitan 0.3.0 with HSDP, TP, EP and CP trains through
``--module ragged_fsdp.integrations.torchtitan`` as with torchtitan's own FSDP2 (4 gloo CPU
ranks, debug models cut to their first two blocks; HSDP and FSDPxTP in bf16 with fp32
reduction, torchtitan's default mixed precision, the others in fp32).

One process group of 4 ranks runs every configuration in turn. torchtitan's own
``Trainer`` writes one seed checkpoint per model with FSDP2 (DCP reshards it to each
configuration's layout on load); each configuration then trains ``STEPS`` steps from it
with FSDP2 (stock config function) and with ragged_fsdp (the ragged module's config
function of the same name), both with torchtitan's parallelism settings for that
configuration; losses and gradient norms (float64 norms of the full gradients, and
torchtitan's logged norm) are compared step by step. For HSDP each framework also resumes
the other's full checkpoint (model, optimizer, data loader, step) for one more step; the
other runs write no checkpoint. CPU stand-ins: ragged_fsdp's CPU mode
(``ragged_fsdp.integrations.torchtitan.cpu``).

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
STEPS = 2  # step 2 runs on the parameters of one optimizer update
N_LAYERS = 2  # deepseek-v3 debug: one dense block, one MoE block
SEQ_LEN = 64
# the bounds: losses 1e-5 relative in fp32, 1e-4 in bf16; gradient norms 1e-3.
# Measured values are in docs/integrations.md.
LOSS_RTOL = {"float32": 1e-5, "bfloat16": 1e-4}
NORM_RTOL = 1e-3
# torchtitan's logged norm: FSDP2 sums fp32 per-shard norms; ragged_fsdp accumulates in
# float64, so the logged values differ by the FSDP2 side's fp32 rounding
LOGGED_NORM_RTOL = 1e-3

# name: (model, torchtitan parallelism settings, sequence length, cross-framework resume,
# parameter dtype of the mixed-precision policy; the reduction is fp32 throughout)
CONFIGS = {
    "hsdp": ("llama3", dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2), SEQ_LEN, True,
             "bfloat16"),
    "tp": ("llama3", dict(data_parallel_shard_degree=2, tensor_parallel_degree=2), SEQ_LEN, False, "bfloat16"),
    "ep": ("deepseek_v3", dict(data_parallel_shard_degree=4, expert_parallel_degree=2), SEQ_LEN, False,
           "float32"),
    # torch's CP FlexAttention needs seq_len divisible by cp * 128
    "cp": ("llama3", dict(data_parallel_shard_degree=2, context_parallel_degree=2), 256, False, "float32"),
    # torch 2.13's FSDP2 fails under full_dtensor with TP ("Expected param's DTensor mesh to
    # be the same mesh passed to fully_shard"), so the backend is matched on FSDP alone
    "full_dtensor": ("llama3", dict(spmd_backend="full_dtensor", data_parallel_shard_degree=4), SEQ_LEN, False,
                     "float32"),
}

# the seed checkpoint of each model, written by the first configuration that needs it
_SEEDS: dict[str, str] = {}


def _selected():
    only = os.environ.get("RAGGED_TT_ND")
    return [n for n in CONFIGS if not only or n in only.split(",")]


def _seed(h, model: str, fsdp2_fn, assets: str, root: str) -> str:
    """One FSDP2 seed checkpoint per model, on plain FSDP over the 4 ranks with
    partial_dtensor: under full_dtensor a second FSDP2 trainer in the same process fails in
    FSDP2's fully_shard ("different mesh objects")."""
    if model not in _SEEDS:
        dump = os.path.join(root, f"seed_{model}")
        h.train(h.build_config(fsdp2_fn, assets=assets, dump=dump, steps=0, seq_len=SEQ_LEN, n_layers=N_LAYERS,
                               parallelism=dict(data_parallel_shard_degree=WORLD, spmd_backend="partial_dtensor")),
                save_seed=True)
        _SEEDS[model] = f"{dump}/checkpoint/step-0"
    return _SEEDS[model]


def _run_config(name: str, rank: int) -> None:
    from ragged_fsdp.integrations.torchtitan import compare as h

    model, par, seq_len, resume, dtype = CONFIGS[name]
    root = os.environ["RAGGED_TT_ROOT"]
    base = os.path.join(root, name)
    fsdp2_fn, ragged_fn = h.registries(model)
    assets = os.path.join(root, "assets")
    common = dict(assets=assets, parallelism=par, seq_len=seq_len, dtype=dtype, n_layers=N_LAYERS)
    bounds = dict(loss_rtol=LOSS_RTOL[dtype], norm_rtol=NORM_RTOL, logged_rtol=LOGGED_NORM_RTOL)

    seed = _seed(h, model, fsdp2_fn, assets, root)
    a = h.train(h.build_config(fsdp2_fn, dump=f"{base}/fsdp2", steps=STEPS, load_path=seed, save=resume, **common))
    b = h.train(h.build_config(ragged_fn, dump=f"{base}/ragged", steps=STEPS, load_path=seed, save=resume, **common))
    rep = {"config": [model, par, dtype], "steps": h.compare_runs(name, a, b, range(1, STEPS + 1), **bounds),
           "losses": {"fsdp2": a.losses, "ragged": b.losses},
           "exact_grad_norms": {"fsdp2": a.exact_grad_norms, "ragged": b.exact_grad_norms},
           "logged_grad_norms": {"fsdp2": a.grad_norms, "ragged": b.grad_norms},
           "seconds": {"fsdp2": a.seconds, "ragged": b.seconds}}
    if resume:
        full = dict(model_only=False, steps=STEPS + 1, save=False, **common)
        c = h.train(h.build_config(ragged_fn, dump=f"{base}/ragged_from_fsdp2",
                                   load_path=f"{base}/fsdp2/checkpoint/step-{STEPS}", **full))
        d = h.train(h.build_config(fsdp2_fn, dump=f"{base}/fsdp2_from_ragged",
                                   load_path=f"{base}/ragged/checkpoint/step-{STEPS}", **full))
        assert list(c.losses) == list(d.losses) == [STEPS + 1], (c.losses, d.losses)
        rep["resume"] = h.compare_runs(f"{name} resume", d, c, [STEPS + 1], **bounds)
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
