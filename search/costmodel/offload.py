"""CPU activation offload in the cost model (megatron-core ``cpu_offloading``; ``search/settings/fsdp.py`` has its rules).

transformer-engine's ``get_cpu_offload_context`` (megatron-core 0.16.1 ``TransformerBlock``) copies each offloaded
layer's saved activations to pinned host memory after the layer's forward (device to host) and back before its
backward (host to device), on a side stream, one layer ahead: the copy of layer ``i`` runs behind the compute of
the next layer, and the synchroniser waits for it before the layer after. So, per micro-batch, with ``N`` offloaded
layers of ``A`` MiB of activations each (the offloaded layers' average), the host link's bandwidth ``H`` per
direction and ``t_f`` / ``t_b`` the forward / backward of one layer (the stage's average):

    memory    the activations of the N layers leave the GPU but one (the layer in flight), and that one only while
              the last layers run their forward: TE's ``AsyncDoubleBufferGroupOffloadHandler`` offloads the
              groups one after another and frees group k at the commit of layer ``layer_window_map[k]``, the
              last group at the last layer's, before the loss; so the stage's peak is the kept activations plus
              the larger of the layer in flight and the loss / recompute transient (``evaluate._assemble``), not
              their sum
    forward   exposed  N max(0, A / H - t_f)          hidden  N min(A / H, t_f)
    backward  exposed  N max(0, A / H - t_b)          hidden  N min(A / H, t_b)

The copies run on the copy engines, not the SMs: no overlap tax. ``StageCost.comm["offload"]`` reports them.

Host link per GPU and direction (the GPU record's ``host_link_gbps``, search/data/gpus.json), datasheets: H100 SXM
and H200 "PCIe Gen5: 128 GB/s" (bidirectional, x16: 64 GB/s per direction; NVIDIA H100 / H200 Tensor Core GPU
datasheets); DGX/HGX B200, B300: PCIe Gen5 x16 to the host, 64 GB/s per direction; GB200 / GB300 NVL72: NVLink-C2C
between the Grace CPU and each Blackwell GPU, "900 GB/s" bidirectional (NVIDIA GB200 NVL72 datasheet; Grace Hopper /
Blackwell superchip briefs), 450 GB/s per direction; A100 SXM4 PCIe Gen4 x16 (64 GB/s bidirectional: 32); V100 SXM2
PCIe Gen3 x16 (32: 16). ``HOST_LINK_EFFICIENCY``: pinned ``cudaMemcpyAsync`` reaches about 80% of the PCIe line rate
(CUDA samples' bandwidthTest: 50-55 GB/s on Gen5 x16); an uncalibrated assumption for NVLink-C2C too.
"""

from __future__ import annotations

from search.spec.cluster import gpu_record

HOST_LINK_EFFICIENCY = 0.8


def host_link_gbps(gpu: str) -> float:
    """Achievable host <-> GPU bandwidth per direction, GB/s."""
    return gpu_record(gpu).host_link_gbps * HOST_LINK_EFFICIENCY


def offload_ms(layer_mb: float, num_layers: int, t_layer: float, gbps: float) -> tuple[float, float]:
    """(exposed, hidden) ms of one direction of one micro-batch's offload: ``num_layers`` copies of ``layer_mb``
    MiB, each behind ``t_layer`` ms of the next layer's compute."""
    if num_layers <= 0 or layer_mb <= 0:
        return 0.0, 0.0
    x = layer_mb * 2**20 / (gbps * 1e6)
    return num_layers * max(0.0, x - t_layer), num_layers * min(x, t_layer)


def kept_mb(offloaded_mb: float, num_layers: int) -> float:
    """MiB of the offloaded layers' activations still on the GPU: the one layer in flight."""
    return offloaded_mb / num_layers if num_layers > 0 else offloaded_mb
