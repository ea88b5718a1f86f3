"""torchtitan 0.3.0 trains with ragged_fsdp through ``--module ragged_fsdp.integrations.torchtitan``
exactly as with its own FSDP2 (2 gloo CPU ranks, fp32).

For the llama3 and deepseek-v3 debug models, torchtitan's own ``Trainer`` (built from the
stock config function for FSDP2, and from the ragged module's config function of the same
name) trains from one seed checkpoint; losses, gradient norms and final parameters are
compared, and DCP checkpoints (model, optimizer, data loader, step) written by each framework
are resumed by the other. CPU stand-ins: ragged_fsdp's CPU mode
(``ragged_fsdp.integrations.torchtitan.cpu``); ``ragged_fsdp.integrations.torchtitan.compare`` records the runs.
"""

from __future__ import annotations

import json
import re
import math
import os
import types

import pytest

pytest.importorskip("torchtitan")

from _dist import check_case, run_cases  # noqa: E402

STEPS = 3
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-5  # float64 norms of the full gradients
# AdamW moves every element by about lr (8e-4) whatever its gradient size, so elements whose
# gradient is near zero (rarely routed experts) move by rounding noise: allow a quarter step.
PARAM_ATOL = 2e-4
# torchtitan's logged norm: FSDP2 sums fp32 per-shard norms; ragged_fsdp accumulates in
# float64, so the two logged values differ by fp32 rounding of the FSDP2 side (~5e-5).
LOGGED_NORM_RTOL = 5e-4
BOUNDS = dict(loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL, logged_rtol=LOGGED_NORM_RTOL, param_atol=PARAM_ATOL, exact_logged_norm=True)


def _train_both_ways(model: str, rank: int, world: int) -> None:
    from ragged_fsdp.integrations.torchtitan import compare as h

    root = os.environ["RAGGED_TT_ROOT"]
    # torchtitan's default ChunkedLossWrapper runs norm (in the decoder) and lm_head (in the
    # loss) of the [norm, lm_head] group in separate calls with an explicit reshard() between;
    # RAGGED_TT_CHUNKED=0 compares with torchtitan's plain cross-entropy loss instead.
    chunked = os.environ.get("RAGGED_TT_CHUNKED", "1") == "1"
    base = os.path.join(root, model)
    fsdp2_fn, ragged_fn = h.registries(model)
    common = dict(assets=os.path.join(root, "assets"), chunked_loss=chunked)
    N = STEPS

    # one seed checkpoint, written by torchtitan's own (FSDP2) trainer
    h.train(h.build_config(fsdp2_fn, dump=f"{base}/seed", steps=0, **common), save_seed=True)
    seed = f"{base}/seed/checkpoint/step-0"

    # N steps with each framework from the seed; each saves its full state at step N
    a = h.train(h.build_config(fsdp2_fn, dump=f"{base}/fsdp2", steps=N, load_path=seed, **common))
    b = h.train(h.build_config(ragged_fn, dump=f"{base}/ragged", steps=N, load_path=seed, **common))
    rep = {"steps": h.compare_runs("train", a, b, range(1, N + 1), **BOUNDS)}
    rep["losses"] = {"fsdp2": a.losses, "ragged": b.losses}
    rep["exact_grad_norms"] = {"fsdp2": a.exact_grad_norms, "ragged": b.exact_grad_norms}
    rep["logged_grad_norms"] = {"fsdp2": a.grad_norms, "ragged": b.grad_norms}

    # each resumes the other's step-N checkpoint (model, optimizer, data loader, step)
    full = dict(model_only=False, steps=N + 1, **common)
    c = h.train(h.build_config(ragged_fn, dump=f"{base}/ragged_from_fsdp2", load_path=f"{base}/fsdp2/checkpoint/step-{N}", **full))
    d = h.train(h.build_config(fsdp2_fn, dump=f"{base}/fsdp2_from_ragged", load_path=f"{base}/ragged/checkpoint/step-{N}", **full))
    assert list(c.losses) == list(d.losses) == [N + 1], (c.losses, d.losses)  # resumed at step N
    rep["resume"] = h.compare_runs("resume", d, c, [N + 1], **BOUNDS)

    out = os.environ.get("RAGGED_TT_REPORT")
    if out and rank == 0:
        with open(f"{out}.{model}.json", "w") as f:
            json.dump(rep, f, indent=1, default=str)


def case_llama3(rank, world):
    _train_both_ways("llama3", rank, world)


def case_deepseek_v3(rank, world):
    _train_both_ways("deepseek_v3", rank, world)


def case_shard_placement_fn_maps_to_granularity(rank, world):
    """torchtitan asks for Shard(1) on MoE experts when the mesh outnumbers the experts: each
    rank's Shard(1) piece is whole rows of every expert, so the planner keeps rows whole."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from ragged_fsdp.integrations.torchtitan import fully_shard_for_torchtitan

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = nn.Module()
    m.experts = nn.Parameter(torch.randn(1, 6, 5))  # fewer experts than ranks
    m.dense = nn.Parameter(torch.randn(7))
    full = {k: v.detach().clone() for k, v in m.named_parameters()}
    fully_shard_for_torchtitan(m, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else None)
    pl = m.experts.placements[0]
    assert pl.dims == (0, 1) and pl.unit == 1, pl  # row granularity: 5-element rows kept whole
    for k, v in m.named_parameters():
        assert torch.equal(v.full_tensor(), full[k]), k


CASES = [case_llama3, case_deepseek_v3, case_shard_placement_fn_maps_to_granularity]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan")
    os.environ["RAGGED_TT_ROOT"] = str(root)
    try:
        return run_cases(2, CASES, timeout=600)
    finally:
        os.environ.pop("RAGGED_TT_ROOT", None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_torchtitan(results, case):
    check_case(results, case, 2)


# -- single process: the module's surface and its refusals -------------------------------------

def test_config_module_is_a_torchtitan_module():
    """``--module ragged_fsdp.integrations.torchtitan --config llama3_debugmodel`` parses with
    torchtitan's own ConfigManager into torchtitan's config with the ragged parallelize_fn."""
    from torchtitan.config import ConfigManager

    import ragged_fsdp.integrations.torchtitan as rt

    cfg = ConfigManager().parse_args(
        ["--module", "ragged_fsdp.integrations.torchtitan", "--config", "llama3_debugmodel", "--training.steps", "7"]
    )
    assert cfg.training.steps == 7
    assert getattr(cfg.model_spec.parallelize_fn, "__ragged_fsdp__", False)
    assert cfg.parallelism.spmd_backend == "partial_dtensor"
    for name in ("llama3_8b", "qwen3_0_6b", "deepseek_v3_16b", "gpt_oss_20b"):
        spec = getattr(rt, name)().model_spec
        assert getattr(spec.parallelize_fn, "__ragged_fsdp__", False), name
    # a backend given on the command line still wins, and is then refused by parallelize
    cfg = ConfigManager().parse_args(
        ["--module", "ragged_fsdp.integrations.torchtitan", "--config", "llama3_debugmodel",
         "--parallelism.spmd_backend", "spmd_types"]
    )
    assert cfg.parallelism.spmd_backend == "spmd_types"


def _dims(**kw):
    return types.SimpleNamespace(**{**dict(dp_replicate=1, tp=1, cp=1, ep=1, pp=1), **kw})


def _par(**kw):
    return types.SimpleNamespace(**{**dict(spmd_backend="partial_dtensor", enable_fsdp_symm_mem=False), **kw})


@pytest.mark.parametrize("dims", [dict(dp_replicate=2), dict(tp=2), dict(cp=2), dict(ep=4),
                                  dict(dp_replicate=2, tp=2, ep=2, cp=2)])
def test_hsdp_tp_ep_cp_are_accepted(dims):
    from ragged_fsdp.integrations.torchtitan import check_supported

    check_supported(_dims(**dims), _par())
    if "cp" not in dims:
        check_supported(_dims(**dims), _par(spmd_backend="full_dtensor"))


@pytest.mark.parametrize("dims, par, match", [
    (dict(pp=2), {}, r"pipeline_parallel_degree=2 .*Use --parallelism.pipeline_parallel_degree 1"),
    ({}, dict(spmd_backend="spmd_types"), r"spmd_backend=spmd_types .*partial_dtensor"),
    (dict(cp=2), dict(spmd_backend="full_dtensor"), r"full_dtensor with --parallelism.context_parallel_degree=2"),
    ({}, dict(enable_fsdp_symm_mem=True), r"enable_fsdp_symm_mem .*drop the option"),
])
def test_what_is_left_is_refused_naming_the_setting(dims, par, match):
    from ragged_fsdp.integrations.torchtitan import Refused, check_supported

    with pytest.raises(Refused, match=match):
        check_supported(_dims(**dims), _par(**par))


def test_a_refusal_is_one_line_without_traceback(tmp_path):
    """A refusal reaching the top of a torchtitan run prints one line (per rank), no traceback;
    any other exception still gets Python's traceback."""
    import subprocess
    import sys

    script = (
        "import ragged_fsdp.integrations.torchtitan as rt, types\n"
        "rt.check_supported(types.SimpleNamespace(dp_replicate=1, tp=1, cp=1, ep=1, pp=2),"
        " types.SimpleNamespace(spmd_backend='partial_dtensor', enable_fsdp_symm_mem=False))\n"
    )
    # torchrun's failure summary prints the error file torchtitan's @record writes: it must
    # hold the one line too
    err_file = tmp_path / "error.json"
    err_file.write_text(json.dumps({"message": {"message": "x", "extraInfo": {"py_callstack": "Traceback ..."}}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    # both processes at once: each spends its ~10 s importing torchtitan
    refused = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**env, "TORCHELASTIC_ERROR_FILE": str(err_file)})
    other = subprocess.Popen([sys.executable, "-c", "import ragged_fsdp.integrations.torchtitan\nraise KeyError('x')"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, refused_err = refused.communicate(timeout=300)
    _, other_err = other.communicate(timeout=300)
    assert refused.returncode == 1
    # torchtitan imports torchao when it is installed (make test installs it): its "Failed to
    # load <kernel>.so" lines and torch's logging lines (W1202 ...) are not ours
    noise = re.compile(r"^(Failed to load .*torchao|[WIE]\d{4} \d\d:\d\d)")
    lines = [ln for ln in refused_err.splitlines()
             if ln.strip() and "Warning" not in ln and "warn" not in ln and not noise.match(ln)]
    assert len(lines) == 1 and "Traceback" not in refused_err, refused_err
    assert "pipeline_parallel_degree=2" in lines[0], lines
    summary = json.loads(err_file.read_text())["message"]
    assert "Traceback" not in summary["extraInfo"]["py_callstack"], summary
    assert "pipeline_parallel_degree=2" in summary["extraInfo"]["py_callstack"], summary
    assert "Traceback" in other_err and "KeyError" in other_err, other_err


def test_spmd_types_on_the_command_line_still_wins():
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(
        ["--module", "ragged_fsdp.integrations.torchtitan", "--config", "llama3_debugmodel",
         "--parallelism.spmd_backend", "full_dtensor"]
    )
    assert cfg.parallelism.spmd_backend == "full_dtensor"


def test_backend_notice():
    from ragged_fsdp.integrations.torchtitan.support import backend_notice

    line = backend_notice(_par(), switched=True)
    assert "spmd_backend is partial_dtensor" in line and "spmd_types" in line and "\n" not in line
    assert backend_notice(_par(), switched=False) is None
    assert backend_notice(_par(spmd_backend="full_dtensor"), switched=True) is None


def test_shard_placement_result_keeps_its_placement_as_granularity():
    import torch.nn as nn
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Replicate, Shard

    from ragged_fsdp.integrations.torchtitan import Refused
    from ragged_fsdp.integrations.torchtitan.shard import granularity_from_placement

    p = nn.Parameter(nn.Linear(4, 3).weight.detach())
    assert granularity_from_placement(p, ShardPlacementResult(placement=Shard(0), mesh_info=None), "w") == "row"
    e = nn.Parameter(nn.Linear(4, 3).weight.detach().reshape(1, 3, 4))
    assert granularity_from_placement(e, ShardPlacementResult(placement=Shard(1), mesh_info=None), "e") == "row"
    assert granularity_from_placement(e, Shard(0), "e") == "block:12"
    assert granularity_from_placement(p, None, "w") is None
    with pytest.raises(Refused, match="only Shard"):
        granularity_from_placement(p, Replicate(), "w")


def _torchrun():
    import shutil
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    return torchrun


def _env(tmp_path):
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p),
            "RAGGED_FSDP_ASSETS": str(tmp_path / "assets")}


def test_cpu_mode_command_line(tmp_path):
    """The documented CPU command trains (torchrun, 2 gloo ranks, 2-way FSDP,
    2 steps) and logs a finite loss each step; the start-up notice about the backend appears
    once. Each rank's stdout goes to a file (torchrun --redirects): no ANSI colour codes in
    either, rank 0 logs torchtitan's info lines, rank 1 none of them."""
    import glob
    import subprocess

    logs = tmp_path / "logs"
    cmd = [_torchrun(), "--standalone", "--nproc_per_node", "2", "--redirects", "3", "--log-dir", str(logs),
           "-m", "ragged_fsdp.integrations.torchtitan.cpu",
           "--module", "ragged_fsdp.integrations.torchtitan", "--config", "llama3_debugmodel",
           "--training.steps", "2", "--training.local_batch_size", "2", "--training.seq_len", "64",
           "--validator.no-enable", "--checkpoint.no-enable", "--dump_folder", str(tmp_path / "out")]
    env = _env(tmp_path)
    env.pop("RAGGED_FSDP_LOG_ALL_RANKS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    rank_out = {}
    for rank in (0, 1):
        found = glob.glob(str(logs / "**" / str(rank) / "stdout.log"), recursive=True)
        assert len(found) == 1, (rank, found, r.stdout[-2000:], r.stderr[-2000:])
        rank_out[rank] = open(found[0]).read()
    out = r.stdout + r.stderr + rank_out[0] + rank_out[1]
    assert r.returncode == 0, out[-4000:]
    assert "\x1b[" not in out, [ln for ln in out.splitlines() if "\x1b[" in ln][:5]
    losses = [float(x) for x in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", rank_out[0])]
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), rank_out[0][-4000:]
    assert out.count("spmd_backend is partial_dtensor") == 1, out[-4000:]
    info = re.compile(r"^\[titan\] .* - INFO - ", re.M)
    assert len(info.findall(rank_out[0])) >= 10, rank_out[0][-4000:]
    assert not info.findall(rank_out[1]), rank_out[1][-4000:]


def test_log_on_rank_zero(monkeypatch):
    """Ranks other than 0 log warnings only; RAGGED_FSDP_LOG_ALL_RANKS=1 gives them back."""
    import logging

    from ragged_fsdp.integrations.torchtitan.cpu import log_on_rank_zero

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.INFO)
    for rank, every, quiet, level in [("0", None, False, logging.INFO), ("1", None, False, logging.WARNING),
                                      ("1", "1", False, logging.INFO), ("0", None, True, logging.WARNING)]:
        root.setLevel(logging.INFO)
        monkeypatch.setenv("RANK", rank)
        if every is None:
            monkeypatch.delenv("RAGGED_FSDP_LOG_ALL_RANKS", raising=False)
        else:
            monkeypatch.setenv("RAGGED_FSDP_LOG_ALL_RANKS", every)
        log_on_rank_zero(quiet=quiet)
        assert root.level == level, (rank, every, quiet)


def test_colour_off_when_stdout_is_not_a_terminal(monkeypatch):
    import io
    import sys

    from ragged_fsdp.integrations.torchtitan import llama3_debugmodel
    from ragged_fsdp.integrations.torchtitan.cpu import cpu_defaults

    class _Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cpu_defaults(llama3_debugmodel()).metrics.disable_color_printing is True
    monkeypatch.setattr(sys, "stdout", _Tty())
    assert cpu_defaults(llama3_debugmodel()).metrics.disable_color_printing is False


def test_compare_command(tmp_path):
    """The documented comparison command (2 ranks, 2 steps, seq 64): one seed checkpoint,
    both frameworks from it; its printed table and JSON agree within the bounds of the
    training comparison above."""
    import subprocess
    import sys

    out_file = tmp_path / "stdout.txt"
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "ragged_fsdp.integrations.torchtitan.compare", "--config", "llama3_debugmodel",
           "--nproc", "2", "--steps", "2", "--seq-len", "64", "--batch", "2", "--json", str(report),
           "--rtol", str(LOSS_RTOL)]
    with open(out_file, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(tmp_path), timeout=600)
    out = out_file.read_text()
    assert r.returncode == 0, out[-4000:]
    assert "\x1b[" not in out
    rep = json.loads(report.read_text())
    assert [row["step"] for row in rep["rows"]] == [1, 2], rep
    assert rep["world"] == 2 and rep["spmd_backend"] == "partial_dtensor" and rep["same_parameter_names"]
    for row in rep["rows"]:
        assert row["loss"]["rel"] <= LOSS_RTOL, row
        assert row["grad_norm"]["rel"] <= NORM_RTOL, row
        assert row["logged_grad_norm"]["rel"] <= LOGGED_NORM_RTOL, row
    assert rep["max_rel"]["param_abs"] <= PARAM_ATOL, rep["max_rel"]
    # the printed table: one line per step with both losses and their relative difference
    table = [ln.split() for ln in out.splitlines() if re.match(r"^\s+[12]\s+\d+\.\d{6}\s", ln)]
    assert len(table) == 2, out[-3000:]
    for cols, row in zip(table, rep["rows"]):
        assert float(cols[1]) == pytest.approx(row["loss"]["fsdp2"], abs=1e-6)
        assert float(cols[2]) == pytest.approx(row["loss"]["ragged"], abs=1e-6)
        assert float(cols[3]) <= LOSS_RTOL
    assert "max rel. diff: loss" in out
