"""The Makefile's targets expand without undefined variables.

An edit once dropped the definition of the second-torch subset; make expanded it to nothing,
and the 2.15 target ran the whole suite in a venv without the integration extras. ``make -n``
prints every target's recipe without running it, and ``--warn-undefined-variables`` names
each variable that expanded from nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _phony_targets(makefile: Path) -> list[str]:
    text = makefile.read_text()
    return [t for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for t in line.split()]


def _undefined(makefile: Path) -> list[str]:
    out = subprocess.run(
        ["make", "-f", str(makefile), "-n", "-B", "--warn-undefined-variables", *_phony_targets(makefile)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    return sorted(set(re.findall(r"undefined variable '([^']+)'", out.stdout + out.stderr)))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_every_variable_a_target_uses_is_defined():
    assert _phony_targets(ROOT / "Makefile"), "no .PHONY targets found"
    assert _undefined(ROOT / "Makefile") == []


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_check_sees_a_dropped_definition(tmp_path):
    text = (ROOT / "Makefile").read_text()
    dropped = re.sub(r"^TORCH_SUBSET := .*?(?<!\\)\n", "", text, count=1, flags=re.M | re.S)
    assert dropped != text
    broken = tmp_path / "Makefile"
    broken.write_text(dropped)
    assert "TORCH_SUBSET" in _undefined(broken)
