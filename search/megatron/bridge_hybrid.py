"""A hybrid Mamba model's plan (Nemotron-H, Nemotron-3) as Megatron-Bridge v0.3.1 recipe overrides, and back.

Bridge v0.3.1 builds these models from ``MambaModelProvider`` subclasses (``models/nemotronh/nemotron_h_provider.py``:
``NemotronHModelProvider4B`` / ``8B`` / ``47B`` / ``56B``, ``Nemotron3NanoProvider``) in the recipes of
``recipes/nemotronh/`` (``nemotronh.py``: ``nemotronh_{4b,8b,47b,56b}_pretrain_config``; ``nemotron_3_nano.py``:
``nemotron_3_nano_pretrain_config``), on megatron-core 0.16.1 (its ``3rdparty/Megatron-LM``). There:

- the pattern is ``hybrid_override_pattern`` (symbols ``M * - E``): no ``|`` stage cuts and no ``/`` MTP part (the
  provider has no MTP field); ``num_layers`` is the pattern's length;
- ``MambaStack._select_layers_for_pipeline_parallel`` places the layers evenly over pp, or with
  ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` and the rest evenly, and asserts
  no virtual pipeline (``MambaModelProvider.provide`` asserts it too); a plan split otherwise is refused in one line
  naming v0.3.1 (its '|' cuts run in Megatron-LM, ``--to megatron-lm --hybrid-pattern``, and in Bridge v0.6.0,
  ``--to megatron-bridge --hybrid-pattern``, below);
- ``MambaStack`` checkpoints no layer: full recompute is refused; selective modules act inside the attention and
  MoE layers as in GPTModel;
- the activation is the provider's ``squared_relu`` callable (a YAML cannot set one): other activations are refused;
  the Mamba-2 mixer is ``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups``, ``mamba_num_heads`` and
  ``use_mamba_mem_eff_path`` (``d_conv`` 4 and ``chunk_size`` 128 are the stack spec's, as in Megatron-LM);
- the recipes hold ``mixed_precision`` as a name (``bf16_mixed``) and a ``comm_overlap`` section with
  ``tp_comm_overlap=True``, which every export overrides with the plan's (and the nano recipe's
  ``delay_wgrad_compute`` / ``overlap_moe_expert_parallel_comm``, which Bridge copies onto the model).

Bridge v0.6.0 (tag commit 51885cf13; ``--hybrid-pattern``; ``PIPES``): ``models/hybrid/hybrid_provider.py``
``HybridModelProvider`` passes ``hybrid_layer_pattern`` as it is to megatron-core's ``HybridModel`` (its 3rdparty
pin cd4afff, the 0.19 line), whose ``select_pipeline_segment`` gives pipeline rank ``r`` the ``r``-th '|' segment, so any uneven split
(cuts at any layer of the pattern) runs; ``finalize`` derives ``num_layers`` without the '|'
(``get_hybrid_total_layer_count``) and ``provide`` still asserts no virtual pipeline. The form is Megatron-LM
core_v0.19's hybrid pattern (``hybrid_pattern.hybrid_form``: full recompute checkpoints hybrid layers there); the
first / last stage fields are left out (megatron-core asserts them away with pipes) and ``mixed_precision`` is a
whole ``MixedPrecisionConfig`` object (v0.6.0's recipes hold a name or an object, per GPU). MTP: the provider's
``mtp_num_layers``, ``mtp_hybrid_override_pattern`` (one depth's pattern), ``mtp_use_repeated_layer`` and
``keep_mtp_spec_in_bf16`` (false: aceso prices MTP in the plan's precision; v0.6.0's recipes set true, but at
that tag nothing reads the field: ``HybridModelProvider`` declares it, and neither Bridge, its megatron-core pin nor
Megatron-LM core_v0.16.1 to core_v0.19.0 uses it, so either value runs MTP in the plan's precision), as v0.6.0's
Nemotron recipes set the others;
``finalize`` appends '/' and the MTP pattern once per depth (``max(1, mtp_num_layers)`` with the shared layer), the
Megatron-LM form's pattern again (``_with_mtp``, ``finalized_pattern``). Where v0.3.1 cannot run a plan (an uneven
split, full recompute, MTP) the export writes v0.6.0's form (``needs_pipes``); a model no form runs
(``model_refusal``) is refused before any search by the capability table. v0.4.x / v0.5.x (``MambaModelProvider``
on megatron-core 0.17 / 0.18) are not written (their provider's '|' handling is not checked here).

A model without a recipe of its own runs from another's (``recipe_for``: Nemotron-3 Super and Ultra from the Nano
recipe), so the YAML states every field of that recipe where the model differs: the architecture, MoE and MTP fields,
the router's top-k scaling factor and dtype (always), and the ``megatron`` block's norm epsilon, init std and MTP loss
weight where the model has them (Super: 0.014 and 0.3 over the Nano recipe's 0.0173 and megatron-core's 0.1;
``tests/unit/test_bridge_nano_recipe_leaks.py`` quotes v0.6.0's Nano recipe field by field).

Every other field is ``names.bridge_fields`` of the plan's Megatron form (``hybrid_pattern.hybrid_form``), as for
GPT models. ``read_overrides`` reads such a YAML back as the equivalent ``pretrain_mamba.py`` command line of
Megatron-LM core_v0.17 (the first release with ``--hybrid-layer-pattern``; its NullTokenizer counts the vocabulary
as Bridge v0.3.1's megatron-core does) and refuses any field whose value the plan read from it would not write back.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

from search.spec.plan import ParallelPlan
from .config import MegatronConfig, NotExpressible

BRIDGE = "Megatron-Bridge v0.3.1"
PIPES = "Megatron-Bridge v0.6.0"     # the first Bridge read here whose provider passes '|' cuts to HybridModel
PIPES_CORE = "0.19"                  # the Megatron-LM rules (and reader) of its megatron-core
BRIDGE_CORE = "0.16"                 # the megatron-core release Bridge v0.3.1 runs (search/settings/releases.py)
SYMBOLS = frozenset("M*-E")          # megatron-core 0.16.1 Symbols
# preset -> recipe (recipes/nemotronh of v0.3.1); other hybrid models: the nano recipe with MoE, else the 8B one
RECIPES = {"nemotron-h-4b": "nemotronh_4b_pretrain_config", "nemotron-h-8b": "nemotronh_8b_pretrain_config",
           "nemotron-h-47b": "nemotronh_47b_pretrain_config", "nemotron-h-56b": "nemotronh_56b_pretrain_config",
           "nemotron-3-nano": "nemotron_3_nano_pretrain_config"}
MOE_RECIPE, DENSE_RECIPE = "nemotron_3_nano_pretrain_config", "nemotronh_8b_pretrain_config"
MAMBA_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def recipe_for(model) -> str:
    return RECIPES.get(model.name) or (MOE_RECIPE if model.moe is not None else DENSE_RECIPE)


def model_refusal(model) -> str | None:
    """Why no Bridge form runs any plan of the hybrid ``model`` (the field and why, one clause; the export and the
    capability table's model row add their target and fix), or None: GDN layers (not written here), an activation
    other than the providers' squared ReLU, and what megatron-core 0.19's ``HybridModel`` (v0.6.0's) does not build
    (``hybrid_pattern.model_refusal``: Q/K norms, RoPE scaling, a Mamba-2 mixer its flags cannot set)."""
    from .hybrid_pattern import model_refusal as pattern_refusal
    from .versions import release
    if model.gdn is not None:
        return f"model {model.name} has GDN layers ('G'), which aceso's Bridge hybrid overrides do not write"
    if model.activation != "squared_relu":
        return (f"model.activation {model.activation}: the Nemotron-H providers' activation_func is squared_relu (a "
                "Python callable a YAML cannot set)")
    if model.mamba is not None and model.mamba.mamba_training_ssm_states_dtype:
        return ("model.mamba.mamba_training_ssm_states_dtype: aceso's Bridge hybrid overrides do not write it "
                "(megatron-core 0.19's TransformerConfig field)")
    return pattern_refusal(model, release(PIPES_CORE))


def _refusal(plan: ParallelPlan, pipes: bool = False) -> str | None:
    """What neither form runs (``model_refusal``, virtual stages), as ``bridge`` words it."""
    why = model_refusal(plan.model)
    if why:
        return why
    if any(len(st.chunks) > 1 for st in plan.stages):
        return (f"virtual pipeline stages: the hybrid model provider of {PIPES if pipes else BRIDGE} asserts none"
                + ("" if pipes else " (megatron-core 0.16.1's MambaStack places no virtual stages)"))
    return None


def _model_gap(m) -> str | None:
    """What Bridge v0.3.1 does not run of any plan of the hybrid model ``m`` (its layers, MTP), one clause; or None."""
    bad = sorted(set(m.hybrid_layer_pattern.split("/")[0]) - SYMBOLS)
    if bad:
        return f"hybrid_layer_pattern: '{bad[0]}' layers are newer than megatron-core 0.16.1's MambaModel (M * - E)"
    if m.mtp_num_layers:
        return "mtp_num_layers: MambaModelProvider of v0.3.1 has no MTP (megatron-core 0.16.1's MambaModel none)"
    return None


def model_core(model) -> str:
    """The megatron-core release a Bridge export of ``model``'s plans runs, as far as the model decides it: v0.6.0's
    (``PIPES_CORE``) for a hybrid model Bridge v0.3.1 cannot build (``_model_gap``), else v0.3.1's
    (``BRIDGE_CORE``: GPT, MoE and MLA models, and hybrid models whose plans v0.3.1 splits)."""
    from .hybrid_pattern import runs_as_pattern
    return PIPES_CORE if runs_as_pattern(model) and _model_gap(model) else BRIDGE_CORE


def plan_core(plan: ParallelPlan) -> str:
    """The megatron-core release the Bridge export of ``plan`` runs: v0.6.0's (``PIPES_CORE``) where only its form
    runs the plan (``needs_pipes``: an uneven split, full recompute, MTP), else ``model_core``'s. A plan no form
    runs (the export refuses it) is the model's. The one answer for the search's candidates, the export's header,
    the YAML's import and ``explain --framework megatron-bridge``."""
    from .hybrid_pattern import runs_as_pattern
    if not runs_as_pattern(plan.model) or model_core(plan.model) == PIPES_CORE:
        return model_core(plan.model)
    try:
        return PIPES_CORE if needs_pipes(plan) else BRIDGE_CORE
    except NotExpressible:
        return BRIDGE_CORE


def _v031_gap(plan: ParallelPlan, c: MegatronConfig) -> str | None:
    """What Bridge v0.3.1 (megatron-core 0.16.1's ``MambaModel``) does not run of a plan v0.6.0 runs, one clause;
    or None."""
    from .layout import split_for
    m = plan.model
    gap = _model_gap(m)
    if gap:
        return gap
    if c.recompute.granularity == "full":
        return "recompute full: megatron-core 0.16.1's MambaStack (Bridge v0.3.1) checkpoints no layer"
    if split_for(c.chunk_layers, c.pp, 1).layout is not None:
        even = len(m.hybrid_layer_pattern.split("/")[0]) / c.pp
        return (f"stage layers {'/'.join(map(str, c.chunk_layers))}: {BRIDGE}'s MambaStack splits evenly "
                f"({even:g} hybrid layers a stage) or with other first / last stages only")
    return None


def hybrid_config(plan: ParallelPlan, pipes: bool = False):
    """The plan's Megatron form as Bridge v0.3.1 runs it (``pipes``: Bridge v0.6.0 with '|' cuts), or
    ``NotExpressible`` (one line): ``(config, pattern)``."""
    from .hybrid_pattern import hybrid_form
    from .versions import release
    why = model_refusal(plan.model)
    if why:
        raise NotExpressible(f"--to megatron-bridge: {why}; export it with --to megatron-lm --hybrid-pattern")
    # the model and plan rules of a hybrid run (Megatron-LM's own refusals), before what only Bridge refuses, whose
    # way out is the Megatron-LM export: a plan Megatron-LM does not run either is refused in its words
    form = hybrid_form(plan, release(PIPES_CORE))
    why = _refusal(plan, pipes)
    if why:
        raise NotExpressible(f"--to megatron-bridge: {why}; export it with --to megatron-lm --hybrid-pattern")
    if pipes:
        return form.config, form.pattern
    gap = _v031_gap(plan, form.config)
    if gap:
        raise NotExpressible(f"--to megatron-bridge: {gap}; {PIPES} runs it: export it with --hybrid-pattern, or "
                             "--to megatron-lm --hybrid-pattern")
    return form.config, plan.model.hybrid_layer_pattern


def needs_pipes(plan: ParallelPlan) -> str | None:
    """Which Bridge form the export writes: None, Bridge v0.3.1's MambaStack split; else what v0.3.1 does not run
    of the plan (an uneven split, full recompute, MTP: one clause, the export's note), which only v0.6.0's
    ``HybridModelProvider`` runs; ``NotExpressible`` in v0.6.0's words when neither runs it. The one order of the
    forms, for the export and the Bridge target's capability row."""
    c, _ = hybrid_config(plan, pipes=True)
    return _v031_gap(plan, c)


def overrides(plan: ParallelPlan, pipes: bool = False) -> tuple[str, MegatronConfig, dict[str, object]]:
    """``(recipe, config, {section: {field: value}})`` of a hybrid model's plan (``pipes``: Bridge v0.6.0's
    ``hybrid_layer_pattern`` with the plan's '|' cuts)."""
    from ..layers.mamba import shape
    from .names import bridge_fields
    c, pattern = hybrid_config(plan, pipes)
    m = c.model
    out = bridge_fields(c)
    model = out["model"]
    for k in ("mtp_num_layers", "mtp_use_repeated_layer", "multi_latent_attention", "moe_layer_freq",
              "pipeline_model_parallel_layout"):
        model.pop(k, None)               # not MambaModelProvider fields, or the pattern's (MTP: below)
    sh = shape(m.mamba, m.hidden_size)
    if pipes:                            # megatron-core asserts the split fields away with pipes
        for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            model.pop(k, None)
        from .names import tokenizer_args
        from .versions import release     # 0.19's NullTokenizer counts its EOD token (0.16.1's adds it)
        out["tokenizer"]["vocab_size"] = int(tokenizer_args(c, release(PIPES_CORE))[-1])
    if pipes:
        pattern = _with_mtp(model, pattern, m)
    model.update({"hybrid_layer_pattern" if pipes else "hybrid_override_pattern": pattern}, mamba_state_dim=sh.state,
                 mamba_head_dim=sh.head_dim, mamba_num_groups=sh.groups, mamba_num_heads=sh.heads,
                 use_mamba_mem_eff_path=m.mamba.use_mamba_mem_eff_path)
    ov = {"tp_comm_overlap": c.settings.tp_comm_overlap}
    if m.moe is not None:
        ov.update(delay_wgrad_compute=model.get("delay_wgrad_compute", False),
                  overlap_moe_expert_parallel_comm=model.get("overlap_moe_expert_parallel_comm", False))
    from .names import comm_overlap_dp_fields     # the section's DP defaults would replace the plan's
    ov.update(comm_overlap_dp_fields(c, PIPES_CORE if pipes else BRIDGE_CORE))
    out["comm_overlap"] = ov
    from .bridge import _KEEP, _mixed_precision
    mp = _mixed_precision(c, "whole" if pipes else "name")     # v0.3.1's nemotronh recipes hold it as a name
    if mp is not _KEEP:
        out["mixed_precision"] = mp
    return recipe_for(m), c, out


# v0.6.0 HybridModelProvider's MTP fields (models/hybrid/hybrid_provider.py; mtp_use_repeated_layer is megatron-core's)
MTP_FIELDS = ("mtp_num_layers", "mtp_hybrid_override_pattern", "mtp_use_repeated_layer", "keep_mtp_spec_in_bf16")


def _with_mtp(model: dict, pattern: str, m) -> str:
    """The main pattern (with its '|' cuts) of the Megatron-LM form's ``pattern``, and a model with MTP's fields
    added to ``model`` as Bridge v0.6.0's Nemotron recipes write them (``nemotron_3_5_lightning_pretrain_config``:
    ``mtp_num_layers``, ``mtp_hybrid_override_pattern`` one depth's pattern, ``mtp_use_repeated_layer``):
    ``HybridModelProvider.finalize`` appends ``'/' + mtp_hybrid_override_pattern`` once per depth
    (``max(1, mtp_num_layers)`` with the repeated layer), which is the Megatron-LM form's pattern again.
    ``keep_mtp_spec_in_bf16`` is written false: aceso prices the MTP layers in the plan's precision (the Super
    recipe keeps them in bf16)."""
    main, *depths = pattern.split("/")
    if not m.mtp_num_layers:
        return main
    assert len(depths) == m.mtp_num_layers and len(set(depths)) == 1, pattern
    model.update(dict(zip(MTP_FIELDS, (m.mtp_num_layers, depths[0], bool(m.mtp_use_repeated_layer), False))))
    return main


def finalized_pattern(model: dict) -> str | None:
    """``hybrid_layer_pattern`` as v0.6.0's ``HybridModelProvider.finalize`` makes it of the ``model`` overrides: the
    main pattern (before any '/') and ``mtp_hybrid_override_pattern`` once per MTP depth (``max(1,
    mtp_num_layers)`` with ``mtp_use_repeated_layer``); the pattern as written without an MTP pattern."""
    pattern, mtp = model.get("hybrid_layer_pattern"), model.get("mtp_hybrid_override_pattern")
    if pattern is None or not mtp:
        return pattern
    n = model.get("mtp_num_layers") or 0
    copies = max(1, n) if model.get("mtp_use_repeated_layer") else n
    return "/".join([pattern.split("/")[0]] + [mtp] * copies)


# ----- reading the overrides back --------------------------------------------------------------------------------
READ_RELEASE = "0.17"
# Bridge field -> Megatron-LM flag where the name is not the field's with '-' (None: read from elsewhere / dropped)
FLAGS = {"model.num_moe_experts": "--num-experts", "model.hybrid_override_pattern": "--hybrid-layer-pattern",
         "model.hybrid_layer_pattern": "--hybrid-layer-pattern",
         "model.num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
         "model.num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
         "model.vocab_size": None, "model.virtual_pipeline_model_parallel_size": None,
         "tokenizer.vocab_size": "--vocab-size", "model.layernorm_epsilon": "--norm-epsilon", "dataset.seq_length": None, "optimizer.use_distributed_optimizer": None,
         "comm_overlap.delay_wgrad_compute": None, "comm_overlap.overlap_moe_expert_parallel_comm": None,
         "comm_overlap.tp_comm_overlap": "--tp-comm-overlap",
         # the DP overlaps the section states (names.comm_overlap_dp_fields): read from ddp, checked by the round trip
         "comm_overlap.overlap_grad_reduce": None, "comm_overlap.overlap_param_gather": None,
         "comm_overlap.align_param_gather": None, "comm_overlap.bucket_size": None,
         "model.mtp_hybrid_override_pattern": None, "model.keep_mtp_spec_in_bf16": None}   # in the pattern; priced
# bool fields whose flag says the opposite
NEGATED = {"model.share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
           "model.add_bias_linear": "--disable-bias-linear", "ddp.grad_reduce_in_fp32": "--grad-reduce-in-bf16",
           "model.use_mamba_mem_eff_path": "--disable-mamba-mem-eff-path",
           "dist.align_grad_reduce": "--no-align-grad-reduce"}
SECTIONS = ("model", "train", "ddp", "dist", "optimizer", "dataset", "tokenizer", "checkpoint", "comm_overlap")


def _scalar(text: str) -> object:
    t = text.strip()
    if t in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[t]
    if t.startswith("["):
        inner = t[1:-1].strip()
        return [_scalar(x) for x in inner.split(",")] if inner else []
    if t.startswith("{"):                  # a flow mapping (a dtype object of mixed_precision)
        inner = t[1:-1].strip()
        return {k.strip(): _scalar(v) for k, _, v in (x.partition(":") for x in inner.split(","))} if inner else {}
    if t.startswith('"'):
        return json.loads(t)
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    return t


def parse_yaml(text: str, source: str) -> tuple[dict[str, dict[str, object]], int | None]:
    """The ``section: {field: value}`` overrides of a YAML ``write_yaml`` writes, and the world size of its
    ``torchrun`` line (None if absent); a line of another shape is ``NotExpressible`` naming it."""
    out: dict[str, dict[str, object]] = {}
    section, world = None, None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            g = re.search(r"--nproc-per-node (\d+) --nnodes (\d+)", line)
            world = int(g[1]) * int(g[2]) if g else world
            continue
        if not line.strip():
            continue
        key, sep, value = line.strip().partition(":")
        if not sep:
            raise NotExpressible(f"{source}:{n}: not a 'field: value' line")
        if not line.startswith(" "):
            section = key
            if value.strip():
                out[section] = _scalar(value)     # a whole section (mixed_precision: a recipe name)
            else:
                out[section] = {}
            continue
        if section is None or not isinstance(out[section], dict):
            raise NotExpressible(f"{source}:{n}: a field outside a section")
        out[section][key] = _scalar(value)
    return out, world


def to_argv(ov: dict[str, dict[str, object]]) -> list[str]:
    """The Megatron-LM (core_v0.17 ``pretrain_mamba.py``) flags of the overrides."""
    argv = ["--tokenizer-type", "NullTokenizer", "--squared-relu"]
    argv += _precision(ov.get("mixed_precision", "bf16_mixed"))
    for section in SECTIONS:
        for field, v in (ov.get(section) or {}).items():
            key = f"{section}.{field}"
            if key == "tokenizer.tokenizer_type":
                continue
            if key in NEGATED:
                argv += [] if v else [NEGATED[key]]
                continue
            flag = FLAGS.get(key, "--" + field.replace("_", "-"))
            if flag is None or v is None or v is False:
                continue
            if key == "model.num_query_groups" and v != ov["model"].get("num_attention_heads"):
                argv.append("--group-query-attention")
            if key == "model.expert_tensor_parallel_size" and v == ov["model"].get("tensor_model_parallel_size"):
                continue                  # the default (None: tp) as the Megatron-LM export leaves it
            if key == "model.make_vocab_size_divisible_by":     # Megatron-LM's flag is a multiple per tp rank
                v = v // ov["model"].get("tensor_model_parallel_size", 1)
            if key == "model.seq_length":
                argv += ["--max-position-embeddings", str(v)]
            if section == "optimizer":            # the precision-aware optimizer's torch dtypes (optimizer_state.py)
                from search.settings.optimizer_state import from_bridge
                v = from_bridge(field, v)
            argv += [flag] if v is True else [flag, *(map(str, v) if isinstance(v, list) else [str(v)])]
    return argv


def _precision(mp: object) -> list[str]:
    """The Megatron-LM precision flags of the ``mixed_precision`` override (``bridge._mixed_precision`` writes: a
    recipe name, a ``MixedPrecisionConfig`` object, or null): ``--bf16`` / ``--fp16`` / nothing (fp32), and a
    low-precision object's recipe (``fp8`` / ``fp8_recipe`` or ``fp4`` / ``fp4_recipe``, the param gather, the
    bf16 first / last layers: ``bridge._low_precision_object``'s fields) as ``precision.megatron_flags``."""
    if mp is None:
        return []
    if isinstance(mp, str) and mp in ("bf16_mixed", "fp16_mixed"):
        return ["--" + mp[:4]]
    if isinstance(mp, dict) and {"fp8", "fp4"} & set(mp) and mp.get("bf16"):
        from search.settings.precision import from_megatron, megatron_flags
        try:
            name = from_megatron(mp.get("fp8"), mp.get("fp8_recipe"), mp.get("fp4"), mp.get("fp4_recipe"))
        except ValueError as e:
            raise NotExpressible(f"mixed_precision: {e}") from None
        layers = (mp.get("num_layers_at_start_in_bf16") or 0, mp.get("num_layers_at_end_in_bf16") or 0) \
            if mp.get("first_last_layers_bf16") else (0, 0)
        return ["--bf16", *megatron_flags(name, bool(mp.get("fp8_param_gather")), *layers,
                                          bool(mp.get("reuse_grad_buf_for_mxfp8_param_ag")))]
    if isinstance(mp, dict) and not {"fp8", "fp4"} & set(mp):
        return ["--bf16"] if mp.get("bf16") else ["--fp16"] if mp.get("fp16") else []
    raise NotExpressible(f"mixed_precision: {mp!r} is not read back by aceso (bf16 or fp16 recipes, a "
                         "MixedPrecisionConfig object, or null); import the Megatron-LM script instead")


def read_overrides(text: str, source: str, world_size: int | None = None, cluster=None):
    """The ``Imported`` plan of a YAML of hybrid overrides: the plan Megatron-LM's reader makes of their command
    line (``settings``: Megatron-Bridge on megatron-core 0.16; a v0.6.0 ``hybrid_layer_pattern`` with '|' cuts:
    Megatron-LM core_v0.19's reader, megatron-core 0.19), checked field by field against what that plan exports."""
    from .importer import read_megatron
    ov, world = parse_yaml(text, source)
    pipes = "hybrid_layer_pattern" in (ov.get("model") or {})
    if not pipes and "hybrid_override_pattern" not in (ov.get("model") or {}):
        raise NotExpressible(f"{source}: no model.hybrid_override_pattern; aceso reads back the overrides of hybrid "
                             "(Nemotron-H / Nemotron-3) recipes only")
    world = world_size or world
    if world is None:
        raise NotExpressible(f"{source}: no torchrun line with the world size; give --world-size")
    model = ov.get("model") or {}
    unified = {**ov, "model": {**model, "hybrid_layer_pattern": finalized_pattern(model)}} if pipes else ov
    imp = read_megatron(shlex.join(to_argv(unified)), source, world_size=world, cluster=cluster,
                        version=PIPES_CORE if pipes else READ_RELEASE)
    settings = imp.plan.settings.model_copy(update={"framework": "megatron-bridge",
                                                    "release": PIPES_CORE if pipes else BRIDGE_CORE})
    imp = dataclasses.replace(imp, plan=imp.plan.model_copy(update={"settings": settings}))
    _, _, back = overrides(imp.plan, pipes)
    for section, fields in ov.items():
        for field, v in (fields.items() if isinstance(fields, dict) else [(None, fields)]):
            have = back.get(section)
            w = have if field is None else (have or {}).get(field, "(not written)")
            if w != v:
                raise NotExpressible(f"{section}.{field}: {v!r} is not what the plan read from it runs ({w!r}); "
                                     "aceso reads back the overrides it writes")
    return imp
