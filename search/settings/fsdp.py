"""Megatron FSDP and activation offload: the plan's schema fields and the constraints Megatron-LM puts on them.

Two plan-level fields (``ParallelPlan.megatron_fsdp``, ``ParallelPlan.activation_offload``); a plan without them
(every plan written before them) runs megatron-core's DDP / distributed optimizer and keeps its activations on the
GPU, as before.

**Megatron FSDP** (megatron-core 0.16.1 ``distributed/fsdp/``; Megatron-LM ``--use-megatron-fsdp``
``--data-parallel-sharding-strategy S``): the model states are sharded over each stage's DP x CP group
(``dp_cp_group``) as the strategy says (``param_and_grad_buffer.py``, ``_init_each_parameter_group_buffers``):

    no_shard              nothing sharded (DDP)
    optim                 fp32 main weights and Adam m, v sharded                      (ZeRO-1)
    optim_grads           + the gradient buffer sharded; gradients reduce-scattered after every backward (ZeRO-2)
    optim_grads_params    + the bf16 weights sharded; every TransformerLayer (``fsdp_unit_modules``) all-gathers
                          its weights before its forward and again before its backward          (ZeRO-3)

Constraints (Megatron-LM core_v0.16.1 ``arguments.py`` ``validate_args`` and megatron-core 0.16.1), one line each:
- one pipeline stage with one chunk (megatron-core builds the FSDP mesh from the whole world: ``pipeline_refusal``);
- ``optim_grads`` / ``optim_grads_params`` over at least 2 ranks of DP x CP (and of expert-DP with experts):
  megatron-core counts every gradient twice over a group of one (``one_rank_group``);
- ``--ckpt-format fsdp_dtensor`` is required ("Megatron FSDP only supports fsdp_dtensor checkpoint format"); the
  export writes it, the import refuses another format;
- ``--overlap-param-gather`` needs ``--use-distributed-optimizer`` or ``--use-megatron-fsdp``, and
  ``--overlap-grad-reduce``;
- ``CUDA_DEVICE_MAX_CONNECTIONS`` must not be 1 (asserted); the exported script leaves it unset with FSDP;
- not with ``--use-torch-fsdp2`` (refused by the importer), hybrid context parallelism (refused) or the Muon optimizer
  (aceso prices Adam only);
- the strategy decides the sharding on its own: ``--use-distributed-optimizer`` may be given with it (Megatron-LM's
  functional tests do) and changes no price.

**Activation offload** (``--cpu-offloading-num-layers N``: Megatron-LM sets ``cpu_offloading`` when N > 0;
transformer-engine's ``get_cpu_offload_context``): the activations of N transformer layers go to host memory after
their forward and come back before their backward. megatron-core 0.16.1 ``TransformerConfig.__post_init__``:
- ``0 < N < num_layers`` ("CPU offloading can be done only for layers less than num_layers");
- no pipeline parallelism ("no support for Pipeline parallelism with CPU offloading"): one stage, one chunk;
- no activation recompute ("CPU offloading does not work when activation recomputation is enabled");
- not with CUDA graphs nor ``--fine-grained-activation-offloading`` (neither is exported; the latter is refused by
  the importer).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from search.settings.moe_plan import expert_tp

ShardingStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
MainDtype = Literal["fp32", "bf16", "fp16"]
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
STRATEGIES: tuple[str, ...] = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MAX_OFFLOAD_LAYERS = 1 << 16


class MegatronFSDP(BaseModel):
    """Megatron FSDP instead of DDP (megatron-core ``use_megatron_fsdp``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    data_parallel_sharding_strategy: ShardingStrategy = Field(
        "optim_grads_params", description="What is sharded over each stage's DP x CP group: no_shard (nothing), "
        "optim (fp32 main weights, Adam m and v), optim_grads (+ gradients, reduce-scattered every backward), "
        "optim_grads_params (+ weights, all-gathered per layer in forward and backward).")
    main_params_dtype: MainDtype | None = Field(None, description="megatron-core 0.19: the dtype of FSDP's main "
                                                "(optimizer) weights (--megatron-fsdp-main-params-dtype); None: "
                                                "fp32.")
    main_grads_dtype: MainDtype | None = Field(None, description="megatron-core 0.19: the dtype of FSDP's main "
                                               "gradient buffer and its reduce-scatter (--megatron-fsdp-main-grads-"
                                               "dtype); None (auto): the gradient-reduction dtype.")


class ActivationOffload(BaseModel):
    """CPU activation offload (megatron-core ``cpu_offloading``, Megatron-LM ``--cpu-offloading-num-layers``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_layers: int = Field(gt=0, le=MAX_OFFLOAD_LAYERS, description="Transformer layers whose activations go to "
                            "host memory after their forward and come back before their backward "
                            "(megatron-core cpu_offloading_num_layers; fewer than the model's layers).")


def shards(strategy: str | None) -> tuple[bool, bool, bool]:
    """(weights, gradients, optimizer states) sharded over the DP x CP group under ``strategy`` (None: no FSDP)."""
    i = STRATEGIES.index(strategy) if strategy else 0
    return i >= 3, i >= 2, i >= 1


def pipeline_refusal(num_stages: int, num_chunks: int) -> str | None:
    """Megatron FSDP across pipeline stages (one line), or None: megatron-core 0.16.1 cannot build it."""
    if num_stages == 1 and num_chunks == 1:
        return None
    return (f"megatron_fsdp with {num_stages} pipeline stages ({num_chunks} chunks each): megatron-core 0.16.1 "
            "builds Megatron FSDP's device mesh from the whole world as (dp_cp ep tp) (_get_dp_tp_mesh: 'Shape "
            "mismatch' when the world also spans pipeline stages), in Megatron-LM too; use one stage or remove "
            "megatron_fsdp")


def one_rank_group(strategy: str, dp: int, cp: int, num_gpus: int, etp: int, ep: int, moe: bool) -> str | None:
    """The group of one rank a gradient-sharding strategy would shard over ("dp x cp", or expert-DP with experts),
    or None: megatron-core 0.16.1 then adds its reduce-scatter output onto the bucket it read, counting every
    gradient twice (tests/distributed/test_fsdp_upstream.py), and such a group shards nothing."""
    if strategy in ("no_shard", "optim"):
        return None
    if dp * cp == 1:
        return "dp x cp"
    return "expert-DP (num_gpus / (etp x ep))" if moe and num_gpus // (etp * ep) == 1 else None


def structural_refusal(plan) -> str | None:
    """What of the plan's Megatron FSDP megatron-core 0.16.1 cannot run, in any framework (one line), or None."""
    f = plan.megatron_fsdp
    if f is None:
        return None
    if (why := pipeline_refusal(plan.num_stages, plan.num_virtual_stages)) is not None:
        return why
    st, strategy = plan.stages[0], f.data_parallel_sharding_strategy
    one = one_rank_group(strategy, st.dp, st.cp, st.num_gpus, expert_tp(st), st.ep, plan.model.moe is not None)
    if one is None:
        return None
    return (f"megatron_fsdp {strategy} with {one} 1: megatron-core 0.16.1 counts every gradient twice on an "
            "unsharded buffer (its reduce-scatter output is added onto the bucket it read) and FSDP over one rank "
            "shards nothing; use more data-parallel ranks or remove megatron_fsdp")


def check_plan(plan) -> None:
    """``ValueError`` (one line, the field and the fix) for what Megatron-LM / megatron-core refuse."""
    if (why := structural_refusal(plan)) is not None:
        raise ValueError(why)
    off = plan.activation_offload
    if off is None:
        return
    layers = len(plan.model.layer_starts) - 1
    if off.num_layers >= layers:
        raise ValueError(f"activation_offload.num_layers ({off.num_layers}) must be below the model's {layers} "
                         "layers (megatron-core offloads fewer layers than num_layers); lower it")
    if plan.num_stages > 1 or plan.num_virtual_stages > 1:
        raise ValueError("activation_offload needs one pipeline stage with one chunk (megatron-core has no CPU "
                         "offloading with pipeline parallelism); remove it or use one stage")
    bad = next(((s, k) for s, _j, ch in plan.chunks_in_order() for k, r in enumerate(ch.recompute) if r != "none"),
               None)
    if bad is not None:
        raise ValueError(f"activation_offload with stages[{bad[0]}].recompute[{bad[1]}] "
                         f"{plan.stages[bad[0]].all_recompute[bad[1]]!r}: megatron-core's CPU offloading does not "
                         "work with activation recompute; set every recompute to none or remove the offload")


def describe(plan) -> str:
    """``megatron-fsdp optim_grads_params, offload 20 layers`` (empty without either)."""
    parts = []
    if plan.megatron_fsdp is not None:
        f = plan.megatron_fsdp
        dtypes = "".join(f" {k} {v}" for k, v in (("main params", f.main_params_dtype),
                                                   ("main grads", f.main_grads_dtype)) if v)
        parts.append(f"megatron-fsdp {f.data_parallel_sharding_strategy}{dtypes}")
    if plan.activation_offload is not None:
        n = plan.activation_offload.num_layers
        parts.append(f"offload {n} layer{'s' if n != 1 else ''}")
    return ", ".join(parts)
