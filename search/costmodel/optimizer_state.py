"""Adam's state bytes per parameter under megatron-core's precision-aware optimizer
(``search/settings/optimizer_state.py``), exactly as megatron-core and Transformer Engine's ``FusedAdam`` allocate
them, and the step's bytes. Everything below is per parameter of the rank's distributed-optimizer shard (the
caller divides by dp x cp, or the expert-DP group; the precision-aware optimizer needs the distributed optimizer).
Sources: megatron-core core_v0.19.0 ``megatron/core/optimizer/`` (core_v0.16.1 has the same code at the lines in
brackets) and TE ``transformer_engine/pytorch/optimizers/fused_adam.py`` (``FusedAdam``, TE 2.x).

Who holds the master weight (``held_by_te``): ``optimizer_config.py:404-411``
``use_precision_aware_optimizer_no_fp8_or_ds_fp8``: TE's FusedAdam (``__init__.py:573-580``: ``master_weights=True,
use_decoupled_grad=True, master_weight_dtype=main_params_dtype``) unless the main params are fp32 and the recipe is
an FP8 recipe other than delayed scaling (tensorwise, blockwise, mxfp8), where megatron-core keeps its own fp32 copy
as without the flag. (Megatron-LM passes ``--fp8-recipe``'s value, default delayed, also to an FP4 run: TE holds it.)

Bytes held (``state_bytes``):

    master   TE-held: ``distrib_optimizer.py:452-454`` (``406-408``) creates no fp32 main param ("main params are
             held by FusedAdam"); ``FusedAdam._initialize_state`` allocates it in ``master_weight_dtype``: fp16 2 B
             (``--main-params-dtype fp16``); fp32 with bf16 parameters: only the trailing 16 bits, an int16, 2 B
             (``store_param_remainders``, default True, ``optimizer_config.py:192``, passed at ``__init__.py:584``,
             turned off below TE 2.1 at ``optimizer_config.py:438-439``: aceso prices TE >= 2.1; FusedAdam keeps
             it "only when param type is BF16 and master weight type is FP32"; the checkpoint's dummy state at
             ``distrib_optimizer.py:1007-1013`` says the same: int16 with bf16, else ``main_params_dtype``); fp32
             with fp16 parameters: 4 B. megatron-core-held: ``shard_model_param.clone().float()``
             (``distrib_optimizer.py:445``): 4 B. fp32 training: the parameter is its own master (FusedAdam's
             fp32 path keeps no ``master_param``): 0 B (its 4 B are the weight's).
    m, v     ``FusedAdam._initialize_state``: ``empty_like(param, dtype)``: fp32 4, fp16 2, bf16 2, fp8 1 B (a
             ``Float8Tensor`` of E4M3, ``torch.uint8`` in ``__init__.py:564-567``). Each non-fp32 state also gets
             one fp32 scale per tensor (``self._scales``; fp8 adds its quantizer's scale and amax): a few bytes
             per parameter *tensor*, not per element -- not priced.

The step's transient (``step_copy_bytes``, alive during the step, after the activations are freed: the slot of
megatron-core's fp32 gradient copy): ``FusedAdam.step`` unscales every non-fp32 state of the parameter group into
an fp32 tensor (``get_unscaled_state``: ``.float()``) and keeps them all in ``unscaled_lists`` until the kernels
ran and the states were rescaled (``del unscaled_lists``): 4 B per non-fp32 state (the int16 remainder is read in
place). The gradient needs no fp32 copy when TE holds the master weight: the shard of the grad buffer is handed
over as ``decoupled_grad`` (``distrib_optimizer.py:2780``, ``2417``); megatron-core-held, it is ``.float()``-ed as
without the flag (``:2782``; ``memory.grad_copy_bytes``).

The step's HBM bytes (``step_bytes``; ``evaluate.OPT_BYTES_PER_PARAM`` counts 8 per fp32 state, a read and a
write): an fp32 state 8; the int16 remainder 4 plus the bf16 weight it is rebuilt from, 2: 6; bf16 24 (unscale
``.float()`` 2 + 4, kernel 8, rescale ``.bfloat16()`` 4 + 2 and ``copy_`` 2 + 2); fp16 40 (unscale 2 + 4 and the
scale's ``mul_`` 8, kernel 8, rescale: ``aminmax`` 4, ``mul_`` 8, ``copy_`` 4 + 2); fp8 22 (dequantize 1 + 4,
kernel 8, ``aminmax`` 4, quantize 4 + 1). Lower-precision moments save memory, not step time.

Hand-computed: tests/unit/test_precision_aware_optimizer.py.
"""

from __future__ import annotations

from search.settings.optimizer_state import PrecisionAwareOptimizer
from search.settings.precision import base_dtype

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0}
STEP_BYTES = {"fp32": 8.0, "bf16": 24.0, "fp16": 40.0, "fp8": 22.0}   # per state per step (module docstring)
REMAINDER_STEP_BYTES = 6.0                                              # int16 read + write, bf16 weight read
FP8_MCORE_MASTER = ("fp8-tensorwise", "fp8-blockwise", "mxfp8")          # recipes whose fp32 master mcore keeps


def held_by_te(pa: PrecisionAwareOptimizer, precision: str) -> bool:
    """Whether TE's FusedAdam holds the master weight (megatron-core's ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``)."""
    return pa.main_params_dtype != "fp32" or precision not in FP8_MCORE_MASTER


def _master(pa: PrecisionAwareOptimizer, precision: str) -> tuple[float, str | None]:
    """(bytes held, the dtype it is stepped as: None for the remainder / fp32-in-place) of the master weight."""
    base = base_dtype(precision)
    if base == "fp32":
        return 0.0, "fp32"
    if not held_by_te(pa, precision):
        return 4.0, "fp32"
    if pa.main_params_dtype == "fp16":
        return 2.0, "fp16"
    return (2.0, None) if base == "bf16" else (4.0, "fp32")


def state_bytes(pa: PrecisionAwareOptimizer, precision: str) -> float:
    """Optimizer bytes per parameter held (master + m + v), unsharded (module docstring)."""
    return _master(pa, precision)[0] + DTYPE_BYTES[pa.exp_avg_dtype] + DTYPE_BYTES[pa.exp_avg_sq_dtype]


def step_copy_bytes(pa: PrecisionAwareOptimizer, precision: str, grad_fp32: bool) -> float:
    """Bytes per parameter alive during the step only: the fp32 unscaled states and, megatron-core-held, the fp32
    gradient copy (module docstring)."""
    m_dtype = _master(pa, precision)[1]
    low = [d for d in (m_dtype, pa.exp_avg_dtype, pa.exp_avg_sq_dtype) if d not in (None, "fp32")]
    grad_copy = 0.0 if held_by_te(pa, precision) or grad_fp32 or base_dtype(precision) == "fp32" else 4.0
    return 4.0 * len(low) + grad_copy


def step_bytes(pa: PrecisionAwareOptimizer, precision: str, default_bytes: float) -> float:
    """HBM bytes per parameter of the step: ``default_bytes`` (the fp32-state figure, ``OPT_BYTES_PER_PARAM``) with
    each state's 8 replaced by what it moves here (module docstring)."""
    m_dtype = _master(pa, precision)[1]
    master = REMAINDER_STEP_BYTES if m_dtype is None else STEP_BYTES[m_dtype]
    return default_bytes - 24.0 + master + STEP_BYTES[pa.exp_avg_dtype] + STEP_BYTES[pa.exp_avg_sq_dtype]
