"""Helpers shared by the search and cost-model tests: memory limits derived from the cost model itself, so that a
test keeps exercising memory pressure when the cost model's numbers change; an independent 1F1B simulation."""

from search.spec.cluster import parse_cluster
from search.pricing import make_cost_model
from search.spec.plan import uniform_plan
from search.spec.training import TrainingSpec


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


def simulate_1f1b(fwd, bwd, m, sync=None):
    """Independent reference: run each stage's 1F1B op order, every op as soon as its input and its stage are free;
    the iteration ends when the last stage has finished, with its ``sync[k]`` (DP reduction, optimizer) after it."""
    p = len(fwd)
    sync = sync or [0.0] * p
    orders = []
    for k in range(p):
        w = min(p - k - 1, m)
        ops, f = [("F", i) for i in range(w)], w
        for b in range(m):
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
        orders.append(ops)
    done, clock, pos = {}, [0.0] * p, [0] * p
    while any(pos[k] < len(orders[k]) for k in range(p)):
        for k in range(p):
            while pos[k] < len(orders[k]):
                kind, i = orders[k][pos[k]]
                if kind == "F":
                    dep = 0.0 if k == 0 else done.get(("F", k - 1, i))
                else:
                    dep = done.get(("F", k, i)) if k == p - 1 else done.get(("B", k + 1, i))
                if dep is None:
                    break
                clock[k] = max(clock[k], dep) + (fwd[k] if kind == "F" else bwd[k])
                done[(kind, k, i)] = clock[k]
                pos[k] += 1
    return max(clock[k] + sync[k] for k in range(p))
