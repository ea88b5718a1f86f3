"""FP8 all-gather numbers: bytes gathered per step (net of the padding tiles cost), and the
quantisation error of per-tile scales against one scale per tensor.

    python benchmarks/fp8_allgather.py                       # catalog table + error table
    python benchmarks/fp8_allgather.py --model llama3-70b --world 64,1024 --json out.json

Bytes: every FSDP group is laid out as the engine lays it out. With ``BlockFP8`` the
eligible weights (>= 2 dims, at least one tile, not biases) get their own buffer with the
tile granularity (``rows:128``, or whole expert matrices when a fused expert's rows are not a
multiple of 128) and gather 1 byte per element plus a fp32 scale per tile (``T`` per rank, the
most tiles any rank holds); the rest gathers in bf16. The references are the same groups
with no granularity gathered in bf16 and in fp32. Per step = 2 all-gathers per group
(forward and backward, ``reshard_after_forward=True``); the numbers are the all-gather output
every rank receives, ``W*S`` elements per buffer (its own ``1/W`` included). Where the tile
granularity pads more than 1%, the first way out of ``plan --suggest`` (a smaller shard group
with replicas, as HSDP, or merged groups) is planned too.

Pure planning: no process group, no weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from ragged_fsdp.models.catalog import get_model
from ragged_fsdp.planner.granularity import TensorSpec
from ragged_fsdp.planner.model import plan_model
from ragged_fsdp.planner.suggest import merge_groups, suggest
from ragged_fsdp.quant import BlockFP8, per_tensor_quantize_dequantize, quantize_dequantize
from ragged_fsdp.bench.meta import run_meta

Groups = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]
MASTER_ITEMSIZE = 4
PADDING_OK = 0.05  # the bench looks for the largest HSDP shard group padding at most this  # the engine plans with the parameters' (fp32 master) dtype


def catalog_groups(model_id: str) -> Groups:
    m = get_model(model_id)
    return [(g.name, [(t.name, tuple(t.shape)) for t in g.tensors]) for g in m.groups]


def module_groups(model: torch.nn.Module, wrapped: Sequence[torch.nn.Module]) -> Groups:
    """Groups as ``fully_shard`` on each of ``wrapped`` (bottom-up, root last) would make them."""
    seen, out = set(), []
    owners: dict[int, list] = {}
    for sub in model.modules():
        for pn, p in sub._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((sub, pn))
    for mod in wrapped:
        ts, emb = [], []
        for n, p in mod.named_parameters():
            if id(p) in seen:
                continue
            own = owners.get(id(p), [])
            # the engine gives untied embedding weights a buffer of their own
            alone = len(own) == 1 and isinstance(own[0][0], torch.nn.Embedding) and own[0][1] == "weight"
            (emb if alone else ts).append((n, tuple(p.shape)))
        seen.update(id(p) for p in mod.parameters())
        out.append((type(mod).__name__, ts))
        if emb:
            out.append((type(mod).__name__ + ".embedding", emb))
    return out


def _eligible(policy: BlockFP8, name: str, shape) -> bool:
    return policy.applies(name, torch.empty(shape, device="meta"))


def split(groups: Groups, policy: BlockFP8) -> tuple[list, list]:
    """(fp8 groups, rest groups) as planner specs."""
    q, rest = [], []
    for name, ts in groups:
        qs = [TensorSpec(n, s, MASTER_ITEMSIZE, policy.geometry(s).granularity) for n, s in ts if _eligible(policy, n, s)]
        rs = [TensorSpec(n, s, MASTER_ITEMSIZE) for n, s in ts if not _eligible(policy, n, s)]
        q.append((name, qs))
        rest.append((name, rs))
    return q, rest


def _max_tiles_per_rank(plan, specs, policy: BlockFP8) -> int:
    S = plan.segment
    per: dict[int, int] = {}
    for s in specs:
        g = policy.geometry(s.shape)
        off, n = plan.offsets[s.name], s.numel
        if not n:
            continue
        for r in range(off // S, (off + n - 1) // S + 1):
            a, b = max(off, r * S) - off, min(off + n, (r + 1) * S) - off
            per[r] = per.get(r, 0) + g.tiles(a, b)
    return max(per.values(), default=0)


def _gathered(groups, world: int, itemsize: float) -> tuple[int, object]:
    groups = [(n, s) for n, s in groups if s]
    if not groups:
        return 0, None
    mp = plan_model(groups, world)
    return int(mp.total * itemsize), mp


def fp8_bytes(q_groups, rest_groups, world: int, policy: BlockFP8) -> dict:
    """Bytes of one all-gather of every group, split by kind, and the fp8 part's padding."""
    codes, mp = _gathered(q_groups, world, 1)
    scales = 0
    if mp is not None:
        for k in mp.kinds:
            gi = k.groups[0]
            scales += world * _max_tiles_per_rank(k.plan, mp.group_specs[gi], policy) * 4 * k.count
    rest, _ = _gathered(rest_groups, world, 2)
    return {"codes": codes, "scales": scales, "rest_bf16": rest, "total": codes + scales + rest,
            "fp8_padding": mp.padding_ratio if mp is not None else 0.0, "fp8_elements": mp.used if mp else 0}


def cell(groups: Groups, world: int, policy: BlockFP8, want_suggest: bool = True) -> dict:
    plain = [(n, [TensorSpec(t, s, MASTER_ITEMSIZE) for t, s in ts]) for n, ts in groups]
    fp32, base = _gathered(plain, world, 4)
    bf16 = fp32 // 2
    q, rest = split(groups, policy)
    f8 = fp8_bytes(q, rest, world, policy)
    out = {"world": world, "params": base.used, "base_padding": base.padding_ratio, "fp32": fp32, "bf16": bf16,
           "fp8": f8, "fp8_vs_bf16": f8["total"] / bf16}
    if want_suggest and f8["fp8_padding"] > PADDING_OK:
        # the largest shard group (halving W) whose fp8 buffers pad at most PADDING_OK
        d = world // 2
        while d >= 1:
            f = fp8_bytes(q, rest, d, policy)
            if f["fp8_padding"] <= PADDING_OK:
                ref, _ = _gathered(plain, d, 2)
                out["hsdp_needed"] = {"shard": d, "replicas": world // d, "fp8": f, "fp8_vs_bf16": f["total"] / ref}
                break
            d //= 2
    if want_suggest and f8["fp8_padding"] > 0.01:
        # the best way out of each kind that `plan --suggest` lists for the fp8 buffers
        sug = suggest([(n, s) for n, s in q if s], world)
        out["suggestions"] = []
        for kind in ("merge", "hsdp"):
            s = next((x for x in sug if x.kind == kind), None)
            if s is None:
                continue
            if s.kind == "hsdp":
                f = fp8_bytes(q, rest, s.value, policy)
                ref, _ = _gathered(plain, s.value, 2)
            else:
                f = fp8_bytes(merge_groups(q, s.value), merge_groups(rest, s.value), world, policy)
                ref = bf16
            out["suggestions"].append({
                "describe": s.describe(), "kind": s.kind, "value": s.value, "fp8": f,
                "fp8_vs_bf16": f["total"] / ref if ref else 0.0,
                # what it costs: hsdp holds more per rank; merge gathers more at once
                "params_per_rank_fp32": s.bytes_per_rank, "largest_gather_codes": s.gathered_bytes // MASTER_ITEMSIZE,
            })
    return out


# -- quantisation error ----------------------------------------------------------------------
def tile_errors(w: torch.Tensor, policy: BlockFP8, deq: torch.Tensor) -> torch.Tensor:
    """Relative error of each tile: ||deq - w|| / ||w|| over the tile (all-zero tiles skipped)."""
    tr, tc = policy.tile
    x = w.reshape(-1, w.shape[-2], w.shape[-1]).float()
    d = deq.reshape(x.shape).float()
    errs = []
    for i in range(0, x.shape[1], tr):
        for j in range(0, x.shape[2], tc):
            a, b = x[:, i:i + tr, j:j + tc], d[:, i:i + tr, j:j + tc]
            num = (b - a).flatten(1).norm(dim=1)
            den = a.flatten(1).norm(dim=1)
            errs.append((num / den)[den > 0])
    return torch.cat(errs)


def error_table(weights: dict[str, torch.Tensor], policy: BlockFP8) -> dict:
    per_tile, per_tensor = [], []
    for name, w in weights.items():
        if not _eligible(policy, name, tuple(w.shape)):
            continue
        per_tile.append(tile_errors(w, policy, quantize_dequantize(w, policy)))
        per_tensor.append(tile_errors(w, policy, per_tensor_quantize_dequantize(w, policy.dtype)))
    a, b = torch.cat(per_tile), torch.cat(per_tensor)
    return {"tiles": a.numel(),
            "per_tile": {"median": a.median().item(), "max": a.max().item()},
            "per_tensor": {"median": b.median().item(), "max": b.max().item()}}


def demo_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The demo model's initial weights (Gaussian, std 0.02)."""
    from ragged_fsdp.train import TrainConfig, build_model

    cfg = TrainConfig(seed=seed)
    return {n: p.detach() for n, p in build_model(cfg).named_parameters()}


def heavy_tailed_weights(seed: int = 0, n: int = 4, shape=(2048, 2048)) -> dict[str, torch.Tensor]:
    """Synthetic weights with the structure trained LLM weights are known for: heavy-tailed
    entries (Student-t, 3 dof) and per-input-channel scales spread log-normally (sigma 1),
    so a few channels carry far larger values than the rest."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        t = _student_t(shape, 3.0, g)
        col = torch.exp(torch.randn(shape[1], generator=g))
        out[f"w{i}"] = (t * col * 0.02).float()
    return out


def _student_t(shape, dof: float, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(shape, generator=g)
    chi2 = torch.stack([torch.randn(shape, generator=g) ** 2 for _ in range(int(dof))]).sum(0)
    return z / torch.sqrt(chi2 / dof)


# -- report ---------------------------------------------------------------------------------
def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}" if b >= 2**27 else f"{b / 2**20:.2f} MiB"


def _pct(x: float) -> str:
    return f"{x * 100:.2f}%" if x < 10 else f"{x * 100:.0f}%"


def print_bytes(rows: list[dict], file=sys.stdout) -> None:
    print("| model | W | fp32 GiB/step | bf16 GiB/step | fp8 GiB/step (codes + scales + bf16 rest) | fp8 tile padding | fp8 / bf16 | "
          "largest HSDP shard group with fp8 padding <= 5%: fp8 / bf16 | "
          "way out (`plan --suggest`): fp8 padding, fp8 / bf16, cost |", file=file)
    print("|---|---|---|---|---|---|---|---|---|", file=file)
    for r in rows:
        f = r["fp8"]
        ways = []
        for s in r.get("suggestions", []):
            cost = (f"largest fp8 gather {_gib(s['largest_gather_codes'])} GiB" if s["kind"] == "merge"
                    else f"fp32 params/rank {_gib(s['params_per_rank_fp32'])} GiB")
            ways.append(f"{s['describe']}: {_pct(s['fp8']['fp8_padding'])}, {s['fp8_vs_bf16']:.2f}, {cost}")
        way = "; ".join(ways) if ways else ("none found" if "suggestions" in r else "-")
        h = r.get("hsdp_needed")
        hs = f"{h['shard']} ranks x {h['replicas']}: {h['fp8_vs_bf16']:.2f}" if h else "-"
        print(f"| {r['model']} | {r['world']} | {_gib(2 * r['fp32'])} | {_gib(2 * r['bf16'])} | "
              f"{_gib(2 * f['total'])} ({_gib(2 * f['codes'])} + {_gib(2 * f['scales'])} + {_gib(2 * f['rest_bf16'])}) | "
              f"{_pct(f['fp8_padding'])} | {r['fp8_vs_bf16']:.2f} | {hs} | {way} |", file=file)


def print_errors(name: str, e: dict, file=sys.stdout) -> None:
    print(f"| {name} | {e['tiles']} | {e['per_tile']['median']:.4f} | {e['per_tile']['max']:.4f} | "
          f"{e['per_tensor']['median']:.4f} | {e['per_tensor']['max']:.4f} |", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b,llama3-70b,gpt-oss-120b,deepseek-v3,qwen3-30b-a3b")
    p.add_argument("--world", default="64,1024,16384")
    p.add_argument("--no-suggest", action="store_true")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    p.add_argument("--tile", default="128x128", help="tile rows x cols (default 128x128)")
    p.add_argument("--no-errors", action="store_true", help="skip the quantisation error table")
    a = p.parse_args(argv)
    tr, _, tc = a.tile.partition("x")
    policy = BlockFP8(tile=(int(tr), int(tc)))
    rows = []
    # the demo model (W = 2, what the gloo step time below measures), then the catalog
    from ragged_fsdp.train import TrainConfig, build_model

    demo = build_model(TrainConfig())
    dgroups = module_groups(demo, [*demo.layers, demo])
    r = cell(dgroups, 2, policy, False)
    r["model"] = "demo (dim 128)"
    rows.append(r)
    for m in a.model.split(","):
        for w in (int(x) for x in a.world.split(",")):
            r = cell(catalog_groups(m), w, policy, not a.no_suggest)
            r["model"] = m
            rows.append(r)
            print(f"planned {m} W={w}", file=sys.stderr, flush=True)
    print(f"All-gather bytes per step (2 gathers per group), {policy}:\n")
    print_bytes(rows)
    if a.no_errors:
        return 0
    errs = {"demo model at init (Gaussian, std 0.02)": error_table(demo_weights(), policy),
            "synthetic heavy-tailed 2048x2048 x4 (Student-t 3 dof, log-normal channel scales)":
                error_table(heavy_tailed_weights(), policy)}
    print(f"\nRelative error per {policy.tile[0]}x{policy.tile[1]} tile, ||dequant - w|| / ||w|| (e4m3):\n")
    print("| weights | tiles | per-tile scale: median | per-tile: max | per-tensor scale: median | per-tensor: max |")
    print("|---|---|---|---|---|---|")
    for k, e in errs.items():
        print_errors(k, e)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": run_meta(), "bytes": rows, "errors": errs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
