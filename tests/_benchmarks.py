"""Puts benchmarks/ on ``sys.path``: the scripts that make the docs' tables are not part of the
installed package, and the tests that check their rows import them by name, as the scripts
import each other when run as ``python benchmarks/<name>.py``."""
import sys
from pathlib import Path

DIR = str(Path(__file__).resolve().parents[1] / "benchmarks")
if DIR not in sys.path:
    sys.path.insert(0, DIR)
