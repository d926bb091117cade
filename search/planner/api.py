"""One-call entry points used by ``aceso search``, ``aceso baseline`` and the bench.

``plan_all`` runs the three searches every report shows, each seeded with the one before so the chain never gets
worse: the best uniform Megatron configuration (``baseline``), the best plan Megatron-LM can express
(``--target megatron-lm``: uniform shapes, layer cuts, Megatron's recompute settings; seeded with the uniform
one), the Megatron-LM plans' cuts moved to any unit as Megatron-LM's hybrid layer pattern runs them
(``hybrid_cuts.py``), and the best heterogeneous plan for the aceso runtime (seeded with the uniform and
Megatron-LM plans, never slower than those or the pattern's; not run where the runtime runs no plan of the model,
``capabilities.model_refusal``: the line says why). The search of ``target`` gets the whole
evaluation budget, the other one a quarter (``SECONDARY_SHARE``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from search.io.errors import AcesoError
from .aceso import SearchOptions, SearchResult, search
from .baseline import BaselineResult, best_uniform
from .space import Space
from .state import State

SECONDARY_SHARE = 0.25


def make_space(cm, training, target: str = "aceso", moe=None) -> Space:
    """The search space for this cost model and training spec: what the model prices (``cm.features``) and the
    (per-rank batch, tp) pairs it covers (``cm.available_shapes()`` where it has one, e.g. aceso-compat's profiled
    files; else all) and, for an MoE model, the expert shapes it prices (``expert_shapes()`` of its source where
    it has one: the profile model's measured moe rows; else all). AcesoError when no candidate micro-batch or shape
    is left."""
    available = getattr(cm, "available_shapes", None)
    allowed = available() if available is not None else None
    measured = getattr(getattr(cm, "source", None), "expert_shapes", None)
    space = Space.of(cm.model, cm.cluster, training, priced=getattr(cm, "features", frozenset()), target=target,
                     allowed=allowed, moe=moe, expert_shapes=measured() if measured is not None else None,
                     sync_p2p=getattr(cm, "sync_p2p", False))
    if not space.batches:
        raise AcesoError(f"--micro-batch-sizes: none divides --global-batch-size ({training.global_batch_size})")
    if allowed is not None and not space.candidate_shapes() & space.allowed:
        raise AcesoError(f"--micro-batch-sizes {list(space.batches)}: none of the stage shapes they allow is "
                         f"covered by the cost model (per-GPU batch, tp: {_pairs(space.candidate_shapes())}; "
                         f"covered: {_pairs(space.allowed)}); choose micro-batch sizes whose per-GPU batches it covers")
    return space


search_space = make_space


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


def plan_search(cm, training, opts: SearchOptions, top_k: int = 1, baseline: BaselineResult | None = None,
                target: str = "aceso", seeds: list[State] | None = None) -> tuple[SearchResult, Space]:
    """One search, started also from the uniform baseline (so it never returns a worse plan than it), settled: run
    again under the MoE setting its final step chose, seeded with its best plan (``settle.py``)."""
    from .settle import settle
    space = make_space(cm, training, target)
    opts = copy.copy(opts)
    opts.seeds = list(opts.seeds) + ([baseline.state] if baseline is not None and baseline.fits else []) + \
        list(seeds or [])
    return settle(cm, training, target, opts, top_k, space=space)[0], space


def plan_baseline(cm, training, runs: str = "megatron-lm", space_target: str = "megatron-lm") -> BaselineResult | None:
    """The best uniform Megatron-LM configuration; ``runs``: the target that runs it (``best_uniform``);
    ``space_target``: ``megatron-bridge`` keeps to what Megatron-Bridge also runs."""
    space = make_space(cm, training, space_target)
    return best_uniform(cm, training.global_batch_size, space, cm.model, runs)


@dataclass
class Plans:
    """The three lines of every search report (``None``: nothing fits there)."""

    target: str
    uniform: BaselineResult | None
    megatron: SearchResult
    aceso: SearchResult
    space: Space
    not_offered: dict[str, str] = field(default_factory=dict)   # line -> why its target runs no plan of the model
    pattern: object = None      # the Megatron-LM plans cut at any unit, as a hybrid pattern (hybrid_cuts.py)
    runtime_space: Space | None = None   # the heterogeneous search's space (what the aceso runtime runs)

    @property
    def main(self) -> SearchResult:
        return self.megatron if self.target == "megatron-lm" else self.aceso

    @property
    def drop_in(self) -> str:
        """The framework the uniform and Megatron-LM lines run on: ``megatron-bridge`` for a Bridge search (the
        Megatron-LM space, each plan passing Bridge's rules and priced as Bridge runs it), else ``megatron-lm``."""
        return "megatron-bridge" if self.space.evaluator_target == "megatron-bridge" else "megatron-lm"


def runtime_training(training, strict: bool = True):
    """The training spec for a runtime search: Megatron FSDP and CPU activation offload off (the heterogeneous
    search prices DDP / the distributed optimizer; the aceso runtime keeps activations on the GPU); ``strict``:
    refuse them asked for."""
    from search.targets.runtime_rules import RUNTIME_NO_OFFLOAD
    why = {"megatron_fsdp": ("--megatron-fsdp", "the heterogeneous search prices DDP and the distributed optimizer "
                             "only (the aceso runtime runs a Megatron FSDP plan given to it: aceso validate says "
                             "which)"),
           "activation_offload": ("--activation-offload", RUNTIME_NO_OFFLOAD)}
    for name, (flag, reason) in why.items():
        if strict and getattr(training, name):
            raise AcesoError(f"{flag} on: {reason}; search with --target megatron-lm, or turn it off")
    return training.model_copy(update={"megatron_fsdp": False, "activation_offload": False})


def runtime_lacks(e) -> list[str]:
    """What of an evaluation's plan the aceso runtime does not run (empty: it runs it as it is): Megatron FSDP,
    activation offload, the stack switches (CUDA graphs, fine-grained offload, the cross-entropy fusion), the MoE
    EP overlap (search/targets/runtime_rules.py refuses each in a plan)."""
    f, sk = e.state.features, e.state.features.stack
    out = [name for name, on in (("Megatron FSDP", f.fsdp), ("CPU activation offload", f.offload_layers),
                                 ("CUDA graphs", sk is not None and sk.graphs),
                                 ("fine-grained activation offload", sk is not None and sk.offload_modules),
                                 ("the cross-entropy fusion", sk is not None and sk.ce_fusion),
                                 ("the EP overlap", getattr(e.moe, "overlap_ep_comm", False))) if on]
    return out or (["its stack settings"] if sk is not None else [])


def runs_elsewhere(e) -> bool:
    """An evaluation whose plan the aceso runtime does not run as it is (``runtime_lacks``): not a seed of its
    search as it is, and never its line."""
    return bool(runtime_lacks(e))


FRAMEWORK_NAMES = {"megatron-lm": "Megatron-LM", "megatron-bridge": "Megatron-Bridge"}
# how to get and run the drop-in line's plan: a Bridge search writes it already (-o), an aceso search names the target
_RUN_DROP_IN = {"megatron-lm": "--target megatron-lm, aceso export",
                "megatron-bridge": "the plan this search writes, aceso export --to megatron-bridge"}


def slower_note(plans) -> str | None:
    """Why the heterogeneous line is slower than the Megatron-LM line (None when it is not): the Megatron-LM plan
    uses what the aceso runtime does not run; the heterogeneous search started from it as the runtime runs it.
    Worded for the framework that line runs on (``Plans.drop_in``: Megatron-Bridge for a Bridge search)."""
    het, mlm = (p.plans[0] if p.plans and p.plans[0].fits else None for p in (plans.aceso, plans.megatron))
    if het is None or mlm is None or het.iteration_ms <= mlm.iteration_ms or plans.aceso is plans.megatron:
        return None
    lacks = runtime_lacks(mlm)
    space = plans.runtime_space      # what the heterogeneous search could start from (its seeds' check, plan_all)
    outside = space.refusal(runtime_state(mlm.state)) if space is not None and not lacks else None
    why = f"it uses {_and(lacks)}, which the aceso runtime does not run" if lacks else \
        f"the aceso runtime does not run its {outside}" if outside else "the aceso runtime prices it slower"
    name = FRAMEWORK_NAMES[plans.drop_in]
    return (f"the heterogeneous plan is slower than the {name} plan ({het.iteration_ms:.2f} vs "
            f"{mlm.iteration_ms:.2f} ms): {why}; run the {name} plan with {name} ({_RUN_DROP_IN[plans.drop_in]})")


def _and(words: list[str]) -> str:
    return " and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]


def runtime_state(state):
    """``state`` with the switches the aceso runtime runs (``runs_elsewhere``): Megatron FSDP, activation offload
    and the stack switches off (the parameter gather with them unless the distributed optimizer runs it); the EP
    overlap is the MoE settings', which the heterogeneous search prices without."""
    f = state.features
    return state._replace(features=f._replace(fsdp="", offload_layers=0, stack=None,
                                              overlap_param_gather=f.overlap_param_gather and f.distributed_optimizer))


def plan_all(cm, training, opts: SearchOptions, top_k: int = 1, target: str = "aceso",
             release: str | None = None) -> Plans:
    """Uniform baseline, then the Megatron-LM search, then the heterogeneous search (see the module docstring);
    the Megatron-LM line's cuts also at any unit as a hybrid pattern (``hybrid_cuts.py``; ``release``: the
    ``--release`` whose Megatron-LM runs it, None: the newest)."""
    mlm_space = target if target == "megatron-bridge" else "megatron-lm"   # Bridge: the Megatron-LM space, its rules
    target = "megatron-lm" if target == "megatron-bridge" else target
    if target != "megatron-lm":
        training = runtime_training(training)
    from search.targets.capabilities import model_refusal
    from search.settings.precision import of_training
    if (why := model_refusal(mlm_space, cm.model, of_training(training))) is not None:
        # Megatron-LM runs no plan of the model (setup refuses it as the target): its three lines are not offered
        # and the heterogeneous search runs alone, with the whole budget (no uniform plan priced as Megatron-LM's)
        het, aspace = plan_search(cm, runtime_training(training, strict=False), opts, top_k, None, "aceso")
        return Plans(target, None, SearchResult([], [], 0, 0.0, False, {}), het, aspace,
                     dict.fromkeys(("uniform", "megatron_lm", "megatron_lm_pattern"), why))
    base = plan_baseline(cm, training, space_target=mlm_space)
    fitting = base if base is not None and base.fits else None
    share = max(int(opts.budget_evals * SECONDARY_SHARE), 1)
    o1 = copy.copy(opts)
    o1.budget_evals = opts.budget_evals if target == "megatron-lm" else share
    mlm, space = plan_search(cm, training, o1, top_k if target == "megatron-lm" else 1, fitting, mlm_space)
    if fitting is not None:   # the uniform configuration is a Megatron-LM plan: line 2 never slower than line 1
        _never_worse(mlm, fitting.evaluation)
    pattern, why = _pattern_line(cm, training, space, [fitting.evaluation if fitting else None] + mlm.plans[:1],
                                 release)
    lines = {"pattern": pattern, "not_offered": {"megatron_lm_pattern": why} if why else {}}
    if mlm.interrupted:   # Ctrl-C: no second search; the Megatron-LM plan also runs on the aceso runtime
        return Plans(target, base, mlm, mlm, space, **lines)
    o2 = copy.copy(opts)
    o2.budget_evals = opts.budget_evals if target == "aceso" else share
    if opts.budget_s is not None:   # one wall-clock cap for both searches
        o2.budget_s = max(opts.budget_s - mlm.seconds, 0.0)
    if opts.callback is not None:   # one progress count over both searches
        o2.callback = lambda n, done=mlm.evals: opts.callback(done + n)
    why = model_refusal("aceso", cm.model, of_training(training), training.dtype, cm.cluster.gpu, training.optimizer,
                        getattr(getattr(cm, "settings", None), "precision_aware", None))
    if why is not None:   # the aceso runtime runs no plan of this model: no heterogeneous line (capabilities.py)
        return Plans(target, base, mlm, SearchResult([], [], 0, 0.0, False, {}), space,
                     {"aceso": why, **lines["not_offered"]}, pattern)
    # the Megatron-LM plan and its |-pattern form (one shape, unit cuts) also run on the aceso runtime, where its
    # space holds them (not a hybrid model's Mamba layers under context parallelism: runtime_rules.layers_cp)
    runs = [e for e in mlm.plans[:1] + [pattern] if e is not None and e.fits and not runs_elsewhere(e)]
    # the lines above as the runtime runs them (FSDP, offload, the stack switches and the EP overlap off) are seeds
    # too: a plan the runtime does not run as it is still gives the heterogeneous search its shapes and cuts
    moved = [runtime_state(e.state) for e in [fitting and fitting.evaluation] + mlm.plans[:1]
             if e is not None and e.fits and runs_elsewhere(e)]
    het, aspace = plan_search(cm, runtime_training(training, strict=False), o2, top_k if target == "aceso" else 1,
                              fitting if fitting is not None and not runs_elsewhere(fitting.evaluation) else None,
                              "aceso",
                              [e.state for e in runs] + moved)
    # the heterogeneous line is never slower than the Megatron-LM line (or its |-pattern form) as the runtime runs it
    from .state import Evaluator
    ev = Evaluator(cm, training.global_batch_size, None, "aceso", aspace.moe)
    for e in [e for e in runs if aspace.legal(e.state)] + [ev.evaluate(s, charge=False, exact=True) for s in moved
                                                         if aspace.legal(s)]:
        _never_worse(het, e)
    return Plans(target, base, mlm, het, aspace if target == "aceso" else space, **lines, runtime_space=aspace)


def _pattern_line(cm, training, space, seeds, release):
    """(the hybrid-pattern plan, None) or (None, why it is not offered): ``hybrid_cuts.refine`` of the uniform and
    Megatron-LM plans under the release's Megatron-LM."""
    from ..megatron.hybrid_pattern import release_for
    from .hybrid_cuts import refine
    from .state import Evaluator
    rel, why = release_for(release)
    if rel is None:
        return None, why
    return refine(Evaluator(cm, training.global_batch_size, None, "megatron-lm", space.moe), seeds, rel)


def total_budget(budget_evals: int) -> int:
    """Evaluations ``plan_all`` runs at most (for a progress bar)."""
    return budget_evals + max(int(budget_evals * SECONDARY_SHARE), 1)


def _never_worse(res: SearchResult, e) -> None:
    """``e`` (a fitting plan of a line above) also runs where ``res``'s plans run: put it first if it is faster
    (the uniform configuration is a Megatron-LM plan; a Megatron-LM plan also runs on the aceso runtime)."""
    if e.fits and (not res.plans or e.score < res.plans[0].score):
        res.plans.insert(0, e)
