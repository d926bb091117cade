"""Our ``ParallelPlan`` <-> the reference's op-level config (``aceso export`` / ``aceso import``).

Export: each stage's units become their ops (``ops.OpLayout``: attention = layer ops 0-7, MLP = ops 8-12; T5
decoder: self-attention 0-7, cross-attention 8-15, MLP 16-20; glue ops with their neighbours), every op takes the
stage's tp and dp and algo 0, and a unit's recompute choice becomes its op flags (selective: attention core /
gelu; full: every op of the unit).

Import: the stage boundaries must fall on unit boundaries (for T5, moving only the encoder's final layernorm or
the decoder embedding across the encoder/decoder boundary still counts as that boundary); otherwise an error
names the stage, or with ``snap`` each boundary moves to the nearest unit boundary (the earlier one on a tie).
Each stage needs one tp/dp for all its ops and algo 0. Op flags that are not exactly a unit's none / selective /
full pattern map to the smallest choice that covers them (e.g. the reference's [GEMM-1, gelu] -> full).
"""

from __future__ import annotations

import pydantic

from model_specs import presets as model_presets

from search.spec.cluster import ClusterSpec
from search.io.errors import AcesoError, as_aceso_error
from search.spec.model import ModelSpec
from search.spec.plan import RECOMPUTE_CHOICES, ParallelPlan, StageSpec
from search.spec.presets import load_model
from .ops import OpLayout, layout_for_model
from .refconfig import RefConfig, parse_ref_config

RC_CODE = {name: i for i, name in enumerate(RECOMPUTE_CHOICES)}


def split_db_key(model: ModelSpec) -> tuple[str, str]:
    if not model.aceso_db_key or "_" not in model.aceso_db_key:
        raise AcesoError(f"model {model.name} has no aceso_db_key; the reference format covers the Aceso presets "
                         "(gpt-350m ... gpt-13b, t5-770m ... t5-22b)")
    name, size = model.aceso_db_key.split("_", 1)
    return name, size


def _model_fields(model: ModelSpec) -> dict:
    if model.is_t5:
        if model.num_decoder_layers != model.num_layers:
            raise AcesoError(f"model {model.name}: the reference format has one num_layers for encoder and decoder, "
                             f"but this model has {model.num_layers} and {model.num_decoder_layers}")
        return {"num_layers": model.num_layers, "encoder_seq_length": model.seq_length,
                "decoder_seq_length": model.decoder_seq_length,
                "max_position_embeddings": max(model.seq_length, model.decoder_seq_length),
                "num_attention_heads": model.num_attention_heads, "kv_channels": model.head_dim,
                "hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_hidden_size}
    return {"num_layers": model.num_layers, "seq_length": model.seq_length,
            "max_position_embeddings": model.seq_length, "num_attention_heads": model.num_attention_heads,
            "hidden_size": model.hidden_size}


def plan_to_ref(plan: ParallelPlan) -> RefConfig:
    """The reference config of a plan (every op of a stage at the stage's tp/dp, algo 0)."""
    model = plan.model
    name, size = split_db_key(model)
    layout = layout_for_model(model)
    num_ops, tp, dp, rc, algo = [], [], [], [], []
    for st in plan.stages:
        ops = layout.stage_ops(st.start_unit, st.end_unit)
        flags = layout.op_flags(st.start_unit, st.end_unit, [RC_CODE[c] for c in st.recompute])
        num_ops.append(len(ops))
        tp.append([st.tp] * len(ops))
        dp.append([st.dp] * len(ops))
        rc.append([int(f) for f in flags])
        algo.append([0] * len(ops))
    raw = {"model_name": name, "model_size": size, **_model_fields(model),
           "global_batch_size": plan.global_batch_size, "micro_batch_size": plan.micro_batch_size,
           "num_stages": plan.num_stages, "num_gpus": [st.num_gpus for st in plan.stages],
           "checkpoint_activations": [any(r) for r in rc], "resharding_stages": [False] * plan.num_stages,
           "num_ops_in_each_stage": num_ops, "model_parallel_size_of_each_op": tp,
           "data_parallel_size_of_each_op": dp, "recompute_ops": rc, "algo_of_each_op": algo}
    return parse_ref_config(raw, src="exported plan")


def model_for_key(key: str, num_layers: int) -> ModelSpec:
    """The preset whose ``aceso_db_key`` is ``key``, at ``num_layers``."""
    for preset in model_presets.preset_names():
        data = model_presets.preset_data(preset)
        if data.get("aceso_db_key") == key:
            layers = data["num_layers"]
            return load_model(preset, num_layers=None if num_layers == layers else num_layers)
    raise AcesoError(f"model_name/model_size {key}: no preset has this aceso_db_key; see `aceso models`")


def _boundary_units(layout: OpLayout, model: ModelSpec) -> dict[int, int]:
    """op index of a stage start -> unit index, for every accepted unit boundary."""
    ok = {layout.bounds[u]: u for u in range(1, layout.num_units)}
    if model.is_t5:  # the glue ops between encoder and decoder may sit on either side
        u = model.num_encoder_units
        ok[layout.bounds[u] - 1] = u
        ok[layout.bounds[u] + 1] = u
    return ok


def _stage_units(cfg: RefConfig, layout: OpLayout, model: ModelSpec, snap: bool, src: str,
                 notes: list[str]) -> list[int]:
    accepted = _boundary_units(layout, model)
    cuts = [0]
    for i in range(1, cfg.num_stages):
        x = cfg.stage_op_start(i)
        if x in accepted:
            cuts.append(accepted[x])
            continue
        lo = max(u for u in range(layout.num_units) if layout.bounds[u] <= x)
        hi = lo + 1
        if not snap:
            raise AcesoError(f"{src}: stage {i - 1} ends inside unit {lo} ({layout.unit_kinds[lo]}): stage {i} "
                             f"starts at op {x} ({layout.names[x]}); move the boundary to op {layout.bounds[lo]} "
                             f"or {layout.bounds[hi]} (unit boundaries), or pass --snap")
        u = lo if x - layout.bounds[lo] <= layout.bounds[hi] - x else hi
        notes.append(f"stage {i} start moved from op {x} to op {layout.bounds[u]} (unit {u})")
        cuts.append(u)
    cuts.append(layout.num_units)
    for i in range(cfg.num_stages):
        if cuts[i + 1] <= cuts[i]:
            raise AcesoError(f"{src}: stage {i} holds no whole unit{' after snapping' if snap else ''}; "
                             "merge it with a neighbouring stage")
    return cuts


def ref_to_plan(cfg: RefConfig, snap: bool = False, cluster: ClusterSpec | None = None,
                src: str = "config") -> tuple[ParallelPlan, list[str]]:
    """Our plan for a reference config, and notes on what was approximated (snapped boundaries, recompute)."""
    model = model_for_key(cfg.key, cfg.num_layers)
    for field in ("hidden_size", "num_attention_heads"):
        if field in cfg.raw and cfg.raw[field] != getattr(model, field):
            raise AcesoError(f"{src}: {field} ({cfg.raw[field]}) differs from the {model.name} preset "
                             f"({getattr(model, field)}); the config is not for this model")
    layout = layout_for_model(model)
    if sum(cfg.num_ops) != layout.num_ops:
        raise AcesoError(f"{src}: num_ops_in_each_stage adds up to {sum(cfg.num_ops)} ops, but {cfg.key} with "
                         f"{cfg.num_layers} layers has {layout.num_ops}")
    for i in range(cfg.num_stages):
        if len(set(cfg.tp[i])) > 1 or len(set(cfg.dp[i])) > 1:
            raise AcesoError(f"{src}: stage {i} mixes tp {sorted(set(cfg.tp[i]))} / dp {sorted(set(cfg.dp[i]))} "
                             "across its ops; our plans have one tp and dp per stage")
        if any(cfg.algo[i]):
            k = cfg.algo[i].index(1)
            raise AcesoError(f"{src}: stage {i} op {k} uses algo 1; our plans use Megatron's layout (algo 0)")
    notes: list[str] = []
    cuts = _stage_units(cfg, layout, model, snap, src, notes)
    flat = [f for row in cfg.recompute for f in row]
    codes = layout.unit_choice(flat)
    inexact = sum(1 for u, c in enumerate(codes)
                  if [flat[k] for k in layout.unit_ops(u)] != list(layout.flag_patterns[c, list(layout.unit_ops(u))]))
    if inexact:
        notes.append(f"{inexact} unit(s) had op recompute flags that are not exactly none/selective/full; "
                     "each took the smallest choice that covers its flags")
    stages = []
    for i in range(cfg.num_stages):
        a, b = cuts[i], cuts[i + 1]
        stages.append({"num_gpus": cfg.num_gpus[i], "tp": cfg.tp[i][0], "dp": cfg.dp[i][0], "start_unit": a,
                       "end_unit": b, "recompute": [RECOMPUTE_CHOICES[c] for c in codes[a:b]]})
    try:
        plan = ParallelPlan(model=model, cluster=cluster, micro_batch_size=cfg.micro_batch_size,
                            global_batch_size=cfg.global_batch_size,
                            stages=[StageSpec(**s) for s in stages])
    except pydantic.ValidationError as e:
        raise AcesoError(f"{src}: " + str(as_aceso_error(e))) from None
    return plan, notes
