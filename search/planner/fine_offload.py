"""Fine-grained activation offload as a search choice (``--target megatron-lm`` / ``megatron-bridge``).

megatron-core's ``--fine-grained-activation-offloading --offload-modules M ...`` (``StackSettings.offload``, priced by
``costmodel/stack_cost.py`` and ``costmodel/offload.py``) is one plan-wide setting, so it is chosen as the CUDA-graph
scopes are (``dispatchers.py``): the final step prices each finalist also under a few offload variants
(``variants``), the evaluator re-choosing recompute for each (``megatron_lm.best_setting``: an offloaded stage may
then fit with less or no recompute, which is where it wins), and keeps the fastest fitting one. ``settle`` runs its
searches without it and then, where memory binds on their best plan (``binds``), ``settle_round`` searches again
with the offload on every state, from that plan, so that shapes which fit only with it (a smaller tp, a larger
micro-batch) are reached; that search's final step prices the variants. The aceso runtime never gets it
(``api.runtime_state`` strips the stack switches; ``runs_elsewhere``).

What is offered, and megatron-core's rules it keeps (``offered``, ``variants``, ``recompute_ok``):

- the release: megatron-core 0.16.0 is the first with the offload (``TransformerConfig.fine_grained_activation_
  offloading``: absent from core_v0.14.0 and core_v0.15.0-0.15.3, present in core_v0.16.0); a plan priced at an
  older release (e.g. 25.04 / 0.14) is never offered it (``OFFLOAD_SINCE``); ``--activation-offload-fraction`` is
  0.19's (core_v0.19.0 transformer_config.py ``activation_offload_fraction``; not in the 0.16.1-0.18.2 parsers):
  fractions below 1 only from there (``FRACTION_SINCE``), the earliest groups first;
- the modules (``module_sets``): the attention core's inputs (``core_attn attn_proj``: Q, K, V and the core's
  output; ``attn_proj`` only with ``core_attn``, megatron-core raises otherwise) on a model whose layer kinds offload
  them (``offload_inputs`` in ``search/layers/``), the routed experts' (``expert_fc1 moe_act``) on an MoE model
  without paged stashing (``stack.refusal``), and both. Not the norms nor ``qkv_linear``: megatron-core's TE specs
  fuse the pre-attention and the dense pre-MLP norms into the next linear (``TELayerNormColumnParallelLinear``; the
  norm is an ``IdentityOp``, whose offload megatron-core skips: ``stack_cost.moves`` prices them so);
- recompute (``recompute_ok``): not with full recompute (its checkpointed forward saves no module input to offload:
  the layer keeps only its input), nor ``core_attn`` offloaded with ``core_attn`` recomputed (megatron-core 0.16.1
  attention.py offloads the core's input only on the path that does not checkpoint it): the cost model prices both
  as moving nothing (``stack_cost.moves``), so the search does not spend evaluations on them; ``moe_act`` offloaded
  with ``moe_act`` recomputed is megatron-core's documented combination (experts.py offloads fc1's output either
  way);
- CPU offloading (``cpu_offloading``): never with it (``stack.refusal``);
- CUDA graphs: 0.16 and 0.17 state no rule for the two together and NVIDIA documents the combination from 0.18 on
  (megatron-core's own rules: ``stack.offload_graphs_refusal``, which ``graphs_ok`` applies first; the feature guide
  asks more: the scope must hold ``attn`` and ``moe_router``, no norm offloaded), so: no graphs before 0.18, and
  from 0.18 transformer-engine graphs of a scope holding ``attn`` and ``moe_router`` without ``moe`` (``graphs_ok``).
"""

from __future__ import annotations

import dataclasses

from ..costmodel.types import StackKey
from search.settings.stack import OFFLOAD_GRAPHS_SINCE, offload_graphs_refusal

OFFLOAD_SINCE = (0, 16)         # the first megatron-core with fine-grained activation offload
GRAPHS_SINCE = OFFLOAD_GRAPHS_SINCE     # the first that states how it runs under CUDA graphs
FRACTION_SINCE = (0, 19)        # --activation-offload-fraction
FRACTIONS = (0.5, 1.0)          # offered from FRACTION_SINCE (before: 1 only)
ATTENTION = ("core_attn", "attn_proj")
EXPERTS = ("expert_fc1", "moe_act")


def offered(cm, target: str) -> bool:
    """Whether the search offers the offload: the Megatron-LM / Bridge target (the aceso runtime runs none), the
    analytic model (the only one that prices the stack switches), a release that has it (on a hybrid model 0.18:
    ``hybrid_pattern.OFFLOAD_SINCE``), and transformer-engine's
    layers (Megatron-LM asserts ``--transformer-impl transformer_engine`` with it: ``stack_flags.OFFLOAD_NEEDS_TE``;
    a search priced with unfused attention exports ``local``)."""
    from search.megatron.hybrid_pattern import OFFLOAD_SINCE as HYBRID_SINCE, runs_as_pattern
    from .dispatchers import core_of
    from .report import assumed_attention
    since = HYBRID_SINCE if runs_as_pattern(cm.model) else OFFLOAD_SINCE    # MambaModel before 0.18: a no-op
    return target == "megatron-lm" and getattr(cm, "kind", "analytic") == "analytic" and \
        core_of(cm) >= since and assumed_attention(cm) != "unfused"


def module_sets(model, moe=None) -> list[tuple[str, ...]]:
    """The module sets offered for ``model`` (module docstring); ``moe``: the plan's MoE settings."""
    from ..costmodel.stack_cost import offload_input_bytes
    kinds = {u.kind for u in model.units}

    def moves(module: str) -> bool:
        return any(offload_input_bytes(model, k, module, 1, 1, 1, False, 2) > 0 for k in kinds)
    att = [("core_attn",), ATTENTION] if moves("core_attn") else []
    exp = [("expert_fc1",), ("moe_act",), EXPERTS] \
        if model.moe is not None and not getattr(moe, "paged_stash", False) and moves("expert_fc1") else []
    return att + exp + ([ATTENTION + EXPERTS] if att and exp else [])


def candidates(cm, target: str, moe=None) -> list[tuple[tuple[str, ...], float]]:
    """(modules, fraction) pairs to price a finalist under (empty where not ``offered``)."""
    from .dispatchers import core_of
    if not offered(cm, target):
        return []
    fractions = FRACTIONS if core_of(cm) >= FRACTION_SINCE else (1.0,)
    return [(m, f) for m in module_sets(cm.model, moe) for f in fractions]


def graphs_ok(sk: StackKey | None, core: tuple[int, int]) -> bool:
    """Whether the offload in ``sk`` may run with its CUDA graphs at megatron-core ``core`` (module docstring):
    megatron-core's rules (``stack.offload_graphs_refusal``), then the feature guide's."""
    if sk is None or not sk.offload_modules or not sk.graphs:
        return True
    scope = () if "layer" in sk.graphs else tuple(sorted(sk.graphs))      # StackKey: whole layers hold "layer"
    if offload_graphs_refusal(sk.graph_impl, scope, sk.offload_modules, core) is not None:
        return False
    return core >= GRAPHS_SINCE and sk.graph_impl == "transformer_engine" and {"attn", "moe_router"} <= sk.graphs \
        and "layer" not in sk.graphs


def variants(features, cands, core: tuple[int, int]):
    """The stack keys ``features``' state is priced under with the offload: its own stack with each candidate, where
    it has no offload of its own (a user's or published setting is kept) nor CPU offloading."""
    own = features.stack or StackKey()
    if own.offload_modules or features.offload_layers:
        return
    for modules, fraction in cands:
        sk = own._replace(offload_modules=modules, offload_fraction=fraction)
        if graphs_ok(sk, core):
            yield sk


def recompute_ok(setting, sk: StackKey | None) -> bool:
    """Whether a Megatron-LM recompute setting runs with the offload in ``sk`` as priced (module docstring)."""
    if sk is None or not sk.offload_modules:
        return True
    if setting.granularity == "full":
        return False
    return not ("core_attn" in sk.offload_modules and "core_attn" in (setting.modules or ()))


PROBES = ("tp_to_dp", "inc_mbs")    # the moves that need memory: where one fits only offloaded, memory binds
ROUND_SHARE = 0.25                  # the offload round's evaluations, of the search's (it starts from the best plan)


def settle_round(cm, training, target: str, opts, top_k: int, plans: list, make_space, search, seeded, merge):
    """(plans, result or None, log line or None): where memory binds on the best plan (``binds``), the search again
    with the offload on every state (the final step's choice, else the largest set at fraction 1), seeded with that
    plan, with ``ROUND_SHARE`` of the budget, so that the states which fit only with it are reached; its plans are
    then priced under each other candidate and without (``lighter``). ``settle``'s helpers are passed in."""
    from .dispatchers import core_of
    best = next((e for e in plans if e.fits), None)
    if best is None or best.state.features.offload_layers:
        return plans, None, None
    space = make_space(cm, training, target, moe=best.moe)
    cands = candidates(cm, space.target, best.moe)          # a Bridge search's space: target megatron-lm
    if not cands:
        return plans, None, None
    own = best.state.features.stack or StackKey()
    if any(f.stack is not None and f.stack.offload_modules for f in space.features):
        return plans, None, None                # the user's own offload: kept
    gbs, core = training.global_batch_size, core_of(cm)
    if not own.offload_modules:
        own = own._replace(offload_modules=cands[-1][0], offload_fraction=1.0)
        if not graphs_ok(own, core) or not binds(cm, gbs, space, best, own):
            return plans, None, None
    off = {"offload_modules": own.offload_modules, "offload_fraction": own.offload_fraction}
    # the states without stack switches of their own take the best plan's (its graphs, its loss fusion) with the offload
    space = dataclasses.replace(space, features=tuple(f._replace(stack=(f.stack or own)._replace(**off))
                                                      for f in space.features))
    o = seeded(opts, best)
    o.budget_evals = max(int(opts.budget_evals * ROUND_SHARE), 1)
    r = search(cm, gbs, space, o, top_k)
    found = [lighter(cm, gbs, space, e, cands, core) if e.fits else e for e in r.plans]
    b = next((e for e in found if e.fits), None)
    text = "nothing fits" if b is None else f"{b.iteration_ms:.1f} ms"
    return merge(plans, found), r, f"again with offload {' '.join(own.offload_modules)} from the best plan: {text}"


def binds(cm, gbs: int, space, best, sk: StackKey) -> bool:
    """Whether memory binds on ``best``: it recomputes, or a move that needs memory (``PROBES``: fewer TP ranks, a
    larger micro-batch) gives a faster plan that fits with the offload ``sk``, priced so (a few evaluations)."""
    if getattr(best.setting, "granularity", None) is not None:
        return True
    from .primitives import APPLY, Ctx
    from .state import Evaluator
    ev = Evaluator(cm, gbs, None, space.evaluator_target, space.moe)
    ctx = Ctx(space, ev)
    for name in PROBES:
        for st in APPLY[name](ctx, best, 0):
            c = ev.evaluate(st._replace(features=st.features._replace(stack=sk)), charge=False, exact=True)
            if c.fits and c.score < best.score:
                return True
    return False


def lighter(cm, gbs: int, space, e, cands, core):
    """``e`` or its state under another offload candidate, or none, where that is faster and fits, or as fast with
    less offloaded (the offload round's plans carry the largest set; a smaller one may fit too and copy less)."""
    from .megatron_lm import expressible
    from .state import Evaluator
    ev = Evaluator(cm, gbs, None, space.evaluator_target, space.moe)
    f = e.state.features

    def key(x):     # faster, then (at a tie: the copies hidden) fewer modules and a smaller fraction offloaded
        sk = x.state.features.stack or StackKey()
        return x.score, len(sk.offload_modules), sk.offload_fraction

    best = e
    for modules, fraction in [((), 0.0)] + list(cands):
        sk = (f.stack or StackKey())._replace(offload_modules=modules, offload_fraction=fraction)
        if sk == f.stack or not graphs_ok(sk, core):
            continue
        stack = None if sk == StackKey() else sk
        c = ev.evaluate(e.state._replace(features=f._replace(stack=stack)), charge=False, exact=True)
        if c.fits and key(c) < key(best) and expressible(ev, c):
            best = c
    return best
