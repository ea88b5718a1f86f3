"""Host-side start-up and checkpoint-planning costs, from ``benchmarks/scale.py``'s measurements.

The step-time model says nothing about what a job pays before its first step or at each
checkpoint on the host: every rank's ``fully_shard`` set-up, and DCP's save planning on the
coordinator (``create_global_plan`` over all W local plans), the ``.metadata`` every rank
reads back at load, and the local save's per-rank ``.meta``. ``benchmarks/scale.py`` measured them
(process CPU seconds, one host core, fake process group; ``docs/scale.md``), and at load
every rank's reading of ``.metadata`` and its DCP load planning for Llama-3-70B
and DeepSeek-V3 at 1,024-16,384 ranks and fitted ``y ~ W^e``; ``data/host_costs.json`` holds
its largest-W value and exponent per metric. Here:

* the measured model at another W: the fitted power law from the nearest measured W;
* another model of the same family (dense: Llama, MoE: DeepSeek-V3), scaled by its tensor
  count (set-up, items and planning are per-tensor work); the estimate says so;
* frameworks other than ragged_fsdp and FSDP2, and families never measured: ``None`` with
  the reason, rather than a number nobody measured.

These are CPU seconds of one host core on the bench machine; a GPU host's cores differ, and
nothing here includes I/O (writing the shards) or the collectives' network time.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

__all__ = ["host_costs", "format_host", "METRICS"]

_DATA = Path(__file__).with_name("data") / "host_costs.json"
# sim framework -> bench config (sim's ragged uses element or block granularity for AdamW;
# row is the measured layout closest to it: up to 3 boxes per tensor piece instead of 1)
_CONFIG = {"ragged": "ours-row", "fsdp2": "fsdp2"}
METRICS = {
    "startup_cpu_s": "fully_shard set-up per rank",
    "save_plan_cpu_s": "DCP save planning on the coordinator (ScaleSavePlanner for ragged)",
    "save_plan_default_cpu_s": "DCP save planning on the coordinator (DCP's default planner)",
    "metadata_bytes": ".metadata (read by every rank at load)",
    "local_meta_bytes": "local save: .meta per rank (no coordinator)",
    "metadata_read_cpu_s": "load: reading .metadata, per rank",
    "load_plan_cpu_s": "load: local load planning, per rank, onto half the ranks (ScaleLoadPlanner for ragged, "
                       "DCP's default for FSDP2)",
}


@lru_cache(maxsize=1)
def _table() -> dict:
    if not _DATA.exists():
        return {}
    return json.loads(_DATA.read_text())


def _family(name: str) -> str:
    base = name.split(":")[0]
    return "moe" if base.startswith(("deepseek", "kimi", "qwen3", "gpt-oss", "mixtral")) else "dense"


def host_costs(model: str, framework: str, world: int, tensors: int | None = None) -> dict:
    """``{metric: value or None, "basis": why}`` for ``framework`` at ``world`` ranks."""
    table = _table()
    config = _CONFIG.get(framework)
    if config is None or not table:
        why = "no host-cost data (run python benchmarks/scale.py)" if not table else \
            f"{framework}'s host costs were not measured (benchmarks/scale.py runs ragged_fsdp and FSDP2)"
        return {**dict.fromkeys(METRICS), "basis": why}
    base = model.split(":")[0]
    entry = table["models"].get(base)
    scale, note = 1.0, f"measured on {base}"
    if entry is None:
        ref = next((m for m, e in table["models"].items() if e["family"] == _family(base)), None)
        if ref is None or not tensors:
            return {**dict.fromkeys(METRICS), "basis": f"no measured model like {base}"}
        entry = table["models"][ref]
        scale = tensors / entry["tensors"]
        note = f"scaled from {ref} by tensor count ({tensors:,} / {entry['tensors']:,})"
    cfg = entry["configs"].get(config, {})
    out, fitted = {}, False
    for metric in METRICS:
        m = cfg.get(metric)
        if not m:
            out[metric] = None
            continue
        w0, y0 = min(m["points"], key=lambda p: abs(math.log(p[0] / world)))
        e = m.get("exponent")
        if w0 != world:
            fitted = True
        out[metric] = y0 * scale * ((world / w0) ** e if e is not None and w0 != world else 1.0)
    span = f"{min(entry['worlds']):,}-{max(entry['worlds']):,}"
    out["basis"] = f"{note} at W={span}" + ("; W^e fit to reach this W" if fitted else "")
    return out


def format_host(results_by_fw: dict[str, dict]) -> str:
    """A few lines for the simulate CLI: one per framework with host-cost numbers."""
    lines = ["host costs (CPU s of one host core, from benchmarks/scale.py; I/O and network not included):"]
    for fw, h in results_by_fw.items():
        if h.get("startup_cpu_s") is None:
            lines.append(f"  {fw}: {h['basis']}")
            continue

        def s(k, unit="s"):
            v = h.get(k)
            return "-" if v is None else (f"{v:,.1f} {unit}" if unit == "s" else f"{v / 1e6:,.1f} MB")

        lines.append(f"  {fw}: start-up {s('startup_cpu_s')} per rank; save planning {s('save_plan_cpu_s')} "
                     f"(DCP default planner {s('save_plan_default_cpu_s')}); .metadata {s('metadata_bytes', 'B')}"
                     + (f"; load: reading .metadata {s('metadata_read_cpu_s')} and planning "
                        f"{s('load_plan_cpu_s')} per rank" if h.get("metadata_read_cpu_s") is not None else "")
                     + (f"; local save .meta {s('local_meta_bytes', 'B')}/rank, no coordinator"
                        if h.get("local_meta_bytes") else "") + f"  [{h['basis']}]")
    return "\n".join(lines)
