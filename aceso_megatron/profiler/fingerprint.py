"""Hardware fingerprint of a profile: the GPU preset name the cost model checks, and the versions that
change measured numbers (device name, driver, CUDA, torch, megatron-core, transformer-engine)."""

from __future__ import annotations

import platform
import re
import subprocess
from importlib import metadata

import torch

from search.spec.cluster import gpu_for_device as gpu_preset  # noqa: F401  (the device name's GPU record)

def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def hardware(device: str, per_node: int, num_nodes: int) -> dict:
    """The ``hardware`` block of the database, without ``gpu`` (the caller decides the preset name)."""
    info = {"device": device, "gpus_per_node": per_node, "num_nodes": num_nodes, "torch": torch.__version__,
            "megatron_core": _version("megatron-core") or _version("megatron_core"),
            "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
            "python": platform.python_version(), "host_cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:   # noqa: BLE001 - informational only
            nccl = None
        info.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda, driver=_driver(), nccl=nccl,
                    flash_attention=_version("flash-attn") or _version("flash_attn"))
    else:
        info.update(device_name=f"cpu ({platform.machine()})", threads_per_process=torch.get_num_threads())
    return info
