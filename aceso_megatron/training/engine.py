"""Build everything one rank needs from a plan and run training steps: the API the train command uses.

    runtime = build_runtime(plan, rank, world_size, seed=1234)      # after torch.distributed.init_process_group
    loss = runtime.train_step(iter(micro_batches))                  # one optimizer step over the global batch

Order (``build_runtime``): ordered steps, each a function of ``build_steps`` with one responsibility that logs one
line on rank 0 (``aceso train`` prints them as ``[build] <step>: ...``, docs/runtime.md "Build steps"):
``check`` (the plan valid for the world size, refused here if this environment cannot run it: ``check_plan``),
``patches`` (what the plan needs of ``patches/``), ``fast paths`` (layer specs, dtype, fusions; the model's layer
specs and megatron block checked: ``model.layers.check_model``) -- all before any process group exists --,
``precision`` (parameter and gradient-reduction dtypes, the low-precision recipe), ``groups``
(``layout.build_groups``), ``chunks`` (the rank's model chunks, ``stage_model``; ``v`` of them for an interleaved
plan, with plan-independent weights, ``init``), ``wrap`` (one megatron-core DDP per chunk on the stage's DP (x CP)
group -- bucketed and overlapped when the plan asks -- or Megatron FSDP), ``optimizer`` (megatron-core's,
distributed when the plan asks) and ``schedule`` (what the schedule megatron-core's ``get_forward_backward_func``
picks for the pipeline -- no pipelining, 1F1B, interleaved 1F1B -- calls: ``PlanCommunicator`` as its
``p2p_communicator``, the gradient finalisation, the loss scale).

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

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan, parse_plan
from search.costmodel.plan_view import run_settings

from ..model.fast_path import Environment, FastPath
from ..parallel.layout import Groups, RankLayout, sample_range
from ..parallel.shards import cp_token_index
from ..preflight import refusal
from . import fsdp
from .build_steps import (Precision, apply_patches, build_chunks, build_optimizer, build_process_groups,
                          checked_text, choose_fast_paths, choose_precision, connect_schedule, log_step, wrap_chunks)


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
    """Validate ``plan`` for ``world_size`` processes and refuse what ``env`` cannot run (None: what no environment
    runs), the one pre-flight's answer (``aceso_megatron.preflight.refusal``); one ``AcesoError`` line naming the
    stage and field."""
    plan = parse_plan(plan if isinstance(plan, dict) else plan.model_dump(), world_size=world_size)
    if (msg := refusal(env, plan)) is not None:
        raise AcesoError(msg)
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


def _ddp_config(plan: ParallelPlan, fast: FastPath, precision: Precision, tc: TrainConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
        use_distributed_optimizer=plan.distributed_optimizer or plan.megatron_fsdp is not None,
        # the train config's, else the one the plan was priced with (search/settings/data_parallel.py)
        bucket_size=tc.ddp_bucket_size or run_settings(plan.settings, fast.dtype).ddp_bucket_size,
        # as the plan was priced (search/settings/plan_settings.py: runtime plans reduce in the parameter dtype, megatron-
        # core's DDP default; a Megatron-LM-priced plan as Megatron-LM's flags say)
        grad_reduce_in_fp32=precision.grad_reduce_in_fp32,
        **fsdp.ddp_fields(plan),
    )


def build_runtime(plan: ParallelPlan | dict, rank: int, world_size: int, seed: int = 1234, device: str = "cpu",
                  train_config: TrainConfig | None = None, fast: FastPath | None = None) -> Runtime:
    """Everything rank ``rank`` needs to train ``plan``; ``torch.distributed`` must be initialised. ``fast``: the
    fast paths to use instead of what this machine offers (``fast_path.choose``), e.g. unfused on a GPU. The steps
    in order, each logging one line on rank 0 (``build_steps``)."""
    env = Environment.detect(device)
    plan = check_plan(plan, world_size, env)
    tc = train_config or TrainConfig()
    if not dist.is_initialized():
        raise AcesoError("torch.distributed is not initialised; call init_process_group before build_runtime")
    log_step("check", checked_text(plan, device))
    apply_patches(plan, device)
    fast = choose_fast_paths(plan, env, device, fast)
    precision = choose_precision(plan, fast)
    groups = build_process_groups(plan, rank, fast)
    chunks = build_chunks(plan, groups, device, fast, tc, seed)
    models = wrap_chunks(plan, chunks, groups, device, _ddp_config(plan, fast, precision, tc))
    optimizer = build_optimizer(plan, tc, chunks[0].config, models, groups)
    dev = "cpu" if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    return connect_schedule(Runtime(plan, groups.layout, groups, chunks, models, optimizer, None, tc, fast, dev))
