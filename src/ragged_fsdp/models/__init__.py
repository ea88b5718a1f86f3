"""Reference models (trainable, small) and public model shapes (for planning at full scale)."""
from .catalog import Group, ModelShapes, Tensor, get_model, group_specs, list_models, model_specs
from .llama import Llama, LlamaConfig
from .moe import FusedExperts, MoE, MoEConfig, MoELayer
from .expert_parallel import apply_expert_parallel
from .stages import LlamaStage

__all__ = [
    "Llama", "LlamaConfig", "MoE", "MoEConfig", "MoELayer", "FusedExperts",
    "apply_expert_parallel", "LlamaStage",
    "Group", "ModelShapes", "Tensor", "get_model", "group_specs", "list_models", "model_specs",
]
