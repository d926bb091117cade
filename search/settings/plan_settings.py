"""The one settings record a plan holds (``ParallelPlan.settings``, schema version 4): every plan-wide switch a plan
can carry, each once, and the one mapping of a target to how it runs a plan.

``PlanSettings`` says what the plan runs with beyond its stages: who runs it (``framework``) and which software
``release`` it was priced for; its precision recipe (``low_precision``) and ``optimizer``; how its gradients and
optimizer states are kept and reduced (``grad_reduce_in_fp32``, ``distributed_optimizer``, the two DP overlaps,
``megatron_fsdp``, ``data_parallel``); ``tp_comm_overlap``; CPU ``activation_offload``; the MoE layers' ``moe``
settings; the software-stack switches (``stack``). Each sub-record lives beside its rules (``fsdp.py``,
``moe_plan.py``, ``stack.py``, ``data_parallel.py``, ``precision.py``). Plans of schema versions 1 to 3 carried the
switches at the top level (``LEGACY_KEYS``); ``ParallelPlan`` moves them here on read. Per-stage choices
(``sequence_parallel``, ``cp``, the expert shape, recompute) stay with the stages.

Who runs the plan: our runtime on megatron-core (``runtime``), Megatron-LM's training script (``megatron-lm``) or
Megatron-Bridge (``megatron-bridge``). Beyond the switches, what changes the price and what an exported flag
controls is the gradient reduction dtype (``grad_reduce_in_fp32``: the DDP gradient buffer and the DP reduction in
fp32, 4 B per parameter, instead of the parameter dtype).

Megatron-LM core_v0.16.1 (``megatron/training/arguments.py``, ``validate_args``): with ``--bf16``,
``--grad-reduce-in-bf16`` sets ``accumulate_allreduce_grads_in_fp32`` False; otherwise it is set True unless
``--main-grads-dtype bf16`` (precision-aware optimizer); with ``--fp16`` or fp32 it is
``--accumulate-allreduce-grads-in-fp32`` as given (default off). ``training.py`` passes it to megatron-core's DDP as
``grad_reduce_in_fp32``. Megatron-Bridge v0.3.1: ``mixed_precision.setup`` copies the recipe's
``mixed_precision.grad_reduce_in_fp32`` over ``ddp.grad_reduce_in_fp32`` (``bf16_mixed``: True); aceso's export
writes both (``megatron/bridge.py``). The runtime keeps megatron-core's DDP default (off), and
the runtime's engine (its ``_ddp_config``) builds its DDP from the plan's own settings through
``costmodel.plan_view.run_settings``, so a plan runs in the runtime as it was priced (a Megatron-LM-priced plan launched through the
runtime reduces as its flags would).

``target_settings(target, settings, precision)`` is the one mapping of a target (``Target``: a framework and the
release it runs) to how it runs a plan: the plan's own settings when they are that target's, else the same
switches under the target's defaults (what it does with no extra flag but ``--grad-reduce-in-bf16``);
``search/costmodel/plan_view.py`` derives the cost model's view of them (``run_settings(settings, precision)``, the
one place) and prices a plan with both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from search.settings.data_parallel import DataParallelSettings
from search.settings.fsdp import ActivationOffload, MegatronFSDP
from search.settings.moe_plan import MoEPlanSettings
from search.settings.optimizer_state import PrecisionAwareOptimizer, refusal as optimizer_state_refusal
from search.settings.precision import LowPrecision, base_dtype
from search.settings.stack import StackSettings

Framework = Literal["runtime", "megatron-lm", "megatron-bridge"]
Optimizer = Literal["adam", "muon", "dist_muon"]
FRAMEWORKS: tuple[str, ...] = ("runtime", "megatron-lm", "megatron-bridge")
TARGET_NAMES = {"aceso": "runtime", **{f: f for f in FRAMEWORKS}}   # a --target (``aceso``: the runtime) -> framework
# the switches schema versions 1-3 kept at the plan's top level (ParallelPlan moves them into ``settings`` on read)
LEGACY_KEYS: tuple[str, ...] = ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                                "tp_comm_overlap", "megatron_fsdp", "activation_offload", "moe", "stack")


class PlanSettings(BaseModel):
    """What the plan runs with beyond its stages: every plan-wide switch, each once (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    framework: Framework = Field("runtime", description="Who runs the plan: runtime (aceso on megatron-core), "
                                 "megatron-lm (its training script) or megatron-bridge.")
    release: str | None = Field(None, max_length=32, description="The software release the plan was priced for: a "
                                "NeMo / Megatron-Bridge container (26.04.01) or a megatron-core version "
                                "(search/settings/releases.py); None = the newest container.")
    low_precision: LowPrecision | None = Field(None, description="The low-precision recipe (FP8 / FP4 linear "
                                               "GEMMs, search/settings/precision.py); None = the parameter dtype throughout.")
    optimizer: Optimizer = Field("adam", description="The optimizer (Megatron-LM --optimizer): adam, muon (Muon on "
                                 "the 2-D weights, Adam on the rest) or dist_muon (Muon with its states sharded "
                                 "layer-wise over DP: LayerWiseDistributedOptimizer).")
    precision_aware_optimizer: PrecisionAwareOptimizer | None = Field(
        None, description="--use-precision-aware-optimizer with its master-weight and moment dtypes (adam with the "
        "distributed optimizer; search/settings/optimizer_state.py); None = fp32 master weights and moments.")
    grad_reduce_in_fp32: bool = Field(False, description="Gradient buffer and DP reduction in fp32 (megatron-core "
                                      "DDP grad_reduce_in_fp32). Megatron-LM: on for --bf16 unless "
                                      "--grad-reduce-in-bf16; --accumulate-allreduce-grads-in-fp32 for --fp16.")
    distributed_optimizer: bool = Field(False, description="Optimizer states (and the fp32 master weights) sharded "
                                        "over each stage's DP (x CP) group; gradients reduce-scattered, parameters "
                                        "all-gathered (megatron-core use_distributed_optimizer).")
    overlap_grad_reduce: bool = Field(False, description="DP gradient reduction in buckets overlapped with the "
                                      "backward pass (megatron-core DDP overlap_grad_reduce).")
    overlap_param_gather: bool = Field(False, description="Distributed optimizer or Megatron FSDP only: the "
                                       "parameter all-gather overlapped with the next forward pass "
                                       "(overlap_param_gather).")
    megatron_fsdp: MegatronFSDP | None = Field(None, description="Megatron FSDP instead of DDP, with its sharding "
                                               "strategy (search/settings/fsdp.py); absent: DDP / the distributed optimizer.")
    data_parallel: DataParallelSettings | None = Field(None, description="DDP buckets, the schedule's alignment "
                                                       "of the DP collectives, rank order and in-network reductions "
                                                       "(search/settings/data_parallel.py); None = the framework's defaults.")
    overlap_p2p_comm: bool | None = Field(None, description="Interleaved schedule (virtual stages): p2p sends / "
                                          "receives async behind the next chunk (megatron-core's overlap_p2p_comm); "
                                          "False: synchronous, batched (Megatron-LM --no-overlap-p2p-communication). "
                                          "None = the framework's default: on for Megatron-LM and Bridge (with "
                                          "virtual stages), off for the aceso runtime (its pipeline communicator "
                                          "runs them synchronously).")
    tp_comm_overlap: bool = Field(False, description="Transformer-engine's TP communication / GEMM overlap "
                                  "(GPU with transformer-engine only; needs sequence_parallel on every tp > 1 "
                                  "stage).")
    activation_offload: ActivationOffload | None = Field(None, description="CPU activation offload of the first "
                                                         "layers (search/settings/fsdp.py); absent: activations stay on "
                                                         "the GPU.")
    moe: MoEPlanSettings | None = Field(None, description="MoE models: how the MoE layers run (dispatcher, grouped "
                                        "GEMM, overlaps); None = the defaults (moe_plan.py). Absent on dense models.")
    stack: StackSettings | None = Field(None, description="Software-stack switches: CUDA graphs, fine-grained "
                                        "activation offload, the cross-entropy fusion (stack.py); absent: none.")

    @model_validator(mode="after")
    def _optimizer_state(self) -> "PlanSettings":
        why = optimizer_state_refusal(self.precision_aware_optimizer, self.optimizer, self.distributed_optimizer,
                                      self.megatron_fsdp is not None)
        if why:
            raise ValueError(why)
        return self

    @model_serializer(mode="wrap")
    def _plain_form(self, handler):
        """Without the precision-aware optimizer or a p2p-overlap setting the record is written as before those fields
        existed (plans and their digests unchanged)."""
        out = handler(self)
        for key in ("precision_aware_optimizer", "overlap_p2p_comm"):
            if isinstance(out, dict) and out.get(key, 0) is None:
                out.pop(key)
        return out

    @field_validator("release")
    @classmethod
    def _known_release(cls, v: str | None) -> str | None:
        from search.io.errors import AcesoError
        from search.settings.releases import resolve
        if v is not None:
            try:
                resolve(v)
            except AcesoError as e:
                raise ValueError(str(e)) from None
        return v


@dataclass(frozen=True)
class Target:
    """Who runs a plan: a framework (``FRAMEWORKS``) and the software release it runs (None: the plan's own, else the
    newest; a container or a megatron-core / Megatron-LM version, ``search/settings/releases.py``)."""

    framework: str = "runtime"
    release: str | None = None

    @classmethod
    def of(cls, target: "str | Target | None", release: str | None = None) -> "Target | None":
        """A ``Target`` from a ``--target`` / ``--framework`` name (``aceso`` is the runtime); None stays None."""
        if target is None or isinstance(target, Target):
            return target if release is None or target is None else Target(target.framework, release)
        return cls(TARGET_NAMES[target], release)


RUNTIME = PlanSettings()


def default_grad_reduce_in_fp32(framework: str, precision: str, grad_reduce_in_bf16: bool = False) -> bool:
    """Whether ``framework`` reduces gradients in fp32 with no extra flag but ``--grad-reduce-in-bf16``: Megatron-LM
    and Megatron-Bridge for a bf16 model (a low-precision recipe's base is bf16), the runtime never."""
    return framework != "runtime" and base_dtype(precision) == "bf16" and not grad_reduce_in_bf16


def target_settings(target: "str | Target | None", settings: PlanSettings | None = None, precision: str = "bf16",
                    grad_reduce_in_bf16: bool = False) -> PlanSettings:
    """How ``target`` runs a plan with ``settings`` (None: no switch on): the settings themselves when they are
    ``target``'s (its framework; its release where it names one), else the same switches, recipe, optimizer and
    release under the target's defaults: its gradient-reduction dtype (``default_grad_reduce_in_fp32``;
    ``precision``: the plan's, ``grad_reduce_in_bf16``: Megatron-LM's flag) and its data-parallel defaults (a
    framework's own ``data_parallel`` flags do not carry over). ``target`` None: ``settings`` as they are."""
    own = settings or RUNTIME
    t = Target.of(target)
    if t is None or (settings is not None and t.framework == own.framework
                     and t.release in (None, own.release)):
        return own
    update = {"framework": t.framework, "release": t.release or own.release}
    if settings is None or t.framework != own.framework:
        update |= {"grad_reduce_in_fp32": default_grad_reduce_in_fp32(t.framework, precision, grad_reduce_in_bf16),
                   "data_parallel": None}
    return own.model_copy(update=update)


def sync_p2p_refused(overlap_p2p_comm: bool | None, pp: int, vpp: int) -> bool:
    """Whether Megatron-LM refuses the interleaved schedule's p2p without overlap on ``pp`` stages: its
    validate_args asserts pp > 2 there (several batched sends between the same two ranks; core_v0.16.1
    arguments.py:573-590, core_v0.19.0 arguments.py:966-985). Without virtual stages the flag does nothing."""
    return overlap_p2p_comm is False and vpp > 1 and pp <= 2


def grad_reduce_from_flags(precision: str, grad_reduce_in_bf16: bool, accumulate_in_fp32: bool,
                           main_grads_bf16: bool = False) -> bool:
    """Megatron-LM's ``validate_args`` rule for ``accumulate_allreduce_grads_in_fp32`` (module docstring)."""
    if precision == "bf16":
        return not grad_reduce_in_bf16 and (accumulate_in_fp32 or not main_grads_bf16)
    return accumulate_in_fp32
