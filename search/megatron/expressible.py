"""Can stock Megatron-LM (core_v0.16.1) run this plan exactly? ``check_expressible(plan)`` and ``megatron_config``.

``check_expressible(plan: ParallelPlan) -> str | None`` is the stable entry point (the planner's ``--target
megatron-lm`` calls it): ``None`` when ``aceso export --to megatron-lm`` can write the plan, else one line naming the
stage and field and ending with what to do. It is pure (no I/O) and cheap (linear in the units).

A plan is expressible when
- every stage has the same ``tp``, ``cp``, ``dp`` and ``sequence_parallel`` (Megatron-LM has one shape), and the
  same expert shape ``ep`` / ``etp`` (one expert folding; ``etp`` None and ``etp == tp`` are the same folding);
- every (virtual) stage boundary falls between two layers (not between the attention and MLP halves);
- its recompute choices are one of Megatron-LM's settings (``recompute.py`` has the table);
- T5: one pipeline stage and as many decoder as encoder layers (``pretrain_t5.py`` at core_v0.16.1 raises for
  pipeline parallelism and builds ``--num-layers`` decoder layers), and with RoPE the default base and no scaling
  (``t5_rope_refusal``: ``T5Model`` takes neither);
- ``overlap_param_gather`` comes with ``overlap_grad_reduce`` (``validate_args`` asserts it);
- the padded vocabulary is one Megatron-LM pads to (a multiple of ``--make-vocab-size-divisible-by`` x tp), the
  RoPE base an integer (``--rotary-base`` is an int), the RoPE scaling one its flags carry (``arch_flags``), and
  tp_comm_overlap not with the local (non-TE) layers.
Layer counts per stage are always expressible (``--pipeline-model-parallel-layout`` takes any split).
"""

from __future__ import annotations

from search.spec.plan import ParallelPlan
from search.settings.moe_plan import expert_tp, moe_settings
from search.settings.plan_settings import sync_p2p_refused
from . import arch_flags
from .config import HINT, MegatronConfig, NotExpressible, Recompute, layer_bounds, layer_name, num_layers
from .recompute import recompute_of
from .stack_flags import OFFLOAD_NEEDS_TE

SHAPE_FIELDS = ("tp", "cp", "dp", "sequence_parallel")
FOLDING = ("Megatron-LM has one expert folding for all stages; run the plan on the aceso runtime, or search again with "
           "--target megatron-lm (one folding)")


def check_expressible(plan: ParallelPlan) -> str | None:
    """``None`` if Megatron-LM can run ``plan`` exactly, else one line: stage, field, and the way out. A model with
    Mamba-2 layers runs only as a hybrid-pattern run (``aceso export --hybrid-pattern``, ``hybrid_pattern.py``),
    whose ``|`` segments carry its VPP and uneven cuts (megatron-core splits a pattern without them evenly and
    runs no VPP: ``search.layers.hybrid.pipeline_refusal``)."""
    try:
        from .hybrid_pattern import hybrid_form, runs_as_pattern
        if runs_as_pattern(plan.model):
            hybrid_form(plan)
        else:
            megatron_config(plan)
    except NotExpressible as e:
        return str(e)
    return None


def megatron_config(plan: ParallelPlan, chunk_layers: tuple[int, ...] | None = None,
                    recompute: Recompute | None = None) -> MegatronConfig:
    """The plan in Megatron-LM's terms; ``NotExpressible`` (an ``AcesoError``, exit 2) when it has none.
    ``chunk_layers`` / ``recompute``: the split and setting of another layer form, already checked (the hybrid
    pattern's, ``hybrid_pattern.py``), instead of whole GPT layers'."""
    from .hybrid_pattern import runs_as_pattern
    if runs_as_pattern(plan.model) and chunk_layers is None:
        raise NotExpressible(f"model.mamba: {plan.model.name} has Mamba-2 layers, which pretrain_gpt.py does not "
                             "build; export the plan with --hybrid-pattern (pretrain_hybrid.py --hybrid-layer-pattern "
                             "with '|' stage cuts)")
    if (why := t5_rope_refusal(plan.model)) is not None:
        raise NotExpressible(why)          # the model's own field: no other plan shape or target helps
    try:
        _check_shapes(plan)
        _check_folding(plan)
        _check_t5(plan)
        chunk_layers = _chunk_layers(plan) if chunk_layers is None else chunk_layers
        rc = recompute_of(plan) if recompute is None else recompute
        _check_features(plan)
        if "moe_act" in rc.modules and not moe_settings(plan).grouped_gemm:
            raise NotExpressible("selective recompute of moe units (--recompute-modules moe_act) with grouped_gemm "
                                 "off: megatron-core supports moe_act with --moe-grouped-gemm only")
    except NotExpressible as e:
        raise NotExpressible(str(e) if str(e).endswith(FOLDING) else f"{e}; {HINT}") from None
    st = plan.stages[0]
    attention = plan.predicted.attention if plan.predicted else None
    return MegatronConfig(
        model=plan.model, tp=st.tp, pp=plan.num_stages, cp=st.cp, dp=st.dp, vpp=plan.num_virtual_stages,
        sequence_parallel=st.sequence_parallel, chunk_layers=chunk_layers, recompute=rc,
        micro_batch_size=plan.micro_batch_per_rank(0), global_batch_size=plan.global_batch_size, attention=attention,
        ep=st.ep, etp=st.etp, settings=plan.settings.model_copy(update={"moe": moe_settings(plan)}))


def _check_shapes(plan: ParallelPlan) -> None:
    first = plan.stages[0]
    for i, st in enumerate(plan.stages[1:], start=1):
        for f in SHAPE_FIELDS:
            if getattr(st, f) != getattr(first, f):
                what = {"tp": "tensor-parallel size", "cp": "context-parallel size", "dp": "data-parallel size",
                        "sequence_parallel": "sequence-parallel setting"}[f]
                raise NotExpressible(f"stages[{i}].{f} ({getattr(st, f)}) differs from stages[0].{f} "
                                     f"({getattr(first, f)}): Megatron-LM runs one {what} on every pipeline stage")



def _check_folding(plan: ParallelPlan) -> None:
    if plan.model.moe is None:
        return
    first = plan.stages[0]
    for i, st in enumerate(plan.stages[1:], start=1):
        if (st.ep, expert_tp(st)) != (first.ep, expert_tp(first)):
            raise NotExpressible(f"stages[{i}] has the expert shape ep {st.ep} etp {expert_tp(st)}, stages[0] ep "
                                 f"{first.ep} etp {expert_tp(first)}: {FOLDING}")


def _check_t5(plan: ParallelPlan) -> None:
    m = plan.model
    if not m.is_t5:
        return
    if plan.num_stages > 1:
        raise NotExpressible(f"stages: {plan.num_stages} pipeline stages, but Megatron-LM's pretrain_t5.py "
                             "(core_v0.16.1) does not support pipeline parallelism for T5")
    if m.num_decoder_layers != m.num_layers:
        raise NotExpressible(f"model.num_decoder_layers ({m.num_decoder_layers}) differs from num_layers "
                             f"({m.num_layers}): Megatron-LM's pretrain_t5.py builds --num-layers decoder layers, as "
                             "many as encoder layers")


T5_ROTARY_BASE = 10000.0      # megatron-core RotaryEmbedding's default rotary_base (0.16.1 to 0.19.2)


def t5_rope_refusal(model) -> str | None:
    """Why Megatron-LM would train another T5 than ``model`` (None: it trains this one). ``pretrain_t5.py``
    (core_v0.16.1 to core_v0.19.0, ``examples/t5/`` from 0.18) builds ``T5Model(..., position_embedding_type=,
    rotary_percent=)``, and ``T5Model.__init__`` (megatron-core 0.16.1 to 0.19.2) takes no rotary base and no RoPE
    scaling: its ``RotaryEmbedding`` runs the default base 10000, unscaled, whatever --rotary-base, --use-rope-scaling
    or --position-embedding-type yarn say (rotary_percent it passes on)."""
    if not model.is_t5 or model.position_embedding != "rope":
        return None
    if model.rope_scaling is not None:
        return (f"model.rope_scaling ({model.rope_scaling.type}) with T5: Megatron-LM's pretrain_t5.py builds T5Model, "
                "which takes no RoPE scaling (it would train unscaled RoPE); remove model.rope_scaling")
    if model.rotary_base != T5_ROTARY_BASE:
        return (f"model.rotary_base ({model.rotary_base:g}) with T5: Megatron-LM's pretrain_t5.py builds T5Model, "
                f"whose RoPE runs the default base {T5_ROTARY_BASE:g} and ignores --rotary-base; set model.rotary_base "
                f"{T5_ROTARY_BASE:g}")
    return None


def _chunk_layers(plan: ParallelPlan) -> tuple[int, ...]:
    m = plan.model
    index = {u: i for i, u in enumerate(layer_bounds(m))}
    firsts = []
    for s, j, ch in plan.chunks_in_order():
        if ch.start_unit not in index:
            where = plan.chunk_where(s, j)
            prev, unit = m.units[ch.start_unit - 1], m.units[ch.start_unit]
            raise NotExpressible(
                f"{where}.start_unit ({ch.start_unit}) cuts {layer_name(m, unit)} between its "
                f"{prev.kind.replace('_', '-')} and {unit.kind.replace('_', '-')} units: Megatron-LM places whole "
                "layers on a pipeline stage")
        firsts.append(index[ch.start_unit])
    bounds = firsts + [num_layers(m)]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def _check_features(plan: ParallelPlan) -> None:
    m, tp = plan.model, plan.stages[0].tp
    if plan.overlap_param_gather and not plan.overlap_grad_reduce:
        raise NotExpressible("overlap_param_gather is on but overlap_grad_reduce is off: Megatron-LM's "
                             "--overlap-param-gather requires --overlap-grad-reduce")
    low, s = plan.settings.low_precision, plan.settings
    if low is not None and low.param_gather and not s.distributed_optimizer and s.megatron_fsdp is None:
        # core_v0.16.1 to core_v0.19.0 validate_args: "--fp8-param-gather only supported with distributed optimizer,
        # torch fsdp2, megatron fsdp, or inference mode" (the import refuses such a line too)
        raise NotExpressible("settings.low_precision.param_gather needs settings.distributed_optimizer or "
                             "megatron_fsdp: Megatron-LM's validate_args asserts it; turn one on")
    if sync_p2p_refused(s.overlap_p2p_comm, plan.num_stages, plan.num_virtual_stages):
        raise NotExpressible(f"settings.overlap_p2p_comm false with virtual stages on {plan.num_stages} pipeline "
                             "stages: Megatron-LM's --no-overlap-p2p-communication asserts pp > 2 with them; use "
                             "more stages, one model chunk per stage, or the overlap")
    if m.make_vocab_size_divisible_by % tp and m.padded_vocab_size % tp:
        raise NotExpressible(
            f"model.make_vocab_size_divisible_by ({m.make_vocab_size_divisible_by}): Megatron-LM pads the "
            f"vocabulary to a multiple of --make-vocab-size-divisible-by x tp ({tp}), and the plan's padded "
            f"vocabulary ({m.padded_vocab_size}) is not a multiple of tp")
    if arch_flags.refusal(m):
        raise NotExpressible(arch_flags.refusal(m))
    if m.position_embedding == "rope" and m.rotary_base != int(m.rotary_base):
        raise NotExpressible(f"model.rotary_base ({m.rotary_base}) is not an integer: Megatron-LM's --rotary-base "
                             "takes an integer")
    attention = plan.predicted.attention if plan.predicted else None
    if plan.stack is not None and plan.stack.offload is not None and attention == "unfused":
        raise NotExpressible("settings.stack.offload with megatron-core's local layers (predicted.attention unfused): "
                             + OFFLOAD_NEEDS_TE)
    if plan.tp_comm_overlap and attention == "unfused":
        raise NotExpressible("tp_comm_overlap is on but the plan was priced for megatron-core's local layers "
                             "(predicted.attention unfused): --tp-comm-overlap needs transformer-engine")
