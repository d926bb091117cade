"""Build everything one rank needs from a plan and run training steps: the API the train command uses.

    runtime = build_runtime(plan, rank, world_size, seed=1234)      # after torch.distributed.init_process_group
    loss = runtime.train_step(iter(micro_batches))                  # one optimizer step over the global batch

Order (``build_runtime``): validate the plan, refuse what this environment cannot run and check its model
(``model.layers.check_model``: layer specs, megatron block) -- all before any process group exists --, CPU shims
if on CPU, the fast paths (``model.fast_path``), process groups (``layout.build_groups``), the rank's model chunks (``stage_model``; ``v`` of them for an interleaved plan), plan-independent weights (``init``),
one megatron-core DDP per chunk on the stage's DP (x CP) group -- bucketed and overlapped when the plan asks --,
megatron-core's optimizer (distributed when the plan asks) over the chunks, and the schedule megatron-core's
``get_forward_backward_func`` picks for the pipeline (no pipelining, 1F1B, interleaved 1F1B) with
``PlanCommunicator`` as its ``p2p_communicator``.

A micro-batch is a dict of full pipeline micro-batch tensors, ``{"tokens": [mb, s], "labels": [mb, s]}`` (T5:
``{"enc_tokens": [mb, s_enc], "dec_tokens": [mb, s_dec], "labels": [mb, s_dec]}``), optionally with a
``loss_mask``; every rank is given the same ones and takes its DP replica's samples (and, with context
parallelism, its CP rank's tokens). The reported loss is the mean per-token loss of the global batch (as
Megatron-LM reports ``lm loss``).

Loss normalisation (``TrainConfig.calculate_per_token_loss``), megatron-core's schedule doing what it does in
stock training: the loss function returns the rank's masked sum and token count (Megatron-LM's ``pretrain_gpt``
``loss_func``); by default the schedule divides it by that count and by the number of micro-batches (per
micro-batch of a rank, Megatron-LM's default), the MTP loss by its own count (``mtp.mtp_loss``) and the MoE aux
loss by the micro-batches; with ``calculate_per_token_loss`` it divides nothing and stock megatron-core divides
every gradient by the global batch's token count. Stock DDP then averages over the DP (x CP) group. Here stages
may differ in DP, so DDP always *sums* (``_summing``) and one loss scale (``config.grad_scale_func``, which the
schedule applies to the main, MTP and aux losses alike) does the division: 1 / (the stage's DP x CP) by default
-- the last stage's for the main loss, so every stage's summed gradient is the gradient of the last stage's mean
of per-rank losses, what stock Megatron-LM computes for a uniform plan -- and 1 / the global token count with
``calculate_per_token_loss``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from search.errors import AcesoError
from search.plan import ParallelPlan, parse_plan
from search.plan_settings import run_settings

from ..model.fast_path import Environment, FastPath, choose, refusal
from ..model.moe import refusal as moe_refusal
from ..parallel.layout import Groups, RankLayout, build_groups, sample_range
from ..parallel.shards import cp_token_index
from . import fsdp


@dataclass
class TrainConfig:
    """Optimizer settings of a run."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    init_method_std: float | None = None   # None: the model's megatron.init_method_std, else megatron-core's 0.02
    ddp_bucket_size: int | None = None  # parameters per DDP bucket (overlap_grad_reduce); None: megatron-core's
    calculate_per_token_loss: bool = False  # Megatron-LM's flag: normalise by the global token count (docstring)

    def std_for(self, model) -> float:
        """The initialisation std for ``model``."""
        if self.init_method_std is not None:
            return self.init_method_std
        return float((model.megatron or {}).get("init_method_std", 0.02))


def check_plan(plan: ParallelPlan | dict, world_size: int, env: Environment | None = None) -> ParallelPlan:
    """Validate ``plan`` for ``world_size`` processes and refuse what ``env`` cannot run; one ``AcesoError``
    line naming the stage and field."""
    plan = parse_plan(plan if isinstance(plan, dict) else plan.model_dump(), world_size=world_size)
    if (msg := moe_refusal(env, plan)) is not None:   # never an MoE/MLA/MTP model built as if it were dense
        raise AcesoError(msg)
    if (msg := fsdp.refusal(plan)) is not None:       # never a Megatron FSDP plan run as DDP
        raise AcesoError(msg)
    if env is not None:
        if (msg := refusal(env, plan)) is not None:
            raise AcesoError(msg)
        if env.cuda and plan.model.params_dtype == "fp16":
            raise AcesoError(f"model.params_dtype fp16: the runtime has no fp16 loss scaling yet; use bf16 "
                             f"(model {plan.model.name})")
    return plan


@dataclass
class Runtime:
    plan: ParallelPlan
    layout: RankLayout
    groups: Groups
    chunks: list  # this rank's model chunks (stage_model._Stage), in order
    models: list  # the chunks wrapped in megatron-core DDP
    optimizer: object
    communicator: object
    train_config: TrainConfig
    fast: FastPath
    device: str = "cpu"
    last_grad_norm: float = field(default=0.0)
    loss_denominator: float = field(default=0.0)  # tokens that count in this global batch's loss (0: none yet)
    held_bucket_groups: list = field(default_factory=list)  # see parallel.grads.hold_embedding_buckets
    overlapped_buckets: int = 0  # last step: DDP buckets whose reduction started during backward

    # -- the rank's chunks ------------------------------------------------------------------------------------
    @property
    def stage_module(self):
        """The model chunk of a one-chunk plan (tests and profiles of non-interleaved plans)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank holds {len(self.chunks)} model chunks; use runtime.chunks")
        return self.chunks[0]

    @property
    def model(self):
        if len(self.models) != 1:
            raise ValueError(f"this rank holds {len(self.models)} model chunks; use runtime.models")
        return self.models[0]

    def named_parameters(self):
        """``(local name, parameter)`` of all chunks; local names are ``chunks.<i>.<name in the chunk>``."""
        for i, c in enumerate(self.chunks):
            for n, p in c.named_parameters():
                yield f"chunks.{i}.{n}", p

    def canonical_names(self) -> dict[str, str]:
        """Local name -> name in a single-process megatron-core ``GPTModel``/``T5Model``."""
        return {f"chunks.{i}.{n}": canon for i, c in enumerate(self.chunks) for n, canon in c.canonical_names().items()}

    @property
    def holds_loss(self) -> bool:
        """This rank computes (part of) the loss: the last chunk of the last stage."""
        return self.chunks[-1].post_process

    # -- data -------------------------------------------------------------------------------------------------
    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's samples of a micro-batch tensor and, with context parallelism, its tokens."""
        lo, hi = sample_range(self.plan.micro_batch_size, self.layout.dp, self.layout.dp_rank)
        t = t[lo:hi]
        if self.layout.cp > 1:
            t = t[:, cp_token_index(t.size(1), self.layout.cp, self.layout.cp_rank)]
        return t

    def _global_tokens(self) -> int:
        m = self.plan.model
        return self.plan.global_batch_size * (m.decoder_seq_length if m.is_t5 else m.seq_length)

    def start_global_batch(self, micro_batches) -> Iterator[dict]:
        """Count the global batch's tokens whose ``loss_mask`` is 1 (every token when the batches carry no mask):
        the denominator of ``calculate_per_token_loss`` (``loss_scale``). Every rank gets the full micro-batches,
        so every rank counts the same number without communication (stock megatron-core all-reduces it)."""
        batches = list(micro_batches)
        if batches and "loss_mask" in batches[0]:
            self.loss_denominator = max(1.0, float(sum(float(b["loss_mask"].sum()) for b in batches)))
        else:
            self.loss_denominator = float(self._global_tokens())
        return iter(batches)

    def _forward_step(self, data_iterator, model):
        raw = next(data_iterator)
        if not self.plan.model.is_t5:
            tokens = raw["tokens"]
            raw = {**raw, "position_ids": torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)}
        batch = {k: self._local(v).to(self.device) for k, v in raw.items()}
        mask = batch.get("loss_mask")
        if self.plan.model.is_t5:
            out = model(enc_ids=batch["enc_tokens"], dec_ids=batch["dec_tokens"], labels=batch["labels"])
        else:   # an MTP chunk weighs its MTP loss by the main loss's mask
            extra = {"loss_mask": mask} if self.plan.model.mtp_num_layers else {}
            out = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                        **extra)

        def loss_func(per_token: torch.Tensor):
            """Megatron-LM's ``pretrain_gpt.loss_func``: the masked sum and the token count (the schedule
            normalises, module docstring), and both for the report."""
            if mask is not None:
                per_token = per_token * mask.to(per_token.dtype)
            loss = per_token.float().sum()
            count = mask.sum().to(torch.int) if mask is not None else torch.tensor(per_token.numel(), dtype=torch.int)
            return loss, count, {"sum": loss.detach().clone(), "count": int(count)}

        return out, loss_func

    def loss_scale(self, t: torch.Tensor) -> torch.Tensor:
        """``config.grad_scale_func``: what the schedule multiplies every loss of this rank by before the backward
        (module docstring)."""
        if self.train_config.calculate_per_token_loss:
            return t / max(1.0, self.loss_denominator)
        return t / (self.layout.dp * self.layout.cp)

    # -- step -------------------------------------------------------------------------------------------------
    def run_schedule(self, micro_batches, forward_only: bool = False) -> float:
        """megatron-core's schedule over one global batch (forward and backward, gradients finalised, or forward
        only); returns the mean per-token loss (collective)."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        S, v = self.plan.num_stages, self.plan.num_virtual_stages
        batches = list(self.start_global_batch(micro_batches))
        schedule = get_forward_backward_func(pp_size=S, vp_size=v if v > 1 else None)
        store = schedule(
            forward_step_func=self._forward_step,
            data_iterator=[iter(batches) for _ in self.models] if v > 1 else iter(batches),
            model=self.models, num_microbatches=self.plan.num_micro_batches, seq_length=self.communicator.seq_in,
            micro_batch_size=self.plan.micro_batch_size // self.layout.dp, p2p_communicator=self.communicator,
            pg_collection=self.groups.pg_collection, forward_only=forward_only,
        )
        mine = [sum(float(d["sum"]) for d in store), sum(d["count"] for d in store)] \
            if (self.holds_loss and self.layout.tp_rank == 0) else [0.0, 0.0]
        total = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.groups.world)
        return float(total[0] / total[1].clamp_min(1.0))

    def forward_backward(self, batch_iterator: Iterator[dict]) -> float:
        """Forward and backward over the global batch (gradients finalised, no optimizer step); returns loss."""
        from ..parallel.grads import hold_embedding_buckets

        for m in self.models:
            m.zero_grad_buffer()
        hold_embedding_buckets(self.held_bucket_groups)
        self.optimizer.zero_grad()
        return self.run_schedule(batch_iterator)

    @property
    def sharded_optimizer(self) -> bool:
        """megatron-core's distributed optimizer steps and clips (the plan's, or Megatron FSDP's)."""
        return self.plan.distributed_optimizer or self.plan.megatron_fsdp is not None

    def train_step(self, batch_iterator: Iterator[dict]) -> float:
        """One optimizer step over the global batch (clipped); returns the mean per-token loss."""
        from ..parallel.grads import clip_grad_norm

        loss = self.forward_backward(batch_iterator)
        if self.sharded_optimizer:
            _, norm, _ = self.optimizer.step()
            self.last_grad_norm = float(norm) if norm is not None else 0.0
        else:
            self.last_grad_norm = clip_grad_norm(self, self.train_config.clip_grad)
            self.optimizer.step()
        return loss

    def sync_params(self) -> None:
        """Finish the distributed optimizer's parameter all-gather now (``overlap_param_gather`` defers it to the
        next forward): before reading or saving the weights after an optimizer step. (Not between backward and
        the step: the gather counts as done until the next backward.)"""
        if self.plan.distributed_optimizer and self.plan.overlap_param_gather:
            for m in self.models:
                m.start_param_sync(force_sync=True)

    # -- inspection (tests) -------------------------------------------------------------------------------------
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every full-model gradient, by canonical name (collective: all ranks call it)."""
        from ..parallel.gather import full_tensors

        return full_tensors(self, "grad")

    def full_params(self) -> dict[str, torch.Tensor]:
        from ..parallel.gather import full_tensors

        self.sync_params()
        return full_tensors(self, "param")


def _ddp_config(plan: ParallelPlan, fast: FastPath, tc: TrainConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
        use_distributed_optimizer=plan.distributed_optimizer or plan.megatron_fsdp is not None,
        # the train config's, else the one the plan was priced with (search/data_parallel.py)
        bucket_size=tc.ddp_bucket_size or run_settings(plan.settings, fast.dtype).ddp_bucket_size,
        # as the plan was priced (search/plan_settings.py: runtime plans reduce in the parameter dtype, megatron-
        # core's DDP default; a Megatron-LM-priced plan as Megatron-LM's flags say)
        grad_reduce_in_fp32=run_settings(plan.settings, fast.dtype).grad_reduce_in_fp32,
        **fsdp.ddp_fields(plan),
    )


def _optimizer(plan: ParallelPlan, tc: TrainConfig, config, models, groups: Groups):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dist_opt = plan.distributed_optimizer or plan.megatron_fsdp is not None
    opt_config = OptimizerConfig(  # distributed optimizer: megatron-core clips (norm over the world of shards)
        optimizer="adam", lr=tc.lr, weight_decay=tc.weight_decay, adam_beta1=tc.adam_beta1,
        adam_beta2=tc.adam_beta2, clip_grad=tc.clip_grad if dist_opt else 0.0,
        params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
        use_distributed_optimizer=dist_opt, overlap_param_gather=plan.overlap_param_gather,
    )
    return get_megatron_optimizer(opt_config, models, use_gloo_process_groups=False,
                                  pg_collection=groups.pg_collection)


def build_runtime(plan: ParallelPlan | dict, rank: int, world_size: int, seed: int = 1234, device: str = "cpu",
                  train_config: TrainConfig | None = None, fast: FastPath | None = None) -> Runtime:
    """Everything rank ``rank`` needs to train ``plan``; ``torch.distributed`` must be initialised. ``fast``: the
    fast paths to use instead of what this machine offers (``fast_path.choose``), e.g. unfused on a GPU."""
    env = Environment.detect(device)
    plan = check_plan(plan, world_size, env)
    tc = train_config or TrainConfig()
    if not dist.is_initialized():
        raise AcesoError("torch.distributed is not initialised; call init_process_group before build_runtime")
    if device == "cpu":
        from patches import cpu_mode

        cpu_mode.apply()
    if plan.model.moe is not None:
        from patches import moe_router_without_te

        moe_router_without_te.apply()
    if plan.model.mla is not None or plan.model.mtp_num_layers:
        from patches import mla_mtp_tp_group, mla_without_te   # MLA / MTP mappings on the stage's TP group

        mla_mtp_tp_group.apply()
        mla_without_te.apply()
    if plan.model.mamba is not None:
        from patches import mamba_cpu   # megatron-core's MambaMixer on torch kernels where mamba-ssm is missing

        mamba_cpu.apply()
    if plan.megatron_fsdp is not None and device == "cpu":
        from patches import fsdp_cpu

        fsdp_cpu.apply()
    if plan.distributed_optimizer or plan.megatron_fsdp is not None:
        from patches import dist_opt_torch_adam

        if dist_opt_torch_adam.needed():
            dist_opt_torch_adam.apply()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from patches.compat import quiet_ddp_layout_notice

    from ..model.config import interleaving
    from ..model.init import initialize
    from ..model.layers import check_model
    from ..model.moe import mark_expert_params
    from ..model.stage_model import build_stage
    from ..parallel.grads import embedding_bucket_groups, finalize_model_grads_fn, mark_embedding_copies
    from ..parallel.p2p import PlanCommunicator

    fast = fast or choose(env, plan.model, plan.tp_comm_overlap)
    check_model(plan, device, fast)   # the model's layer specs and megatron block, before any process group
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # scratch buffer of the attention core (no groups)
        parallel_state._set_global_memory_buffer()
    groups = build_groups(plan, rank)
    lay = groups.layout
    if fast.config["tp_comm_overlap"]:
        _initialize_userbuffers(plan, lay, fast)
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
    if groups.embedding is not None and not plan.distributed_optimizer:
        from patches import shared_embedding_bucket  # each embedding copy in a bucket of its own

        shared_embedding_bucket.apply()
    ddp_config = _ddp_config(plan, fast, tc)
    with _summing([c.config for c in chunks]):
        if plan.megatron_fsdp is not None:   # one chunk (fsdp.refusal)
            where = "cpu" if device == "cpu" else f"cuda:{torch.cuda.current_device()}"
            models = [fsdp.wrap(c, copy.copy(ddp_config), groups, where) for c in chunks]
        else:
            quiet_ddp_layout_notice()
            models = [DistributedDataParallel(c.config, copy.copy(ddp_config), c, pg_collection=groups.pg_collection,
                                              disable_bucketing=j > 0)  # as Megatron-LM: buckets for the first chunk
                      for j, c in enumerate(chunks)]
    optimizer = _optimizer(plan, tc, chunks[0].config, models, groups)
    dev = "cpu" if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    comm = PlanCommunicator(plan, rank, chunks[0].config, dev)
    rt = Runtime(plan, lay, groups, chunks, models, optimizer, comm, tc, fast, dev)
    if plan.overlap_grad_reduce and groups.embedding is not None:
        rt.held_bucket_groups = embedding_bucket_groups(rt)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads_fn(rt)
    config.grad_scale_func = rt.loss_scale
    if plan.overlap_grad_reduce:  # reduce each chunk's buckets during its last micro-batch's backward
        config.no_sync_func = [m.no_sync for m in models] if v > 1 else models[0].no_sync
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
