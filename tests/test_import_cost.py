"""What starting costs: `python -m ragged_fsdp --help` and every subcommand's `--help` answer
without importing torch (the package loads its public names on first use and each subcommand
imports its heavy modules after the command line is read), and neither `import ragged_fsdp`
nor `from ragged_fsdp import fully_shard` imports an optional stack. Each case is a fresh
interpreter (one launch for all of them) so that nothing an earlier test imported counts."""
import json
import os
import subprocess
import sys

from ragged_fsdp.cli import SUBCOMMANDS

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
OPTIONAL = ("transformers", "torchtitan", "accelerate", "bitsandbytes", "torchao", "peft", "matplotlib",
            "lightning", "pytorch_lightning", "triton")

# Runs each case in a child interpreter of its own and prints {case: [modules of note imported]}.
PROBE = r"""
import json, subprocess, sys
WATCH = ("torch",) + tuple(sys.argv[2].split(","))
CHILD = '''
import runpy, sys
argv = sys.argv[1:]
if argv[0] == "import":
    exec(argv[1])
else:
    sys.argv = ["ragged_fsdp"] + argv
    try:
        runpy.run_module("ragged_fsdp", run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), e.code
print("\\n" + " ".join(sorted({m.split(".")[0] for m in sys.modules})))
'''
out = {}
for case in json.loads(sys.argv[1]):
    r = subprocess.run([sys.executable, "-c", CHILD, *case], capture_output=True, text=True, timeout=300)
    if r.returncode:
        out[" ".join(case)] = "failed: " + r.stderr[-800:]
        continue
    loaded = set(r.stdout.strip().splitlines()[-1].split())
    out[" ".join(case)] = sorted(m for m in WATCH if m in loaded)
print(json.dumps(out))
"""

HELP = [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS]
IMPORTS = [["import", "import ragged_fsdp"], ["import", "from ragged_fsdp import fully_shard, global_order"]]


def _probe() -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HELP + IMPORTS), ",".join(OPTIONAL)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_help_and_import_cost():
    seen = _probe()
    for case in HELP:
        assert seen[" ".join(case)] == [], f"`python -m ragged_fsdp {' '.join(case)}` imported {seen[' '.join(case)]}"
    assert seen["import import ragged_fsdp"] == [], seen
    # the engine needs torch, and nothing optional
    assert seen["import from ragged_fsdp import fully_shard, global_order"] == ["torch"], seen


def test_lazy_names_resolve():
    import ragged_fsdp
    from ragged_fsdp.fsdp import fully_shard

    assert ragged_fsdp.fully_shard is fully_shard
    assert set(ragged_fsdp.__all__) <= set(dir(ragged_fsdp))
    try:
        ragged_fsdp.not_a_name
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
