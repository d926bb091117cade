"""The one price of a plan: ``price(plan, target, calibration)``, what every command that prices a plan calls.

``aceso search`` (the prediction it writes), ``explain``, ``validate`` (its memory check), ``import`` (the
prediction of an imported command line), ``export`` (the header's prediction on a calibrated cluster),
``calibrate`` (each run before and after) and ``launch`` (a CPU run's memory) all price through here, so they
agree on a plan to the last digit (tests/unit/test_pricing.py). Three inputs, each from one place:

- the plan's settings as ``target`` runs them (``plan_settings.target_settings``: its own settings, or the same
  switches under another framework's defaults), and the cost model's view of them (``run_settings``, here; ``describe`` says it in one line);
- the training spec a plan is priced with (``training_of``: its batch, precision recipe, optimizer and sharding,
  the attention kernel its prediction assumed);
- the cluster (the plan's, or the one given) with a calibration file applied (``calibration.apply_calibration``).

``cost_model`` is the builder underneath (the search builds its own through it, with the settings it searches
under); ``price`` evaluates the plan with it.
"""

from __future__ import annotations

from search.costmodel.release_constants import note
from search.costmodel.types import RunSettings
from search.io.errors import AcesoError
from search.settings.data_parallel import run_fields
from search.settings.plan_settings import RUNTIME, PlanSettings, Target, target_settings
from search.settings.precision import base_dtype, training_fields
from search.settings.releases import resolve
from search.spec.training import TrainingSpec


def run_settings(settings: PlanSettings | None, precision: str):
    """The cost model's ``RunSettings`` for these settings (fp32 training: the gradients are fp32 anyway; the
    release resolved by ``releases.resolve``)."""
    s = settings or RUNTIME
    return RunSettings(grad_reduce_in_fp32=s.grad_reduce_in_fp32 and precision != "fp32",
                       release=resolve(s.release)[0], **run_fields(s.data_parallel, s.framework))


def describe(settings: PlanSettings | None, precision: str) -> str:
    """One line for reports and export headers."""
    s = settings or RUNTIME
    dtype = "fp32" if s.grad_reduce_in_fp32 or precision == "fp32" else base_dtype(precision)
    low = f", {s.low_precision.recipe} linear GEMMs" if s.low_precision else ""
    opt = f", {s.optimizer}" if s.optimizer != "adam" else ""
    return f"{s.framework}{low}{opt}, gradients reduced in {dtype}{release_text(s.release)}"


def release_text(release: str | None) -> str:
    """``, release 26.04.01`` (what a stated release is priced as, and why where it is not its own fit); empty for
    None."""
    if not release:
        return ""
    name, why = resolve(release)
    shown = name if name == release else f"{name} (stated: {release})"
    extra = "; ".join(x for x in (why, note(name)) if x)
    return f", release {shown}" + (f": {extra}" if extra else "")


def precision_of(plan, precision: str | None = None) -> dict:
    """The ``TrainingSpec`` fields of the software a plan runs: its recipe (else its parameter dtype; ``precision``
    overrides both) and its optimizer."""
    s = plan.settings
    prec = {"precision": precision} if precision else training_fields(s.low_precision, plan.model.params_dtype)
    return {**prec, "optimizer": s.optimizer}


def training_of(plan, attention: str | None = None, precision: str | None = None) -> TrainingSpec:
    """The ``TrainingSpec`` a plan is priced with: its batch, ``precision_of``, its sharding (the distributed
    optimizer; Megatron FSDP shards on its own: an FSDP plan with ``--fp8-param-gather`` needs no distributed
    optimizer), and ``attention`` (None: what its prediction assumed, else auto)."""
    s = plan.settings
    if attention is None:
        attention = (plan.predicted.attention if plan.predicted else None) or "auto"
    return TrainingSpec(global_batch_size=plan.global_batch_size, micro_batch_sizes=[plan.micro_batch_size],
                        **precision_of(plan, precision), distributed_optimizer=s.distributed_optimizer,
                        megatron_fsdp=s.megatron_fsdp is not None, attention=attention)


def cost_model(model, cluster, training: TrainingSpec, settings: PlanSettings | None = None,
               kind: str = "analytic", db=None, run=None):
    """The cost model of ``kind`` pricing under ``settings`` (None: the runtime's); ``run``: the cost model's view
    given as it is (a ``RunSettings``: the benchmark's 2021 / 2022 Megatron-LM), instead of the settings'.
    aceso-compat prices the reference's way whatever the settings are."""
    if kind == "aceso-compat":
        try:
            from search.compat.costmodel import make_compat_cost_model
        except ImportError:
            raise AcesoError("--cost-model aceso-compat is not available in this version") from None
        return make_compat_cost_model(model, cluster, training, db)
    from search.costmodel import make_cost_model
    return make_cost_model(model, cluster, training, kind, db=db,
                           settings=run if run is not None else run_settings(settings, training.precision))


def priced_cluster(plan, cluster=None, calibration=None):
    """The cluster a plan is priced on: ``cluster`` (None: the plan's) with ``calibration`` (a
    ``CalibrationFile``, a path to one, or None) applied."""
    cluster = cluster if cluster is not None else plan.cluster
    if cluster is None:
        raise AcesoError("the plan names no cluster; give --cluster NODESxGPUS-gpu")
    if calibration is None:
        return cluster
    from search.calibration.calibration import apply_calibration, load_calibration
    return apply_calibration(cluster, load_calibration(calibration) if isinstance(calibration, str) else calibration)


def plan_cost_model(plan, target: "str | Target | None" = None, calibration=None, *, cluster=None,
                    kind: str = "analytic", db=None, attention: str | None = None, precision: str | None = None,
                    run=None):
    """``(cost model, plan on its priced cluster, settings priced)`` of ``price`` (explain draws with the cost
    model)."""
    cl = priced_cluster(plan, cluster, calibration)
    training = training_of(plan, attention, precision)
    settings = target_settings(target, plan.settings, plan.model.params_dtype)
    cm = cost_model(plan.model, cl, training, settings, kind, db, run)
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
