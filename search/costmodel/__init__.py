"""Cost models: time and memory of any plan (see types.py for the shared result types)."""

from .types import RC, RC_CODE, PipelineCost, PlanCost, StageCost, UnitTable

__all__ = ["RC", "RC_CODE", "PipelineCost", "PlanCost", "StageCost", "UnitTable"]
