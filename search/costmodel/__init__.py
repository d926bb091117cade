"""Cost models: time and memory of any plan (see types.py for the shared result types).

``make_cost_model(model, cluster, training, kind)`` builds a ``CostModel`` over one source of per-unit costs:
``analytic`` (roofline, embedded: plan before owning the hardware), ``profile`` (a measured profile database,
``profiledb.py``, docs/profile-db.md) or ``aceso-compat`` (the reference implementation's model, ``search.compat``).
Formulas: analytic.py (unit times) over kernels.py (GEMM / attention / memory-bound kernels), tpcomm.py (TP
collectives and their overlap), comm.py (collectives), memory.py, pipeline.py (1F1B and interleaved schedules),
evaluate.py (stages, DP and optimizer), timeline.py (finer event kinds); MoE / MLA / MTP units: moe_cost.py and
mla_mtp.py over moe_primitives.py (analytic; the profile kind prices MoE units from the database's moe rows,
profiledb_moe.py, and refuses MLA / MTP; aceso-compat refuses all three with one line).
``settings`` (``types.RunSettings``) says how the framework runs a plan (default: our runtime on megatron-core;
``pricing.run_settings`` derives it from a plan's settings, ``search/costmodel/pricing.py`` prices a plan with it);
``kernels`` picks the analytic kernel
model (``shape``, default; ``flat``: the v1 per-GPU constants).
"""

from __future__ import annotations

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError
from search.spec.model import ModelSpec
from search.settings.precision import check as check_precision
from search.settings.precision import is_low
from search.spec.training import TrainingSpec
from .comm import CommModel
from .evaluate import CostModel
from .types import LEGACY_V1, RC, RC_CODE, PipelineCost, PlanCost, RunSettings, StageCost, UnitTable

KINDS = ("analytic", "profile", "aceso-compat")


def make_cost_model(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, kind: str = "analytic",
                    db=None, *, settings: RunSettings | None = None, kernels: str = "shape"):
    """A cost model of ``kind``; ``db`` is the profile database folder/file (profile, aceso-compat)."""
    from search.layers.moe_spec import refuse_unpriced
    if kind not in KINDS:
        raise AcesoError(f"cost model '{kind}': choose one of {', '.join(KINDS)}")
    if kind == "aceso-compat":  # MoE / MLA / MTP: the analytic model prices them (moe_cost.py, mla_mtp.py)
        refuse_unpriced(model, f"the {kind} cost model does not price them; use --cost-model analytic")
    if kind == "profile" and (model.mla is not None or model.mtp_num_layers):   # MoE: the database's moe rows
        refuse_unpriced(model.model_copy(update={"moe": None}), "the profile cost model does not price them "
                        "(the profiler measures MoE layers, not MLA or MTP); use --cost-model analytic")
    refuse_unpriced(model)      # what the analytic model does not price either (search.layers.moe_spec.unpriced_features)
    why = check_precision(training.precision, cluster.gpu)    # every kind: bf16 on a V100 is no fp16 run
    if why:
        raise AcesoError(why)
    if kind != "analytic" and is_low(training.precision):
        raise AcesoError(f"--cost-model {kind}: precision {training.precision} is priced by the analytic cost model "
                         "only (its FP8/FP4 GEMMs are not profiled); use --cost-model analytic")
    if kind == "analytic":
        from .analytic import AnalyticSource
        comm = CommModel(cluster, nvls=bool(settings and settings.nvls), sharp=bool(settings and settings.sharp))
        src = AnalyticSource(model, cluster, training, comm, kernels=kernels, settings=settings)
        return CostModel(model, cluster, training, src, comm, kind, settings=settings)
    if kind == "profile":
        if db is None:
            raise AcesoError("--cost-model profile needs --db PATH (a profile database, see docs/profile-db.md)")
        from .profiledb import load_profile_db, ProfileSource
        pdb = load_profile_db(db)
        src = ProfileSource(pdb, model, cluster, training)
        return CostModel(model, cluster, training, src, src.comm, kind, settings=settings)
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


__all__ = ["LEGACY_V1", "RC", "RC_CODE", "CostModel", "KINDS", "PipelineCost", "PlanCost", "RunSettings",
           "StageCost", "UnitTable", "make_cost_model"]
