"""Machine profiles: what one accelerator and its links can do, from public spec sheets.

Every field can be overridden (``GPUProfile.with_overrides`` / the CLI's ``--gpu-*`` flags).
``efficiency`` is the fraction of peak dense flops a transformer step's matmuls reach; it is
the one number fitted on a published point, each GPU on a run of its own (:mod:`.fitted`);
everything else is a spec-sheet value. A GPU with a data sheet but no run to fit on
(``mi325x``) is in :data:`UNCALIBRATED` and refused unless its efficiency is given. A ``cpu`` profile comes from ``simulate --calibrate`` (measured here).

Sources (vendor data sheets): H100 SXM5 80 GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
NVLink 900 GB/s per GPU (450 each way), 8 GPUs per HGX node, 400 Gb/s ConnectX-7 per GPU.
H200 SXM: same compute and links, 141 GB HBM3e at 4.8 TB/s. A100 SXM4 80 GB: 312 TFLOP/s
dense bf16, 2.04 TB/s, NVLink 600 GB/s (300 each way), 200 Gb/s HDR per GPU in DGX A100.
B200 (HGX B200): 2.25 PFLOP/s dense bf16, 180 GB HBM3e at 7.7 TB/s, NVLink 5 at 1.8 TB/s
(900 each way), 400 Gb/s per GPU. MI325X: 1.3 PFLOP/s dense bf16, 256 GB HBM3E at 6 TB/s. ``h100-gt``: the H100 of Meta's Grand Teton hosts that
torchtitan's published benchmarks ran on (their "Hardware" section): 96 GB HBM2e at
2.4 TB/s, 500 W, NVLink inside the 8-GPU host, 400 Gb/s RDMA per GPU; its dense bf16 peak
is "between SXM and NVL" (the same file), taken as the midpoint, 912 TFLOP/s.

Bandwidth profile per GPU type (what the collectives and the per-phase overlap use):
``nvlink_bw`` one way per GPU inside a node, ``net_bw`` one way per GPU across nodes, ring
latency ``alpha_intra`` per step inside a node and ``alpha_inter`` per tree level across
nodes (NCCL's orders of magnitude; not measured here). H100 / H200 / h100-gt: 450 GB/s and
50 GB/s (NVLink 4, ConnectX-7 400 Gb/s); A100: 300 GB/s and 25 GB/s (NVLink 3, HDR 200 Gb/s
of a DGX A100); B200: 900 GB/s and 50 GB/s.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

__all__ = ["GPUProfile", "PROFILES", "UNCALIBRATED", "HOST_LINK_BW", "HOST_LINK_DEFAULT", "get_profile",
           "load_profile", "profile_sources", "validate_profile"]

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class GPUProfile:
    name: str
    hbm_bytes: float  # usable device memory
    flops: float  # peak dense flop/s in the compute dtype (bf16)
    mem_bw: float  # bytes/s of device memory (copies, optimizer: memory-bound kernels)
    nvlink_bw: float  # bytes/s one way per GPU inside a node
    net_bw: float  # bytes/s one way per GPU across nodes
    gpus_per_node: int
    alpha_intra: float = 5e-6  # seconds per collective step inside a node
    alpha_inter: float = 15e-6  # seconds per collective step across nodes
    efficiency: float = 0.5  # fraction of peak flops reached by the step's matmuls
    overlap: float = 1.0  # fraction of communication that can hide under compute (GPU: own stream)
    reserved_bytes: float = 1.5 * GiB  # context, NCCL buffers, allocator slack (not modelled)
    op_overhead: float = 0.0  # seconds per dispatched op (CPU profiles; ~0 on GPU with enough work)
    # measured collective cost: {op: [[bytes, seconds], ...]} at the calibration world size
    collectives: dict | None = None
    calibrated_world: int = 0
    alpha_beta: dict | None = None  # {op: [alpha seconds, beta bytes/s]} fitted on `collectives`
    fp32_flops: float = 0.0  # CPU profile: fp32 matmul throughput (0: use flops)
    # the CUDA caching allocator's reserve over the peak allocated, as a fraction (what
    # torch.cuda.max_memory_reserved adds to max_memory_allocated: fragmentation, cached blocks)
    alloc_reserve: float = 0.0

    def with_overrides(self, **kw) -> "GPUProfile":
        known = {f.name for f in fields(self)}
        bad = sorted(k for k in kw if k not in known)
        if bad:
            raise ValueError(f"unknown GPU profile field(s) {bad}; known: {sorted(known)}")
        return validate_profile(replace(self, **{k: v for k, v in kw.items() if v is not None}))

    def to_json(self) -> dict:
        return asdict(self)


# efficiency: each built-in profile's own, fitted on a published bf16 run on that GPU
# (sim/fitted.py says which); none is borrowed from another GPU (issue 56)
from .fitted import ALLOCATOR_RESERVE, EFFICIENCY, FIT_POINTS

_R = {"alloc_reserve": ALLOCATOR_RESERVE}

# the Grand Teton H100's dense bf16 peak: torchtitan's benchmark file (footnote 2) says it
# lies between the H100 NVL's (835 TFLOP/s) and the SXM's (989) and is not known exactly;
# the midpoint (its efficiency is fitted against this peak, so the choice cancels on it)
H100_GT_PEAK = (835e12 + 989e12) / 2

# spec sheets (vendor data): name -> (HBM bytes, dense bf16 flop/s, HBM bytes/s, NVLink one way,
# network per GPU, GPUs per NVLink domain)
SPECS = {
    "h100": (80 * GB, 989e12, 3.35e12, 450 * GB, 50 * GB, 8),
    "h100-gt": (96 * GB, H100_GT_PEAK, 2.4e12, 450 * GB, 50 * GB, 8),
    "h200": (141 * GB, 989e12, 4.8e12, 450 * GB, 50 * GB, 8),
    "a100": (80 * GB, 312e12, 2.039e12, 300 * GB, 25 * GB, 8),
    # HGX B200; 'b200' is calibrated on torchtitan's power-limited runs, 'b200-1000w' on a run
    # at the default limit (the same silicon and data sheet)
    "b200": (180 * GB, 2250e12, 7.7e12, 900 * GB, 50 * GB, 8),
    "b200-1000w": (180 * GB, 2250e12, 7.7e12, 900 * GB, 50 * GB, 8),
    # GB200 NVL72: 2.5 PFLOP/s dense bf16, 186 GB HBM3e at 8 TB/s, NVLink 5 across the whole
    # 72-GPU rack (900 GB/s each way per GPU), 400 Gb/s per GPU beyond the rack
    "gb200": (186 * GB, 2500e12, 8.0e12, 900 * GB, 50 * GB, 72),
    # MI300X: 1,307 TFLOP/s dense bf16, 192 GB HBM3 at 5.3 TB/s, Infinity Fabric to the 7
    # other GPUs of the node (7 x 64 GB/s each way), 400 Gb/s per GPU
    "mi300x": (192 * GB, 1307e12, 5.3e12, 448 * GB, 50 * GB, 8),
    # MI325X: the MI300X's compute (1,307 TFLOP/s dense bf16) with 256 GB HBM3E at 6 TB/s
    "mi325x": (256 * GB, 1307e12, 6.0e12, 448 * GB, 50 * GB, 8),
}

# host <-> device bandwidth one way (activation offload): PCIe Gen5 x16 (64 GB/s) on H100 /
# H200 / B200 / MI300X hosts, Gen4 x16 (32 GB/s) on A100, NVLink-C2C (450 GB/s each way) on
# GB200; taken at 80% of the link (DMA copies of pinned memory reach about that; assumed)
HOST_LINK_BW = {name: 0.8 * bw for name, bw in (("h100", 64e9), ("h100-gt", 64e9), ("h200", 64e9), ("a100", 32e9),
                                                ("b200", 64e9), ("b200-1000w", 64e9), ("gb200", 450e9),
                                                ("mi300x", 64e9), ("mi325x", 64e9))}
HOST_LINK_DEFAULT = 0.8 * 32e9  # a custom profile: PCIe Gen4 x16

PROFILES: dict[str, GPUProfile] = {
    name: GPUProfile(name, *spec, efficiency=EFFICIENCY[name], **_R) for name, spec in SPECS.items() if name in EFFICIENCY}
# data-sheet profiles with no training run and no microbenchmark to calibrate on: refused by
# get_profile unless the caller supplies the efficiency (then flagged as uncalibrated)
UNCALIBRATED: dict[str, GPUProfile] = {
    name: GPUProfile(name, *spec, **_R) for name, spec in SPECS.items() if name not in EFFICIENCY}


# field -> (lowest, highest, lowest allowed itself); every other numeric field: finite > 0
_RANGES = {"efficiency": (0.0, 1.0, False), "overlap": (0.0, 1.0, True), "reserved_bytes": (0.0, math.inf, True),
           "op_overhead": (0.0, math.inf, True), "alpha_intra": (0.0, math.inf, True),
           "alpha_inter": (0.0, math.inf, True), "fp32_flops": (0.0, math.inf, True),
           "calibrated_world": (0.0, math.inf, True), "alloc_reserve": (0.0, 10.0, True)}
_OPTIONAL = {"collectives", "alpha_beta"}


def validate_profile(prof: GPUProfile, where: str = "GPU profile") -> GPUProfile:
    """Every number finite and in range (efficiency in (0, 1], overlap in [0, 1], the rest
    > 0), ``gpus_per_node`` a positive int; else a ValueError naming the field."""
    for f in fields(prof):
        v = getattr(prof, f.name)
        if f.name == "name":
            if not isinstance(v, str) or not v:
                raise ValueError(f"{where}: name must be a non-empty string (got {v!r})")
            continue
        if f.name in _OPTIONAL:
            if v is not None and not isinstance(v, dict):
                raise ValueError(f"{where}: {f.name} must be an object {{op: ...}} or null (got {type(v).__name__})")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: {f.name} must be a finite number (got {v!r})")
        lo, hi, closed = _RANGES.get(f.name, (0.0, math.inf, False))
        if not ((v >= lo if closed else v > lo) and v <= hi):
            raise ValueError(f"{where}: {f.name} = {v!r} is out of range: must be "
                             f"{'>=' if closed else '>'} {lo:g}" + (f" and <= {hi:g}" if math.isfinite(hi) else ""))
        if f.name == "gpus_per_node" and int(v) != v:
            raise ValueError(f"{where}: gpus_per_node must be a whole number (got {v!r})")
    return prof


def load_profile(path: str | Path) -> GPUProfile:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--gpu {path}: cannot read a profile JSON there ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--gpu {path}: a profile is a JSON object of GPUProfile fields, got a "
                         f"{type(data).__name__}; write one with `simulate --calibrate`")
    known = {f.name for f in fields(GPUProfile)}
    required = {f.name for f in fields(GPUProfile) if f.default is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"--gpu {path}: profile lacks {missing}; required: {sorted(required)}")
    prof = GPUProfile(**{k: v for k, v in data.items() if k in known})
    return validate_profile(prof, f"--gpu {path}")


def get_profile(name: str, efficiency: float | None = None) -> GPUProfile:
    """A built-in profile by name, or a JSON profile file (e.g. from ``--calibrate`` or
    ``benchmarks/gpu_calibrate.py``). A built-in GPU without evidence (:data:`UNCALIBRATED`)
    is refused unless ``efficiency`` is given: its efficiency is never borrowed."""
    key = name.lower()
    if key in PROFILES:
        return PROFILES[key]
    if key in UNCALIBRATED:
        if efficiency is None:
            raise ValueError(
                f"--gpu {key}: no published training run or microbenchmark of this GPU to calibrate its GEMM "
                f"efficiency on, and none is borrowed from another GPU. Pass --efficiency X (the prediction is then "
                f"flagged as uncalibrated, without an error band), or measure one with "
                f"`python benchmarks/gpu_calibrate.py` on the GPU and pass its JSON as --gpu")
        return validate_profile(replace(UNCALIBRATED[key], efficiency=efficiency))
    if Path(name).suffix == ".json":
        return load_profile(name)
    raise ValueError(f"unknown GPU profile {name!r}; known: {', '.join(PROFILES)} (no evidence: "
                     f"{', '.join(UNCALIBRATED)}) or a profile "
                     "JSON written by `simulate --calibrate`")


_DATA_SHEET = {"h100": "NVIDIA H100 SXM5 data sheet; ConnectX-7 400 Gb/s per GPU",
               "h100-gt": "torchtitan benchmark files' Hardware section (Grand Teton: 96 GB HBM2e, 2.4 TB/s, 500 W); "
                          "peak the midpoint of its stated 835-989 TFLOP/s",
               "h200": "NVIDIA H200 SXM data sheet", "a100": "NVIDIA A100 SXM4 80 GB data sheet, DGX A100 (HDR 200 Gb/s)",
               "b200": "NVIDIA HGX B200 data sheet", "b200-1000w": "NVIDIA HGX B200 data sheet",
               "gb200": "NVIDIA GB200 NVL72 data sheet (72 GPUs per NVLink domain)",
               "mi300x": "AMD Instinct MI300X data sheet", "mi325x": "AMD Instinct MI325X data sheet"}


def profile_sources(prof: GPUProfile) -> dict:
    """Where each number of a built-in profile comes from (a JSON profile carries its own
    ``sources``, written by the calibration that measured it)."""
    sheet = _DATA_SHEET.get(prof.name)
    if sheet is None:
        return {"all": f"profile {prof.name!r}: supplied or measured (see its JSON's 'sources')"}
    key = f"efficiency:{prof.name}"
    eff = (f"fitted on published point {FIT_POINTS[key]} (a run on {prof.name}; sim/data/published_points*.json)"
           if key in FIT_POINTS and math.isclose(prof.efficiency, EFFICIENCY[prof.name], rel_tol=1e-3) else
           "supplied (--efficiency); no evidence for this GPU" if key not in FIT_POINTS else "overridden by the caller")
    return {"hbm_bytes, flops, mem_bw, nvlink_bw, net_bw, gpus_per_node": sheet, "efficiency": eff,
            "alloc_reserve": f"fitted on published point {FIT_POINTS['allocator_reserve']} (its memory)",
            "alpha_intra, alpha_inter": "NCCL's orders of magnitude (assumed, not measured)",
            "overlap": "assumed 1.0 (collectives on their own stream)",
            "reserved_bytes": "assumed 1.5 GiB (context, NCCL buffers)",
            "host link (activation offload)": "PCIe / NVLink-C2C data sheet x 0.8 (assumed)"}
