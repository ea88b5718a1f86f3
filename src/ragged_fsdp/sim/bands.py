"""The error bands of :mod:`.crossval`: which groups a run belongs to, the band a run gets,
and the stored table (``data/error_bands.json``). Kept apart from the cross-validation so
that printing a band does not import the validation machinery."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

__all__ = ["BANDS_PATH", "MIN_GROUP", "groups_of", "band_for", "load_bands"]

BANDS_PATH = Path(__file__).parent / "data" / "error_bands.json"
MIN_GROUP = 5  # a group with fewer cross-validated points sets no band of its own


def groups_of(gpu: str, recipe: dict, mesh: str, moe: bool = False) -> list[str]:
    """The groups a run belongs to: its GPU, and each feature that changes how it is costed."""
    f8 = recipe.get("float8")
    out = [f"gpu:{gpu}"]
    if f8 in ("tensorwise", "rowwise"):
        out.append("float8")
    elif f8 in ("mxfp8", "nvfp4"):
        out.append(f8)
    else:
        out.append("bf16")
    dims = dict(kv.split("=") for kv in mesh.split(",") if "=" in kv)
    for d in ("ep", "cp", "tp", "pp"):
        if int(dims.get(d, 1)) > 1:
            out.append(d)
    if moe and "ep" not in out:
        out.append("ep")
    return out


def band_for(groups: list[str], table: dict) -> tuple[float, str]:
    """(|log ratio| half-width, which group it came from) for a run in ``groups``."""
    cand = [(table[g]["band_log"], g) for g in groups if g in table and table[g]["n"] >= MIN_GROUP]
    if not cand:
        return table["pooled"]["band_log"], "pooled"
    return max(cand)


def load_bands(path: Path = BANDS_PATH) -> dict:
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return json.loads(Path(path).read_text())
    return {}
