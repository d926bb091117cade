"""Cost models: time and memory of any plan (see types.py for the shared result types).

``make_cost_model(model, cluster, training, kind)`` builds a ``CostModel`` over one source of per-unit costs:
``analytic`` (roofline, embedded: plan before owning the hardware), ``profile`` (a measured profile database,
``profiledb.py``, docs/profile-db.md) or ``aceso-compat`` (the reference implementation's model, ``search.compat``).
Formulas: analytic.py (unit times), comm.py (collectives), memory.py, pipeline.py (1F1B), evaluate.py (stages).
"""

from __future__ import annotations

from ..cluster import ClusterSpec
from ..errors import AcesoError
from ..model import ModelSpec
from ..training import TrainingSpec
from .comm import CommModel
from .evaluate import CostModel
from .types import RC, RC_CODE, PipelineCost, PlanCost, StageCost, UnitTable

KINDS = ("analytic", "profile", "aceso-compat")


def make_cost_model(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, kind: str = "analytic",
                    db=None):
    """A cost model of ``kind``; ``db`` is the profile database folder/file (profile, aceso-compat)."""
    if kind == "analytic":
        from .analytic import AnalyticSource
        comm = CommModel(cluster)
        return CostModel(model, cluster, training, AnalyticSource(model, cluster, training, comm), comm, kind)
    if kind == "profile":
        if db is None:
            raise AcesoError("--cost-model profile needs --db PATH (a profile database, see docs/profile-db.md)")
        from .profiledb import load_profile_db, ProfileSource
        pdb = load_profile_db(db)
        src = ProfileSource(pdb, model, cluster, training)
        return CostModel(model, cluster, training, src, src.comm, kind)
    if kind == "aceso-compat":
        try:
            from ..compat import make_compat_cost_model
        except ImportError:
            try:
                from ..compat.costmodel import make_compat_cost_model
            except ImportError:
                raise AcesoError("--cost-model aceso-compat is not available in this version (search.compat is "
                                 "missing); use analytic or profile") from None
        return make_compat_cost_model(model, cluster, training, db)
    raise AcesoError(f"cost model '{kind}': choose one of {', '.join(KINDS)}")


__all__ = ["RC", "RC_CODE", "CostModel", "KINDS", "PipelineCost", "PlanCost", "StageCost", "UnitTable",
           "make_cost_model"]
