"""The command line: every subcommand is listed, `plan` first, and each has its own help."""
import subprocess
import sys

import pytest

from ragged_fsdp.cli import SUBCOMMANDS, main


def test_help_lists_subcommands_plan_first(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    names = list(SUBCOMMANDS)
    assert names[0] == "plan"
    positions = [out.index(f"    {n} ") for n in names]
    assert positions == sorted(positions)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_subcommand_help(name):
    r = subprocess.run([sys.executable, "-m", "ragged_fsdp", name, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


def test_demo_rejects_unknown_optimizer():
    r = subprocess.run([sys.executable, "-m", "ragged_fsdp", "demo", "--optimizer", "sgd"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "adamw8bit" in r.stderr
