"""The software settings a plan was priced under (``ParallelPlan.settings``), and the one mapping to ``RunSettings``.

A plan runs on one of three frameworks: our runtime on megatron-core (``runtime``), Megatron-LM's training script
(``megatron-lm``) or Megatron-Bridge (``megatron-bridge``). Beyond the plan's own fields, what changes its price
and what an exported flag controls is the gradient reduction dtype (``grad_reduce_in_fp32``: the DDP gradient
buffer and the DP reduction in fp32, 4 B per parameter, instead of the parameter dtype).

Megatron-LM core_v0.16.1 (``megatron/training/arguments.py``, ``validate_args``): with ``--bf16``,
``--grad-reduce-in-bf16`` sets ``accumulate_allreduce_grads_in_fp32`` False; otherwise it is set True unless
``--main-grads-dtype bf16`` (precision-aware optimizer); with ``--fp16`` or fp32 it is
``--accumulate-allreduce-grads-in-fp32`` as given (default off). ``training.py`` passes it to megatron-core's DDP as
``grad_reduce_in_fp32``. Megatron-Bridge v0.3.1: ``mixed_precision.setup`` copies the recipe's
``mixed_precision.grad_reduce_in_fp32`` over ``ddp.grad_reduce_in_fp32`` (``bf16_mixed``: True); aceso's export
writes both (``megatron/bridge.py``). The runtime keeps megatron-core's DDP default (off), and
the runtime's engine (its ``_ddp_config``) builds its DDP from the plan's own settings through
``run_settings``, so a plan runs in the runtime as it was priced (a Megatron-LM-priced plan launched through the
runtime reduces as its flags would).

``plan_settings(framework, precision, grad_reduce_in_bf16)`` is the default of each framework (what it does with
no extra flag); ``run_settings(settings, precision)`` is the one place a pricing path gets its ``RunSettings``;
``settings_for(plan, framework)`` picks the plan's own settings, or the framework's default when asked to price
the plan for another framework. Plans without the field (older ones) are runtime plans.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from .data_parallel import DataParallelSettings, run_fields
from .precision import LowPrecision, base_dtype, training_fields

Framework = Literal["runtime", "megatron-lm", "megatron-bridge"]
Optimizer = Literal["adam", "muon", "dist_muon"]
FRAMEWORKS: tuple[str, ...] = ("runtime", "megatron-lm", "megatron-bridge")


class PlanSettings(BaseModel):
    """How the framework runs the plan beyond the plan's own fields (what the prediction assumed)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    framework: Framework = Field("runtime", description="Who runs the plan: runtime (aceso on megatron-core), "
                                 "megatron-lm (its training script) or megatron-bridge.")
    grad_reduce_in_fp32: bool = Field(False, description="Gradient buffer and DP reduction in fp32 (megatron-core "
                                      "DDP grad_reduce_in_fp32). Megatron-LM: on for --bf16 unless "
                                      "--grad-reduce-in-bf16; --accumulate-allreduce-grads-in-fp32 for --fp16.")
    low_precision: LowPrecision | None = Field(None, description="The low-precision recipe (FP8 / FP4 linear "
                                               "GEMMs, search/precision.py); None = the parameter dtype throughout.")
    optimizer: Optimizer = Field("adam", description="The optimizer (Megatron-LM --optimizer): adam, muon (Muon on "
                                 "the 2-D weights, Adam on the rest) or dist_muon (Muon with its states sharded "
                                 "layer-wise over DP: LayerWiseDistributedOptimizer).")
    release: str | None = Field(None, max_length=32, description="The software release the plan was priced for: a "
                                "NeMo / Megatron-Bridge container (26.04.01) or a megatron-core version "
                                "(search/releases.py); None = the newest container.")

    data_parallel: DataParallelSettings | None = Field(None, description="DDP buckets, the schedule's alignment "
                                                       "of the DP collectives, rank order and in-network reductions "
                                                       "(search/data_parallel.py); None = the framework's defaults.")

    @model_serializer(mode="wrap")
    def _plain_form(self, handler):
        """Adam is written as before the field existed (no ``optimizer`` key)."""
        out = handler(self)
        if isinstance(out, dict) and out.get("optimizer") == "adam":
            out.pop("optimizer")
        return out

    @field_validator("release")
    @classmethod
    def _known_release(cls, v: str | None) -> str | None:
        from .errors import AcesoError
        from .releases import resolve
        if v is not None:
            try:
                resolve(v)
            except AcesoError as e:
                raise ValueError(str(e)) from None
        return v


RUNTIME = PlanSettings()


def plan_settings(framework: str, precision: str, grad_reduce_in_bf16: bool = False,
                  low: LowPrecision | None = None) -> PlanSettings:
    """The settings ``framework`` runs with for ``precision`` and no extra flag but ``--grad-reduce-in-bf16``;
    ``low``: the low-precision recipe the plan runs (``precision`` is then its bf16 base)."""
    if framework == "runtime":
        return RUNTIME if low is None else PlanSettings(low_precision=low)
    return PlanSettings(framework=framework, low_precision=low,
                        grad_reduce_in_fp32=base_dtype(precision) == "bf16" and not grad_reduce_in_bf16)


def plan_precision(plan) -> dict:
    """The ``TrainingSpec`` fields of the software a plan was priced under: its recipe (else its parameter dtype)
    and its optimizer."""
    s = plan.settings or RUNTIME
    out = training_fields(s.low_precision, plan.model.params_dtype)
    return {**out, "optimizer": s.optimizer} if s.optimizer != "adam" else out


def plan_sharding(plan) -> dict:
    """The ``TrainingSpec`` sharding fields of a plan as it runs: the distributed optimizer, Megatron FSDP (which
    shards on its own: an FSDP plan with ``--fp8-param-gather`` has no distributed optimizer, and needs none)."""
    return {"distributed_optimizer": plan.distributed_optimizer, "megatron_fsdp": plan.megatron_fsdp is not None}


def settings_from_flags(precision: str, grad_reduce_in_bf16: bool, accumulate_in_fp32: bool,
                        main_grads_bf16: bool = False) -> PlanSettings:
    """Megatron-LM's ``validate_args`` rule for ``accumulate_allreduce_grads_in_fp32`` (module docstring)."""
    if precision == "bf16":
        fp32 = not grad_reduce_in_bf16 and (accumulate_in_fp32 or not main_grads_bf16)
    else:
        fp32 = accumulate_in_fp32
    return PlanSettings(framework="megatron-lm", grad_reduce_in_fp32=fp32)


def settings_for(plan, framework: str | None = None) -> PlanSettings:
    """The plan's own settings; for another ``framework``, that framework's default."""
    own = plan.settings or RUNTIME
    if framework is None or framework == own.framework:
        return own
    other = plan_settings(framework, plan.model.params_dtype, low=own.low_precision)
    return other.model_copy(update={"optimizer": own.optimizer, "release": own.release})


def run_settings(settings: PlanSettings | None, precision: str):
    """The cost model's ``RunSettings`` for these settings (fp32 training: the gradients are fp32 anyway; the
    release resolved by ``releases.resolve``)."""
    from .costmodel.types import RunSettings
    if isinstance(settings, RunSettings):      # already the cost model's (``RunSettings.megatron_lm``)
        return settings
    from .releases import resolve
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
    from .costmodel.release_constants import note
    from .releases import resolve
    name, why = resolve(release)
    shown = name if name == release else f"{name} (stated: {release})"
    extra = "; ".join(x for x in (why, note(name)) if x)
    return f", release {shown}" + (f": {extra}" if extra else "")
