"""Training settings that shape the cost and the search space: batch sizes, precision, optimizer, and which of
megatron-core's parallel features the search may use.

``micro_batch_sizes`` are *per-rank* micro-batch candidates (Megatron-LM's ``--micro-batch-size``): a stage with DP
``d`` then runs pipeline micro-batches of ``b * d`` samples (``ParallelPlan.micro_batch_size``), so data
parallelism is limited only by the GPUs and the global batch. A feature switch set to ``None`` lets the search
decide; ``True``/``False`` fixes it for every plan the search considers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from search.settings.precision import base_dtype, is_low
from search.settings.precision_overrides import PerModule

# Upper bounds (docs/inputs.md): far above any published run (global batches of a few thousand sequences, per-rank
# micro-batches of 1-16, cp up to 32), low enough that a typo such as 10^30 is refused.
MAX_BATCH = 1 << 24
MAX_CP = 1024
MAX_VIRTUAL = 512
MAX_CANDIDATES = 64


class TrainingSpec(BaseModel):
    """What the search plans for."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    global_batch_size: int = Field(gt=0, le=MAX_BATCH, description="Samples per optimizer step.")
    micro_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8], min_length=1, max_length=MAX_CANDIDATES,
        description="Candidate per-rank micro-batch sizes (Megatron-LM's --micro-batch-size; a stage with DP d "
                    "runs pipeline micro-batches of size * d samples).",
    )
    precision: Literal["bf16", "fp16", "fp32", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"] = \
        Field("bf16", description="Compute and parameter dtype, or a low-precision recipe (search/settings/precision.py: "
              "the linear layers' GEMMs in FP8/FP4, the rest bf16).")
    fp8_param_gather: bool = Field(False, description="Low precision: parameters stored quantized, no bf16 copy, "
                                   "quantized all-gather (Megatron-LM --fp8-param-gather / --fp4-param-gather).")
    bf16_layers_start: int = Field(0, ge=0, le=1 << 16, description="Low precision: first transformer layers kept "
                                   "in bf16 (--first-last-layers-bf16 --num-layers-at-start-in-bf16).")
    bf16_layers_end: int = Field(0, ge=0, le=1 << 16, description="Low precision: last transformer layers kept in "
                                 "bf16 (--num-layers-at-end-in-bf16).")
    per_module: PerModule = Field((), description="Low precision: per-module overrides "
                                                      "(--te-precision-config-file; search/settings/"
                                                      "precision_overrides.py); empty = the recipe throughout.")
    optimizer: Literal["adam", "muon", "dist_muon"] = Field(
        "adam", description="Optimizer: adam (fp32 master weights, m and v), muon (Muon's momentum on the 2-D "
        "weights, Adam on the rest) or dist_muon (Muon sharded layer-wise over DP; search/costmodel/optimizers.py).")
    attention: Literal["auto", "flash", "unfused"] = Field(
        "auto", description="Attention kernel the analytic model assumes: flash (transformer-engine's fused attention "
        "in the runtime), unfused (megatron-core's local attention: s^2 activations, no transformer-engine), or auto "
        "(flash on GPUs that have it: A100, H100, H200, B200).")
    # ----- parallel features the search may use (None: searched) --------------------------------------------------
    distributed_optimizer: bool | None = Field(None, description="Shard optimizer states over each stage's DP "
                                               "group; None = the search decides.")
    sequence_parallel: bool | None = Field(None, description="Sequence parallelism on stages with tp > 1; None = "
                                           "the search decides per stage.")
    overlap_grad_reduce: bool | None = Field(None, description="Overlap the DP gradient reduction with backward; "
                                             "None = the search decides.")
    overlap_param_gather: bool | None = Field(None, description="Overlap the distributed optimizer's parameter "
                                              "all-gather with forward; None = the search decides.")
    megatron_fsdp: bool | None = Field(None, description="Megatron FSDP (--target megatron-lm; strategies "
                                       "optim_grads_params and optim_grads); None = the search decides.")
    activation_offload: bool | None = Field(None, description="CPU activation offload of the first layers "
                                            "(--target megatron-lm, one stage, no recompute); None = the search "
                                            "decides where nothing else fits without recompute.")
    tp_comm_overlap: bool = Field(False, description="Transformer-engine TP communication overlap (GPU with "
                                  "transformer-engine only): off unless asked for.")
    context_parallel_sizes: list[int] = Field(default_factory=lambda: [1], min_length=1, max_length=MAX_CANDIDATES,
                                              description="Candidate context-parallel degrees.")
    uniform_cp: bool = Field(True, description="Keep cp equal across stages (False: each stage may differ).")
    virtual_stages: list[int] | None = Field(
        default_factory=lambda: [1, 2], min_length=1, max_length=MAX_CANDIDATES,
        description="Candidate model chunks per stage (interleaved 1F1B; 1 = off); None = every degree Megatron-LM "
                    "accepts (search.planner.space.virtual_degrees).")

    tensor_parallel_sizes: list[int] | None = Field(None, min_length=1, max_length=MAX_CANDIDATES,
                                                    description="Allowed tp degrees (None: every power of two "
                                                    "that divides the heads, query groups and FFN within a node).")
    pipeline_parallel_sizes: list[int] | None = Field(None, min_length=1, max_length=MAX_CANDIDATES,
                                                      description="Allowed numbers of pipeline stages (None: all).")
    # ----- MoE models: the expert shapes and dispatchers the search may use (search/planner/constraints.py) ------
    expert_parallel_sizes: list[int] | None = Field(None, min_length=1, max_length=MAX_CANDIDATES,
                                                    description="Allowed expert-parallel degrees (None: every divisor "
                                                    "of num_experts that divides a stage's GPUs over its etp).")
    max_expert_parallel: int | None = Field(None, ge=1, le=MAX_BATCH, description="The largest expert-parallel "
                                            "degree allowed (None: no bound).")
    expert_tensor_parallel_sizes: list[int] | None = Field(None, min_length=1, max_length=MAX_CANDIDATES,
                                                           description="Allowed expert tensor-parallel degrees, "
                                                           "each 1 or a stage's tp (None: both).")
    token_dispatchers: list[Literal["alltoall", "allgather", "flex"]] | None = Field(
        None, min_length=1, max_length=3, description="Token dispatchers the search may use, the first the one it "
        "searches under (None: alltoall, then allgather and, on GPUs, flex: DeepEP / HybridEP).")
    moe_router_dtype: Literal["fp32", "fp64"] | None = Field(
        None, description="The MoE router's dtype every plan runs (moe_router_dtype, Megatron-LM --moe-router-dtype; "
        "numerics, not searched; None: the model's).")
    moe_hybridep_num_sms: Literal[16, 32] | None = Field(
        None, description="SMs of HybridEP's kernels in every plan that dispatches with HybridEP "
        "(moe_hybridep_num_sms, Megatron-LM --moe-hybridep-num-sms: a tuning the search keeps, not searched; None: "
        "the release's default).")

    @property
    def dtype(self) -> str:
        """The dtype of parameters, activations and the unquantized kernels (bf16 under a low-precision recipe)."""
        return base_dtype(self.precision)

    @model_validator(mode="after")
    def _check(self) -> "TrainingSpec":
        for name, top in (("micro_batch_sizes", MAX_BATCH), ("context_parallel_sizes", MAX_CP),
                          ("virtual_stages", MAX_VIRTUAL), ("tensor_parallel_sizes", MAX_BATCH),
                          ("pipeline_parallel_sizes", MAX_BATCH), ("expert_parallel_sizes", MAX_BATCH),
                          ("expert_tensor_parallel_sizes", MAX_BATCH)):
            for m in getattr(self, name) or ():
                if not 1 <= m <= top:
                    raise ValueError(f"{name}: {m} is not an integer in [1, {top}]")
        usable = [m for m in self.micro_batch_sizes if self.global_batch_size % m == 0]
        if not usable:
            raise ValueError(
                f"micro_batch_sizes: none of {self.micro_batch_sizes} divides global_batch_size "
                f"({self.global_batch_size}); add a divisor"
            )
        if not is_low(self.precision) and (self.fp8_param_gather or self.bf16_layers_start or self.bf16_layers_end
                                           or self.per_module):
            raise ValueError(f"fp8_param_gather / bf16_layers_* / per_module: precision {self.precision} quantizes nothing; "
                             "give a low-precision recipe (fp8-tensorwise, mxfp8, ...) or drop them")
        if self.fp8_param_gather and self.distributed_optimizer is False and not self.megatron_fsdp:
            raise ValueError("fp8_param_gather needs the distributed optimizer or Megatron FSDP (Megatron-LM asserts "
                             "it); do not turn both off")
        if self.overlap_param_gather and self.distributed_optimizer is False:
            raise ValueError("overlap_param_gather needs the distributed optimizer; do not turn it off")
        return self
