"""The Megatron-LM launch script (``aceso export --to megatron-lm``) and the one-line argument form (``--args-only``),
for one Megatron-LM release (``versions.Release``).

The script sets what megatron-core needs in the environment (``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tp or cp > 1
before Blackwell: ``validate_args`` asserts it; never with Megatron FSDP, which asserts the opposite;
``NVTE_CPU_OFFLOAD_V1=1`` with fine-grained activation offload, which ``validate_args`` asserts from
transformer-engine 2.10, core_v0.16.1 on), launches
``torchrun`` with the plan's world size and runs the release's ``pretrain_gpt.py`` (GPT, Llama) or
``pretrain_t5.py`` (``examples/t5/`` from 0.18) with the model, parallel, recompute, batch and precision arguments
in bash arrays, written by the names the release has (``Release.flag_name``) and as the release runs them (from
0.18 Megatron FSDP runs the distributed optimizer: the flag is written). ``TOKENIZER_ARGS`` is a NullTokenizer with
the plan's vocabulary (what ``aceso import`` reads back); it, ``DATA_ARGS`` and ``TRAINING_ARGS`` are placeholders
the user replaces (environment variables of those names override them); extra arguments pass through ``"$@"``.
"""

from __future__ import annotations

import dataclasses
import shlex

from .. import __version__
from search.io.errors import AcesoError
from search.spec.plan import ParallelPlan
from .arch_flags import release_refusal
from .config import MegatronConfig
from .versions import Release, having, release
from search.settings.fsdp import describe as fsdp_describe
from search.costmodel.plan_view import describe
from search.costmodel.throughput import throughput
from .names import grad_reduce_args, megatron_lm_args, tokenizer_args
from .stack_flags import INFERENCE_PAD, needs_inference_pad, release_stack_refusal

TRAINING_PLACEHOLDER = ("--train-iters 100 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 10 "
                        "--weight-decay 0.1 --clip-grad 1.0 --log-interval 10 --eval-iters 0")
GROUPS = ("model", "parallel", "recompute", "batch", "precision")


def as_run(c: MegatronConfig, rel: Release) -> MegatronConfig:
    """``c`` as ``rel`` runs it: from 0.18 Megatron FSDP turns the distributed optimizer on (validate_args), and
    the loss fusion is written as ``written_settings`` says."""
    settings = written_settings(c.settings, rel)
    if c.fsdp and rel.rule("fsdp_forces_distributed_optimizer") and not settings.distributed_optimizer:
        settings = settings.model_copy(update={"distributed_optimizer": True})
    return c if settings is c.settings else dataclasses.replace(c, settings=settings)


def written_settings(settings, rel: Release):
    """The plan's ``settings`` as the script for ``rel`` writes them: from 0.18 Megatron-LM refuses transformer-engine's
    cross-entropy fusion (``versions.RULES`` te_cross_entropy_refused), so a plan with it (a Bridge recipe's, an
    imported 0.16 / 0.17 line's) is written with megatron-core's native fusion, which ``aceso export``'s header then
    prices (``cli.export.as_written``)."""
    stack = settings.stack
    if stack is None or stack.cross_entropy_fusion != "te" or not rel.rule("te_cross_entropy_refused"):
        return settings
    return settings.model_copy(update={"stack": stack.model_copy(update={"cross_entropy_fusion": "native"})})


def arg_groups(c: MegatronConfig, rel: Release | None = None) -> dict[str, list[str]]:
    """``megatron_lm_args`` for ``rel`` (default the newest): its rules applied, its flag names; a flag the
    release does not have is refused (one line)."""
    rel = rel or release()
    why = release_refusal(c.model, rel)          # YaRN on standard attention: core_v0.19.0 on
    if why:
        raise AcesoError(why)
    groups = megatron_lm_args(as_run(c, rel))
    stack = c.settings.stack
    if needs_inference_pad(rel, stack, c.ep):    # 0.16 / 0.17 validate_args asserts it (inference only)
        groups["parallel"] = groups["parallel"] + [INFERENCE_PAD]
    if (why := release_stack_refusal(rel, stack, c.ep, True, c.attention)):
        raise AcesoError(why)
    out = {}
    for g, words in groups.items():
        out[g] = [rel.flag_name(w) if w.startswith("--") else w for w in words]
        missing = [w for w in out[g] if w.startswith("--") and not rel.has(w)]
        if missing:
            raise AcesoError(f"{missing[0]}: not a flag of {rel.label}; export with a --megatron-version that has it "
                             f"({', '.join(r.tag for r in having(missing[0])) or 'none'})")
    return out


def argv(c: MegatronConfig, rel: Release | None = None) -> list[str]:
    """Every plan argument in one list (the tokenizer last: it pins the plan's vocabulary)."""
    groups = arg_groups(c, rel)
    return [a for g in GROUPS for a in groups[g]] + tokenizer_args(c, rel or release())


def args_line(c: MegatronConfig, rel: Release | None = None) -> str:
    return shlex.join(argv(c, rel)) + "\n"


def entry_script(c: MegatronConfig, rel: Release | None = None) -> str:
    """The entry point's path in ``rel``'s checkout (T5: ``examples/t5/pretrain_t5.py`` from 0.18)."""
    return (rel or release()).entry_path("pretrain_t5.py" if c.model.is_t5 else "pretrain_gpt.py")


def needs_max_connections(plan: ParallelPlan, c: MegatronConfig) -> bool:
    """``max_connections_rule`` of the exported flags."""
    return max_connections_rule(plan, c.tp > 1 or c.cp > 1, bool(c.fsdp))


def max_connections_rule(plan: ParallelPlan, model_parallel: bool, fsdp: bool) -> bool:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1``: tp or cp > 1 (``model_parallel``) on a GPU before Blackwell (an unknown
    GPU counts as one); never with Megatron FSDP, which asserts the opposite (``validate_args``: it only warns about
    tp/cp then). The export's script and ``aceso launch`` (``launch.commands.launch_env``) both ask it."""
    gpu = plan.cluster.gpu.name if plan.cluster else ""
    return model_parallel and not gpu.startswith(("b", "gb")) and not fsdp


def hybrid_mix(m) -> str:
    """A hybrid model's layers by kind, ``23 Mamba-2 + 23 MoE + 6 attention`` (its main pattern, MTP aside)."""
    from ..layers.hybrid import UNREGISTERED, parse_pattern
    from ..layers.kind import by_symbol

    main = parse_pattern(m.hybrid_layer_pattern).layers
    return " + ".join(f"{main.count(c)} {UNREGISTERED[c] if c in UNREGISTERED else by_symbol(c).text}"
                      for c in dict.fromkeys(main))


def header(plan: ParallelPlan, c: MegatronConfig, source: str, rel: Release) -> list[str]:
    m = plan.model
    cl = plan.cluster
    what = (f"{m.family.upper()}, {m.num_layers}+{m.num_decoder_layers} layers" if m.is_t5
            else f"hybrid {hybrid_mix(m)}, {m.num_layers} layers" if m.hybrid_layer_pattern
            else f"{m.family.upper() if m.family == 'gpt' else 'Llama'}, {m.num_layers} layers")
    lines = [
        f"Megatron-LM launch script written by aceso {__version__} from {source}.",
        f"Arguments of {rel.label} (megatron/training/arguments.py, megatron-core {rel.series}.x); run it in a "
        f"checkout of that tag.",
        f"model: {m.name} ({what}, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
        f"{m.num_parameters / 1e9:.2f}B parameters, {m.params_dtype})",
        f"cluster: {cl.label if cl else 'not recorded in the plan'}, {c.world_size} GPUs = pp {c.pp} x tp {c.tp} x "
        f"cp {c.cp} x dp {c.dp}" + (f", {c.vpp} virtual stages per pipeline rank" if c.vpp > 1 else "")
        + (", sequence parallel" if c.sequence_parallel else ""),
        "layers per pipeline stage: " + " ".join(map(str, c.stage_layers()))
        + (f" (model chunks in order: {' '.join(map(str, c.chunk_layers))})" if c.vpp > 1 else ""),
        f"recompute: {c.recompute.label}" + (f"; {fsdp_describe(plan)}" if fsdp_describe(plan) else ""),
        *([f"Megatron FSDP saves and loads checkpoints only in the fsdp_dtensor format (--ckpt-format fsdp_dtensor), "
           "not the torch_dist format of DDP runs: convert an existing torch_dist checkpoint with Megatron-LM's",
           "tools/checkpoint/checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor before --load; without FSDP "
           "later runs cannot load these checkpoints"
           + ("; with it the distributed optimizer runs (validate_args)"
              if rel.rule("fsdp_forces_distributed_optimizer") else "")] if c.fsdp else []),
        f"micro-batch: the plan's pipeline micro-batch {plan.micro_batch_size} = --micro-batch-size "
        f"{c.micro_batch_size} per rank x dp {c.dp}; {plan.num_micro_batches} micro-batches per iteration",
    ]
    lines.append(f"priced as {describe(plan.settings, m.params_dtype)}"
                 + (f" ({' '.join(grad_reduce_args(c))})" if grad_reduce_args(c) else " (no flag: the default)"))
    p = plan.predicted
    if p is None:
        lines.append("predicted: the plan carries no prediction (aceso explain PLAN prices it)")
    else:
        att = f", {p.attention} attention" if p.attention else ""
        limit = f" of {cl.memory_mb / 1024:.2f}" if cl else ""
        t = throughput(plan.model, plan.global_batch_size, p.iteration_time_ms, plan.world_size)
        lines.append(f"predicted ({p.cost_model} cost model{att}): {p.iteration_time_ms:.1f} ms per iteration, "
                     f"{p.samples_per_s:.2f} samples/s, {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; peak memory "
                     f"{max(p.stage_memory_mb) / 1024:.2f}{limit} GiB per GPU")
    return lines


def _array(name: str, items: list[str]) -> str:
    return f"{name}=({' ' + shlex.join(items) if items else ''} )"


def write_script(plan: ParallelPlan, c: MegatronConfig, source: str, rel: Release | None = None,
                 groups: dict[str, list[str]] | None = None, entry: str | None = None, notes: list[str] = ()) -> str:
    """``groups`` / ``entry`` / ``notes``: another form's arguments, entry point and header lines (the hybrid
    pattern's, ``hybrid_pattern.py``)."""
    rel = rel or release()
    groups = groups or arg_groups(c, rel)
    cl = plan.cluster
    gpn, nodes = (cl.gpus_per_node, cl.num_nodes) if cl else (c.world_size, 1)
    out = ["#!/usr/bin/env bash"] + [f"# {line}" for line in header(plan, c, source, rel) + list(notes)] + [
        "# Fill in TOKENIZER_ARGS, DATA_ARGS and TRAINING_ARGS (or set them in the environment); more Megatron-LM",
        "# arguments pass through \"$@\". Several nodes: run it on each with NODE_RANK and MASTER_ADDR set.",
        "set -euo pipefail", "",
        "MEGATRON_LM=${MEGATRON_LM:-.}   # the Megatron-LM checkout"]
    if needs_max_connections(plan, c):
        out.append("export CUDA_DEVICE_MAX_CONNECTIONS=1   # tp/cp > 1 before Blackwell (validate_args asserts it)")
    if plan.settings.stack is not None and plan.settings.stack.offload is not None:
        out.append("export NVTE_CPU_OFFLOAD_V1=1   # fine-grained activation offload with transformer-engine >= 2.10 "
                   "(validate_args asserts it)")
    out += [f"GPUS_PER_NODE={gpn}", f"NNODES={nodes}", "NODE_RANK=${NODE_RANK:-0}",
            "MASTER_ADDR=${MASTER_ADDR:-localhost}", "MASTER_PORT=${MASTER_PORT:-6000}", ""]
    low = plan.settings.low_precision
    if low is not None and low.per_module:      # --te-precision-config-file (settings/precision_overrides.py)
        from search.megatron.names import TE_CONFIG_FILE
        from search.settings.precision_overrides import write_yaml
        out += [f"# per-module precision overrides (megatron-core --te-precision-config-file)",
                f"cat > {TE_CONFIG_FILE} <<'EOF'", *write_yaml(low.per_module).rstrip("\n").split("\n"), "EOF", ""]
    out += [_array(f"{g.upper()}_ARGS", groups[g]) for g in GROUPS]
    tok = tokenizer_args(c, rel)
    out += ["",
            f"# The plan assumed a vocabulary of {c.model.vocab_size} tokens (padded to {c.model.padded_vocab_size}): "
            "NullTokenizer with --vocab-size",
            f"# {tok[-1]} ({'its last id the EOD token' if rel.rule('null_tokenizer_counts_eod') else '+ the EOD token'})"
            " reproduces it. Use yours, e.g. --tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME"
            + (" (T5: --tokenizer-type BertWordPieceCase --vocab-file FILE --vocab-extra-ids 100)."
               if c.model.is_t5 else "."),
            f"TOKENIZER_ARGS=(${{TOKENIZER_ARGS:-{shlex.join(tok)}}})",
            "# Your data: --data-path PREFIX --split 949,50,1" + (" (mock data needs none)." if not c.model.is_t5
                                                                 else " (T5 needs a WordPiece-tokenized corpus)."),
            f"DATA_ARGS=(${{DATA_ARGS:-{'--mock-data' if not c.model.is_t5 else '--data-path YOUR_DATA_PREFIX'}}})",
            f"TRAINING_ARGS=(${{TRAINING_ARGS:-{TRAINING_PLACEHOLDER}}})", "",
            'torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \\',
            '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
            f'    "$MEGATRON_LM/{entry or entry_script(c, rel)}" \\',
            "    " + " ".join(f'"${{{g.upper()}_ARGS[@]}}"' for g in GROUPS) + " \\",
            '    "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"', ""]
    return "\n".join(out)
