"""Checkpoints with megatron-core ``dist_checkpointing``, keyed by canonical parameter names, so a checkpoint
written under one plan loads under any other.

Layout (the marker file name is Megatron-LM's)::

    SAVE/iter_0000015/            a dist_checkpointing folder (``*.distcp``, metadata.json; common.pt before 0.19)
                     /extra_rank_00000.pt ...   per rank: RNG states, LR scheduler, iteration, plan digest
    SAVE/latest_checkpointed_iteration.txt      -> "15"

Sharded state: every rank describes its parameters as ``ShardedTensor``s under their canonical names
(``GPTStage.canonical_names``: the names in a single-process megatron-core model) with their TP offsets, and replica
ids that make exactly one rank write each piece (TP-replicated parameters: TP rank 0; DP replicas: DP rank 0; copies
on several stages, such as a tied output embedding: the first stage, see ``model_sharded_state_dict``). A gated
``linear_fc1`` (SwiGLU, quick GEGLU: ``MLP.sharded_state_dict`` keys it on ``gated_linear_unit``) uses megatron-core's
``apply_swiglu_sharded_factory`` (its shard ``t`` is ``[gate_t; up_t]``), GPT-OSS's learnable softmax offset its TP
offset along the heads (``model.softmax_offset``), Mamba's
packed ``in_proj`` / ``conv1d`` one sharded tensor per part (``_packed_parts``). The
optimizer's state comes from megatron-core's own ``optimizer.sharded_state_dict(model_sharded_state_dict)``, which
keys Adam's moments by the same parameters. Each stage therefore saves its own shards, and
``dist_checkpointing.load`` re-shards them for whatever plan loads them. We build the sharded dict ourselves because
megatron-core's ``MegatronModule.sharded_state_dict`` reads TP ranks from the global ``parallel_state``, which a
heterogeneous plan does not set.

Resuming with the same plan is exact (RNG states too). With another plan the model, optimizer, scheduler and
data position carry over, and the RNG states of the new ranks start from the seed; the global batch size must
match, since the data position is ``iteration * global_batch_size`` samples. A checkpoint of another model
(another size, GPT into T5) is refused before anything is read, with the first differing ``ModelSpec`` field
(``model_mismatch``; checkpoints without the recorded spec: the first missing or differently shaped tensor). The
distributed optimizer is saved in megatron-core's ``fully_reshardable`` format (re-sharded for any TP/DP/pipeline
layout; ``patches/dist_opt_torch_adam.py`` makes it load with torch's Adam); a checkpoint of the other optimizer
kind (distributed or not) keeps Adam's moments, master weights and step too (``optim_convert``), or loads the
weights only with ``--no-load-optim``.

Protocol: all ranks write into ``SAVE/.tmp_iter_N``; after a barrier rank 0 renames it to ``iter_N`` and
atomically replaces the marker, so the marker never names a partial checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from search.io.errors import AcesoError
from search.layers.layer_variants import FIELDS as LAYER_VARIANT_FIELDS

from ..parallel.gather import expert_bias_buffers, expert_bias_name
from .checkpoint_files import MARKER


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def plan_digest(plan) -> str:
    return plan.digest()


# ----- sharded state ---------------------------------------------------------------------------------------------
def _owners(rt) -> tuple[dict[str, int], set[str]]:
    """For each canonical name: the first stage that holds it, and the names held by several stages (a tied
    output embedding on the last stage, T5's embedding on the first decoder stage). Collective."""
    mine = (rt.layout.stage, sorted(set(rt.canonical_names().values())))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    owner: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    for stage, keys in parts:
        for k in keys:
            owner[k] = min(owner.get(k, stage), stage)
            holders.setdefault(k, set()).add(stage)
    return owner, {k for k, h in holders.items() if len(h) > 1}


def model_sharded_state_dict(rt) -> dict:
    """Local name -> ShardedTensor (or SwiGLU factory) of this rank's parameters, keyed by canonical name, with
    the Parameter itself as ``data`` (megatron-core's optimizer maps its state to parameters by identity); and of
    the routers' expert biases (``router.expert_bias``, replicated over the stage like the router's weight).

    A parameter held by several stages (copies kept equal by the runtime) is written by the first of them; the
    others are replicas (replica id ``(1, ...)``) that only load. Their TP may differ, and dist_checkpointing's
    validation wants one local shape per key on a regular grid, so such keys are declared with an irregular grid
    (``axis_fragmentations=None``: validation deferred to torch DCP, which reads any chunking).
    """
    from dataclasses import replace

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from ..model.moe import is_expert

    lay = rt.layout
    names = rt.canonical_names()
    owner, shared = _owners(rt)
    out = {}
    for local, p in rt.named_parameters():
        canon = names[local]
        split = bool(getattr(p, "tensor_model_parallel", False))
        if is_expert(canon):   # its global expert index is in the name: EP re-shards by key; ETP by offset
            tp, tp_rank, dp_index = lay.etp, lay.etp_rank, lay.edp_rank
        else:
            tp, tp_rank, dp_index = lay.tp, lay.tp_rank, lay.dp_rank * lay.cp + lay.cp_rank
        replica = (int(owner[canon] != lay.stage), 0 if split else tp_rank, dp_index)
        offsets = [(p.partition_dim, tp_rank, tp)] if split else []
        sh = ShardedTensor.from_rank_offsets(canon, p, *offsets, replica_id=replica)
        if canon in shared:
            sh = replace(sh, axis_fragmentations=None)
        elif rt.plan.model.gated_mlp and ".linear_fc1." in canon and split:   # SwiGLU, quick GEGLU
            sh = apply_swiglu_sharded_factory(sh, ())
        elif split and getattr(p, "partition_sizes", None) is not None:
            sh = _packed_parts(sh, list(p.partition_sizes), p.partition_dim)
        out[local] = sh
    for local, buf in expert_bias_buffers(rt):   # the router's state (moe_router_enable_expert_bias), a replica
        replica = (0, lay.tp_rank, lay.dp_rank * lay.cp + lay.cp_rank)
        out[local] = ShardedTensor.from_rank_offsets(expert_bias_name(names, local), buf, replica_id=replica)
    return out


def _packed_parts(sh, sizes: list[int], dim: int):
    """A packed TP parameter (megatron-core's ``partition_sizes``: Mamba's ``in_proj`` [z, x, B, C, dt] and
    ``conv1d`` [x, B, C]) saved as one sharded tensor per part (``KEY.part<i>``), each split over TP, as
    ``MambaMixer.sharded_state_dict`` saves them (megatron-core's ``_split_tensor_factory``): a contiguous TP offset
    would put another plan's parts in the wrong rows."""
    from megatron.core.ssm.utils import _split_tensor_factory

    return _split_tensor_factory(sh, sizes, [f"part{i}" for i in range(len(sizes))], dim)


# the distributed optimizer's checkpoint format: the one megatron-core re-shards across any TP/DP/PP (its
# 0.16 default, fully_sharded_model_space, is no longer supported by dist_checkpointing's ShardedTensor)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def sharded_state_dict(rt, is_loading: bool = False) -> dict:
    model = model_sharded_state_dict(rt)
    return {"model": model, "optimizer": rt.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                          metadata=OPTIMIZER_METADATA)}


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _allocate_optimizer_state(optimizer) -> None:
    """A distributed optimizer that has not stepped yet gets its state allocated before loading.

    torch's Adam creates its state at the first step, and megatron-core's ``DistributedOptimizer.state_dict``
    (without apex or transformer-engine) reads the step count from it; megatron-core allocates it the same way
    before its own FSDP-format load (``_init_optimizer_states_with_dummy_values``: one step on zero gradients,
    whose effect the loaded state replaces).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and len(opt.optimizer.state) == 0:
            init()


# ----- save / load -----------------------------------------------------------------------------------------------
def save(root: str, iteration: int, rt, scheduler, keep_last: int | None = None, protect: int | None = None) -> Path:
    """Write checkpoint ``iteration`` (collective: every rank calls it); with ``keep_last``, then delete all but
    the newest ``keep_last`` checkpoints except ``protect`` (``rotate``)."""
    from .signals import held

    with held():   # SIGTERM / SIGINT wait until the checkpoint is complete (signals.held)
        return _save(root, iteration, rt, scheduler, keep_last, protect)


def _save(root: str, iteration: int, rt, scheduler, keep_last: int | None, protect: int | None) -> Path:
    from megatron.core import dist_checkpointing

    from .signals import pause_for_test_signal

    root_p = Path(root)
    rank = dist.get_rank()
    tmp = root_p / f".tmp_iter_{iteration:07d}"
    rt.sync_params()  # overlap_param_gather: the last step's all-gather is still pending
    if rank == 0:
        root_p.mkdir(parents=True, exist_ok=True)
        for stale in root_p.glob(".tmp_iter_*"):   # this save's, or what a killed save left: never complete
            shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(rt), str(tmp))
    extra = {"iteration": iteration, "scheduler": scheduler.state_dict(), "rng": rng_state(),
             "plan_digest": plan_digest(rt.plan), "world_size": dist.get_world_size(),
             "global_batch_size": rt.plan.global_batch_size, "model": rt.plan.model.model_dump(),
             "distributed_optimizer": rt.plan.distributed_optimizer}
    torch.save(extra, tmp / f"extra_rank_{rank:05d}.pt")
    pause_for_test_signal(rank)
    dist.barrier()
    final = _iter_dir(root_p, iteration)
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = root_p / f".{MARKER}.tmp"
        marker_tmp.write_text(f"{iteration}\n")
        os.replace(marker_tmp, root_p / MARKER)
        if keep_last:
            rotate(root, keep_last, protect)
    dist.barrier()
    return final


def rotate(root: str, keep: int, protect: int | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest ``iter_N`` folders in ``root`` (rank 0 only; after a save), never the
    one named ``protect`` (the checkpoint this run resumed from) nor the one the marker names; returns the deleted."""
    root_p = Path(root)
    spared = {latest_iteration(root), protect}
    found = sorted((int(d.name[5:]), d) for d in root_p.glob("iter_*") if d.is_dir() and d.name[5:].isdigit())
    gone = [d for it, d in found[:-keep] if it not in spared] if keep > 0 else []
    for d in gone:
        shutil.rmtree(d)
    return gone


def latest_iteration(root: str) -> int | None:
    """The iteration the marker names, or None when the folder has no complete checkpoint."""
    marker = Path(root) / MARKER
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise AcesoError(f"--load {root}: {MARKER} holds '{text}', not an iteration; fix or delete it")
    return int(text)


def read_extra(root: str, iteration: int, rank: int) -> dict:
    path = _iter_dir(Path(root), iteration) / f"extra_rank_{rank:05d}.pt"
    if not path.is_file():
        raise AcesoError(f"--load {root}: {path} is missing; the checkpoint is incomplete")
    return torch.load(path, map_location="cpu", weights_only=False)


def load(root: str, rt, scheduler, load_optim: bool = True, load_rng: bool = True) -> tuple[int, bool] | None:
    """``_load`` with a failure traced to a damaged file of the checkpoint turned into one line naming it
    (``checkpoint_files``); any other failure is raised as it is."""
    try:
        with warnings.catch_warnings():   # 0.19 reads the common state through torch DCP with no process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            return _load(root, rt, scheduler, load_optim, load_rng)
    except (AcesoError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException:   # torch DCP's CheckpointException is a BaseException
        from .checkpoint_files import damage_message, damaged_file, damaged_item

        iteration = latest_iteration(root)
        folder = _iter_dir(Path(root), iteration)
        if (found := damaged_file(folder) or damaged_item(folder)) is not None:
            raise AcesoError(damage_message(root, iteration, found)) from None
        raise


def _load(root: str, rt, scheduler, load_optim: bool = True, load_rng: bool = True) -> tuple[int, bool] | None:
    """Restore from the latest checkpoint in ``root``: (its iteration, whether it was the same plan), or None.

    A checkpoint of the other optimizer kind (distributed or not) loads Adam's state through ``optim_convert``.
    ``load_optim=False`` (Megatron-LM's ``--no-load-optim``): the weights only; Adam's moments start from zero.
    The iteration, data position and learning-rate schedule still carry on (Megatron-LM restarts its scheduler
    too, which would re-warm the rate). ``load_rng=False`` (``--no-load-rng``): the RNG states start from the seed
    even under the same plan."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        return None
    first = read_extra(root, iteration, 0)
    if first["global_batch_size"] != rt.plan.global_batch_size:
        raise AcesoError(
            f"--load {root}: iteration {iteration} was trained with global_batch_size {first['global_batch_size']}, "
            f"the plan has {rt.plan.global_batch_size}; the data position would not carry over, use a plan with "
            f"global_batch_size {first['global_batch_size']}"
        )
    ckpt_dir = _iter_dir(Path(root), iteration)
    # the other optimizer kind (distributed or not): its Adam state is mapped after the weights (optim_convert)
    convert = load_optim and first.get("distributed_optimizer", False) != rt.plan.distributed_optimizer
    from .schedule import load_state, mismatch

    if (msg := mismatch(first["scheduler"], scheduler)) is not None:
        raise AcesoError(f"--load {root}: iteration {iteration} {msg}")
    found = [None] * dist.get_world_size()  # ranks check their own parameters: agree before anyone loads
    dist.all_gather_object(found, model_mismatch(first.get("model"), rt, ckpt_dir))
    if (msg := next((m for m in found if m is not None), None)) is not None:
        raise AcesoError(f"--load {root}: iteration {iteration} {msg}")
    same_plan = first["plan_digest"] == plan_digest(rt.plan) and first["world_size"] == dist.get_world_size()
    if load_optim:
        _allocate_optimizer_state(rt.optimizer)   # before the weights: its dummy step decays them
    if load_optim and not convert:
        request = sharded_state_dict(rt, is_loading=True)
    else:
        request = {"model": model_sharded_state_dict(rt)}
    state = dist_checkpointing.load(request, str(ckpt_dir))
    with torch.no_grad():
        for local, p in [*rt.named_parameters(), *expert_bias_buffers(rt)]:
            value = state["model"][local]
            if value is not p:
                p.copy_(value)
    if convert:
        from .optim_convert import load_other_kind

        load_other_kind(rt, model_sharded_state_dict(rt), ckpt_dir, f"--load {root}: iteration {iteration}")
    elif load_optim:
        rt.optimizer.load_state_dict(state["optimizer"])
    else:
        rt.optimizer.reload_model_params()   # fp32 main copies (bf16 models) from the loaded weights
    mine = read_extra(root, iteration, dist.get_rank()) if same_plan else first
    load_state(scheduler, mine["scheduler"])
    if same_plan and load_rng:
        set_rng_state(mine["rng"])
    return iteration, same_plan


# fields of ModelSpec that change the parameters (not dtype, dropout or names) or what they were trained for; sequence
# lengths only with learned position embeddings (a RoPE model has no per-position parameter); with RoPE its base,
# rotated fraction and scaling (megatron-core RotaryEmbedding's rotary_base, rotary_percent, rope_scaling: weights
# trained under one set of frequencies, or rotating a part of each head, are another function under another's)
_ARCH_FIELDS = ("family", "num_layers", "num_decoder_layers", "hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "ffn_hidden_size", "vocab_size", "make_vocab_size_divisible_by",
                "activation", "normalization", "position_embedding", "tied_embeddings", "add_bias_linear",
                "hybrid_layer_pattern") + LAYER_VARIANT_FIELDS
# (LAYER_VARIANT_FIELDS: GPT-OSS's sliding window and its period, the softmax offset, quick GEGLU's offset and clamp:
# the learnable offset is a parameter, and weights trained under one window / clamp are another function under another)
# megatron block entries that add parameters (TransformerConfig.add_qkv_bias: q/k/v biases; qk_layernorm: Q/K norms)
_MEGATRON_FIELDS = ("add_qkv_bias", "qk_layernorm")
_LEARNED_FIELDS = ("seq_length", "decoder_seq_length")
_ROPE_FIELDS = ("rotary_base", "rotary_percent", "rope_scaling")
# MoE / MLA / MTP fields that shape the parameters (the router's top-k, coefficients and balancing do not) or
# the saved state (the routers' expert biases)
_MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
               "first_k_dense_layers", "moe_router_enable_expert_bias", "moe_shared_expert_gate")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_GDN_FIELDS = ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
               "linear_conv_kernel_dim")


def _arch(model, fields) -> dict:
    """``fields`` of ``model`` by name, its parameter-adding ``megatron`` entries, and its MoE / MLA / MTP shape
    (``moe.num_experts``, ``mla``, ...)."""
    out = {f: getattr(model, f) for f in fields}
    if out.get("rope_scaling") is not None:     # its set fields, shown as data in the refusal
        out["rope_scaling"] = out["rope_scaling"].model_dump(exclude_none=True)
    for f in _MEGATRON_FIELDS:
        out[f"megatron.{f}"] = bool((model.megatron or {}).get(f, False))
    out["mtp_num_layers"] = model.mtp_num_layers or 0       # None and 0: no MTP block
    out["mtp_use_repeated_layer"] = model.mtp_use_repeated_layer   # one MTP layer's weights, or one per depth
    out["moe"] = model.moe is not None
    for f in _MOE_FIELDS:
        out[f"moe.{f}"] = getattr(model.moe, f) if model.moe is not None else None
    out["mla"] = model.mla is not None
    for f in _MLA_FIELDS:
        out[f"mla.{f}"] = getattr(model.mla, f) if model.mla is not None else None
    out.update(_mixer_arch(model))
    return out


def _mixer_arch(model) -> dict:
    """The hybrid mixers' parameter shapes: Mamba-2's as ``MambaMixer`` derives them (``mamba_num_heads`` None is
    ``expand x hidden / head_dim`` heads, so a checkpoint with the heads written out matches one that derives them),
    its conv width; Gated DeltaNet's head counts and dims and its conv width. The scan's chunk length and the fused
    kernel path are no parameter."""
    from search.layers.mamba import shape

    out = {"mamba": model.mamba is not None, "gdn": model.gdn is not None}
    m = shape(model.mamba, model.hidden_size) if model.mamba is not None else None
    for f in ("heads", "head_dim", "groups", "state"):
        out[f"mamba.{f}"] = getattr(m, f) if m is not None else None
    out["mamba.d_conv"] = model.mamba.d_conv if model.mamba is not None else None
    for f in _GDN_FIELDS:
        out[f"gdn.{f}"] = getattr(model.gdn, f) if model.gdn is not None else None
    return out


def model_mismatch(saved: dict | None, rt, ckpt_dir: Path) -> str | None:
    """Why the checkpoint does not hold the plan's model (the first differing field), or None."""
    from search.spec.model import ModelSpec

    want = rt.plan.model
    if saved is not None:
        have = ModelSpec.model_validate(saved)
        fields = _ARCH_FIELDS + {"learned": _LEARNED_FIELDS, "rope": _ROPE_FIELDS}.get(want.position_embedding, ())
        got, need = _arch(have, fields), _arch(want, fields)
        for f in need:
            a, b = got[f], need[f]
            if a != b:
                return (f"holds another model than the plan's: {f} is {a!r} in the checkpoint (model {have.name}) "
                        f"but {b!r} in the plan (model {want.name}); resume it with a plan for its model, or save "
                        "this run to a new folder")
        return None
    return _tensor_mismatch(rt, ckpt_dir)


def _tensor_mismatch(rt, ckpt_dir: Path) -> str | None:
    """For a checkpoint without the recorded model: the first of this rank's parameters it lacks or shapes
    differently."""
    from megatron.core import dist_checkpointing

    from ..model.init import full_shape
    from ..model.moe import is_expert

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    names = rt.canonical_names()
    for local, p in rt.named_parameters():
        canon = names[local]
        if canon not in meta:
            if f"{canon}_w" in meta:  # SwiGLU fc1 saved as gate and up halves
                continue
            return (f"holds another model than the plan's: it has no {canon}; resume it with a plan for its model, "
                    "or save this run to a new folder")
        tp = rt.layout.etp if is_expert(canon) else rt.layout.tp
        have, want = tuple(meta[canon].global_shape), tuple(full_shape(p, tp))
        if have != want:
            return (f"holds another model than the plan's: {canon} has shape {list(have)} in the checkpoint but "
                    f"{list(want)} in the plan; resume it with a plan for its model, or save this run to a new "
                    "folder")
    return None
