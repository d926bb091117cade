"""What each target runs: one table of feature x target -> refusal (issue 32; the seed of issue 35's capability
table, read by the search space, validate, launch's pre-flight and the messages).

A target is who runs the plan (``plan_settings.FRAMEWORKS``): ``runtime`` (the aceso runtime on megatron-core:
``search --target aceso``, ``aceso launch``), ``megatron-lm`` or ``megatron-bridge``. Each row names a feature and,
for each target that cannot run it, the rule that says why in one line (the field and the fix); a target the row
does not name runs the feature. A target's limits apply to that target only: the aceso runtime's (no FP8 yet, no
LatentMoE) never stop a ``--target megatron-lm`` search, and Megatron-LM's one
shape never stops the heterogeneous one.

Three scopes:

- ``model``: the model and the low-precision recipe decide, before any search (``model_refusal``): ``search`` and
  ``baseline`` refuse that target in one line, and ``explain`` offers no line for it;
- ``precision``: the training dtype on the plan's GPU decides, as early (``model_refusal`` with ``dtype`` and
  ``gpu``; a plan's own dtype and GPU in ``plan_refusal``);
- ``plan``: the plan and the device it runs on decide (``plan_refusal``, which also asks the model rows): the one
  pre-flight (``search.targets.preflight``: validate, the search's output check, launch) asks them.

``Device``: what is known of the machine the plan runs on: ``cuda`` (False for a ``*-cpu`` cluster or ``launch
--cpu``) and ``te`` (transformer-engine importable; never on CPU; on a GPU only known on that machine, else None,
and a rule that needs it does not refuse). What only the running machine, torch or megatron-core can tell (layer
specs, transformer-engine's version, einops) is the runtime's own half of the pre-flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from search.targets import runtime_rules as rt
from search.layers.layer_variants import offset_blocks_cp
from search.settings.plan_settings import FRAMEWORKS, TARGET_NAMES
from search.settings.precision import check_bf16_layers

RUNTIME, MEGATRON_LM, BRIDGE = FRAMEWORKS


@dataclass(frozen=True)
class Device:
    """What is known of the machine a plan runs on (module docstring)."""

    cuda: bool = True
    te: bool | None = None

    @classmethod
    def of(cls, name: str) -> Device:
        """``cpu``: no CUDA, no transformer-engine; ``cuda``: a GPU whose software is not known here."""
        return cls(cuda=False, te=False) if name == "cpu" else cls(cuda=True, te=None)


Rule = Callable[..., "str | None"]


@dataclass(frozen=True)
class Row:
    feature: str
    scope: str                                          # "model" | "precision" | "plan"
    refuse: dict[str, Rule] = field(default_factory=dict)   # target -> rule; a target not named runs the feature
    built: bool = False       # the runtime builds it when asked directly (``build_runtime``: its GPU tests), only
                              # the pre-flight does not offer it yet; the runtime's entry check skips the row


def _every(rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(FRAMEWORKS, rule)


# ----- rules every target shares (megatron-core's own) ------------------------------------------------------------
def bf16_layers(plan, device) -> str | None:
    low = plan.settings.low_precision
    if low is None:
        return None
    return check_bf16_layers(low.recipe, low.bf16_layers_start, low.bf16_layers_end, plan.model.num_layers,
                             plan.num_stages)


def padded_vocab(plan, device) -> str | None:
    """The padded vocabulary divides every tp that shards it (the first and last chunks' stages, a T5's decoder
    embedding): megatron-core's ``VocabParallelEmbedding`` and output layer."""
    m = plan.model
    order = plan.chunks_in_order()
    holders = {order[0][0]: "the input embedding", order[-1][0]: "the output layer"}
    if m.is_t5:
        for s, _j, ch in order:
            if ch.start_unit <= m.num_encoder_units < ch.end_unit or ch.start_unit == m.num_encoder_units:
                holders.setdefault(s, "the decoder embedding")
    vocab = m.padded_vocab_size
    for s, what in sorted(holders.items()):
        tp = plan.stages[s].tp
        if vocab % tp:
            return (f"stages[{s}].tp ({tp}): the padded vocabulary ({vocab} = vocab_size {m.vocab_size} rounded up to "
                    f"make_vocab_size_divisible_by {m.make_vocab_size_divisible_by}) must divide by it ({what} is "
                    f"split over tp); set model.make_vocab_size_divisible_by to a multiple of {tp} (Megatron-LM uses "
                    "128), or use a tp that divides it")
    return None


def softmax_offset_cp(plan, device) -> str | None:
    for i, st in enumerate(plan.stages):
        if st.cp > 1 and offset_blocks_cp(plan.model):
            return (f"stages[{i}].cp ({st.cp}): transformer-engine runs softmax_type {plan.model.softmax_type} "
                    "under context parallelism only with cp_comm_type a2a, which aceso does not price; use cp 1")
    return None


def cp_needs_te(plan, device) -> str | None:
    """megatron-core runs context parallelism only with transformer-engine's attention (TEDotProductAttention)."""
    if device.te is not False:
        return None
    for i, st in enumerate(plan.stages):
        if st.cp > 1:
            head = (f"stages[{i}].cp ({st.cp}): megatron-core runs context parallelism only with transformer-engine's "
                    "attention (TEDotProductAttention), ")
            if not device.cuda:
                return head + ("not on CPU; search the plan for a CPU cluster with cp 1 (aceso search --cluster "
                               "1xN-cpu), or run it on GPUs with transformer-engine")
            return head + "not without transformer-engine; use cp 1 or run on a GPU with transformer-engine"
    return None


# ----- Megatron-LM and Megatron-Bridge ------------------------------------------------------------------------------
def one_shape(plan, device) -> str | None:
    """What ``aceso export --to megatron-lm`` can write (``megatron.check_expressible``: one shape, layer cuts,
    Megatron's recompute settings)."""
    from search.megatron.expressible import check_expressible

    return check_expressible(plan)


def megatron_lm_hybrid_model(model, low) -> str | None:
    """A hybrid model (Mamba-2 / GDN layers) runs in Megatron-LM only as a hybrid-pattern run
    (``pretrain_hybrid.py``): what the newest release's ``HybridModel`` does not build
    (``megatron.hybrid_pattern.model_refusal``: a Mamba-2 mixer field no flag sets, a custom layer spec, ...) is
    refused before any search, so no report line prices a plan Megatron-LM cannot run."""
    from search.megatron.hybrid_pattern import model_refusal as pattern_refusal, release_for, runs_as_pattern
    if not runs_as_pattern(model):
        return None
    why = pattern_refusal(model, release_for(None)[0])
    return f"--target megatron-lm: {why}" if why else None


def bridge_hybrid_model(model, low) -> str | None:
    """A hybrid model no Bridge form runs at all (``megatron.bridge_hybrid.model_refusal``: GDN layers, another
    activation than the providers' squared ReLU, what megatron-core 0.19's HybridModel does not build): refused
    before any search."""
    from search.megatron.hybrid_pattern import runs_as_pattern
    if not runs_as_pattern(model):
        return None
    from search.megatron.bridge_hybrid import model_refusal as bridge_refusal
    why = bridge_refusal(model)
    if why is None:
        return None
    way_out = "" if megatron_lm_hybrid_model(model, low) else \
        "; search with --target megatron-lm (pretrain_hybrid.py --hybrid-layer-pattern)"
    return f"--target megatron-bridge: {why}{way_out}"


def bridge_hybrid_layout(plan, device) -> str | None:
    """What ``aceso export --to megatron-bridge`` writes of a hybrid model's plan, the export's own checks
    (``megatron.bridge_hybrid.needs_pipes``): Bridge v0.3.1's MambaStack split, else v0.6.0's
    ``HybridModelProvider`` ('|' cuts at any layer, full recompute, MTP); what neither runs (virtual pipeline
    stages) is refused in v0.6.0's words, so the search for this target returns only plans that export."""
    from search.megatron.hybrid_pattern import runs_as_pattern
    if not runs_as_pattern(plan.model):
        return None
    from search.megatron.bridge_hybrid import needs_pipes
    from search.megatron.config import NotExpressible
    try:
        needs_pipes(plan)
    except NotExpressible as e:
        return str(e)
    return None


def yarn_on_bridge(model, low) -> str | None:
    """YaRN on standard attention for Megatron-Bridge: the GPT-OSS recipes' provider holds the ``yarn_*`` fields,
    the other recipes are refused (``bridge.yarn_refusal``). The aceso runtime builds it on every stage as stock
    ``GPTModel(position_embedding_type="yarn")`` does (docs/runtime.md, "RoPE scaling"; tests/runtime/
    test_yarn_runtime.py, tests/distributed/test_yarn_plans.py). Megatron-LM runs it from core_v0.19.0 on, the
    release being the export's choice: its one line is the export's (``rope_scaling.megatron_lm_refusal``)."""
    from search.megatron.bridge import yarn_refusal
    why = yarn_refusal(model)
    return f"--target megatron-bridge: {why}" if why is not None else None


def t5_rope_on_megatron_lm(model, low) -> str | None:
    """A T5 whose RoPE base or scaling ``pretrain_t5.py`` does not pass on (``megatron.expressible.t5_rope_refusal``):
    refused before any search, as the export refuses it."""
    from search.megatron.expressible import t5_rope_refusal
    why = t5_rope_refusal(model)
    return f"--target megatron-lm: {why}" if why is not None else None


def t5_on_bridge(model, low) -> str | None:
    if not model.is_t5:
        return None
    return ("--target megatron-bridge: Megatron-Bridge v0.3.1 has no T5 pretraining recipe; use --target megatron-lm "
            "(pretrain_t5.py)")


TABLE: tuple[Row, ...] = (
    Row("low-precision recipe (FP8 / FP4 linear GEMMs)", "model", {RUNTIME: rt.low_precision}, built=True),
    Row("LatentMoE (moe_latent_size)", "model", {RUNTIME: rt.latent_moe}),
    Row("YaRN on standard attention (GPT-OSS's rope scaling)", "model", {BRIDGE: yarn_on_bridge}),
    Row("T5 (encoder-decoder)", "model", {BRIDGE: t5_on_bridge}),
    Row("T5 with RoPE (position_embedding rope)", "model", {RUNTIME: rt.t5_rope}),
    Row("T5 with a RoPE base other than 10000 or RoPE scaling (T5Model takes neither)", "model",
        {RUNTIME: rt.t5_rope, MEGATRON_LM: t5_rope_on_megatron_lm, BRIDGE: t5_on_bridge}),
    Row("hybrid models in Megatron-LM (what pretrain_hybrid.py builds)", "model",
        {MEGATRON_LM: megatron_lm_hybrid_model}),
    Row("hybrid models on Bridge (Mamba-2, squared ReLU; no GDN)", "model", {BRIDGE: bridge_hybrid_model}),
    Row("bf16 first / last layers of an FP8 recipe", "plan", _every(bf16_layers)),
    Row("fp16 on a GPU with bf16 (loss scaling)", "precision", {RUNTIME: rt.fp16_on_gpu}),
    Row("CPU activation offload", "plan", {RUNTIME: rt.activation_offload}),
    Row("vocabulary sharded over tp", "plan", _every(padded_vocab)),
    Row("softmax offset under context parallelism", "plan", _every(softmax_offset_cp)),
    Row("context parallelism without transformer-engine", "plan", _every(cp_needs_te)),
    Row("MLA / MTP layouts", "plan", {RUNTIME: rt.mla_mtp}),
    Row("Mamba-2 / GDN layers under context parallelism (a layer kind's no_runtime_cp)", "plan",
        {RUNTIME: rt.layers_cp}),
    Row("MoE EP communication overlap", "plan", {RUNTIME: rt.overlap_ep}),
    Row("MoE flex dispatcher on CPU", "plan", {RUNTIME: rt.flex_on_cpu}),
    Row("MoE expert tp > 1 with the alltoall dispatcher on CPU", "plan", {RUNTIME: rt.expert_tp_alltoall_on_cpu}),
    Row("MoE grouped GEMM without transformer-engine", "plan", {RUNTIME: rt.grouped_gemm_without_te}),
    Row("Megatron FSDP", "plan", {RUNTIME: rt.megatron_fsdp}),
    Row("TP communication overlap", "plan", {RUNTIME: rt.tp_comm_overlap}),
    Row("CUDA graphs, fine-grained offload, fused cross-entropy", "plan", {RUNTIME: rt.stack_features}),
    Row("optimizers other than Adam (Muon, dist_muon); the precision-aware optimizer's state dtypes", "plan",
        {RUNTIME: rt.optimizer}),
    Row("tp-pp-dp rank order, SHARP", "plan", {RUNTIME: rt.data_parallel}),
    Row("interleaved schedule's p2p overlapped with compute", "plan", {RUNTIME: rt.overlap_p2p}),
    Row("per-stage shapes, mid-layer cuts, per-unit recompute", "plan", {MEGATRON_LM: one_shape, BRIDGE: one_shape}),
    Row("hybrid layouts on Bridge (v0.3.1's even split; '|' cuts, full recompute, MTP from v0.6.0; no VPP)", "plan",
        {BRIDGE: bridge_hybrid_layout}),
)


def target_key(target: str) -> str:
    """The table's name of a ``--target`` (``aceso`` is the runtime)."""
    return TARGET_NAMES[target]


def plan_target(plan) -> str:
    """The target a plan was made for: its settings' framework."""
    return plan.settings.framework


def model_refusal(target: str, model, low=None, dtype: str | None = None, gpu=None,
                  optimizer: str = "adam", precision_aware=None) -> str | None:
    """Why ``target`` runs no plan of ``model`` (with the low-precision recipe ``low``; trained in ``dtype`` on
    ``gpu``, the cluster's, when given; with ``optimizer`` and the precision-aware optimizer ``precision_aware``, the
    optimizer row's rules), one line; or None."""
    key = target_key(target)
    for row in TABLE:
        if row.scope == "model" and key in row.refuse and (why := row.refuse[key](model, low)) is not None:
            return why
    if key == RUNTIME and (why := rt.optimizer_refusal(optimizer, "--optimizer")) is not None:
        return why
    if key == RUNTIME and (why := rt.precision_aware_refusal(precision_aware, "--use-precision-aware-optimizer")):
        return why
    return precision_refusal(target, dtype, gpu) if dtype is not None else None


def precision_refusal(target: str, dtype: str, gpu) -> str | None:
    """Why ``target`` does not train in ``dtype`` on ``gpu`` (a ``GPUSpec``; None or the cpu preset: a CPU), one
    line; or None."""
    key = target_key(target)
    for row in TABLE:
        if row.scope == "precision" and key in row.refuse and (why := row.refuse[key](dtype, gpu)) is not None:
            return why
    return None


def plan_refusal(plan, target: str | None = None, device: Device | str = "cuda", entry: bool = False) -> str | None:
    """Why ``target`` (default: the plan's own) does not run ``plan`` on ``device``, one line; or None. ``entry``:
    the runtime's own entry check (its pre-flight half's ``refusal``), which builds the ``built`` rows."""
    key = target_key(target) if target is not None else plan_target(plan)
    device = Device.of(device) if isinstance(device, str) else device
    low = plan.settings.low_precision
    for row in TABLE:
        rule = row.refuse.get(key)
        if rule is None or (entry and row.built):
            continue
        if row.scope == "precision":
            why = rule(plan.model.params_dtype, plan.cluster.gpu if device.cuda and plan.cluster is not None else None)
        else:
            why = rule(plan.model, low) if row.scope == "model" else rule(plan, device)
        if why is not None:
            return why
    return None


def markdown() -> str:
    """The table as Markdown (docs/search.md): per feature and target, ``runs``, ``no`` (a model-scope rule: no plan
    of such a model) or ``limits`` (a plan-scope rule: the plans or devices it names)."""
    lines = ["| feature | " + " | ".join(FRAMEWORKS) + " |", "|---|" + "---|" * len(FRAMEWORKS)]
    for row in TABLE:
        cells = [("no" if row.scope == "model" else "limits") if t in row.refuse else "runs" for t in FRAMEWORKS]
        lines.append(f"| {row.feature} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
