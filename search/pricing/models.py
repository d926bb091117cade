"""The choice of cost model: ``make_cost_model(model, cluster, training, kind)`` builds the ``CostModel`` of one
source of per-unit costs: ``analytic`` (``search.costmodel.analytic``, roofline, embedded: plan before owning the
hardware), ``profile`` (a measured profile database, ``search.costmodel.profiledb``, docs/profile-db.md) or
``aceso-compat`` (the reference implementation's model, ``search.compat``). It sits above the cost models, so that
none of them imports another to be chosen. ``settings`` (``RunSettings``) says how the framework runs a plan;
``kernels`` picks the analytic kernel model (``shape``, default; ``flat``: the v1 per-GPU constants).
"""

from __future__ import annotations

from search.compat.costmodel import make_compat_cost_model
from search.costmodel.comm import CommModel
from search.costmodel.evaluate import CostModel
from search.costmodel.types import RunSettings
from search.io.errors import AcesoError
from search.layers.moe_spec import refuse_unpriced
from search.settings.precision import check as check_precision
from search.settings.precision import is_low
from search.spec.cluster import ClusterSpec
from search.spec.model import ModelSpec
from search.spec.training import TrainingSpec

KINDS = ("analytic", "profile", "aceso-compat")


def make_cost_model(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, kind: str = "analytic",
                    db=None, *, settings: RunSettings | None = None, kernels: str = "shape"):
    """A cost model of ``kind``; ``db`` is the profile database folder/file (profile, aceso-compat)."""
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
        from search.costmodel.analytic import AnalyticSource
        comm = CommModel(cluster, nvls=bool(settings and settings.nvls), sharp=bool(settings and settings.sharp))
        src = AnalyticSource(model, cluster, training, comm, kernels=kernels, settings=settings)
        return CostModel(model, cluster, training, src, comm, kind, settings=settings)
    if kind == "profile":
        if db is None:
            raise AcesoError("--cost-model profile needs --db PATH (a profile database, see docs/profile-db.md)")
        from search.costmodel.profiledb import load_profile_db, ProfileSource
        pdb = load_profile_db(db)
        src = ProfileSource(pdb, model, cluster, training)
        return CostModel(model, cluster, training, src, src.comm, kind, settings=settings)
    if kind == "aceso-compat":
        return make_compat_cost_model(model, cluster, training, db)
    raise AcesoError(f"cost model '{kind}': choose one of {', '.join(KINDS)}")
