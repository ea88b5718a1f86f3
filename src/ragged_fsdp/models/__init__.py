"""Model shapes for planning and simulation at full scale."""
from .catalog import Group, ModelShapes, Tensor, get_model, group_specs, list_models, model_specs

__all__ = ["Group", "ModelShapes", "Tensor", "get_model", "group_specs", "list_models", "model_specs"]
