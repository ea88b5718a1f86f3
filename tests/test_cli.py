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


@pytest.fixture(scope="module")
def ran():
    """Every ``python -m ragged_fsdp`` command of this file, all started at once (each spends
    seconds importing torch): name -> (exit code, stdout, stderr)."""
    commands = {name: [name, "--help"] for name in SUBCOMMANDS}
    commands["demo --optimizer sgd"] = ["demo", "--optimizer", "sgd"]
    procs = {k: subprocess.Popen([sys.executable, "-m", "ragged_fsdp", *argv], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, argv in commands.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[k] = (p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_subcommand_help(ran, name):
    code, out, err = ran[name]
    assert code == 0, err
    assert "usage:" in out


def test_demo_rejects_unknown_optimizer(ran):
    code, out, err = ran["demo --optimizer sgd"]
    assert code == 2 and "adamw8bit" in err
