"""megatron-core's precision-aware optimizer (``PlanSettings.precision_aware_optimizer``): Adam's master weights and
moments kept in lower precision by Transformer Engine's ``FusedAdam``. The record's presence is Megatron-LM's
``--use-precision-aware-optimizer``; its fields are the three dtype flags (megatron-core ``OptimizerConfig``,
core_v0.16.1 and core_v0.19.0 ``optimizer/optimizer_config.py:187-206``; Megatron-LM ``arguments.py``
``_add_training_args``: ``--main-params-dtype {fp32,fp16}``, ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``
``{fp32,fp16,bf16,fp8}``, fp8 mapped to ``torch.uint8``). Absent: megatron-core's default, fp32 master weights
and moments held by megatron-core's own distributed optimizer (the plan as priced before the field existed).

megatron-core's rules (``OptimizerConfig.__post_init__``, core_v0.19.0 ``optimizer_config.py:430-436`` and
``469-481``; core_v0.16.1 ``375-381`` and ``414-426``), each refused in one line (``refusal``):

- the precision-aware optimizer only with ``adam`` (``'--use-precision-aware-optimizer only supported with adam'``)
  and with the distributed optimizer (``'... only supported with distributed optimizer'``);
- a dtype other than fp32 needs the precision-aware optimizer (``'exp_avg_dtype can only be fp32 when not using
  precision-aware optimizer'``, and so for main params and exp_avg_sq) -- by construction here: the dtypes live in
  this record only.

What they cost is ``search/costmodel/optimizer_state.py``. Megatron FSDP keeps its own main weights
(``fsdp.py``): aceso does not price the two together and refuses it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MainDtype = Literal["fp32", "fp16"]
StateDtype = Literal["fp32", "fp16", "bf16", "fp8"]
MAIN_DTYPES: tuple[str, ...] = ("fp32", "fp16")
STATE_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8")
# Megatron-LM flag -> field (the order they are written in)
FLAG_FIELDS: dict[str, str] = {"--main-params-dtype": "main_params_dtype", "--exp-avg-dtype": "exp_avg_dtype",
                               "--exp-avg-sq-dtype": "exp_avg_sq_dtype"}
USE_FLAG = "--use-precision-aware-optimizer"
# Megatron-Bridge's OptimizerConfig takes torch dtypes (Megatron-LM maps fp8 to torch.uint8, arguments.py)
TORCH_DTYPES = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16", "fp8": "torch.uint8"}


class PrecisionAwareOptimizer(BaseModel):
    """``--use-precision-aware-optimizer`` with its state dtypes (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    main_params_dtype: MainDtype = Field("fp32", description="--main-params-dtype: the master weights (fp32: with "
                                         "bf16 parameters Transformer Engine keeps only their 16 remainder bits).")
    exp_avg_dtype: StateDtype = Field("fp32", description="--exp-avg-dtype: Adam's first moment (fp8: E4M3).")
    exp_avg_sq_dtype: StateDtype = Field("fp32", description="--exp-avg-sq-dtype: Adam's second moment (fp8: E4M3).")


def refusal(pa: PrecisionAwareOptimizer | None, optimizer: str, distributed_optimizer: bool,
            megatron_fsdp: bool) -> str | None:
    """One line where megatron-core refuses ``pa`` with these settings (or aceso does not price it); else None."""
    if pa is None:
        return None
    if optimizer != "adam":
        return (f"precision_aware_optimizer with optimizer {optimizer}: megatron-core supports it only with adam "
                "(optimizer_config.py asserts it); drop --use-precision-aware-optimizer or use --optimizer adam")
    if megatron_fsdp:
        return ("precision_aware_optimizer with megatron_fsdp: aceso prices it with the distributed optimizer "
                "only; drop --use-precision-aware-optimizer or --use-megatron-fsdp")
    if not distributed_optimizer:
        return ("precision_aware_optimizer needs distributed_optimizer (megatron-core asserts "
                "'--use-precision-aware-optimizer only supported with distributed optimizer'); add "
                "--use-distributed-optimizer")
    return None


def from_flags(use: bool, dtypes: dict[str, str | None]) -> PrecisionAwareOptimizer | None:
    """The record of a Megatron-LM command line (``dtypes``: flag -> value given, None when absent); raises
    ``ValueError`` with one line for a dtype megatron-core refuses (a choice it lacks, or not fp32 without the
    precision-aware optimizer)."""
    for flag, v in dtypes.items():
        choices = MAIN_DTYPES if flag == "--main-params-dtype" else STATE_DTYPES
        if v is not None and v not in choices:
            raise ValueError(f"{flag} {v}: choose {', '.join(choices)}")
        if v not in (None, "fp32") and not use:
            raise ValueError(f"{flag} {v} needs {USE_FLAG} (megatron-core asserts '{FLAG_FIELDS[flag]} can only "
                             f"be fp32 when not using precision-aware optimizer'); add it or drop the flag")
    if not use:
        return None
    return PrecisionAwareOptimizer(**{FLAG_FIELDS[f]: v for f, v in dtypes.items() if v is not None})


def to_flags(pa: PrecisionAwareOptimizer | None) -> list[str]:
    """The Megatron-LM flags that say ``pa`` (a dtype at its fp32 default is not written)."""
    if pa is None:
        return []
    out = [USE_FLAG]
    for flag, name in FLAG_FIELDS.items():
        v = getattr(pa, name)
        out += [flag, v] if v != "fp32" else []
    return out


def bridge_fields(pa: PrecisionAwareOptimizer | None) -> dict[str, object]:
    """Megatron-Bridge ``optimizer`` fields (megatron-core ``OptimizerConfig``, torch dtypes) that say ``pa``."""
    if pa is None:
        return {}
    out: dict[str, object] = {"use_precision_aware_optimizer": True}
    for name in FLAG_FIELDS.values():
        v = getattr(pa, name)
        if v != "fp32":
            out[name] = {"_target_": TORCH_DTYPES[v], "_call_": False}
    return out


def from_bridge(field: str, value: object) -> object:
    """A Bridge ``optimizer`` field as Megatron-LM's flag value: a torch dtype object of ``bridge_fields`` (a dtype
    field) back to its name (fp8 for ``torch.uint8``); anything else as it is."""
    if field in FLAG_FIELDS.values() and isinstance(value, dict):
        names = {t: n for n, t in TORCH_DTYPES.items()}
        return names.get(value.get("_target_"), value)
    return value
