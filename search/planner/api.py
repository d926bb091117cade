"""One-call entry points used by ``aceso search``, ``aceso baseline`` and the bench."""

from __future__ import annotations

from ..errors import AcesoError
from .aceso import SearchOptions, SearchResult, search
from .baseline import BaselineResult, best_uniform
from .state import Space, State


def build_cost_model(model, cluster, training, kind: str = "analytic", db=None):
    if kind == "aceso-compat":
        try:
            from ..compat.costmodel import make_compat_cost_model
        except ImportError:
            raise AcesoError("--cost-model aceso-compat is not available in this version") from None
        return make_compat_cost_model(model, cluster, training, db)
    from ..costmodel import make_cost_model
    return make_cost_model(model, cluster, training, kind, db=db)


def search_space(cm, training) -> Space:
    """The model's and cluster's shape space, restricted to what the cost model covers: ``cm.available_shapes()``
    (per-rank batch ``micro_batch / dp``, tp) where the cost model has one (aceso-compat: the profiled files),
    else everything. AcesoError when no candidate shape is covered."""
    available = getattr(cm, "available_shapes", None)
    allowed = available() if available is not None else None
    space = Space.of(cm.model, cm.cluster, training, allowed=allowed)
    if allowed is not None and space.mbs_list and not space.candidate_shapes() & allowed:
        raise AcesoError(f"--micro-batch-sizes {list(space.mbs_list)}: none of the stage shapes they allow is "
                         f"covered by the cost model (per-GPU batch, tp: {_pairs(space.candidate_shapes())}; "
                         f"covered: {_pairs(allowed)}); choose micro-batch sizes whose per-GPU batches it covers")
    return space


def dropped_shapes(space: Space) -> list[tuple[int, int]]:
    """The candidate (per-rank batch, tp) pairs the cost model does not cover (the search skips them)."""
    return [] if space.allowed is None else sorted(space.candidate_shapes() - space.allowed)


def _pairs(pairs) -> str:
    return ", ".join(f"({b}, {t})" for b, t in sorted(pairs)) or "none"


def describe_dropped(space: Space) -> str | None:
    """One line naming the dropped shapes, or None."""
    dropped = dropped_shapes(space)
    if not dropped:
        return None
    kept = len(space.candidate_shapes()) - len(dropped)
    return (f"(per-GPU batch, tp) {_pairs(dropped)} not profiled in the cost model's database: plans use only "
            f"the other {kept} candidate shapes")


def plan_search(cm, training, opts: SearchOptions, top_k: int = 1,
                baseline: BaselineResult | None = None) -> tuple[SearchResult, Space]:
    """The search, started also from the uniform baseline (so it never returns a worse plan than it)."""
    space = search_space(cm, training)
    if not space.mbs_list:
        raise AcesoError(f"--micro-batch-sizes: none divides --global-batch-size ({training.global_batch_size})")
    if baseline is not None:
        opts.seeds = list(opts.seeds) + [baseline_state(baseline)]
    return search(cm, training.global_batch_size, space, opts, top_k), space


def baseline_state(b: BaselineResult) -> State:
    return State(b.mbs, ((b.tp, b.dp),) * b.pp, tuple(b.bounds))


def plan_baseline(cm, training) -> BaselineResult | None:
    space = search_space(cm, training)
    return best_uniform(cm, training.global_batch_size, space, cm.model)
