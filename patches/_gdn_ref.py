"""Pure-torch reference kernels for megatron-core's ``GatedDeltaNet`` on CPU (``patches/gdn_cpu.py``): the three fla
(flash-linear-attention) functions its forward calls, with fla's signatures and tensor layouts.

- ``l2norm(x)``: ``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, in fp32, cast back (fla ``modules/l2norm.py``).
- ``causal_conv1d(x, weight, bias, activation, ...)``: the depthwise causal convolution of ``x`` [B, T, D] with
  ``weight`` [D, W] (output ``t`` sees inputs ``t - W + 1 .. t``), then SiLU (fla ``modules/convolution.py``);
  returns ``(y, None)``.
- ``chunk_gated_delta_rule(q, k, v, g, beta, scale, ...)``: the gated delta rule (Yang, Kautz, Hatamizadeh 2025,
  "Gated Delta Networks", eq. 10) with ``q, k`` [B, T, H, K], ``v`` [B, T, H, V], log-decay ``g`` and ``beta``
  [B, T, H], state ``S`` [B, H, K, V] per head::

      S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = scale S_t^T q_t

  (``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` in the paper's transposed notation; fla's
  ``naive_recurrent_gated_delta_rule`` loop). ``naive_recurrent`` is that loop, step by step. The kernel computes
  it by chunks of ``C`` tokens, as fla's ``chunk_gated_delta_rule`` does (the WY form, Yang et al. 2024,
  "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", section 3): within a chunk with
  cumulative log-decay ``G_r`` (``G_r = g_1 + ... + g_r``) and start state ``S_0``, unrolling the recurrence gives
  ``(I + A) U = diag(beta) V - diag(beta exp(G)) K S_0`` with ``A_rj = beta_r exp(G_r - G_j) k_r . k_j`` for
  ``j < r`` (a unit lower-triangular solve), then ``o_r = scale (exp(G_r) S_0^T q_r + sum_{j <= r} exp(G_r - G_j)
  (q_r . k_j) u_j)`` and ``S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T``. A partial last chunk is padded
  with ``g = beta = 0`` and zero ``q, k, v`` (decay 1, no write: the state and earlier outputs are unchanged).
  Computed in fp32 (fla's kernels accumulate in fp32; fp64 inputs in fp64), the output cast to ``v``'s dtype, the final state fp32.

Backward is torch's autograd through these functions (the triangular solve included): the same gradients as
fla's hand-written backward, not its memory (fla keeps ``q, k, v, g, beta`` and the inverse, and recomputes the
states; autograd here keeps the per-chunk intermediates). Packed sequences (``cu_seqlens``), an initial conv
state and decode are not covered: they raise ``NotImplementedError`` naming this patch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64      # fla chunk_gated_delta_rule's BT
_EPS = 1e-6     # fla l2norm's default eps


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the accumulation dtype: fp32, or fp64 for fp64 inputs (the tests' exact comparisons)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _not_covered(what: str):
    raise NotImplementedError(f"{what}: aceso's CPU Gated DeltaNet patch (patches.gdn_cpu) covers training on whole "
                              "sequences only; install flash-linear-attention on a GPU")


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = _EPS, output_dtype=None, **_unused) -> torch.Tensor:
    y = _acc(x) * torch.rsqrt(_acc(x).pow(2).sum(dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual=None,
                  initial_state=None, output_final_state: bool = False, activation: str | None = None,
                  cu_seqlens=None, **_unused):
    if residual is not None or initial_state is not None or output_final_state or cu_seqlens is not None:
        _not_covered("causal_conv1d with a residual, a conv state or packed sequences")
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    y = y[..., : x.shape[1]].transpose(1, 2)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (fla takes silu / swish)")
    return y, None


def naive_recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """The gated delta rule token by token (module docstring); returns ``(o, final_state)`` in fp32."""
    q, k, v, g, beta = (_acc(t.transpose(1, 2)) for t in (q, k, v, g, beta))     # [B, H, T, ...]
    b, h, length, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, :, t]))
        state = state + k[:, :, t, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t] * scale))
    return torch.stack(out, 1), state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None, chunk_size: int | None = None,
                           **_unused):
    """fla's ``chunk_gated_delta_rule`` by chunks (module docstring): ``(o [B, T, H, V], final state or None)``;
    chunks of ``chunk_size`` tokens (default ``CHUNK``, fla's)."""
    chunk_size = chunk_size or CHUNK
    if cu_seqlens is not None:
        _not_covered("chunk_gated_delta_rule over packed sequences (cu_seqlens)")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    dtype, length = v.dtype, q.shape[1]
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    pad = -length % chunk_size
    q, k, v = (F.pad(_acc(t), (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(_acc(t), (0, 0, 0, pad)) for t in (g, beta))
    # [B, H, N, C, ...]: N chunks of C tokens
    q, k, v = (t.transpose(1, 2).unflatten(2, (-1, chunk_size)) for t in (q, k, v))
    g, beta = (t.transpose(1, 2).unflatten(2, (-1, chunk_size)) for t in (g, beta))
    gc = g.cumsum(-1)                                               # G_r within each chunk
    diff = gc[..., :, None] - gc[..., None, :]                      # G_r - G_j
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device)
    decay_le = diff.masked_fill(~ones.tril(), float("-inf")).exp()  # exp(G_r - G_j), j <= r
    kk = k @ k.transpose(-1, -2)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    lower = eye + (beta[..., :, None] * kk * decay_le).masked_fill(~ones.tril(-1), 0.0)     # I + A
    qk = (q @ k.transpose(-1, -2)) * decay_le
    b, h, n = q.shape[:3]
    state = (q.new_zeros(b, h, k.shape[-1], v.shape[-1]) if initial_state is None
             else initial_state.to(q.dtype))
    out = []
    for i in range(n):
        gi, bi = gc[:, :, i], beta[:, :, i]
        rhs = bi[..., None] * v[:, :, i] - (bi * gi.exp())[..., None] * (k[:, :, i] @ state)
        u = torch.linalg.solve_triangular(lower[:, :, i], rhs, upper=False, unitriangular=True)
        out.append(scale * (gi.exp()[..., None] * (q[:, :, i] @ state) + qk[:, :, i] @ u))
        last = gi[..., -1:]
        state = last.exp()[..., None] * state + (k[:, :, i] * (last - gi).exp()[..., None]).transpose(-1, -2) @ u
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :length].transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)
