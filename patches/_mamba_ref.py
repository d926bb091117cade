"""Pure-torch reference kernels for Mamba-2 (SSD), with the call signatures megatron-core's ``MambaMixer`` uses.

The state-space model of one Mamba-2 head (Dao & Gu 2024, "Transformers are SSMs", eq. (1) with the scalar-times-
identity A of section 3): with ``a_t = exp(dt_t * A)``, state ``h_t = a_t h_{t-1} + dt_t B_t x_t^T`` (N x P) and output
``y_t = h_t^T C_t + D x_t``. ``ssd_chunked`` evaluates it by the paper's block decomposition (section 6): within a
chunk of Q steps the output is a masked, decayed ``C B^T`` product (step 1, "diagonal blocks"); each chunk's final
state (step 2) is passed across chunks by a recurrence over chunk boundaries (step 3) and read out by ``C`` inside
the next chunk (step 4). Autograd differentiates it; ``naive_scan`` is the step-by-step recurrence the tests hold it
to.

What the fused kernels of mamba_ssm / causal_conv1d compute, and what their backward keeps, is mirrored where
megatron-core's training path relies on it: ``mamba_split_conv1d_scan_combined`` is an autograd function that saves
what ``MambaSplitConv1dScanCombinedFn`` saves (the in_proj output ``zxbcdt``, the conv weight and bias, the
un-gated scan output ``out_x``, ``A``, ``D``, ``dt_bias``) and recomputes the convolution and the scan in backward,
and the gated RMSNorm without a gate saves its input and the per-group ``rstd`` as the layernorm_gated kernel does,
so a layer's activation memory on CPU is the one the GPU kernels keep. Options megatron-core's training and prefill
paths do not pass (packed sequences, varlen states, a fused norm or out_proj) raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_NO_LIMIT = (0.0, float("inf"))


def _not_here(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not in aceso's CPU reference of the Mamba-2 kernels (patches/mamba_cpu.py)")


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i``, ``-inf`` above the diagonal."""
    steps = a.shape[-1]
    total = torch.cumsum(a, dim=-1)
    out = total[..., :, None] - total[..., None, :]
    keep = torch.ones(steps, steps, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~keep, float("-inf"))


def _heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, l, g, n) -> (b, l, h, n): head ``i`` reads group ``i // (h / g)``, as the kernels do."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def ssd_chunked(x, dt, A, B, C, chunk_size: int, initial_states=None):
    """The SSM by chunks. x (b, l, h, p), dt (b, l, h) after bias / softplus / limit, A (h,), B and C (b, l, g, n),
    initial_states (b, h, p, n). Returns y (b, l, h, p) and the final state (b, h, p, n), in the promoted dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    batch, length, nheads, headdim = x.shape
    pad = (-length) % chunk_size
    x, dt, B, C = (F.pad(t.to(acc), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    chunks = x.shape[1] // chunk_size

    def by_chunk(t):
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    inputs = by_chunk(x * dt[..., None])                                  # discretised input dt * x
    b_h, c_h = by_chunk(_heads(B, nheads)), by_chunk(_heads(C, nheads))
    log_decay = (dt * A.to(acc)).reshape(batch, chunks, chunk_size, nheads).permute(0, 3, 1, 2)  # (b, h, c, Q)
    within = torch.cumsum(log_decay, dim=-1)

    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c_h, b_h, torch.exp(_segsum(log_decay)), inputs)
    to_end = torch.exp(within[..., -1:] - within)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b_h, to_end, inputs)
    start = (torch.zeros_like(states[:, :1]) if initial_states is None
             else initial_states.to(acc)[:, None])
    across = torch.exp(_segsum(F.pad(within[..., -1], (1, 0))))           # (b, h, c+1, c+1)
    passed = torch.einsum("bhzc,bchpn->bzhpn", across, torch.cat([start, states], dim=1))
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c_h, passed[:, :-1], torch.exp(within))
    y = (y_diag + y_off).reshape(batch, chunks * chunk_size, nheads, headdim)[:, :length]
    return y, passed[:, -1]


def naive_scan(x, dt, A, B, C, initial_states=None):
    """The same SSM one step at a time (the definition the chunked form is checked against)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    batch, length, nheads, headdim = x.shape
    b_h, c_h = _heads(B.to(acc), nheads), _heads(C.to(acc), nheads)
    state = (torch.zeros(batch, nheads, headdim, B.shape[-1], dtype=acc, device=x.device)
             if initial_states is None else initial_states.to(acc))
    out = []
    for t in range(length):
        step = dt[:, t].to(acc)                                           # (b, h)
        decay = torch.exp(step * A.to(acc))[..., None, None]
        state = decay * state + (step[..., None] * x[:, t].to(acc))[..., None] * b_h[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, c_h[:, t]))
    return torch.stack(out, dim=1), state


def _dt(dt, dt_bias, dt_softplus: bool, dt_limit):
    dt = dt.float() if dt.dtype != torch.float64 else dt
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _skip(y, x, D):
    if D is None:
        return y
    return y + x.to(y.dtype) * (D[:, None] if D.dim() == 1 else D).to(y.dtype)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=_NO_LIMIT,
                              return_final_states=False, return_varlen_states=False, state_dtype=None):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``: out = (SSM(x) + D x) * silu(z)."""
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise _not_here("packed sequences (seq_idx / cu_seqlens / varlen states)")
    y, final = ssd_chunked(x, _dt(dt, dt_bias, dt_softplus, dt_limit), A, B, C, chunk_size, initial_states)
    y = _skip(y, x, D)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    out = y.to(x.dtype)
    return (out, final.to(state_dtype or C.dtype)) if return_final_states else out


def causal_conv1d(x, weight, bias=None, activation: str | None = "silu"):
    """``causal_conv1d_fn``: depthwise causal convolution of x (b, d, l) with weight (d, w), then SiLU."""
    width = weight.shape[-1]
    out = F.conv1d(x, weight[:, None, :], bias, padding=width - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def _split_scan(zxbcdt, conv_w, conv_b, dt_bias, A, D, chunk_size, headdim, ngroups, dt_limit):
    """z and the un-gated output y of in_proj's output ``zxbcdt`` = [z, x, B, C, dt] (b, l, .)."""
    nheads = A.shape[0]
    dim = nheads * headdim
    dstate = (conv_w.shape[0] - dim) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xbc = causal_conv1d(xbc.transpose(1, 2), conv_w, conv_b).transpose(1, 2)
    x, B, C = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    batch, length = x.shape[:2]
    x = x.reshape(batch, length, nheads, headdim)
    y, _ = ssd_chunked(x, _dt(dt, dt_bias, True, dt_limit), A, B.reshape(batch, length, ngroups, dstate),
                       C.reshape(batch, length, ngroups, dstate), chunk_size)
    return z, _skip(y, x, D).reshape(batch, length, dim).to(zxbcdt.dtype)


def _dsilu(z):
    """d silu(z) / dz = sigmoid(z) (1 + z (1 - sigmoid(z)))."""
    sig = torch.sigmoid(z)
    return sig * (1 + z * (1 - sig))


class _SplitConv1dScan(torch.autograd.Function):
    """Keeps what ``MambaSplitConv1dScanCombinedFn`` keeps; backward recomputes conv and scan from ``zxbcdt``."""

    @staticmethod
    def forward(ctx, zxbcdt, conv_w, conv_b, dt_bias, A, D, chunk_size, headdim, ngroups, dt_limit):
        z, out_x = _split_scan(zxbcdt, conv_w, conv_b, dt_bias, A, D, chunk_size, headdim, ngroups, dt_limit)
        ctx.save_for_backward(zxbcdt, conv_w, conv_b, out_x, A, D, dt_bias)
        ctx.args = (chunk_size, headdim, ngroups, dt_limit)
        return out_x * F.silu(z)

    @staticmethod
    def backward(ctx, dout):
        zxbcdt, conv_w, conv_b, out_x, A, D, dt_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad[:6]
        leaves = [t.detach().requires_grad_(need) for t, need in zip((zxbcdt, conv_w, conv_b, dt_bias, A, D), needs)]
        with torch.enable_grad():
            z, y = _split_scan(*leaves, *ctx.args)
            gate = F.silu(z.detach())
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad(y, wanted, dout * gate, allow_unused=True) if wanted else ())
        grads = [next(found) if need else None for need in needs]
        if needs[0]:
            if grads[0] is None:
                grads[0] = torch.zeros_like(zxbcdt)
            dz = dout * out_x * _dsilu(z.detach())
            grads[0][..., : dz.shape[-1]] += dz.to(grads[0].dtype)
        return (*grads, None, None, None, None)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=_NO_LIMIT,
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined`` as megatron-core calls it: the
    causal conv + SiLU of [x, B, C], the scan with ``D`` and softplus(dt + dt_bias), gated by silu(z)."""
    if seq_idx is not None or initial_states is not None or return_final_states:
        raise _not_here("packed sequences / initial or final states in the training kernel")
    if rmsnorm_weight is not None or outproj_weight is not None or outproj_bias is not None:
        raise _not_here("the kernel's fused norm or out_proj")
    if activation not in ("silu", "swish"):
        raise _not_here(f"conv activation {activation}")
    if D.dim() == 2:
        headdim = D.shape[1]
    dim = A.shape[0] * headdim
    if zxbcdt.shape[-1] != 2 * dim + (conv1d_weight.shape[0] - dim) + A.shape[0]:
        raise _not_here("extra non-SSM channels in zxbcdt")
    return _SplitConv1dScan.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, headdim, ngroups,
                                  tuple(dt_limit))


def _group_rstd(x, group_size: int, eps: float):
    xg = x.reshape(*x.shape[:-1], -1, group_size)
    return xg, torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)


class _GroupRMSNorm(torch.autograd.Function):
    """Grouped RMSNorm keeping its input and the per-group rstd, as mamba_ssm's layernorm_gated kernel does."""

    @staticmethod
    def forward(ctx, x, weight, group_size, eps):
        xg, rstd = _group_rstd(x.float() if x.dtype != torch.float64 else x, group_size, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.group_size = group_size
        return ((xg * rstd).reshape(x.shape) * weight.to(rstd.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xg = (x.float() if x.dtype != torch.float64 else x).reshape(*x.shape[:-1], -1, ctx.group_size)
        xhat = xg * rstd
        dyg = dy.to(rstd.dtype).reshape(xg.shape)
        dweight = (dyg * xhat).reshape(-1, x.shape[-1]).sum(dim=0)
        g = dyg * weight.to(rstd.dtype).reshape(xg.shape[-2:])
        dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
        return dx.reshape(x.shape).to(x.dtype), dweight.to(weight.dtype), None, None


class RMSNormGated(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``: RMSNorm over groups of ``group_size`` channels; with a
    gate z, norm(x) * silu(z) (``norm_before_gate``) or norm(x * silu(z))."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size or hidden_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x, z=None):
        if z is None:
            return _GroupRMSNorm.apply(x, self.weight, self.group_size, self.eps)
        x32 = x.float() if x.dtype != torch.float64 else x
        gate = F.silu(z.to(x32.dtype))
        if not self.norm_before_gate:
            x32 = x32 * gate
        xg, rstd = _group_rstd(x32, self.group_size, self.eps)
        out = (xg * rstd).reshape(x.shape) * self.weight.to(x32.dtype)
        return (out * gate if self.norm_before_gate else out).to(x.dtype)
