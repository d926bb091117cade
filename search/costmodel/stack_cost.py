"""The software-stack features' named terms on a stage (``StageCost.terms``, ms per iteration; memory:
``StageCost.memory_breakdown`` keys): each feature adds its own, so ``aceso explain`` can show them.

Terms computed on the unit table (``analytic.py``, ``moe_cost.py``) and summed here per stage:

    host_wait            the host-bound wait of the MoE layers (``host.py``: launches not captured by a CUDA graph,
                         exposed by the dispatcher's synchronisation), M x its units' ``UnitTable.host_ms``
    cuda_graphs (MB)     the CUDA graphs' static buffers, per micro-batch in flight (``host.graph_buffer_bytes``)

Terms computed here (``stack_terms``):

    optimizer_step       the optimizer's step (``optimizers.py``: Adam, Muon, dist_muon), once per iteration
    offload_copies       fine-grained activation offload (``stack.FineGrainedOffload``; megatron-core
                         ``fine_grained_activation_offload.py``): each offloaded module's input goes to host memory
                         after its forward on a side stream and comes back before its backward, behind the layer's
                         compute (as ``offload.py``): exposed ``max(0, bytes / H - t_layer)`` each way, per layer and
                         micro-batch, for the groups offloaded (a group: one module in one layer; each module's last
                         group stays, the margin; then of each chunk's other groups with bytes to move the earliest
                         ``activation_offload_fraction``, as megatron-core 0.19 counts them: ``_fine_grained_
                         offload``). Only what megatron-core moves (``moves``, core_v0.16.1 to core_v0.19.0
                         alike): nothing of a unit under full recompute (the checkpointed forward runs without grad
                         and saves no module input; megatron-core's config does not refuse it, its
                         feature guide pairs the offload with fine-grained recompute only), not ``core_attn`` where
                         the unit's recompute checkpoints the core attention (``Attention.forward`` offloads its
                         input only on the path that does not), not a norm transformer-engine's spec fuses into the
                         next linear (``LayerKind.te_fused_norm``: the layer's norm is an ``IdentityOp``, which
                         ``TransformerLayer`` does not offload; the local spec's separate norm is moved)
    fine_grained_offload (MB, negative) the activations those copies take off the GPU: per offloaded group and
                         micro-batch in flight, its module's input (``OFFLOAD_INPUT``)
    moe_capacity (MB)    megatron-core 0.19's per-rank capacity (``MoEPlanSettings.rank_capacity_factor`` c): the
                         dispatch receive buffer and the routed experts' saved activations are sized by the capacity,
                         (c - 1) x the even share more per MoE layer in flight; ``moe_paged_stash`` stores them in
                         pages sized by the average tokens x ``PAGED_STASH_FACTOR`` (``moe_paged_stash_buffer_size_
                         factor_cuda``, 1.10) instead, pooled over the layers
    fsdp_main_params / fsdp_main_grads (MB) Megatron FSDP's main weights / gradient buffer in another dtype than
                         fp32 / the reduction dtype (``MegatronFSDP.main_params_dtype`` / ``main_grads_dtype``,
                         megatron-core 0.19): the difference per sharded parameter

Hand-computed: tests/unit/test_stack_features.py.
"""

from __future__ import annotations

import numpy as np

from search.settings.fsdp import DTYPE_BYTES, shards
from ..layers import resolve
from .memory import MB
from .offload import host_link_gbps
from .types import RC, RC_CODE

PAGED_STASH_FACTOR = 1.10        # megatron-core 0.19 moe_paged_stash_buffer_size_factor_cuda default
# the memory_breakdown keys the features add (module docstring)
STACK_MEMORY = ("cuda_graphs", "fine_grained_offload", "moe_capacity", "fsdp_main_params", "fsdp_main_grads")


def cross_entropy(ce: str, dt: float) -> tuple[float, float, float, float]:
    """The loss under ``--cross-entropy-loss-fusion`` (``StackSettings.cross_entropy_fusion``), per logit: (forward
    bytes beyond the dt read, backward bytes, bytes kept for backward, transient bytes at the peak).

    native (megatron-core 0.16.1 ``fusions/fused_cross_entropy.py``: the unfused steps in three jit-fused kernels):
    the ``.float()`` copy with the max (write 4), the in-place exp with the sums (read and write 4), the divide
    (read and write 4): 20 forward; the gradient's 12 backward; keeps the fp32 softmax (4) and the dt logits beside
    it at the peak, as unfused (``memory.LOSS_KEPT_BYTES``, ``loss_transient_bytes``).
    te (transformer-engine's ``parallel_cross_entropy``, an online-softmax kernel that writes the gradient into the
    logits tensor): a second read of the logits and the gradient's write, 2 dt forward; scaling it in place, 2 dt
    backward; keeps only that dt gradient, no fp32 copy and no transient."""
    if ce == "te":
        return 2 * dt, 2 * dt, dt, 0.0
    return 20.0, 12.0, 4.0, (dt if dt < 4.0 else 0.0)


def offload_input_bytes(model, kind: str, module: str, b: float, s: float, t: int, sp: bool, dt: float,
                        ep: int = 1, etp: int = 0) -> float:
    """Bytes of the input one offloaded module saves for backward, per unit and micro-batch (megatron-core's
    ``offload_modules``), its layer kind's ``offload_inputs`` (``search/layers/``): attn_norm / mlp_norm: the
    residual stream (``dt s b h / r``); qkv_linear: the norm output (the same); core_attn: Q, K and V
    (``dt s b (q + 2 kv) / t``); attn_proj: the core's output (``dt s b q / t``); expert_fc1: the dispatched tokens
    (``dt m h``); moe_act: the fc1 output (``dt m up / etp``), ``m`` the tokens at the rank's experts."""
    inputs = resolve(model, kind).offload_inputs
    return inputs(model, module, b, s, t, sp, dt, ep, etp) if inputs is not None else 0.0


def moves(kind, module: str, te: bool, recompute: str) -> bool:
    """Whether megatron-core offloads ``module``'s input on a unit of layer kind ``kind`` (a ``LayerKind``) under
    the unit's ``recompute`` choice, ``te``: transformer-engine's layer spec (module docstring)."""
    if recompute == "full":
        return False
    if te and module == kind.te_fused_norm:
        return False
    return not (module == "core_attn" and kind.megatron_modules.get(recompute) == "core_attn")


def offload_recompute_key(cm, sk, spans, recompute: np.ndarray) -> bytes | None:
    """The stage's recompute codes where they change what the offload in ``sk`` moves (a unit under full
    recompute, or one that checkpoints the core attention with ``core_attn`` offloaded), else None: the stage's
    recompute-independent terms are then keyed by them (``CostModel.stage_cost``)."""
    if (recompute == RC_CODE["full"]).any():
        return recompute.tobytes()
    if "core_attn" in sk.offload_modules:
        mask = getattr(cm, "_core_attn_checkpointed", None)
        if mask is None:        # (U, N_RC): the unit's choice checkpoints the core attention
            m = cm.model
            mask = np.array([[resolve(m, u.kind).megatron_modules.get(r) == "core_attn" for r in RC]
                             for u in m.units], dtype=bool)
            cm._core_attn_checkpointed = mask
        units = np.concatenate([np.arange(a, e) for a, e in spans])
        if mask[units, recompute].any():
            return recompute.tobytes()
    return None


def stack_terms(cm, p, spans, in_fl, M: int, features, opt_ms: float, me, moe, chunk_fwd: list, chunk_bwd: list,
                rc_off: bytes | None = None):
    """(memory terms, time terms) of a stage, each a tuple of (name, value); the fine-grained offload's exposed
    copies are added to ``chunk_fwd`` / ``chunk_bwd`` in place (module docstring). ``rc_off``: the stage's recompute
    codes where they change what the offload moves (``offload_recompute_key``; None: they do not)."""
    t = p.table
    mem, terms = [], [("optimizer_step", opt_ms)]
    if t.host_ms is not None:
        host = sum(float(t.host_ms[a:e].sum()) for a, e in spans)
        if host:
            terms.append(("host_wait", M * host))
    if t.graph_mb is not None:
        g = sum(float(t.graph_mb[a:e].sum()) * n for (a, e), n in zip(spans, in_fl))
        if g:
            mem.append(("cuda_graphs", g))
    st = features.stack if features is not None else None
    if st is not None and st.offload_modules and st.offload_fraction > 0:
        mb, ms = _fine_grained_offload(cm, p, spans, in_fl, st, me, chunk_fwd, chunk_bwd, rc_off)
        if mb:
            mem.append(("fine_grained_offload", -mb))
            terms.append(("offload_copies", M * ms))
    if moe is not None and moe.rank_capacity_factor is not None and cm.model.moe is not None:
        mem.append(("moe_capacity", _capacity_mb(cm, p, spans, in_fl, me, moe)))
    if st is not None and features.fsdp and (st.fsdp_main_params or st.fsdp_main_grads):
        mem += _fsdp_dtypes(cm, p, spans, features, me)
    return tuple(mem), tuple(terms)


def _layers(model, spans):
    """The layers of ``spans``: (first unit, end unit) per layer, in order."""
    starts = model.layer_starts
    out = []
    for a, e in spans:
        bounds = [u for u in starts if a <= u < e] + [e]
        out += [(x, y) for x, y in zip(bounds[:-1], bounds[1:]) if y > x]
    return out


def _fine_grained_offload(cm, p, spans, in_fl, st, me, chunk_fwd, chunk_bwd, rc_off=None) -> tuple[float, float]:
    """(MB off the GPU at the stage's peak, exposed copy ms per micro-batch), by offload group as megatron-core
    0.19 keeps them (``fine_grained_activation_offload.py`` ``post_warmup_callback``): a group is one offloaded
    module's input in one layer. First the offload margin: each module's last group (the stage's last chunk holding
    it) stays on the GPU, so that reloading it does not block the backward; then, per model chunk, of its other
    eligible groups (moving bytes: a Mamba layer has no ``core_attn``), the last ``int(n (1 - fraction))``."""
    m = cm.model
    b = p.table.batch
    s = m.seq_length / me.cp
    dt = m.dtype_bytes
    gbps = host_link_gbps(cm.cluster.gpu.name)
    t = p.table
    te = getattr(cm.source, "flash", True)          # transformer-engine's layers (local: megatron-core's own)
    codes = np.frombuffer(rc_off, dtype=np.int8) if rc_off is not None else None
    rc = {}                                         # unit -> its recompute choice, where it changes what moves
    if codes is not None:
        units = [u for a, e in spans for u in range(a, e)]
        rc = {u: RC[c] for u, c in zip(units, codes.tolist()) if c}
    chunks = []                                     # per chunk: [((first unit, end unit), module, bytes)]
    for a, e in spans:
        groups = []
        for x, y in _layers(m, ((a, e),)):
            for mod in st.offload_modules:
                nbytes = sum(offload_input_bytes(m, m.units[u].kind, mod, b, s, me.tp, me.sp, dt, me.ep, me.etp)
                             for u in range(x, y) if moves(resolve(m, m.units[u].kind), mod, te, rc.get(u, "none")))
                if nbytes > 0:
                    groups.append(((x, y), mod, nbytes))
        chunks.append(groups)
    margin = {}                                     # module -> (chunk, index) of its last group
    for j, groups in enumerate(chunks):
        for i, (_, mod, _) in enumerate(groups):
            margin[mod] = (j, i)
    margin = set(margin.values())
    saved = exposed = 0.0
    for j, groups in enumerate(chunks):
        eligible = [g for i, g in enumerate(groups) if (j, i) not in margin]
        n_on_gpu = int(len(eligible) * (1.0 - st.offload_fraction) + 1e-9)     # the latest groups stay
        per_layer: dict[tuple[int, int], float] = {}
        for (x, y), _, nbytes in eligible[:len(eligible) - n_on_gpu]:
            per_layer[(x, y)] = per_layer.get((x, y), 0.0) + nbytes
        for (x, y), nbytes in per_layer.items():
            copy = nbytes / (gbps * 1e6)
            ef = max(0.0, copy - float(t.fwd_ms[x:y].sum()))
            eb = max(0.0, copy - float(t.bwd_ms[x:y].sum()))
            chunk_fwd[j] += ef
            chunk_bwd[j] += eb
            exposed += ef + eb
            saved += nbytes / MB * in_fl[j]
    return saved, exposed


def _capacity_mb(cm, p, spans, in_fl, me, moe) -> float:
    """MB the per-rank capacity adds over the even share (module docstring)."""
    m = cm.model
    b = p.table.batch
    s = m.seq_length / me.cp
    dt = m.dtype_bytes
    c = moe.rank_capacity_factor
    per_layer = sum(offload_input_bytes(m, "moe", mod, b, s, me.tp, me.sp, dt, me.ep, me.etp)
                    for mod in ("expert_fc1", "moe_act"))
    n = sum(sum(1 for u in range(a, e) if resolve(m, m.units[u].kind).routed_experts) * f
            for (a, e), f in zip(spans, in_fl))
    if moe.paged_stash:
        return (PAGED_STASH_FACTOR - 1.0) * per_layer * n / MB + (c - 1.0) * per_layer / MB   # one layer's buffer
    return (c - 1.0) * per_layer * n / MB


def _fsdp_dtypes(cm, p, spans, features, me) -> list[tuple[str, float]]:
    """Megatron FSDP's main-params / main-grads dtypes against the defaults (fp32 main weights; gradients in the
    reduction dtype): the difference in MB per GPU over the stage's parameters, as sharded by the strategy."""
    st = features.stack
    params = sum(p.cum["params"][e] - p.cum["params"][a] for a, e in spans)
    dpc = me.dp * me.cp
    _, g_sh, o_sh = shards(features.fsdp)
    out = []
    if st.fsdp_main_params:
        d = (DTYPE_BYTES[st.fsdp_main_params] - 4.0) * params / (dpc if o_sh else 1)
        out.append(("fsdp_main_params", d / MB))
    if st.fsdp_main_grads:
        d = (DTYPE_BYTES[st.fsdp_main_grads] - cm._g) * params / (dpc if g_sh else 1)
        out.append(("fsdp_main_grads", d / MB))
    return out
