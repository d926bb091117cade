"""Analytic GPU cost source: per-unit times from FLOPs and bytes, over a kernel model (``kernels.py``).

Each unit is a short list of kernels timed by the kernel model (``ShapeKernels``, the default: shape-aware GEMM
and attention efficiency; ``FlatKernels``: the v1 per-GPU constants). Per rank, with b samples of s tokens (the
sequence / cp), hidden h, q = heads*head_dim, kv = groups*head_dim, ffn f (``up`` = f, 2f for SwiGLU and
quick-GEGLU), tp t, element size dt, r = t with sequence parallelism (else 1):

    attention fwd: norm (2 sbh dt / r bytes) | QKV GEMM (sb, (q+2kv)/t, h) | with ``qk_layernorm`` the Q and K
                   norms (2 sb(q+kv) dt / t, two kernels: ``memory.qk_norm_elems``) | RoPE (2 sb(q+kv) dt / t) |
                   core: flash (causal: half of 4 s^2 b q / t) or unfused (score and context batched GEMMs of
                   b heads/t matrices (s, kv_len, d) and (s, d, kv_len); softmax 2 dt and dropout 2dt+1 bytes per
                   score element) | output GEMM (sb, h, q/t) | bias-dropout-add ((3dt+1) sbh / r);
                   a sliding-window layer (``layer_variants``): flash 4 s w b q / t over the band of w keys
                   per query (its own row), unfused unchanged (megatron-core scores s x s and masks)
    mlp fwd:       norm | fc1 GEMM (sb, up/t, h) | activation (gelu 2 sbf dt / t, SwiGLU 3 sbf dt / t) |
                   fc2 GEMM (sb, h, f/t) | bias-dropout-add
    backward:      each GEMM's input- and weight-gradient GEMMs; flash backward 2.5x the forward FLOPs (5
                   matmuls to 2, Dao 2023, FlashAttention-2, section 3.2); element-wise kernels 1.5x their bytes.
    tp above the query groups (``search.spec.query_groups``): the QKV output all-gathered over TP forward and
                   reduce-scattered backward (s b (q + 2kv) dt, exposed); RoPE and K/V of one group per rank.
    TP collectives per half (``tpcomm.py``): no SP one all-reduce forward and one backward (Shoeybi et al. 2019,
                   fig. 3); SP an all-gather + reduce-scatter forward and two all-gathers + a reduce-scatter
                   backward (Korthikanti et al. 2023, 4.2.2); what megatron-core (async input-gradient
                   collectives) or transformer-engine (``tp_comm_overlap``) hides behind GEMMs is not exposed.
    embedding:     gather + position add + dropout ((3dt+1) sbh / r) + TP all-reduce (SP: reduce-scatter);
                   backward scatter-add into the V h / t gradient (2 V h dt / t + 3 sbh dt) (SP: + all-gather).
    head:          final norm (/r), (SP: all-gather of its output), logits GEMM (sb, V/t, h), vocab-parallel
                   cross-entropy in fp32 over s b V / t logits (``kernels.ce_bytes`` per logit beyond the dt read:
                   the passes of megatron-core's implementation; v1: 24 forward, 8 backward) and two all-reduces
                   of s b fp32, backward: the GEMM gradients, the input-gradient all-reduce (SP: reduce-scatter)
                   behind the weight-gradient GEMM.
    context parallelism (megatron-core / TE ring attention, ``AttnFuncWithCPAndKVP2P``): every token-linear
                   kernel on s/cp tokens; the causal core of s/cp queries against all s keys, load-balanced (half
                   the score matrix), in cp steps of s/cp x s/cp blocks; each of the cp - 1 exchanges of one
                   s/cp chunk of K and V (backward: K, V, dK, dV) runs behind one step's compute: exposed
                   ``(cp - 1) max(0, p2p - core / cp)``.

Recompute: selective re-runs the attention core and the MLP activation function forward; full re-runs the whole
unit forward (its TP collectives included). Activations and peaks come from ``memory.py``.

Each unit is priced by its layer kind (``search.layers``: ``LayerKind.price`` over this source as the pricing
context, once per distinct row): the dense kinds with the kernels above, the ``moe`` unit at the stage's expert shape
(``unit_table(..., ep, etp, moe)``) by ``moe_cost.py``, an MLA ``attention`` unit and the ``mtp`` unit by
``mla_mtp.py`` (their docstrings and docs/costmodel.md have every term).
"""

from __future__ import annotations

import numpy as np

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError
from .. import layers
from ..layers.kind import PriceArgs, UnitCost, ep_overlap_pairs
from search.spec.megatron_fields import analytic_note
from search.spec.model import ModelSpec
from search.spec.query_groups import gathers_qkv, groups_per_rank
from search.spec.training import TrainingSpec
from .comm import CommModel
from .comm import overlap_tax
from search.settings import precision as lowp
from search.settings.precision_overrides import UnitRecipes, unit_prefix, unit_recipes
from .kernels import GENERATION, arch, KERNEL_MODELS, LAUNCH_MS, lowprec_kernels
from . import memory, mla_mtp, moe_cost, moe_primitives
from .memory import (LOSS_KEPT_BYTES, MB, embedding_params_per_rank, has_attention_dropout, loss_transient_bytes,
                     output_params_per_rank, tied_copy_params_per_rank)
from search.settings.moe_plan import MoEPlanSettings
from .moe_cost import host_layers, imbalance_note
from .stack_cost import cross_entropy
from .tpcomm import TPComm, tp_half
from .types import N_RC, UNAVAILABLE_MS, RunSettings, UnitTable


def sink_attention_scale(model: ModelSpec, release: str, gpu: str = "") -> float:
    """The fused attention's rate with a softmax offset (attention sinks: ``softmax_type`` learnable / off-by-one),
    relative to the vanilla kernel: transformer-engine (2.9+) disables FlashAttention for any non-vanilla softmax
    (``dot_product_attention/utils.py`` ``get_attention_backend``) and runs cuDNN's fused attention with the offset
    (``F16_arbitrary_seqlen``, cuDNN >= 9.13.1), whose rate at these shapes no benchmark in our sources measures:
    ``release_constants.SINK_ATTN_SCALE``, per GPU generation, fitted on the GPT-OSS rows of every release together
    (the published models with sinks; too few in any one release). 1 for vanilla softmax."""
    if model.softmax_type not in ("learnable", "off-by-one"):
        return 1.0
    from .release_constants import value
    return value("SINK_ATTN_SCALE", release).get(GENERATION.get(gpu, ""), 1.0)


def _sink(t: float, scale: float) -> float:
    """A fused-attention kernel's time at ``scale`` of its rate (its launch unscaled)."""
    return t if scale == 1.0 else (t - LAUNCH_MS) / scale + LAUNCH_MS


class AnalyticSource:
    """Produces ``UnitTable``s for (per-rank batch, tp, cp, sp, TP overlap) from the kernels above.

    ``kernels``: ``"shape"`` (default) or ``"flat"`` (``kernels.py``); ``settings``: the framework's behaviour
    (``types.RunSettings``: whether megatron-core's async input-gradient collectives hide behind GEMMs).
    """

    name = "analytic"
    features = ("sequence_parallel", "context_parallel", "tp_comm_overlap")

    # The cost model's formulas the layer kinds price with (``search.layers.kind``, "The pricing context"): a kind
    # reads them here and imports nothing of the cost model, which imports the kinds.
    attention_act_bytes = staticmethod(memory.attention_act_bytes)
    mlp_act_bytes = staticmethod(memory.mlp_act_bytes)
    unit_params_per_rank = staticmethod(memory.unit_params_per_rank)
    mla_params_per_rank = staticmethod(mla_mtp.mla_params_per_rank)
    ep_all_to_all_ms = staticmethod(moe_primitives.ep_all_to_all_ms)
    mla_attention = mla_mtp.mla_attention       # (src, ...): bound, called as src.mla_attention(...)
    mla_act_bytes = mla_mtp.mla_act_bytes
    mtp_unit = mla_mtp.mtp_unit
    moe_unit = moe_cost.moe_unit

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, comm: CommModel,
                 kernels: str = "shape", settings: RunSettings | None = None):
        if kernels not in KERNEL_MODELS:
            raise AcesoError(f"kernel model '{kernels}': choose one of {', '.join(KERNEL_MODELS)}")
        self.model, self.cluster, self.training, self.comm = model, cluster, training, comm
        self.settings = settings or RunSettings()
        self.dt = 4.0 if training.dtype == "fp32" else 2.0
        why = lowp.check(training.precision, cluster.gpu, training.fp8_param_gather, training.bf16_layers_start,
                         training.bf16_layers_end, model.num_layers)
        for o in training.per_module:       # an override's recipe must run on the GPU too
            why = why or (lowp.check(o.recipe, cluster.gpu) if o.recipe != "bf16" else None)
        if model.is_t5 and lowp.is_low(training.precision):
            why = f"precision {training.precision}: low precision is priced for GPT models (T5 trains in bf16 here)"
        if why:
            raise AcesoError(why)
        self.peak = cluster.gpu.peak_tflops(training.dtype) * 1e9   # FLOP per ms
        self.hbm = cluster.gpu.hbm_gbps * 1e6                           # bytes per ms
        self.kern = KERNEL_MODELS[kernels](cluster.gpu.name, self.peak, self.hbm, self.dt)
        self.kern.attn_scale = cluster.gpu.attention_scale or 1.0     # aceso calibrate (search/costmodel/calibration.py)
        self.kernels = kernels
        self.lp = training.precision          # the recipe (search/settings/precision.py); bf16/fp16/fp32: no quantization
        self._kerns: dict = {}                # kern_of's kernel models, one per recipe
        self.kern_lp = self.kern_of(self.lp)
        self.non_tn = GENERATION.get(cluster.gpu.name) == "blackwell"   # FP8 GEMMs in any layout (precision.copies)
        if training.attention == "flash" and not self.kern.has_flash:
            raise AcesoError(f"--attention flash: {cluster.gpu.name} has no flash attention (it needs sm80+, A100 or "
                             "newer); use --attention auto or unfused")
        self.flash = self.kern.has_flash if training.attention == "auto" else training.attention == "flash"
        self._sms = arch(cluster.gpu.name).sms
        self._tax = overlap_tax(cluster.gpu.name) if self.settings.overlap_tp_dgrad else 0.0
        self._tax_cp = overlap_tax(cluster.gpu.name)
        self._tax_ep = overlap_tax(cluster.gpu.name)      # the EP overlap's communication kernels take SMs too
        self._sink_scale = sink_attention_scale(model, self.settings.release, cluster.gpu.name)
        notes = (analytic_note(model),  # a custom layer_spec and megatron fields it does not price
                 imbalance_note(model))  # learned MoE routing priced as even
        self.warnings: list[str] = [n for n in notes if n]

    def kern_wide(self, dtype: str):
        """The kernel model of GEMMs in fp32 / fp64 (the MoE router's ``moe_router_dtype``): the GPU's fp32 (TF32)
        peak, 4- or 8-byte elements; fp64 at half the fp32 rate (an assumption: datasheets quote fp64 tensor
        throughput only for some GPUs)."""
        key = f"_kern_{dtype}"
        if not hasattr(self, key):
            peak = self.cluster.gpu.peak_tflops("fp32") * 1e9 * (0.5 if dtype == "fp64" else 1.0)
            setattr(self, key, KERNEL_MODELS[self.kernels](self.cluster.gpu.name, peak, self.hbm,
                                                           4.0 if dtype == "fp32" else 8.0))
        return getattr(self, key)

    def kern_of(self, recipe: str | None):
        """The kernel model of GEMMs in ``recipe`` (None / a plain dtype: ``kern``), one per recipe, built as
        ``kern_lp`` (per-module overrides, ``settings.precision_overrides``)."""
        if recipe is None or not lowp.is_low(recipe):
            return self.kern
        if recipe not in self._kerns:
            peak = self.cluster.gpu.peak_tflops(lowp.recipe(recipe).gemm) * 1e9
            self._kerns[recipe] = lowprec_kernels(self.kernels, self.cluster.gpu.name, peak, self.hbm,
                                                  lowp.per_elem(recipe), recipe, self.settings.release)
        return self._kerns[recipe]

    def recipe_of(self, lp, name: str | None = None) -> str | None:
        """The recipe linear ``name`` of a unit runs: ``lp`` a ``UnitRecipes`` (per-module), else a flag (the
        plan's recipe where truthy and quantizing). None: unquantized."""
        if isinstance(lp, UnitRecipes):
            return lp.of(name)
        return self.lp if lp and self.kern_lp is not self.kern else None

    # ----- communication ------------------------------------------------------------------------------------------
    def _tp_ar(self, b: float, s: int, t: int) -> float:
        """One TP all-reduce of the ``s b h`` activation."""
        return self.comm.all_reduce(self.dt * s * b * self.model.hidden_size, t)

    def _tp_mode(self, sp: bool, overlap: bool) -> str:
        if overlap and sp:
            return "te"
        return "dgrad" if self.settings.overlap_tp_dgrad else "none"

    def _half(self, col: tuple, row: tuple, b: float, s: int, t: int, sp: bool, overlap: bool,
              lp=False, names: tuple = (None, None)) -> TPComm:
        """``names``: the column- and row-parallel linears' names (per-module recipes: the column linear's input
        gathers in its recipe, the row linear's output gradient in its own)."""
        x = self.dt * s * b * self.model.hidden_size
        rc, rr = self.recipe_of(lp, names[0]), self.recipe_of(lp, names[1])
        kern = self.kern_of(rc or rr)
        ag, amax = None, 0.0
        if (rc or rr) and sp:     # quantized gathers, current scaling's amax all-reduces
            elems = s * b * self.model.hidden_size
            # (the column linear's input gathers forward and backward, the row linear's output gradient backward)
            c, r_ = (lowp.sp_gather_bytes(x_ or "bf16", self.dt) for x_ in (rc, rr))
            ag = (c[0] * elems, r_[1] * elems, c[2] * elems)
            amax = max(lowp.amax_reductions(x_) for x_ in (rc or "bf16", rr or "bf16")) * self.comm.all_reduce(4.0, t)
        return tp_half(self.comm, kern, col, row, x, t, sp, self._tp_mode(sp, overlap), self._sms, self._tax,
                       ag, amax)

    def _linears(self, gemms: list, lp, names: tuple | None = None) -> tuple[float, float]:
        """(forward, backward) ms of a unit's linear GEMMs: bf16, or quantized at the low-precision peak plus the
        casts of their inputs (forward x: m k; backward dy: m n; ``precision.cast_bytes``). ``names``: each GEMM's
        linear (per-module recipes: each group of one recipe priced as one call)."""
        recs = [self.recipe_of(lp, n) for n in (names or [None] * len(gemms))]
        if len(set(recs)) > 1:
            parts = [self._linears([g for g, r in zip(gemms, recs) if r == x], x is not None and UnitRecipes(x))
                     for x in dict.fromkeys(recs)]
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        rec = recs[0] if recs else None
        if rec is None:
            return self.kern.gemm(gemms), self.kern.gemm(gemms, backward=True)
        k, n_l = self.kern_of(rec), lowp.cast_launches(rec)
        cast = lambda elems: self.kern.memory(lowp.cast_bytes(rec, elems, self.dt, self.non_tn), n_l)  # noqa: E731
        cast_f = sum(cast(m * kk) for m, n, kk in gemms)
        cast_b = sum(cast(m * n) for m, n, kk in gemms)
        return k.gemm(gemms) + cast_f, k.gemm(gemms, backward=True) + cast_b

    def _cp_ring(self, b: float, s: float, t: int, cp: int, core_f: float, core_b: float) -> tuple[float, ...]:
        """(exposed fwd, exposed bwd, hidden) ms of ring attention's K/V exchange: ``cp - 1`` steps of one
        ``s / cp`` chunk of K and V (backward also dK, dV), each behind its step's share of the attention core."""
        ef, eb, hf, hb = self._cp_ring_parts(b, s, t, cp, core_f, core_b)
        return ef, eb, hf + hb

    def _cp_ring_parts(self, b: float, s: float, t: int, cp: int, core_f: float, core_b: float,
                       chunk: float | None = None) -> tuple[float, ...]:
        """``_cp_ring`` with the hidden time per direction: (exposed fwd, exposed bwd, hidden fwd, hidden bwd);
        ``chunk``: bytes of one K/V chunk (default: the standard attention's)."""
        if cp <= 1:
            return 0.0, 0.0, 0.0, 0.0
        m = self.model
        if chunk is None:
            chunk = 2 * self.dt * s * b * groups_per_rank(m.groups, t) * m.head_dim   # this rank's K and V
        inter = t * cp > self.cluster.nvlink_size
        step_f = self.comm.p2p(chunk, inter)
        step_b = self.comm.p2p(2 * chunk, inter)
        per_f, per_b = core_f / cp, core_b / cp
        hf, hb = (cp - 1) * min(step_f, per_f), (cp - 1) * min(step_b, per_b)
        ef = (cp - 1) * max(0.0, step_f - per_f) + self._tax_cp * hf
        eb = (cp - 1) * max(0.0, step_b - per_b) + self._tax_cp * hb
        return ef, eb, hf, hb

    # ----- kernels ------------------------------------------------------------------------------------------------
    def _core(self, b: float, s: int, kv_len: int, t: int, causal: bool, cp: int = 1,
              window: int | None = None) -> tuple[float, float, float]:
        """Attention core (scores, softmax, dropout, context): (fwd, bwd, attn_dropout recompute) ms. ``window``:
        keys per query of a sliding-window layer (``layer_variants.window_keys``): flash attention skips the tiles
        outside the band, s x window scores, already causal; the unfused core scores all of s x kv_len and masks."""
        m, dt, k = self.model, self.dt, self.kern
        flops = 4.0 * s * kv_len * b * m.num_attention_heads * m.head_dim / t
        sink = self._sink_scale
        if self.flash and window is not None and window < kv_len:
            f = 4.0 * s * window * b * m.num_attention_heads * m.head_dim / t
            fwd = _sink(k.flash(f, window, m.head_dim, causal), sink) + (cp - 1) * LAUNCH_MS
            bwd = _sink(k.flash(f, window, m.head_dim, causal, backward=True), sink) + (cp - 1) * LAUNCH_MS
            return fwd, bwd, UNAVAILABLE_MS
        if self.flash:
            f = flops * (0.5 if causal else 1.0)
            blk = kv_len / cp          # ring attention: cp blocks of s/cp keys each
            fwd = _sink(k.flash(f, blk, m.head_dim, causal), sink) + (cp - 1) * LAUNCH_MS
            bwd = _sink(k.flash(f, blk, m.head_dim, causal, backward=True), sink) + (cp - 1) * LAUNCH_MS
            return fwd, bwd, UNAVAILABLE_MS
        heads = b * m.num_attention_heads / t
        elems = m.num_attention_heads * s * kv_len * b / t
        d = m.head_dim
        fwd = k.bmm(heads, s, kv_len, d) + k.bmm(heads, s, d, kv_len) + k.memory(2 * dt * elems)
        bwd = k.bmm(heads, s, kv_len, d, backward=True) + k.bmm(heads, s, d, kv_len, backward=True) + \
            k.memory(3 * dt * elems)
        rec_drop = UNAVAILABLE_MS
        if has_attention_dropout(m):
            drop = k.memory((2 * dt + 1) * elems)
            fwd += drop
            bwd += drop
            rec_drop = drop + k.bmm(heads, s, d, kv_len)
        return fwd, bwd, rec_drop

    def attention(self, b: float, s: int, t: int, kv_len: int | None = None, causal: bool = True,
                  cp: int = 1, sp: bool = False, overlap: bool = False, window: int | None = None,
                  lp: bool = False) -> UnitCost:
        """``s``: this rank's tokens (the sequence / cp); ``kv_len``: cross-attention's encoder tokens;
        ``window``: keys per query of a sliding-window layer (``_core``); ``lp``: the linear GEMMs run in the
        training spec's low-precision recipe."""
        m, dt, k = self.model, self.dt, self.kern
        h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.groups * m.head_dim
        cross = kv_len is not None
        kv_len = kv_len or s
        sbh = s * b * h
        ew = (2 * dt * sbh + (3 * dt + 1) * sbh) / (t if sp else 1)   # norm + bias-dropout-add
        launches = 2
        if m.position_embedding == "rope" and not cross:     # the rank's query heads and K/V group(s)
            ew += 2 * dt * s * b * (q / t + groups_per_rank(m.groups, t) * m.head_dim)
            launches = 3
        qk = 0.0 if cross else memory.qk_norm_elems(m, b, s, t)
        if qk:                  # the Q and K norms (``qk_layernorm``): read and write, one kernel each
            ew += 2 * dt * qk
            launches += 2
        if cross:   # Q from the decoder tokens, K/V from the encoder's: two GEMMs; K/V shapes per encoder token
            gemms = [(s * b, q / t, h), (kv_len * b, 2 * kv / t, h), (s * b, h, q / t)]
        else:
            gemms = [(s * b, (q + 2 * kv) / t, h), (s * b, h, q / t)]
        core_f, core_b, rec_drop = self._core(b, s, kv_len * (cp if not cross else 1), t, causal and not cross,
                                              1 if cross else cp, window)
        ring_f, ring_b, ring_hf, ring_hb = (self._cp_ring_parts(b, s, t, cp, core_f, core_b) if not cross
                                            else (0.0, 0.0, 0.0, 0.0))
        names = (("linear_q", "linear_kv", "linear_proj") if cross else ("linear_qkv", "linear_proj"))
        names = tuple(f"{'cross' if cross else 'self'}_attention.{n}" for n in names)
        tpc = self._half(gemms[0], gemms[-1], b, s, t, sp, overlap, lp, (names[0], names[-1]))
        gf, gb = (0.0, 0.0) if cross else self._qkv_gather(b, s, t)
        lin_f, lin_b = self._linears(gemms, lp, names)
        fwd = lin_f + k.memory(ew, launches) + core_f + ring_f + tpc.fwd + gf
        bwd = lin_b + k.memory(1.5 * ew, launches) + core_b + ring_b + tpc.bwd + gb
        wgrad = sum(self.kern_of(self.recipe_of(lp, n)).gemm_parts(*g)[2] for g, n in zip(gemms, names))
        return UnitCost(fwd, bwd, core_f + ring_f, fwd, tpc.fwd + tpc.bwd + gf + gb + ring_f + ring_b, rec_drop,
                        tpc.hidden, ring_f + ring_b, ring_hf + ring_hb,
                        (tpc.fwd + gf, tpc.hidden_fwd, ring_f, ring_hf), wgrad=wgrad)

    def _qkv_gather(self, b: float, s: int, t: int) -> tuple[float, float]:
        """(fwd, bwd) ms of the QKV output's TP all-gather (backward: reduce-scatter) megatron-core runs when tp
        exceeds the query groups (``query_groups``): the whole ``s b (q + 2 kv)`` output, sequence parallel or not
        (the GEMM's input is already gathered along the sequence), exposed (nothing overlaps it)."""
        m = self.model
        if not gathers_qkv(m.groups, t):
            return 0.0, 0.0
        x = self.dt * s * b * (m.num_attention_heads + 2 * m.groups) * m.head_dim
        return self.comm.all_gather(x, t), self.comm.reduce_scatter(x, t)

    def mlp(self, b: float, s: int, t: int, sp: bool = False, overlap: bool = False, lp: bool = False) -> UnitCost:
        m, dt, k = self.model, self.dt, self.kern
        h, f = m.hidden_size, m.ffn_hidden_size
        up = 2 * f if m.gated_mlp else f
        sbh = s * b * h
        ew = (2 * dt * sbh + (3 * dt + 1) * sbh) / (t if sp else 1)
        act_bytes = (3 if m.gated_mlp else 2) * dt * s * b * f / t
        gemms = [(s * b, up / t, h), (s * b, h, f / t)]
        act_f = k.memory(act_bytes)
        names = ("mlp.linear_fc1", "mlp.linear_fc2")
        tpc = self._half(gemms[0], gemms[1], b, s, t, sp, overlap, lp, names)
        lin_f, lin_b = self._linears(gemms, lp, names)
        fwd = lin_f + k.memory(ew, 2) + act_f + tpc.fwd
        bwd = lin_b + k.memory(1.5 * (ew + act_bytes), 3) + tpc.bwd
        return UnitCost(fwd, bwd, act_f, fwd, tpc.fwd + tpc.bwd, UNAVAILABLE_MS, tpc.hidden,
                        comm_fwd=(tpc.fwd, tpc.hidden_fwd, 0.0, 0.0))

    def embedding(self, b: float, s: int, t: int, sp: bool = False) -> tuple[float, float]:
        m, dt, k = self.model, self.dt, self.kern
        sbh = s * b * m.hidden_size
        vh = m.padded_vocab_size * m.hidden_size / t
        x = dt * sbh
        if not sp or t == 1:
            comm_f, comm_b = self._tp_ar(b, s, t), 0.0
        else:                   # reduce-scatter into the sequence-parallel region; its backward all-gathers
            comm_f, comm_b = self.comm.reduce_scatter(x, t), self.comm.all_gather(x, t)
        fwd = k.memory((3 * dt + 1) * sbh / (t if sp else 1)) + comm_f
        bwd = k.memory(2 * dt * vh + 3 * dt * sbh) + comm_b
        return fwd, bwd

    def head(self, b: float, s: int, t: int, sp: bool = False, ce: str = "") -> tuple[float, float]:
        """The final norm, logits GEMM and loss; ``ce``: the cross-entropy fusion (``stack_cost.cross_entropy``)."""
        m, dt, k = self.model, self.dt, self.kern
        sbh = s * b * m.hidden_size
        sbv = s * b * m.padded_vocab_size / t
        logits = (s * b, m.padded_vocab_size / t, m.hidden_size)
        ce_ar = 2 * self.comm.all_reduce(4.0 * s * b, t)
        r = t if sp else 1
        comm_f, comm_b = self._head_comm(logits, b, s, t, sp)
        ce_f, ce_b = cross_entropy(ce, dt)[:2] if ce else k.ce_bytes
        fwd = k.memory(2 * dt * sbh / r) + k.gemm([logits]) + k.memory((dt + ce_f) * sbv) + ce_ar + comm_f
        bwd = k.memory(3 * dt * sbh) + k.gemm([logits], backward=True) + k.memory((dt + ce_b) * sbv) + comm_b
        return fwd, bwd

    def _head_comm(self, logits: tuple, b: float, s: int, t: int, sp: bool) -> tuple[float, float]:
        """The output layer (column-parallel, megatron's own linear): SP gathers its input forward; backward its
        input-gradient all-reduce / reduce-scatter (and the SP re-gather) behind the GEMMs when overlapped."""
        if t <= 1:
            return 0.0, 0.0
        x = self.dt * s * b * self.model.hidden_size
        _, dg, wg = self.kern.gemm_parts(*logits)
        hide = self.settings.overlap_tp_dgrad
        if not sp:
            ar = self.comm.all_reduce(x, t)
            return 0.0, max(0.0, ar - wg) + self._tax * min(ar, wg) if hide else ar
        ag, rs = self.comm.all_gather(x, t), self.comm.reduce_scatter(x, t)
        if not hide:
            return ag, ag + rs
        return ag, max(0.0, ag - dg) + max(0.0, rs - wg) + self._tax * (min(ag, dg) + min(rs, wg))

    # ----- the table ---------------------------------------------------------------------------------------------
    def unit_table(self, batch: float, tp: int, cp: int = 1, sp: bool = False,
                   tp_overlap: bool = False, ep: int = 1, etp: int = 0, moe=None, stack=None) -> UnitTable:
        """``ep``/``etp``/``moe`` (``MoEPlanSettings``; None = the defaults): the expert shape and settings the
        ``moe`` units run with (``moe_cost.py``); ``stack``: the plan's ``types.TableStack`` (CUDA-graph scopes,
        cross-entropy fusion; None: none)."""
        if cp > 1 and not self.flash:
            raise AcesoError(f"context parallelism (cp {cp}) needs transformer-engine's fused attention; the "
                             "unfused (local) attention has none: use --attention flash or cp 1")
        x = (int(ep), int(etp), moe or MoEPlanSettings())
        return _build_table(self, float(batch), int(tp), int(cp), bool(sp), bool(tp_overlap and sp and tp > 1), x,
                            stack)


def _seqs(model: ModelSpec, cp: int = 1) -> tuple[int, int]:
    """Tokens per rank of the encoder (GPT: the only) and decoder sequences under context parallelism ``cp``."""
    return model.seq_length // cp, (model.decoder_seq_length if model.is_t5 else model.seq_length) // cp


def _lp_unit(src: AnalyticSource, u):
    """Whether unit ``u`` runs its linear GEMMs quantized (a low-precision recipe, not a layer kept in bf16); with
    per-module overrides its ``UnitRecipes`` (each linear's recipe, ``settings.precision_overrides``)."""
    tr, m = src.training, src.model
    q = src.kern_lp is not src.kern and lowp.unit_quantized(
        tr.precision, u.layer, m.num_layers, tr.bf16_layers_start, tr.bf16_layers_end,
        mtp=u.kind == "mtp" or u.stack == "mtp", hybrid=bool(m.hybrid_layer_pattern))
    if not tr.per_module:
        return q
    kind = layers.resolve(src.model, u.kind)
    return unit_recipes(kind.linears, unit_prefix(u.stack, u.layer), src.lp if q else None, tr.per_module)


def _override_params(src: AnalyticSource, u, t: int, x: tuple) -> dict:
    """Weight parameters per rank of unit ``u``'s linears that a per-module override sets, by the recipe each runs
    (``_lp_unit``: the recipes its time is priced at; None = bf16); ``x``: (ep, etp, ...) of the moe units. Empty
    without overrides, and for a kind that names no linears (its unit at its recipe throughout)."""
    lp = _lp_unit(src, u)
    kind = layers.resolve(src.model, u.kind)
    if not isinstance(lp, UnitRecipes) or not lp.matched or kind.linear_params is None:
        return {}
    out: dict = {}
    for name, n in zip(kind.linears, kind.linear_params(src.model, t, x[0], x[1])):
        if name in lp.matched:
            out[lp.of(name)] = out.get(lp.of(name), 0.0) + n
    return out


def _unit_rows(src: AnalyticSource, b: float, t: int, cp: int, sp: bool, ov: bool = False,
               x: tuple = (1, 0, None)) -> dict:
    """Each unit's ``layers.Row`` (its kind's pricer: time, bytes kept per recompute choice, parameters per rank),
    keyed by ``_row_key``: units priced alike are priced once. ``x``: (ep, etp, MoEPlanSettings) of the moe units."""
    m = src.model
    s_enc, s_dec = _seqs(m, cp)
    rows: dict = {}

    def row(u) -> layers.kind.Row:
        key = _row_key(src, u)
        if key not in rows:
            s = s_enc if u.stack == "encoder" else s_dec
            args = PriceArgs(b, s, s_enc, t, cp, sp, ov, _lp_unit(src, u), *x, row)
            rows[key] = layers.resolve(m, u.kind).price(src, u, args)
        return rows[key]

    for u in m.units:
        row(u)
    return rows


def _row_key(src: AnalyticSource, u) -> tuple:
    """Units priced alike: (stack, kind, the kind's row variant (a sliding-window layer), low precision): a
    windowed self-attention layer and a layer kept in bf16 under a low-precision recipe are their own rows."""
    m = src.model
    return u.stack, u.kind, layers.resolve(m, u.kind).row_variant(m, u), _lp_unit(src, u)


def _build_table(src: AnalyticSource, b: float, t: int, cp: int = 1, sp: bool = False,
                 ov: bool = False, x: tuple = (1, 0, None), stack=None) -> UnitTable:
    m, dt = src.model, src.dt
    s_enc, s_dec = _seqs(m, cp)
    rows = _unit_rows(src, b, t, cp, sp, ov, x)
    r = t if sp else 1          # SP: what TP replicates (norm/dropout/residual tensors) is split over the TP group
    n = m.num_units
    fwd, bwd, tpc, tph, cpc, cph = (np.zeros(n) for _ in range(6))
    comm_fwd = np.zeros((n, 4))
    rec, act, peak = np.zeros((n, N_RC)), np.zeros((n, N_RC)), np.zeros((n, N_RC))
    params, eparams, epc, eph, epf = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros((n, 2))
    pre = np.zeros(n)                            # moe units: forward before the dispatcher's host wait
    moved: dict = {}                             # recipe -> (U,) parameters of the linears an override set
    for i, u in enumerate(m.units):
        for rec_, k in _override_params(src, u, t, x).items():
            moved.setdefault(rec_, np.zeros(n))[i] = k
        cost, a, params[i], eparams[i], transient = rows[_row_key(src, u)]
        epc[i], eph[i], epf[i], pre[i] = cost.ep_comm, cost.ep_hidden, cost.ep_fwd, cost.fwd_before_wait
        transient /= MB                          # what the unit needs while it runs (MoE: the dispatch buffers)
        a = (*a, *([a[0]] * (N_RC - len(a))))    # choices a unit cannot take (attn_dropout, mla_up_proj): its none row
        fwd[i], bwd[i], tpc[i] = cost.fwd, cost.bwd, cost.tp_comm
        tph[i], cpc[i], cph[i] = cost.tp_hidden, cost.cp_comm, cost.cp_hidden
        comm_fwd[i] = cost.comm_fwd
        rec[i] = (0.0, cost.rec_sel, cost.rec_full, cost.rec_drop, cost.rec_up)
        act[i] = np.asarray(a) / MB
        peak[i] = np.maximum(act[i, 0] - act[i], 0.0) + transient   # (fused SwiGLU: selective = the unfused row)
    if m.moe is not None and x[2].overlap_ep_comm and x[0] > 1:
        _ep_overlap_layers(src, rows, fwd, bwd, epc, eph, epf, x[2].delay_wgrad)
    scopes = stack.graphs if stack is not None else frozenset()
    host = None
    if m.moe is not None:       # a host-bound MoE layer: max(device, host) (moe_cost.host_layers, host.py)
        host = host_layers(src, fwd, bwd, rec, x[0], x[2], scopes, lambda u: _lp_unit(src, u), pre)
    graph = graph_unit_mb(src, b, s_dec, t, sp, x, scopes) if scopes else None
    boundary = np.full(n + 1, dt * s_dec * b * m.hidden_size / MB / r)   # SP: the sequence-sharded activation
    if m.is_t5:  # encoder boundaries carry the encoder activation; decoder ones also carry the encoder output
        boundary[:m.num_encoder_units + 1] = dt * s_enc * b * m.hidden_size / MB / r
        boundary[m.num_encoder_units + 1:] += dt * s_enc * b * m.hidden_size / MB / r
    emb_f, emb_b = src.embedding(b, s_enc, t, sp)
    ce = stack.ce_fusion if stack is not None else ""
    head_f, head_b = src.head(b, s_dec, t, sp, ce)
    kept, transient = (cross_entropy(ce, dt)[2:] if ce else (LOSS_KEPT_BYTES, loss_transient_bytes(1.0, dt)))
    sbv = s_dec * b * m.padded_vocab_size / t
    return UnitTable(
        batch=b, tp=t, fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec, act_mb=act, peak_mb=peak,
        weight_params=params, boundary_mb=boundary,
        embed_fwd_ms=emb_f, embed_bwd_ms=emb_b, embed_params=embedding_params_per_rank(m, t),
        embed_act_mb=(s_enc * b * m.hidden_size * (1 if m.hidden_dropout > 0 else 0)) / MB / r,
        head_fwd_ms=head_f, head_bwd_ms=head_b, head_params=output_params_per_rank(m, t),
        # final-norm input (SP: sharded) + logits input (dt sbh) and the fp32 softmax kept by the vocab-parallel loss
        head_act_mb=(dt * s_dec * b * m.hidden_size * (1 + 1 / r) + kept * sbv) / MB,
        head_peak_mb=transient * sbv / MB,
        tp_comm_ms=tpc, tp_hidden_ms=tph, cp_comm_ms=cpc, cp_hidden_ms=cph, comm_fwd_ms=comm_fwd,
        word_embed_params=tied_copy_params_per_rank(m, t),
        encoder_output_mb=dt * s_enc * b * m.hidden_size / MB / r if m.is_t5 else 0.0,
        expert_params=eparams if eparams.any() else None,
        ep_comm_ms=epc if epc.any() or eph.any() else None, ep_hidden_ms=eph if epc.any() or eph.any() else None,
        ep_fwd_ms=epf if epf.any() else None,
        host_ms=host if host is not None and host.any() else None, graph_mb=graph,
        override_params=tuple(moved.items()),
    )


def _ep_overlap_layers(src: AnalyticSource, rows: dict, fwd, bwd, epc, eph, epf, delay: bool) -> None:
    """The EP overlap of each MoE layer (``ep_overlap.py``: its attention and moe units scheduled as megatron-core
    pairs one micro-batch's forward with another's backward), in place: the moe unit's forward and backward lose
    the saving, split in proportion to their all-to-all, which moves from exposed to hidden."""
    from .ep_overlap import LayerTimes, saving_ms
    units = src.model.units
    for i in ep_overlap_pairs(src.model):
        u = units[i]
        att, moe = rows[_row_key(src, units[i - 1])].cost, rows[_row_key(src, u)].cost
        if not moe.ep_split:
            continue
        d, c, m_dw = moe.ep_split
        a2a_f, a2a_b = epf[i][0], epc[i] - epf[i][0]          # exposed all-to-all, forward / backward
        if a2a_f + a2a_b <= 0:
            continue
        a_dw = att.wgrad if delay else 0.0
        e_dw = m_dw if delay else 0.0
        x = LayerTimes(fwd[i - 1], bwd[i - 1] - a_dw, a_dw, fwd[i] - a2a_f, bwd[i] - a2a_b - e_dw, e_dw,
                       d * a2a_f / (d + c), c * a2a_f / (d + c), d * a2a_b / (d + c), c * a2a_b / (d + c))
        save = saving_ms(x, src._tax_ep)
        share_f = a2a_f / (a2a_f + a2a_b)
        fwd[i] -= save * share_f
        bwd[i] -= save * (1 - share_f)
        epc[i] -= save
        eph[i] += save
        epf[i] = (a2a_f - save * share_f, epf[i][1] + save * share_f)


def graph_unit_mb(src: AnalyticSource, b: float, s: int, t: int, sp: bool, x: tuple, scopes) -> np.ndarray:
    """MB of CUDA-graph static buffers each unit keeps per micro-batch in flight (``host.graph_buffer_bytes``:
    the unit's captured parts, ``dt s b h / r`` each)."""
    from .host import graph_buffer_bytes, part_launches
    m = src.model
    r = t if sp else 1
    n_local = m.moe.num_experts // max(x[0], 1) if m.moe is not None else 0
    out = np.zeros(m.num_units)
    for i, u in enumerate(m.units):
        parts = part_launches(m, u.kind, False, n_local, x[2])
        out[i] = graph_buffer_bytes(parts, scopes, src.dt, s * b / r, m.hidden_size) / MB
    return out
