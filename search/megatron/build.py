"""``plan_from_config``: the ``ParallelPlan`` a Megatron-LM configuration runs (the inverse of ``megatron_config``).

Pipeline rank ``s`` is stage ``s`` with ``tp * cp * dp`` GPUs; model chunk ``k`` (``chunk_layers[k]`` layers) is
chunk ``k // pp`` of stage ``k % pp``; each unit's recompute choice follows ``recompute.unit_choices``; the
pipeline micro-batch is Megatron-LM's per-rank ``--micro-batch-size`` times dp; ``settings``: Megatron-LM with
the configuration's gradient-reduction dtype. MoE: every stage has the one expert shape (``ep``, ``etp``), the plan
the ``moe`` settings, and the last chunk also holds the MTP unit. A layout's end chunk without a transformer layer
(``E|...``, ``...|L``) is a chunk ``holds_only`` "embedding" / "loss".
"""

from __future__ import annotations

import pydantic

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError, as_aceso_error
from search.spec.plan import ChunkSpec, ParallelPlan, PlanPrediction, StageSpec
from .config import MegatronConfig, layer_bounds
from .recompute import unit_choices


def plan_from_config(cfg: MegatronConfig, cluster: ClusterSpec | None = None,
                     predicted: PlanPrediction | None = None, source: str = "megatron-lm arguments",
                     release: str | None = None, spans: list[tuple[int, int]] | None = None,
                     choices=unit_choices) -> ParallelPlan:
    """The plan, validated (a problem becomes one ``AcesoError`` line prefixed with ``source``). ``spans`` /
    ``choices``: the chunks' units and the recompute mapping of another layer form (the hybrid pattern's,
    ``hybrid_pattern.py``) instead of whole GPT layers'."""
    m = cfg.model
    spans = spans or _layer_spans(cfg, source)
    last = len(spans) - 1
    only = {k: ("embedding" if k == 0 else "loss") for k, (a, b) in enumerate(spans) if a == b and k in (0, last)}
    stages = []
    for s in range(cfg.pp):
        chunks = [ChunkSpec(start_unit=a, end_unit=b, recompute=choices(cfg.recompute, m, a, b),
                            holds_only=only.get(k))
                  for k, (a, b) in list(enumerate(spans))[s::cfg.pp]]
        stages.append(StageSpec(num_gpus=cfg.tp * cfg.cp * cfg.dp, tp=cfg.tp, cp=cfg.cp, dp=cfg.dp,
                                sequence_parallel=cfg.sequence_parallel, ep=cfg.ep, etp=cfg.etp, chunks=chunks))
    try:
        return ParallelPlan(model=m, cluster=cluster, micro_batch_size=cfg.micro_batch_size * cfg.dp,
                            global_batch_size=cfg.global_batch_size, stages=stages, predicted=predicted,
                            settings=cfg.settings.model_copy(update={"framework": "megatron-lm", "release": release}))
    except pydantic.ValidationError as e:
        raise AcesoError(f"{source}: " + str(as_aceso_error(e))) from None


def _layer_spans(cfg: MegatronConfig, source: str) -> list[tuple[int, int]]:
    """The units of each model chunk of ``chunk_layers`` whole layers."""
    m = cfg.model
    starts = layer_bounds(m)
    if len(cfg.chunk_layers) != cfg.pp * cfg.vpp or sum(cfg.chunk_layers) != len(starts) - 1:
        raise AcesoError(f"{source}: the layer layout gives {sum(cfg.chunk_layers)} layers in "
                         f"{len(cfg.chunk_layers)} chunks; the model has {len(starts) - 1} layers "
                         f"(pp {cfg.pp} x vpp {cfg.vpp} chunks)")
    spans, li = [], 0
    for n in cfg.chunk_layers:
        spans.append((starts[li], starts[li + n]))
        li += n
    spans[-1] = (spans[-1][0], m.num_units)       # the MTP unit (if any) runs in the last model chunk
    return spans
