"""A GPT / Llama / MoE plan as a Megatron-LM hybrid-pattern run: ``--hybrid-layer-pattern "*-*-|*-..."``.

megatron-core's ``HybridModel`` (``models/hybrid``, 0.18 on; ``models/mamba`` ``MambaModel`` in 0.17) builds a model
from one symbol per layer, and its attention layer ``*`` is a transformer layer's input norm, self-attention and
residual add, its MLP layer ``-`` the pre-MLP norm, MLP and residual add, ``E`` an MoE layer's, ``+`` an MLA
attention layer (0.19): exactly aceso's units. A GPT layer is ``*-`` (``*E`` MoE, ``+-`` / ``+E`` MLA), and ``|``
cuts the pattern into pipeline segments anywhere, so a plan whose stages cut at any unit (the attention and MLP
halves of one layer on two stages) runs in stock Megatron-LM, as long as every stage has one shape.

Rules (read in each release's ``megatron/training/arguments.py`` ``validate_args``, ``hybrid_layer_allocation.py``
``select_pipeline_segment`` / ``mamba_hybrid_layer_allocation.py``, ``pretrain_hybrid.py`` / ``pretrain_mamba.py``
and their ``hybrid_builders.py`` / ``mamba_builders.py``):

- releases: ``|`` and ``/`` from core_v0.17 (``--hybrid-layer-pattern``; core_v0.16.1's ``--hybrid-override-pattern``
  has neither, and its ``MambaStack`` asserts no VPP); the entry is ``pretrain_mamba.py`` with ``--spec
  megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec`` in 0.17, ``pretrain_hybrid.py`` with ``--spec
  megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec`` from 0.18 (the builders raise without a spec);
  ``+`` (MLA) from 0.19;
- segments: their number is ``pp x vp`` (any multiple of pp; vp is derived, so ``--num-virtual-stages-per-pipeline-
  rank``, ``--num-layers-per-virtual-pipeline-stage``, ``--pipeline-model-parallel-layout``, ``--decoder-first/last-
  pipeline-num-layers`` and ``--account-for-*-in-pipeline-split`` are refused with pipes); segment ``vp * pp +
  pp_rank`` runs on that rank's virtual stage ``vp``, which is a plan's model order; a segment may be empty
  (the first holding only the embedding, the last only the loss); ``--num-layers`` is derived from the pattern;
- embeddings and loss: on the first / last pipeline stage as in GPTModel; MTP: ``/`` then one pattern per depth
  (``--mtp-num-layers`` inferred), built on the last pipeline rank's last virtual stage, as a plan holds it; its
  pattern is the GPT MTP layer's (``*-``, ``*E``);
- recompute: ``--recompute-granularity full`` checkpoints hybrid layers (``HybridStack`` ``checkpointed_forward``,
  0.18 on; 0.17's ``MambaStack`` has none): ``uniform 1`` every unit, ``block N`` the first N units of each chunk;
  ``selective`` modules act inside the layers as in GPTModel (``core_attn`` in ``*``, ``moe_act`` in ``E``,
  ``mla_up_proj`` in ``+``);
- what HybridModel builds of a GPT model: RoPE (``rotary_base``, ``rotary_percent``; no ``rope_scaling``, no
  ``seq_len_interpolation_factor``: the builders do not pass them), learned absolute positions, SwiGLU, GQA,
  biases, tied or untied embeddings, RMSNorm / LayerNorm, window attention and other attention config; MoE only
  with grouped-GEMM experts (the stack spec's ``get_moe_module_spec(moe_grouped_gemm=True)``); no Q/K layernorm
  (``attention_layer`` has none, ``mla_layer`` ``IdentityOp`` latent norms); transformer-engine only (no local
  spec); no custom layer spec, no T5.

Checkpoints: HybridModel numbers layers by unit (GPT layer ``i``'s attention is ``decoder.layers.{2i}``, its MLP
``decoder.layers.{2i+1}``) and calls the final norm ``decoder.final_norm``, so a GPTModel checkpoint does not load
as it is: Megatron-LM's ``tools/checkpoint/gpt_hybrid_conversion.py --direction gpt-to-hybrid`` (core_v0.18 on;
dense or all-MoE, no MLA, no MTP) converts it, ``hybrid-to-gpt`` back.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass

from .. import layers
from ..layers.gdn import GDNSpec
from ..layers.mamba import Mamba2Spec, shape as mamba_shape
from search.spec.model import ModelSpec, Unit
from search.spec.plan import ParallelPlan
from .config import NO_RECOMPUTE, MegatronConfig, NotExpressible, Recompute, layer_bounds
from .recompute import _check_units, _selective, mtp_choice, plan_modules
from .entry import HYBRID_ENTRIES
from .versions import Release, release

SINCE = (0, 17)                      # --hybrid-layer-pattern with '|' and '/'
FULL_RECOMPUTE_SINCE = (0, 18)       # HybridStack's checkpointed_forward
# the fine-grained activation offload on a hybrid model: HybridModel starts the offload manager's chunk handler
# (``preprocess_for_fine_grained_offloading``) from core_v0.18.0; core_v0.16.1 to core_v0.17.1's MambaModel never
# does, so every offload group finds no chunk and moves nothing (fine_grained_activation_offload.py
# ``fine_grained_offloading_group_start``: "if cur_forward_chunk is None: return tensor")
OFFLOAD_SINCE = (0, 18)
OFFLOAD_NOOP = ("--fine-grained-activation-offloading on a hybrid-pattern run: {label}'s MambaModel never starts the "
                "offload (no chunk handler before core_v0.18's HybridModel), so nothing moves and the memory it "
                "would save stays on the GPU; drop it, or use --megatron-version 0.18 or newer")
MLA_SINCE = (0, 19)                  # the '+' symbol
PIPE, MTP = "|", "/"
FLAG = "--hybrid-layer-pattern"
# flags of the GPT form that the pattern replaces (Megatron-LM asserts the split flags away with pipes)
SPLIT_FLAGS = ("--num-layers", "--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
               "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--moe-layer-freq")
CONVERTER = "tools/checkpoint/gpt_hybrid_conversion.py"


def entry(rel: Release) -> tuple[str, list[str]]:
    """The release's hybrid entry point and its ``--spec`` (module, attribute)."""
    if "pretrain_hybrid.py" in rel.entry_points:
        return "pretrain_hybrid.py", ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]
    return "pretrain_mamba.py", ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]


def release_refusal(rel: Release) -> str | None:
    if rel.version < SINCE:
        return (f"{rel.label} has no '|' pipeline cuts in a hybrid layer pattern (its --hybrid-override-pattern "
                f"splits evenly by layer count; '|' came with core_v0.17)")
    return None


def release_for(name: str | None) -> tuple[Release | None, str | None]:
    """(the Megatron-LM release of a ``--release``, None) or (None, why it runs no hybrid pattern): a container runs
    the megatron-core it ships, a version names itself, None is the newest."""
    from search.settings.releases import BY_NAME, resolve
    from search.io.errors import AcesoError
    if name is None:
        return release(), None
    text = name.strip()
    container = text in BY_NAME or re.fullmatch(r"\d\d\.\d\d(\.\d\d)?", text)
    core = BY_NAME[resolve(text)[0]].megatron_core if container else text
    try:
        rel = release(core)
    except AcesoError:
        return None, f"release {name} (megatron-core {core}) is older than Megatron-LM core_v0.17's hybrid pattern"
    why = release_refusal(rel)
    return (None, why) if why else (rel, None)


def unit_symbol(model: ModelSpec, unit: Unit) -> str | None:
    """The hybrid layer symbol of a unit, its layer kind's (``search.layers``: ``+`` for an MLA model's attention);
    None where no hybrid layer is (T5's cross-attention, an MTP unit)."""
    kind = layers.resolve(model, unit.kind)
    return kind.symbol if kind.role != "layer" else None


def unit_pattern(model: ModelSpec, start: int, end: int) -> str:
    """The symbols of the decoder units ``[start, end)`` (the MTP units after the last layer left out)."""
    end = min(end, layer_bounds(model)[-1])
    return "".join(unit_symbol(model, u) for u in model.units[start:max(start, end)])


def mtp_pattern(model: ModelSpec) -> str | None:
    """One MTP depth's pattern: the GPT MTP layer is a transformer layer of the last decoder layer's kind; a hybrid
    model's is its pattern's."""
    if not model.mtp_num_layers:
        return None
    if model.hybrid_layer_pattern:      # a hybrid model names its MTP depth's layers ('/*E': Nemotron-3 Super)
        from ..layers.hybrid import mtp_layer
        return mtp_layer(model)
    starts = layer_bounds(model)
    return unit_pattern(model, starts[-2], starts[-1])


def model_refusal(model: ModelSpec, rel: Release) -> str | None:
    """Why HybridModel of ``rel`` does not build ``model`` as GPTModel does (one line), or None."""
    why = release_refusal(rel)
    if why:
        return why
    m = model.megatron or {}
    if model.is_t5:
        return "model.family t5: a hybrid layer pattern builds decoder-only models"
    if model.layer_spec is not None:
        return ("model.layer_spec: pretrain_hybrid.py builds its own stack spec (--spec hybrid_stack_spec), not a "
                "custom one")
    if m.get("qk_layernorm"):
        return ("model.megatron.qk_layernorm: HybridModel's attention layers have no Q/K norms (hybrid_stack_spec: "
                "attention_layer without q/k_layernorm, mla_layer IdentityOp), so it would be another model")
    if model.rope_scaling is not None:
        return ("model.rope_scaling: pretrain_hybrid.py does not pass RoPE scaling to HybridModel "
                "(hybrid_builder: rotary_base and rotary_percent only)")
    if model.mla is not None and rel.version < MLA_SINCE:
        return f"model.mla: the MLA layer '+' came with core_v0.19 ({rel.label} has none): give --megatron-version 0.19"
    if model.mamba is not None and mamba_refusal(model.mamba):
        return mamba_refusal(model.mamba)
    if model.mamba is not None and model.mamba.mamba_training_ssm_states_dtype and not rel.has(STATES_FLAG):
        return (f"model.mamba.mamba_training_ssm_states_dtype: {STATES_FLAG} came with core_v0.19 ({rel.label} has "
                "none): give --megatron-version 0.19 or drop it")
    if any(unit_symbol(model, u) is None for u in model.units if u.kind != "mtp"):
        return "model: a unit that is no hybrid layer"
    return None


# ----- Mamba-2 layers: TransformerConfig's mamba_* fields as Megatron-LM flags ------------------------------------
# MambaMixer arguments no flag sets (the stack specs build the mixer with its defaults): (field, default)
MAMBA_FIXED = (("d_conv", 4), ("chunk_size", 128))
STATES_FLAG = "--mamba-training-ssm-states-dtype"     # core_v0.19.0 on
MAMBA_FLAGS = ("--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
               "--disable-mamba-mem-eff-path", STATES_FLAG)


def mamba_refusal(m: Mamba2Spec) -> str | None:
    """What of a Mamba-2 mixer Megatron-LM's flags cannot set (one line), or None. ``expand`` needs none: the
    export writes the heads (``--mamba-num-heads``)."""
    for field, default in MAMBA_FIXED:
        if getattr(m, field) != default:
            return (f"model.mamba.{field} {getattr(m, field)}: Megatron-LM has no flag for MambaMixer's {field} (its "
                    f"hybrid stack spec builds {default}); use {default}")
    return None


def mamba_args(model: ModelSpec) -> list[str]:
    """The Mamba-2 flags (``TransformerConfig.mamba_*``, 0.17-0.19), the heads written out as ``MambaMixer``
    derives them."""
    sh = mamba_shape(model.mamba, model.hidden_size)
    return ["--mamba-state-dim", str(sh.state), "--mamba-head-dim", str(sh.head_dim), "--mamba-num-groups",
            str(sh.groups), "--mamba-num-heads", str(sh.heads)] + \
        ([] if model.mamba.use_mamba_mem_eff_path else ["--disable-mamba-mem-eff-path"]) + \
        ([STATES_FLAG, d] if (d := model.mamba.mamba_training_ssm_states_dtype) else [])


def mamba_of(f) -> Mamba2Spec:
    """The Mamba-2 mixer a command line's flags build (``Flags`` of the release)."""
    heads = f.get("--mamba-num-heads")
    return Mamba2Spec(mamba_state_dim=f.value("--mamba-state-dim"), mamba_head_dim=f.value("--mamba-head-dim"),
                      mamba_num_groups=f.value("--mamba-num-groups"), mamba_num_heads=heads,
                      use_mamba_mem_eff_path=not f.has("--disable-mamba-mem-eff-path"),
                      mamba_training_ssm_states_dtype=f.get(STATES_FLAG))


# ----- Gated DeltaNet layers: TransformerConfig's linear_* fields, one flag each (GDNSpec's fields are their names) --
GDN_FLAGS = tuple("--" + name.replace("_", "-") for name in GDNSpec.model_fields)


def gdn_args(model: ModelSpec) -> list[str]:
    """The GDN flags (``--linear-key-head-dim`` ... ``--linear-conv-kernel-dim``; every release's parser has them,
    core_v0.17's hybrid stack builds ``G`` layers from them)."""
    return [w for flag, name in zip(GDN_FLAGS, GDNSpec.model_fields) for w in (flag, str(getattr(model.gdn, name)))]


def gdn_of(f) -> GDNSpec:
    """The GDN mixer a command line's flags build (a flag left out: the parser's default, megatron-core's)."""
    return GDNSpec(**{name: f.value(flag) for flag, name in zip(GDN_FLAGS, GDNSpec.model_fields)})


def plan_refusal(plan: ParallelPlan, rel: Release) -> str | None:
    """``model_refusal`` and what the plan runs that the hybrid form does not (one line), or None."""
    why = model_refusal(plan.model, rel)
    if why:
        return why
    if plan.moe is not None and not plan.moe.grouped_gemm:
        return ("moe.grouped_gemm is off: HybridModel's MoE layers are grouped-GEMM experts (hybrid_stack_spec: "
                "get_moe_module_spec(moe_grouped_gemm=True)); turn it on")
    if plan.activation_offload is not None:
        return OFFLOAD_REFUSAL
    return run_refusal(plan, rel)


def run_refusal(plan: ParallelPlan, rel: Release) -> str | None:
    """What ``rel``'s hybrid model class does not run of the plan's switches (one line; the export's
    ``plan_refusal`` and the import share it), or None: the EP overlap (no schedule plan), the fine-grained
    offload before ``OFFLOAD_SINCE`` (no chunk handler: the flag moves nothing)."""
    if plan.moe is not None and plan.moe.overlap_ep_comm:
        return EP_OVERLAP_REFUSAL
    if plan.stack is not None and plan.stack.offload is not None and rel.version < OFFLOAD_SINCE:
        return OFFLOAD_NOOP.format(label=rel.label)
    return None


# megatron-core's combined 1F1B EP overlap builds its schedule from ``model.build_schedule_plan``, which only GPTModel
# has (core_v0.17.1 to core_v0.19.0: gpt_model.py; combined_1f1b.py calls ``forward_step_func(...,
# return_schedule_plan=True)``, which only pretrain_gpt.py's forward_step takes), so a HybridModel line with
# --overlap-moe-expert-parallel-comm fails at its first step
EP_OVERLAP_REFUSAL = ("moe.overlap_ep_comm: megatron-core's EP overlap (--overlap-moe-expert-parallel-comm) schedules "
                      "GPTModel only (build_schedule_plan; pretrain_hybrid.py's forward_step has no schedule plan); "
                      "turn it off")
OFFLOAD_REFUSAL = "activation_offload: aceso prices CPU activation offload for GPTModel's layers only; turn it off"


def runs_as_pattern(model: ModelSpec) -> bool:
    """Whether Megatron-LM runs ``model`` only as a hybrid-pattern run (a model with Mamba-2 or GDN layers:
    ``check_expressible``), so that what the pattern form refuses (``plan_refusal``: CPU activation offload) is no
    Megatron-LM plan of it."""
    return model.mamba is not None or model.gdn is not None


# ----- recompute over hybrid layers (one unit each) -------------------------------------------------------------
def unit_choices(rc: Recompute, model: ModelSpec, start: int, end: int) -> list[str]:
    """Per-unit choices of the chunk ``[start, end)`` under a Megatron-LM setting, each unit a hybrid layer:
    selective by the unit's kind, full uniform every unit, full block N the chunk's first N units; the MTP units
    as megatron-core gives the MTP layer (``recompute.mtp_choice``)."""
    end_layers = layer_bounds(model)[-1]
    out = []
    for i, u in enumerate(range(start, min(end, end_layers))):
        kind = model.units[u].kind
        if rc.granularity == "selective":
            out.append(_selective(model, kind, rc.modules))
        elif rc.granularity == "full" and (rc.method == "uniform" or i < (rc.num_layers or 0)):
            out.append("full")
        else:
            out.append("none")
    return out + [mtp_choice(rc)] * (end - max(start, end_layers))


def recompute_of(plan: ParallelPlan) -> Recompute:
    """The setting whose ``unit_choices`` are exactly the plan's, or ``NotExpressible``."""
    _check_units(plan)
    chunks = [ch for _, _, ch in plan.chunks_in_order()]
    used = {rc for ch in chunks for rc in ch.recompute}
    modules = plan_modules(plan)
    cands = [NO_RECOMPUTE] + ([Recompute("selective", modules=modules)] if modules else [])
    if "full" in used:
        n = max(len(ch.recompute) for ch in chunks)
        cands += [Recompute("full", "uniform", 1)] + [Recompute("full", "block", k) for k in range(1, n + 1)]
    for rc in cands:
        if all(ch.recompute == unit_choices(rc, plan.model, ch.start_unit, ch.end_unit) for ch in chunks):
            return rc
    raise NotExpressible("recompute: the plan's per-unit choices are none of Megatron-LM's settings over hybrid "
                         "layers (none, one selective module set, every layer full, or the first N layers of "
                         "each chunk full)")


# ----- the plan as a hybrid-pattern run ------------------------------------------------------------------------
@dataclass(frozen=True)
class HybridForm:
    """A plan as a Megatron-LM hybrid-pattern run: ``config`` (its ``chunk_layers`` count hybrid layers, its
    ``recompute`` is over them), the pattern with its ``|`` cuts and MTP part, and the release."""

    config: MegatronConfig
    pattern: str
    rel: Release

    @property
    def segments(self) -> list[str]:
        return self.pattern.split(MTP)[0].split(PIPE)


def pattern_of(plan: ParallelPlan) -> str:
    m = plan.model
    main = PIPE.join(unit_pattern(m, ch.start_unit, ch.end_unit) for _, _, ch in plan.chunks_in_order())
    mtp = mtp_pattern(m)
    return main + "".join(MTP + mtp for _ in range(m.mtp_num_layers or 0)) if mtp else main


def hybrid_form(plan: ParallelPlan, rel: Release | None = None) -> HybridForm:
    """The plan as ``--hybrid-layer-pattern`` run of ``rel`` (default the newest), or ``NotExpressible`` (one
    line). Any unit cut; every other rule of ``megatron_config`` (one stage shape, one expert folding, the
    features' checks) applies."""
    from .expressible import megatron_config
    rel = rel or release()
    if release_refusal(rel):
        raise NotExpressible(f"{release_refusal(rel)}: give --megatron-version 0.17 or newer")
    why = plan_refusal(plan, rel)
    if why:
        raise NotExpressible(f"{why} (a hybrid-pattern run, {rel.label})")
    rc = recompute_of(plan)
    if rc.granularity == "full" and rel.version < FULL_RECOMPUTE_SINCE:
        raise NotExpressible(f"recompute full: {rel.label}'s MambaStack checkpoints no layers (HybridStack does from "
                             "core_v0.18): give --megatron-version 0.18 or newer")
    units = tuple(len(unit_pattern(plan.model, ch.start_unit, ch.end_unit)) for _, _, ch in plan.chunks_in_order())
    cfg = megatron_config(plan, chunk_layers=units, recompute=rc)
    return HybridForm(cfg, pattern_of(plan), rel)


def _doubled(words: list[str]) -> list[str]:
    """``--num-layers-at-start/end-in-bf16 N`` over hybrid layers: the first N GPT layers are 2N units."""
    out = list(words)
    for i, w in enumerate(out[:-1]):
        if w in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"):
            out[i + 1] = str(2 * int(out[i + 1]))
    return out


def _without(words: list[str], flags) -> list[str]:
    out, skip = [], False
    for w in words:
        if w.startswith("--"):
            skip = w in flags
        if not skip:
            out.append(w)
    return out


def arg_groups(form: HybridForm) -> dict[str, list[str]]:
    """``script.arg_groups`` of the GPT form, its layer split replaced by the pattern and ``--spec``, the recompute
    over hybrid layers."""
    from .names import _recompute
    from .script import arg_groups as gpt_groups
    c, rel = form.config, form.rel
    groups = gpt_groups(dataclasses.replace(c, chunk_layers=(1,) * len(c.chunk_layers), recompute=NO_RECOMPUTE), rel)
    num_layers = len(form.pattern.split(MTP)[0].replace(PIPE, ""))
    m = c.model
    groups["model"] = ["--num-layers", str(num_layers), FLAG, form.pattern, "--spec", *entry(rel)[1],
                       *_without(groups["model"], SPLIT_FLAGS), *(mamba_args(m) if m.mamba is not None else []),
                       *(gdn_args(m) if m.gdn is not None else [])]
    groups["parallel"] = _without(groups["parallel"], SPLIT_FLAGS)
    groups["recompute"] = _recompute(c)
    # a hybrid model's layers are hybrid layers already; a GPT model's bf16 layer counts are doubled
    groups["precision"] = groups["precision"] if m.hybrid_layer_pattern else _doubled(groups["precision"])
    return groups


def args_line(form: HybridForm) -> str:
    from .names import tokenizer_args
    from .script import GROUPS
    groups = arg_groups(form)
    return shlex.join([a for g in GROUPS for a in groups[g]] + tokenizer_args(form.config, form.rel)) + "\n"


def header_notes(form: HybridForm) -> list[str]:
    segs = form.segments
    if form.config.model.hybrid_layer_pattern:     # a hybrid model: its own pattern, its own checkpoints
        return [f"hybrid model ({entry(form.rel)[0]}, megatron-core HybridModel): '|' cuts {len(segs)} segments "
                "(pp x vpp), hybrid layers per segment: " + " ".join(str(len(s)) for s in segs)]
    return [f"hybrid-pattern run ({entry(form.rel)[0]}, megatron-core HybridModel): each GPT layer is an attention "
            f"layer and an MLP layer ({''.join(dict.fromkeys(form.pattern.replace(PIPE, '').replace(MTP, '')))}); "
            f"'|' cuts {len(segs)} segments (pp x vpp), hybrid layers per segment: "
            + " ".join(str(len(s)) for s in segs),
            "checkpoints: HybridModel's are not GPTModel's (layer 2i attention, 2i+1 MLP; decoder.final_norm); "
            f"convert one with Megatron-LM's {CONVERTER} --direction gpt-to-hybrid "
            f"--hybrid-layer-pattern '{form.pattern.split(MTP)[0].replace(PIPE, '')}' (core_v0.18 on; not MLA, MTP or "
            "mixed dense / MoE layers)"]


def write_script(plan: ParallelPlan, form: HybridForm, source: str) -> str:
    from .script import write_script as gpt_script
    return gpt_script(plan, form.config, source, form.rel, groups=arg_groups(form),
                      entry=form.rel.entry_path(entry(form.rel)[0]), notes=header_notes(form))


# ----- reading a pattern back -----------------------------------------------------------------------------------
_LAYER = re.compile(r"[*+][-E]")


def gpt_layers(pattern: str) -> tuple[list[str], str | None, int]:
    """A GPT-like pattern read back: (segments, the MTP pattern, MTP depths); ``NotExpressible`` where the main
    pattern without its cuts is not GPT layers (``*-``, ``*E``, ``+-``, ``+E``) or the MTP depths differ."""
    main, *mtp = pattern.split(MTP)
    flat = main.replace(PIPE, "")
    if not flat or len(flat) % 2 or any(not _LAYER.fullmatch(flat[i:i + 2]) for i in range(0, len(flat), 2)):
        raise NotExpressible(f"{FLAG} {pattern!r}: not a GPT model's layers (attention '*' / '+' then MLP '-' or "
                             "MoE 'E', repeated) nor a Mamba-2 or GDN hybrid's ('M', 'G' layers); aceso prices no other hybrid layers")
    if any(p != mtp[0] for p in mtp) or (mtp and not _LAYER.fullmatch(mtp[0])):
        raise NotExpressible(f"{FLAG} {pattern!r}: every MTP depth must be one GPT layer's pattern")
    if len(set(s for i in range(0, len(flat), 2) for s in flat[i])) > 1:
        raise NotExpressible(f"{FLAG} {pattern!r}: '*' mixed with '+' (megatron-core refuses it)")
    return main.split(PIPE), (mtp[0] if mtp else None), len(mtp)


# ----- importing a hybrid-pattern script --------------------------------------------------------------------------
ENTRIES = HYBRID_ENTRIES
PIPED_OUT = ("--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
             "--pipeline-model-parallel-layout", "--account-for-embedding-in-pipeline-split",
             "--account-for-loss-in-pipeline-split")
FIRST_LAST = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
BF16_LAYERS = ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16")


@dataclass(frozen=True)
class ReadPattern:
    """A hybrid-pattern command line read as its GPT form: ``argv`` the GPT flags on one pipeline rank (``--num-layers``
    of GPT layers, ``--moe-layer-freq`` / ``--mtp-num-layers`` from the pattern, bf16 layer counts halved), ``pp``
    the pipeline ranks, ``counts`` the hybrid layers of each model chunk (model order)."""

    argv: list[str]
    pp: int
    counts: tuple[int, ...]
    model_fields: dict | None = None    # a hybrid model's: its pattern, Mamba-2 mixer and what GPT flags miss


OLD_FLAG = "--hybrid-override-pattern"     # deprecated spelling (core_v0.17 on: kept, copied into FLAG)
HYBRID_SWITCH = "--is-hybrid-model"        # parsed, read by nothing from core_v0.17 (is_hybrid_model: a pattern)


def current_spelling(argv: list[str], rel: Release) -> list[str]:
    """``argv`` as ``validate_args`` of ``rel`` reads its pattern: from core_v0.17 a deprecated
    ``--hybrid-override-pattern`` is copied into ``--hybrid-layer-pattern`` (both given: it asserts), and
    ``--is-hybrid-model`` changes nothing (``is_hybrid_model(args)`` is ``hybrid_layer_pattern is not None``), as in
    NVIDIA's own Nemotron scripts; then the legacy ``--mtp-hybrid-override-pattern P`` with ``--mtp-num-layers N`` >
    0 is appended to a pattern without ``/`` as ``/P`` N times, and otherwise read by nothing (core_v0.17.1
    arguments.py:621-632, core_v0.19.0 :748-759: "kept only for loading old checkpoints"). Before core_v0.17 the
    line is left as it is (refused, one line)."""
    if not rel.has(FLAG) or not any(w.split("=")[0] in (OLD_FLAG, HYBRID_SWITCH, OLD_MTP) for w in argv):
        return argv
    words = _split_eq(argv)
    if OLD_FLAG in words and FLAG in words:
        raise NotExpressible(f"{OLD_FLAG} and {FLAG} cannot both be specified ({rel.label}'s validate_args "
                             f"asserts it); give {FLAG}")
    words = [FLAG if w == OLD_FLAG else w for w in words if w != HYBRID_SWITCH]
    return _mtp_spelling(words) if OLD_MTP in words else words


OLD_MTP = "--mtp-hybrid-override-pattern"    # legacy MTP pattern (core_v0.17 on: converted into FLAG's '/' part)


def _mtp_spelling(words: list[str]) -> list[str]:
    """``words`` with ``OLD_MTP`` converted as ``validate_args`` does (``current_spelling``); argparse's last
    occurrence of each flag wins."""
    def last(flag: str) -> str | None:
        at = [i for i, w in enumerate(words) if w == flag]
        return words[at[-1] + 1] if at and at[-1] + 1 < len(words) and not words[at[-1] + 1].startswith("--") \
            else None
    mtp, pattern, n = last(OLD_MTP), last(FLAG), last("--mtp-num-layers")
    out = _without(words, (OLD_MTP,))
    try:
        depth = int(n) if n is not None else 0
    except ValueError:
        return out                          # the flag reader refuses the value in one line
    if mtp is None or depth <= 0 or (pattern is not None and MTP in pattern):
        return out
    unified = (pattern or "") + MTP + MTP.join([mtp] * depth)
    at = [i for i, w in enumerate(out) if w == FLAG]
    if at:
        out[at[-1] + 1] = unified
    else:
        out += [FLAG, unified]
    return out


def _split_eq(argv: list[str]) -> list[str]:
    return [x for w in argv for x in (w.split("=", 1) if w.startswith("--") and "=" in w else [w])]


def _counts(f, segments: list[str], pp: int) -> tuple[int, ...]:
    """Hybrid layers per model chunk as megatron-core's ``select_pipeline_segment`` places them: the ``|`` segments
    (a multiple of pp of them), else one pattern split evenly over pp, or with ``--decoder-first/last-pipeline-num-
    layers`` (hybrid layers) at the ends and the rest evenly."""
    if len(segments) > 1:
        if any(f.has(x) for x in FIRST_LAST):
            raise NotExpressible(f"{FIRST_LAST[0]} / {FIRST_LAST[1][2:]} with '|' in {FLAG}: Megatron-LM asserts "
                                 "the pipe separators define the layout alone; drop them")
        if len(segments) % pp:
            raise NotExpressible(f"{FLAG} has {len(segments)} '|' segments, not a multiple of "
                                 f"--pipeline-model-parallel-size ({pp}) (Megatron-LM asserts it)")
        return tuple(len(s) for s in segments)
    n = len(segments[0])
    first, last = (f.get(x) for x in FIRST_LAST)
    rest, ranks = n - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if (ranks and rest % ranks) or rest < 0 or (not ranks and rest):
        raise NotExpressible(f"{FLAG}: its {n} hybrid layers without '|' do not split evenly over pp {pp}"
                             + (f" after the first / last stages' {first} / {last}" if first or last else "")
                             + " (megatron-core raises)")
    mid = rest // ranks if ranks else 0
    return tuple([first] if first is not None else []) + (mid,) * ranks + tuple([last] if last is not None else [])


def read_argv(argv: list[str], rel: Release) -> ReadPattern:
    """``ReadPattern`` of a ``pretrain_hybrid.py`` / ``pretrain_mamba.py`` command line (``NotExpressible``: one
    line, e.g. for a Mamba pattern)."""
    from .cmdline import parse_flags
    why = release_refusal(rel)
    if why:
        raise NotExpressible(f"{why}; read the script with --megatron-version 0.17 or newer")
    argv = _split_eq(argv)
    f = parse_flags(argv, rel)
    pattern = f.get(FLAG)
    if pattern is None:
        raise NotExpressible(f"{entry(rel)[0]} without {FLAG}: give the model's pattern")
    if {"M", "G"} & set(pattern.split(MTP)[0]):
        return _read_hybrid_model(argv, f, pattern)
    segments, mtp, depths = gpt_layers(pattern)
    flat = "".join(segments)
    for flag in PIPED_OUT:
        if f.has(flag):
            raise NotExpressible(f"{flag} with {FLAG}: Megatron-LM asserts it away (the pattern's '|' segments give "
                                 "the pipeline layout)")
    if ("E" in flat + (mtp or "")) != f.has("--num-experts") or ("+" in flat) != f.has("--multi-latent-attention"):
        raise NotExpressible(f"{FLAG} {pattern!r}: 'E' layers go with --num-experts and '+' with "
                             "--multi-latent-attention (HybridModel builds them from those settings)")
    pp = f.get("--pipeline-model-parallel-size", 1)
    counts = _counts(f, segments, pp)
    moe = [int(flat[i + 1] == "E") for i in range(0, len(flat), 2)]
    out = _without(argv, ("--spec", FLAG, "--num-layers", "--moe-layer-freq", "--mtp-num-layers", *FIRST_LAST,
                          "--pipeline-model-parallel-size", *BF16_LAYERS))
    out += ["--num-layers", str(len(flat) // 2), "--pipeline-model-parallel-size", "1"]
    out += ["--moe-layer-freq", "[" + ",".join(map(str, moe)) + "]"] if 0 < sum(moe) < len(moe) else []
    out += ["--mtp-num-layers", str(depths)] if depths else []
    for flag in BF16_LAYERS:
        n = f.get(flag)
        if n is not None and n % 2:
            raise NotExpressible(f"{flag} {n}: an odd count of hybrid layers splits a GPT layer's precision")
        out += [flag, str(n // 2)] if n is not None else []
    return ReadPattern(out, pp, counts)


def _read_hybrid_model(argv: list[str], f, pattern: str) -> ReadPattern:
    """A hybrid model's command line (Mamba-2 ``M`` or GDN ``G`` layers): its GPT flags on one rank with ``--num-layers`` the
    pattern's layers, and the model fields GPT flags do not carry (``model_fields``)."""
    from ..layers.hybrid import parse_pattern
    try:
        p = parse_pattern(pattern)
    except ValueError as e:
        raise NotExpressible(f"{FLAG}: {e}") from None
    for flag in PIPED_OUT:
        if f.has(flag) and len(p.segments) > 1:
            raise NotExpressible(f"{flag} with '|' in {FLAG}: Megatron-LM asserts it away (the pattern's '|' "
                                 "segments give the pipeline layout)")
    pp = f.get("--pipeline-model-parallel-size", 1)
    counts = _counts(f, list(p.segments), pp)
    pos = f.value("--position-embedding-type")
    out = _without(argv, ("--spec", FLAG, "--num-layers", "--mtp-num-layers", *FIRST_LAST, *MAMBA_FLAGS, *GDN_FLAGS,
                          "--pipeline-model-parallel-size", "--squared-relu", "--position-embedding-type"))
    out += ["--num-layers", str(len(p.layers)), "--pipeline-model-parallel-size", "1"]
    out += ["--mtp-num-layers", str(p.mtp_depths)] if p.mtp_depths else []
    if pos != "none":
        out += ["--position-embedding-type", pos]
    elif p.mtp_depths:      # the GPT twin's MTP needs rope or none: rope here, 'none' is the model field below
        out += ["--position-embedding-type", "rope"]
    fields = {"hybrid_layer_pattern": pattern.replace(PIPE, "")}
    for symbol, name, read in (("M", "mamba", mamba_of), ("G", "gdn", gdn_of)):
        if symbol in p.layers + (p.mtp or ""):
            try:
                fields[name] = read(f)
            except ValueError as e:
                raise NotExpressible(f"--{name}-*: {str(e).splitlines()[-1].strip()}") from None
    fields.update({"activation": "squared_relu"} if f.has("--squared-relu") else {})
    fields.update({"position_embedding": "none"} if pos == "none" else {})
    return ReadPattern(out, pp, counts, fields)


def hybrid_model(model: ModelSpec, fields: dict, notes: list[str]) -> ModelSpec:
    """The GPT flags' model with a hybrid command line's ``model_fields``, named after the preset it is (or
    ``custom``)."""
    from .model_args import _named
    spec = {**model.model_dump(), "name": "custom", "aceso_db_key": None, "nominal_params_b": None, **fields}
    return _named(spec, notes)


def unit_spans(model: ModelSpec, counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """The plan's chunks of hybrid-layer counts (one unit each), the MTP units in the last."""
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    spans = list(zip(bounds[:-1], bounds[1:]))
    spans[-1] = (spans[-1][0], model.num_units)
    return spans
