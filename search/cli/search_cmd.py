"""Search the best parallel plan (Aceso's iterative bottleneck alleviation + exact refinements).

Example: aceso search --model gpt-1.3b --cluster 1x8-h100 --global-batch-size 512 -o plan.json

--target aceso (default) plans for the aceso runtime (per-stage shapes, unit cuts, per-unit recompute);
--target megatron-lm (or megatron-bridge) searches only what stock Megatron-LM can run (``aceso export --to
megatron-lm``), priced as that framework runs the exported flags: with bf16 gradients reduced in fp32, its
default, or in bf16 with --grad-reduce-in-bf16 (the export then writes that flag). The plan records the settings it
was priced under (``settings``; ``plan_settings.py``). Every
report prints three lines: the best uniform Megatron config, the best Megatron-LM plan and the best heterogeneous
plan; a line whose target runs no plan of the model says why it is not offered, and a --target that runs none is
refused before searching (search/targets/capabilities.py). The budget is counted in plan evaluations (--budget-evals), so
the same inputs and --seed give the same plan on any machine, and more budget never a slower one from a search round (an MoE search whose final step picks another dispatcher or EP overlap searches again under it, seeded with its best plan, up to 2 more rounds: docs/search.md); --budget-s adds a wall-clock cap (then results may depend on the CPU). Ctrl-C stops the search and
writes the best plan found so far (SIGTERM too). Exit 2 when nothing fits, with what would make it fit.

Words: a unit is half a transformer layer (its attention or its MLP half; a T5 decoder layer has three), the
granularity of stage boundaries and recompute. The plan's micro-batch is the pipeline micro-batch: a stage with
data parallelism dp runs micro-batch / dp samples per rank (mbs/rank, Megatron-LM's --micro-batch-size); the
--micro-batch-sizes candidates are per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import plots
from search.io.argtypes import positive_float, positive_int, seed
from search.io.errors import AcesoError
from search.settings.precision import PRECISIONS
from .common import (add_calibration_arg, add_cluster_args, add_model_args, add_release_arg, check_output,
                     cluster_from_args, model_from_args, release_of, write_outputs)

DEFAULT_BUDGET = 4000
LONG_SEQUENCE = 8192          # context parallelism is a candidate by default from this many tokens on
DEFAULT_CP = [1, 2, 4, 8]
DEFAULT_VIRTUAL = None        # model chunks per stage: every degree Megatron-LM accepts (space.virtual_degrees)
SWITCH = {"auto": None, "on": True, "off": False}
# --target -> space (megatron-bridge: the Megatron-LM space, each plan also passing Bridge's capability rules)
SPACE_TARGET = {"aceso": "aceso", "megatron-lm": "megatron-lm", "megatron-bridge": "megatron-bridge"}


def add_training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch-size", type=positive_int, required=True, help="samples per optimizer step")
    p.add_argument("--micro-batch-sizes", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="candidate PER-RANK micro-batch sizes, Megatron-LM's --micro-batch-size (default 1 2 4 8); "
                        "a stage with DP d runs pipeline micro-batches of size * d samples")
    p.add_argument("--sequence-parallel", choices=tuple(SWITCH), default="auto",
                   help="sequence parallelism on tp > 1 stages: auto (searched, default), on, off")
    p.add_argument("--context-parallel-sizes", "--cp", type=positive_int, nargs="+", default=None,
                   help=f"candidate context-parallel degrees (default: 1, and {' '.join(map(str, DEFAULT_CP[1:]))} "
                        f"from {LONG_SEQUENCE} tokens on)")
    p.add_argument("--virtual-stages", "--vpp", type=positive_int, nargs="+", default=DEFAULT_VIRTUAL,
                   help="candidate model chunks per pipeline stage, interleaved 1F1B (default: every degree "
                        "Megatron-LM accepts, up to one layer per chunk; 1 = off)")
    p.add_argument("--tp", type=positive_int, nargs="+", default=None,
                   help="allowed tensor-parallel degrees (default: every power of two within a node that divides "
                        "the heads, query groups and FFN)")
    p.add_argument("--max-tp", type=positive_int, default=None, help="largest tensor-parallel degree allowed")
    p.add_argument("--pp", type=positive_int, nargs="+", default=None,
                   help="allowed numbers of pipeline stages (default: all)")
    p.add_argument("--seq-length", type=positive_int, default=None, help="override the model's sequence length "
                   "(T5: the encoder's)")
    moe = p.add_argument_group("MoE models", "Every stage's expert shape ep x etp is searched (etp 1 or the "
                               "stage's tp, ep\nany divisor of the experts and of the stage's GPUs / etp), and one "
                               "token dispatcher\nfor the whole plan (its finalists priced under each); these "
                               "options narrow that\n(docs/search.md, 'MoE').")
    moe.add_argument("--ep", type=positive_int, nargs="+", default=None, dest="expert_parallel_sizes", metavar="EP",
                     help="allowed expert-parallel degrees (each must divide the model's experts)")
    moe.add_argument("--max-ep", type=positive_int, default=None, dest="max_expert_parallel", metavar="EP",
                     help="largest expert-parallel degree allowed")
    moe.add_argument("--etp", type=positive_int, nargs="+", default=None, dest="expert_tensor_parallel_sizes",
                     metavar="ETP", help="allowed expert tensor-parallel degrees (1, or a stage's tp)")
    moe.add_argument("--dispatcher", choices=("alltoall", "allgather", "flex"), nargs="+", default=None,
                     dest="token_dispatchers",
                     help="token dispatchers the plan may use, the first searched under (default: alltoall, then "
                          "allgather and, on GPUs, flex = DeepEP / HybridEP); --dispatcher alltoall allgather keeps "
                          "DeepEP and HybridEP out")
    moe.add_argument("--moe-router-dtype", choices=("fp32", "fp64", "model"), default=None,
                     help="the router's gating GEMM and scores in this dtype in every plan (Megatron-LM "
                          "--moe-router-dtype: numerics, not searched; default fp32, as every Megatron-Bridge MoE "
                          "recipe and NVIDIA's published MoE runs; model: the model's dtype, Megatron-LM's default)")
    moe.add_argument("--moe-hybridep-num-sms", type=int, choices=(16, 32), default=None,
                     help="SMs of HybridEP's dispatch / combine kernels in every plan that uses HybridEP (flex "
                          "dispatcher; Megatron-LM --moe-hybridep-num-sms: a tuning, not searched; 16 or 32, "
                          "HybridEP's published rates; default: the release's)")
    dp = p.add_argument_group("Data-parallel and pipeline tuning", "Megatron-LM's flags, kept in every plan (not "
                              "searched; search/settings/data_parallel.py):\nthe DDP buckets, the schedule's "
                              "alignment of the DP collectives, the rank order,\nSHARP and the interleaved "
                              "schedule's p2p overlap.")
    dp.add_argument("--ddp-bucket-size", type=positive_int, default=None, metavar="N",
                    help="parameters per DDP bucket (default: megatron-core's max(40M, 1M x dp))")
    dp.add_argument("--ddp-num-buckets", type=positive_int, default=None, metavar="N",
                    help="each rank's bucket size is its parameter count // N (not with --ddp-bucket-size; "
                         "--target megatron-lm)")
    dp.add_argument("--no-align-grad-reduce", action="store_true",
                    help="each pipeline rank launches its gradient reduction itself, not aligned by the schedule")
    dp.add_argument("--no-align-param-gather", action="store_true",
                    help="the interleaved schedule does not gather the next chunk's parameters at a chunk's first "
                         "forward")
    dp.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                    help="megatron-core rank order tp-cp-ep-pp-dp (--target megatron-lm, dense models)")
    dp.add_argument("--use-sharp", action="store_true",
                    help="InfiniBand SHARP for the DP x CP groups (--target megatron-lm)")
    dp.add_argument("--no-overlap-p2p-communication", action="store_true",
                    help="the interleaved schedule's p2p synchronous and batched (Megatron-LM then runs virtual "
                         "stages on more than 2 pipeline stages only)")
    p.add_argument("--distributed-optimizer", choices=tuple(SWITCH), default="auto",
                   help="shard optimizer states over DP: auto (searched, default), on, off")
    p.add_argument("--overlap", choices=tuple(SWITCH), default="auto",
                   help="overlap the DP gradient reduce-scatter and the distributed optimizer's parameter "
                        "all-gather with compute: auto (searched, default), on, off")
    p.add_argument("--megatron-fsdp", choices=tuple(SWITCH), default="auto",
                   help="Megatron FSDP, strategies optim_grads_params / optim_grads (--target megatron-lm): auto "
                        "(searched, default), on, off")
    p.add_argument("--activation-offload", choices=tuple(SWITCH), default="auto",
                   help="CPU activation offload of the first layers (--target megatron-lm, one stage, no recompute): "
                        "auto (where nothing fits without recompute, default), on (allowed), off")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="transformer-engine's TP communication overlap (needs sequence parallelism; off by default)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="training precision (default: the model's params_dtype); fp8-* / mxfp8 / nvfp4: the linear "
                        "layers' GEMMs in FP8 / FP4 (search/settings/precision.py), the rest bf16")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="low precision: parameters kept quantized, all-gathered quantized (Megatron-LM "
                        "--fp8-param-gather; needs the distributed optimizer)")
    p.add_argument("--bf16-layers", type=int, nargs=2, metavar=("START", "END"), default=(0, 0),
                   help="low precision: the first START and last END transformer layers in bf16 (Megatron-LM "
                        "--first-last-layers-bf16)")
    p.add_argument("--te-precision-config-file", metavar="FILE", default=None,
                   help="low precision: megatron-core's per-module precision overrides (the YAML Megatron-LM's "
                        "--te-precision-config-file reads; search/settings/precision_overrides.py), priced per "
                        "linear and written by the Megatron-LM export")
    from search.settings.optimizer_state import MAIN_DTYPES, STATE_DTYPES
    p.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="megatron-core's precision-aware optimizer in every plan (Megatron-LM's flag: numerics, not "
                        "searched; needs Adam and the distributed optimizer, which it turns on, Megatron FSDP off), "
                        "its state dtypes below (search/settings/optimizer_state.py)")
    p.add_argument("--main-params-dtype", choices=MAIN_DTYPES, default=None,
                   help="with --use-precision-aware-optimizer: the master weights' dtype (default fp32)")
    p.add_argument("--exp-avg-dtype", choices=STATE_DTYPES, default=None,
                   help="with --use-precision-aware-optimizer: Adam's first moment's dtype (default fp32)")
    p.add_argument("--exp-avg-sq-dtype", choices=STATE_DTYPES, default=None,
                   help="with --use-precision-aware-optimizer: Adam's second moment's dtype (default fp32)")
    p.add_argument("--optimizer", choices=("adam", "muon", "dist_muon"), default="adam",
                   help="the optimizer the plan runs, priced as itself (Megatron-LM --optimizer; muon / dist_muon: "
                        "--target megatron-lm, the aceso runtime runs Adam only)")
    p.add_argument("--cost-model", choices=("analytic", "profile", "aceso-compat"), default="analytic",
                   help="analytic (default), profile (--db profile database) or aceso-compat (--db Aceso database)")
    add_release_arg(p)
    p.add_argument("--db", default=None, help="database for --cost-model profile / aceso-compat")
    p.add_argument("--attention", choices=("auto", "flash", "unfused"), default="auto",
                   help="analytic model: attention kernel the runtime will use (flash = transformer-engine installed; "
                        "unfused = without it; auto = flash on A100/H100/H200)")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=tuple(SPACE_TARGET), default="aceso",
                   help="aceso: plans for the aceso runtime (default); megatron-lm / megatron-bridge: only what "
                        "stock Megatron-LM can run (uniform shapes, layer cuts, Megatron's recompute settings), "
                        "priced as that framework runs the exported flags (bf16: gradients reduced in fp32); each "
                        "target's limits apply to it only (search/targets/capabilities.py)")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="--target megatron-lm/-bridge with bf16: price gradients reduced in bf16; the export then "
                        "writes Megatron-LM's --grad-reduce-in-bf16 (Bridge: ddp.grad_reduce_in_fp32 false)")


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """What search and baseline share: the model, cluster, calibration, training and target."""
    add_model_args(p)
    add_cluster_args(p)
    add_calibration_arg(p)
    add_training_args(p)
    add_target_args(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..planner.aceso import MIN_PER_COUNT
    add_problem_args(p)
    p.add_argument("--budget-evals", type=positive_int, default=DEFAULT_BUDGET,
                   help=f"plan evaluations of the target's search over all stage counts (default {DEFAULT_BUDGET}; "
                        f"at least {MIN_PER_COUNT} per stage count, so a small budget evaluates more; the other "
                        "search of the report gets a quarter)")
    p.add_argument("--budget-s", type=positive_float, default=None, help="optional wall-clock cap, seconds")
    p.add_argument("--top-k", type=positive_int, default=1,
                   help="also write the k-1 next best plans (PLAN.top2.json ...)")
    p.add_argument("--seed", type=seed, default=0, help="seed (the search is deterministic for a given seed)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="worker processes over stage counts (default: CPU count, at most 8; results do not "
                        "depend on it)")
    p.add_argument("--trace", default=None, help="write the accepted moves as JSON to this file")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    plots.add_arguments(p, "the accepted moves and the final comparison")
    p.add_argument("-o", "--output", default=None, help="write the best plan (ParallelPlan JSON) here; - = stdout")


def target_precision(dtype: str, gpu, target: str = "aceso") -> tuple[str, str | None]:
    """The precision a search without ``--precision`` plans a ``dtype`` model in on ``gpu`` for ``target``, and
    why it is not ``dtype`` (None when it is): a bf16 model on a GPU without bf16 (V100) plans in fp16; an fp16
    model (the GPT presets, Aceso's V100 dtype) for the aceso runtime plans in bf16 where the GPU has it, since the
    runtime has no fp16 loss scaling (the capability table's precision row)."""
    from search.targets.capabilities import precision_refusal
    from search.settings.precision import plain_dtype
    if dtype == "bf16" and plain_dtype(gpu) != "bf16":
        return plain_dtype(gpu), f"the {gpu.name} has no bf16"
    if precision_refusal(target, dtype, gpu) is not None:
        return "bf16", f"the aceso runtime trains in bf16 on the {gpu.name} (no fp16 loss scaling yet)"
    return dtype, None


def default_precision(args, model, gpu) -> str:
    """``--precision``, else the model's params_dtype as the target trains it on ``gpu`` (``target_precision``; an
    explicit ``--precision bf16`` on a V100 is refused by ``precision.check``)."""
    return args.precision or target_precision(model.params_dtype, gpu, getattr(args, "target", "aceso"))[0]


def precision_note(args, model, gpu) -> str | None:
    """The note saying why the search plans in another dtype than the model's (``target_precision``), or None."""
    if args.precision:
        return None
    dtype, why = target_precision(model.params_dtype, gpu, getattr(args, "target", "aceso"))
    if why is None:
        return None
    article = "an" if model.params_dtype.startswith("f") else "a"
    return f"{model.name} is {article} {model.params_dtype} model and {why}: planning {dtype} (--precision sets it)"


def runtime_cp_note(args, model) -> str | None:
    """The note saying that the heterogeneous search leaves out the --cp degrees asked for (None: it searches them):
    the aceso runtime does not run the model's Mamba-2 / GDN layers under context parallelism yet
    (``layers.kind.without_runtime_cp``, its cp 1 in ``planner.space``); the Megatron-LM lines search them."""
    from search.layers.kind import without_runtime_cp
    if (getattr(args, "command", None) or "search") != "search":
        return None
    asked = [c for c in (getattr(args, "context_parallel_sizes", None) or []) if c > 1]
    kinds = without_runtime_cp(model) if asked else ()
    if not kinds:
        return None
    return (f"--cp {' '.join(map(str, asked))}: the aceso runtime does not run {kinds[0].no_runtime_cp} under context "
            "parallelism yet, so the heterogeneous plans use cp 1; the Megatron-LM lines search it")


def training_from_args(args, model, gpu=None):
    import pydantic

    from search.io.errors import format_validation_error
    from search.spec.training import TrainingSpec
    if args.global_batch_size < 1:
        raise AcesoError(f"--global-batch-size ({args.global_batch_size}) must be at least 1")
    dist = SWITCH[args.distributed_optimizer]
    overlap = SWITCH[args.overlap]
    fsdp = SWITCH[args.megatron_fsdp]
    if args.optimizer != "adam":    # megatron-core's rules (search/megatron/stack_flags.py reads them from flags)
        for on, flag, why in ((dist, "--distributed-optimizer on", "'muon with dist optimizer is not supported'"),
                              (fsdp, "--megatron-fsdp on", "'Emerging optimizer does not support Megatron-FSDP'")):
            if on:
                raise AcesoError(f"--optimizer {args.optimizer} with {flag}: megatron-core refuses it ({why}); "
                                 f"drop {flag} (dist_muon shards the states layer-wise)")
        dist, fsdp = False, False
    if precision_aware_of(args) is not None:       # megatron-core: Adam with the distributed optimizer only
        why = ("--optimizer " + args.optimizer if args.optimizer != "adam" else "--distributed-optimizer off"
               if dist is False else "--megatron-fsdp on" if fsdp else None)
        if why:
            raise AcesoError(f"--use-precision-aware-optimizer with {why}: megatron-core runs it with Adam and the "
                             "distributed optimizer only (optimizer_config.py asserts it); drop one of them")
        dist, fsdp = True, False        # (not searched: a Megatron FSDP plan would carry a setting it refuses)
    cps = args.context_parallel_sizes or ([1] if model.seq_length < LONG_SEQUENCE else DEFAULT_CP)
    tps = args.tp
    if args.max_tp is not None:
        tps = [t for t in (tps or [1 << k for k in range(args.max_tp.bit_length())]) if t <= args.max_tp]
        if not tps:
            raise AcesoError(f"--tp {' '.join(map(str, args.tp))} --max-tp {args.max_tp}: no tensor-parallel "
                             "degree is left; raise --max-tp or add a smaller --tp")
    try:
        return TrainingSpec(global_batch_size=args.global_batch_size, micro_batch_sizes=args.micro_batch_sizes,
                            precision=default_precision(args, model, gpu) if gpu else args.precision or
                            model.params_dtype, attention=args.attention,
                            fp8_param_gather=args.fp8_param_gather, bf16_layers_start=args.bf16_layers[0],
                            bf16_layers_end=args.bf16_layers[1], per_module=per_module_of(args),
                            sequence_parallel=SWITCH[args.sequence_parallel],
                            distributed_optimizer=True if args.fp8_param_gather and dist is None else dist,
                            overlap_grad_reduce=overlap,
                            overlap_param_gather=(overlap and dist if overlap else overlap) if dist is not False
                            else False,
                            tp_comm_overlap=args.tp_comm_overlap, context_parallel_sizes=cps,
                            virtual_stages=args.virtual_stages, tensor_parallel_sizes=tps,
                            pipeline_parallel_sizes=args.pp, megatron_fsdp=fsdp,
                            expert_parallel_sizes=args.expert_parallel_sizes,
                            max_expert_parallel=args.max_expert_parallel,
                            expert_tensor_parallel_sizes=args.expert_tensor_parallel_sizes,
                            token_dispatchers=_unique(args.token_dispatchers),
                            moe_router_dtype=router_dtype(args.moe_router_dtype, model), optimizer=args.optimizer,
                            moe_hybridep_num_sms=args.moe_hybridep_num_sms,
                            activation_offload=SWITCH[args.activation_offload])
    except pydantic.ValidationError as e:
        raise AcesoError(format_validation_error(e)) from None


def router_dtype(asked: str | None, model) -> str | None:
    """The router dtype every plan of an MoE model runs (``--moe-router-dtype``): fp32 unless asked otherwise (every
    Megatron-Bridge MoE recipe sets ``moe_router_dtype`` fp32, and so do NVIDIA's published MoE runs,
    ../shared/published/); ``model``: the model's dtype (None: Megatron-LM's default). A dense model has no router:
    none by default, and a dtype asked for is passed on for the training spec to refuse."""
    if asked == "model" or (asked is None and model.moe is None):
        return None
    return asked or "fp32"


def _unique(values):
    """``values`` without repeats, in order (None stays None)."""
    return None if values is None else list(dict.fromkeys(values))


def settings_from_args(args, training, model):
    """The ``PlanSettings`` the search prices under: how the target (``--target``, ``--release``: for
    megatron-bridge, the release its export runs, ``bridge_release``) runs a plan of the training spec's recipe
    (``plan_settings.target_settings``), ``--grad-reduce-in-bf16``."""
    from search.settings.plan_settings import PlanSettings, Target, target_settings
    from search.settings.precision import of_training
    target = getattr(args, "target", "aceso")
    bf16_reduce = getattr(args, "grad_reduce_in_bf16", False)
    if bf16_reduce and (target == "aceso" or training.dtype != "bf16"):
        raise AcesoError("--grad-reduce-in-bf16 is for --target megatron-lm / megatron-bridge with bf16 (the aceso "
                         f"runtime reduces in the parameter dtype; this search is --target {target} --precision "
                         f"{training.precision}); drop it")
    rel = bridge_release(args, model) if target == "megatron-bridge" else release_of(args)
    pa = precision_aware_of(args)
    settings = target_settings(Target.of(target, rel),
                               PlanSettings(low_precision=of_training(training), optimizer=training.optimizer,
                                            **({"precision_aware_optimizer": pa, "distributed_optimizer": True} if pa
                                               else {})),
                               training.dtype, bf16_reduce)
    return settings.model_copy(update={"data_parallel": data_parallel_of(args, target),
                                       "overlap_p2p_comm": False if getattr(args, "no_overlap_p2p_communication",
                                                                            False) else None})


def data_parallel_of(args, target: str = "aceso"):
    """The DP tuning every plan of the search runs (``--ddp-bucket-size`` ... ``--use-sharp``, read as the import
    reads Megatron-LM's: ``data_parallel.from_flags``), or None; refused in one line where ``target`` runs no plan
    with it (the aceso runtime: ``data_parallel.runtime_refusal``; Megatron-Bridge: the fields its export has,
    ``names.bridge_ddp_fields``)."""
    import pydantic

    from search.io.errors import format_validation_error
    from search.settings.data_parallel import FLAGS, from_flags, runtime_refusal
    try:
        d = from_flags(getattr(args, "ddp_bucket_size", None), getattr(args, "no_align_grad_reduce", False),
                       getattr(args, "no_align_param_gather", False), getattr(args, "use_tp_pp_dp_mapping", False),
                       getattr(args, "use_sharp", False), getattr(args, "ddp_num_buckets", None))
    except pydantic.ValidationError as e:
        raise AcesoError("--ddp-bucket-size with --ddp-num-buckets: " + format_validation_error(e)) from None
    why = runtime_refusal(d) if target == "aceso" else None
    if why is not None:
        raise AcesoError(f"{FLAGS[why[0]]} with --target aceso: {why[1]}; search with --target megatron-lm, or drop "
                         "it")
    if target == "megatron-bridge":
        from search.megatron.config import NotExpressible
        from search.megatron.names import bridge_ddp_fields
        try:
            bridge_ddp_fields(d)
        except NotExpressible as e:
            raise AcesoError(f"--target megatron-bridge: {e}") from None
    return d


def precision_aware_of(args):
    """The precision-aware optimizer the search's plans run (``--use-precision-aware-optimizer`` and its dtypes,
    megatron-core's rules: ``optimizer_state.from_flags``), or None."""
    from search.settings.optimizer_state import FLAG_FIELDS, from_flags
    dtypes = {flag: getattr(args, name, None) for flag, name in FLAG_FIELDS.items()}
    try:
        return from_flags(getattr(args, "use_precision_aware_optimizer", False), dtypes)
    except ValueError as e:
        raise AcesoError(str(e).splitlines()[0]) from None


def bridge_release(args, model) -> str:
    """The release a ``--target megatron-bridge`` search prices: the megatron-core of the Megatron-Bridge that
    ``aceso export --to megatron-bridge`` writes for (v0.3.1: 0.16, container 26.02.01; a hybrid model only v0.6.0
    builds: 0.19; ``bridge_hybrid.model_core``), which its import prices too; a candidate whose form is v0.6.0's is
    priced at 0.19 by the search itself (``planner/bridge_release.py``). A ``--release`` of another container
    would price what the YAML does not run: refused, naming the one it runs."""
    from search.settings.releases import resolve
    from ..megatron.bridge_hybrid import BRIDGE, PIPES, PIPES_CORE, model_core
    core = model_core(model)
    given = release_of(args)
    if given is not None and resolve(given)[0] != resolve(core)[0]:
        bridge = PIPES if core == PIPES_CORE else BRIDGE
        raise AcesoError(f"--release {given} with --target megatron-bridge: aceso exports {bridge} overrides, which "
                         f"run megatron-core {core} (priced as {resolve(core)[0]}); drop --release, or search with "
                         f"--target megatron-lm --release {given}")
    return core


def with_seq_length(model, n: int | None):
    """The model at sequence length ``n`` (``--seq-length``; T5: the encoder's), validated as a spec file is."""
    if n is None or n == model.seq_length:
        return model
    import pydantic

    from search.io.errors import format_validation_error
    from search.spec.model import ModelSpec
    try:
        return ModelSpec.model_validate({**model.model_dump(), "seq_length": n})
    except pydantic.ValidationError as e:
        raise AcesoError(f"--seq-length {n}: " + format_validation_error(e)) from None


def setup(args, model=None, runtime: bool = False):
    """model, cluster, training, cost model from the shared arguments (``model``: instead of ``--model``'s, e.g.
    explain's imported one); refuses a target that runs no plan of the model (``capabilities.model_refusal``); says
    once on stderr which stage shapes the cost model does not cover (aceso-compat: unprofiled (per-GPU batch, tp)
    files), which plans then skip. ``runtime``: the plan is for the aceso runtime (``api.runtime_training``: no
    Megatron FSDP or activation offload), in the training spec the cost model carries too."""
    from search.targets.capabilities import model_refusal
    from ..planner.api import describe_dropped, runtime_training, search_space
    from search.pricing import cost_model
    from search.settings.precision import of_training
    model = with_seq_length(model if model is not None else model_from_args(args), args.seq_length)
    cluster = cluster_from_args(args)
    training = training_from_args(args, model, cluster.gpu)
    target = getattr(args, "target", "aceso")
    why = model_refusal(target, model, of_training(training), training.dtype, cluster.gpu, training.optimizer,
                        precision_aware_of(args))
    if why is not None:
        raise AcesoError(why)
    if target == "aceso":
        runtime_training(training)     # Megatron FSDP / activation offload asked for: one line naming the target
    if runtime:
        training = runtime_training(training)
    cm = cost_model(model, cluster, training, settings_from_args(args, training, model), args.cost_model, args.db)
    if args.cost_model != "aceso-compat":     # (compat keeps the reference planner's own limit)
        from ..costmodel.memory import memory_budget_mb
        cm.memory_limit_mb = memory_budget_mb(cm.memory_limit_mb, args.memory_headroom)
    for note in (describe_dropped(search_space(cm, training, SPACE_TARGET[target])),
                 (f"note: {n}" if (n := precision_note(args, model, cluster.gpu)) else None),
                 (f"note: {n}" if (n := runtime_cp_note(args, model)) else None)):
        if note:
            print(f"aceso {getattr(args, 'command', None) or 'search'}: {note}", file=sys.stderr)
    return model, cluster, training, cm


def runnable(found: list, keep: int, target: str = "aceso") -> tuple:
    """The search's output check: of ``(evaluation, plan)`` best first, the first ``keep`` that ``target`` runs (the
    one pre-flight, ``search.targets.preflight``, for that target); the best of them and their plans. None runs: the first
    refusal, one line."""
    from search.targets.capabilities import target_key
    from search.targets.preflight import preflight

    who = {"runtime": "the runtime", "megatron-lm": "Megatron-LM", "megatron-bridge": "Megatron-Bridge"}[target_key(target)]
    kept, refusal, unchecked = [], None, False
    for ev, plan in found:
        if len(kept) == keep:
            break
        try:
            unchecked |= not preflight(plan, target=target)
            kept.append((ev, plan))
        except AcesoError as e:
            refusal = refusal or e
    if not kept:
        raise AcesoError(f"the search found no plan {who} runs: {refusal}")
    if refusal is not None:
        print(f"aceso search: note: left out plan(s) {who} would refuse: {refusal}", file=sys.stderr)
    if unchecked:   # the capability table applied; what needs torch could not be asked here
        print("aceso search: note: the pre-flight ran the capability table's rules only: the runtime is not installed "
              "here, or lacks what the plan's GPUs run (transformer-engine; megatron-core 0.19 for a hybrid model), "
              "so the plan's layer specs and megatron block were not built (aceso validate on a machine with the "
              "runtime, or the workers at launch, check them)", file=sys.stderr)
    return kept[0][0], [plan for _, plan in kept]


@dataclass
class Found:
    """What one ``aceso search`` found: the report's three lines (``plans``), the target's search (``result``), the
    best plan the target runs (``best``, its evaluation) and the plans ``-o`` writes, best first."""

    plans: object
    result: object
    best: object
    out_plans: list
    model: object
    cluster: object
    training: object
    cm: object


def per_module_of(args: argparse.Namespace) -> tuple:
    """The search's per-module precision overrides: ``args.per_module`` where a caller holds them already
    (``explain --megatron-args``: the imported script's), else ``--te-precision-config-file`` read (one line when it
    cannot be), else none."""
    if getattr(args, "per_module", None):
        return tuple(args.per_module)
    path = args.te_precision_config_file
    if path is None:
        return ()
    from search.settings.precision_overrides import read_file
    try:
        return read_file(path)
    except ValueError as e:
        raise AcesoError(str(e).splitlines()[0]) from None


def find(args: argparse.Namespace, model=None, quiet: bool = False) -> Found:
    """The search of ``aceso search ARGS`` (``args`` as its parser makes them): everything but the outputs.
    ``explain --megatron-args`` runs this very function on the command line it prints (``model``: the imported
    model when it is no preset), so its lines are what that command returns."""
    from ..planner import report
    from ..planner.aceso import SearchOptions
    from ..planner.api import plan_all, total_budget

    model, cluster, training, cm = setup(args, model)
    for note in getattr(getattr(cm, "source", None), "warnings", []):   # what it cannot price (a custom layer)
        print(f"aceso search: note: {note}", file=sys.stderr)
    workers = args.workers or min(os.cpu_count() or 1, 8)
    with report.progress(total_budget(args.budget_evals), quiet=quiet or args.json) as tick:
        opts = SearchOptions(budget_evals=args.budget_evals, budget_s=args.budget_s, seed=args.seed,
                             workers=workers, callback=tick)
        plans = plan_all(cm, training, opts, top_k=args.top_k, target=SPACE_TARGET[args.target],
                         release=getattr(args, "release", None))
    result = plans.main
    best = result.plans[0] if result.plans else None
    if best is None and args.budget_s is not None and plans.uniform is not None:
        raise AcesoError(f"--budget-s {args.budget_s:g}: the search evaluated no plan in that time; raise it, or "
                         "drop it (--budget-evals alone bounds the search)")
    if best is None or not best.fits:
        raise AcesoError(report.infeasible_hint(best, cm, cluster, training, plans.space))
    settings = settings_from_args(args, training, model)
    # the best the search found first; the Megatron-LM-expressible and uniform plans (whole layers, one recompute
    # setting) after them, for when the target refuses every heterogeneous one (e.g. a custom layer that runs whole)
    found = [*result.plans, *(plans.megatron.plans if result is not plans.megatron else []),
             *([plans.uniform.evaluation] if plans.uniform is not None else [])]
    best, out_plans = runnable([(e, report.to_plan(e, model, cluster, training, cm, settings)) for e in found
                                if e.fits], keep=max(1, len([e for e in result.plans if e.fits])), target=args.target)
    return Found(plans, result, best, out_plans, model, cluster, training, cm)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``aceso search ARGV``'s arguments, parsed by its own parser (``explain`` runs the command it prints)."""
    from search.io.argparser import AcesoParser
    parser = AcesoParser(prog="aceso search")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command = "search"
    return args


def run(args: argparse.Namespace) -> int:
    from ..planner import report

    started = time.perf_counter()
    if args.budget_evals < 1:
        raise AcesoError(f"--budget-evals ({args.budget_evals}) must be at least 1")
    if args.top_k < 1:
        raise AcesoError(f"--top-k ({args.top_k}) must be at least 1")
    check_output(args.output)
    check_output(args.trace, "--trace")
    plots.target(args.plot, args.plot_format)   # before the search: a bad --plot or no matplotlib is exit 2
    f = find(args)
    plans, result, best, out_plans, cm = f.plans, f.result, f.best, f.out_plans, f.cm
    out = args.output
    files = [(out_plans[0].to_json(), out, "-o")] if out else []   # written as one: a failing --trace writes no plan
    if out and out != "-":
        p = Path(out)
        files += [(extra.to_json(), str(p.with_name(f"{p.stem}.top{k}{p.suffix}")), "-o")
                  for k, extra in enumerate(out_plans[1:], start=2)]
        if plans.pattern is not None and plans.pattern.fits:    # the |-pattern line: aceso export --hybrid-pattern
            # a Megatron-LM plan, also in a Bridge search (its report line: "Megatron-LM alternative"), at the
            # --release whose Megatron-LM ran the pattern's checks (None: the newest; api._pattern_line)
            pattern = report.to_plan(plans.pattern, f.model, f.cluster, f.training, cm, out_plans[0].settings
                                     .model_copy(update={"framework": "megatron-lm", "release": release_of(args)}))
            files.append((pattern.to_json(), str(p.with_name(f"{p.stem}.pattern{p.suffix}")), "-o"))
    if args.trace:
        files.append((json.dumps([m.as_dict() for m in result.moves], indent=2) + "\n", args.trace, "--trace"))
    write_outputs(files)
    mlm = plans.megatron.plans[0] if plans.megatron.plans and plans.megatron.plans[0].fits else None
    plots.draw_search(args, result, plans.uniform, out_plans[0], mlm.iteration_ms if mlm is not None else None)
    wall_s = time.perf_counter() - started
    summary = report.summary(out_plans[0], best, plans, result, cm, wall_s=wall_s)
    summary["target"] = getattr(args, "target", "aceso")    # the user's (the planner searches Bridge as Megatron-LM)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n") if out != "-" else None
    else:
        report.print_table(out_plans[0], best, plans, result, cm, file=sys.stderr if out == "-" else sys.stdout,
                           wall_s=wall_s)
    if result.interrupted or plans.aceso.interrupted or plans.megatron.interrupted:
        print("aceso search: interrupted; wrote the best plan found so far", file=sys.stderr)
        return 130
    return 0
