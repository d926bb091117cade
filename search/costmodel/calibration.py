"""Calibration files (``aceso calibrate -o calib.json``) and the one helper that applies them to a cluster.

A calibration file holds, per GPU type, what the user's own short runs measured, in absolute terms so that it
keeps its meaning when the default constants change (docs/calibrate.md):

- ``gemm_efficiency``: the sustained fraction of the dtype peak a large GEMM reaches (the analytic model's default
  is ``kernels.ARCH[gpu].gemm_max x sustained``);
- ``attention_efficiency``: the same for the fused attention forward (default ``attn_fwd x sustained``);
- ``intra_node_gbps`` / ``inter_node_gbps``: achieved bus bandwidth per GPU and direction (default: the preset
  link x ``comm.LINK_EFFICIENCY``); ``None`` where no run exercised the link;
- ``memory_reserve_mib``: what a GPU needs beyond the modelled states, activations and buffers (default
  ``memory.RESERVE_MB``);

with the fit's residuals per run (``runs``). ``apply_calibration`` turns one entry into the fields the analytic
model already reads: the GPU's peaks scaled by measured / default GEMM efficiency, ``GPUSpec.attention_scale``,
the two link bandwidths, and the memory budget lowered (or raised, up to the GPU's memory) by the reserve beyond
the default. Nothing else changes, so every command prices a plan the same way with or without a file.
"""

from __future__ import annotations

import math
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError, format_validation_error, read_json
from .comm import LINK_EFFICIENCY
from .kernels import arch
from .memory import RESERVE_MB

SCHEMA_VERSION = 1


class RunResidual(BaseModel):
    """One run of the fit: measured against predicted, before (defaults) and after calibration."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    run: str = Field(max_length=4096, description="The run's launch script or plan, and its log.")
    cluster: str = Field(max_length=64, description="The cluster it ran on (NODESxGPUS-gpu).")
    measured_iteration_ms: float = Field(gt=0)
    predicted_before_ms: float = Field(gt=0)
    predicted_after_ms: float = Field(gt=0)
    error_before: float = Field(description="predicted_before / measured - 1 of the iteration time (positive: "
                                "predicted slower).")
    error_after: float
    measured_memory_mb: float | None = Field(None, ge=0, description="Max over ranks of the log's peak memory.")
    predicted_memory_before_mb: float | None = Field(None, ge=0)
    predicted_memory_after_mb: float | None = Field(None, ge=0)


class GPUCalibration(BaseModel):
    """What one GPU type's runs measured (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    gemm_efficiency: float = Field(gt=0, le=1, description="Sustained large-GEMM fraction of the dtype peak.")
    attention_efficiency: float = Field(gt=0, le=1, description="Sustained fused-attention forward fraction of "
                                        "the peak (causal, head dim 128, long sequences).")
    intra_node_gbps: float | None = Field(None, gt=0, le=1e6, description="Achieved intra-node bus bandwidth, "
                                          "GB/s per GPU and direction; None = not measured (preset).")
    inter_node_gbps: float | None = Field(None, gt=0, le=1e6, description="Achieved network bandwidth per GPU.")
    memory_reserve_mib: float = Field(ge=0, le=1e6, description="Per-GPU memory beyond the modelled parts, MiB (2^20 bytes).")
    fitted: list[str] = Field(default_factory=list, description="The parameters the runs determined.")
    pinned: list[str] = Field(default_factory=list, description="The factors the runs exercised that the fit left "
                              "at a bound (the hardware's: a link's datasheet, a kernel's ceiling; or 1/4 of the "
                              "default): the runs would move them beyond it, so their values are the bound's.")
    runs: list[RunResidual] = Field(default_factory=list)


class CalibrationFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    kind: Literal["aceso-calibration"] = "aceso-calibration"
    schema_version: Literal[1] = SCHEMA_VERSION
    gpus: dict[str, GPUCalibration] = Field(description="GPU name (as in `aceso clusters`) -> its calibration.")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def load_calibration(path: str) -> CalibrationFile:
    raw = read_json(path, missing="no such calibration file", label=f"--calibration {path}")
    if not isinstance(raw, dict) or raw.get("kind") != "aceso-calibration":
        raise AcesoError(f"--calibration {path}: not a calibration file (no \"kind\": \"aceso-calibration\"); "
                         "write one with `aceso calibrate`")
    try:
        return CalibrationFile.model_validate(raw)
    except pydantic.ValidationError as e:
        raise AcesoError(f"--calibration {path}: " + format_validation_error(e)) from None


# ----- defaults of the analytic model, in the file's absolute terms -----------------------------------------------
def defaults(gpu: str, intra_gbps: float, inter_gbps: float) -> dict[str, float]:
    """The analytic model's own values of the file's fields for ``gpu`` (links: the cluster's datasheet numbers)."""
    a = arch(gpu)
    return {"gemm_efficiency": a.gemm_max * a.sustained, "attention_efficiency": (a.attn_fwd or 1.0) * a.sustained,
            "intra_node_gbps": intra_gbps * LINK_EFFICIENCY, "inter_node_gbps": inter_gbps * LINK_EFFICIENCY,
            "memory_reserve_mib": RESERVE_MB}


def scaled_cluster(cluster: ClusterSpec, gemm: float = 1.0, attention: float = 1.0, intra: float = 1.0,
                   inter: float = 1.0, extra_reserve_mb: float = 0.0) -> ClusterSpec:
    """``cluster`` with its peaks, attention factor and links scaled and its budget less ``extra_reserve_mb``."""
    g = cluster.gpu
    gpu = g.model_copy(update={
        "peak_tflops_fp16": g.peak_tflops_fp16 * gemm, "peak_tflops_fp32": g.peak_tflops_fp32 * gemm,
        "peak_tflops_bf16": None if g.peak_tflops_bf16 is None else g.peak_tflops_bf16 * gemm,
        "attention_scale": (g.attention_scale or 1.0) * attention})
    full = g.memory_gib * 1024.0                     # MiB
    limit = min(cluster.memory_mb - extra_reserve_mb, full)
    data = {**cluster.model_dump(), "gpu": gpu.model_dump(), "intra_node_gbps": cluster.intra_node_gbps * intra,
            "inter_node_gbps": cluster.inter_node_gbps * inter,
            "memory_limit_mib": None if abs(limit - full) < 1e-6 and cluster.memory_limit_mb is None else limit}
    if not all(math.isfinite(v) and v > 0 for v in (gemm, attention, intra, inter, limit)):
        raise AcesoError(f"calibration for {g.name}: it leaves no memory or a non-positive factor "
                         f"(gemm {gemm:g}, attention {attention:g}, links {intra:g}/{inter:g}, limit {limit:.0f} MiB)")
    try:
        return ClusterSpec.model_validate(data)
    except pydantic.ValidationError as e:
        raise AcesoError(f"calibration for {g.name}: " + format_validation_error(e)) from None


def apply_calibration(cluster: ClusterSpec, calib: CalibrationFile | None) -> ClusterSpec:
    """The cluster as the calibration measured it (peaks and links from the GPU's preset, the budget less the
    reserve beyond the default); unchanged without a file or when it is already calibrated (a plan searched with
    the same file). A file without this GPU: exit 2."""
    if calib is None:
        return cluster
    from search.spec.cluster import GPU_PRESETS, LINK_PRESETS
    name = cluster.gpu.name
    c = calib.gpus.get(name)
    if c is None or name not in GPU_PRESETS:
        have = ", ".join(calib.gpus) or "none"
        raise AcesoError(f"--calibration: no calibration for {name} (the file has {have}); calibrate with runs "
                         f"on {name} or drop --calibration")
    intra0, inter0 = LINK_PRESETS[name]
    d = defaults(name, intra0, inter0)
    base = cluster.model_copy(update={"gpu": GPU_PRESETS[name], "intra_node_gbps": intra0,
                                      "inter_node_gbps": inter0})
    gemm = c.gemm_efficiency / d["gemm_efficiency"]
    out = scaled_cluster(
        base, gemm=gemm, attention=c.attention_efficiency / d["attention_efficiency"] / gemm,
        intra=c.intra_node_gbps / d["intra_node_gbps"] if c.intra_node_gbps else 1.0,
        inter=c.inter_node_gbps / d["inter_node_gbps"] if c.inter_node_gbps else 1.0,
        extra_reserve_mb=c.memory_reserve_mib - d["memory_reserve_mib"])
    if (cluster.gpu, cluster.intra_node_gbps, cluster.inter_node_gbps) == \
            (out.gpu, out.intra_node_gbps, out.inter_node_gbps):
        return cluster
    return out
