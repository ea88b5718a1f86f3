"""`simulate` bounds and validates its input like `plan`: each bad input
gets exit 2 and one line naming the option and the fix, never a traceback or a table of nan."""
from __future__ import annotations

import builtins
import json

import pytest

from ragged_fsdp.cli import main as cli_main

BASE = ["simulate", "--model", "llama3-8b", "--gpus", "64", "--frameworks", "ragged"]


def _err(capsys, argv) -> str:
    rc = cli_main(argv)
    out = capsys.readouterr()
    assert rc == 2, (rc, out.out[-500:])
    assert "Traceback" not in out.err and out.out == ""
    return out.err


def test_gpus_bounded_like_plan(capsys):
    err = _err(capsys, ["simulate", "--gpus", "1000000000", "--frameworks", "ragged"])
    assert "--gpus 1000000000" in err and "131,072" in err
    assert "131,072" in _err(capsys, BASE + ["--sweep", "gpus=64..1048576"])


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("hidden_size", 0), ("intermediate_size", 0),
                                         ("num_hidden_layers", 0), ("vocab_size", -1), ("hidden_size", "4096")])
def test_hf_config_sizes(tmp_path, capsys, field, value):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    err = _err(capsys, ["simulate", "--model", str(path), "--gpus", "64", "--frameworks", "ragged"])
    assert field in err and "fix the config" in err


def test_hf_config_not_an_object(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    assert "must be a JSON object" in _err(capsys, ["simulate", "--model", str(path), "--gpus", "8"])


@pytest.mark.parametrize("data,what", [({"name": "x", "hbm_bytes": "80", "flops": 1, "mem_bw": 1, "nvlink_bw": 1,
                                         "net_bw": 1, "gpus_per_node": 8}, "hbm_bytes"),
                                       ({"name": "x"}, "lacks"), ([1], "JSON object"),
                                       ({"name": "x", "hbm_bytes": 8e10, "flops": 1e15, "mem_bw": 1e12, "nvlink_bw": 1e11,
                                         "net_bw": 1e10, "gpus_per_node": 8, "efficiency": 3}, "efficiency")])
def test_bad_gpu_profile(tmp_path, capsys, data, what):
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(data))
    err = _err(capsys, BASE + ["--gpu", str(path)])
    assert what in err and str(path) in err


def test_missing_profile_file(tmp_path, capsys):
    assert "cannot read" in _err(capsys, BASE + ["--gpu", str(tmp_path / "none.json")])


@pytest.mark.parametrize("flag,value", [("--efficiency", "nan"), ("--efficiency", "5"), ("--efficiency", "0"),
                                        ("--overlap", "1.5"), ("--gpu-tflops", "inf"), ("--gpu-net-gbs", "-1"),
                                        ("--gpus-per-node", "2.5")])
def test_profile_overrides_bounded(capsys, flag, value):
    assert flag in _err(capsys, BASE + [flag, value])


def test_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError("No module named 'matplotlib'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    err = _err(capsys, BASE + ["--sweep", "gpus=64..128", "--plot", str(tmp_path / "p.png")])
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err


@pytest.mark.parametrize("extra,what", [(["--mesh", "pp=4"], "--micro-batch"),
                                        (["--mesh", "pp=2", "--micro-batch", "4", "--microbatches", "3"], "divide"),
                                        (["--microbatches", "2"], "needs a PP mesh"),
                                        (["--mesh", "cp=2", "--seq", "4095"], "multiple of 2 x cp"),
                                        (["--async-tp"], "needs a TP mesh"),
                                        (["--float8-allgather"], "needs --float8"),
                                        (["--mesh", "tp=3,dp=2", "--gpus", "6"], "heads")])
def test_recipe_errors(capsys, extra, what):
    argv = BASE + extra
    assert what in _err(capsys, argv)
