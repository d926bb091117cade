"""Where a stage's data-parallel collectives run on its timeline, and how much of them stays exposed.

megatron-core (0.16, ``distributed/distributed_data_parallel.py`` and ``pipeline_parallel/schedules.py``) with
``overlap_grad_reduce`` / ``overlap_param_gather`` and the distributed optimizer:

Buckets. Gradients (and, with the distributed optimizer, parameters) are grouped in buckets of ``bucket_size``
parameters (``--ddp-bucket-size``; default ``max(40M, 1M x dp)``, dp without CP). Only the first model chunk of the
first pipeline stage is bucketed: DDP drops bucketing on pipeline ranks > 0 ("not on the critical path") and
Megatron-LM's ``get_model`` passes ``disable_bucketing=(model_chunk_idx > 0)``; any other chunk is one bucket.

Gradient reduce-scatter (all-reduce without the distributed optimizer), per model chunk, queued on one stream:
- bucket hooks (the default without ``grad_sync_func``: our runtime, or ``--no-align-grad-reduce``): a bucket is
  reduced when the last micro-batch's backward has produced all its gradients, i.e. buckets of chunk j are released
  during chunk j's last backward;
- aligned (``grad_sync_func``, Megatron-LM's default ``align_grad_reduce``): the interleaved schedule launches
  chunk j's reduction after its last backward, ``pp_rank`` virtual steps later ("at the same time across the
  pipeline-parallel group"), all its buckets at once; without interleaving the first stage still uses the hooks
  and the other stages launch theirs after their cool-down ("during pipeline bubble").
In the interleaved cool-down a stage's last backwards are the last ``pp`` micro-batches of chunks ``v-1 .. 0`` in
turn, so chunk j's last backward ends ``pp x (the backwards of chunks j-1 .. 0)`` before the stage's last one.

Parameter all-gather (``overlap_param_gather``), needed before each chunk's first forward:
- hooks (default): the first bucket of a chunk is dispatched by the chunk's first forward pre-hook and waited for
  (exposed), each next bucket is dispatched when the previous one is used (behind that bucket's forward);
- aligned (``--align-param-gather``, interleaved): chunks 0 and 1 are gathered at the start of the schedule,
  chunk j+1 at chunk j's first forward; the pre-hooks only wait. Chunk j's first forward comes after
  ``pp x (the forwards of chunks 0 .. j-1)`` in the warm-up.

Full-iteration CUDA graphs (``--cuda-graph-impl local --cuda-graph-scope full_iteration``) keep all of this:
``FullCudaGraphWrapper`` captures the schedule with ``torch.cuda.graph``, and DDP's hooks skip only while
``is_graph_capturing()``, the flag of the per-layer graph captures (``transformer/cuda_graphs.py``), so the
collectives the hooks launch are captured with the compute they overlap.

Each list of (release ms, duration ms, deadline ms) runs first-in first-out on one stream (``fifo``); what ends past
the stage's last backward (gradients) or past a chunk's first forward (parameters) is exposed. Later pipeline
stages' timing relative to their own last backward / first forward is priced as the first stage's; their cool-down
and warm-up idle (the pipeline's own bubble) hides the rest (``pipeline.py``: a stage's sync follows its last op, the
parameter all-gather delays its first op).

How deep into the interleaved cool-down / warm-up the chunks' collectives hide (``COOLDOWN_MICRO_BATCHES``): the
schedule leaves ``pp`` micro-batches of each later chunk between chunk j's last backward and the stage's last one;
the published runs do not show that much hiding. NVIDIA's MLPerf Training v5.0 Llama 3.1 405B runs on 512 to 8,192
H100s (tp 8, pp 8, vp 8, cp 2, dp 4 to 64; bench/scale_published.py) measure a step time linear in the micro-batches
per step whose fixed part, less the pipeline bubble, is 0.47 s at every DP size: the size of their whole DP traffic
(bf16 reduce-scatter and FP8 all-gather of 6.3e9 parameters per rank on one 400 Gb/s NIC), where pp micro-batches of
hiding leave 0.13 s exposed; with one micro-batch the residual of those five runs is the same -4.5% to -6.6% (their
per-micro-batch compute), and GPT-3 175B on 10,752 / 11,616 H100s (dp 448 / 484) comes to -1% instead of -20%. So a
chunk's collectives hide behind one micro-batch's backward (forward) of the chunks that follow (precede) it.
"""

from __future__ import annotations

from math import ceil
from typing import Callable

Collective = Callable[[float], float]      # bytes -> ms


def fifo(jobs: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(exposed, hidden) ms of collectives ``(release, duration, deadline)`` run one after another in release order;
    exposed = the total time the stream's work ends past a deadline (each wait delays the compute, so the later
    releases and deadlines move with it)."""
    t, stall, total = float("-inf"), 0.0, 0.0
    for release, duration, deadline in sorted(jobs, key=lambda j: j[0]):
        t = max(t, release + stall) + duration
        total += duration
        late = t - (deadline + stall)
        if late > 0:
            stall += late
    return stall, max(0.0, total - stall)


COOLDOWN_MICRO_BATCHES = 1     # micro-batches of later chunks a chunk's collectives hide behind (docstring)


def num_buckets(params: float, bucket_params: float) -> int:
    return max(1, ceil(params / bucket_params)) if bucket_params > 0 else 1


def grad_jobs(chunk_params: list[float], chunk_bytes: list[float], chunk_bwd: list[float], reduce: Collective,
              stage: int, depth: int, bucket_params: float, aligned: bool) -> list[tuple[float, float, float]]:
    """The gradient reductions of one stage (``chunk_bytes`` per model chunk) as ``fifo`` jobs; 0 = the end of
    the stage's last backward; ``depth``: micro-batches of each later chunk between a chunk's last backward and 0."""
    v = len(chunk_params)
    jobs = []
    for j, (p, b) in enumerate(zip(chunk_params, chunk_bytes)):
        if p <= 0:
            continue
        end = -depth * sum(chunk_bwd[:j])           # chunk j's last backward ends here
        schedule = aligned and (v > 1 or stage > 0)  # launched by the schedule, else by the bucket hooks
        nb = num_buckets(p, bucket_params) if stage == 0 and j == 0 else 1
        if not schedule and nb > 1:               # the bucketed chunk: buckets during its last backward
            c, w = reduce(b / nb), chunk_bwd[0]
            jobs += [(end - w + (i + 1) * w / nb, c, 0.0) for i in range(nb)]
        else:                                       # one launch: all its buckets when its gradients are done
            delay = stage * chunk_bwd[j] if schedule and v > 1 else 0.0
            jobs += [(min(0.0, end + delay), reduce(b / nb), 0.0)] * nb
    return jobs


def gather_jobs(chunk_params: list[float], chunk_bytes: list[float], chunk_fwd: list[float], gather: Collective,
                stage: int, depth: int, bucket_params: float, aligned: bool) -> list[tuple[float, float, float]]:
    """The parameter all-gathers of one stage (``chunk_bytes`` per model chunk) as ``fifo`` jobs; 0 = the stage's
    first forward; ``depth``: micro-batches of each earlier chunk before a chunk's first forward."""
    v = len(chunk_params)
    first = [depth * sum(chunk_fwd[:j]) for j in range(v)]     # chunk j's first forward
    jobs = []
    for j, (p, b) in enumerate(zip(chunk_params, chunk_bytes)):
        if p <= 0:
            continue
        nb = num_buckets(p, bucket_params) if stage == 0 and j == 0 else 1
        if aligned and v > 1:                       # the schedule: chunks 0, 1 at the start, j at j-1's first forward
            release = 0.0 if j < 2 else max(0.0, first[j - 1] - stage * chunk_fwd[j - 1])
            jobs += [(release, gather(b / nb), first[j])] * nb
        else:   # bucket 0 when the chunk's first layer needs it; bucket i+1 when bucket i starts its forward
            c, w = gather(b / nb), chunk_fwd[j]
            jobs += [(first[j] + max(i - 1, 0) * w / nb, c, first[j] + i * w / nb) for i in range(nb)]
    return jobs
