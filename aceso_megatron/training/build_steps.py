"""The runtime's build steps (torchtitan's ``parallelize_*``): ``engine.build_runtime`` calls them in order, each
one responsibility and one log line on rank 0 (``log_step``), so a reader sees the build order in one place and a
user sees it in the log (``aceso train`` prints the lines: ``show_build_steps``)::

    [build] check: tiny-gpt, 2 stage(s) on 4 cpu process(es), ...
    [build] patches: cpu_mode, dist_opt_torch_adam
    [build] groups: pp 2 stage(s), tp 2|1, dp 1|2
    ...

A feature that is off is a step that says so ("patches: none", "overlapped: nothing"), not an ``if`` inside
another step. What the run refuses is the one pre-flight's (``search.targets.preflight``, ``aceso_megatron.preflight``,
``engine.check_plan``), never a step's.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from search.spec.plan import ParallelPlan
from search.costmodel.plan_view import run_settings

from ..model.fast_path import Environment, FastPath, choose
from ..parallel.layout import Groups, RankLayout, build_groups, embedding_stages
from . import fsdp

if TYPE_CHECKING:
    from .engine import Runtime, TrainConfig

log = logging.getLogger(__name__)


def log_step(step: str, text: str) -> None:
    """A build step's one line, from rank 0 only (``aceso train`` prints them: ``show_build_steps``)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("%s: %s", step, text)


def show_build_steps(stream=None) -> None:
    """Print the build steps' lines (``[build] groups: ...``) on ``stream`` (stdout): ``aceso train``'s console."""
    if any(getattr(h, "_aceso_build", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter(" [build] %(message)s"))
    handler._aceso_build = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False      # printed once, whatever the root logger does


def checked_text(plan: ParallelPlan, device: str) -> str:
    """The ``check`` step's line (``engine.check_plan`` passed)."""
    return (f"{plan.model.name}, {plan.num_stages} stage(s) on {plan.world_size} {device} process(es), global batch "
            f"{plan.global_batch_size} = {plan.num_micro_batches} micro-batch(es) of {plan.micro_batch_size}: the "
            "plan is valid and nothing in it is refused here")


def _per_stage(plan: ParallelPlan, value) -> str:
    """``value(stage)`` of every stage, ``|``-separated: ``tp 2|1``."""
    return "|".join(str(value(st)) for st in plan.stages)


def _patches_for(plan: ParallelPlan, device: str) -> list[str]:
    """The patches (modules of ``patches/``, docs/patches.md) ``plan`` needs on ``device``, in the order they are
    applied."""
    m = plan.model
    return [name for name, wanted in (
        ("cpu_mode", device == "cpu"),
        ("moe_router_without_te", m.moe is not None),
        ("expert_bias_out_of_place", m.moe is not None and m.add_bias_linear),   # GPT-OSS's biased experts
        ("mla_mtp_tp_group", m.mla is not None or bool(m.mtp_num_layers)),   # MLA / MTP mappings on the stage's TP
        ("mla_without_te", m.mla is not None or bool(m.mtp_num_layers)),
        ("qkv_gather_tp_group", m.mla is None and any(st.tp > m.groups for st in plan.stages)),   # tp > groups
        ("mamba_cpu", m.mamba is not None),     # megatron-core's MambaMixer on torch kernels without mamba-ssm
        ("gdn_cpu", m.gdn is not None),         # megatron-core's GatedDeltaNet on torch kernels without fla
        ("fsdp_cpu", plan.megatron_fsdp is not None and device == "cpu"),
        ("dist_opt_torch_adam", plan.distributed_optimizer or plan.megatron_fsdp is not None),
        # each embedding copy in a DDP bucket of its own (a no-op on a rank whose buffers hold no copy)
        ("shared_embedding_bucket", len(embedding_stages(plan)) > 1 and not plan.distributed_optimizer),
    ) if wanted]


def apply_patches(plan: ParallelPlan, device: str) -> list[str]:
    """Apply what ``plan`` needs of ``patches/`` (each idempotent; one that says it is not ``needed()`` on this
    megatron-core is skipped); returns the names applied."""
    applied = []
    for name in _patches_for(plan, device):
        patch = importlib.import_module(f"patches.{name}")
        if getattr(patch, "needed", lambda: True)():
            patch.apply()
        if patch.is_applied():
            applied.append(name)
    log_step("patches", ", ".join(applied) or "none")
    return applied


def choose_fast_paths(plan: ParallelPlan, env: Environment, device: str, fast: FastPath | None) -> FastPath:
    """The layer specs, dtype and fusions this machine runs the plan with (``fast_path.choose``, unless given), and
    the model's layer specs and megatron block checked with them (``check_model``), before any process group."""
    from ..model.layers import check_model

    fast = fast or choose(env, plan.model, plan.tp_comm_overlap)
    check_model(plan, device, fast)
    fused = [k for k, on in fast.config.items() if on]
    notes = f" ({'; '.join(fast.notes)})" if fast.notes else ""
    log_step("fast paths", f"{fast.spec} layer specs, {fast.dtype}, fused: {', '.join(fused) or 'nothing'}{notes}")
    return fast


@dataclass(frozen=True)
class Precision:
    """The run's dtypes: the chunks' parameters (the fast path's), the DP gradient reduction (as the plan was
    priced: ``search.costmodel.plan_view.run_settings``) and the low-precision recipe of the linear layers, if any."""

    params: str                 # fp32 | bf16 | fp16
    grad_reduce_in_fp32: bool
    recipe: str | None = None   # settings.low_precision's (FP8 / FP4 GEMMs in transformer-engine)


def choose_precision(plan: ParallelPlan, fast: FastPath) -> Precision:
    """The run's ``Precision``: what the chunks' configs, DDP's reduction and the optimizer are built with."""
    low = plan.settings.low_precision if plan.settings is not None else None
    p = Precision(fast.dtype, run_settings(plan.settings, fast.dtype).grad_reduce_in_fp32,
                  low.recipe if low is not None else None)
    main = ", fp32 main weights in the optimizer" if p.params != "fp32" else ""
    log_step("precision", f"{p.params} parameters, gradients reduced in {'fp32' if p.grad_reduce_in_fp32 else p.params}"
                          f"{main}, low-precision recipe: {p.recipe or 'none'}")
    return p


def build_process_groups(plan: ParallelPlan, rank: int, fast: FastPath) -> Groups:
    """Every stage's process groups (``layout.build_groups``; every rank creates every group in the same order), the
    attention core's scratch buffer and, with TP overlap, transformer-engine's userbuffers."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # scratch buffer of the attention core (no groups)
        parallel_state._set_global_memory_buffer()
    groups = build_groups(plan, rank)
    if fast.config["tp_comm_overlap"]:
        _initialize_userbuffers(plan, groups.layout, fast)
    text = f"pp {plan.num_stages} stage(s), tp {_per_stage(plan, lambda s: s.tp)}"
    if any(s.cp > 1 for s in plan.stages):
        text += f", cp {_per_stage(plan, lambda s: s.cp)}"
    text += f", dp {_per_stage(plan, lambda s: s.dp)}"
    if any(s.sequence_parallel for s in plan.stages):
        text += f", sp {_per_stage(plan, lambda s: 'on' if s.sequence_parallel and s.tp > 1 else 'off')}"
    if plan.model.moe is not None:
        text += (f", ep {_per_stage(plan, lambda s: s.ep)}, etp {_per_stage(plan, lambda s: s.etp or s.tp)}")
    if len(emb := embedding_stages(plan)) > 1:
        text += f", embedding copies on stages {', '.join(map(str, emb))}"
    log_step("groups", text + (", TP overlap userbuffers" if fast.config["tp_comm_overlap"] else ""))
    return groups


def build_chunks(plan: ParallelPlan, groups: Groups, device: str, fast: FastPath, tc: TrainConfig,
                 seed: int) -> list:
    """This rank's model chunks (``stage_model.build_stage``, ``v`` of them for an interleaved plan) with plan-
    independent weights (``init``), expert and embedding-copy flags, on the device."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ..model.config import interleaving
    from ..model.init import initialize
    from ..model.moe import mark_expert_params
    from ..model.stage_model import build_stage
    from ..parallel.grads import mark_embedding_copies

    lay = groups.layout
    # dropout RNG seeded as Megatron-LM does: seed + 100 * stage for the default generator (hidden dropout: equal
    # within a stage's TP group, different between stages), the rng tracker's TP state differing by TP rank on top
    model_parallel_cuda_manual_seed(seed + 100 * lay.stage, tp_rank=lay.tp_rank, ep_rank=0, etp_rank=0)
    v = plan.num_virtual_stages
    chunks = [build_stage(plan, lay.stage, groups.pg_collection, device, j, fast, tc.calculate_per_token_loss)
              for j in range(v)]
    std = tc.std_for(plan.model)
    for c in chunks:
        c.config.init_method_std = std
        initialize(c, c.canonical_names(), plan.model, seed, lay.tp, lay.tp_rank, std, (lay.etp, lay.etp_rank))
        mark_expert_params(c)
        if device != "cpu":
            c.cuda(torch.cuda.current_device())
    interleaving(chunks[0].config, plan.num_stages, v)
    mark_embedding_copies(chunks, plan)
    spans = _per_stage(plan, lambda s: "+".join(c.holds_only or f"{c.start_unit}-{c.end_unit}" for c in s.chunks))
    log_step("chunks", f"{v} per stage, units {spans}, initialised with std {std:g} (seed {seed}), dropout seeded "
                       f"{seed} + 100 x stage")
    return chunks


def _dp_text(plan: ParallelPlan) -> str:
    """Each stage's DP group (DP x CP where context parallelism is on)."""
    cp = any(s.cp > 1 for s in plan.stages)
    return (f"dp x cp {_per_stage(plan, lambda s: s.dp * s.cp)}" if cp else f"dp {_per_stage(plan, lambda s: s.dp)}")


def wrap_chunks(plan: ParallelPlan, chunks: list, groups: Groups, device: str, ddp_config) -> list:
    """Each chunk in megatron-core's DDP on the stage's DP (x CP) group -- bucketed and overlapped as the plan asks,
    buckets for the first chunk only, as Megatron-LM -- or, for a Megatron FSDP plan (one chunk), in megatron-core's
    ``FullyShardedDataParallel``; built summing (``_summing``: the loss scale divides)."""
    from patches.compat import quiet_ddp_layout_notice

    from .teardown import ReleasableDDP   # megatron-core's DDP, its gradient hooks removable at the end (teardown)

    with _summing([c.config for c in chunks]):
        if plan.megatron_fsdp is not None:   # one chunk (search.settings.fsdp.structural_refusal)
            where = "cpu" if device == "cpu" else f"cuda:{torch.cuda.current_device()}"
            models = [fsdp.wrap(c, copy.copy(ddp_config), groups, where) for c in chunks]
        else:
            quiet_ddp_layout_notice()
            models = [ReleasableDDP(c.config, copy.copy(ddp_config), c, pg_collection=groups.pg_collection,
                                     disable_bucketing=j > 0)  # as Megatron-LM: buckets for the first chunk
                      for j, c in enumerate(chunks)]
    if plan.megatron_fsdp is not None:
        how = f"Megatron FSDP ({plan.megatron_fsdp.data_parallel_sharding_strategy})"
    else:
        how = "megatron-core DDP" + (" (first chunk bucketed)" if len(chunks) > 1 else "")
    bucket = f"{ddp_config.bucket_size} parameters" if ddp_config.bucket_size else "megatron-core's default"
    overlaps = [n for n, on in (("grad reduce", plan.overlap_grad_reduce), ("param gather", plan.overlap_param_gather))
                if on]
    log_step("wrap", f"{how} per chunk over {_dp_text(plan)}, summing gradients, buckets of {bucket}, "
                     f"overlapped: {', '.join(overlaps) or 'nothing'}")
    return models


def build_optimizer(plan: ParallelPlan, tc: TrainConfig, config, models, groups: Groups):
    """megatron-core's Adam over the wrapped chunks (``get_megatron_optimizer``), distributed when the plan asks (or
    Megatron FSDP's); the distributed optimizer clips itself (norm over the world of shards), the runtime clips
    the others (``Runtime.train_step``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dist_opt = plan.distributed_optimizer or plan.megatron_fsdp is not None
    opt_config = OptimizerConfig(  # distributed optimizer: megatron-core clips (norm over the world of shards)
        optimizer="adam", lr=tc.lr, weight_decay=tc.weight_decay, adam_beta1=tc.adam_beta1,
        adam_beta2=tc.adam_beta2, clip_grad=tc.clip_grad if dist_opt else 0.0,
        params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
        use_distributed_optimizer=dist_opt, overlap_param_gather=plan.overlap_param_gather,
    )
    optimizer = get_megatron_optimizer(opt_config, models, use_gloo_process_groups=False,
                                       pg_collection=groups.pg_collection)
    kind = f"distributed Adam over {_dp_text(plan)}" if dist_opt else "Adam"
    clip = "by megatron-core" if dist_opt else "by the runtime, over all stages"
    log_step("optimizer", f"{kind} (megatron-core), lr {tc.lr:g}, weight decay {tc.weight_decay:g}, betas "
                          f"{tc.adam_beta1:g}/{tc.adam_beta2:g}, clipped at {tc.clip_grad:g} {clip}")
    return optimizer


def connect_schedule(rt: Runtime) -> Runtime:
    """What megatron-core's schedule calls: the stage-to-stage communicator (``PlanCommunicator``), the gradient
    finalisation (DP, embedding copies, SP), the loss scale and, with overlapped reduction, each chunk's
    ``no_sync``."""
    from ..parallel.grads import embedding_bucket_groups, finalize_model_grads_fn
    from ..parallel.p2p import PlanCommunicator

    plan, models = rt.plan, rt.models
    config = rt.chunks[0].config
    rt.communicator = PlanCommunicator(plan, rt.layout.rank, config, rt.device)
    if plan.overlap_grad_reduce and rt.groups.embedding is not None:
        rt.held_bucket_groups = embedding_bucket_groups(rt)
    config.finalize_model_grads_func = finalize_model_grads_fn(rt)
    config.grad_scale_func = rt.loss_scale
    v = plan.num_virtual_stages
    if plan.overlap_grad_reduce:  # reduce each chunk's buckets during its last micro-batch's backward
        config.no_sync_func = [m.no_sync for m in models] if v > 1 else models[0].no_sync
    S = plan.num_stages
    name = "no pipelining" if S == 1 else (f"interleaved 1F1B ({v} chunks per stage)" if v > 1 else "1F1B")
    scale = ("1 / the global batch's tokens" if rt.train_config.calculate_per_token_loss
             else "1 / (the stage's dp x cp)")
    log_step("schedule", f"megatron-core's {name} over {S} stage(s), {plan.num_micro_batches} micro-batch(es), "
                         f"stage-to-stage by PlanCommunicator, loss scale {scale}")
    return rt


@contextlib.contextmanager
def _summing(configs):
    """megatron-core's DDP and FSDP pick their gradient scaling from ``calculate_per_token_loss`` when built: build
    them as for per-token loss (a sum over the DP group, scale 1) and give the configs back the run's setting,
    which the schedule, the MTP loss and the routers read (module docstring)."""
    kept = [c.calculate_per_token_loss for c in configs]
    for c in configs:
        c.calculate_per_token_loss = True
    try:
        yield
    finally:
        for c, k in zip(configs, kept):
            c.calculate_per_token_loss = k


def _initialize_userbuffers(plan: ParallelPlan, lay: RankLayout, fast: FastPath) -> None:
    """transformer-engine's TP-overlap buffers (Megatron-LM's ``_initialize_tp_communicators``): one shape for the
    world, ``[seq * per-rank micro-batch / cp, hidden]`` (``fast_path.refusal`` checked that every stage agrees)."""
    from transformer_engine.pytorch import module as te_module

    shape = [plan.model.seq_length * plan.micro_batch_per_rank(lay.stage) // lay.cp, plan.model.hidden_size]
    te_module.base.initialize_ub(shape=shape, tp_size=lay.tp, use_fp8=False, ub_cfgs={}, bootstrap_backend="nccl")
