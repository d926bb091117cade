"""The one price of a plan: ``price(plan, target, calibration)``, what every command that prices a plan calls.

``aceso search`` (the prediction it writes), ``explain``, ``validate`` (its memory check), ``import`` (the
prediction of an imported command line), ``export`` (the header's prediction on a calibrated cluster),
``calibrate`` (each run before and after) and ``launch`` (a CPU run's memory) all price through here, so they
agree on a plan to the last digit (tests/unit/test_pricing.py). Three inputs, each from one place:

- the plan's settings as ``target`` runs them (``plan_settings.target_settings``: its own settings, or the same
  switches under another framework's defaults), and the cost model's view of them (``run_settings``,
  ``search.costmodel.plan_view``; ``describe`` says it in one line);
- the training spec a plan is priced with (``plan_view.training_of``: its batch, precision recipe, optimizer and
  sharding, the attention kernel its prediction assumed);
- the cluster (the plan's, or the one given) with a calibration file applied
  (``search.costmodel.calibration.apply_calibration``).

``cost_model`` is the builder underneath (the search builds its own through it, with the settings it searches
under; ``models.make_cost_model`` below it chooses the cost model); ``price`` evaluates the plan with it.
"""

from __future__ import annotations

from search.compat.costmodel import make_compat_cost_model
from search.costmodel.calibration import apply_calibration, load_calibration
from search.costmodel.plan_view import run_settings, training_of
from search.io.errors import AcesoError
from search.megatron.bridge import with_recipe_loss
from search.settings.plan_settings import PlanSettings, Target, target_settings
from search.settings.releases import megatron_core
from search.spec.training import TrainingSpec
from .models import make_cost_model


def cost_model(model, cluster, training: TrainingSpec, settings: PlanSettings | None = None,
               kind: str = "analytic", db=None, run=None):
    """The cost model of ``kind`` pricing under ``settings`` (None: the runtime's); ``run``: the cost model's view
    given as it is (a ``RunSettings``: the benchmark's 2021 / 2022 Megatron-LM), instead of the settings'.
    aceso-compat prices the reference's way whatever the settings are."""
    if kind == "aceso-compat":
        return make_compat_cost_model(model, cluster, training, db)
    cm = make_cost_model(model, cluster, training, kind, db=db,
                         settings=run if run is not None else run_settings(settings, training.precision))
    if settings is not None:        # megatron-core's rules of the stated release (a 0.19 is priced as the newest
        cm.megatron_core = megatron_core(settings.release)    # container, but runs 0.19's; planner.dispatchers)
        # the plans say --no-overlap-p2p-communication (planner.api.make_space: Megatron-LM's pp > 2 rule); not the
        # priced ``RunSettings.overlap_p2p_comm``, which is off for the runtime's own synchronous p2p too
        cm.sync_p2p = settings.overlap_p2p_comm is False
    return cm


def priced_cluster(plan, cluster=None, calibration=None):
    """The cluster a plan is priced on: ``cluster`` (None: the plan's) with ``calibration`` (a
    ``CalibrationFile``, a path to one, or None) applied."""
    cluster = cluster if cluster is not None else plan.cluster
    if cluster is None:
        raise AcesoError("the plan names no cluster; give --cluster NODESxGPUS-gpu")
    if calibration is None:
        return cluster
    return apply_calibration(cluster, load_calibration(calibration) if isinstance(calibration, str) else calibration)


def plan_cost_model(plan, target: "str | Target | None" = None, calibration=None, *, cluster=None,
                    kind: str = "analytic", db=None, attention: str | None = None, precision: str | None = None,
                    run=None):
    """``(cost model, plan on its priced cluster, settings priced)`` of ``price`` (explain draws with the cost
    model)."""
    cl = priced_cluster(plan, cluster, calibration)
    training = training_of(plan, attention, precision)
    settings = with_recipe_loss(target_settings(target, plan.settings, plan.model.params_dtype), plan.settings,
                                plan.model)
    cm = cost_model(plan.model, cl, training, settings, kind, db, run)
    if settings.stack != plan.settings.stack:       # the Bridge recipe's loss fusion (a stage's cost reads the plan's)
        plan = plan.model_copy(update={"settings": plan.settings.model_copy(update={"stack": settings.stack})})
    return cm, plan if cl is plan.cluster else plan.model_copy(update={"cluster": cl}), settings


def price(plan, target: "str | Target | None" = None, calibration=None, *, cluster=None, kind: str = "analytic",
          db=None, attention: str | None = None, precision: str | None = None, run=None):
    """The ``PlanCost`` of ``plan`` as ``target`` runs it (None: as its own settings say; a ``--target`` name, a
    framework or a ``Target`` with a release) on its cluster (``cluster``: another) with ``calibration`` applied.
    ``kind`` / ``db``: the cost model; ``attention``: the kernel assumed (None: the plan's prediction's, else
    auto); ``precision``: priced in another precision than the plan's; ``run``: a ``RunSettings`` to price under
    as it is (benchmarks of older Megatron-LM)."""
    cm, plan, _ = plan_cost_model(plan, target, calibration, cluster=cluster, kind=kind, db=db, attention=attention,
                                  precision=precision, run=run)
    return cm.evaluate(plan)
