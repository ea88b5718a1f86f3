"""Scale without a cluster: per-rank memory and step time of ragged_fsdp, FSDP2, FSDP1,
DeepSpeed ZeRO-3 and Megatron-FSDP from shapes, using the real planner for every layout
(`python -m ragged_fsdp simulate`). Pure models; only ``calibrate`` and ``bench_check``
touch torch."""
from .arch import Arch, resolve_model
from .mesh import Mesh, parse_mesh
from .profiles import PROFILES, GPUProfile, get_profile
from .simulate import FRAMEWORKS, FrameworkResult, Scenario, simulate, simulate_auto

__all__ = ["Arch", "resolve_model", "Mesh", "parse_mesh", "PROFILES", "GPUProfile", "get_profile",
           "FRAMEWORKS", "FrameworkResult", "Scenario", "simulate", "simulate_auto"]
