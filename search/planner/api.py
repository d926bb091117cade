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


def plan_search(cm, training, opts: SearchOptions, top_k: int = 1,
                baseline: BaselineResult | None = None) -> tuple[SearchResult, Space]:
    """The search, started also from the uniform baseline (so it never returns a worse plan than it)."""
    space = Space.of(cm.model, cm.cluster, training)
    if not space.mbs_list:
        raise AcesoError(f"--micro-batch-sizes: none divides --global-batch-size ({training.global_batch_size})")
    if baseline is not None:
        opts.seeds = list(opts.seeds) + [baseline_state(baseline)]
    return search(cm, training.global_batch_size, space, opts, top_k), space


def baseline_state(b: BaselineResult) -> State:
    return State(b.mbs, ((b.tp, b.dp),) * b.pp, tuple(b.bounds))


def plan_baseline(cm, training) -> BaselineResult | None:
    space = Space.of(cm.model, cm.cluster, training)
    return best_uniform(cm, training.global_batch_size, space, cm.model)
