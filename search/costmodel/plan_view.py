"""The cost model's view of a plan: what the one price (``search.pricing``) prices a plan with.

- ``run_settings``: the plan's settings as the cost model reads them (a ``RunSettings``); ``describe`` says them
  in one line (reports, export headers), ``release_text`` the release they are priced as;
- ``training_of``: the training spec a plan is priced with (its batch, ``precision_of``: its precision recipe and
  optimizer; its sharding; the attention kernel its prediction assumed).

The runtime reads ``run_settings`` too, so a plan runs as it was priced.
"""

from __future__ import annotations

from search.costmodel.release_constants import note
from search.costmodel.types import RunSettings
from search.settings.data_parallel import run_fields
from search.settings.plan_settings import RUNTIME, PlanSettings
from search.settings.precision import base_dtype, training_fields
from search.settings.releases import resolve
from search.spec.training import TrainingSpec


def run_settings(settings: PlanSettings | None, precision: str):
    """The cost model's ``RunSettings`` for these settings (fp32 training: the gradients are fp32 anyway; the
    release resolved by ``releases.resolve``)."""
    s = settings or RUNTIME
    return RunSettings(grad_reduce_in_fp32=s.grad_reduce_in_fp32 and precision != "fp32",
                       release=resolve(s.release)[0], precision_aware=s.precision_aware_optimizer,
                       # unset: Megatron-LM's default with virtual stages (on); the aceso runtime's pipeline
                       # communicator runs them synchronously (``runtime_rules.overlap_p2p`` refuses it on)
                       overlap_p2p_comm=s.overlap_p2p_comm if s.overlap_p2p_comm is not None else
                       s.framework != "runtime",
                       **run_fields(s.data_parallel, s.framework))


def describe(settings: PlanSettings | None, precision: str) -> str:
    """One line for reports and export headers."""
    s = settings or RUNTIME
    dtype = "fp32" if s.grad_reduce_in_fp32 or precision == "fp32" else base_dtype(precision)
    low = f", {s.low_precision.recipe} linear GEMMs" if s.low_precision else ""
    opt = f", {s.optimizer}" if s.optimizer != "adam" else ""
    if (pa := s.precision_aware_optimizer) is not None:
        opt += (f", precision-aware optimizer (master {pa.main_params_dtype}, moments {pa.exp_avg_dtype} / "
                f"{pa.exp_avg_sq_dtype})")
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
