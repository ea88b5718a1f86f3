"""Without torchtitan installed, the torchtitan integration's commands still answer ``--help``
and say which extra to install when asked to run, instead of a ModuleNotFoundError traceback.

torchtitan is hidden in one subprocess (``sys.modules["torchtitan"] = None`` makes every
import of it, and of its submodules, raise ModuleNotFoundError, as an environment without it
does); each command runs there as ``python -m`` runs it (``runpy`` as ``__main__``), its exit
status, output and any traceback recorded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")
COMPARE, CPU = "ragged_fsdp.integrations.torchtitan.compare", "ragged_fsdp.integrations.torchtitan.cpu"
RUNS = {"compare --help": (COMPARE, ["--help"]), "cpu --help": (CPU, ["--help"]),
        "compare": (COMPARE, ["--steps", "1"]), "cpu": (CPU, ["--config", "llama3_debugmodel"])}

DRIVER = r'''
import contextlib, io, json, runpy, sys, traceback
sys.modules["torchtitan"] = None
out = {}
for name, (module, argv) in json.loads(sys.argv[1]).items():
    sys.argv = [module] + argv
    o, e, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as x:
            code = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    out[name] = {"code": code, "stdout": o.getvalue(), "stderr": e.getvalue()}
try:
    import ragged_fsdp.integrations.torchtitan as rt
    rt.llama3_debugmodel
    out["attribute"] = "no error"
except ModuleNotFoundError as x:
    out["attribute"] = str(x)
print("RESULTS" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(RUNS)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and "RESULTS" in r.stdout, r.stderr[-4000:]
    return json.loads(r.stdout.split("RESULTS", 1)[1])


@pytest.mark.parametrize("name", ["compare --help", "cpu --help"])
def test_help_without_torchtitan(results, name):
    r = results[name]
    assert r["code"] == 0, r
    assert "usage" in r["stdout"].lower() and "Traceback" not in r["stderr"], r


@pytest.mark.parametrize("name", ["compare", "cpu"])
def test_run_without_torchtitan_names_the_extra(results, name):
    r = results[name]
    assert r["code"] != 0 and "Traceback" not in r["stderr"], r
    assert "pip install torch==2.13.0 -e '.[torchtitan]'" in r["stderr"], r


def test_import_without_torchtitan_names_the_extra(results):
    assert "'.[torchtitan]'" in results["attribute"], results["attribute"]
