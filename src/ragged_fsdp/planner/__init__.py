"""The structure-aware layout planner: pure integer math, no process groups.

A group's tensors are laid into one flat buffer of ``W`` equal segments so that no segment
boundary cuts a block of any tensor, offsets are aligned, and ``W * S`` is as small as the
heuristic can make it; every plan states the structural lower bound it is measured against.
"""
from .baselines import BASELINES, BaselineResult, all_baselines, baseline
from .bound import lower_bound, lower_bound_segment
from .exact import exact_segment, solve_exact
from .granularity import GRANULARITY_FORMS, Granularity, TensorSpec
from .heuristic import plan_group
from .model import ModelPlan, plan_model
from .plan import Plan
from .sections import Section, SectionedPlan, plan_sections
from .suggest import Suggestion, suggest, suggest_sections
from .validate import validate_plan

__all__ = [
    "Granularity", "TensorSpec", "Plan", "plan_group", "validate_plan", "lower_bound",
    "lower_bound_segment", "solve_exact", "exact_segment", "GRANULARITY_FORMS", "ModelPlan",
    "plan_model", "BASELINES", "BaselineResult", "all_baselines", "baseline", "Suggestion",
    "suggest", "suggest_sections", "Section", "SectionedPlan", "plan_sections",
]
