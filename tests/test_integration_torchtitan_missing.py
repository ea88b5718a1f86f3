"""Without torchtitan installed, the torchtitan integration's commands still answer ``--help``
and say which extra to install when asked to run, instead of a ModuleNotFoundError traceback.

torchtitan is hidden in a subprocess (``sys.modules["torchtitan"] = None`` makes every import
of it, and of its submodules, raise ModuleNotFoundError, as an environment without it does).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _run(module: str, *argv: str) -> subprocess.CompletedProcess:
    code = ("import runpy, sys; sys.modules['torchtitan'] = None; "
            f"sys.argv = [{module!r}] + {list(argv)!r}; runpy.run_module({module!r}, run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("module", ["ragged_fsdp.integrations.torchtitan.compare",
                                    "ragged_fsdp.integrations.torchtitan.cpu"])
def test_help_without_torchtitan(module):
    r = _run(module, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower() and "Traceback" not in r.stderr, (r.stdout, r.stderr)


@pytest.mark.parametrize("module,argv", [("ragged_fsdp.integrations.torchtitan.compare", ["--steps", "1"]),
                                         ("ragged_fsdp.integrations.torchtitan.cpu", ["--config", "llama3_debugmodel"])])
def test_run_without_torchtitan_names_the_extra(module, argv):
    r = _run(module, *argv)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert "pip install torch==2.13.0 -e '.[torchtitan]'" in r.stderr, r.stderr


def test_import_without_torchtitan_names_the_extra():
    code = ("import sys; sys.modules['torchtitan'] = None\n"
            "import ragged_fsdp.integrations.torchtitan as rt\n"
            "try:\n    rt.llama3_debugmodel\nexcept ModuleNotFoundError as e:\n    print('ERR', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "'.[torchtitan]'" in r.stdout, r.stdout
