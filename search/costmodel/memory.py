"""Memory per GPU: model states per parameter, activations per unit and recompute choice, stage assembly.

Model states (Rajbhandari et al., ZeRO, SC'20, section 3.1; mixed-precision Adam): for bf16/fp16 training each
parameter costs 2 B (half-precision weight) + 2 B (gradient) + 12 B (fp32 master weight, Adam m and v) = 16 B; for
fp32, 4 + 4 + 8. With the distributed optimizer (ZeRO-1, megatron-core ``use_distributed_optimizer``) the 12 (or 8)
optimizer bytes are sharded over the stage's DP group: 2 + 2 + 12/dp.

Activations kept for backward per micro-batch (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", MLSys'23, section 4.1, Table 2): a GPT layer keeps ``sbh (34 + 5as/h)`` bytes at 2-byte
precision, ``sbh (10 + 24/t + 5as/(ht))`` under tensor parallelism t without sequence parallelism. Split per unit
(b = per-rank batch, s = tokens, q = heads*head_dim, kv = groups*head_dim, f = ffn width, t = tp):

    attention unit: 2sbh (norm input) + 2sbh (QKV input) + sbh (dropout mask)   [replicated]
                    + 2sb(q + 2kv)/t (Q, K, V) + 2sbq/t (projection input)      [split]
                      (tp above the query groups: K and V of the rank's one group, 2sb(q/t + 2 head_dim))
                    + a s^2 b / t (4 + 1 + dt) -- unfused attention only (``unfused_core_bytes``): Korthikanti
                      count 5 (a 2-byte softmax output, the dropout mask, the dropout output); megatron-core's
                      softmax runs in fp32 (``attention_softmax_in_fp32``) and, unfused (the runtime keeps
                      ``masked_softmax_fusion`` off), keeps its fp32 output: 4 + 1 + dt. Without attention dropout
                      the probs x V product keeps the dt-byte cast of the softmax output instead (none in fp32).
                      With flash attention (Dao et al. 2022) the s^2 term vanishes: only the fp32 log-sum-exp
                      (4 a s b / t bytes) is kept
    mlp unit:       2sbh + 2sbh + sbh   [replicated]  +  2sbf/t (activation input) + 2sbf/t (fc2 input)   [split]
                    (SwiGLU: the activation input is 2f wide, and the gate multiply also keeps the silu output
                    and its copy of the linear half, 2sbf/t each -- megatron-core's unfused GLU, which the
                    runtime uses on CPU; tests/runtime/test_recompute_memory.py measures it; on a GPU megatron-core's
                    jit-fused SwiGLU keeps only its input: ``RunSettings.fused_swiglu``)
    dropout masks (1 byte) only where the model trains with dropout: the sbh masks with ``hidden_dropout``,
    the s^2 mask and dropout output with ``attention_dropout`` (GPT/T5 presets 0.1, Llama 0).

Recompute choices (megatron-core ``recompute_granularity``): *selective* recomputes the attention core (the s^2
part; with flash attention only the log-sum-exp is saved by it) and the MLP activation function (its output is
dropped: for gelu that is the fc2 input, for SwiGLU the silu output the gate multiply kept); *full* keeps only the
unit input (2sbh) and re-runs the unit's forward in backward; *attn_dropout* (attention units, unfused
attention with attention dropout only) re-runs the probability dropout and the probs x V product: the mask and the
dropout output (1 + 2 bytes per score element) are not kept, the softmax output is. While a unit
is re-materialised its dropped activations exist again: that is the transient ``peak`` of the choice. The last
stage's loss has its own transient beyond the fp32 softmax it keeps (below): the dt-byte logits beside it in forward,
the gradient's dt-byte cast in backward (dt s b V / t bytes, none in fp32: ``loss_transient_bytes``); a stage's
``recompute_peak`` is the larger of the two (they never overlap in time).

Per stage and GPU: states (above) + activations x in-flight micro-batches (1F1B: num_stages - stage_index, at most
M) x (1 + FRAGMENTATION) + recompute_peak + p2p receive buffers (one per direction and boundary) + RESERVE_MB.
The first stage adds the embedding's dropout mask per micro-batch; the last stage the final-norm and logits inputs
and the fp32 softmax that the vocab-parallel cross-entropy keeps for backward (4 s b V / t bytes).
"""

from __future__ import annotations

import math

from search.spec.model import ModelSpec
from search.spec.query_groups import groups_per_rank

MB = float(2**20)              # one MiB (the one memory unit: search/io/units.py); the name predates it
# Share of the GPU's memory a plan must leave free (``--memory-headroom``; search, validate and explain, through
# ``memory_budget_mb`` / ``headroom_verdict``): what the per-category estimate does not see -- NCCL's communicator
# buffers (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer, for each of a rank's TP/DP/PP/CP/embedding
# communicators: NCCL user guide, "Environment Variables"), the caching allocator's fragmentation beyond the
# activations' 5% (PyTorch "CUDA semantics: memory management") and kernel workspaces beyond RESERVE_MB. 3% is
# 2.4 GB of an 80 GB H100; every fully specified published bf16 run keeps it free under its own settings (the
# tightest, Nemotron-4 340B on 128 H100s, is predicted at 95.7%: bench/megatron_memory.py).
DEFAULT_HEADROOM = 0.03
RESERVE_MB = 1024.0            # CUDA context (~0.5 GB) + cuBLAS/NCCL workspaces (~0.5 GB), per GPU
FRAGMENTATION = 0.05           # caching-allocator slack on activations (PyTorch allocator, typical 3-8%)
SOFTMAX_BYTES = 4.0            # per score element kept by megatron-core's unfused softmax (fp32 output)
# The vocab-parallel cross-entropy (megatron-core 0.16.1 tensor_parallel/cross_entropy.py; the native
# --cross-entropy-loss-fusion runs the same steps jit-fused): ``.float()`` makes one fp32 copy of the logits, the
# max subtraction, exp and division run in place on it, and it is saved as the softmax: 4 bytes per logit kept.
# tests/runtime/test_loss_memory.py measures it (every storage's bytes, on CPU).
LOSS_KEPT_BYTES = 4.0


def loss_transient_bytes(logits: float, dt: float) -> float:
    """Bytes beyond the kept fp32 softmax (``LOSS_KEPT_BYTES`` per logit) that the loss holds at its peak, for
    ``logits`` logits (s b V / t) of ``dt`` bytes: in forward the dt-byte logits beside their fp32 copy, in backward
    the gradient (written into the softmax's storage) and its cast back to dt -- dt per logit either way; in fp32
    ``.float()`` is the logits themselves and the cast is none: nothing. tests/runtime/test_loss_memory.py."""
    return (dt if dt < LOSS_KEPT_BYTES else 0.0) * logits


def memory_budget_mb(limit_mb: float, headroom: float) -> float:
    """What a plan may use of ``limit_mb`` per GPU when it keeps ``headroom`` of it free."""
    return limit_mb * (1.0 - headroom)


def headroom_verdict(peak_mb: float, limit_mb: float, headroom: float) -> str | None:
    """None when ``peak_mb`` keeps the headroom free; else one line: over the GPU, or inside the headroom."""
    budget = memory_budget_mb(limit_mb, headroom)
    if peak_mb <= budget:
        return None
    if peak_mb > limit_mb:
        return f"needs {peak_mb:.0f} MiB per GPU, over the {limit_mb:.0f} MiB the GPU has"
    return (f"needs {peak_mb:.0f} MiB per GPU: it fits the {limit_mb:.0f} MiB but not the {100 * headroom:g}% "
            f"--memory-headroom (budget {budget:.0f} MiB); give --memory-headroom 0 to accept it")


# ----- parameters per rank (what megatron-core 0.16 allocates; tests/runtime/test_param_counts.py builds them) -----
def replicated_unit_params(model: ModelSpec, kind: str) -> int:
    """Parameters of a unit every TP rank holds whole: its norm, the row-parallel output bias (``linear_proj`` /
    ``linear_fc2``: ``RowParallelLinear`` adds its bias after the reduction, unsplit) and the Q/K norms."""
    bias = model.hidden_size if model.add_bias_linear else 0
    return model._norm_params() + bias + (model.qk_norm_params() if kind == "attention" else 0)


def unit_params_per_rank(model: ModelSpec, kind: str, tp: int) -> float:
    """Parameters of one unit on one TP rank: linear weights and column-parallel biases split, the rest whole."""
    rep = replicated_unit_params(model, kind)
    return (model.unit_params(kind) - rep) / tp + rep


def embedding_params_per_rank(model: ModelSpec, tp: int) -> float:
    """The first stage's embedding: the vocab-parallel word embedding (padded vocabulary / tp rows) and the
    learned position embedding, which megatron-core's ``LanguageModelEmbedding`` keeps whole on every TP rank."""
    word = model.padded_vocab_size * model.hidden_size
    return word / tp + (model.embedding_params() - word)


def output_params_per_rank(model: ModelSpec, tp: int) -> float:
    """The last stage's final norm(s) (whole) and the untied output layer / T5 LM-head bias (vocab-split)."""
    norms = model._norm_params() * (2 if model.is_t5 else 1)
    return (model.output_params() - norms) / tp + norms


def tied_copy_params_per_rank(model: ModelSpec, tp: int) -> float:
    """With tied embeddings and pp > 1 the last stage allocates its own copy of the word embedding as the output
    layer's weight (``LanguageModule.setup_embeddings_and_output_layer``), kept equal by an all-reduce."""
    return model.padded_vocab_size * model.hidden_size / tp if model.tied_embeddings else 0.0


def ddp_buffer_numel(numels: list[int], dpc: int, distributed_optimizer: bool, bucket_size: int | None = None,
                     shared: frozenset[int] = frozenset()) -> tuple[int, int]:
    """(elements, buckets) of megatron-core 0.16.1's grad buffer (and, with the distributed optimizer, its param
    buffer) for parameters of ``numels`` in registration order (``_ParamAndGradBuffer.__init__``): parameters are
    laid out in reverse order; with the distributed optimizer each starts at a multiple of 64 elements, each bucket
    ends at a multiple of ``lcm(dp x cp, 128)`` and a shared (tied) embedding weight (indices in ``shared``) gets a
    bucket of its own; a bucket closes once it holds ``bucket_size`` elements. Without it nothing is padded.

    The cost model does not price this padding per stage (at most 63 elements per tensor and ``lcm(dp x cp, 128)``
    per bucket: under a MB per rank on the published configurations, bench/megatron_memory.py); this is the exact
    layout the bench and tests/runtime/test_memory_buffers.py check against megatron-core's own buffer."""
    def pad(n: int, d: int) -> int:
        return -(-n // d) * d
    div = math.lcm(dpc, 128)
    start = bucket_start = end = 0
    n_in_bucket, buckets = 0, 0
    for i in reversed(range(len(numels))):
        own = distributed_optimizer and i in shared
        if distributed_optimizer:
            start = pad(start, 64)
        if own and n_in_bucket:
            start = bucket_start = pad(start, div) if distributed_optimizer else start
            buckets, n_in_bucket = buckets + 1, 0
        end = start + numels[i]
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own:
            start = bucket_start = pad(end, div) if distributed_optimizer else end
            buckets, n_in_bucket = buckets + 1, 0
        else:
            start = end
    if n_in_bucket:
        end, buckets = (pad(end, div) if distributed_optimizer else end), buckets + 1
    else:
        end = start
    return end, buckets


def state_bytes_per_param(precision: str, distributed_optimizer: bool, dp: int,
                          grad_fp32: bool = False) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter on one GPU; ``grad_fp32``: the gradient buffer in fp32
    (``RunSettings.grad_reduce_in_fp32``; megatron's table in docs/distrib_optimizer.md: bf16 weights with fp32
    gradients are 6 + 12/d bytes with the distributed optimizer, 18 without)."""
    w = 4.0 if precision == "fp32" else 2.0
    opt = 8.0 if precision == "fp32" else 12.0
    if distributed_optimizer:
        opt /= dp
    return w, 4.0 if grad_fp32 else w, opt


def grad_copy_bytes(precision: str, grad_fp32: bool) -> float:
    """Bytes per parameter of the mixed-precision optimizer's fp32 gradient copy (``main_param.grad =
    main_grad.float()``, megatron-core ``_copy_model_grads_to_main_grads``) when the grad buffer is not fp32."""
    return 0.0 if grad_fp32 or precision == "fp32" else 4.0


def has_attention_dropout(model: ModelSpec) -> bool:
    return model.attention_dropout > 0


def _has_hidden_dropout(model: ModelSpec) -> bool:
    return model.hidden_dropout > 0


def qk_norm_elems(model: ModelSpec, b: float, s: int, t: int) -> float:
    """Elements of one rank's queries and keys that a self-attention unit's Q and K norms read (0 without
    ``megatron.qk_layernorm``). megatron-core's ``SelfAttention.get_query_key_value_tensors`` (core_v0.16.1 to
    core_v0.19.0) splits the QKV output and applies ``q_layernorm`` to the query heads and ``k_layernorm`` to the key
    groups (TENorm over each head's ``head_dim``): ``s b (heads / t + groups per rank) head_dim`` elements, one norm
    kernel each. Its time is the unit's element-wise work (``AnalyticSource.attention``: read and write, dt each;
    backward 1.5x), its memory ``attention_act_bytes`` (each norm keeps its input, dt, and one fp32 rstd per head
    row, for backward)."""
    if not (model.megatron or {}).get("qk_layernorm"):
        return 0.0
    return s * b * (model.num_attention_heads / t + groups_per_rank(model.groups, t)) * model.head_dim


def attention_act_bytes(model: ModelSpec, b: float, s: int, t: int, flash: bool, kv_len: int | None = None,
                        dt: float = 2.0, sp: bool = False) -> tuple[float, float, float, float]:
    """Bytes kept by one attention (or cross-attention, ``kv_len`` = encoder tokens) unit: (none, selective, full,
    attn_dropout); attn_dropout equals none where it frees nothing (flash attention, no attention dropout).

    Cross-attention's K/V input (the encoder output) is one tensor shared by all its units: it is counted once per
    stage by the caller, not here.
    """
    h = model.hidden_size
    q = model.num_attention_heads * model.head_dim
    kv_rank = groups_per_rank(model.groups, t) * model.head_dim   # groups / tp, one group when tp exceeds them
    a = model.num_attention_heads
    cross = kv_len is not None
    kv_len = kv_len or s
    r = t if sp else 1     # sequence parallelism splits what TP replicates
    mask = 1.0 * s * b * h if _has_hidden_dropout(model) else 0.0
    replicated = (2 * dt * s * b * h + mask) / r
    split = dt * b * (s * q / t + 2 * kv_len * kv_rank) + dt * s * b * q / t
    dropped = 0.0   # the probability dropout's mask and output
    if flash:
        core = 4.0 * a * s * b / t
    else:
        core, dropped = unfused_core_bytes(model, b, s, kv_len, t, dt)
    # the Q and K norms' inputs and rstd (self-attention only; selective recompute re-runs the core, not them)
    qk = 0.0 if cross else qk_norm_elems(model, b, s, t)
    split += (dt + 4.0 / model.head_dim) * qk
    none = replicated + split + core
    selective = replicated + split
    full = dt * s * b * h / r
    return none, selective, full, none - dropped


def unfused_core_bytes(model: ModelSpec, b: float, s: int, kv_len: int, t: int, dt: float) -> tuple[float, float]:
    """(bytes kept, of which the dropout's mask and output) by megatron-core's unfused attention core, per unit.

    Per score element: the fp32 softmax output, then with attention dropout its 1-byte mask and dt-byte output
    (kept by the probs x V product); without, the dt-byte copy the product keeps (the same tensor in fp32).
    """
    elems = model.num_attention_heads * s * kv_len * b / t
    if has_attention_dropout(model):
        dropped = (1.0 + dt) * elems
        return SOFTMAX_BYTES * elems + dropped, dropped
    return (SOFTMAX_BYTES + (dt if dt < SOFTMAX_BYTES else 0.0)) * elems, 0.0


def mlp_act_bytes(model: ModelSpec, b: float, s: int, t: int, dt: float = 2.0,
                  sp: bool = False, fused_swiglu: bool = False) -> tuple[float, float, float]:
    """Bytes kept by one MLP unit: (none, selective, full). ``fused_swiglu``: megatron-core's jit-fused SwiGLU
    (``fused_bias_swiglu.SwiGLUFunction`` saves only its input and recomputes silu in backward) keeps no silu
    output nor linear-half copy without recompute; a selective unit runs unfused (the runtime turns the fusion off
    for it, ``model.config.unit_config``), so its row is the unfused one."""
    h, f = model.hidden_size, model.ffn_hidden_size
    up = 2 * f if model.gated_mlp else f
    r = t if sp else 1
    mask = 1.0 * s * b * h if _has_hidden_dropout(model) else 0.0
    replicated = (2 * dt * s * b * h + mask) / r
    act_in = dt * s * b * up / t
    fc2_in = dt * s * b * f / t
    act_out = dt * s * b * f / t  # what selective recompute drops: gelu's output (= fc2 input) or silu's output
    if model.gated_mlp:  # + silu (quick-gelu) output and (x_linear + offset), both kept by the gate multiply
        none = replicated + act_in + 2 * act_out + fc2_in
    else:
        none = replicated + act_in + fc2_in
    selective = none - act_out
    if fused_swiglu and model.activation == "swiglu":
        none = replicated + act_in + fc2_in
    full = dt * s * b * h / r
    return none, selective, full


def in_flight(stage_index: int, num_stages: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak under 1F1B (Narayanan et al. 2021, 2.2)."""
    return max(1, min(num_stages - stage_index, num_micro_batches))


def interleaved_warmup(stage_index: int, num_stages: int, num_chunks: int, num_micro_batches: int) -> int:
    """Warm-up forwards (model-chunk micro-batches) of a rank under megatron-core's interleaved 1F1B (0.16,
    ``get_pp_rank_microbatches``, micro-batch groups of ``num_stages``): ``2 (p - r - 1) + (v - 1) p``, at most all."""
    total = num_micro_batches * num_chunks
    return min(2 * (num_stages - stage_index - 1) + (num_chunks - 1) * num_stages, total)


def in_flight_per_chunk(stage_index: int, num_stages: int, num_chunks: int,
                        num_micro_batches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each of a stage's chunks holds at the stage's peak.

    One chunk: 1F1B's ``min(p - i, M)``. Interleaved (megatron-core): the warm-up forwards plus the first steady
    forward are in flight before the first backward; forward ``k`` of a rank runs chunk ``(k // p) % v``.
    """
    if num_chunks == 1:
        return (in_flight(stage_index, num_stages, num_micro_batches),)
    total = num_micro_batches * num_chunks
    w = interleaved_warmup(stage_index, num_stages, num_chunks, num_micro_batches)
    live = min(w + 1, total)
    counts = [0] * num_chunks
    for k in range(live):
        counts[(k // num_stages) % num_chunks] += 1
    return tuple(counts)
