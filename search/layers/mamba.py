"""Mamba-2 layers (``M`` in megatron-core's hybrid layer pattern) as data and formulas: parameters, FLOPs,
activation and state memory, and the tensor- and context-parallel rules, as megatron-core builds the layer.

A Mamba layer (``MambaLayer``, megatron-core 0.16.1 and 0.19.2: ``ssm/mamba_layer.py``, ``ssm/mamba_mixer.py``) is
a pre-norm (``norm``, or the layer norm fused into TE's ``in_proj``), the mixer, and a residual add. The mixer:

- ``in_proj``: ``h -> [z, x, B, C, dt]`` of widths ``d_inner, d_inner, g N, g N, H`` (no bias: megatron-core asserts
  ``not bias``), column-parallel: every part is split over TP, so ``H`` and ``g`` must be multiples of ``tp``.
  ``d_inner = H P`` with ``H = mamba_num_heads`` (None: ``expand h / P``), ``P = mamba_head_dim``,
  ``g = mamba_num_groups``, ``N = mamba_state_dim``.
- a depthwise causal ``conv1d`` of width ``d_conv`` over ``[x, B, C]`` (``conv_dim = d_inner + 2 g N`` channels,
  with bias) and SiLU;
- the selective state-space scan (SSD) with per-head ``dt_bias``, ``A_log`` and skip ``D`` (``H`` each), gated by
  ``silu(z)``;
- a grouped RMSNorm over ``d_inner`` (``g`` groups, weight only) and the row-parallel ``out_proj`` ``d_inner -> h``
  (no bias).

FLOPs (2 per multiply-add, forward; backward is priced elsewhere as 2x): the projections and the convolution as
their shapes say; the scan as the SSD algorithm of Dao & Gu 2024 ("Transformers are SSMs", section 6, the block
decomposition mamba_ssm's kernels implement) over chunks of ``Q = chunk_size``: per chunk and group the ``C B^T``
product (``Q^2 N``), per chunk and head the masked ``(L o C B^T) X`` product (``Q^2 P``), the chunk's state
``B^T X`` (``Q N P``), its hand-off to the next chunk (``N P``) and the read-out ``C h`` (``Q N P``): with ``s``
padded to whole chunks, ``g s Q N + H s Q P + 2 H s N P + H (s / Q) N P`` multiply-adds, the full ``Q x Q`` blocks
counted as the kernels compute them (the paper's ``O(s N^2)`` for ``N = P = Q``). Element-wise work (softplus and
exponentials of ``dt A``, the ``D`` skip, the gate, the norm) is reported apart (``elementwise``), as the matmul
count excludes it. Megatron-LM's ``mamba_layer_flops`` (training.py) instead takes ``d_inner = 2 h`` whatever
``mamba_num_heads`` is and ``7 s d_inner N`` for the scan.

Activation memory (what backward keeps, training path ``use_mamba_mem_eff_path``): ``in_proj``'s input (``h``, or
``h / tp`` with sequence parallelism, which re-gathers it in backward), what mamba_ssm's
``MambaSplitConv1dScanCombinedFn`` saves (the whole ``zxbcdt`` and the un-gated scan output ``out_x``; it recomputes
the convolution and the scan in backward), the gated norm's input and its per-group ``rstd`` (fp32), and
``out_proj``'s input. The layer's pre-norm is an ordinary norm and is not counted here. Under context parallelism
the mixer swaps the sequence split for a head split (all-to-all, ``mamba_context_parallel.py``): each rank scans
the whole sequence for ``H / (tp cp)`` heads, and ``B, C`` of a group whose heads span several CP ranks are
repeated on each (``cp > g / tp``).

The layer kind ``M`` (``MAMBA``, at the end: search.layers.kind, docs/layer-kinds.md) prices a Mamba layer from these
formulas (``price_layer``). Checked against megatron-core's own ``MambaLayer`` on CPU
(``tests/runtime/test_mamba_layer.py``: parameters per TP rank, activation bytes with saved-tensor hooks under
``patches/mamba_cpu.py``).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from .kind import UNAVAILABLE_MS, LayerKind, Row, UnitCost, register

_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
FP32 = 4


class Mamba2Spec(BaseModel):
    """A Mamba-2 mixer in megatron-core's terms: ``TransformerConfig``'s ``mamba_*`` fields (Megatron-LM flags with
    ``-`` for ``_``) and the ``MambaMixer`` arguments its layer specs leave at their defaults."""

    model_config = _STRICT

    mamba_state_dim: int = Field(128, gt=0, le=1 << 12, description="SSM state size N per head (HF ssm_state_size; "
                                 "megatron-core's default 128).")
    mamba_head_dim: int = Field(64, gt=0, le=1 << 12, description="Channels per head P (HF mamba_head_dim).")
    mamba_num_groups: int = Field(8, gt=0, le=1 << 12, description="Groups g sharing B and C (HF n_groups; "
                                  "megatron-core's default 8).")
    mamba_num_heads: int | None = Field(None, gt=0, le=1 << 16, description="Heads H (HF mamba_num_heads); None = "
                                        "expand x hidden_size / mamba_head_dim.")
    expand: int = Field(2, gt=0, le=64, description="MambaMixer's expand (no flag; used when mamba_num_heads is "
                        "None).")
    d_conv: int = Field(4, gt=1, le=64, description="Causal convolution width (MambaMixer d_conv; HF conv_kernel).")
    chunk_size: int = Field(128, gt=0, le=1 << 14, description="SSD chunk length Q of the scan kernels (MambaMixer "
                            "chunk_size; HF chunk_size).")
    use_mamba_mem_eff_path: bool = Field(True, description="The fused conv + scan training kernel (Megatron-LM "
                                         "--disable-mamba-mem-eff-path turns it off).")
    mamba_training_ssm_states_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="megatron-core 0.19: dtype of the inter-chunk SSM states the training scan materialises "
        "(--mamba-training-ssm-states-dtype); None: the activation dtype.")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Without the states dtype when unset: models without it dump (and digest) as before the field existed."""
        out = handler(self)
        if isinstance(out, dict) and out.get("mamba_training_ssm_states_dtype", 0) is None:
            out.pop("mamba_training_ssm_states_dtype")
        return out

    @model_validator(mode="after")
    def _check(self) -> "Mamba2Spec":
        if self.mamba_num_heads is not None and self.mamba_num_heads % self.mamba_num_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of mamba_num_groups "
                             f"({self.mamba_num_groups})")
        return self


class Shape(NamedTuple):
    """The mixer's sizes for a model width ``hidden``."""

    hidden: int
    heads: int        # H
    head_dim: int     # P
    groups: int       # g
    state: int        # N
    d_inner: int      # H P

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.state

    @property
    def in_proj_out(self) -> int:
        return 2 * self.d_inner + 2 * self.groups * self.state + self.heads


def shape(m: Mamba2Spec, hidden: int) -> Shape:
    """Sizes as ``MambaMixer.__init__`` derives them; ValueError (one line) where megatron-core asserts."""
    p = m.mamba_head_dim
    if m.mamba_num_heads is None:
        d_inner = m.expand * hidden
        if d_inner % p:
            raise ValueError(f"mamba: expand x hidden_size ({d_inner}) must be a multiple of mamba_head_dim ({p}); "
                             "set mamba_num_heads")
        heads = d_inner // p
    else:
        heads = m.mamba_num_heads
    if heads % m.mamba_num_groups:
        raise ValueError(f"mamba: heads ({heads}) must be a multiple of mamba_num_groups ({m.mamba_num_groups})")
    return Shape(hidden, heads, p, m.mamba_num_groups, m.mamba_state_dim, heads * p)


# ----- rules (one line each; None: allowed) ---------------------------------------------------------------------
def tp_refusal(m: Mamba2Spec, hidden: int, tp: int) -> str | None:
    """megatron-core gives every TP rank whole heads and whole groups (``MambaMixer.__init__``)."""
    s = shape(m, hidden)
    if s.heads % tp:
        return f"mamba heads ({s.heads}) must be a multiple of tensor_model_parallel_size ({tp})"
    if s.groups % tp:
        return f"mamba_num_groups ({s.groups}) must be a multiple of tensor_model_parallel_size ({tp})"
    return None


def cp_refusal(m: Mamba2Spec, hidden: int, tp: int, cp: int) -> str | None:
    """Mamba context parallelism is an all-to-all from a sequence split to a head split
    (``MambaContextParallel``): whole heads per CP rank, and groups split over or repeated on CP ranks evenly."""
    why = tp_refusal(m, hidden, tp)
    if why or cp == 1:
        return why
    s = shape(m, hidden)
    heads, groups = s.heads // tp, s.groups // tp
    if heads % cp:
        return (f"mamba heads per TP rank ({heads}) must be a multiple of context_parallel_size ({cp}); "
                f"cp is at most heads / tp")
    if groups < cp and cp % groups:
        return f"context_parallel_size ({cp}) must be a multiple of mamba_num_groups / tp ({groups})"
    if groups >= cp and groups % cp:
        return f"mamba_num_groups / tp ({groups}) must be a multiple of context_parallel_size ({cp})"
    return None


def fp8_refusal(m: Mamba2Spec, hidden: int) -> str | None:
    """FP8 GEMMs want in_proj's output width a multiple of 16 (``MambaMixer.__init__`` asserts it under fp8)."""
    width = shape(m, hidden).in_proj_out
    if width % 16:
        return f"mamba in_proj width 2 d_inner + 2 g N + heads ({width}) must be a multiple of 16 for fp8"
    return None


# ----- parameters ------------------------------------------------------------------------------------------------
class Params(NamedTuple):
    """Parameters of one Mamba layer on one TP rank (tp = 1: the whole layer), the pre-norm included."""

    in_proj: int
    conv1d: int       # weight and bias
    dt_bias: int
    A_log: int
    D: int
    norm: int         # the mixer's gated RMSNorm
    out_proj: int
    pre_norm: int     # the layer's input norm (replicated over TP)

    @property
    def total(self) -> int:
        return sum(self)


def params(m: Mamba2Spec, hidden: int, tp: int = 1, layernorm: bool = False) -> Params:
    """``layernorm``: the pre-norm is a LayerNorm (weight and bias) rather than an RMSNorm."""
    s = shape(m, hidden)
    why = tp_refusal(m, hidden, tp)
    if why:
        raise ValueError(why)
    heads = s.heads // tp
    return Params(in_proj=hidden * s.in_proj_out // tp, conv1d=s.conv_dim // tp * (m.d_conv + 1), dt_bias=heads,
                  A_log=heads, D=heads, norm=s.d_inner // tp, out_proj=s.d_inner // tp * hidden,
                  pre_norm=hidden * (2 if layernorm else 1))


# ----- FLOPs -----------------------------------------------------------------------------------------------------
class Flops(NamedTuple):
    """Forward FLOPs of one Mamba layer over one sequence (all TP ranks together)."""

    in_proj: float
    conv1d: float
    scan: float           # SSD: C B^T, the masked chunk product, chunk states, state passing, read-out
    out_proj: float
    elementwise: float    # not in ``total``: softplus / exp of dt A, dt x, D skip, gate, grouped RMSNorm

    @property
    def total(self) -> float:
        return self.in_proj + self.conv1d + self.scan + self.out_proj


def scan_macs(m: Mamba2Spec, hidden: int, seq: int) -> float:
    """Multiply-adds of the SSD scan of one sequence of ``seq`` tokens (padded to whole chunks)."""
    s = shape(m, hidden)
    q = m.chunk_size
    chunks = math.ceil(seq / q)
    padded = chunks * q
    cb = s.groups * chunks * q * q * s.state
    diagonal = s.heads * chunks * q * q * s.head_dim
    states = s.heads * padded * s.state * s.head_dim
    passing = s.heads * chunks * s.state * s.head_dim
    read_out = s.heads * padded * s.state * s.head_dim
    return float(cb + diagonal + states + passing + read_out)


def forward_flops(m: Mamba2Spec, hidden: int, seq: int) -> Flops:
    """Forward FLOPs of one layer over one sequence of ``seq`` tokens."""
    s = shape(m, hidden)
    # element-wise per token: dt (bias, softplus, x A, exp: 4 per head), dt x and D x (2 per channel), gate
    # y silu(z) (2), RMSNorm (square-add, scale by rstd, by weight: 3) per d_inner channel
    elementwise = seq * (4 * s.heads + 7 * s.d_inner)
    return Flops(in_proj=2.0 * seq * hidden * s.in_proj_out, conv1d=2.0 * seq * s.conv_dim * m.d_conv,
                 scan=2.0 * scan_macs(m, hidden, seq), out_proj=2.0 * seq * s.d_inner * hidden,
                 elementwise=float(elementwise))


# ----- memory ----------------------------------------------------------------------------------------------------
class ActBytes(NamedTuple):
    """Bytes one Mamba mixer keeps for backward per token on one rank (``tokens`` = its sequence share)."""

    in_proj_input: float
    zxbcdt: float          # the fused kernel's saved in_proj output (after the CP all-to-all)
    scan_out: float        # the kernel's un-gated output out_x
    norm_input: float      # incl. the norm's fp32 rstd per group
    out_proj_input: float

    @property
    def total(self) -> float:
        return sum(self)


def local_groups(m: Mamba2Spec, hidden: int, tp: int, cp: int) -> int:
    """Groups whose B and C one rank holds after the CP all-to-all, times cp (per token of its sequence share):
    ``g / tp``, or ``cp`` when groups are repeated over CP ranks (``MambaContextParallel.group_repeat_count``)."""
    groups = shape(m, hidden).groups // tp
    return groups if groups >= cp else cp


def act_bytes(m: Mamba2Spec, hidden: int, dtype_bytes: int, tp: int = 1, cp: int = 1, sp: bool = False) -> ActBytes:
    """Per token of this rank's sequence share (``seq / cp``), training path of megatron-core's MambaMixer."""
    why = cp_refusal(m, hidden, tp, cp)
    if why:
        raise ValueError(why)
    if not m.use_mamba_mem_eff_path:
        raise ValueError("mamba: activation memory is modelled for use_mamba_mem_eff_path (megatron-core's "
                         "training path) only")
    s = shape(m, hidden)
    b = dtype_bytes
    inner = s.d_inner // tp
    zxbcdt = 2 * inner + 2 * s.state * local_groups(m, hidden, tp, cp) + s.heads // tp
    return ActBytes(in_proj_input=b * hidden / (tp if sp else 1), zxbcdt=b * zxbcdt, scan_out=b * inner,
                    norm_input=b * inner + FP32 * s.groups // tp, out_proj_input=b * inner)


def fixed_act_bytes(m: Mamba2Spec, hidden: int, dtype_bytes: int, tp: int = 1) -> int:
    """Kept per layer whatever the tokens, fp32 per head: ``A = -exp(A_log)`` (kept by the exp and by the kernel;
    A_log is an fp32 parameter) and, with 16-bit parameters, the kernel's fp32 copy of ``dt_bias``."""
    return (2 if dtype_bytes == FP32 else 3) * FP32 * shape(m, hidden).heads // tp


def scan_state_bytes(m: Mamba2Spec, hidden: int, seq: int, dtype_bytes: int, tp: int = 1, cp: int = 1) -> int:
    """Transient bytes of the inter-chunk states one sequence materialises in the scan kernels (forward, and again
    in backward's recompute): fp32 chunk states and the passed states in the activation dtype (megatron-core
    0.19's ``mamba_training_ssm_states_dtype`` can change the latter), for this rank's heads."""
    s = shape(m, hidden)
    per_chunk = s.heads // (tp * cp) * s.head_dim * s.state
    return math.ceil(seq / m.chunk_size) * per_chunk * (FP32 + dtype_bytes)


def inference_state_bytes(m: Mamba2Spec, hidden: int, dtype_bytes: int, tp: int = 1) -> int:
    """Recurrent state of one sequence at inference (``mamba_state_shapes_per_request``): the conv window
    (conv_dim x d_conv) and the SSM state (H x P x N), per TP rank."""
    s = shape(m, hidden)
    return (s.conv_dim // tp * m.d_conv + s.heads // tp * s.head_dim * s.state) * dtype_bytes


def cp_all_to_all_widths(m: Mamba2Spec, hidden: int, tp: int, cp: int) -> tuple[int, ...]:
    """Per token of this rank's sequence share, the width of each forward CP all-to-all's input on the training path
    (``MambaContextParallel.pre_conv_ssm``: z, x, B, C (B and C repeated over ``group_repeat_count`` ranks), dt; then
    ``post_conv_ssm``: y); empty without CP. Backward runs the reverse all-to-alls of the same sizes."""
    if cp == 1:
        return ()
    s = shape(m, hidden)
    bc = s.state * local_groups(m, hidden, tp, cp)
    return (s.d_inner // tp, s.d_inner // tp, bc, bc, s.heads // tp, s.d_inner // tp)


def cp_all_to_all_elems(m: Mamba2Spec, hidden: int, tp: int, cp: int) -> float:
    """Elements one rank sends per token of its sequence share in one layer's forward CP all-to-alls: before the
    conv (z, x, B, C (repeated), dt) and after the norm (y); each all-to-all keeps 1/cp of its input local."""
    return sum(cp_all_to_all_widths(m, hidden, tp, cp)) * (cp - 1) / cp


def cp_all_to_all_ms(src, m: Mamba2Spec, hidden: int, tokens: float, tp: int, cp: int) -> float:
    """One direction's CP all-to-alls of one Mamba layer (``tokens``: this rank's ``b s / cp``): each an all-to-all
    over the CP group (ranks ``tp`` apart, megatron-core's tp-cp-ep-dp-pp order) of ``tokens x width`` elements,
    ``(cp - 1) / cp`` of them leaving the rank, priced as the EP dispatch's all-to-all
    (``moe_primitives.ep_all_to_all_ms``: latency + the slower of the NVLink and the network share)."""
    return all_to_all_ms(src, cp_all_to_all_widths(m, hidden, tp, cp), tokens, tp, cp)


def all_to_all_ms(src, widths, tokens: float, tp: int, cp: int) -> float:
    """CP all-to-alls of ``tokens x width`` elements each (``widths``), as ``cp_all_to_all_ms`` prices them (a
    head-split mixer's: Mamba-2, GDN)."""
    members = src.comm.members_per_node(0, tp, cp)
    return sum(src.ep_all_to_all_ms(src.comm, src.dt * tokens * w, cp, members) for w in widths)


# ----- the layer kind ``M`` (search.layers.kind; docs/layer-kinds.md) ---------------------------------------------
def _spec(model) -> Mamba2Spec:
    spec = getattr(model, "mamba", None)
    if spec is None:
        raise ValueError(f"model {model.name}: a Mamba layer needs the model's mamba block (Mamba2Spec)")
    return spec


def layer_params(model) -> int:
    """One Mamba layer, unsharded, its pre-norm included."""
    return params(_spec(model), model.hidden_size, 1, model.normalization == "layernorm").total


def layer_flops(model, seq: int, keys: int | None = None) -> float:
    return forward_flops(_spec(model), model.hidden_size, seq).total


def scan_bmms(m: Mamba2Spec, hidden: int, b: float, seq: int, tp: int) -> list[tuple[float, int, int, int]]:
    """The SSD scan of ``b`` sequences of ``seq`` tokens on one TP rank as the batched matmuls of its chunks
    (``scan_macs``; the inter-chunk state passing, ``H (s / Q) N P``, is left out): (batch, m, n, k) each."""
    s = shape(m, hidden)
    q = m.chunk_size
    n = b * math.ceil(seq / q)
    heads = n * s.heads / tp
    return [(n * s.groups / tp, q, q, s.state),    # C B^T per chunk and group
            (heads, q, s.head_dim, q),             # (L o C B^T) X per chunk and head
            (heads, s.state, s.head_dim, q),       # the chunk state B^T X
            (heads, q, s.head_dim, s.state)]       # the read-out C h


def mixer_bytes(m: Mamba2Spec, hidden: int, tokens: float, dtype_bytes: float, tp: int) -> float:
    """Element-wise bytes of the mixer's forward on one TP rank: the depthwise conv1d (read and write its
    ``conv_dim`` channels), the scan's inputs and output (``in_proj``'s output read, ``d_inner`` written) and the
    gated RMSNorm (``y`` and ``z`` read, ``d_inner`` written)."""
    s = shape(m, hidden)
    return dtype_bytes * tokens * (2 * s.conv_dim + s.in_proj_out + s.d_inner + 3 * s.d_inner) / tp


STATES_BYTES = {"fp32": FP32, "bf16": 2}


def states_dtype_extra_bytes(m: Mamba2Spec, hidden: int, seq: int, dtype_bytes: int, tp: int = 1,
                             cp: int = 1) -> int:
    """What ``mamba_training_ssm_states_dtype`` adds to the scan's transient (``scan_state_bytes``) of one sequence
    of ``seq`` tokens over the activation dtype's passed states: mamba_ssm's ``_state_passing_fwd`` writes them in
    ``state_dtype`` (megatron-core 0.19 core/ssm/mamba_mixer.py:227-229, 752-753, 1058-1060: the option, else
    ``params_dtype``), recomputed in backward, so no kept activation changes. The transient in the activation dtype
    is below the layer's other transients and not priced; only the wider states' extra bytes are (0 without it)."""
    if m.mamba_training_ssm_states_dtype is None:
        return 0
    wider = STATES_BYTES[m.mamba_training_ssm_states_dtype]
    return max(0, scan_state_bytes(m, hidden, seq, wider, tp, cp) - scan_state_bytes(m, hidden, seq, dtype_bytes,
                                                                                     tp, cp))


# The time of mamba_ssm's mixer kernels (causal_conv1d, the SSD chunk-scan Triton kernels, the gated RMSNorm) over
# what the kernel model gives their matmuls and memory passes: fitted on the published runs of two hybrid models on
# three GPU generations (bench/hybrid_published.py --fit: Nemotron-3 Nano on GB300 / GB200 / B300 / B200 / H100 and
# Nemotron-H 56B on H100 x32 to x2048, 12 rows; docs/costmodel.md, "Mamba-2"). The SSD kernels are launch- and
# latency-bound small matmuls (Q x Q blocks of 128, head dim 64: tile-ai/tilelang benchmark/mamba2/README.md measures
# the best tuned chunk-scan kernel at 14% of an H800's bf16 peak) and the backward runs about ten of them.
SSD_KERNEL_TIME = 3.25


def price_layer(src, u, a):
    """One Mamba layer on one rank, per micro-batch: ``in_proj`` / ``out_proj`` as a column- / row-parallel pair of
    GEMMs with their TP collectives (as an MLP's), the pre-norm and residual add memory-bound, and the mixer's kernels
    (the scan as its chunk matmuls at the kernel model's batched-GEMM rate, ``scan_bmms``; the element-wise passes,
    ``mixer_bytes``, memory-bound) times ``SSD_KERNEL_TIME``, calibrated on the published Nemotron rows
    (docs/costmodel.md, "Mamba-2 and hybrid models"). Backward: the GEMMs' and matmuls' gradients, 1.5x the
    element-wise bytes, and the fused training path's re-run of the conv and the scan (``use_mamba_mem_eff_path``).
    Bytes kept: ``act_bytes`` per token and ``fixed_act_bytes``, plus the pre-norm's input; full recompute keeps the
    layer input. Transient: fp32 SSM states' extra bytes (``states_dtype_extra_bytes``). Context parallelism (``a.s``
    is ``seq / cp``): the mixer's all-to-alls (``cp_all_to_all_ms``) forward and, reversed, backward, exposed (the conv and scan wait for them); each rank then scans the whole sequence for
    ``H / (tp cp)`` heads, the same matmul work as ``seq / cp`` tokens of ``H / tp`` heads (``scan_bmms``)."""
    model, dt = src.model, src.dt
    spec, h, t = _spec(model), model.hidden_size, a.t
    sh = shape(spec, h)
    sb, r = a.s * a.b, (t if a.sp else 1)
    cost = mixer_cost(src, a, sh.in_proj_out, sh.d_inner, scan_bmms(spec, h, a.b, a.s, t),
                      mixer_bytes(spec, h, sb, dt, t), cp_all_to_all_widths(spec, h, t, a.cp))
    keep = sb * act_bytes(spec, h, int(dt), t, a.cp, a.sp).total + fixed_act_bytes(spec, h, int(dt), t) + dt * sb * h / r
    full = dt * sb * h / r
    states = a.b * states_dtype_extra_bytes(spec, h, a.s * a.cp, int(dt), t, a.cp)   # each rank scans the sequence
    return Row(cost, (keep, keep, full), params(spec, h, t, model.normalization == "layernorm").total,
               transient=states)


def mixer_cost(src, a, in_width: int, out_width: int, bmms: list, mix: float, a2a_widths) -> UnitCost:
    """The time of a head-split token mixer's layer (Mamba-2, GDN) on one rank: ``in_proj`` (h -> ``in_width``) and
    ``out_proj`` (``out_width`` -> h) as a column- / row-parallel GEMM pair with their TP collectives, the pre-norm
    and residual add memory-bound (as a dense unit's), the mixer's kernels (``bmms`` at the batched-GEMM rate, ``mix``
    element-wise bytes memory-bound) times ``SSD_KERNEL_TIME``, backward with 1.5x the bytes and the kernels'
    forward once more (the fused path's re-run), and the CP all-to-alls of ``a2a_widths`` each way, exposed."""
    k, dt, h, t = src.kern, src.dt, src.model.hidden_size, a.t
    sb, r = a.s * a.b, (t if a.sp else 1)
    gemms = [(sb, in_width / t, h), (sb, h, out_width / t)]
    names = ("mixer.in_proj", "mixer.out_proj")      # MAMBA.linears (a GDN kind names none: its recipe throughout)
    tpc = src._half(gemms[0], gemms[-1], a.b, a.s, t, a.sp, a.overlap, a.lp, names)
    lin_f, lin_b = src._linears(gemms, a.lp, names)
    scan_f = sum(k.bmm(*x) for x in bmms)
    scan_b = sum(k.bmm(*x, backward=True) for x in bmms)
    ew = (2 * dt * sb * h + (3 * dt + 1) * sb * h) / r          # pre-norm + bias-dropout-add, as a dense unit's
    ssd_f = SSD_KERNEL_TIME * (k.memory(mix, 3) + scan_f)                  # conv1d / scan / gated norm kernels
    ssd_b = SSD_KERNEL_TIME * (k.memory(1.5 * mix, 3) + scan_b) + ssd_f     # their backward and the fused re-run
    a2a = all_to_all_ms(src, a2a_widths, sb, t, a.cp)
    fwd = lin_f + k.memory(ew, 2) + ssd_f + tpc.fwd + a2a
    bwd = lin_b + k.memory(1.5 * ew, 3) + ssd_b + tpc.bwd + a2a
    return UnitCost(fwd, bwd, UNAVAILABLE_MS, fwd, tpc.fwd + tpc.bwd, UNAVAILABLE_MS, tpc.hidden, cp_comm=2 * a2a,
                    comm_fwd=(tpc.fwd, tpc.hidden_fwd, a2a, 0.0))


def mamba_linears(model, t: int, ep: int = 1, etp: int = 0) -> tuple:
    """``in_proj`` and ``out_proj``: weight parameters per rank (``params``)."""
    p = params(_spec(model), model.hidden_size, t)
    return p.in_proj, p.out_proj


def mamba_launches(m, quantized: bool, n_local: int = 0, moe=None) -> dict:
    """megatron-core 0.19 ``MambaMixer``'s training path: 17, + 3 quantized (``costmodel.host`` lists them)."""
    return {"mamba": 17 + 3 * (1 if quantized else 0)}


MAMBA = register(LayerKind(
    name="mamba", symbol="M", role="attention", label="Mamba-2", params=layer_params, flops=layer_flops,
    price=price_layer, in_layer=lambda m, stack: False,      # only where a hybrid pattern writes M
    recompute=("none", "full"),     # no --recompute-modules entry covers a Mamba mixer (megatron-core 0.19)
    hybrid_slot="mamba_layer", launches=mamba_launches, block="mamba",
    linears=("mixer.in_proj", "mixer.out_proj"),       # core_v0.19.0 mamba_layer.py / mamba_mixer.py
    linear_params=mamba_linears,
    shape_refusal=lambda model, tp, cp: cp_refusal(_spec(model), model.hidden_size, tp, cp),
    # megatron-core's MambaContextParallel on the runtime's per-stage groups is not run against stock megatron-core
    no_runtime_cp="Mamba-2 layers"))
