"""Machine profiles: what one accelerator and its links can do, from public spec sheets.

Every field can be overridden (``GPUProfile.with_overrides`` / the CLI's ``--gpu-*`` flags).
``efficiency`` is the fraction of peak dense flops a transformer step's matmuls reach; it is
the one number fitted on a published point (see :mod:`.published`); everything else is a
spec-sheet value. A ``cpu`` profile comes from ``simulate --calibrate`` (measured here).

Sources (vendor data sheets): H100 SXM5 80 GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
NVLink 900 GB/s per GPU (450 each way), 8 GPUs per HGX node, 400 Gb/s ConnectX-7 per GPU.
H200 SXM: same compute and links, 141 GB HBM3e at 4.8 TB/s. A100 SXM4 80 GB: 312 TFLOP/s
dense bf16, 2.04 TB/s, NVLink 600 GB/s (300 each way), 200 Gb/s HDR per GPU in DGX A100.
B200 (HGX B200): 2.25 PFLOP/s dense bf16, 180 GB HBM3e at 7.7 TB/s, NVLink 5 at 1.8 TB/s
(900 each way), 400 Gb/s per GPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

__all__ = ["GPUProfile", "PROFILES", "get_profile", "load_profile"]

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

    def with_overrides(self, **kw) -> "GPUProfile":
        known = {f.name for f in fields(self)}
        bad = sorted(k for k in kw if k not in known)
        if bad:
            raise ValueError(f"unknown GPU profile field(s) {bad}; known: {sorted(known)}")
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def to_json(self) -> dict:
        return asdict(self)


# efficiency: fitted on one published torchtitan FSDP2 point per GPU (sim/published.py):
# H100 on Llama 3.1 8B (8 GPUs), A100 on Llama 3 8B (64 GPUs). H200 shares H100's compute;
# B200 has no published point here, so it borrows H100's factor (unvalidated).
EFF_H100, EFF_A100 = 0.40, 0.71

PROFILES: dict[str, GPUProfile] = {
    "h100": GPUProfile("h100", 80 * GB, 989e12, 3.35e12, 450 * GB, 50 * GB, 8, efficiency=EFF_H100),
    "h200": GPUProfile("h200", 141 * GB, 989e12, 4.8e12, 450 * GB, 50 * GB, 8, efficiency=EFF_H100),
    "a100": GPUProfile("a100", 80 * GB, 312e12, 2.039e12, 300 * GB, 25 * GB, 8, efficiency=EFF_A100),
    "b200": GPUProfile("b200", 180 * GB, 2250e12, 7.7e12, 900 * GB, 50 * GB, 8, efficiency=EFF_H100),
}


def load_profile(path: str | Path) -> GPUProfile:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a profile JSON object")
    known = {f.name for f in fields(GPUProfile)}
    return GPUProfile(**{k: v for k, v in data.items() if k in known})


def get_profile(name: str) -> GPUProfile:
    """A built-in profile by name, or a JSON profile file (e.g. from ``--calibrate``)."""
    key = name.lower()
    if key in PROFILES:
        return PROFILES[key]
    if Path(name).suffix == ".json" and Path(name).exists():
        return load_profile(name)
    raise ValueError(f"unknown GPU profile {name!r}; known: {', '.join(PROFILES)} or a profile "
                     "JSON written by `simulate --calibrate`")
