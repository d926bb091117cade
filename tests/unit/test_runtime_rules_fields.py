"""The runtime's refusal lines (``search/targets/runtime_rules.py``, the runtime column of the capability table) name the
plan field a user edits, as plan schema v4 names it, and are written there only (issue 35).

Each rule is triggered by a plan (or model) made for it; the line must start with a field path (``settings.X``,
``model.X``, ``stages[i].X``), and every field path in it must resolve against ``ParallelPlan``'s schema (before,
the lines named pre-v4 top-level fields: ``moe.token_dispatcher``, ``megatron_fsdp``, ``activation_offload``,
``tp_comm_overlap``, ``stack``, and ``precision fp16``, which no plan has). And no other module of the planner or
the runtime holds a copy of a line's text: the runtime's entry check asks these functions (before, its fast paths
and the GPT-OSS layer check had their own copies)."""

from __future__ import annotations

import ast
import json
import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from search.targets import runtime_rules as rt
from search.targets.capabilities import Device
from search.spec.cluster import parse_cluster
from search.spec.model import ModelSpec
from search.layers.moe_spec import MLASpec, MoESpec
from search.spec.plan import ParallelPlan, uniform_plan
from search.settings.precision import LowPrecision
from search.settings.optimizer_state import PrecisionAwareOptimizer
from tests.conftest import ROOT
from tests.tiny_models import HYBRID, LLAMA, T5

MOE = LLAMA.model_copy(update={"name": "tiny-moe", "moe": MoESpec(num_experts=4, moe_router_topk=2,
                                                                  moe_ffn_hidden_size=32)})
MTP = MOE.model_copy(update={"mtp_num_layers": 1})
MLA = MOE.model_copy(update={"num_query_groups": None, "mla": MLASpec(kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)})
CPU, CUDA, CUDA_TE = Device(cuda=False, te=False), Device(cuda=True, te=None), Device(cuda=True, te=True)
FIELD = r"(?:settings|model|stages\[\d+\])(?:\.\w+(?:\[\d+\])?)*"


def plan(model=LLAMA, tp=1, dp=1, settings=None, stage=None, stages=None, gpu="cpu") -> ParallelPlan:
    raw = json.loads(uniform_plan(model, 1, tp, dp, 2 * dp, 4 * dp, cluster=parse_cluster(f"1x{tp * dp}-{gpu}"),
                                  sequence_parallel=tp > 1).to_json())
    raw["settings"].update(settings or {})
    raw["stages"][0].update(stage or {})
    if stages is not None:
        raw["stages"] = stages
    n = sum(st["num_gpus"] for st in raw["stages"])
    raw["cluster"] = parse_cluster(f"1x{n}-{gpu}").model_dump()
    return ParallelPlan.model_validate(raw)


def _chunks(*spans):
    return [{"num_gpus": 1, "tp": 1, "dp": 1, "chunks": [{"start_unit": a, "end_unit": b, "recompute": ["none"] * (b - a)}
                                                         for a, b in pair]} for pair in spans]


def _recompute(model, k, choice):
    rc = ["none"] * model.num_units
    rc[k] = choice
    return {"chunks": [{"start_unit": 0, "end_unit": model.num_units, "recompute": rc}]}


LOW = LowPrecision(recipe="fp8-tensorwise")
H100 = parse_cluster("1x1-h100").gpu

# rule -> its arguments (a refused case each)

CASES = {
    "low_precision": (rt.low_precision, (LLAMA, LOW)),
    "latent_moe": (rt.latent_moe, (MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"moe_latent_size": 64})}),
                                   None)),
    "layers_cp mamba": (rt.layers_cp, (plan(HYBRID, stage={"cp": 2, "num_gpus": 2}), CUDA_TE)),
    "layers_cp gdn": (rt.layers_cp, (plan(ModelSpec.model_validate({**HYBRID.model_dump(), "mamba": None, "gdn": {
        "linear_num_key_heads": 2, "linear_num_value_heads": 4}, "hybrid_layer_pattern": "G*EG-E"}),
        stage={"cp": 2, "num_gpus": 2}), CUDA_TE)),
    "t5_rope": (rt.t5_rope, (T5.model_copy(update={"position_embedding": "rope"}), None)),
    "fp16_on_gpu": (rt.fp16_on_gpu, ("fp16", H100)),
    "fp16_loss_scaling": (rt.fp16_loss_scaling, ("fp16",)),
    "activation_offload": (rt.activation_offload, (plan(settings={"activation_offload": {"num_layers": 1}}), CUDA)),
    "megatron_fsdp no_shard": (rt.megatron_fsdp, (plan(dp=2, settings={"megatron_fsdp": {
        "data_parallel_sharding_strategy": "no_shard"}}), CUDA)),
    "megatron_fsdp moe tp": (rt.megatron_fsdp, (plan(MOE, tp=2, dp=2, settings={
        "megatron_fsdp": {"data_parallel_sharding_strategy": "optim_grads_params"}}), CUDA)),
    "overlap_ep": (rt.overlap_ep, (plan(MOE.model_copy(update={"params_dtype": "bf16"}), dp=2, stage={"ep": 2},
                                        settings={"moe": {"overlap_ep_comm": True}}), CUDA)),
    "mla_mtp vpp": (rt.mla_mtp, (plan(MTP, stages=_chunks(((0, 1), (2, 3)), ((1, 2), (3, MTP.num_units)))), CPU)),
    "mla_mtp cp": (rt.mla_mtp, (plan(MTP, stage={"cp": 2, "num_gpus": 2}), CUDA_TE)),
    "mla_mtp recompute": (rt.mla_mtp, (plan(MTP, stage=_recompute(MTP, MTP.num_units - 1, "full")), CPU)),
    "mla_mtp attn_dropout": (rt.mla_mtp, (plan(MLA, stage=_recompute(MLA, 0, "attn_dropout")), CPU)),
    "flex_on_cpu": (rt.flex_on_cpu, (plan(MOE, dp=2, stage={"ep": 2}, settings={"moe": {"token_dispatcher": "flex"}}),
                                     CPU)),
    "expert_tp_alltoall_on_cpu": (rt.expert_tp_alltoall_on_cpu, (plan(MOE, tp=2, stage={"etp": 2}), CPU)),
    "grouped_gemm_without_te": (rt.grouped_gemm_without_te, (plan(MOE, dp=2, stage={"ep": 2}, settings={
        "moe": {"grouped_gemm": True}}), Device(cuda=True, te=False))),
    "tp_comm_overlap no te": (rt.tp_comm_overlap, (plan(tp=2, settings={"tp_comm_overlap": True}), CPU)),
    "tp_comm_overlap domains": (rt.tp_comm_overlap, (plan(stages=[
        {"num_gpus": 2, "tp": 2, "dp": 1, "sequence_parallel": True, "start_unit": 0, "end_unit": 2,
         "recompute": ["none"] * 2},
        {"num_gpus": 1, "tp": 1, "dp": 1, "start_unit": 2, "end_unit": 4, "recompute": ["none"] * 2}],
        settings={"tp_comm_overlap": True}, tp=2), CUDA_TE)),
    "stack_features": (rt.stack_features, (plan(settings={"stack": {"cross_entropy_fusion": "te"}}), CUDA)),
    "optimizer": (rt.optimizer, (plan(settings={"optimizer": "muon"}), CUDA)),
    "precision_aware_refusal": (rt.precision_aware_refusal, (PrecisionAwareOptimizer(exp_avg_dtype="bf16"),)),
    "data_parallel": (rt.data_parallel, (plan(settings={"data_parallel": {"sharp": True}}), CUDA)),
    "overlap_p2p": (rt.overlap_p2p, (plan(stages=_chunks(((0, 1), (2, 3)), ((1, 2), (3, 4))),
                                          settings={"overlap_p2p_comm": True}), CUDA)),
}


def resolve(path: str) -> None:
    """Walk ``path`` (``settings.moe.grouped_gemm``, ``stages[0].chunks[1].recompute[2]``) through the schema's
    pydantic models from ``ParallelPlan``; AssertionError naming the first part that is no field."""
    cls: typing.Any = ParallelPlan
    for part in path.split("."):
        name = part.split("[")[0]
        assert isinstance(cls, type) and issubclass(cls, BaseModel), f"{path}: {name} is inside a leaf field"
        assert name in cls.model_fields, f"{path}: {cls.__name__} has no field {name!r}"
        cls = _inner(cls.model_fields[name].annotation)


def _inner(t):
    """The model class a field holds (through Optional, list and Annotated), else the type itself."""
    for _ in range(4):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        if typing.get_origin(t) in (typing.Union, types.UnionType, list, typing.Annotated) and args:
            t = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0])
        else:
            return t
    return t


def test_every_rule_is_triggered_here():
    rules = {n for n, f in vars(rt).items() if callable(f) and getattr(f, "__module__", "") == rt.__name__
             and not n.startswith("_") and n != "optimizer_refusal"}
    assert rules == {f.__name__ for f, _ in CASES.values()}


@pytest.mark.parametrize("name", CASES)
def test_each_line_starts_with_the_field_a_user_edits(name):
    rule, args = CASES[name]
    line = rule(*args)
    assert line is not None and "\n" not in line, (name, line)
    lead = re.match(FIELD, line)
    assert lead is not None and "." in lead.group(0), f"{name}: the line does not start with a plan field: {line}"
    for path in re.findall(FIELD, line):
        if "." in path:
            resolve(path)


def test_the_resolver_refuses_pre_v4_names():
    """The check itself: the names the lines used before schema v4's settings are no plan fields."""
    for old in ("moe.token_dispatcher", "megatron_fsdp", "tp_comm_overlap", "stack", "activation_offload"):
        with pytest.raises(AssertionError):
            resolve(old)
    resolve("settings.moe.token_dispatcher")
    resolve("stages[0].chunks[1].recompute[2]")
    resolve("model.moe.moe_router_enable_expert_bias")


def _strings(path: Path) -> list[str]:
    """The module's string literals as Python joins them (implicit concatenation, f-string literal parts), its
    docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None}
    return [n.value.strip() for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_each_refusal_text_is_written_once():
    """No module of the planner, the runtime, the model specs, patches or launch repeats a piece (40 characters or
    more) of a runtime refusal line (before: fast_path.py's TP-overlap line, layer_variants.py's GPT-OSS line)."""
    home = ROOT / "search" / "targets" / "runtime_rules.py"
    pieces = {p for p in _strings(home) if len(p) >= 40}
    assert len(pieces) > 15
    copies = []
    for pkg in ("search", "aceso_megatron", "model_specs", "patches", "launch"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if f != home:
                texts = _strings(f)
                copies += [(str(f.relative_to(ROOT)), p) for p in pieces if any(p in t for t in texts)]
    assert not copies, copies
