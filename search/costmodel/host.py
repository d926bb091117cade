"""The host (CPU) side of a step: kernel launches per unit and micro-batch, what a synchronising MoE dispatcher
exposes of them, and what a CUDA graph removes (and the memory it pins).

Each unit's forward launches a number of kernels from Python (PyTorch, megatron-core, transformer-engine); the CPU
needs ``HOST_LAUNCH_MS`` (``release_constants.py``, fitted per release: interpreter, framework and launch time
per kernel) for each. Launch counts per part of a layer, forward, counted on megatron-core 0.16.1's code paths
(each layer kind's ``launches``, in its module in ``search/layers/``; ``q`` = 1 where the part's linears run a
low-precision recipe, its quantize / amax kernels):

    attn            TE LayerNormLinear (norm, QKV GEMM), fused RoPE (q, k), the fused attention, TE Linear
                    (proj), bias-dropout-add: 7 (+ 3 q: quantize and amax of the two linears; + 2 with
                    ``qk_layernorm``: the Q and K norms, ``memory.qk_norm_elems``)
                    MLA: 2 down projections, 2 latent norms, 2 up projections, RoPE, core, proj, bda: 12 (+ 5 q)
    mlp             TE LayerNormMLP: norm, fc1, activation, fc2, bda: 5 (+ 3 q)
    mamba           megatron-core 0.19 ``MambaMixer`` training path (``use_mem_eff_path``): TE LayerNormColumn-
                    ParallelLinear in_proj (norm, GEMM: 2), the two ``rearrange(...).contiguous()`` copies (2),
                    ``A = -exp(A_log.float())`` (3), ``D.float()`` (1), mamba-ssm's ``mamba_split_conv1d_scan_
                    combined`` (causal conv1d, the SSD's chunk cumsum, chunk state, state passing, chunk bmm, chunk
                    scan, the gated RMSNorm: 7), out_proj (1), bias-dropout-add (1): 17 (+ 3 q, as attn's two
                    linears); the CUDA-graph scope ``mamba`` (``stack.py``: megatron-core captures the whole
                    ``MambaLayer``) replays them as one
    moe_router      ``TopKRouter.forward``: gating GEMM (+1 fp32 cast with moe_router_dtype), the forced-balance
                    random logits (2), score / top-k / scatter / scaling (7; group-limited top-k + 4; expert bias
                    + 2), the aux-loss scores and loss (11; ``seq_aux_loss``: + 1, its division by the micro-batch
                    size: the per-sequence reshapes are views, router.py ``_apply_seq_aux_loss``), the expert-bias
                    token count (1); ``moe_router_fusion``: the score / top-k and aux-loss steps in 4 fused kernels
                    instead of 18 (the seq_aux_loss division stays outside them)
    moe_preprocess  ``MoEAlltoAllTokenDispatcher.preprocess``: token counts, their all-gather over the TP x EP
                    group, the split / sum / slice steps and the five host copies: 16 (padded to capacity: 5)
    moe_rest        permute (fused 2, unfused 6), the dispatch and combine all-to-alls, the chunk sort and unsort,
                    the activation, unpermute, bias-dropout-add (7), and per local expert the fc1 and fc2 GEMMs of
                    TE's ``general_grouped_gemm`` (``search.layers.moe.EXPERT_LAUNCHES`` = 6 per expert: a fitted per-expert host cost,
                    not a count; its comment has TE's own count; without grouped GEMM one activation per expert
                    more), + 2 q quantize: 9 + 6 experts (+ 2 q)
    shared expert   as a dense MLP (5 + 3 q), in ``moe_router``'s graph when captured with it

The backward's launches (two gradient GEMMs per GEMM, one kernel per element-wise step) are not priced: the
per-launch time is fitted on the forward's counts alone. Counting them (one more launch per linear and per expert
GEMM, none for the preprocess; exposed ``max(0, H_b - D_b)`` per layer after a synchronised forward) was tried
against the published rows: the 26.04.01 MoE rows' MAE went from 6.7% to 7.6% at best over the fit's grid of
``HOST_LAUNCH_MS`` x ``GROUPED_K0_LP`` (the rows at micro-batch 1 without graphs, DeepSeek-V3 pp 16 and Qwen3-235B
pp 8, came out 20-28% too slow), and pricing the experts' grouped-GEMM calls at one cuBLAS call per expert
(transformer-engine ``multi_stream_cublas_gemm``) instead of ``EXPERT_LAUNCHES`` moved it to 7.7% at best: not
kept (docs/costmodel.md, "The 2026 software stack"). What the device sees:

- a dropless MoE layer's dispatcher copies the token counts to the host and waits for them before its EP
  all-to-all (``moe_cost.syncs``; megatron-core 0.16.1 ``_maybe_dtoh_and_synchronize``; 0.19's HybridEP without
  a per-rank capacity "sizes buffers dynamically (CPU sync in dispatch)", token_dispatcher.py ``_HybridEPManager``;
  a CUDA graph of ``moe_preprocess`` moves the copy, the wait stays): the CPU then launches the layer's remaining
  kernels and the next layer's up to its wait while the device idles, so a layer's forward takes max(device,
  host): exposed ``max(0, H_f - D_f)``; and the kernels launched right after the wait (``moe_rest``: the
  all-to-alls, the experts) hide only behind the device work after the wait, ``D_moe - D_before``: megatron-core's
  ``MoELayer.forward`` runs the shared expert (not overlapped), the router and the preprocess (LatentMoE's
  ``fc1_latent_proj``) before the dispatch (0.16.1 and 0.19 moe_layer.py; ``UnitCost.fwd_before_wait``,
  ``moe_cost._before_wait``): exposed ``max(0, H_rest - (D_moe - D_before), H_f - D_f)``. A layer is the moe unit
  and the unit before it: the attention unit, or in a hybrid pattern the Mamba unit (``ME``: every MoE layer of
  Nemotron-3 but those after an attention one);
- without a synchronisation the CPU runs ahead: exposed only when a layer's (forward) host time exceeds its whole
  device time, ``max(0, H_f - D_f - D_b)``.

The host time per launch is the host CPU's single-thread work (Python, the framework, the driver call), so it
scales with the host's clock: ``launch_ms`` = ``HOST_LAUNCH_MS`` x ``HOST_REF_GHZ`` / the GPU record's
``host_cpu_ghz`` (the single-core boost clock of its DGX system's x86 CPU: DGX H100 / H200 Xeon Platinum 8480C 3.8
GHz, DGX B200 Xeon Platinum 8570 4.0, DGX B300 Xeon 6776P 4.6 with Priority Core Turbo, which Intel introduced for
this serial work of feeding the GPUs). ``HOST_REF_GHZ`` is DGX B200's 4.0 GHz, the x86 host with the most fitted
MoE rows: not a fitted constant. Grace hosts (GB200 / GB300) and GPUs without a record value take ``HOST_LAUNCH_MS`` as
fitted: an Arm core's clock says nothing of its time per launch against an x86 one (a factor for Grace, fitted on
the rows, was tried and not kept: docs/costmodel.md, "Host time on Grace: tried, not kept").

A CUDA graph (``stack.CudaGraphs``) replays its captured part with one launch (``GRAPH_LAUNCH``): the part's
kernels leave the host time. ``full_iteration`` replays the whole forward and backward: no host time per layer.
Memory it pins (``graph_buffer_bytes``): each captured part keeps static input and output buffers per layer for
every micro-batch in flight (TE's ``make_graphed_callables`` / megatron-core's ``CudaGraphManager`` allocate a
graph's inputs and outputs once and reuse them, so they are not freed between micro-batches): ``dt s b h / r`` per
buffer, ``GRAPH_BUFFERS`` per captured part (forward input and output, backward output gradient); a
``full_iteration`` graph pins none beyond its pool of the same activations.
"""

from __future__ import annotations

from search.settings.stack import GRAPH_SCOPES  # noqa: F401  (the scope names the parts below use)
from search.spec.cluster import gpu_record
from ..layers import resolve
from .release_constants import value

# One replay of a captured part: transformer-engine's ``make_graphed_callables`` forward copies its inputs into the
# static buffers (no copy where the input is the buffer) and calls ``fwd_graph.replay()``: one cudaGraphLaunch.
GRAPH_LAUNCH = 1.0
GRAPH_BUFFERS = 3         # static buffers a captured part keeps per layer and micro-batch in flight
# The x86 host clock at which ``HOST_LAUNCH_MS`` is the time per launch (module docstring): DGX B200's Xeon Platinum
# 8570, 4 GHz max boost (DGX B200 user guide). A reference, not a fitted constant.
HOST_REF_GHZ = 4.0


def launch_ms(gpu: str, release: str | None) -> float:
    """Host ms per kernel launch of ``release`` on the host of GPU ``gpu``'s system: the release's fitted
    ``HOST_LAUNCH_MS`` x ``HOST_REF_GHZ`` / the record's ``host_cpu_ghz`` (as fitted where the record has none)."""
    ghz = gpu_record(gpu).host_cpu_ghz
    return value("HOST_LAUNCH_MS", release) * (HOST_REF_GHZ / ghz if ghz else 1.0)


def part_launches(model, kind: str, quantized: bool, n_local: int, moe_settings=None) -> dict[str, float]:
    """Forward kernel launches of one unit by part (``attn``, ``mlp``, ``moe_router``, ``moe_preprocess``,
    ``moe_rest``), module docstring; ``n_local``: the moe unit's local experts. The unit's layer kind counts
    them (``search.layers``: ``launches``, the kind's module; none: no launches counted)."""
    launches = resolve(model, kind).launches
    return launches(model, quantized, n_local, moe_settings) if launches is not None else {}


def captured(part: str, scopes: frozenset[str]) -> bool:
    """Whether a CUDA graph of ``scopes`` replays ``part`` (whole-layer graphs capture every part;
    ``moe``: the whole drop-and-pad MoE layer, router and dispatch included)."""
    if not scopes:
        return False
    if "full_iteration" in scopes or "layer" in scopes:
        return True
    if part == "moe_rest":
        return "moe" in scopes
    if part in ("moe_router", "moe_preprocess"):
        return part in scopes or "moe" in scopes
    return part in scopes


def host_launches(parts: dict[str, float], scopes: frozenset[str]) -> float:
    """Forward launches the CPU still makes under ``scopes``: the parts not captured, one launch per captured part."""
    if "full_iteration" in scopes:
        return 0.0
    return sum(GRAPH_LAUNCH if captured(p, scopes) else n for p, n in parts.items())


def exposed_host_ms(h_f: float, d_f: float, d_b: float, syncs: bool, h_first: float = 0.0,
                    d_first: float = 0.0) -> float:
    """Forward ms the device waits on the CPU in one layer of host forward time ``h_f`` and device times ``d_f`` /
    ``d_b`` (module docstring); ``h_first`` / ``d_first``: the host time of the part launched right after the wait
    (a synchronising layer's experts and all-to-alls) and the device time after the wait that hides it (the moe
    unit's forward less what it runs before the dispatch: ``moe_cost.host_layers``)."""
    if syncs:
        return max(0.0, h_first - d_first, h_f - d_f)
    return max(0.0, h_f - d_f - d_b)


def graph_buffer_bytes(parts: dict[str, float], scopes: frozenset[str], dt: float, tokens: float,
                       hidden: int) -> float:
    """Bytes of static graph buffers one unit keeps per micro-batch in flight (module docstring): one graph per
    unit with a captured part (a moe unit's router and preprocessing are one), ``GRAPH_BUFFERS`` tensors of
    ``dt tokens h`` each."""
    if not scopes or "full_iteration" in scopes:
        return 0.0
    return GRAPH_BUFFERS * dt * tokens * hidden if any(captured(p, scopes) for p in parts) else 0.0
