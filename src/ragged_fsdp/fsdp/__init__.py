"""The training engine: a drop-in ``fully_shard`` built on DBuffers.

This is the engine's front door: the rest of the package and ``benchmarks/`` import the
engine from here only (``tests/test_import_rules.py`` checks it), so what lies below
``fsdp/`` can move without a grep of the repository.
"""
from .api import FSDPModule, UnshardHandle, fully_shard
from .compat.extension import register_fsdp_forward_method
from .core.consistency import LayoutMismatchError, SettingMismatchError
from .core.residual_state import ResidualWarning, is_residual_key, warn_zeroed_residuals
from .core.late_params import LateParameterError
from .core.stale_optimizer import StaleOptimizerError, check_optimizer
from .core.step_boundary import StepBoundaryError
from .deterministic import abort_step, check_step_boundary, global_order
from .offload.phase import load_to_device, offload_to_host
from .offload.policy import OffloadPolicy
from .offload.staging import policy_of
from .probes import hsdp_segment_bytes, probe
from .same_init import check_same_init, sync_module_states
from .tracing import Event, Trace, trace

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "trace", "Trace", "Event",
           "OffloadPolicy", "offload_to_host", "load_to_device", "LayoutMismatchError", "SettingMismatchError",
           "ResidualWarning", "StepBoundaryError", "LateParameterError", "abort_step", "check_step_boundary",
           "check_same_init", "sync_module_states", "global_order",
           # for the layers above the engine (optimizers, checkpoints, the bench) and benchmarks/
           "policy_of", "check_optimizer", "StaleOptimizerError", "is_residual_key", "warn_zeroed_residuals", "probe", "hsdp_segment_bytes"]
