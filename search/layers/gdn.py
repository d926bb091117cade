"""Gated DeltaNet layers (``G`` in megatron-core 0.19's hybrid layer pattern) as data and formulas: parameters,
FLOPs, activation and state memory, the tensor- and context-parallel rules, and the layer kind.

A GDN layer (megatron-core 0.19.2 ``models/hybrid/hybrid_layer_specs.py`` ``gdn_layer``: a ``TransformerLayer`` whose
``self_attention`` is ``ssm/gated_delta_net/gdn.py`` ``GatedDeltaNet``, no MLP) is the fused pre-norm +
``in_proj`` (``TELayerNormColumnParallelLinear``), the mixer, ``out_proj`` (``TERowParallelLinear``) and a residual
add. With ``qk = H_k d_k`` and ``v = H_v d_v`` (``linear_num_key_heads`` x ``linear_key_head_dim``,
``linear_num_value_heads`` x ``linear_value_head_dim``; ``ssm/gated_delta_net/common.py`` ``_GDNBase.__init__``):

- ``in_proj``: ``h -> [q, k, v, z, beta, alpha]`` of widths ``qk, qk, v, v, H_v, H_v`` (``in_proj_split_sections``;
  ``bias=False``, the layer spec's default), column-parallel;
- a depthwise causal ``conv1d`` of width ``linear_conv_kernel_dim`` over ``[q, k, v]`` (``conv_dim = 2 qk + v``
  channels, ``conv_bias=False``) and SiLU, then L2-normalised ``q, k`` repeated to ``H_v`` heads;
- the gate ``g = -exp(A_log) softplus(alpha + dt_bias)`` and ``beta = sigmoid(beta)`` (``A_log``, ``dt_bias``:
  ``H_v`` each, split over TP);
- the chunked gated delta rule (fla's ``chunk_gated_delta_rule``), an RMSNorm over each head's ``d_v`` channels
  (``out_norm``, one weight of ``d_v`` shared by the heads, replicated over TP), gated by ``silu(z)``;
- the row-parallel ``out_proj`` ``v -> h`` (no bias).

FLOPs (2 per multiply-add, forward): the projections and the convolution as their shapes say; the scan as fla's
chunk algorithm (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025,
section 3.3, and the WY form of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length", section 3; fla ``ops/gated_delta_rule/chunk.py`` ``chunk_gated_delta_rule_fwd`` with chunks of
``C = 64`` (``BT``)). Per chunk and value head: ``beta K K^T`` (``C^2 d_k``, ``chunk_scaled_dot_kkt_fwd``), the
lower-triangular inverse (``C^3 / 3``, ``solve_tril``), ``W = T beta K`` and ``U = T beta V`` (``C^2 (d_k + d_v)``,
``recompute_w_u_fwd``), the state recurrence ``U - W S`` and ``S + K^T V_new`` (``2 C d_k d_v``,
``chunk_gated_delta_rule_fwd_h``), and the output ``Q S`` plus the masked ``(Q K^T) V_new`` (``C d_k d_v + C^2 (d_k +
d_v)``, ``chunk_fwd_o``): with ``s`` padded to whole chunks, ``H_v s (3 C d_k + 2 C d_v + 3 d_k d_v + C^2 / 3)``
multiply-adds. Megatron-LM 0.19's ``gdn_layer_flops`` (training.py) counts the same projections and conv, and
``4 H_v d_v^2`` per token for the rule (the recurrent form's ``K K^T, V K^T, S(a(I - b K K^T)), S Q``); the chunk
form spends more on the ``C x C`` blocks. Element-wise work (conv activation, L2 norms, gate, norm) is apart.

Activation memory: what backward keeps per token on one rank, megatron-core's forward over fla's autograd
functions (``causal_conv1d`` keeps its input, ``l2norm`` its outputs, ``ChunkGatedDeltaRuleFunction`` saves
``q, k, v, g, beta`` and the ``C``-wide inverse ``A`` per head and recomputes ``W, U`` and the states in backward):
the fused norm's input, ``in_proj``'s output, the conv output, ``q, k`` after the norm and repeat (``H_v`` heads),
``g`` (fp32) and ``beta``, ``A``, the rule's output and the norm's fp32 ``rstd`` per head, ``out_proj``'s input.
Context parallelism is an all-to-all from a sequence split to a head split (``tensor_a2a_cp2hp`` on ``in_proj``'s
output, ``tensor_a2a_hp2cp`` on the norm's output), so each rank runs the whole sequence for ``H / (tp cp)`` heads.

megatron-core 0.19 asserts (``TransformerConfig.__post_init__``): ``linear_num_value_heads`` a multiple of
``linear_num_key_heads``, and both multiples of ``tp x cp``; fp8 wants ``in_proj``'s width a multiple of 16.
``GatedDeltaNet.__init__`` raises ImportError without fla (``flash-linear-attention``): on CPU the aceso runtime
runs it on ``patches/gdn_cpu.py``'s torch kernels, and refuses it under cp (the kind's ``no_runtime_cp``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .kind import LayerKind, Row, register
from .mamba import FP32, mixer_cost

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
CHUNK = 64          # fla chunk_gated_delta_rule's chunk length BT (ops/gated_delta_rule/chunk.py)


class GDNSpec(BaseModel):
    """A Gated DeltaNet mixer in megatron-core 0.19's terms: ``TransformerConfig``'s ``linear_*`` fields (Megatron-LM
    flags with ``-`` for ``_``; defaults are megatron-core 0.19.2's, ``transformer_config.py`` "linear attention")."""

    model_config = _STRICT

    linear_key_head_dim: int = Field(128, gt=0, le=1 << 12, description="Query and key head dim d_k (HF "
                                     "linear_key_head_dim).")
    linear_value_head_dim: int = Field(128, gt=0, le=1 << 12, description="Value and gate head dim d_v (HF "
                                       "linear_value_head_dim).")
    linear_num_key_heads: int = Field(16, gt=0, le=1 << 12, description="Query and key heads H_k (HF "
                                      "linear_num_key_heads).")
    linear_num_value_heads: int = Field(32, gt=0, le=1 << 12, description="Value and gate heads H_v (HF "
                                        "linear_num_value_heads).")
    linear_conv_kernel_dim: int = Field(4, gt=1, le=64, description="Causal convolution width (HF "
                                        "linear_conv_kernel_dim).")

    @model_validator(mode="after")
    def _check(self) -> "GDNSpec":
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        return self

    @property
    def qk(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def v(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.qk + self.v

    @property
    def in_proj_out(self) -> int:
        return 2 * self.qk + 2 * self.v + 2 * self.linear_num_value_heads


# ----- rules (one line each; None: allowed) ---------------------------------------------------------------------
def shape_refusal(g: GDNSpec, tp: int, cp: int = 1) -> str | None:
    """megatron-core 0.19's ``TransformerConfig`` asserts: both head counts multiples of ``tp x cp``."""
    for field, heads in (("linear_num_key_heads", g.linear_num_key_heads),
                         ("linear_num_value_heads", g.linear_num_value_heads)):
        if heads % (tp * cp):
            return (f"gdn.{field} ({heads}) must be a multiple of tensor_model_parallel_size x "
                    f"context_parallel_size ({tp} x {cp})")
    return None


def fp8_refusal(g: GDNSpec) -> str | None:
    """``_GDNBase.__init__`` under fp8: in_proj's output width a multiple of 16."""
    if g.in_proj_out % 16:
        return f"gdn in_proj width 2 qk + 2 v + 2 H_v ({g.in_proj_out}) must be a multiple of 16 for fp8"
    return None


# ----- parameters ------------------------------------------------------------------------------------------------
class Params(NamedTuple):
    """Parameters of one GDN layer on one TP rank (tp = 1: the whole layer), the fused pre-norm included."""

    in_proj: int
    conv1d: int       # weight only (conv_bias=False)
    dt_bias: int
    A_log: int
    out_norm: int     # one d_v weight, replicated over TP
    out_proj: int
    pre_norm: int     # the LayerNorm fused into in_proj (replicated over TP)

    @property
    def total(self) -> int:
        return sum(self)


def params(g: GDNSpec, hidden: int, tp: int = 1, layernorm: bool = False) -> Params:
    why = shape_refusal(g, tp)
    if why:
        raise ValueError(why)
    return Params(in_proj=hidden * g.in_proj_out // tp, conv1d=g.conv_dim // tp * g.linear_conv_kernel_dim,
                  dt_bias=g.linear_num_value_heads // tp, A_log=g.linear_num_value_heads // tp,
                  out_norm=g.linear_value_head_dim, out_proj=g.v // tp * hidden,
                  pre_norm=hidden * (2 if layernorm else 1))


# ----- FLOPs -----------------------------------------------------------------------------------------------------
class Flops(NamedTuple):
    """Forward FLOPs of one GDN layer over one sequence (all TP ranks together)."""

    in_proj: float
    conv1d: float
    scan: float           # the chunked gated delta rule (module docstring)
    out_proj: float
    elementwise: float    # not in ``total``: SiLU, L2 norms, g and beta, output norm and gate

    @property
    def total(self) -> float:
        return self.in_proj + self.conv1d + self.scan + self.out_proj


def scan_macs(g: GDNSpec, seq: int, chunk: int = CHUNK) -> float:
    """Multiply-adds of the chunked gated delta rule over one sequence of ``seq`` tokens (padded to whole chunks)."""
    c, dk, dv = chunk, g.linear_key_head_dim, g.linear_value_head_dim
    chunks = math.ceil(seq / c)
    per_chunk = 3 * c * c * dk + 2 * c * c * dv + 3 * c * dk * dv + c ** 3 / 3
    return float(g.linear_num_value_heads * chunks * per_chunk)


def forward_flops(g: GDNSpec, hidden: int, seq: int) -> Flops:
    """Forward FLOPs of one layer over one sequence of ``seq`` tokens."""
    hv = g.linear_num_value_heads
    # per token: SiLU of the conv (4 per channel), L2 norm of q, k (3 per channel), g and beta (6 per head), the
    # output RMSNorm (3) and its SiLU gate (5) per value channel
    elementwise = seq * (4 * g.conv_dim + 3 * 2 * g.qk + 6 * hv + 8 * g.v)
    return Flops(in_proj=2.0 * seq * hidden * g.in_proj_out, conv1d=2.0 * seq * g.conv_dim * g.linear_conv_kernel_dim,
                 scan=2.0 * scan_macs(g, seq), out_proj=2.0 * seq * g.v * hidden, elementwise=float(elementwise))


# ----- memory ----------------------------------------------------------------------------------------------------
class ActBytes(NamedTuple):
    """Bytes one GDN layer keeps for backward per token of this rank's sequence share (module docstring)."""

    in_proj_input: float
    in_proj_output: float   # q k v z beta alpha (the conv's input among them)
    conv_output: float
    qk_normed: float        # q, k after the L2 norm, repeated to H_v heads
    gates: float            # g (fp32) and beta per head
    inverse: float          # the chunk's (I + A)^-1, C wide per head
    rule_output: float      # the norm's input, plus its fp32 rstd per head
    out_proj_input: float

    @property
    def total(self) -> float:
        return sum(self)


def act_bytes(g: GDNSpec, hidden: int, dtype_bytes: int, tp: int = 1, cp: int = 1, sp: bool = False,
              chunk: int = CHUNK) -> ActBytes:
    why = shape_refusal(g, tp, cp)
    if why:
        raise ValueError(why)
    b, hv = dtype_bytes, g.linear_num_value_heads / tp
    return ActBytes(in_proj_input=b * hidden / (tp if sp else 1), in_proj_output=b * g.in_proj_out / tp,
                    conv_output=b * g.conv_dim / tp, qk_normed=b * 2 * hv * g.linear_key_head_dim,
                    gates=(FP32 + b) * hv, inverse=b * chunk * hv, rule_output=b * g.v / tp + FP32 * hv,
                    out_proj_input=b * g.v / tp)


def scan_state_bytes(g: GDNSpec, seq: int, dtype_bytes: int, tp: int = 1, cp: int = 1, chunk: int = CHUNK) -> float:
    """Transient bytes of the per-chunk states ``S`` (``d_k x d_v`` per head) fla's forward materialises for one
    sequence (``chunk_gated_delta_rule_fwd_h``'s ``h``), and again in backward's recompute, for this rank's heads."""
    per_chunk = g.linear_num_value_heads // (tp * cp) * g.linear_key_head_dim * g.linear_value_head_dim
    return math.ceil(seq / chunk) * per_chunk * dtype_bytes


def inference_state_bytes(g: GDNSpec, dtype_bytes: int, tp: int = 1) -> int:
    """Recurrent state of one sequence: the conv window (``conv_dim x d_conv``) and the fp32 delta-rule state
    (``H_v x d_k x d_v``), per TP rank."""
    hv = g.linear_num_value_heads // tp
    return g.conv_dim // tp * g.linear_conv_kernel_dim * dtype_bytes + hv * g.linear_key_head_dim * \
        g.linear_value_head_dim * FP32


def cp_all_to_all_widths(g: GDNSpec, tp: int, cp: int) -> tuple[int, ...]:
    """Per token of this rank's share, the width of each forward CP all-to-all (``tensor_a2a_cp2hp`` on in_proj's
    output, ``tensor_a2a_hp2cp`` on the gated norm's); empty without CP."""
    return () if cp == 1 else (g.in_proj_out // tp, g.v // tp)


# ----- the layer kind ``G`` (search.layers.kind; docs/layer-kinds.md) ---------------------------------------------
def _spec(model) -> GDNSpec:
    spec = getattr(model, "gdn", None)
    if spec is None:
        raise ValueError(f"model {model.name}: a GDN layer needs the model's gdn block (GDNSpec)")
    return spec


def layer_params(model) -> int:
    return params(_spec(model), model.hidden_size, 1, model.normalization == "layernorm").total


def layer_flops(model, seq: int, keys: int | None = None) -> float:
    return forward_flops(_spec(model), model.hidden_size, seq).total


def scan_bmms(g: GDNSpec, b: float, seq: int, tp: int, chunk: int = CHUNK) -> list[tuple[float, int, int, int]]:
    """The chunked rule of ``b`` sequences on one TP rank as batched matmuls (batch, m, n, k) (``scan_macs``)."""
    c, dk, dv = chunk, g.linear_key_head_dim, g.linear_value_head_dim
    heads = b * math.ceil(seq / c) * g.linear_num_value_heads / tp
    return [(heads, c, c, dk),            # beta K K^T
            (heads / 3, c, c, c),         # the triangular inverse (C^3 / 3 per chunk and head)
            (heads, c, dk + dv, c),       # W, U
            (heads, c, dv, dk),           # W S
            (heads, dk, dv, c),           # K^T V_new
            (heads, c, dv, dk),           # Q S
            (heads, c, c, dk),            # Q K^T
            (heads, c, dv, c)]            # (Q K^T) V_new


def mixer_bytes(g: GDNSpec, tokens: float, dtype_bytes: float, tp: int) -> float:
    """Element-wise bytes of the mixer's forward on one TP rank: the conv (read and write ``conv_dim``), the L2 norm
    and repeat of q, k, the rule's inputs and output, and the gated norm (output and z read, output written)."""
    return dtype_bytes * tokens * (2 * g.conv_dim + 4 * g.qk + g.in_proj_out + 4 * g.v) / tp


def price_layer(src, u, a):
    """One GDN layer on one rank, per micro-batch, priced as Mamba-2's (``mamba.mixer_cost``): the projections as a
    column- / row-parallel GEMM pair with their TP collectives, the pre-norm and residual add memory-bound, and the
    mixer's kernels (the rule as its chunk matmuls at the batched-GEMM rate, ``scan_bmms``; the element-wise passes
    memory-bound) times ``SSD_KERNEL_TIME``, Mamba-2's Triton chunk-kernel factor (no published GDN run to fit one
    of its own: docs/costmodel.md). Backward: the gradients, 1.5x the element-wise bytes, and fla's recompute of
    ``W, U`` and the states (the forward's rule once more). Context parallelism: the two all-to-alls forward and
    backward, exposed. Bytes kept: ``act_bytes``; full recompute keeps the layer input."""
    model, dt = src.model, src.dt
    spec, h, t = _spec(model), model.hidden_size, a.t
    sb, r = a.s * a.b, (t if a.sp else 1)
    cost = mixer_cost(src, a, spec.in_proj_out, spec.v, scan_bmms(spec, a.b, a.s, t), mixer_bytes(spec, sb, dt, t),
                      cp_all_to_all_widths(spec, t, a.cp))
    keep = sb * act_bytes(spec, h, int(dt), t, a.cp, a.sp).total
    full = dt * sb * h / r
    return Row(cost, (keep, keep, full), params(spec, h, t, model.normalization == "layernorm").total)


def gdn_launches(m, quantized: bool, n_local: int = 0, moe=None) -> dict:
    """megatron-core 0.19 ``GatedDeltaNet.forward`` (training, bshd, no CP): TE LayerNormColumnParallelLinear (2),
    transpose and split (1), fla ``causal_conv1d`` (1), ``l2norm`` (1), ``repeat_interleave`` of q, k (2) and the
    contiguous copies (2), ``_compute_g_and_beta`` (2), fla ``chunk_gated_delta_rule_fwd`` (local cumsum,
    ``chunk_scaled_dot_kkt``, ``solve_tril``, ``recompute_w_u``, ``fwd_h``, ``fwd_o``: 6), the gated norm (3), the
    transpose back (1), ``out_proj`` (1), bias-dropout-add (1): 23, + 3 quantized (as Mamba's)."""
    return {"gdn": 23 + 3 * (1 if quantized else 0)}


GDN = register(LayerKind(
    name="gdn", symbol="G", role="attention", label="GDN", params=layer_params, flops=layer_flops,
    price=price_layer, in_layer=lambda m, stack: False,      # only where a hybrid pattern writes G
    recompute=("none", "full"),     # gdn_norm_out (megatron-core 0.19) recomputes the output norm only: not a plan choice
    hybrid_slot="gdn_layer", launches=gdn_launches, block="gdn",
    shape_refusal=lambda model, tp, cp: shape_refusal(_spec(model), tp, cp),
    # GatedDeltaNet's own all-to-alls (tensor_a2a_cp2hp) on the runtime's per-stage groups are not run against stock
    # megatron-core
    no_runtime_cp="Gated DeltaNet layers"))
