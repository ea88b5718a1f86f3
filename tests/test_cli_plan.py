"""`python -m ragged_fsdp plan`."""

import json
import subprocess
import sys

import pytest

from ragged_fsdp.cli import main

KEYS = {"model", "world_size", "granularity", "padding_ratio", "lower_bound_ratio", "plan_seconds", "valid", "baselines"}


def test_json_has_the_keys(capsys):
    rc = main(["plan", "--model", "llama3-8b,gpt-oss-20b", "--world", "64,1024", "--granularity", "row,rows:16", "--json"])
    out = capsys.readouterr().out
    cells = json.loads(out)
    assert rc == 0 and len(cells) == 8
    for c in cells:
        assert KEYS <= set(c)
        assert c["valid"] is True
        assert set(c["baselines"]) == {"fsdp2", "fsdp1", "deepspeed", "megatron"}
        for b in c["baselines"].values():
            assert set(b) >= {"padding_ratio", "blocks_cut"}
        assert c["padding_ratio"] >= c["lower_bound_ratio"] >= 0
    assert [(c["model"], c["world_size"], c["granularity"]) for c in cells][:2] == [
        ("llama3-8b", 64, "row"), ("llama3-8b", 64, "rows:16")]


def test_json_stdout_is_one_document():
    proc = subprocess.run([sys.executable, "-m", "ragged_fsdp", "plan", "--model", "qwen3-30b-a3b:fused",
                           "--world", "128", "--granularity", "rows:128", "--suggest", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (cell,) = json.loads(proc.stdout)
    assert cell["model"] == "qwen3-30b-a3b:fused" and cell["padding_ratio"] > 0.01
    assert cell["suggestions"] and all(s["padding_ratio"] < cell["padding_ratio"] for s in cell["suggestions"])


def test_text_tables_and_suggestions(capsys):
    assert main(["plan", "--model", "llama3-70b", "--world", "1024", "--granularity", "rows:128", "--suggest"]) == 0
    out = capsys.readouterr().out
    assert "layers.0..79" in out and "whole model" in out and "fsdp2" in out and "megatron" in out
    assert "alternatives that cut it" in out and "HSDP" in out and "merge" in out
    assert "ordered by least padding first, then least parameter memory" in out
    table = out[out.index("alternatives that cut it"):out.index("# way out 1")]
    # 9.575% (HSDP over 128 ranks) above the 17.185% merges, which go by their gather size
    assert table.index("shard over 128 ranks") < table.index("merge 8 consecutive") < table.index("merge 16")


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--granularity" in out and "--suggest" in out and "--json" in out


@pytest.mark.parametrize("argv, words", [
    (["--granularity", "rows:zero"], ["'rows:zero'", "rows:K", "block:N"]),
    (["--granularity", "row,blocks:4"], ["'blocks:4'"]),
    (["--model", "llama5"], ["unknown model 'llama5'"]),
    (["--world", "0"], ["world size"]),
])
def test_bad_arguments_give_clear_errors(capsys, argv, words):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
