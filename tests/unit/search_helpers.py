"""Helpers shared by the search tests: memory limits derived from the cost model itself, so that a test keeps
exercising memory pressure when the cost model's numbers change."""

from search.cluster import parse_cluster
from search.costmodel import make_cost_model
from search.plan import uniform_plan
from search.training import TrainingSpec


def memory_between(model, cluster, gbs, f):
    """A memory limit between what one GPU per stage with every unit recomputed needs (about the least) and what one
    stage of pure DP needs without recompute at per-rank batch 1 (so below it every fitting plan pipelines or
    recomputes): ``low + f (high - low)``."""
    cl = parse_cluster(cluster)
    cm = make_cost_model(model, cl, TrainingSpec(global_batch_size=gbs))
    on = dict(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    n = cl.num_gpus
    low = cm.evaluate(uniform_plan(model, n, 1, 1, 1, gbs, "full", cl, **on)).max_memory_mb
    high = cm.evaluate(uniform_plan(model, 1, 1, n, n, gbs, "none", cl, **on)).max_memory_mb
    return low + f * (high - low)
