"""A Megatron-LM command line (the flags of one release, ``versions.py``) -> ``MegatronConfig`` -> ``ParallelPlan``.

``parse_flags`` reads ``--flag value...`` / ``--flag=value`` as argparse would (last occurrence wins, values up to
the next ``--flag``) against the release's parser: a flag it does not have is refused naming its closest flag and
the releases that have it. Every flag given is kept in ``Flags.values`` (typed by ``Flags.get`` as the release's
parser types it), so a pricing that reads a flag later finds it there. The plan's flags (``FLAGS``) are read with
the release's defaults (``Flags.value``) and Megatron-LM's checks; flags that
change the cost in ways aceso does not model are refused with one line (``REFUSED``: FP8/FP4, FSDP,
offloading, other rank orders...); the MoE / MLA / MTP flags are read by ``moe_flags.py``; every other flag
(data, optimizer hyper-parameters, logging,
checkpointing, fusions: ``QUIET``) does not change a plan and is accepted; any other flag is listed in one warning. ``config_from_flags`` applies
Megatron-LM's defaults (``--ffn-hidden-size`` 4h or the SwiGLU rule, dropouts 0.1, ``--global-batch-size`` =
micro-batch x dp, vocabulary padding to ``--make-vocab-size-divisible-by`` x tp) and the checks of
``validate_args`` / ``TransformerConfig`` that a plan depends on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from search.io.errors import AcesoError
from search.settings.data_parallel import from_flags as dp_from_flags
from search.settings.fsdp import STRATEGIES, ActivationOffload, MegatronFSDP
from search.settings.plan_settings import PlanSettings, grad_reduce_from_flags, sync_p2p_refused
from search.settings.optimizer_state import (FLAG_FIELDS as PA_DTYPE_FLAGS, USE_FLAG as PA_FLAG,
                                             from_flags as pa_from_flags, refusal as pa_refusal)
from search.settings.precision import REUSE_FLAG, LowPrecision, from_megatron, reuse_grad_buf_check
from .config import MegatronConfig, Recompute, num_layers
from .layer_variant_flags import FLAG_KINDS as LAYER_FLAG_KINDS
from .layout import distribution, layout_chunk_layers
from .model_args import model_from_flags
from .moe_flags import moe_plan_fields
from .tp_overlap_flags import FLAG_KINDS as TP_OVERLAP_FLAG_KINDS, refusal as tp_overlap_refusal
from .stack_flags import FLAG_KINDS as STACK_FLAG_KINDS, INFERENCE_PAD, release_stack_refusal, stack_fields
from .shell import placeholder
from .versions import Release, having, not_a_flag, release


@functools.cache
def megatron_flags(version: str | None = None) -> frozenset[str]:
    """Every flag of a Megatron-LM release's parser (default the newest; ``versions.py``)."""
    return frozenset(release(version).flags)

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
                        "--ddp-bucket-size", "--ddp-num-buckets",
                        # MoE / MLA / MTP (moe_flags.py)
                        "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                        "--moe-shared-expert-intermediate-size", "--moe-router-num-groups", "--moe-router-group-topk",
                        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
                        "--mtp-num-layers", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                        "--moe-latent-size", "--moe-hybridep-num-sms", "--moe-flex-dispatcher-num-sms")},
    **{f: FLOAT for f in ("--attention-dropout", "--hidden-dropout", "--moe-expert-capacity-factor",
                          "--moe-expert-rank-capacity-factor", "--moe-router-bias-update-rate")},
    **{f: STR for f in ("--position-embedding-type", "--normalization", "--tokenizer-type", "--transformer-impl",
                        "--attention-backend",
                        "--pipeline-model-parallel-layout", "--recompute-granularity", "--recompute-method",
                        "--main-grads-dtype", "--fp8-format", "--fp8-recipe", "--fp4-format", "--fp4-recipe",
                        "--data-parallel-sharding-strategy", "--ckpt-format", "--moe-layer-freq",
                        "--moe-router-score-function", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
                        "--moe-router-dtype",
                        # the precision-aware optimizer (search/settings/optimizer_state.py)
                        "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype",
                        # per-module precision (read by importer.te_overrides: settings/precision_overrides.py)
                        "--te-precision-config-file")},
    **{f: BOOL for f in ("--group-query-attention", "--use-rotary-position-embeddings", "--swiglu",
                         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--sequence-parallel",
                         "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                         "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                         "--use-precision-aware-optimizer",
                         "--tp-comm-overlap", "--recompute-activations", "--bf16", "--fp16",
                         "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                         "--no-position-embedding", "--fp8-param-gather", "--fp4-param-gather",
                         "--first-last-layers-bf16", "--use-megatron-fsdp", "--reuse-grad-buf-for-mxfp8-param-ag",
                         "--moe-router-enable-expert-bias", "--moe-router-force-load-balancing",
                         "--moe-pad-expert-input-to-capacity", "--moe-shared-expert-gate", "--multi-latent-attention",
                         "--qk-layernorm",
                         "--moe-grouped-gemm", "--moe-permute-fusion",
                         "--moe-shared-expert-overlap", "--overlap-moe-expert-parallel-comm", "--moe-enable-deepep",
                         "--moe-router-pre-softmax", "--delay-wgrad-compute", "--moe-router-fusion",
                         "--moe-paged-stash", "--mtp-use-repeated-layer", "--use-fused-weighted-squared-relu",
                         # (MoE ones read by moe_flags.py)
                         # the DP synchronization (search/settings/data_parallel.py)
                         "--no-align-grad-reduce", "--no-align-param-gather", "--use-tp-pp-dp-mapping", "--use-sharp",
                         "--moe-layer-recompute",         # (_recompute: selective 'moe')
                         "--no-overlap-p2p-communication",    # (_overlap_p2p: PlanSettings.overlap_p2p_comm)
                         )},
    **STACK_FLAG_KINDS,         # --cuda-graph-impl, --optimizer, --offload-modules, ... (stack_flags.py)
    **{f: LIST for f in ("--recompute-modules", "--moe-aux-loss-coeff", "--moe-router-load-balancing-type")},
    **LAYER_FLAG_KINDS,         # --window-size, --softmax-type, --quick-geglu, ... (layer_variant_flags)
    **TP_OVERLAP_FLAG_KINDS,    # TE's overlap method overrides, refused with --tp-comm-overlap (tp_overlap_flags.py)
}


# Megatron-LM flags that do not change a plan (training schedule, data, logging, checkpointing, fusions): accepted
# without a warning; any other flag is listed in the one warning
QUIET_PREFIXES = ("--lr", "--min-lr", "--train-", "--eval-", "--log-", "--save", "--load", "--data-", "--tokenizer-",
                  "--wandb-", "--tensorboard-", "--exit-", "--ckpt-", "--profile", "--adam-", "--sgd-", "--valid-data",
                  "--test-data", "--manual-gc", "--timing-log", "--fp8-amax-",
                  # families that do not touch a pretraining step (inference, RL, vision / BERT / retrieval models,
                  # checkpoint formats, fault injection and tolerance, logging and tracing, tokenizers, FIM data)
                  "--inference-", "--mamba-inference-", "--rl-", "--no-rl-", "--grpo-", "--dino-", "--img-",
                  "--vision-", "--swin-", "--bert-", "--biencoder-", "--ict-", "--retriever-", "--dist-ckpt-",
                  "--non-persistent-", "--async-ckpt-", "--fault-injector-", "--error-injection-", "--inprocess-",
                  "--flight-recorder-", "--no-flight-recorder-", "--disable-flight-recorder-", "--straggler-",
                  "--one-logger-", "--app-tag-", "--pytorch-profiler-", "--moe-routing-trace-", "--logits-",
                  "--tiktoken-", "--null-tokenizer-", "--fim-")
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
    "--moe-pad-experts-for-cuda-graph-inference",     # inference only; 0.16 / 0.17 assert it (stack_flags)
    # initialisation, learning-rate and weight-decay variants, loss bookkeeping, checks, warm-up-only and logging
    # switches (Megatron-LM core_v0.19.0: none changes a step's work or memory)
    "--init-model-with-meta-device", "--use-cpu-initialization", "--no-initialization", "--lazy-mpu-init",
    "--embedding-init-method-std", "--init-method-xavier-uniform", "--decoupled-lr", "--decoupled-min-lr",
    "--head-lr-mult", "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type", "--calculate-per-token-loss",
    "--check-for-large-grads", "--check-for-spiky-loss", "--rerun-mode", "--cuda-graph-warmup-steps",
    "--te-rng-tracker", "--logging-level", "--nvtx-ranges", "--skip-train", "--iterations-to-skip",
    "--enable-experimental", "--distributed-timeout-seconds-after-init", "--disable-gloo-process-groups",
    "--tp-comm-bootstrap-backend", "--record-memory-history", "--memory-snapshot-path", "--fp16-lm-cross-entropy",
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


OLD_HYBRID = ("aceso reads hybrid (Mamba) runs of Megatron-LM core_v0.17 on (--hybrid-layer-pattern, "
              "pretrain_hybrid.py), not core_v0.16.1's MambaModel: read the script with --megatron-version 0.17 or "
              "newer")

BF16_WGRAD = "bf16 weight-gradient GEMMs under a low-precision recipe are not modelled"
# flag -> (refused when, why)
REFUSED: dict[str, tuple[object, str]] = {
    "--fp8-dot-product-attention": (_always, "FP8 attention is not modelled (the attention core prices bf16)"),
    "--fp8-multi-head-attention": (_always, "FP8 attention is not modelled (the attention core prices bf16)"),
    # (from core_v0.17 both are read as --hybrid-layer-pattern: hybrid_pattern.current_spelling)
    "--hybrid-override-pattern": (_always, OLD_HYBRID),
    "--is-hybrid-model": (_always, OLD_HYBRID),
    "--heterogeneous-layers-config-path": (_always, "heterogeneous layer configs are not modelled by aceso"),
    "--heterogeneous-layers-config-encoded-json": (_always, "heterogeneous layer configs are not modelled by aceso"),
    "--yaml-cfg": (_always, "a YAML config replaces the command line; give the flags instead"),
    "--use-torch-fsdp2": (_always, "torch FSDP2 is not modelled (aceso prices DDP, the distributed optimizer and "
                                   "Megatron FSDP: --use-megatron-fsdp)"),
    "--outer-dp-sharding-strategy": (lambda v: v != ["no_shard"], "hybrid-sharded FSDP is not modelled by aceso"),
    "--num-distributed-optimizer-instances": (_above_one, "several distributed-optimizer instances are not "
                                                          "modelled by aceso"),
    "--distribute-saved-activations": (_always, "recompute checkpoints split over TP are not modelled by aceso"),
    "--optimizer-cpu-offload": (_always, "optimizer offloading is not modelled by aceso"),
    "--cp-comm-type": (lambda v: any(x != "p2p" for x in v), "aceso prices ring (p2p) context parallelism only"),
    "--hierarchical-context-parallel-sizes": (_always, "hierarchical context parallelism is not modelled"),
    "--hybrid-context-parallel": (_always, "hybrid context parallelism is not modelled by aceso"),
    "--use-legacy-models": (_always, "aceso plans megatron-core models, not the legacy ones"),
    "--rampup-batch-size": (_always, "a batch-size ramp-up changes the plan during training; plan the final size"),
    "--step-batch-size-schedule": (_always, "a batch-size schedule changes the plan during training; plan the final "
                                            "size"),
    "--model-parallel-size": (_always, "the old flag; use --tensor-model-parallel-size"),
    "--checkpoint-activations": (_always, "removed in Megatron-LM; use --recompute-activations or "
                                          "--recompute-granularity"),
    "--fp8-quantizer-factory": (_always, "custom quantizers are not priced by aceso (the --fp8-recipe is)"),
    "--fp4-quantizer-factory": (_always, "custom quantizers are not priced by aceso (the --fp4-recipe is)"),
    # Megatron-LM core_v0.19.0 file:line of what each does (megatron/...), the model or run aceso would misprice
    # (--hybrid-layer-pattern and --spec on a GPT / T5 line: importer.GPT_LINE_REFUSED)
    "--experimental-attention-variant": (_always, "gated delta-net / DeepSeek sparse attention layers in a GPT model "
                                                  "are not read from pretrain_gpt.py (gpt_builders.py:37-40); give "
                                                  "GDN layers as G in --hybrid-layer-pattern with pretrain_hybrid.py"),
    "--attention-output-gate": (_always, "gated attention (linear_qkv widened by a per-head sigmoid gate, "
                                         "core/transformer/attention.py) is not modelled"),
    "--freeze-all-layers": (_always, "a frozen model (no weight gradients or optimizer step) is not priced"),
    "--fp32-residual-connection": (_always, "an fp32 residual stream is not modelled (activations and pipeline "
                                            "messages are priced in the parameter dtype)"),
    "--defer-embedding-wgrad-compute": (_always, "the deferred output-layer weight gradients (the last stage keeps "
                                                 "each micro-batch's logits gradient to the flush) are not modelled"),
    "--deterministic-mode": (_always, "deterministic kernels and ring-only NCCL are not modelled"),
    "--batch-invariant-mode": (_always, "batch-invariant kernels are not modelled"),
    "--no-fp8-wgrad": (_always, BF16_WGRAD),
    "--disable-fp8-wgrad": (_always, BF16_WGRAD),           # (0.19's spelling of the same parser field)
    "--fp8-output-proj": (_always, "an MXFP8 output layer is not modelled (the output layer is priced in bf16)"),
    "--use-kitchen-attention": (_always, "kitchen attention is not modelled (aceso prices transformer-engine's and "
                                         "megatron-core's local attention)"),
    "--moe-router-force-biased": (_always, "a forced routing imbalance is not modelled (force-balanced routing is "
                                           "--moe-router-force-load-balancing)"),
    "--delta-offload-bytes-across-pp-ranks": (_positive, "per-stage offload amounts are not modelled"),
    "--moe-paged-stash-buffer-size-factor-cuda": (lambda v: _num(v) != 1.1, "the paged stash is priced at megatron-"
                                                                           "core's default 1.1x buffer"),
    "--moe-paged-stash-buffer-size-factor-cpu": (_positive, "a paged stash spilling to host memory is not modelled"),
}

# flags whose refusal depends on the rest of the line (``_refuse_in_context``): flag -> (refused when, why); not
# refused, each is megatron-core's default and not listed as unpriced
IN_CONTEXT: dict[str, tuple[object, str]] = {
    # model_parallel_config.py resolve_tensor_parallel_weight_shards: shards beyond tp are GTP's all-gathered weights
    "--tensor-parallel-num-weight-shards": (
        lambda f: f.get("--tensor-parallel-num-weight-shards") != f.get("--tensor-model-parallel-size", 1),
        "weight sharding beyond TP (GTP) is not modelled; give --tensor-model-parallel-size's value or drop it"),
    "--expert-tensor-parallel-num-weight-shards": (
        lambda f: f.get("--expert-tensor-parallel-num-weight-shards") != (
            f.get("--expert-tensor-parallel-size") or f.get("--tensor-model-parallel-size", 1)),
        "expert weight sharding beyond ETP (GTP) is not modelled; give the expert TP size or drop it"),
    # model_parallel_config.py: the interleaved schedule's micro-batch group defaults to pp (its warm-up depth)
    "--microbatch-group-size-per-virtual-pipeline-stage": (
        lambda f: f.get("--microbatch-group-size-per-virtual-pipeline-stage") != f.get(
            "--pipeline-model-parallel-size", 1),
        "aceso prices the interleaved schedule's default group (--pipeline-model-parallel-size micro-batches); "
        "give pp's value or drop it"),
}


def _refuse_in_context(f: "Flags") -> None:
    for name, (when, why) in IN_CONTEXT.items():
        if f.has(name) and when(f):
            raise AcesoError(f"{' '.join([name, *f.values[name]])}: {why}")


_ALIASES: dict[str, dict[str, str]] = {}


def _aliases(rel) -> dict[str, str]:
    """Flags of ``rel``'s parser that set the same ``args`` field the same way as a priced flag (``FLAGS``): read as
    that flag (core_v0.17.1 on: ``--disable-align-grad-reduce`` is ``--no-align-grad-reduce``)."""
    if rel.label not in _ALIASES:
        priced = {(f.dest, f.action): n for n, f in rel.flags.items() if n in FLAGS}
        _ALIASES[rel.label] = {n: priced[(f.dest, f.action)] for n, f in rel.flags.items()
                               if n not in FLAGS and (f.dest, f.action) in priced}
    return _ALIASES[rel.label]


@dataclass
class Flags:
    """The flags of a command line under one release: ``values`` holds every flag given (priced or not, in the
    release's parser), ``ignored`` those aceso does not price and does not know to be harmless."""

    values: dict[str, list[str]]
    ignored: list[str] = field(default_factory=list)
    release: Release = field(default_factory=release)

    def has(self, name: str) -> bool:
        return name in self.values

    def kind(self, name: str) -> str:
        """``FLAGS``'s kind for a priced flag, else what the release's parser makes of it."""
        if name in FLAGS:
            return FLAGS[name]
        f = self.release.flags.get(name)
        if f is None or f.action in ("store_true", "store_false", "store_const", "count", "boolean_optional"):
            return BOOL
        if f.nargs in ("+", "*") or isinstance(f.nargs, int) or f.action == "append":
            return LIST
        return {"int": INT, "float": FLOAT}.get(f.type, STR)

    def get(self, name: str, default=None):
        """The value given (typed), else ``default``."""
        if name not in self.values:
            return default
        v, kind = self.values[name], self.kind(name)
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

    def value(self, name: str):
        """What the run's ``args.<dest>`` holds after the release's parser: the value given (a ``store_false``
        flag given: False), else the parser's default."""
        if name not in self.values:
            return self.release.default(name)
        f = self.release.flags.get(name)
        return False if f is not None and f.action == "store_false" else self.get(name)


def parse_flags(argv: list[str], rel: Release | None = None) -> Flags:
    rel = rel or release()
    values: dict[str, list[str]] = {}
    ignored: set[str] = set()
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
        if not rel.has(name) and (having(name) or name not in REFUSED):
            raise AcesoError(not_a_flag(name, rel))
        name = _aliases(rel).get(name, name)
        if name in REFUSED:
            when, why = REFUSED[name]
            if when(vals):
                raise AcesoError(f"{' '.join([name, *vals])}: {why}" +
                                 ("" if why == OLD_HYBRID else "; remove it to price the rest"))
            continue
        if name not in FLAGS:
            if name not in QUIET and not name.startswith(QUIET_PREFIXES):
                ignored.add(name)
            values[name] = vals
            continue
        if FLAGS[name] == BOOL and vals:
            hole = next((placeholder(v) for v in vals if placeholder(v)), None)
            if hole:
                raise AcesoError(f"{name} is followed by {hole}; give its value")
            raise AcesoError(f"{name} takes no value (got {' '.join(vals)})")
        values[name] = vals
    f = Flags(values, sorted(ignored - IN_CONTEXT.keys()), rel)
    _refuse_in_context(f)
    return f


def config_from_flags(f: Flags, world_size: int, t5: bool, notes: list[str],
                      vocab_size: int | None = None) -> MegatronConfig:
    """The configuration a Megatron-LM run with these flags has on ``world_size`` GPUs."""
    tp = f.value("--tensor-model-parallel-size")
    pp = f.value("--pipeline-model-parallel-size")
    cp = f.value("--context-parallel-size")
    if min(tp, pp, cp) < 1:
        raise AcesoError("--tensor/pipeline-model-parallel-size and --context-parallel-size must be at least 1")
    if world_size % (tp * pp * cp):
        raise AcesoError(f"the world size ({world_size}) is not a multiple of tp x pp x cp ({tp} x {pp} x {cp}); "
                         "check --world-size or the launcher's process count")
    dp = world_size // (tp * pp * cp)
    if t5 and pp > 1:
        raise AcesoError(f"--pipeline-model-parallel-size {pp}: pretrain_t5.py ({f.release.tag}) does not "
                         "support pipeline parallelism for T5")
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
    if mbs < 1 or f.get("--global-batch-size", 1) < 1:
        raise AcesoError("--micro-batch-size and --global-batch-size must be at least 1")
    gbs = f.get("--global-batch-size", mbs * dp)
    if gbs % (mbs * dp):
        raise AcesoError(f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size x dp ({mbs} x {dp})")
    dist_opt, ogr, opg = (f.has(x) for x in ("--use-distributed-optimizer", "--overlap-grad-reduce",
                                             "--overlap-param-gather"))
    fsdp = _fsdp(f, notes)
    if fsdp and f.release.rule("fsdp_forces_distributed_optimizer") and not dist_opt:
        notes.append(f"--use-megatron-fsdp: {f.release.label} runs the distributed optimizer with it "
                     "(validate_args turns it on)")
        dist_opt = True
    if opg and not ((dist_opt or fsdp) and ogr):
        raise AcesoError("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp) and "
                         "--overlap-grad-reduce (Megatron-LM's validate_args asserts both)")
    offload = f.value("--cpu-offloading-num-layers")
    if offload < 0:
        raise AcesoError(f"--cpu-offloading-num-layers {offload}: give 0 (no offload) or a positive number of layers")
    if f.has("--tp-comm-overlap") and not sp:
        raise AcesoError("--tp-comm-overlap needs --sequence-parallel (Megatron-LM's validate_args asserts it)")
    if (why := tp_overlap_refusal(f)):
        raise AcesoError(why)
    stack, optimizer = stack_fields(f, model, dist_opt, bool(fsdp), notes)
    if (why := release_stack_refusal(f.release, stack, ep, f.has(INFERENCE_PAD), attention)):
        raise AcesoError(why)
    main_params, main_grads = _fsdp_dtypes(f, fsdp, model.params_dtype)
    pa = _precision_aware(f, optimizer, dist_opt, bool(fsdp))
    settings = PlanSettings(precision_aware_optimizer=pa,
        framework="megatron-lm", distributed_optimizer=dist_opt, overlap_grad_reduce=ogr, overlap_param_gather=opg,
        tp_comm_overlap=f.has("--tp-comm-overlap"), moe=moe,
        grad_reduce_in_fp32=grad_reduce_from_flags(model.params_dtype, f.has("--grad-reduce-in-bf16"),
                                                   f.has("--accumulate-allreduce-grads-in-fp32"),
                                                   f.get("--main-grads-dtype") == "bf16"),
        low_precision=_low_precision(f, model.params_dtype, dist_opt or bool(fsdp)),
        megatron_fsdp=MegatronFSDP(data_parallel_sharding_strategy=fsdp, main_params_dtype=main_params,
                                   main_grads_dtype=main_grads) if fsdp else None,
        activation_offload=ActivationOffload(num_layers=offload) if offload else None, stack=stack,
        optimizer=optimizer, data_parallel=_data_parallel(f, ogr, fsdp),
        overlap_p2p_comm=_overlap_p2p(f, pp, vpp, notes))
    return MegatronConfig(model=model, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, sequence_parallel=sp, ep=ep, etp=etp,
                          chunk_layers=chunk_layers, recompute=_recompute(f, notes, moe), micro_batch_size=mbs,
                          global_batch_size=gbs, attention=attention, settings=settings)


def _fsdp_dtypes(f: Flags, fsdp: str | None, dtype: str) -> tuple[str | None, str | None]:
    """Megatron FSDP's main-params / main-grads dtypes (megatron-core 0.19 ``--megatron-fsdp-main-params-dtype``,
    default fp32, ``auto`` the parameters' dtype; ``--megatron-fsdp-main-grads-dtype``, default ``auto``, the
    gradient-reduction dtype): None where the flag gives the default."""
    out = []
    for flag, auto in (("--megatron-fsdp-main-params-dtype", dtype), ("--megatron-fsdp-main-grads-dtype", None)):
        v = f.get(flag)
        if v is not None and v not in ("fp32", "bf16", "fp16", "auto"):
            raise AcesoError(f"{flag} {v}: choose fp32, bf16, fp16 or auto")
        if v is not None and fsdp is None:
            raise AcesoError(f"{flag} without --use-megatron-fsdp does nothing; add it or drop the flag")
        v = auto if v == "auto" else v
        out.append(None if v == ("fp32" if auto else None) else v)
    return out[0], out[1]


def _precision_aware(f: Flags, optimizer: str, dist_opt: bool, fsdp: bool):
    """``--use-precision-aware-optimizer`` and its dtypes (``search/settings/optimizer_state.py``), refused in one
    line where megatron-core's ``OptimizerConfig`` asserts."""
    try:
        pa = pa_from_flags(f.has(PA_FLAG), {flag: f.get(flag) for flag in PA_DTYPE_FLAGS})
    except ValueError as e:
        raise AcesoError(str(e)) from None
    if (why := pa_refusal(pa, optimizer, dist_opt, fsdp)):
        raise AcesoError(why)
    return pa


def _overlap_p2p(f: Flags, pp: int, vpp: int, notes: list[str]) -> bool | None:
    """``--no-overlap-p2p-communication`` (``PlanSettings.overlap_p2p_comm`` False: the interleaved schedule's p2p
    synchronous and batched, ``batch_p2p_comm = not overlap_p2p_comm``, core_v0.19.0 training/argument_utils.py:307);
    None where the flag is not given. Megatron-LM's validate_args (core_v0.16.1 arguments.py:573-590, core_v0.19.0
    arguments.py:966-985): without virtual stages it turns the overlap off anyway; with them and the overlap off it
    asserts pp > 2."""
    if not f.has("--no-overlap-p2p-communication"):
        return None
    if vpp == 1:
        notes.append("--no-overlap-p2p-communication without virtual stages does nothing (Megatron-LM overlaps p2p "
                     "only in the interleaved schedule)")
        return None
    if sync_p2p_refused(False, pp, vpp):
        raise AcesoError(f"--no-overlap-p2p-communication with --pipeline-model-parallel-size {pp} and virtual "
                         "stages: Megatron-LM asserts pp > 2 (several batched sends between the same two ranks); "
                         "drop the flag or use pp > 2")
    return False


def _data_parallel(f: Flags, ogr: bool, fsdp):
    """The DP synchronization flags (``search/settings/data_parallel.py``), with Megatron-LM's checks."""
    bucket, num = f.get("--ddp-bucket-size"), f.get("--ddp-num-buckets")
    if bucket is not None and bucket <= 0:
        raise AcesoError(f"--ddp-bucket-size {bucket}: give a positive number of parameters per bucket")
    # Megatron-LM's asserts (core_v0.16.1 training.py:1299-1302; core_v0.18.2 on: DistributedDataParallelConfig)
    if num is not None and num <= 0:
        raise AcesoError(f"--ddp-num-buckets {num}: must be greater than 0 (Megatron-LM asserts it)")
    if num is not None and bucket is not None:
        raise AcesoError("--ddp-num-buckets with --ddp-bucket-size: Megatron-LM asserts \"Cannot specify both\"; "
                         "give one of them")
    if fsdp and (f.has("--use-tp-pp-dp-mapping") or f.has("--use-sharp")):
        raise AcesoError("--use-tp-pp-dp-mapping / --use-sharp with --use-megatron-fsdp: aceso prices them for DDP "
                         "and the distributed optimizer; drop the flag")
    return dp_from_flags(bucket if ogr else None, f.has("--no-align-grad-reduce"), f.has("--no-align-param-gather"),
                         f.has("--use-tp-pp-dp-mapping"), f.has("--use-sharp"), num if ogr else None)


def _low_precision(f: Flags, dtype: str, sharded: bool) -> LowPrecision | None:
    """The recipe of ``--fp8-format/--fp8-recipe`` / ``--fp4-format/--fp4-recipe`` (search/settings/precision.py), with
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
    start = f.value("--num-layers-at-start-in-bf16") if first_last else 0
    end = f.value("--num-layers-at-end-in-bf16") if first_last else 0
    # Megatron-LM's validate_args resets it under Megatron FSDP (arguments.py: "if args.use_megatron_fsdp:
    # args.reuse_grad_buf_for_mxfp8_param_ag = False")
    reuse = f.has(REUSE_FLAG) and not f.has("--use-megatron-fsdp")
    why = reuse_grad_buf_check(recipe, gather, reuse)
    if why:
        raise AcesoError(why)
    return LowPrecision(recipe=recipe, param_gather=gather, bf16_layers_start=start, bf16_layers_end=end,
                        reuse_grad_buf=reuse)


def _fsdp(f: Flags, notes: list[str]) -> str | None:
    """Megatron FSDP's sharding strategy (not given: the release's default, ``no_shard`` before 0.18,
    ``optim_grads_params`` from 0.18), or None (DDP); Megatron-LM's checks (``search/settings/fsdp.py``)."""
    strategy = f.value("--data-parallel-sharding-strategy")
    if strategy not in STRATEGIES:
        raise AcesoError(f"--data-parallel-sharding-strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if not f.has("--use-megatron-fsdp"):
        if f.has("--data-parallel-sharding-strategy") and strategy != "no_shard":
            notes.append(f"--data-parallel-sharding-strategy {strategy} without --use-megatron-fsdp does nothing "
                         "(DDP runs)")
        return None
    fmt = f.value("--ckpt-format")
    if fmt != "fsdp_dtensor":
        raise AcesoError(f"--use-megatron-fsdp with --ckpt-format {fmt}: {f.release.label} asserts that Megatron "
                         "FSDP only supports the fsdp_dtensor checkpoint format; add --ckpt-format fsdp_dtensor")
    if not f.has("--data-parallel-sharding-strategy"):
        notes.append(f"--use-megatron-fsdp without --data-parallel-sharding-strategy: {f.release.label}'s default, "
                     f"{strategy}")
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


# megatron-core TransformerConfig: the modules selective recompute accepts (0.16.1 to 0.18.x), and those added since
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
MODULES_SINCE = {"gdn_norm_out": (0, 19)}
PLAN_MODULES = ("core_attn", "moe_act", "mla_up_proj")   # those a plan's per-unit choices say (megatron/recompute.py)


def _recompute(f: Flags, notes: list[str], moe=None) -> Recompute:
    mla = f.has("--multi-latent-attention")
    gran = "selective" if f.has("--recompute-activations") else f.get("--recompute-granularity")
    method, n = f.get("--recompute-method"), f.get("--recompute-num-layers")
    modules = f.get("--recompute-modules")
    if f.has("--moe-layer-recompute"):
        # megatron-core core_v0.16.1 to core_v0.19.0 TransformerConfig: the deprecated spelling of selective 'moe'
        # (granularity selective, 'moe' appended to the modules, which default to core_attn first); raises with full
        if gran == "full":
            raise AcesoError("--moe-layer-recompute with --recompute-granularity full: megatron-core's "
                             "TransformerConfig raises; use one of them")
        gran = "selective"
        modules = list(modules if modules is not None else ["core_attn"])
        modules += [] if "moe" in modules else ["moe"]
    if gran is None:
        if method or n is not None or modules:
            notes.append("--recompute-method/-num-layers/-modules without --recompute-granularity do nothing")
        return Recompute()
    if gran == "selective":
        if method is not None or n is not None:
            raise AcesoError("--recompute-granularity selective takes no --recompute-method / --recompute-num-layers "
                             "(Megatron-LM asserts it)")
        modules = modules if modules is not None else ["core_attn"]
        known = MODULES + tuple(m for m, since in MODULES_SINCE.items() if f.release.version >= since)
        bad = [x for x in modules if x not in known]
        if bad:
            raise AcesoError(f"--recompute-modules {bad[0]}: not a module of megatron-core {f.release.series} "
                             f"({', '.join(known)})")
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
