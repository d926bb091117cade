"""A Megatron-LM command line (core_v0.16.1 flags) -> ``MegatronConfig`` -> ``ParallelPlan``.

``parse_flags`` reads ``--flag value...`` / ``--flag=value`` as argparse would (last occurrence wins, values up to
the next ``--flag``). The plan's flags (``FLAGS``) are read with Megatron-LM's defaults and checks; flags that
change the cost in ways aceso does not model are refused with one line (``REFUSED``: FP8/FP4, FSDP,
offloading, other rank orders...); the MoE / MLA / MTP flags are read by ``moe_flags.py``; every other flag
(data, optimizer hyper-parameters, logging,
checkpointing, fusions: ``QUIET``) does not change a plan and is accepted; any other flag is listed in one warning. ``config_from_flags`` applies
Megatron-LM's defaults (``--ffn-hidden-size`` 4h or the SwiGLU rule, dropouts 0.1, ``--global-batch-size`` =
micro-batch x dp, vocabulary padding to ``--make-vocab-size-divisible-by`` x tp) and the checks of
``validate_args`` / ``TransformerConfig`` that a plan depends on.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field

from ..errors import AcesoError
from ..fsdp import STRATEGIES
from ..data_parallel import from_flags as dp_from_flags
from ..plan_settings import settings_from_flags
from ..precision import REUSE_FLAG, LowPrecision, from_megatron, reuse_grad_buf_check
from .config import MegatronConfig, Recompute, num_layers
from .layer_variant_flags import FLAG_KINDS as LAYER_FLAG_KINDS
from .layout import distribution, layout_chunk_layers
from .model_args import model_from_flags
from .moe_flags import moe_plan_fields
from .shell import placeholder

_FLAGS_FILE = os.path.join(os.path.dirname(__file__), "data", "flags_core_v0.16.1.txt")


@functools.cache
def megatron_flags() -> frozenset[str]:
    """Every flag of Megatron-LM core_v0.16.1's parser (bench/megatron_reference_lists.py writes the list)."""
    with open(_FLAGS_FILE) as f:
        return frozenset(x.strip() for x in f if x.startswith("--"))

INT, FLOAT, STR, BOOL, LIST = "int", "float", "str", "bool", "list"
FLAGS: dict[str, str] = {
    **{f: INT for f in ("--num-layers", "--encoder-num-layers", "--decoder-num-layers", "--hidden-size",
                        "--ffn-hidden-size", "--num-attention-heads", "--kv-channels", "--num-query-groups",
                        "--seq-length", "--encoder-seq-length", "--decoder-seq-length", "--max-position-embeddings",
                        "--rotary-base", "--vocab-size", "--padded-vocab-size", "--make-vocab-size-divisible-by",
                        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                        "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
                        "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                        "--recompute-num-layers", "--micro-batch-size", "--global-batch-size",
                        "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--cpu-offloading-num-layers",
                        "--ddp-bucket-size",
                        # MoE / MLA / MTP (moe_flags.py)
                        "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                        "--moe-shared-expert-intermediate-size", "--moe-router-num-groups", "--moe-router-group-topk",
                        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
                        "--mtp-num-layers", "--expert-model-parallel-size", "--expert-tensor-parallel-size")},
    **{f: FLOAT for f in ("--attention-dropout", "--hidden-dropout", "--moe-expert-capacity-factor")},
    **{f: STR for f in ("--position-embedding-type", "--normalization", "--tokenizer-type", "--transformer-impl",
                        "--attention-backend",
                        "--pipeline-model-parallel-layout", "--recompute-granularity", "--recompute-method",
                        "--main-grads-dtype", "--fp8-format", "--fp8-recipe", "--fp4-format", "--fp4-recipe",
                        "--data-parallel-sharding-strategy", "--ckpt-format", "--moe-layer-freq",
                        "--moe-router-score-function", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend")},
    **{f: BOOL for f in ("--group-query-attention", "--use-rotary-position-embeddings", "--swiglu",
                         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--sequence-parallel",
                         "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                         "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                         "--tp-comm-overlap", "--recompute-activations", "--bf16", "--fp16",
                         "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                         "--no-position-embedding", "--fp8-param-gather", "--fp4-param-gather",
                         "--first-last-layers-bf16", "--use-megatron-fsdp", "--reuse-grad-buf-for-mxfp8-param-ag",
                         "--moe-router-enable-expert-bias", "--moe-router-force-load-balancing",
                         "--moe-pad-expert-input-to-capacity", "--multi-latent-attention", "--qk-layernorm",
                         "--moe-grouped-gemm", "--moe-permute-fusion",
                         "--moe-shared-expert-overlap", "--overlap-moe-expert-parallel-comm", "--moe-enable-deepep",
                         "--moe-router-pre-softmax",      # MoE ones read by moe_flags.py
                         # the DP synchronization (search/data_parallel.py)
                         "--no-align-grad-reduce", "--no-align-param-gather", "--use-tp-pp-dp-mapping", "--use-sharp")},
    **{f: LIST for f in ("--recompute-modules", "--moe-aux-loss-coeff", "--moe-router-load-balancing-type")},
    **LAYER_FLAG_KINDS,         # --window-size, --softmax-type, --quick-geglu, ... (layer_variant_flags)
}


# Megatron-LM flags that do not change a plan (training schedule, data, logging, checkpointing, fusions): accepted
# without a warning; any other flag is listed in the one warning
QUIET_PREFIXES = ("--lr", "--min-lr", "--train-", "--eval-", "--log-", "--save", "--load", "--data-", "--tokenizer-",
                  "--wandb-", "--tensorboard-", "--exit-", "--ckpt-", "--profile", "--adam-", "--sgd-", "--valid-data",
                  "--test-data", "--manual-gc", "--timing-log", "--fp8-amax-")
QUIET = frozenset({
    "--split", "--vocab-file", "--merge-file", "--mock-data", "--weight-decay", "--start-weight-decay",
    "--end-weight-decay", "--weight-decay-incr-style", "--clip-grad", "--seed", "--init-method-std",
    "--use-dist-ckpt", "--async-save", "--distributed-backend", "--distributed-timeout-minutes", "--num-workers",
    "--use-flash-attn", "--attention-softmax-in-fp32",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--use-mcore-models",
    "--dataloader-type", "--finetune", "--use-checkpoint-args", "--no-load-optim", "--no-load-rng",
    "--vocab-extra-ids", "--legacy-tokenizer", "--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask",
    "--norm-epsilon", "--initial-loss-scale", "--min-loss-scale", "--loss-scale", "--loss-scale-window",
    "--hysteresis", "--fp8-margin", "--fp8-interval", "--mask-prob", "--short-seq-prob", "--no-check-for-nan-in-loss-and-grad", "--local-rank",
    "--mtp-loss-scaling-factor", "--moe-per-layer-logging",
})


def _always(_):
    return True


def _positive(v):
    return _num(v) > 0


def _above_one(v):
    return _num(v) > 1


def _num(v) -> float:
    try:
        return float(v[0]) if v else 0.0
    except ValueError:
        return 1.0


# flag -> (refused when, why)
REFUSED: dict[str, tuple[object, str]] = {
    "--fp8-dot-product-attention": (_always, "FP8 attention is not modelled (the attention core prices bf16)"),
    "--fp8-multi-head-attention": (_always, "FP8 attention is not modelled (the attention core prices bf16)"),
    "--hybrid-override-pattern": (_always, "hybrid (Mamba) models are not modelled by aceso"),
    "--is-hybrid-model": (_always, "hybrid (Mamba) models are not modelled by aceso"),
    "--heterogeneous-layers-config-path": (_always, "heterogeneous layer configs are not modelled by aceso"),
    "--heterogeneous-layers-config-encoded-json": (_always, "heterogeneous layer configs are not modelled by aceso"),
    "--yaml-cfg": (_always, "a YAML config replaces the command line; give the flags instead"),
    "--use-torch-fsdp2": (_always, "torch FSDP2 is not modelled (aceso prices DDP, the distributed optimizer and "
                                   "Megatron FSDP: --use-megatron-fsdp)"),
    "--outer-dp-sharding-strategy": (lambda v: v != ["no_shard"], "hybrid-sharded FSDP is not modelled by aceso"),
    "--num-distributed-optimizer-instances": (_above_one, "several distributed-optimizer instances are not "
                                                          "modelled by aceso"),
    "--distribute-saved-activations": (_always, "recompute checkpoints split over TP are not modelled by aceso"),
    "--fine-grained-activation-offloading": (_always, "activation offloading is not modelled by aceso"),
    "--optimizer-cpu-offload": (_always, "optimizer offloading is not modelled by aceso"),
    "--cp-comm-type": (lambda v: any(x != "p2p" for x in v), "aceso prices ring (p2p) context parallelism only"),
    "--hierarchical-context-parallel-sizes": (_always, "hierarchical context parallelism is not modelled"),
    "--hybrid-context-parallel": (_always, "hybrid context parallelism is not modelled by aceso"),
    "--use-legacy-models": (_always, "aceso plans megatron-core models, not the legacy ones"),
    "--rampup-batch-size": (_always, "a batch-size ramp-up changes the plan during training; plan the final size"),
    "--model-parallel-size": (_always, "the old flag; use --tensor-model-parallel-size"),
    "--checkpoint-activations": (_always, "removed in Megatron-LM; use --recompute-activations or "
                                          "--recompute-granularity"),
    "--optimizer": (lambda v: v != ["adam"], "aceso prices the Adam optimizer's states only"),
}


@dataclass
class Flags:
    values: dict[str, list[str]]
    ignored: list[str] = field(default_factory=list)

    def has(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str, default=None):
        if name not in self.values:
            return default
        v, kind = self.values[name], FLAGS[name]
        if kind == BOOL:
            return True
        if kind == LIST:
            return v
        if len(v) != 1:
            raise AcesoError(f"{name}: expected one value, got {' '.join(v) or 'none'}")
        if placeholder(v[0]):
            raise AcesoError(f"{name} is {placeholder(v[0])}; give its value")
        try:
            return {INT: int, FLOAT: float, STR: str}[kind](v[0])
        except ValueError:
            raise AcesoError(f"{name} {v[0]!r}: expected {'an integer' if kind == INT else 'a number'}") from None


def parse_flags(argv: list[str]) -> Flags:
    values: dict[str, list[str]] = {}
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            if placeholder(tok):
                raise AcesoError(f"the arguments include {placeholder(tok)}; give its value")
            raise AcesoError(f"{tok!r} stands where a flag is expected (Megatron-LM's parser exits on it: "
                             "unrecognized arguments)")
        name, eq, val = tok.partition("=")
        j = i + 1
        while not eq and j < len(argv) and not argv[j].startswith("--"):
            j += 1
        vals = [val] if eq else argv[i + 1:j]
        i = j
        if name in REFUSED:
            when, why = REFUSED[name]
            if when(vals):
                raise AcesoError(f"{' '.join([name, *vals])}: {why}; remove it to price the rest")
            continue
        if name not in megatron_flags():
            raise AcesoError(f"{name}: not a flag of Megatron-LM core_v0.16.1 (its parser exits on it: "
                             f"unrecognized arguments){_closest(name)}")
        if name not in FLAGS:
            if name not in QUIET and not name.startswith(QUIET_PREFIXES):
                ignored.append(name)
            continue
        if FLAGS[name] == BOOL and vals:
            hole = next((placeholder(v) for v in vals if placeholder(v)), None)
            if hole:
                raise AcesoError(f"{name} is followed by {hole}; give its value")
            raise AcesoError(f"{name} takes no value (got {' '.join(vals)})")
        values[name] = vals
    return Flags(values, sorted(set(ignored)))


def _closest(name: str) -> str:
    """``; did you mean --x?`` for the closest core_v0.16.1 flag (difflib), or ``""``."""
    close = difflib.get_close_matches(name, sorted(megatron_flags()), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def config_from_flags(f: Flags, world_size: int, t5: bool, notes: list[str],
                      vocab_size: int | None = None) -> MegatronConfig:
    """The configuration a Megatron-LM run with these flags has on ``world_size`` GPUs."""
    tp = f.get("--tensor-model-parallel-size", 1)
    pp = f.get("--pipeline-model-parallel-size", 1)
    cp = f.get("--context-parallel-size", 1)
    if min(tp, pp, cp) < 1:
        raise AcesoError("--tensor/pipeline-model-parallel-size and --context-parallel-size must be at least 1")
    if world_size % (tp * pp * cp):
        raise AcesoError(f"the world size ({world_size}) is not a multiple of tp x pp x cp ({tp} x {pp} x {cp}); "
                         "check --world-size or the launcher's process count")
    dp = world_size // (tp * pp * cp)
    if t5 and pp > 1:
        raise AcesoError(f"--pipeline-model-parallel-size {pp}: pretrain_t5.py (core_v0.16.1) does not support "
                         "pipeline parallelism for T5")
    if t5 and f.has("--pipeline-model-parallel-layout"):
        raise AcesoError("--pipeline-model-parallel-layout: megatron-core's layouts do not support encoder layers "
                         "(T5)")
    model, attention = model_from_flags(f, tp, t5, notes, vocab_size)
    sp = f.has("--sequence-parallel")
    if sp and tp == 1:
        notes.append("--sequence-parallel with tp 1: Megatron-LM turns it off")
        sp = False
    chunk_layers, vpp = _chunk_layers(f, num_layers(model), pp, model.mtp_num_layers or 0)
    ep, etp, moe = moe_plan_fields(f, model, notes)
    mbs = f.get("--micro-batch-size")
    if mbs is None:
        raise AcesoError("--micro-batch-size is missing; Megatron-LM requires it (the per-rank micro-batch)")
    gbs = f.get("--global-batch-size", mbs * dp)
    if gbs % (mbs * dp):
        raise AcesoError(f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size x dp ({mbs} x {dp})")
    dist_opt, ogr, opg = (f.has(x) for x in ("--use-distributed-optimizer", "--overlap-grad-reduce",
                                             "--overlap-param-gather"))
    fsdp = _fsdp(f, notes)
    if opg and not ((dist_opt or fsdp) and ogr):
        raise AcesoError("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp) and "
                         "--overlap-grad-reduce (Megatron-LM's validate_args asserts both)")
    offload = f.get("--cpu-offloading-num-layers", 0)
    if offload < 0:
        raise AcesoError(f"--cpu-offloading-num-layers {offload}: give 0 (no offload) or a positive number of layers")
    if f.has("--tp-comm-overlap") and not sp:
        raise AcesoError("--tp-comm-overlap needs --sequence-parallel (Megatron-LM's validate_args asserts it)")
    return MegatronConfig(model=model, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, sequence_parallel=sp, ep=ep, etp=etp,
                          moe=moe, chunk_layers=chunk_layers, recompute=_recompute(f, notes, moe), micro_batch_size=mbs,
                          global_batch_size=gbs, distributed_optimizer=dist_opt, overlap_grad_reduce=ogr,
                          overlap_param_gather=opg, tp_comm_overlap=f.has("--tp-comm-overlap"), attention=attention,
                          grad_reduce_in_fp32=settings_from_flags(
                              model.params_dtype, f.has("--grad-reduce-in-bf16"),
                              f.has("--accumulate-allreduce-grads-in-fp32"),
                              f.get("--main-grads-dtype") == "bf16").grad_reduce_in_fp32,
                          low_precision=_low_precision(f, model.params_dtype, dist_opt or bool(fsdp)),
                          fsdp=fsdp, offload_layers=offload, data_parallel=_data_parallel(f, ogr, fsdp))


def _data_parallel(f: Flags, ogr: bool, fsdp):
    """The DP synchronization flags (``search/data_parallel.py``), with Megatron-LM's checks."""
    bucket = f.get("--ddp-bucket-size")
    if bucket is not None and bucket <= 0:
        raise AcesoError(f"--ddp-bucket-size {bucket}: give a positive number of parameters per bucket")
    if fsdp and (f.has("--use-tp-pp-dp-mapping") or f.has("--use-sharp")):
        raise AcesoError("--use-tp-pp-dp-mapping / --use-sharp with --use-megatron-fsdp: aceso prices them for DDP "
                         "and the distributed optimizer; drop the flag")
    return dp_from_flags(bucket if ogr else None, f.has("--no-align-grad-reduce"), f.has("--no-align-param-gather"),
                         f.has("--use-tp-pp-dp-mapping"), f.has("--use-sharp"))


def _low_precision(f: Flags, dtype: str, sharded: bool) -> LowPrecision | None:
    """The recipe of ``--fp8-format/--fp8-recipe`` / ``--fp4-format/--fp4-recipe`` (search/precision.py), with
    ``--fp8-param-gather`` and the bf16 first/last layers (megatron-core's defaults: 1 and 1 when only
    ``--first-last-layers-bf16`` is given)."""
    try:
        recipe = from_megatron(f.get("--fp8-format"), f.get("--fp8-recipe"), f.get("--fp4-format"),
                               f.get("--fp4-recipe"))
    except ValueError as e:
        raise AcesoError(str(e)) from None
    gather = f.has("--fp8-param-gather") or f.has("--fp4-param-gather")
    if recipe is None:
        if gather or f.has("--first-last-layers-bf16"):
            raise AcesoError("--fp8-param-gather / --first-last-layers-bf16 without --fp8-format or --fp4-format: "
                             "give the recipe")
        return None
    if dtype != "bf16":
        raise AcesoError(f"--{recipe.split('-')[0][:3]}-format with {dtype}: aceso prices low precision on --bf16")
    if gather and not sharded:
        raise AcesoError("--fp8-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp (Megatron-LM's "
                         "validate_args asserts it)")
    first_last = f.has("--first-last-layers-bf16")
    start = f.get("--num-layers-at-start-in-bf16", 1) if first_last else 0
    end = f.get("--num-layers-at-end-in-bf16", 1) if first_last else 0
    # Megatron-LM's validate_args resets it under Megatron FSDP (arguments.py: "if args.use_megatron_fsdp:
    # args.reuse_grad_buf_for_mxfp8_param_ag = False")
    reuse = f.has(REUSE_FLAG) and not f.has("--use-megatron-fsdp")
    why = reuse_grad_buf_check(recipe, gather, reuse)
    if why:
        raise AcesoError(why)
    return LowPrecision(recipe=recipe, param_gather=gather, bf16_layers_start=start, bf16_layers_end=end,
                        reuse_grad_buf=reuse)


def _fsdp(f: Flags, notes: list[str]) -> str | None:
    """Megatron FSDP's sharding strategy, or None (DDP); Megatron-LM's checks (``search/fsdp.py``)."""
    strategy = f.get("--data-parallel-sharding-strategy", "no_shard")
    if strategy not in STRATEGIES:
        raise AcesoError(f"--data-parallel-sharding-strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if not f.has("--use-megatron-fsdp"):
        if strategy != "no_shard":
            notes.append(f"--data-parallel-sharding-strategy {strategy} without --use-megatron-fsdp does nothing "
                         "(DDP runs)")
        return None
    fmt = f.get("--ckpt-format", "torch_dist")
    if fmt != "fsdp_dtensor":
        raise AcesoError(f"--use-megatron-fsdp with --ckpt-format {fmt}: Megatron-LM core_v0.16.1 asserts "
                         "\"Megatron FSDP only supports fsdp_dtensor checkpoint format\"; add --ckpt-format fsdp_dtensor")
    return strategy


def _chunk_layers(f: Flags, num_layers: int, pp: int, mtp: int = 0) -> tuple[tuple[int, ...], int]:
    layout = f.get("--pipeline-model-parallel-layout")
    vps, per_vps = f.get("--num-virtual-stages-per-pipeline-rank"), f.get("--num-layers-per-virtual-pipeline-stage")
    if sum(x is not None for x in (layout, vps, per_vps)) > 1:
        raise AcesoError("give at most one of --pipeline-model-parallel-layout, --num-virtual-stages-per-pipeline-"
                         "rank, --num-layers-per-virtual-pipeline-stage (Megatron-LM asserts it)")
    first, last = f.get("--decoder-first-pipeline-num-layers"), f.get("--decoder-last-pipeline-num-layers")
    emb, loss = f.has("--account-for-embedding-in-pipeline-split"), f.has("--account-for-loss-in-pipeline-split")
    if layout is not None:
        if first is not None or last is not None or emb or loss:
            raise AcesoError("--pipeline-model-parallel-layout cannot be combined with --decoder-first/last-"
                             "pipeline-num-layers or --account-for-*-in-pipeline-split (megatron-core refuses it)")
        counts, vpp = layout_chunk_layers(layout, pp, mtp)
        if sum(counts) != num_layers:
            raise AcesoError(f"--pipeline-model-parallel-layout {layout!r} has {sum(counts)} transformer layers but "
                             f"--num-layers is {num_layers}")
    else:
        vpp = vps or 1
        if per_vps is not None:
            if first is not None or last is not None:
                raise AcesoError("uneven first/last stages need --num-virtual-stages-per-pipeline-rank, not "
                                 "--num-layers-per-virtual-pipeline-stage (Megatron-LM asserts it)")
            per_rank, rest = divmod(num_layers + emb + loss, pp)
            if rest or per_rank % per_vps:
                raise AcesoError(f"--num-layers-per-virtual-pipeline-stage {per_vps} must divide the "
                                 f"{num_layers} layers / pp {pp} per pipeline rank")
            vpp = per_rank // per_vps
        counts = distribution(num_layers, pp, vpp, first, last, emb, loss)
    if vpp > 1 and pp == 1:
        raise AcesoError("virtual pipeline stages need --pipeline-model-parallel-size > 1 (Megatron-LM asserts it)")
    return counts, vpp


# megatron-core 0.16.1 TransformerConfig: the modules selective recompute accepts
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
PLAN_MODULES = ("core_attn", "moe_act", "mla_up_proj")   # those a plan's per-unit choices say (megatron/recompute.py)


def _recompute(f: Flags, notes: list[str], moe=None) -> Recompute:
    mla = f.has("--multi-latent-attention")
    gran = "selective" if f.has("--recompute-activations") else f.get("--recompute-granularity")
    method, n = f.get("--recompute-method"), f.get("--recompute-num-layers")
    modules = f.get("--recompute-modules")
    if gran is None:
        if method or n is not None or modules:
            notes.append("--recompute-method/-num-layers/-modules without --recompute-granularity do nothing")
        return Recompute()
    if gran == "selective":
        if method is not None or n is not None:
            raise AcesoError("--recompute-granularity selective takes no --recompute-method / --recompute-num-layers "
                             "(Megatron-LM asserts it)")
        modules = modules if modules is not None else ["core_attn"]
        bad = [x for x in modules if x not in MODULES]
        if bad:
            raise AcesoError(f"--recompute-modules {bad[0]}: not a module of megatron-core 0.16.1 "
                             f"({', '.join(MODULES)})")
        if "moe_act" in modules and moe and not moe.grouped_gemm:
            raise AcesoError("--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core's TransformerConfig "
                             "raises)")
        if "mla_up_proj" in modules and not mla:
            raise AcesoError("--recompute-modules mla_up_proj needs --multi-latent-attention (megatron-core's "
                             "TransformerConfig raises)")
        mapped = tuple(x for x in PLAN_MODULES if x in modules and (x == "core_attn" or (x == "moe_act" and moe)
                                                                     or (x == "mla_up_proj" and mla)))
        other = [x for x in modules if x not in mapped]
        if other:
            notes.append(f"--recompute-modules {' '.join(other)}: not one of the plan's per-unit choices (core_attn, "
                         "on MoE models moe_act, on MLA models mla_up_proj are); priced without recomputing them")
        if "core_attn" in mapped and "mla_up_proj" in mapped:
            notes.append("--recompute-modules core_attn mla_up_proj: an MLA attention unit takes one choice; priced "
                         "as mla_up_proj, keeping the flash attention's log-sum-exp that core_attn would free")
        return Recompute("selective", modules=mapped) if mapped else Recompute()
    if gran != "full":
        raise AcesoError(f"--recompute-granularity {gran!r}: use full or selective")
    if method not in ("uniform", "block") or n is None or n < 0:
        raise AcesoError("--recompute-granularity full needs --recompute-method uniform|block and "
                         "--recompute-num-layers N (megatron-core's TransformerConfig raises otherwise)")
    if method == "uniform":
        if n < 1:
            raise AcesoError("--recompute-method uniform needs --recompute-num-layers of at least 1")
        if n > 1:
            notes.append(f"--recompute-method uniform --recompute-num-layers {n}: megatron-core checkpoints groups of "
                         f"{n} layers (one kept input per group, {n} layers re-materialised at once); priced as every "
                         "layer fully recomputed on its own")
        return Recompute("full", "uniform", 1)
    return Recompute("full", "block", n) if n > 0 else Recompute()
