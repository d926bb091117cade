"""Cluster description (``ClusterSpec``) and GPU presets with datasheet numbers.

Each GPU is one record of ``data/gpus.json`` (``GPURecord``: peaks, memory, links, host link, NVLink rack, kernel
constants; docs/gpus.md); ``--gpu-file`` adds one (``load_gpu_file``); an unknown name is refused (``gpu_record``).
The sources of the shipped records' numbers, in detail:

String form ``NxG-gpu``: ``1x8-h100`` is one node of 8 H100s, ``4x8-v100`` four nodes of 8 V100s.

Datasheet sources (dense, no sparsity): V100-SXM2-32GB 125 TFLOP/s fp16 tensor, 900 GB/s HBM2, NVLink2 300 GB/s
bidirectional per GPU; A100-SXM4 312 TFLOP/s bf16/fp16, 1555 (40 GB) / 2039 (80 GB) GB/s, NVLink3 600 GB/s
bidirectional; H100-SXM5 989 TFLOP/s bf16, 3350 GB/s HBM3, NVLink4 900 GB/s bidirectional; H200-SXM 989 TFLOP/s,
4800 GB/s HBM3e, 141 GB; B200 (HGX/DGX B200 datasheets: 36 PFLOP/s fp16/bf16 with sparsity per 8 GPUs = 2250
dense per GPU, TF32 1125 dense, HBM3e 8 TB/s, 1,440 GB per 8 GPUs = 180 GB, NVLink5 1.8 TB/s bidirectional);
GB200 (GB200 NVL72 datasheet, per GPU of 72: 360 PFLOP/s fp16/bf16 sparse / 72 = 2500 dense, TF32 1250 dense,
13.4 TB HBM3e / 72 = 186 GB at 576 TB/s / 72 = 8 TB/s, NVLink5 1.8 TB/s bidirectional across the whole rack:
a GB200 NVL72 rack is one NVLink "node" of 72 GPUs, ``1x72-gb200``). Link bandwidths here are one direction per
GPU (half the bidirectional figure). Inter-node: one NIC per GPU, 100 Gb/s EDR for V100 systems (DGX-1/2),
200 Gb/s HDR for A100 (DGX A100), 400 Gb/s NDR for H100/H200/B200/GB200 (DGX H100/H200/B200 and GB200 NVL72 with
ConnectX-7); in GB/s that is 12.5, 25 and 50 per GPU. Memory is GiB (2^30 bytes, the one memory unit of aceso,
docs/inputs.md): the HBM stacks of V100/A100/H100 are 32/40/80 GiB (sold as "32/40/80 GB"); H200's is the 139 GiB a
process can allocate. B200's, GB200's and GB300's "180 / 186 / 279 GB" are binary as H100's "80 GB" is: NVIDIA's
full-GPU MIG profiles are named 7g.80gb / 7g.180gb / 7g.186gb / 7g.278gb at 81920 / 184320 / 190464 / 284672 MiB
(NVML profile tables as transcribed by NVIDIA's nvml-mock profiles), and nvidia-smi reports 183359 MiB on a B200 and
189471 MiB on a GB200 (179.1 / 185.0 GiB, public nvidia-smi logs; H100: 81559 MiB for its 80): 180, 186, 278 GiB.
B300's 288 GB stays decimal (268 GiB: what B300 listings report). Plan files written before the unit was fixed
(``memory_gb``, 10^9 bytes) still read.

Low-precision peaks (dense, ``peak_tflops_fp8`` / ``peak_tflops_fp4``; None: no such tensor cores, a low-precision
plan is refused, ``search/settings/precision.py``): H100-SXM5 / H200-SXM FP8 1979 (H100 datasheet: 3958 with sparsity);
B200 FP8 4500, FP4 9000 (DGX B200: 72 PFLOP/s FP8 training and 144 FP4 inference sparse per 8 GPUs); GB200 FP8
5000, FP4 10000 (GB200 NVL72: 720 PFLOP/s FP8 and 1440 FP4 sparse per 72). Blackwell Ultra: B300 (HGX/DGX B300;
G. Lockwood's B300 page, glennklockwood.com/garden/processors/B300, from NVIDIA's HGX B300 datasheet: dense
bf16 2250, TF32 1125, FP8 4500, FP4 13125; 288 GB HBM3e at 8 TB/s, NVLink5 1.8 TB/s bidirectional; DGX B300:
72 PFLOP/s FP8 sparse per 8 GPUs, 2.3 TB HBM3e per 8, ConnectX-8 800 Gb/s per GPU) and GB300 (GB300 NVL72
datasheet as quoted on the same page and verda.com/blog/gb300-nvl72-architecture: 360 PFLOP/s FP8, 1.08 EFLOP/s
FP4 and 180 PFLOP/s bf16 dense per 72 GPUs = 5000 / 15000 / 2500, 20 TB HBM3e at 576 TB/s per 72 = 279 GB at
8 TB/s, 72 ConnectX-8 800 Gb/s NICs). Their networks: 800 Gb/s = 100 GB/s per GPU.

NVLink domains (``ClusterSpec.nvlink_domain``): GPUs that reach each other over NVLink, a multiple of the GPUs per
node (default: one node; GB200 / GB300 trays: their NVL72 rack, ``RACK_DOMAIN``). ``1x64-gb200`` prices a rack as one
node of 64; ``16x4-gb200:nvl64`` writes it as 16 trays of 4 in one NVLink domain of 64 (``:nvlN`` after the string;
``:nvl4`` isolated trays): TP, CP and DP groups inside a domain run at the NVLink bandwidth, groups across domains on
the network (``comm.py``). Trays of several nodes are their rack, and so are the rack presets ``gb200-nvl72`` /
``gb300-nvl72``: ``128x4-gb200``, ``128x4-gb200-nvl72`` and ``128x4-gb200:nvl72`` are one cluster, the whole nodes of
one 72-GPU rack in one domain (``rack_domain``; nodes of 64, as the published ``1x64-gb200`` rows, stay one domain
of 64).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from search.io.units import gib_from_legacy_gb, mib_alias

from search.io.errors import AcesoError, did_you_mean

# Upper bounds (docs/inputs.md): far above any machine (B200: 192 GB, 2.25 PFLOP/s dense fp16, 8 TB/s HBM,
# NVLink5 900 GB/s per direction), low enough that a typo such as 10^30 is refused.
MAX_NODES = 1 << 16
MAX_GPUS_PER_NODE = 1024
MAX_GPUS = 1 << 20
MAX_MEMORY_GIB = 1e5
MAX_TFLOPS = 1e6
MAX_GBPS = 1e6


class GPUSpec(BaseModel):
    """One accelerator type."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=64, description="Short name, e.g. h100.")
    memory_gib: float = Field(gt=0, le=MAX_MEMORY_GIB, description="Device memory, GiB (2^30 bytes).")
    peak_tflops_fp16: float = Field(gt=0, le=MAX_TFLOPS, description="Dense fp16 tensor-core peak, TFLOP/s.")
    peak_tflops_bf16: float | None = Field(None, gt=0, le=MAX_TFLOPS,
                                           description="Dense bf16 peak, TFLOP/s; None = unsupported.")
    peak_tflops_fp32: float = Field(gt=0, le=MAX_TFLOPS,
                                    description="fp32 peak (TF32 tensor cores where present), TFLOP/s.")
    hbm_gbps: float = Field(gt=0, le=MAX_GBPS, description="Memory bandwidth, GB/s.")
    peak_tflops_fp8: float | None = Field(None, gt=0, le=MAX_TFLOPS,
                                          description="Dense FP8 tensor-core peak, TFLOP/s; None = no FP8.")
    peak_tflops_fp4: float | None = Field(None, gt=0, le=MAX_TFLOPS,
                                          description="Dense FP4 tensor-core peak, TFLOP/s; None = no FP4.")
    attention_scale: float | None = Field(None, gt=0, le=100, description="Calibrated (`aceso calibrate`): fused "
                                          "attention throughput relative to the cost model's default; None = 1.")

    _legacy = model_validator(mode="before")(gib_from_legacy_gb)

    def peak_tflops(self, dtype: str) -> float | None:
        """The dense peak of ``dtype`` (bf16, fp16, fp32, fp8, fp4; None where the GPU has none: bf16 on a V100 is
        refused by ``precision.check``, not priced at the fp16 peak)."""
        if dtype in ("fp8", "fp4"):
            return self.peak_tflops_fp8 if dtype == "fp8" else self.peak_tflops_fp4
        if dtype == "bf16":
            return self.peak_tflops_bf16
        return self.peak_tflops_fp16 if dtype == "fp16" else self.peak_tflops_fp32


class KernelConstants(BaseModel):
    """The shape kernel model's constants of one GPU (``costmodel/kernels.py``: ``Arch``, sources in its docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sms: int = Field(gt=0, le=100000, description="Streaming multiprocessors (datasheet).")
    gemm_tile: tuple[int, int] = Field(description="cuBLAS output tile (rows, cols) on this architecture.")
    gemm_max: float = Field(gt=0, le=1, description="Maximum achievable matmul FLOPS / dense bf16 peak (MAMF).")
    attn_fwd: float = Field(ge=0, le=1, description="Fused attention forward fraction of peak (0: no flash).")
    attn_bwd: float = Field(ge=0, le=1, description="Fused attention backward fraction of peak.")
    sustained: float = Field(1.0, gt=0, le=1, description="Fraction of the ceilings a training step sustains.")


class FlatEfficiency(BaseModel):
    """The v1 flat kernel model's efficiencies (``kernels.Efficiency``); only ``kernels="flat"`` reads them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm: float = Field(gt=0, le=1)
    bmm: float = Field(gt=0, le=1)
    flash_fwd: float = Field(ge=0, le=1)
    flash_bwd: float = Field(ge=0, le=1)
    mem: float = Field(gt=0, le=1)


class GPURecord(BaseModel):
    """One GPU as data: its datasheet numbers, links and kernel constants (``search/data/gpus.json``; a user's
    ``--gpu-file``, docs/gpus.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,63}$", description="Short lower-case name, e.g. h100.")
    aliases: list[str] = Field(default_factory=list, description="Other names of the same GPU.")
    source: str = Field(min_length=1, description="Where the numbers come from (datasheet, measurement).")
    memory_gib: float = Field(gt=0, le=MAX_MEMORY_GIB)
    peak_tflops_fp16: float = Field(gt=0, le=MAX_TFLOPS)
    peak_tflops_bf16: float | None = Field(None, gt=0, le=MAX_TFLOPS)
    peak_tflops_fp32: float = Field(gt=0, le=MAX_TFLOPS)
    peak_tflops_fp8: float | None = Field(None, gt=0, le=MAX_TFLOPS)
    peak_tflops_fp4: float | None = Field(None, gt=0, le=MAX_TFLOPS)
    hbm_gbps: float = Field(gt=0, le=MAX_GBPS)
    nvlink_gbps: float = Field(gt=0, le=MAX_GBPS, description="GPU-to-GPU in a node, GB/s per GPU per direction.")
    network_gbps: float = Field(gt=0, le=MAX_GBPS, description="Across nodes, GB/s per GPU per direction.")
    host_link_gbps: float = Field(gt=0, le=MAX_GBPS, description="GPU <-> host memory (PCIe or NVLink-C2C), GB/s "
                                  "per direction (activation offload, costmodel/offload.py).")
    host_cpu_ghz: float | None = Field(None, gt=0, le=10, description="Single-core boost clock of the x86 host CPU "
                                       "of the GPU's DGX system, GHz: the host time per kernel launch scales with "
                                       "it (costmodel/host.py); None = an Arm (Grace) or unknown host: the fitted "
                                       "per-launch time as it is.")
    nvlink_domain: int | None = Field(None, gt=0, le=MAX_GPUS, description="GPUs of one NVLink rack (NVL72: 72); "
                                      "None = one node. Adds the rack preset NAME-nvlN.")
    generation: str | None = Field(None, description="hopper / blackwell: the generation whose fitted "
                                   "low-precision and NVLS constants apply; None = none.")
    nominal: bool = Field(False, description="Numbers of no particular machine (the cpu preset).")
    device_pattern: str | None = Field(None, description="Regex of torch's device name (the profiler's fingerprint).")
    kernels: KernelConstants
    flat_efficiency: FlatEfficiency | None = None

    def spec(self) -> GPUSpec:
        return GPUSpec(**self.model_dump(include=set(GPUSpec.model_fields) - {"attention_scale"}))


GPU_RECORDS: dict[str, GPURecord] = {}
GPU_PRESETS: dict[str, GPUSpec] = {}
# presets whose numbers describe no particular machine: "cpu" is a nominal CPU process (0.2 TFLOP/s, 20 GB/s memory,
# 5 / 1 GB/s between processes) for CPU test runs; only `aceso calibrate` on a run of this machine makes it real
# (its factors are fitted without the hardware bounds of a datasheet preset, search/calibration/calibrate.py)
NOMINAL_PRESETS: set[str] = set()
GPU_ALIASES: dict[str, str] = {}
# Rack presets: the GPU and the GPUs one NVLink domain of the rack holds. ``16x4-gb200-nvl72`` is 16 trays of 4 in
# one NVL72 rack (``rack_domain``: as many whole nodes as the rack holds); ``1x64-gb200-nvl72`` is the 64 GPUs the
# published recipes use of one rack, priced as ``1x64-gb200``.
RACK_PRESETS: dict[str, tuple[str, int]] = {}
# (intra-node GB/s per GPU per direction, inter-node GB/s per GPU)
LINK_PRESETS: dict[str, tuple[float, float]] = {}
# Grace-Blackwell GPUs come in NVL72 racks (GB200 NVL72 / GB300 NVL72 datasheets: 18 compute trays of 4 GPUs, 72 GPUs
# in one NVLink domain; the presets' aliases gb200-nvl72 / gb300-nvl72): trays written as nodes (``128x4-gb200``, as an
# MLPerf system file or Slurm counts them) sit in racks of 72 unless ``:nvlN`` says how many a job uses per rack.
RACK_DOMAIN: dict[str, int] = {}
_ON_ADD: list = []          # tables built from the records elsewhere (costmodel/kernels.py): called per added GPU
GPU_DATA = Path(__file__).resolve().parents[1] / "data" / "gpus.json"


def add_gpu(record: GPURecord) -> None:
    """Registers ``record``: every GPU table (presets, links, racks, kernel constants) reads it."""
    if GPU_RECORDS.get(record.name) == record:
        return                                    # the same file given again (one process, several commands)
    taken = {*GPU_PRESETS, *GPU_ALIASES, *RACK_PRESETS}
    names = [record.name, *record.aliases] + ([f"{record.name}-nvl{record.nvlink_domain}"]
                                              if record.nvlink_domain else [])
    clash = [n for n in names if n in taken]
    if clash:
        raise AcesoError(f"gpu '{clash[0]}': already a known GPU name; give the record another name")
    GPU_RECORDS[record.name] = record
    GPU_PRESETS[record.name] = record.spec()
    LINK_PRESETS[record.name] = (record.nvlink_gbps, record.network_gbps)
    GPU_ALIASES.update({a: record.name for a in record.aliases})
    if record.nominal:
        NOMINAL_PRESETS.add(record.name)
    if record.nvlink_domain:
        RACK_DOMAIN[record.name] = record.nvlink_domain
        RACK_PRESETS[names[-1]] = (record.name, record.nvlink_domain)
    for f in _ON_ADD:
        f(record)


def load_gpu_file(path: str | Path, option: str = "--gpu-file") -> list[str]:
    """Adds the GPU record(s) of a JSON file (one object or a list of them); returns their names."""
    from search.io.errors import format_validation_error
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise AcesoError(f"{option} {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        records = [GPURecord.model_validate(r) for r in (raw if isinstance(raw, list) else [raw])]
    except ValueError as e:   # pydantic ValidationError is a ValueError
        raise AcesoError(f"{option} {path}: " + format_validation_error(e)) from None
    try:
        for r in records:
            add_gpu(r)
    except AcesoError as e:
        raise AcesoError(f"{option} {path}: {e}") from None
    return [r.name for r in records]


def gpu_record(name: str, field: str = "gpu") -> GPURecord:
    """The record of GPU ``name``; an unknown name is refused (never priced as another GPU)."""
    r = GPU_RECORDS.get(GPU_ALIASES.get(name, name))
    if r is None:
        hint = did_you_mean(name, [*GPU_PRESETS, *GPU_ALIASES]) or ";"
        raise AcesoError(f"{field} '{name}': unknown GPU{hint} known: {', '.join(GPU_PRESETS)} (add one with "
                         "--gpu-file FILE, docs/gpus.md)")
    return r


def gpu_for_device(device_name: str) -> str | None:
    """The GPU record whose ``device_pattern`` matches torch's device name (first in the records' order), or None
    (the profiler's fingerprint; a GH200's "NVIDIA GH200 480GB" is no H200)."""
    for r in GPU_RECORDS.values():
        if r.device_pattern and re.search(r.device_pattern, device_name, re.IGNORECASE):
            return r.name
    return None


for _r in json.loads(GPU_DATA.read_text()):
    add_gpu(GPURecord.model_validate(_r))


class ClusterSpec(BaseModel):
    """Homogeneous nodes of identical GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    num_nodes: int = Field(gt=0, le=MAX_NODES, description="Number of nodes.")
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE, description="GPUs in each node.")
    gpu: GPUSpec = Field(description="The accelerator.")
    intra_node_gbps: float = Field(gt=0, le=MAX_GBPS,
                                   description="GPU-to-GPU bandwidth inside a node, GB/s per direction.")
    inter_node_gbps: float = Field(gt=0, le=MAX_GBPS,
                                   description="Network bandwidth per GPU across nodes, GB/s per direction.")
    nvlink_domain: int | None = Field(None, gt=0, le=MAX_GPUS, description="GPUs per NVLink domain (a multiple "
                                      "of gpus_per_node: an NVL72 rack of trays of 4); None = one node.")
    memory_limit_mb: float | None = Field(
        None, gt=0, description="Per-GPU memory budget in MiB (2^20 bytes); None = the GPU's memory.",
        **mib_alias("memory_limit_mb"))

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        if self.num_nodes * self.gpus_per_node > MAX_GPUS:
            raise ValueError(f"num_nodes x gpus_per_node ({self.num_nodes * self.gpus_per_node}) is above the "
                             f"limit of {MAX_GPUS} GPUs")
        if self.nvlink_domain is not None and self.nvlink_domain % self.gpus_per_node:
            raise ValueError(f"nvlink_domain ({self.nvlink_domain}) must be a multiple of gpus_per_node "
                             f"({self.gpus_per_node})")
        if self.memory_limit_mb is not None and self.memory_limit_mb > self.gpu.memory_gib * 1024 * 1.0001:
            raise ValueError(
                f"memory_limit_mib ({self.memory_limit_mb:.0f}) exceeds the {self.gpu.name}'s "
                f"{self.gpu.memory_gib * 1024:.0f} MiB; lower it"
            )
        return self

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def memory_mb(self) -> float:
        """The per-GPU memory budget, MiB."""
        return self.memory_limit_mb or self.gpu.memory_gib * 1024

    @property
    def nvlink_size(self) -> int:
        """GPUs per NVLink domain."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def label(self) -> str:
        nvl = f":nvl{self.nvlink_domain}" if self.nvlink_size != self.gpus_per_node else ""
        return f"{self.num_nodes}x{self.gpus_per_node}-{self.gpu.name}{nvl}"

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def domain_of(self, rank: int) -> int:
        """The NVLink domain of ``rank``."""
        return rank // self.nvlink_size


_CLUSTER_RE = re.compile(r"^(\d+)x(\d+)-([a-z0-9-]+?)(?::nvl(\d+))?$")


def parse_cluster(text: str, memory_limit_mb: float | None = None) -> ClusterSpec:
    """``'4x8-h100'`` -> ClusterSpec with the preset's GPU and links."""
    m = _CLUSTER_RE.match(text.strip().lower())
    if not m:
        raise AcesoError(f"cluster '{text}': expected NODESxGPUS-gpu[:nvlN], e.g. 1x8-h100{_shape_hint(text)} "
                         "(see `aceso clusters`)")
    nodes, gpn, gpu = int(m.group(1)), int(m.group(2)), m.group(3)
    nvl = int(m.group(4)) if m.group(4) else None
    if nodes < 1 or gpn < 1:
        raise AcesoError(f"cluster '{text}': nodes and gpus per node must be at least 1")
    if gpu in RACK_PRESETS:
        gpu, rack = RACK_PRESETS[gpu]
        nvl = rack_domain(text, gpn, rack, nvl)
    elif gpu in RACK_DOMAIN and nvl is None and nodes > 1 and gpn < RACK_DOMAIN[gpu]:
        nvl = rack_domain(text, gpn, RACK_DOMAIN[gpu], nvl)    # trays of a Grace-Blackwell rack (docstring)
    gpu = GPU_ALIASES.get(gpu, gpu)
    if gpu not in GPU_PRESETS:
        hint = did_you_mean(gpu, [*GPU_PRESETS, *GPU_ALIASES, *RACK_PRESETS], what=f"{nodes}x{gpn}-")
        raise AcesoError(f"cluster '{text}': unknown gpu '{gpu}'{hint or ';'} choose one of "
                         f"{', '.join([*GPU_PRESETS, *RACK_PRESETS])}")
    if nvl is not None and nvl % gpn:
        raise AcesoError(f"cluster '{text}': an NVLink domain of {nvl} GPUs cannot hold whole nodes of {gpn} (a "
                         f"node is never split between domains); use :nvl{max(gpn, nvl // gpn * gpn)} or nodes of "
                         f"a size that divides {nvl}")
    intra, inter = LINK_PRESETS[gpu]
    try:
        return ClusterSpec(num_nodes=nodes, gpus_per_node=gpn, gpu=GPU_PRESETS[gpu], intra_node_gbps=intra,
                           inter_node_gbps=inter, memory_limit_mb=memory_limit_mb, nvlink_domain=nvl)
    except ValueError as e:  # pydantic ValidationError is a ValueError
        from search.io.errors import format_validation_error
        raise AcesoError(f"cluster '{text}': " + format_validation_error(e)) from None


def rack_domain(text: str, gpus_per_node: int, rack: int, nvl: int | None) -> int | None:
    """The NVLink domain of a rack preset with nodes of ``gpus_per_node``: the whole nodes one rack of ``rack`` GPUs
    holds (None: one node, as without the preset). ``:nvlN`` may name a smaller domain, not a larger one."""
    if gpus_per_node > rack:
        raise AcesoError(f"cluster '{text}': a rack holds {rack} GPUs, not a node of {gpus_per_node}; use nodes "
                         f"(trays) of at most {rack} GPUs, e.g. {-(-gpus_per_node // 4)}x4")
    if nvl is not None and nvl > rack:
        raise AcesoError(f"cluster '{text}': :nvl{nvl} is more than the {rack} GPUs one rack's NVLink reaches; drop "
                         f":nvl{nvl} (the preset makes the rack one domain)")
    domain = nvl or rack // gpus_per_node * gpus_per_node
    return None if domain == gpus_per_node else domain


def _shape_hint(text: str) -> str:
    """A guess at what a malformed cluster string meant: ``h100`` -> 1x8-h100, ``8xh100`` -> 1x8-h100."""
    t = text.strip().lower()
    names = [*GPU_PRESETS, *GPU_ALIASES, *RACK_PRESETS]
    m = re.match(r"^(?:(\d+)[x*])?(?:(\d+)[x*-]?)?([a-z][a-z0-9-]*)$", t)
    if not m or m.group(3) not in names:
        return ""
    if m.group(1) and m.group(2):
        nodes, gpn = int(m.group(1)), int(m.group(2))
    else:                                       # one number: the GPUs in all (``64-h100``), in nodes of 8
        total = int(m.group(1) or m.group(2) or 8)
        nodes, gpn = (total // 8, 8) if total > 8 and total % 8 == 0 else (1, total)
    return f"; did you mean {nodes}x{gpn}-{m.group(3)}?"
