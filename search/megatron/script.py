"""The Megatron-LM launch script (``aceso export --to megatron-lm``) and the one-line argument form (``--args-only``).

The script sets what megatron-core needs in the environment (``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tp or cp > 1
before Blackwell: ``validate_args`` asserts it), launches ``torchrun`` with the plan's world size and runs
``pretrain_gpt.py`` (GPT, Llama) or ``pretrain_t5.py`` with the model, parallel, recompute, batch and precision
arguments in bash arrays; ``TOKENIZER_ARGS`` / ``DATA_ARGS`` / ``TRAINING_ARGS`` are placeholders the user replaces
(environment variables of those names override them), extra arguments pass through ``"$@"``.
"""

from __future__ import annotations

import shlex

from .. import __version__
from ..plan import ParallelPlan
from .config import MegatronConfig
from ..fsdp import describe as fsdp_describe
from ..plan_settings import describe
from ..throughput import throughput
from .names import grad_reduce_args, megatron_lm_args, tokenizer_args

TRAINING_PLACEHOLDER = ("--train-iters 100 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 10 "
                        "--weight-decay 0.1 --clip-grad 1.0 --log-interval 10 --eval-iters 0")
GROUPS = ("model", "parallel", "recompute", "batch", "precision")


def argv(c: MegatronConfig) -> list[str]:
    """Every plan argument in one list (the tokenizer placeholder last: it pins the plan's vocabulary)."""
    groups = megatron_lm_args(c)
    return [a for g in GROUPS for a in groups[g]] + tokenizer_args(c)


def args_line(c: MegatronConfig) -> str:
    return shlex.join(argv(c)) + "\n"


def entry_script(c: MegatronConfig) -> str:
    return "pretrain_t5.py" if c.model.is_t5 else "pretrain_gpt.py"


def needs_max_connections(plan: ParallelPlan, c: MegatronConfig) -> bool:
    """tp or cp > 1 on a GPU before Blackwell (an unknown GPU counts as one); never with Megatron FSDP, which
    asserts the opposite (``validate_args``: it only warns about tp/cp then)."""
    gpu = plan.cluster.gpu.name if plan.cluster else ""
    return (c.tp > 1 or c.cp > 1) and not gpu.startswith(("b", "gb")) and not c.fsdp


def header(plan: ParallelPlan, c: MegatronConfig, source: str, version: str) -> list[str]:
    m = plan.model
    cl = plan.cluster
    what = (f"{m.family.upper()}, {m.num_layers}+{m.num_decoder_layers} layers" if m.is_t5
            else f"{m.family.upper() if m.family == 'gpt' else 'Llama'}, {m.num_layers} layers")
    lines = [
        f"Megatron-LM launch script written by aceso {__version__} from {source}.",
        f"Arguments of Megatron-LM {version} (megatron/training/arguments.py); run it in a checkout of that tag.",
        f"model: {m.name} ({what}, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
        f"{m.num_parameters / 1e9:.2f}B parameters, {m.params_dtype})",
        f"cluster: {cl.label if cl else 'not recorded in the plan'}, {c.world_size} GPUs = pp {c.pp} x tp {c.tp} x "
        f"cp {c.cp} x dp {c.dp}" + (f", {c.vpp} virtual stages per pipeline rank" if c.vpp > 1 else "")
        + (", sequence parallel" if c.sequence_parallel else ""),
        "layers per pipeline stage: " + " ".join(map(str, c.stage_layers()))
        + (f" (model chunks in order: {' '.join(map(str, c.chunk_layers))})" if c.vpp > 1 else ""),
        f"recompute: {c.recompute.label}" + (f"; {fsdp_describe(plan)}" if fsdp_describe(plan) else ""),
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


def write_script(plan: ParallelPlan, c: MegatronConfig, source: str, version: str) -> str:
    groups = megatron_lm_args(c)
    cl = plan.cluster
    gpn, nodes = (cl.gpus_per_node, cl.num_nodes) if cl else (c.world_size, 1)
    out = ["#!/usr/bin/env bash"] + [f"# {line}" for line in header(plan, c, source, version)] + [
        "# Fill in TOKENIZER_ARGS, DATA_ARGS and TRAINING_ARGS (or set them in the environment); more Megatron-LM",
        "# arguments pass through \"$@\". Several nodes: run it on each with NODE_RANK and MASTER_ADDR set.",
        "set -euo pipefail", "",
        "MEGATRON_LM=${MEGATRON_LM:-.}   # the Megatron-LM checkout"]
    if needs_max_connections(plan, c):
        out.append("export CUDA_DEVICE_MAX_CONNECTIONS=1   # tp/cp > 1 before Blackwell (validate_args asserts it)")
    out += [f"GPUS_PER_NODE={gpn}", f"NNODES={nodes}", "NODE_RANK=${NODE_RANK:-0}",
            "MASTER_ADDR=${MASTER_ADDR:-localhost}", "MASTER_PORT=${MASTER_PORT:-6000}", ""]
    out += [_array(f"{g.upper()}_ARGS", groups[g]) for g in GROUPS]
    tok = shlex.join(tokenizer_args(c))
    out += ["",
            f"# The plan assumed a vocabulary of {c.model.vocab_size} tokens (padded to {c.model.padded_vocab_size}): "
            "NullTokenizer with --vocab-size",
            f"# {c.model.vocab_size - 1} (+ the EOD token) reproduces it. Use yours, e.g. --tokenizer-type "
            "HuggingFaceTokenizer --tokenizer-model NAME"
            + (" (T5: --tokenizer-type BertWordPieceCase --vocab-file FILE --vocab-extra-ids 100)."
               if c.model.is_t5 else "."),
            f"TOKENIZER_ARGS=(${{TOKENIZER_ARGS:-{tok}}})",
            "# Your data: --data-path PREFIX --split 949,50,1" + (" (mock data needs none)." if not c.model.is_t5
                                                                 else " (T5 needs a WordPiece-tokenized corpus)."),
            f"DATA_ARGS=(${{DATA_ARGS:-{'--mock-data' if not c.model.is_t5 else '--data-path YOUR_DATA_PREFIX'}}})",
            f"TRAINING_ARGS=(${{TRAINING_ARGS:-{TRAINING_PLACEHOLDER}}})", "",
            'torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \\',
            '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
            f'    "$MEGATRON_LM/{entry_script(c)}" \\',
            "    " + " ".join(f'"${{{g.upper()}_ARGS[@]}}"' for g in GROUPS) + " \\",
            '    "${TOKENIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"', ""]
    return "\n".join(out)
