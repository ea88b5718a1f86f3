"""The training engine: a drop-in ``fully_shard`` built on DBuffers."""
from .api import FSDPModule, UnshardHandle, fully_shard
from .compat.extension import register_fsdp_forward_method
from .core.consistency import LayoutMismatchError, SettingMismatchError
from .core.residual_state import ResidualWarning
from .core.late_params import LateParameterError
from .core.step_boundary import StepBoundaryError
from .deterministic import abort_step, check_step_boundary
from .offload.phase import load_to_device, offload_to_host
from .offload.policy import OffloadPolicy
from .same_init import check_same_init, sync_module_states
from .tracing import Event, Trace, trace

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "trace", "Trace", "Event",
           "OffloadPolicy", "offload_to_host", "load_to_device", "LayoutMismatchError", "SettingMismatchError",
           "ResidualWarning", "StepBoundaryError", "LateParameterError", "abort_step", "check_step_boundary",
           "check_same_init", "sync_module_states"]
