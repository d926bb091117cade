"""Kernel time models of the analytic source: how long one GEMM, one attention core, one memory-bound pass takes.

Two models behind one interface (``gemm``, ``bmm``, ``flash``, ``memory``, all in ms):

``ShapeKernels`` (the default): efficiency as a function of the shape.
- GEMM ``(m, n, k)`` (output m x n, inner k), after NVIDIA's "Matrix Multiplication Background User's Guide"
  (DU-09799-001, ch. 3, tile and wave quantization): output tiles of ``TILE`` (the cuBLAS kernels' tile on each
  architecture: ``128x256`` on sm90/sm100, ``256x128`` on sm80/sm70) over ``SMS`` streaming multiprocessors
  (datasheet); ``tile_util = m n / (tiles TM TN)``; with fewer tiles than SMs cuBLAS splits k (at most
  ``SMS // tiles`` ways, each split at least ``SPLIT_K_MIN`` deep), ``wave_util = units / (waves SMS)``;
  ``t = max(2 m n k / (peak E_max tile_util wave_util), bytes / (hbm MEM_EFF)) + LAUNCH_MS`` with
  ``bytes = dt (m k + k n + m n)`` (+ the fp32 partials of a split-k reduction). ``E_max`` is the maximum
  achievable matmul throughput measured by Bekman's MAMF finder (ml-engineering, "Maximum Achievable Matmul FLOPS
  comparison table", bf16): A100 SXM 267.9/312 (0.859), H100 SXM 794.5/989 (0.803), B200 SXM 1745/2250 (0.776),
  GB200 SXM 1822/2500 (0.729);
  V100: 0.70, the best GEMM of the Aceso artifact's V100 profile (miniset gpt_1_3B_mbs1_tp1: MLP GEMM-1 at
  86.9 of 125 TFLOP/s). Times ``sustained``: the calibrated fraction of these microbenchmark ceilings a training
  step reaches (``ARCH``).
- Backward GEMMs: the input gradient ``(m, k, n)`` and the weight gradient ``(k, n, m)`` of each forward GEMM.
- Fused (flash) attention: ``eff = E_attn (s / (s + ATTN_S0)) hd(d)`` of the dtype peak, FLOPs counted as
  FlashAttention does (causal: half the score matrix; backward 2.5x the forward). H100/H200: cuDNN's fused
  attention (what transformer-engine runs) in the FlashAttention-3 paper (Shah et al. 2024, figs. 5-6, head dim 128,
  bf16): causal forward 315/410/484/518/529/539 TFLOP/s at s = 512..16k fits ``E = 0.558, S0 = 385`` within 4%;
  backward (non-causal 305..518) fits ``E = 0.549, S0 = 400``, scaled by the causal/non-causal forward ratio at 4k
  (518/609) to 0.466; non-causal attention runs 609/518 = 1.18x faster. Head dim: ``hd(d) = min(1, (d/(d+64)) /
  (128/192))`` (hd 64: x0.75, between cuDNN's forward 0.67 and backward 0.86 ratios in the same figures).
  A100: FlashAttention-2 (Dao 2023, fig. 4: 50-73% of peak forward, 40-63% backward), set so that s = 2048 gives
  the v1 constants 0.60 / 0.45 (E = 0.71 / 0.535). B200: no measurement in our sources; the H100 fractions.
- Batched attention GEMMs (unfused attention): the GEMM model per matrix, ``batch`` of them in one launch.
- Memory-bound kernels: ``bytes / (hbm MEM_EFF) + LAUNCH_MS`` each.
- Low-precision GEMMs (``search/settings/precision.py``: the linear layers under an FP8 / FP4 recipe): the same shape model
  at the GPU's FP8 / FP4 dense peak with the quantized element size, times ``gemm_scale``: the achieved fraction of
  the bf16 microbenchmark ceiling that an FP8 GEMM of a training step reaches (``LOWPREC_GEMM_SCALE``, one per GPU
  generation, fitted on the published FP8 / MXFP8 Megatron-Bridge runs: ``python bench/lowprec_published.py
  --fit``). FP8 GEMMs are shorter for the same shape, so launch, tail and the scaling-factor handling weigh more.

``FlatKernels`` (the v1 model, selectable with ``kernels="flat"``): one efficiency per kernel class and GPU
(``GPU_EFFICIENCY``), one launch overhead per kernel group; it reproduces the v1 numbers exactly (tests).

Why the shape model is the default: a flat 0.70 cannot tell a 2048-wide GEMM at tp 8 from a 16384-wide one, nor
a 512-token attention from an 8k one; the published H100 runs span exactly these (docs/costmodel.md, accuracy).
"""

from __future__ import annotations

from math import ceil
from typing import NamedTuple

from search.spec.cluster import _ON_ADD, GPU_RECORDS, gpu_record
from search.io.errors import AcesoError

LAUNCH_MS = 0.005        # launch + tail of one CUDA kernel (~5 us; the v1 constant)
MEM_EFF = 0.80           # achieved / datasheet HBM bandwidth of element-wise kernels (Aceso V100 profile: softmax
                         # and dropout at 700-890 of 900 GB/s)
SPLIT_K_MIN = 256        # shallowest k slice of a split-k GEMM (4 k-blocks of 64)
ATTN_S0 = 390.0          # sequence length at which fused attention reaches half its efficiency (FA3 figs. 5-6)
ATTN_D0 = 64.0           # head-dim saturation of fused attention
NONCAUSAL_GAIN = 609.0 / 518.0


class Efficiency(NamedTuple):
    """The v1 per-GPU efficiencies (``FlatKernels``)."""

    gemm: float        # dense GEMMs, fraction of the dtype's tensor-core peak
    bmm: float         # batched attention GEMMs (unfused attention)
    flash_fwd: float   # fused flash attention forward (0 = not available: unfused path)
    flash_bwd: float
    mem: float         # element-wise kernels, fraction of HBM bandwidth


# built from the GPU records (search/data/gpus.json, ``flat_efficiency``) at the end of this table block
GPU_EFFICIENCY: dict[str, Efficiency] = {}


class Arch(NamedTuple):
    """Per-GPU constants of ``ShapeKernels`` (sources in the module docstring)."""

    sms: int
    tile: tuple[int, int]
    gemm_max: float            # MAMF / peak
    attn_fwd: float            # fused attention, causal, head dim 128, s -> infinity (0: none, unfused path)
    attn_bwd: float
    sustained: float = 1.0     # fraction of the microbenchmark ceilings a training step sustains (calibrated)


# ``sustained`` (the only fitted constants of the analytic model): a training step does not reach the ceilings of a
# short microbenchmark (clocks under sustained power, L2/HBM shared with concurrent kernels). One factor per GPU
# generation multiplies its GEMM and attention ceilings, fitted with ``python bench/published_runs.py --fit`` on
# that generation's fully specified calibration rows (every priced setting published, bench/calibration.py): H100
# on the 21 DGX Cloud Benchmarking rows (NeMo 24.x, Llama 3.1 8B/405B, GPT-3 175B, Nemotron-4 340B), A100 on the 6
# SC'21 Table 1 rows that state everything. V100 needs none (its ceiling comes from a profile of real training
# layers). H200 is H100's die (same factor); B200/GB200 take H100's (an assumption, docs/costmodel.md). B300/GB300
# (Blackwell Ultra: 160 SMs, NVIDIA's Blackwell Ultra architecture brief) take B200's MAMF fraction (no
# measurement in our sources: an assumption), ULTRA_ATTN and the same sustained factor.
# GB200: the same die as B200 at a higher datasheet peak (2500 / 5000 dense bf16 / FP8 against 2250 / 4500), but its
# measured matmul ceiling is only 4.4% above B200's: MAMF 1822 of 2500 bf16 (0.729) against 1745 of 2250 (0.776),
# and FP8 3615.6 of 5000 against 3432.5 of 4500 (+5.3%) (Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS
# comparison table", GB200 SXM rows added 2025-09-17, commit 68cd2e5). Its gemm_max is its own MAMF fraction; its
# fused-attention fractions are B200's scaled by the same ratio (GB200_TC = 0.729 / 0.776: the attention core runs
# on the same tensor cores at the same clocks; an assumption, no GB200 attention measurement in our sources).
# The numbers live in the GPU records (search/data/gpus.json, ``kernels``): gb200's gemm_max 0.7288 = 1822 / 2500,
# its attn_fwd / attn_bwd 0.558 / 0.466 x GB200_TC (GB200_TC = 0.7288 / 0.776); b300 / gb300's attention
# ULTRA_ATTN = min(2 x 0.466, 0.776) = 0.776 (next paragraph); sustained 0.83 (SUSTAINED_HOPPER: h100, h200, b200, gb200, b300,
# gb300) and 0.82 (SUSTAINED_AMPERE: a100, a100-40gb).
# Blackwell Ultra doubles the SFU's exponentials (10.7 vs 5 TeraExp/s per GPU: NVIDIA's B300/GB300 specifications,
# "2x attention-layer acceleration"), the softmax bound of fused attention; with it removed the attention core is
# taken to run at the GEMM ceiling (min(2 x the B200 fractions 0.558 / 0.466, MAMF 0.776)): an assumption, no
# measurement in our sources (docs/costmodel.md).
ARCH: dict[str, Arch] = {}


# Low-precision GEMM efficiency relative to the bf16 ceiling (``gemm_scale``), per GPU generation: per release,
# fitted on each release's published rows (``release_constants.py``; docs/costmodel.md, "Low precision").
# The block-scaled MXFP8 GEMM's rate relative to the per-tensor-scaled FP8 GEMM of the same shape, fitted on the
# published runs that ran one configuration in both recipes (Megatron-Bridge 25.11: Llama 3 8B on 8 GB300 / GB200 /
# B200 and Llama 3.1 405B on 128 B200, MXFP8 3.6-5.6% slower than FP8-CS each): ``bench/lowprec_published.py --fit``.
RECIPE_GEMM_SCALE = {"mxfp8": 0.91}
GENERATION: dict[str, str] = {}     # gpu -> "hopper" / "blackwell" (the record's ``generation``)


def _add(record) -> None:
    """The kernel tables' rows of one GPU record (``cluster.add_gpu``)."""
    k = record.kernels
    ARCH[record.name] = Arch(k.sms, tuple(k.gemm_tile), k.gemm_max, k.attn_fwd, k.attn_bwd, k.sustained)
    if record.flat_efficiency is not None:
        GPU_EFFICIENCY[record.name] = Efficiency(**record.flat_efficiency.model_dump())
    if record.generation:
        GENERATION[record.name] = record.generation


for _r in GPU_RECORDS.values():
    _add(_r)
_ON_ADD.append(_add)
SUSTAINED_HOPPER = ARCH["h100"].sustained     # the fitted factors (bench/published_runs.py --fit), as the records hold
SUSTAINED_AMPERE = ARCH["a100"].sustained


def arch(gpu: str) -> Arch:
    """The shape model's constants of ``gpu``; an unknown GPU is refused (``cluster.gpu_record``)."""
    return ARCH[gpu] if gpu in ARCH else ARCH[gpu_record(gpu).name]


def flat_efficiency(gpu: str) -> Efficiency:
    """The v1 flat model's efficiencies of ``gpu``; refused where the record has none."""
    name = gpu if gpu in GPU_EFFICIENCY else gpu_record(gpu).name
    if name not in GPU_EFFICIENCY:
        raise AcesoError(f"gpu '{gpu}': its record has no flat_efficiency; price it with the shape kernel model "
                         "(the default) or add flat_efficiency to its record")
    return GPU_EFFICIENCY[name]


def has_flash(gpu: str) -> bool:
    """Whether ``gpu`` runs flash attention (sm80+: A100 and newer); ``ShapeKernels.has_flash``."""
    return arch(gpu).attn_fwd > 0


class FlatKernels:
    """v1: ``max(flops / (peak eff), bytes / (hbm mem)) + LAUNCH_MS`` per kernel group, efficiencies per GPU."""

    name = "flat"
    attn_scale = 1.0            # calibrated fused-attention throughput factor (GPUSpec.attention_scale)
    gemm_scale = 1.0            # low-precision GEMMs: LOWPREC_GEMM_SCALE
    ce_bytes = (24.0, 8.0)      # v1: cross-entropy bytes per logit beyond the dt read, forward / backward

    def __init__(self, gpu: str, peak_flop_per_ms: float, hbm_bytes_per_ms: float, dt: float):
        self.eff = flat_efficiency(gpu)
        self.peak, self.hbm, self.dt = peak_flop_per_ms, hbm_bytes_per_ms, dt
        self.has_flash = self.eff.flash_fwd > 0

    def _k(self, flops: float = 0.0, nbytes: float = 0.0, eff: float | None = None) -> float:
        t_c = flops / (self.peak * (eff or self.eff.gemm * self.gemm_scale)) if flops else 0.0
        t_m = nbytes / (self.hbm * self.eff.mem) if nbytes else 0.0
        return max(t_c, t_m) + LAUNCH_MS

    def gemm(self, shapes, backward: bool = False) -> float:
        """A group of GEMMs ``[(m, n, k), ...]`` (v1: one kernel of their summed FLOPs; backward twice them)."""
        flops = sum(2.0 * m * n * k for m, n, k in shapes)
        return self._k(2 * flops if backward else flops)

    def bmm(self, batch: float, m: float, n: float, k: float, backward: bool = False) -> float:
        return self._k(2.0 * batch * m * n * k * (2 if backward else 1), eff=self.eff.bmm)

    def gemm_parts(self, m: float, n: float, k: float) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) time of one GEMM: the windows TP communication hides in."""
        one = self._k(2.0 * m * n * k)
        return one, one, one

    def flash(self, flops: float, s_kv: float, head_dim: int, causal: bool, backward: bool = False) -> float:
        eff = self.eff.flash_bwd if backward else self.eff.flash_fwd
        return self._k(2.5 * flops if backward else flops, eff=eff * self.attn_scale)

    def memory(self, nbytes: float, launches: int = 1) -> float:
        return self._k(nbytes=nbytes)


class ShapeKernels:
    """Shape-aware GEMM and attention efficiency (module docstring)."""

    name = "shape"
    attn_scale = 1.0            # calibrated fused-attention throughput factor (GPUSpec.attention_scale)
    gemm_scale = 1.0            # low-precision GEMMs: LOWPREC_GEMM_SCALE
    # megatron-core's vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py), bytes per logit beyond the
    # dt read: forward .float() 4 + max 4 + subtract 8 + exp 8 + sum 4 + divide 8; backward mul_ 8 + the cast's 4
    ce_bytes = (36.0, 12.0)

    def __init__(self, gpu: str, peak_flop_per_ms: float, hbm_bytes_per_ms: float, dt: float):
        self.arch = arch(gpu)
        self.peak, self.hbm, self.dt = peak_flop_per_ms, hbm_bytes_per_ms, dt
        self.has_flash = self.arch.attn_fwd > 0
        self._cache: dict[tuple, float] = {}

    def _one(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        key = (m, n, k, batch)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        a = self.arch
        tm, tn = a.tile
        tiles = ceil(m / tm) * ceil(n / tn)
        tile_util = m * n / (tiles * tm * tn)
        units = tiles * batch
        split = 1
        if units < a.sms:
            split = max(1, min(a.sms // max(int(units), 1), int(k // SPLIT_K_MIN)))
            units *= split
        waves = ceil(units / a.sms)
        eff = a.gemm_max * a.sustained * self.gemm_scale * tile_util * units / (waves * a.sms)
        flops = 2.0 * m * n * k * batch
        nbytes = self.dt * (m * k + k * n + m * n) * batch + (4.0 * m * n * batch * split if split > 1 else 0.0)
        t = max(flops / (self.peak * eff), nbytes / (self.hbm * MEM_EFF)) + LAUNCH_MS
        self._cache[key] = t
        return t

    def gemm(self, shapes, backward: bool = False) -> float:
        if not backward:
            return sum(self._one(m, n, k) for m, n, k in shapes)
        return sum(self._one(m, k, n) + self._one(k, n, m) for m, n, k in shapes)

    def bmm(self, batch: float, m: float, n: float, k: float, backward: bool = False) -> float:
        if not backward:
            return self._one(m, n, k, batch)
        return self._one(m, k, n, batch) + self._one(k, n, m, batch)

    def gemm_parts(self, m: float, n: float, k: float) -> tuple[float, float, float]:
        return self._one(m, n, k), self._one(m, k, n), self._one(k, n, m)

    def flash(self, flops: float, s_kv: float, head_dim: int, causal: bool, backward: bool = False) -> float:
        a = self.arch
        eff = (a.attn_bwd if backward else a.attn_fwd) * a.sustained * self.attn_scale * s_kv / (s_kv + ATTN_S0)
        eff *= min(1.0, (head_dim / (head_dim + ATTN_D0)) / (128.0 / (128.0 + ATTN_D0)))
        if not causal:
            eff *= NONCAUSAL_GAIN
        return (2.5 * flops if backward else flops) / (self.peak * eff) + LAUNCH_MS

    def memory(self, nbytes: float, launches: int = 1) -> float:
        return nbytes / (self.hbm * MEM_EFF) + launches * LAUNCH_MS


KERNEL_MODELS = {"shape": ShapeKernels, "flat": FlatKernels}


def lowprec_kernels(kernels: str, gpu: str, peak_flop_per_ms: float, hbm_bytes_per_ms: float, elem_bytes: float,
                    recipe: str = "", release: str = ""):
    """The kernel model of the quantized linear GEMMs: the FP8 / FP4 peak, the quantized element size, the
    release's ``LOWPREC_GEMM_SCALE`` of the generation and the recipe's rate (``RECIPE_GEMM_SCALE``; NVFP4: the
    release's ``NVFP4_GEMM_SCALE``), read at call time from ``release_constants`` (so a fit can vary them)."""
    from .release_constants import value
    k = KERNEL_MODELS[kernels](gpu, peak_flop_per_ms, hbm_bytes_per_ms, elem_bytes)
    rate = value("NVFP4_GEMM_SCALE", release) if recipe == "nvfp4" else RECIPE_GEMM_SCALE.get(recipe, 1.0)
    k.gemm_scale = value("LOWPREC_GEMM_SCALE", release).get(GENERATION.get(gpu, ""), 1.0) * rate
    return k
