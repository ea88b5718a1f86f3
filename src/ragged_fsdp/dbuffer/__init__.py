"""DBuffer: flat distributed buffers laid out by the planner (zero-copy parameter views)."""
from .buffer import DBuffer
from .layout import BufferLayout, TensorSlot
from .planning import plan_layout
from .store import GradientHalf, UnitStore

__all__ = ["DBuffer", "BufferLayout", "TensorSlot", "plan_layout", "UnitStore", "GradientHalf"]
