"""The command line: every subcommand is listed, `plan` first, and each has its own help; the
subcommands that start ranks (`demo`, `bench`) refuse bad arguments in the parent, before any
rank starts, with one line naming the flag and exit code 2."""
import os
import signal
import subprocess
import sys
import time

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


# Bad arguments of the commands that start ranks, run as a user runs them. Each one must be
# refused at once; before the argument checks, `bench --world 0` waited forever for ranks that
# were never started and `demo --data missing.txt` failed in every rank after a minute.
REFUSED = {
    "bench --world 0": (["bench", "--world", "0"], ["--world 0", "at least 1"]),
    "bench --world nan": (["bench", "--world", "nan"], ["--world nan", "whole number"]),
    "bench --frameworks bogus": (["bench", "--frameworks", "bogus"],
                                 ["--frameworks bogus", "'bogus'", "ragged_fsdp, fsdp2, fsdp1, ddp, local"]),
    "bench --steps 0": (["bench", "--steps", "0"], ["--steps 0", "at least 1"]),
    "demo --data missing.txt": (["demo", "--data", "missing.txt"], ["--data missing.txt", "no such file"]),
    "demo --nproc 0": (["demo", "--nproc", "0"], ["--nproc 0", "at least one rank"]),
}

# The whole module waits at most this long for all its commands together (they run at once
# and each spends seconds importing torch); a command still running then has hung.
DEADLINE_S = 240


@pytest.fixture(scope="module")
def ran():
    """Every ``python -m ragged_fsdp`` command of this file, all started at once (each spends
    seconds importing torch): name -> (exit code, stdout, stderr); exit code None: killed at
    the deadline (it hung, or started ranks)."""
    commands = {name: [name, "--help"] for name in SUBCOMMANDS}
    commands["demo --optimizer sgd"] = ["demo", "--optimizer", "sgd"]
    commands.update({k: argv for k, (argv, _) in REFUSED.items()})
    # Own session per command: a command that did start torchrun is killed with its ranks.
    procs = {k: subprocess.Popen([sys.executable, "-m", "ragged_fsdp", *argv], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
             for k, argv in commands.items()}
    deadline = time.monotonic() + DEADLINE_S
    out = {}
    for k, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out[k] = (p.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
            out[k] = (None, stdout, stderr)
    return out


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_subcommand_help(ran, name):
    code, out, err = ran[name]
    assert code == 0, err
    assert "usage:" in out


def test_demo_rejects_unknown_optimizer(ran):
    code, out, err = ran["demo --optimizer sgd"]
    assert code == 2 and "adamw8bit" in err


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_before_any_rank_starts(ran, name):
    code, out, err = ran[name]
    assert code is not None, f"{name}: still running after {DEADLINE_S} s (hung, or started ranks)\n{out}{err}"
    assert "torchrun" not in out, f"{name}: started the ranks\n{out}"
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{name}: expected one line on stderr, got:\n{err}"
    for needle in REFUSED[name][1]:
        assert needle in lines[0], f"{name}: {needle!r} not in {lines[0]!r}"
    assert code == 2, f"{name}: exit code {code}"


# The same checks in this process, for every kind of bad value: nothing may start ranks
# (the launchers are replaced by ones that fail the test).

class Launched(Exception):
    pass


@pytest.fixture
def no_launch(monkeypatch):
    from ragged_fsdp.bench import engine

    def launch(*a, **kw):
        raise Launched(a)

    monkeypatch.setattr(engine, "run", launch)
    monkeypatch.setattr(subprocess, "call", launch)


@pytest.fixture
def paths(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("too short")
    text = tmp_path / "corpus.txt"
    text.write_text("words " * 400)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return {"SMALL": str(small), "TEXT": str(text), "DIR": str(tmp_path), "UNDER_FILE": str(blocker / "out"),
            "MISSING": str(tmp_path / "missing.txt")}


def _fill(argv, paths):
    return [paths.get(a, a) for a in argv]


BAD = [  # argv, what the one line must name
    (["bench", "--world", "0"], ["--world 0", "at least 1"]),
    (["bench", "--world", "-2"], ["--world -2", "at least 1"]),
    (["bench", "--world", "2,-1"], ["--world 2,-1", "-1"]),
    (["bench", "--world", "nan"], ["--world nan", "whole number"]),
    (["bench", "--world", "2.5"], ["--world 2.5", "whole number"]),
    (["bench", "--world", ""], ["--world", "whole number"]),
    (["bench", "--world", "2,,4"], ["--world 2,,4", "whole number"]),
    (["bench", "--world", "2,2"], ["--world 2,2", "twice"]),
    (["bench", "--frameworks", "bogus"], ["--frameworks bogus", "ragged_fsdp, fsdp2, fsdp1, ddp, local"]),
    (["bench", "--frameworks", "ragged_fsdp,FSDP2"], ["'FSDP2'", "fsdp2"]),
    (["bench", "--frameworks", ""], ["--frameworks", "ragged_fsdp, fsdp2"]),
    (["bench", "--models", "gpt"], ["--models gpt", "dense, moe, dense-1024"]),
    (["bench", "--steps", "0"], ["--steps 0", "at least 1"]),
    (["bench", "--steps", "-3"], ["--steps -3", "at least 1"]),
    (["bench", "--rounds", "0"], ["--rounds 0", "at least 1"]),
    (["bench", "--out", "UNDER_FILE"], ["--out", "not a directory"]),
    (["bench", "--out", "DIR"], ["--out", "is a directory"]),
    (["bench", "--png", "UNDER_FILE"], ["--png", "not a directory"]),
    (["bench", "--mesh", "2x0"], ["--mesh", "at least 1"]),
    (["demo", "--data", "MISSING"], ["--data", "missing.txt", "no such file"]),
    (["demo", "--data", "DIR"], ["--data", "is a directory"]),
    (["demo", "--data", "SMALL"], ["--data", "9 bytes", "1 KiB"]),
    (["demo", "--nproc", "0"], ["--nproc 0", "at least one rank"]),
    (["demo", "--nproc", "-1"], ["--nproc -1"]),
    (["demo", "--steps", "-1"], ["--steps -1", "at least one"]),
    (["demo", "--batch", "0"], ["--batch 0"]),
    (["demo", "--out", "UNDER_FILE"], ["--out", "not a directory"]),
]


@pytest.mark.parametrize("argv,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_refused_in_the_parent(capsys, no_launch, paths, argv, needles):
    try:
        code = main(_fill(argv, paths))
    except SystemExit as e:  # bench raises its refusal (callers match on its text)
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, f"{argv}: exit code {code}\n{out}{err}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got:\n{err}"
    for needle in needles:
        assert needle in lines[0], f"{argv}: {needle!r} not in {lines[0]!r}"


def test_good_arguments_still_start_the_ranks(capsys, no_launch, paths):
    with pytest.raises(Launched):
        main(["demo", "--data", paths["TEXT"], "--steps", "2", "--out", paths["DIR"] + "/demo"])
    with pytest.raises(Launched) as e:
        main(["bench", "--quick", "--rounds", "1", "--steps", "1", "--world", "1,2", "--frameworks", "ragged_fsdp,local", "--models", "dense-wide",
              "--out", paths["DIR"] + "/new/b.json", "--png", ""])
    (cfg,) = e.value.args[0]
    assert cfg.world == 1 and cfg.frameworks == ("ragged_fsdp", "local") and cfg.models == ("dense-wide",)
