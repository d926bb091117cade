"""Precision recipes: what each training precision quantizes, its Megatron-LM flags, and its cast and memory bytes.

``TrainingSpec.precision`` is one of ``RECIPES``. bf16 / fp16 / fp32 are the plain dtypes. The low-precision
recipes (transformer-engine through megatron-core core_v0.16.1, ``TransformerConfig.fp8`` / ``fp8_recipe`` /
``fp4`` / ``fp4_recipe``) train in bf16 (``--bf16``) and run the GEMMs of the transformer layers' linear layers
(QKV, attention output, fc1, fc2: forward, input gradient and weight gradient) at the GPU's FP8 or FP4 tensor-core
peak. What stays bf16: the attention core (``fp8_dot_product_attention`` off), norms, softmax, activations, the
embedding and the output layer (logits; megatron-core's own ``ColumnParallelLinear``, not a TE module), and the
first / last layers kept in bf16 (``--first-last-layers-bf16 --num-layers-at-start-in-bf16 N
--num-layers-at-end-in-bf16 M``; megatron-core refuses it with the delayed recipe).

Flags (core_v0.16.1 ``transformer_config.py``; names checked against ``megatron/data/flags_core_v0.16.1.txt``):

    fp8-delayed     --fp8-format hybrid --fp8-recipe delayed      per-tensor scale from an amax history
    fp8-tensorwise  --fp8-format hybrid --fp8-recipe tensorwise   per-tensor current scaling (NVIDIA's "FP8-CS")
    fp8-blockwise   --fp8-format e4m3   --fp8-recipe blockwise    1x128 (activations) / 128x128 (weights) fp32 scales
    mxfp8           --fp8-format e4m3   --fp8-recipe mxfp8        E8M0 scale per 32 elements (Blackwell only)
    nvfp4           --fp4-format e2m1   --fp4-recipe nvfp4        E4M3 scale per 16 elements + a per-tensor fp32 scale

Quantize / cast kernels (memory bound, per linear layer and micro-batch; ``cast_bytes``): transformer-engine casts
each GEMM input it did not already hold quantized: forward the input x (m x k) is read in bf16 and written in the
low-precision format twice (row-wise for the forward GEMM, column-wise for the weight gradient, which keeps it);
backward the output gradient dy (m x n) the same way (dgrad and wgrad). Current scaling (tensorwise, nvfp4's
per-tensor scale) reads its input once more for the amax before the cast; delayed scaling takes the scale from the
history (the amax is fused into the cast); block recipes write one scale per block. Weights are cast once per
iteration (``is_first_microbatch``: cached over the micro-batches) and not priced per micro-batch.

Memory (``weight_bytes_per_param``, per linear-layer parameter beyond the bf16 weight): transformer-engine caches the
quantized weight and its transpose (both directions, with block scales) for the whole iteration; with
``--fp8-param-gather`` the parameter itself is stored quantized (megatron-core ``fp8_param``: no bf16 copy; the
fp32 master copy lives in the optimizer states as before) and the distributed optimizer's all-gather moves 1 byte per
parameter instead of 2. Activations (``act_saving_bytes``): the linear layers keep their quantized input for the
weight gradient instead of the bf16 tensor.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from search.settings.precision_overrides import PerModule


class Recipe(NamedTuple):
    name: str
    gemm: str | None           # the dtype the linear GEMMs run in ("fp8", "fp4"); None: the plain dtype
    elem_bytes: float          # bytes per quantized element
    block: int                 # elements per scale (0: one scale per tensor)
    scale_bytes: float         # bytes per scale
    amax_pass: bool            # current scaling: one more read of the input for its amax
    flags: tuple[str, ...]     # Megatron-LM core_v0.16.1 flags


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("bf16", None, 2.0, 0, 0.0, False, ()),
    Recipe("fp16", None, 2.0, 0, 0.0, False, ()),
    Recipe("fp32", None, 4.0, 0, 0.0, False, ()),
    Recipe("fp8-delayed", "fp8", 1.0, 0, 0.0, False, ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")),
    Recipe("fp8-tensorwise", "fp8", 1.0, 0, 0.0, True, ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")),
    Recipe("fp8-blockwise", "fp8", 1.0, 128, 4.0, False, ("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")),
    Recipe("mxfp8", "fp8", 1.0, 32, 1.0, False, ("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")),
    Recipe("nvfp4", "fp4", 0.5, 16, 1.0, True, ("--fp4-format", "e2m1", "--fp4-recipe", "nvfp4")),
)}
PRECISIONS: tuple[str, ...] = tuple(RECIPES)
LOW_PRECISIONS: tuple[str, ...] = tuple(n for n, r in RECIPES.items() if r.gemm)
# the published tables' labels (Megatron-Bridge performance summary) -> ours
LABELS = {"fp8-cs": "fp8-tensorwise", "fp8-ds": "fp8-delayed", "fp8-mx": "mxfp8", "fp8-blockwise": "fp8-blockwise"}


def recipe(precision: str) -> Recipe:
    return RECIPES[precision]


def is_low(precision: str) -> bool:
    return RECIPES[precision].gemm is not None


def base_dtype(precision: str) -> str:
    """The dtype of parameters, activations and everything a recipe does not quantize (low precision: bf16)."""
    return "bf16" if is_low(precision) else precision


def per_elem(precision: str) -> float:
    """Bytes per quantized element with its share of the block scales."""
    r = RECIPES[precision]
    return r.elem_bytes + (r.scale_bytes / r.block if r.block else 0.0)


def copies(precision: str, non_tn: bool = False) -> int:
    """Quantized copies of a GEMM operand: row-wise and column-wise (2), except per-tensor-scaled FP8 (delayed,
    tensorwise) on a GPU whose FP8 GEMMs take any layout (Blackwell, ``non_tn``): transformer-engine makes no
    transpose there (``quantizer.cpp``: ``create_transpose = columnwise_usage &&
    !nvte_is_non_tn_fp8_gemm_supported()``, true from sm100); block-scaled recipes scale along each direction and
    keep both."""
    return 1 if non_tn and RECIPES[precision].block == 0 else 2


def cast_bytes(precision: str, elems: float, dt: float = 2.0, non_tn: bool = False) -> float:
    """HBM bytes of quantizing one GEMM input of ``elems`` elements read in ``dt`` bytes: the amax read (current
    scaling), the read, and the row-wise and column-wise quantized copies with their scales (module docstring;
    one copy where ``copies`` says so)."""
    r = RECIPES[precision]
    if r.gemm is None:
        return 0.0
    return dt * elems * (2.0 if r.amax_pass else 1.0) + copies(precision, non_tn) * per_elem(precision) * elems


def cast_launches(precision: str) -> int:
    """Kernels per cast: the amax reduction (current scaling) and the cast."""
    return 2 if RECIPES[precision].amax_pass else 1


def weight_bytes_per_param(precision: str, param_gather: bool, non_tn: bool = False) -> float:
    """Bytes per linear-layer parameter beyond the dt-byte weight: the cached quantized weight and its transpose
    (``copies`` x ``per_elem``); with ``--fp8-param-gather`` the bf16 weight is not kept (-2)."""
    if not is_low(precision):
        return 0.0
    return copies(precision, non_tn) * per_elem(precision) - (2.0 if param_gather else 0.0)


REUSE_FLAG = "--reuse-grad-buf-for-mxfp8-param-ag"


def reuse_grad_buf_check(precision: str, param_gather: bool, reuse: bool) -> str | None:
    """``--reuse-grad-buf-for-mxfp8-param-ag`` is for MXFP8 parameters (``--fp8-param-gather``): megatron-core's
    ``DistributedDataParallelConfig`` asserts ``fp8_param_gather``, and only MXFP8 parameters live in the shared
    gradient buffer the flag copies them out of (``param_and_grad_buffer.py``); with another recipe the flag leaves
    the parameters unmapped to the all-gathered buffer. One line, or None."""
    if reuse and not (precision == "mxfp8" and param_gather):
        return (f"{REUSE_FLAG} needs --fp8-recipe mxfp8 with --fp8-param-gather (megatron-core asserts "
                f"fp8_param_gather; only MXFP8 parameters share the gradient buffer), not {precision}"
                f"{' with' if param_gather else ' without'} parameter gather; drop it")
    return None


def gather_bytes_per_param(precision: str, param_gather: bool, dt: float = 2.0) -> float:
    """Bytes per linear-layer parameter the distributed optimizer all-gathers: quantized with param gather, except
    MXFP8, whose parameters megatron-core all-gathers in the gradient buffer's dtype (``dt``: bf16 with
    ``--grad-reduce-in-bf16``) and then quantizes into the MXFP8 parameter (core_v0.16.1
    ``param_and_grad_buffer.py``: "For MXFP8 param: Create a shared buffer for param AG and grad RS", the buffer
    typed as the gradients, whatever ``--reuse-grad-buf-for-mxfp8-param-ag`` says)."""
    if not (param_gather and is_low(precision)) or precision == "mxfp8":
        return dt
    return per_elem(precision)


def fsdp_weight_bytes_per_param(precision: str, param_gather: bool, dt: float = 2.0, non_tn: bool = False) -> float:
    """Bytes per linear-layer parameter beyond the dt-byte weight under Megatron FSDP: with param gather the
    (sharded) parameter and the unsharded copy FSDP all-gathers are what the all-gather moves
    (``gather_bytes_per_param``) and no transposed copy is cached (megatron-core ``keep_fp8_transpose_cache``
    False by default, as Megatron-Bridge's FSDP runs set it); without it as under DDP (``weight_bytes_per_param``)."""
    if param_gather and is_low(precision):
        return gather_bytes_per_param(precision, True, dt) - dt
    return weight_bytes_per_param(precision, False, non_tn)


def sp_gather_bytes(precision: str, dt: float = 2.0) -> tuple[float, float, float]:
    """Bytes per element of a quantized linear layer's three sequence-parallel all-gathers under transformer-engine
    (2.9, which megatron-core core_v0.16.1's TE layers run with ``sequence_parallel``): (forward input of the
    column-parallel layer, backward output gradient of the row-parallel layer, backward re-gather of the
    column-parallel input for its weight gradient). Transformer-engine quantizes before it gathers
    (``layernorm_linear.py`` forward: the norm writes the quantized output, ``gather_along_first_dim(...,
    quantizer=input_quantizer)`` after ``set_usage(rowwise=True, columnwise=False)``; ``base.py``
    ``grad_output_preprocess``: ``gather_along_first_dim(grad_output, ..., quantizer=quantizer)``): the forward moves
    the row-wise copy (``per_elem``); per-tensor FP8 (delayed, tensorwise) gathers only its row-wise data and
    transposes locally (``distributed.py`` ``_all_gather_fp8``; ``supports_only_rowwise_all_gather``), block-scaled
    recipes gather the copies the quantizer uses: the output gradient both row- and column-wise (``_all_gather_mxfp8``
    / ``_nvfp4`` / ``_fp8_blockwise``: dgrad and wgrad), the re-gathered input column-wise only. Plain dtypes:
    ``dt`` each."""
    r = RECIPES[precision]
    if r.gemm is None:
        return dt, dt, dt
    e = per_elem(precision)
    return e, (2 * e if r.block else e), e


def amax_reductions(precision: str) -> int:
    """Blocking all-reduces of one fp32 amax over the TP group per SP-gathered tensor: current scaling
    (tensorwise, nvfp4's per-tensor scale) reduces the amax of the column-parallel input (forward) and of the
    row-parallel output gradient (backward) before it casts, so that every rank gathers with one scale
    (transformer-engine 2.9 ``layernorm_linear.py`` / ``linear.py`` ``_customize_quantizers_float8_current_scaling``
    / ``_nvfp4``: ``with_amax_reduction = True``, ``amax_reduction_group = tp_group`` under ``sequence_parallel``;
    ``quantizer.cpp``: ``amax_reduction_group->allreduce(...)->wait()``). Delayed scaling reduces its amax history
    once per autocast, not per GEMM (not priced); block recipes scale locally (none)."""
    return 1 if RECIPES[precision].amax_pass else 0


def act_saving_bytes(precision: str, elems: float, dt: float = 2.0) -> float:
    """Activation bytes saved when a linear layer keeps its quantized input (``elems`` elements) for backward."""
    return (dt - per_elem(precision)) * elems if is_low(precision) else 0.0


def bf16_layer(precision: str, layer: int, num_layers: int, start: int, end: int) -> bool:
    """Whether transformer layer ``layer`` (0-based) runs its GEMMs in bf16 (first / last layers kept)."""
    return not is_low(precision) or layer < start or layer >= num_layers - end


def mtp_quantized(precision: str, hybrid: bool) -> bool:
    """Whether megatron-core runs a multi-token-prediction depth's linears quantized under ``precision``
    (transformer/multi_token_prediction.py, core_v0.16.1-0.19.0): a GPT model's MTP layer under the fp8 context of
    the whole block (``get_fp8_context(config)``, layer_no -1: whatever the first / last bf16 layers) and under no
    fp4 context ("TODO: currently ignoring FP4 in MTP layers"); a hybrid model's (``hybrid``: a model written as a
    hybrid layer pattern; 0.17+ builds its MTP layer as a ``HybridStack``, models/hybrid/hybrid_block.py) under each
    inner layer's own fp8 or fp4 context, by its index in the MTP pattern (0, 1, ...): quantized, unless
    --num-layers-at-start-in-bf16 covers that index (not priced: the inner layers are priced quantized)."""
    gemm = RECIPES[precision].gemm
    return gemm == "fp8" or (hybrid and gemm == "fp4")


def unit_quantized(precision: str, layer: int, num_layers: int, start: int, end: int, mtp: bool = False,
                   hybrid: bool = False) -> bool:
    """Whether a unit of layer ``layer`` runs its linears quantized: an MTP depth's (``mtp``) by ``mtp_quantized``,
    a decoder layer's unless it is kept in bf16 (``bf16_layer``). The one answer the time (``costmodel.analytic``)
    and the memory of its cached quantized weights (``costmodel.evaluate``) both use."""
    if mtp:
        return is_low(precision) and mtp_quantized(precision, hybrid)
    return not bf16_layer(precision, layer, num_layers, start, end)


def megatron_flags(precision: str, param_gather: bool = False, start: int = 0, end: int = 0,
                   reuse_grad_buf: bool = False) -> list[str]:
    """The Megatron-LM flags of a recipe (beyond ``--bf16``)."""
    r = RECIPES[precision]
    out = list(r.flags)
    if param_gather and r.gemm:
        out.append("--fp8-param-gather" if r.gemm == "fp8" else "--fp4-param-gather")
    if reuse_grad_buf and param_gather and precision == "mxfp8":
        out.append(REUSE_FLAG)
    if (start or end) and r.gemm:
        out += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(start),
                "--num-layers-at-end-in-bf16", str(end)]
    return out


def from_megatron(fp8_format: str | None, fp8_recipe: str | None, fp4_format: str | None,
                  fp4_recipe: str | None) -> str | None:
    """The recipe of Megatron-LM's flags (None: no low precision). Raises ValueError naming the flag."""
    if fp8_format and fp4_format:
        raise ValueError("--fp4-format and --fp8-format together: Megatron-LM refuses it; choose one")
    if fp4_format:
        if fp4_format != "e2m1" or (fp4_recipe or "nvfp4") != "nvfp4":
            raise ValueError(f"--fp4-format {fp4_format} --fp4-recipe {fp4_recipe}: aceso prices e2m1 nvfp4 only")
        return "nvfp4"
    if not fp8_format:
        return None
    if fp8_format not in ("hybrid", "e4m3"):
        raise ValueError(f"--fp8-format {fp8_format}: Megatron-LM accepts hybrid or e4m3")
    name = {"delayed": "fp8-delayed", "tensorwise": "fp8-tensorwise", "blockwise": "fp8-blockwise",
            "mxfp8": "mxfp8"}.get(fp8_recipe or "delayed")
    if name is None:
        raise ValueError(f"--fp8-recipe {fp8_recipe}: aceso prices delayed, tensorwise, blockwise and mxfp8")
    return name


def plain_dtype(gpu) -> str:
    """The half precision ``gpu`` trains in: bf16 where it has bf16 tensor cores (A100 and newer), else fp16."""
    return "bf16" if gpu.peak_tflops("bf16") else "fp16"


def check(precision: str, gpu, param_gather: bool = False, start: int = 0, end: int = 0,
          num_layers: int = 0) -> str | None:
    """Why a precision cannot run on ``gpu`` (one line naming the precision and what the GPU runs), or None. The
    fix names the dtype, not a flag: ``aceso search`` spells it --precision, a Megatron-LM script --fp16."""
    r = RECIPES[precision]
    if r.gemm is not None and gpu.peak_tflops(r.gemm) is None:
        return (f"precision {precision}: the {gpu.name} has no {r.gemm.upper()} tensor cores (H100/H200 have "
                f"FP8, B200/B300/GB200/GB300 FP8 and FP4); train in {plain_dtype(gpu)}")
    base = base_dtype(precision)
    if gpu.peak_tflops(base) is None:
        return (f"precision {precision}: the {gpu.name} has no {base} tensor cores (bf16 needs an A100 or newer); "
                f"train in {plain_dtype(gpu)}")
    if r.gemm is None:
        if param_gather or start or end:
            return (f"precision {precision}: fp8_param_gather and bf16 first/last layers need a low-precision "
                    "recipe (fp8-tensorwise, mxfp8, ...)")
        return None
    if precision == "mxfp8" and gpu.name in ("h100", "h200"):
        return f"precision mxfp8: Blackwell only (transformer-engine); the {gpu.name} runs fp8-blockwise"
    if precision == "fp8-delayed" and (start or end):
        return "precision fp8-delayed: megatron-core keeps no first/last layers in bf16 with delayed scaling"
    if start < 0 or end < 0 or start + end > num_layers:
        return f"bf16 first/last layers ({start} + {end}) must be between 0 and the {num_layers} layers"
    return None


def check_bf16_layers(precision: str, start: int, end: int, num_layers: int, pp: int) -> str | None:
    """megatron-core's bound on the bf16 first / last layers (core_v0.16.1 ``TransformerConfig.__post_init__``,
    under ``if self.fp8``): each of ``num_layers_at_start_in_bf16`` and ``num_layers_at_end_in_bf16`` must be
    between 0 and ``num_layers // pipeline_model_parallel_size``; with an FP4 recipe megatron-core checks nothing
    more (``check``'s own bound, start + end <= num_layers, applies). One line naming the field, or None."""
    if RECIPES[precision].gemm != "fp8" or pp < 1:
        return None
    cap = num_layers // pp
    for field, n in (("bf16_layers_start", start), ("bf16_layers_end", end)):
        if n > cap:
            return (f"settings.low_precision.{field} ({n}): megatron-core keeps at most num_layers // pp = "
                    f"{num_layers} // {pp} = {cap} layers in bf16 at each end (TransformerConfig: "
                    f"num_layers_at_{field.split('_')[-1]}_in_bf16 must be between 0 and the layers per pipeline "
                    f"stage); lower it to {cap} or use fewer pipeline stages")
    return None


class LowPrecision(BaseModel):
    """A plan's low-precision recipe (``PlanSettings.low_precision``): what the prediction assumed and what the
    exported flags run."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    recipe: Literal["fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"] = Field(
        description="The recipe (search/settings/precision.py): the linear layers' GEMMs in FP8 / FP4.")
    param_gather: bool = Field(False, description="Parameters stored quantized (--fp8-param-gather).")
    bf16_layers_start: int = Field(0, ge=0, description="First layers kept in bf16 (--num-layers-at-start-in-bf16).")
    bf16_layers_end: int = Field(0, ge=0, description="Last layers kept in bf16 (--num-layers-at-end-in-bf16).")
    reuse_grad_buf: bool = Field(False, description="MXFP8 parameters all-gathered through the gradient buffer "
                                 "(--reuse-grad-buf-for-mxfp8-param-ag; Megatron-Bridge requires it with mxfp8 "
                                 "and param_gather). Priced the same either way (search/settings/precision.py).")
    per_module: PerModule = Field((), description="Per-module overrides (--te-precision-config-"
                                                      "file; search/settings/precision_overrides.py): ordered glob "
                                                      "matchers, the first match wins; empty = the recipe throughout.")

    @model_validator(mode="after")
    def _reuse(self) -> "LowPrecision":
        why = reuse_grad_buf_check(self.recipe, self.param_gather, self.reuse_grad_buf)
        if why:
            raise ValueError(why)
        return self

    @model_serializer(mode="wrap")
    def _plain_form(self, handler):
        """Without overrides the record is written as before the field existed (plans and digests unchanged)."""
        out = handler(self)
        if isinstance(out, dict) and not out.get("per_module", 1):
            out.pop("per_module")
        return out


def of_training(training) -> LowPrecision | None:
    """The ``LowPrecision`` of a ``TrainingSpec`` (None: a plain dtype)."""
    if not is_low(training.precision):
        return None
    reuse = training.precision == "mxfp8" and training.fp8_param_gather and not training.megatron_fsdp
    return LowPrecision(recipe=training.precision, param_gather=training.fp8_param_gather,
                        bf16_layers_start=training.bf16_layers_start, bf16_layers_end=training.bf16_layers_end,
                        reuse_grad_buf=reuse, per_module=training.per_module)


def training_fields(low: LowPrecision | None, dtype: str) -> dict:
    """``TrainingSpec`` fields of a plan: its recipe, else its parameter dtype."""
    if low is None:
        return {"precision": dtype}
    out = {"precision": low.recipe, "fp8_param_gather": low.param_gather,
           "bf16_layers_start": low.bf16_layers_start, "bf16_layers_end": low.bf16_layers_end}
    return {**out, "per_module": low.per_module} if low.per_module else out
