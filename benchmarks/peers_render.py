"""The peers page (docs/peers.md) rendered from the JSON ``benchmarks/peers.py`` writes.

Pure functions of that JSON: re-running the bench and then this renderer updates the page, so no
number on it is typed by hand. ``python benchmarks/peers.py --render docs/data/peers.json``
rewrites the page from a saved file without running anything.
"""

from __future__ import annotations

LABELS = {"ragged_fsdp": "ragged_fsdp", "fsdp2": "torch FSDP2", "deepspeed_zero3": "DeepSpeed ZeRO-3",
          "megatron_fsdp": "Megatron-FSDP"}


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _loss_cell(row: dict) -> str:
    if not row.get("loss"):
        return "-"
    return f"{row['loss'][-1]:.6f} / {row['loss_ref'][-1]:.6f}"


def _agree_cell(row: dict) -> str:
    if row.get("max_rel_err") is None:
        return "-"
    return f"{'yes' if row['agrees'] else 'NO'} ({row['max_rel_err']:.1e})"


def _step_cell(row: dict) -> str:
    if row.get("step_ms") is None:
        return "-"
    ts = [t * 1e3 for t in row.get("step_s", [])]
    return f"{row['step_ms']:.0f} ({min(ts):.0f}-{max(ts):.0f})" if ts else f"{row['step_ms']:.0f}"


def render_table(doc: dict) -> str:
    """One row per (world size, workload, framework) of ``doc["rows"]``; a framework that did
    not run shows its status (the reason is listed under the table)."""
    meta = doc["metadata"]
    head = ("W", "workload", "framework", "version", f"loss after {meta['check_steps']} steps / single-process",
            "agrees (max rel. err)", "step ms: median (min-max)", "step vs FSDP2", "peak MiB (MemTracker)",
            "live tensor MiB", "sent MiB/step/rank")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i in (0, 6, 7, 8, 9, 10) else "---"
                                                          for i in range(len(head))) + "|"]
    for r in doc["rows"]:
        name = LABELS.get(r["framework"], r["framework"])
        if r["status"] != "ok":
            cells = (str(r["world"]), r["workload"], name, r.get("version") or "-",
                     f"**{r['status']}** (see below)") + ("-",) * (len(head) - 5)
        else:
            cells = (str(r["world"]), r["workload"], name, r.get("version") or "-", _loss_cell(r), _agree_cell(r),
                     _step_cell(r), _num(r.get("vs_fsdp2"), ".2f"), _mib(r.get("peak_bytes")),
                     _mib(r.get("live_bytes")), _mib(r.get("comm_bytes")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _failures(doc: dict) -> list[str]:
    """Each framework that did not run, once per distinct reason, with the worlds/workloads it hit."""
    seen: dict[tuple[str, str], list[str]] = {}
    text: dict[tuple[str, str], str] = {}
    for r in doc["rows"]:
        if r["status"] == "ok":
            continue
        key = (r["framework"], " ".join(r["reason"].split()))  # the same error, however indented
        text.setdefault(key, r["reason"])
        seen.setdefault(key, []).append(f"W={r['world']} {r['workload']}")
    out = []
    versions = {r["framework"]: r.get("version") for r in doc["rows"]}
    for (fw, key), where in seen.items():
        reason = text[(fw, key)]
        ver = versions.get(fw)
        out.append(f"### {LABELS.get(fw, fw)}{f' {ver}' if ver else ''}: did not run ({', '.join(where)})\n\n"
                   f"```text\n{reason.rstrip()}\n```")
    return out


def summary(doc: dict) -> str:
    """What the rows say about the loss check, per framework, computed from the rows."""
    ran = [r for r in doc["rows"] if r["status"] == "ok" and r.get("max_rel_err") is not None]
    if not ran:
        return "No framework ran."
    worst: dict[str, float] = {}
    for r in ran:
        worst[r["framework"]] = max(worst.get(r["framework"], 0.0), r["max_rel_err"])
    agree = sum(bool(r["agrees"]) for r in ran)
    per = ", ".join(f"{LABELS.get(f, f)} {e:.1e}" for f, e in worst.items())
    return (f"{agree} of {len(ran)} runs follow the single-process losses within the tolerance; the "
            f"largest relative error of any step, per framework: {per}.")


def render_page(doc: dict, intro: str = "", notes: str = "") -> str:
    """The whole Markdown page: ``intro``, the conditions from the metadata, the table, the
    reason each peer could not run (verbatim), then ``notes``."""
    m = doc["metadata"]
    peers = ", ".join(f"{LABELS.get(k, k)} {v or 'not installed'}" for k, v in m["versions"].items()
                      if k not in ("torch", "ragged_fsdp"))
    cond = [
        f"- Command: `{m['command']}`",
        f"- Date: {m['date']}; torch {m['versions']['torch']}, ragged_fsdp {m['versions'].get('ragged_fsdp')}; "
        f"peers: {peers}",
        f"- Machine: {m['machine']['cores']} CPU cores, {m['machine']['gpu'] or 'no GPU'}; "
        f"{m['machine']['platform']}; {m['conditions']}"
        + (f" (1-minute load average at the start and after each launch: "
           f"{', '.join(map(str, m['machine']['load_average']))})" if m["machine"].get("load_average") else ""),
        f"- Launch: W = {', '.join(map(str, m['worlds']))} gloo ranks on CPU, one process per rank, "
        f"one thread each; every framework in the same launch, one after the other",
        f"- Loss check: {m['check_steps']} AdamW steps (lr {m['lr']}) from the same initial weights "
        f"(seed 0) on the same per-rank batches; the mean over ranks of each step's loss is compared "
        f"with a single process training the same model on all ranks' batches at once "
        f"(`torch.optim.AdamW`); agrees = relative error at most {m['rtol']:g} at every step",
        f"- Step time: {m['rounds']} rounds x {m['steps']} steps per framework, the order of the "
        f"frameworks rotated each round; \"vs FSDP2\" is the median over rounds of the per-round ratio",
        "- Peak MiB: torch's MemTracker over one step, the framework's model and optimizer tracked, "
        "rank 0 (the tensors reachable from them and everything allocated during the step). Live "
        "tensor MiB: the tensor storages that came alive in the rank-0 process from the framework's "
        "set-up on and are still alive after its loss-check steps (a garbage-collector scan, each "
        "storage once), whatever object holds them",
        "- Sent MiB: bytes rank 0 sends in one step by the rule of `ragged_fsdp.bench.comm_bytes` "
        "(the `torch.distributed` collectives, wrapped while the step runs)",
    ]
    parts = [intro.rstrip(), "## Conditions", "\n".join(cond), "## Results", render_table(doc), summary(doc)]
    fails = _failures(doc)
    if fails:
        parts += ["## Frameworks that did not run", "The error each raised, verbatim (the last lines of "
                  "its traceback on rank 0), with the version installed:", *fails]
    if notes.strip():
        parts.append(notes.rstrip())
    return "\n\n".join(p for p in parts if p) + "\n"
