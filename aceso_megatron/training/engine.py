"""Build everything one rank needs from a plan and run training steps: the API the train command uses.

    runtime = build_runtime(plan, rank, world_size, seed=1234)      # after torch.distributed.init_process_group
    loss = runtime.train_step(iter(micro_batches))                  # one optimizer step over the global batch

Order: validate the plan (before any process group exists), CPU shims if on CPU, process groups
(``layout.build_groups``), the stage chunk (``stage_model``), plan-independent weights (``init``), megatron-core
DDP on the stage's DP group, megatron-core optimizer (distributed optimizer when the plan asks), and the 1F1B schedule
``forward_backward_pipelining_without_interleaving`` with ``PlanCommunicator`` as its ``p2p_communicator``.

A micro-batch is a dict of full pipeline micro-batch tensors, ``{"tokens": [mb, s], "labels": [mb, s]}`` (T5:
``{"enc_tokens": [mb, s_enc], "dec_tokens": [mb, s_dec], "labels": [mb, s_dec]}``); every rank is given the same
ones and takes its DP replica's slice. The loss is the mean per-token loss of the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from search.errors import AcesoError
from search.plan import ParallelPlan, parse_plan

from ..parallel.layout import Groups, RankLayout, build_groups, sample_range


@dataclass
class TrainConfig:
    """Optimizer settings of a run."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    init_method_std: float = 0.02


def check_plan(plan: ParallelPlan | dict, world_size: int) -> ParallelPlan:
    """Validate ``plan`` for ``world_size`` processes; one ``AcesoError`` line naming the stage and field."""
    plan = parse_plan(plan if isinstance(plan, dict) else plan.model_dump(), world_size=world_size)
    return plan


@dataclass
class Runtime:
    plan: ParallelPlan
    layout: RankLayout
    groups: Groups
    stage_module: torch.nn.Module
    model: torch.nn.Module  # the DDP-wrapped stage
    optimizer: object
    communicator: object
    train_config: TrainConfig
    device: str = "cpu"
    last_grad_norm: float = field(default=0.0)
    loss_denominator: float = field(default=0.0)  # tokens that count in this global batch's loss (0: all of them)

    # -- data -------------------------------------------------------------------------------------------------
    def _local(self, t: torch.Tensor) -> torch.Tensor:
        lo, hi = sample_range(self.plan.micro_batch_size, self.layout.dp, self.layout.dp_rank)
        return t[lo:hi]

    def _global_tokens(self) -> int:
        m = self.plan.model
        return self.plan.global_batch_size * (m.decoder_seq_length if m.is_t5 else m.seq_length)

    def start_global_batch(self, micro_batches) -> Iterator[dict]:
        """Fix the loss denominator for one global batch and iterate over its micro-batches.

        The loss is per token and normalised globally (stages may differ in DP): divided by the global batch's
        count of tokens whose ``loss_mask`` is 1 (every token when the batches carry no mask). Every rank gets the
        full micro-batches, so every rank counts the same number without communication.
        """
        batches = list(micro_batches)
        if batches and "loss_mask" in batches[0]:
            self.loss_denominator = max(1.0, float(sum(float(b["loss_mask"].sum()) for b in batches)))
        else:
            self.loss_denominator = float(self._global_tokens())
        return iter(batches)

    def _forward_step(self, data_iterator, model):
        batch = {k: self._local(v).to(self.device) for k, v in next(data_iterator).items()}
        if self.plan.model.is_t5:
            out = model(enc_ids=batch["enc_tokens"], dec_ids=batch["dec_tokens"], labels=batch["labels"])
        else:
            tokens = batch["tokens"]
            pos = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
            out = model(input_ids=tokens, position_ids=pos, labels=batch["labels"])
        denom = self.loss_denominator or float(self._global_tokens())
        mask = batch.get("loss_mask")

        def loss_func(per_token: torch.Tensor):
            if mask is not None:
                per_token = per_token * mask.to(per_token.dtype)
            loss = per_token.sum() / denom
            count = int(mask.sum()) if mask is not None else per_token.numel()
            return loss, torch.tensor(count, dtype=torch.int), {"loss": loss.detach().clone()}

        return out, loss_func

    # -- step -------------------------------------------------------------------------------------------------
    def forward_backward(self, batch_iterator: Iterator[dict]) -> float:
        """Forward and backward over the global batch (gradients finalised, no optimizer step); returns loss."""
        from megatron.core.pipeline_parallel.schedules import (
            forward_backward_pipelining_without_interleaving,
        )

        batch_iterator = self.start_global_batch(batch_iterator)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        seq = self.communicator.seq_in
        store = forward_backward_pipelining_without_interleaving(
            forward_step_func=self._forward_step, data_iterator=batch_iterator, model=[self.model],
            num_microbatches=self.plan.num_micro_batches, seq_length=seq,
            micro_batch_size=self.plan.micro_batch_size // self.layout.dp,
            p2p_communicator=self.communicator, pg_collection=self.groups.pg_collection,
        )
        lay = self.layout
        mine = sum(float(d["loss"]) for d in store) if (self.stage_module.post_process and lay.tp_rank == 0) else 0.0
        total = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.groups.world)
        return float(total)

    def train_step(self, batch_iterator: Iterator[dict]) -> float:
        """One optimizer step over the global batch (clipped); returns the mean per-token loss."""
        from ..parallel.grads import clip_grad_norm

        loss = self.forward_backward(batch_iterator)
        if self.plan.distributed_optimizer:
            _, norm, _ = self.optimizer.step()
            self.last_grad_norm = float(norm) if norm is not None else 0.0
        else:
            self.last_grad_norm = clip_grad_norm(self, self.train_config.clip_grad)
            self.optimizer.step()
        return loss

    # -- inspection (tests) -------------------------------------------------------------------------------------
    def _gather(self, which: str) -> dict[str, torch.Tensor]:
        from ..model.init import gather_full

        params = dict(self.stage_module.named_parameters())
        names = self.stage_module.canonical_names()
        local = {n: (p.main_grad if which == "grad" else p.data) for n, p in params.items()}
        full = gather_full(local, params, names, self.plan.model, self.groups.tp)
        mine = full if (self.layout.tp_rank == 0 and self.layout.dp_rank == 0) else {}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                out.setdefault(k, v)
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every full-model gradient, by canonical name (collective: all ranks call it)."""
        return self._gather("grad")

    def full_params(self) -> dict[str, torch.Tensor]:
        return self._gather("param")


def build_runtime(plan: ParallelPlan | dict, rank: int, world_size: int, seed: int = 1234, device: str = "cpu",
                  train_config: TrainConfig | None = None) -> Runtime:
    """Everything rank ``rank`` needs to train ``plan``; ``torch.distributed`` must be initialised."""
    plan = check_plan(plan, world_size)
    tc = train_config or TrainConfig()
    if not dist.is_initialized():
        raise AcesoError("torch.distributed is not initialised; call init_process_group before build_runtime")
    if device == "cpu":
        from patches import cpu_mode

        cpu_mode.apply()
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ..model.init import initialize
    from ..model.stage_model import build_stage, stage_seq_lens
    from ..parallel.grads import finalize_model_grads_fn, mark_embedding_copies
    from ..parallel.p2p import PlanCommunicator

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # scratch buffer of the attention core (no groups)
        parallel_state._set_global_memory_buffer()
    groups = build_groups(plan, rank)
    lay = groups.layout
    # dropout RNG seeded as Megatron-LM does: seed + 100 * stage for the default generator (hidden dropout: equal
    # within a stage's TP group, different between stages), the rng tracker's TP state differing by TP rank on top
    model_parallel_cuda_manual_seed(seed + 100 * lay.stage, tp_rank=lay.tp_rank, ep_rank=0, etp_rank=0)
    stage = build_stage(plan, lay.stage, groups.pg_collection, device)
    stage.config.init_method_std = tc.init_method_std
    initialize(stage, stage.canonical_names(), plan.model, seed, lay.tp, lay.tp_rank, tc.init_method_std)
    mark_embedding_copies(stage, plan)
    dist_opt = plan.distributed_optimizer
    ddp = DistributedDataParallel(
        stage.config, DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=dist_opt),
        stage, pg_collection=groups.pg_collection,
    )
    opt_config = OptimizerConfig(  # distributed optimizer: megatron-core clips (norm over the world of shards)
        optimizer="adam", lr=tc.lr, weight_decay=tc.weight_decay, adam_beta1=tc.adam_beta1,
        adam_beta2=tc.adam_beta2, clip_grad=tc.clip_grad if dist_opt else 0.0,
        params_dtype=stage.config.params_dtype, bf16=stage.config.bf16, fp16=stage.config.fp16,
        use_distributed_optimizer=dist_opt,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False,
                                       pg_collection=groups.pg_collection)
    seq_lens = stage_seq_lens(plan)
    dev = "cpu" if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    comm = PlanCommunicator(plan, rank, stage.config, seq_lens, dev)
    rt = Runtime(plan, lay, groups, stage, ddp, optimizer, comm, tc, dev)
    stage.config.finalize_model_grads_func = finalize_model_grads_fn(rt)
    return rt
