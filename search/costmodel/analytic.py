"""Analytic GPU cost source: per-unit times from FLOPs and bytes (a roofline with achievable efficiencies).

Each unit is a short list of kernels; a kernel takes ``max(flops / (peak * eff), bytes / (hbm * mem_eff)) +
KERNEL_OVERHEAD_MS``. Per rank, with b samples of s tokens, hidden h, q = heads*head_dim, kv = groups*head_dim,
ffn f (``up`` = f, 2f for SwiGLU), tp t and element size dt:

    attention fwd: norm (2 sbh dt bytes) | QKV GEMM 2sbh(q+2kv)/t | RoPE (2 sb(q+kv) dt / t) |
                   core: flash (causal: half of 4 s^2 b q / t at the flash efficiency) or unfused (score and
                   context batched GEMMs 2 s^2 b q / t each, softmax 2 dt and dropout 2dt+1 bytes per score element)
                   | output GEMM 2 sbqh/t | TP all-reduce of sbh dt | bias-dropout-add (3dt+1) sbh
    mlp fwd:       norm | fc1 GEMM 2sbh*up/t | activation (gelu 2 sbf dt / t, SwiGLU 3 sbf dt / t) |
                   fc2 GEMM 2sbfh/t | TP all-reduce | bias-dropout-add
    backward:      GEMMs 2x the forward FLOPs; flash backward 2.5x (5 matmuls to 2, Dao 2023, FlashAttention-2,
                   section 3.2); element-wise kernels 1.5x their forward bytes; one TP all-reduce per unit
                   (Megatron TP: 2 all-reduces forward and 2 backward per layer, Shoeybi et al. 2019, figure 3).
    embedding:     gather + position add + dropout ((3dt+1) sbh) + TP all-reduce; backward scatter-add into the
                   V h / t gradient (2 V h dt / t + 3 sbh dt).
    head:          final norm, logits GEMM 2 sbhV/t, vocab-parallel cross-entropy in fp32 (about 6 passes of 4 bytes
                   over s b V / t, plus the dt read), backward: GEMMs 2x, cross-entropy grad (8 + dt) sbV/t.

Recompute: selective re-runs the attention core and the MLP activation function forward; full re-runs the whole
unit forward (its TP all-reduce included). Activations and peaks come from ``memory.py``.

Efficiency constants per GPU (``GPU_EFFICIENCY``), with their sources:
- v100: GEMM 0.65, batched attention GEMM 0.28, memory 0.80, no flash attention (FlashAttention needs sm80+).
  Calibrated on the Aceso artifact's V100 profile of GPT-1.3B (miniset gpt_1_3B_mbs1_tp1: QKV/MLP GEMMs run at
  73-87 of 125 TFLOP/s, score/context batched GEMMs at 25-32, softmax/dropout at 700-890 GB/s of 900).
- a100 / a100-40gb: GEMM 0.75 (cuBLAS large bf16 GEMMs 230-250 of 312 TFLOP/s), flash fwd 0.60, bwd 0.45
  (FlashAttention-2 paper, figure 4: 50-73% forward, 40-63% backward on A100), memory 0.80.
- h100 / h200: GEMM 0.70 (600-750 of 989 TFLOP/s bf16), flash fwd 0.55, bwd 0.42 (cuDNN/TE fused attention,
  roughly 500-550 TFLOP/s forward), memory 0.80. H200 has the same compute die; only HBM differs.
- cpu: a placeholder for tests (all 0.5).
KERNEL_OVERHEAD_MS is a typical launch + tail cost of a CUDA kernel (~5 us).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..cluster import ClusterSpec
from ..errors import AcesoError
from ..megatron_fields import analytic_note
from ..model import ModelSpec
from ..training import TrainingSpec
from .comm import CommModel
from .memory import MB, attention_act_bytes, has_attention_dropout, mlp_act_bytes
from .types import N_RC, UNAVAILABLE_MS, UnitTable

KERNEL_OVERHEAD_MS = 0.005


class Efficiency(NamedTuple):
    gemm: float        # dense GEMMs, fraction of the dtype's tensor-core peak
    bmm: float         # batched attention GEMMs (unfused attention)
    flash_fwd: float   # fused flash attention forward (0 = not available: unfused path)
    flash_bwd: float
    mem: float         # element-wise kernels, fraction of HBM bandwidth


GPU_EFFICIENCY: dict[str, Efficiency] = {
    "v100": Efficiency(0.65, 0.28, 0.0, 0.0, 0.80),
    "a100-40gb": Efficiency(0.75, 0.45, 0.60, 0.45, 0.80),
    "a100": Efficiency(0.75, 0.45, 0.60, 0.45, 0.80),
    "h100": Efficiency(0.70, 0.40, 0.55, 0.42, 0.80),
    "h200": Efficiency(0.70, 0.40, 0.55, 0.42, 0.80),
    "cpu": Efficiency(0.5, 0.5, 0.0, 0.0, 0.5),
}


class UnitCost(NamedTuple):
    fwd: float
    bwd: float
    rec_sel: float
    rec_full: float
    tp_comm: float       # fwd + bwd TP collective time inside the unit
    rec_drop: float = UNAVAILABLE_MS   # attn_dropout: the probability dropout + probs x V forward, where it applies


class AnalyticSource:
    """Produces ``UnitTable``s for (per-rank batch, tp, cp, sp) from the roofline above.

    Sequence parallelism (Korthikanti et al. 2023, section 4.2.2): the norms, dropouts and residual adds run on
    ``s / t`` tokens per rank (their bytes and activations / t) and every TP all-reduce becomes a reduce-scatter
    plus an all-gather of the same ring volume (so the same time). Context parallelism (megatron-core / TE ring
    attention): every token-linear kernel runs on ``s / cp`` tokens; the causal attention core of ``s / cp``
    queries against all ``s`` keys, load-balanced (half the score matrix), with ``cp - 1`` ring steps that each
    pass a ``s / cp`` chunk of K and V (backward: K, V and their gradients) overlapped with the core's compute:
    only what the core does not cover is exposed.
    """

    name = "analytic"
    features = ("sequence_parallel", "context_parallel")

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, comm: CommModel):
        self.model, self.cluster, self.training, self.comm = model, cluster, training, comm
        self.eff = GPU_EFFICIENCY.get(cluster.gpu.name, GPU_EFFICIENCY["a100"])
        if training.attention == "flash" and not self.eff.flash_fwd > 0:
            raise AcesoError(f"--attention flash: {cluster.gpu.name} has no flash attention (it needs sm80+, A100 or "
                             "newer); use --attention auto or unfused")
        self.flash = self.eff.flash_fwd > 0 if training.attention == "auto" else training.attention == "flash"
        self.dt = 4.0 if training.precision == "fp32" else 2.0
        self.peak = cluster.gpu.peak_tflops(training.precision) * 1e9   # FLOP per ms
        self.hbm = cluster.gpu.hbm_gbps * 1e6                           # bytes per ms
        note = analytic_note(model)     # a custom layer_spec and megatron fields it does not price
        self.warnings: list[str] = [note] if note else []

    # ----- kernels -----------------------------------------------------------------------------------------------
    def _k(self, flops: float = 0.0, nbytes: float = 0.0, eff: float | None = None) -> float:
        t_c = flops / (self.peak * (eff or self.eff.gemm)) if flops else 0.0
        t_m = nbytes / (self.hbm * self.eff.mem) if nbytes else 0.0
        return max(t_c, t_m) + KERNEL_OVERHEAD_MS

    def _tp_ar(self, b: float, s: int, t: int) -> float:
        """One TP all-reduce of the ``s b h`` activation (with SP: reduce-scatter + all-gather, the same ring time)."""
        return self.comm.all_reduce(self.dt * s * b * self.model.hidden_size, t)

    def _cp_ring(self, b: float, s: float, t: int, cp: int, core_f: float, core_b: float) -> tuple[float, float]:
        """Exposed (fwd, bwd) ms of ring attention's K/V exchange: ``cp - 1`` steps of one ``s / cp`` chunk of K and
        V (backward also dK, dV), each hidden behind its step's share of the attention core."""
        if cp <= 1:
            return 0.0, 0.0
        m = self.model
        chunk = 2 * self.dt * s * b * m.groups * m.head_dim / t      # K and V of this rank's s/cp tokens
        inter = t * cp > self.cluster.gpus_per_node
        step_f = self.comm.p2p(chunk, inter)
        step_b = self.comm.p2p(2 * chunk, inter)
        per_f, per_b = core_f / cp, core_b / cp
        return (cp - 1) * max(0.0, step_f - per_f), (cp - 1) * max(0.0, step_b - per_b)

    def _core(self, b: float, s: int, kv_len: int, t: int, causal: bool) -> tuple[float, float, float]:
        """Attention core (scores, softmax, dropout, context): (fwd, bwd, attn_dropout recompute) ms."""
        m, dt = self.model, self.dt
        flops = 4.0 * s * kv_len * b * m.num_attention_heads * m.head_dim / t
        if self.flash:
            f = flops * (0.5 if causal else 1.0)
            return self._k(f, eff=self.eff.flash_fwd), self._k(2.5 * f, eff=self.eff.flash_bwd), UNAVAILABLE_MS
        elems = m.num_attention_heads * s * kv_len * b / t
        fwd = 2 * self._k(flops / 2, eff=self.eff.bmm) + self._k(nbytes=2 * dt * elems)
        bwd = 2 * self._k(flops, eff=self.eff.bmm) + self._k(nbytes=3 * dt * elems)
        rec_drop = UNAVAILABLE_MS
        if has_attention_dropout(m):
            drop = self._k(nbytes=(2 * dt + 1) * elems)
            fwd += drop
            bwd += drop
            rec_drop = drop + self._k(flops / 2, eff=self.eff.bmm)
        return fwd, bwd, rec_drop

    def attention(self, b: float, s: int, t: int, kv_len: int | None = None, causal: bool = True,
                  cp: int = 1, sp: bool = False) -> UnitCost:
        """``s``: this rank's tokens (the sequence / cp); ``kv_len``: cross-attention's encoder tokens."""
        m, dt = self.model, self.dt
        h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.groups * m.head_dim
        cross = kv_len is not None
        kv_len = kv_len or s
        sbh = s * b * h
        ew = (2 * dt * sbh + (3 * dt + 1) * sbh) / (t if sp else 1)   # norm + bias-dropout-add
        if m.position_embedding == "rope" and not cross:
            ew += 2 * dt * s * b * (q + kv) / t
        gemm = 2.0 * b * (s * h * q + kv_len * h * 2 * kv) / t + 2.0 * s * b * q * h / t
        core_f, core_b, rec_drop = self._core(b, s, kv_len * (cp if not cross else 1), t, causal and not cross)
        ring_f, ring_b = self._cp_ring(b, s, t, cp, core_f, core_b)
        ar = self._tp_ar(b, s, t)
        fwd = self._k(gemm) + self._k(nbytes=ew) + core_f + ring_f + ar
        bwd = self._k(2 * gemm) + self._k(nbytes=1.5 * ew) + core_b + ring_b + ar
        return UnitCost(fwd, bwd, core_f + ring_f, fwd, 2 * ar + ring_f + ring_b, rec_drop)

    def mlp(self, b: float, s: int, t: int, sp: bool = False) -> UnitCost:
        m, dt = self.model, self.dt
        h, f = m.hidden_size, m.ffn_hidden_size
        up = 2 * f if m.activation == "swiglu" else f
        sbh = s * b * h
        ew = (2 * dt * sbh + (3 * dt + 1) * sbh) / (t if sp else 1)
        act_bytes = (3 if m.activation == "swiglu" else 2) * dt * s * b * f / t
        gemm = 2.0 * s * b * h * (up + f) / t
        act_f = self._k(nbytes=act_bytes)
        ar = self._tp_ar(b, s, t)
        fwd = self._k(gemm) + self._k(nbytes=ew) + act_f + ar
        bwd = self._k(2 * gemm) + self._k(nbytes=1.5 * (ew + act_bytes)) + ar
        return UnitCost(fwd, bwd, act_f, fwd, 2 * ar)

    def embedding(self, b: float, s: int, t: int, sp: bool = False) -> tuple[float, float]:
        m, dt = self.model, self.dt
        sbh = s * b * m.hidden_size
        vh = m.padded_vocab_size * m.hidden_size / t
        fwd = self._k(nbytes=(3 * dt + 1) * sbh / (t if sp else 1)) + self._tp_ar(b, s, t)
        bwd = self._k(nbytes=2 * dt * vh + 3 * dt * sbh)
        return fwd, bwd

    def head(self, b: float, s: int, t: int) -> tuple[float, float]:
        m, dt = self.model, self.dt
        sbh = s * b * m.hidden_size
        sbv = s * b * m.padded_vocab_size / t
        gemm = 2.0 * sbh * m.padded_vocab_size / t
        ce_ar = 2 * self.comm.all_reduce(4.0 * s * b, t)
        fwd = self._k(nbytes=2 * dt * sbh) + self._k(gemm) + self._k(nbytes=(dt + 24) * sbv) + ce_ar
        bwd = self._k(nbytes=3 * dt * sbh) + self._k(2 * gemm) + self._k(nbytes=(dt + 8) * sbv) + self._tp_ar(b, s, t)
        return fwd, bwd

    # ----- the table ---------------------------------------------------------------------------------------------
    def unit_table(self, batch: float, tp: int, cp: int = 1, sp: bool = False) -> UnitTable:
        if cp > 1 and not self.flash:
            raise AcesoError(f"context parallelism (cp {cp}) needs transformer-engine's fused attention; the "
                             "unfused (local) attention has none: use --attention flash or cp 1")
        return _build_table(self, float(batch), int(tp), int(cp), bool(sp))


def _seqs(model: ModelSpec, cp: int = 1) -> tuple[int, int]:
    """Tokens per rank of the encoder (GPT: the only) and decoder sequences under context parallelism ``cp``."""
    return model.seq_length // cp, (model.decoder_seq_length if model.is_t5 else model.seq_length) // cp


def _unit_rows(src: AnalyticSource, b: float, t: int, cp: int, sp: bool):
    """Per-unit (UnitCost, act bytes (3,)) keyed by (stack, kind): each distinct kind is computed once."""
    m, dt = src.model, src.dt
    s_enc, s_dec = _seqs(m, cp)
    rows = {}
    for u in m.units:
        key = (u.stack, u.kind)
        if key in rows:
            continue
        s = s_enc if u.stack == "encoder" else s_dec
        causal = not (m.is_t5 and u.stack == "encoder")
        if u.kind == "mlp":
            rows[key] = (src.mlp(b, s, t, sp), mlp_act_bytes(m, b, s, t, dt, sp))
        elif u.kind == "cross_attention":
            rows[key] = (src.attention(b, s, t, kv_len=s_enc, sp=sp),
                         attention_act_bytes(m, b, s, t, src.flash, kv_len=s_enc, dt=dt, sp=sp))
        else:
            cost = src.attention(b, s, t, causal=causal, cp=cp, sp=sp)
            rows[key] = (cost, attention_act_bytes(m, b, s, t, src.flash, dt=dt, sp=sp))
    return rows


def _build_table(src: AnalyticSource, b: float, t: int, cp: int = 1, sp: bool = False) -> UnitTable:
    m, dt = src.model, src.dt
    s_enc, s_dec = _seqs(m, cp)
    rows = _unit_rows(src, b, t, cp, sp)
    r = t if sp else 1          # SP: what TP replicates (norm/dropout/residual tensors) is split over the TP group
    n = m.num_units
    fwd, bwd, tpc = np.zeros(n), np.zeros(n), np.zeros(n)
    rec, act, peak = np.zeros((n, N_RC)), np.zeros((n, N_RC)), np.zeros((n, N_RC))
    params = np.zeros(n)
    for i, u in enumerate(m.units):
        cost, a = rows[(u.stack, u.kind)]
        fwd[i], bwd[i], tpc[i] = cost.fwd, cost.bwd, cost.tp_comm
        rec[i] = (0.0, cost.rec_sel, cost.rec_full, cost.rec_drop)
        act[i] = np.asarray((*a, a[0])[:N_RC]) / MB      # an MLP has no attn_dropout: its none row
        peak[i] = act[i, 0] - act[i]
        params[i] = _unit_params_per_rank(m, u.kind, t)
    boundary = np.full(n + 1, dt * s_dec * b * m.hidden_size / MB / r)   # SP: the sequence-sharded activation
    if m.is_t5:  # encoder boundaries carry the encoder activation; decoder ones also carry the encoder output
        boundary[:m.num_encoder_units + 1] = dt * s_enc * b * m.hidden_size / MB / r
        boundary[m.num_encoder_units + 1:] += dt * s_enc * b * m.hidden_size / MB / r
    emb_f, emb_b = src.embedding(b, s_enc, t, sp)
    head_f, head_b = src.head(b, s_dec, t)
    sbv = s_dec * b * m.padded_vocab_size / t
    return UnitTable(
        batch=b, tp=t, fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec, act_mb=act, peak_mb=peak,
        weight_params=params, boundary_mb=boundary,
        embed_fwd_ms=emb_f, embed_bwd_ms=emb_b, embed_params=m.embedding_params() / t,
        embed_act_mb=(s_enc * b * m.hidden_size * (1 if m.hidden_dropout > 0 else 0)) / MB / r,
        head_fwd_ms=head_f, head_bwd_ms=head_b, head_params=m.output_params() / t,
        # final-norm input (SP: sharded) + logits input (dt sbh) and the fp32 softmax kept by the vocab-parallel loss
        head_act_mb=(dt * s_dec * b * m.hidden_size * (1 + 1 / r) + 4.0 * sbv) / MB,
        head_peak_mb=(dt + 4.0) * sbv / MB,
        tp_comm_ms=tpc,
        word_embed_params=m.padded_vocab_size * m.hidden_size / t if m.tied_embeddings else 0.0,
        encoder_output_mb=dt * s_enc * b * m.hidden_size / MB / r if m.is_t5 else 0.0,
    )


def _unit_params_per_rank(m: ModelSpec, kind: str, t: int) -> float:
    """Linear weights split by TP; norms (and the row-parallel output bias) replicated."""
    norm = m.hidden_size * (2 if m.normalization == "layernorm" else 1)
    bias_rep = m.hidden_size if m.add_bias_linear else 0
    total = m.unit_params(kind)
    return (total - norm - bias_rep) / t + norm + bias_rep

