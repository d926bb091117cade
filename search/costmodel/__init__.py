"""Cost models: time and memory of any plan (see types.py for the shared result types).

A ``CostModel`` (evaluate.py) prices plans over one source of per-unit costs: ``analytic.AnalyticSource``
(roofline, embedded: plan before owning the hardware) or ``profiledb.ProfileSource`` (a measured profile database,
docs/profile-db.md); ``search.compat`` is the reference implementation's model, built on these types. Which one a
command uses is chosen above all of them (``search.pricing.make_cost_model``).
Formulas: analytic.py (unit times) over kernels.py (GEMM / attention / memory-bound kernels), tpcomm.py (TP
collectives and their overlap), comm.py (collectives), memory.py, pipeline.py (1F1B and interleaved schedules),
evaluate.py (stages, DP and optimizer), timeline.py (finer event kinds); MoE / MLA / MTP units: moe_cost.py and
mla_mtp.py over moe_primitives.py (analytic; the profile kind prices MoE units from the database's moe rows,
profiledb_moe.py, and refuses MLA / MTP; aceso-compat refuses all three with one line).
``settings`` (``types.RunSettings``) says how the framework runs a plan (default: our runtime on megatron-core;
``plan_view.run_settings`` derives it from a plan's settings); calibration.py reads a calibration file and applies
it to a cluster (in the analytic model's terms).
"""

from __future__ import annotations

from .comm import CommModel
from .evaluate import CostModel
from .types import LEGACY_V1, RC, RC_CODE, PipelineCost, PlanCost, RunSettings, StageCost, UnitTable

__all__ = ["LEGACY_V1", "RC", "RC_CODE", "CommModel", "CostModel", "PipelineCost", "PlanCost", "RunSettings",
           "StageCost", "UnitTable"]
