"""List the GPU presets usable in a cluster string NODESxGPUS-gpu (e.g. 1x8-h100, 4x8-v100)."""

from __future__ import annotations

import argparse

from search.spec.cluster import GPU_ALIASES, GPU_PRESETS, LINK_PRESETS, RACK_PRESETS
from .common import add_gpu_file_arg, print_json, print_rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_gpu_file_arg(p)


def run(args: argparse.Namespace) -> int:
    rows = []
    for name, g in GPU_PRESETS.items():
        intra, inter = LINK_PRESETS[name]
        rows.append({"gpu": name, "aliases": [a for a, n in GPU_ALIASES.items() if n == name],
                     "racks": {r: size for r, (n, size) in RACK_PRESETS.items() if n == name},
                     "memory_gib": round(g.memory_gib, 1), "bf16_tflops": g.peak_tflops_bf16, "fp16_tflops": g.peak_tflops_fp16,
                     "fp8_tflops": g.peak_tflops_fp8, "fp4_tflops": g.peak_tflops_fp4, "hbm_gbps": g.hbm_gbps,
                     "intra_node_gbps": intra, "inter_node_gbps": inter})
    if args.json:
        print_json(rows)
        return 0
    print_rows("GPU presets: use as NODESxGPUS-gpu, e.g. 4x8-h100", rows, left=("gpu", "aliases", "racks"),
               footer="racks: NODESxGPUS-gb200-nvl72 (or gb300-nvl72) puts the nodes one rack holds in one 72-GPU "
               "NVLink domain, e.g. 16x4-gb200-nvl72 (16 trays of 4, one rack); :nvlN after any string sets the "
               "domain, e.g. 16x4-gb200:nvl64")
    return 0
