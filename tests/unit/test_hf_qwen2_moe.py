"""`aceso models --from-hf` of Qwen2-MoE (model_type qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; their config.json
in tests/unit/data/hf, SOURCES.md there). Before, the type was refused ("model_type 'qwen2_moe' is not supported").

The reference is transformers' Qwen2-MoE (``configuration_qwen2_moe.py`` / ``modular_qwen2_moe.py``): q/k/v biased
by ``qkv_bias`` (default true), no output-projection bias; layer i is MoE when i is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``, its dense layers an MLP of ``intermediate_size``; the router a softmax over all
experts, top-k, renormalized only with ``norm_topk_prob`` (default false); every MoE layer adds a shared expert of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``, a ``hidden -> 1`` linear without
bias. megatron-core has that gate in every supported release (``moe_shared_expert_gate``, ``SharedExpertMLP``:
``output * sigmoid(linear(x, gate_weight))``, gate_weight 1 x h; Megatron-LM ``--moe-shared-expert-gate``; Bridge's
Qwen3-Next provider sets the same field and maps HF's ``mlp.shared_expert_gate.weight`` onto ``gate_weight``).
The gate is priced as what it is, h parameters and 2 s h FLOPs a layer (its time is below the cost model's grain)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from search.cli.import_hf import hf_to_spec
from search.io.errors import AcesoError
from search.layers.moe_params import counts
from search.megatron import megatron_config
from search.megatron.bridge import overrides
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release, tags
from search.spec import model_rules
from search.spec.plan import uniform_plan

DATA = Path(__file__).parent / "data" / "hf"
BRIDGE_FIELDS = json.loads((Path(__file__).parents[2] / "search" / "megatron" / "data" /
                            "bridge_fields_v0.3.1.json").read_text())["fields"]


def config(name: str, **edits) -> dict:
    return {**json.loads((DATA / name / "config.json").read_text()), **edits}


def spec(name: str, **edits):
    return hf_to_spec(config(name, **edits), source=name)


def _attention(h, heads, groups, d):
    """HF Qwen2MoeAttention with its input RMSNorm: q/k/v with biases, o without."""
    q, kv = heads * d, groups * d
    return h * q + 2 * h * kv + q * h + q + 2 * kv + h


def _moe(h, experts, f, shared):
    """HF Qwen2MoeSparseMoeBlock with the post-attention RMSNorm: router, experts, shared expert, its 1-wide gate."""
    return experts * h + experts * 3 * h * f + 3 * h * shared + h + h


@pytest.mark.parametrize("name, h, heads, groups, experts, f, shared, total, active", [
    ("qwen1.5-moe-a2.7b", 2048, 16, 16, 60, 1408, 5632, 14.3, 2.7),
    ("qwen2-57b-a14b", 3584, 28, 4, 64, 2560, 20480, 57.4, 14.0)])
def test_published_configs_import_with_the_gated_shared_expert(name, h, heads, groups, experts, f, shared, total,
                                                               active):
    cfg = config(name)
    m = spec(name)
    e = m.moe
    assert (e.num_experts, e.moe_ffn_hidden_size, e.moe_shared_expert_intermediate_size) == (experts, f, shared)
    assert e.moe_shared_expert_gate and e.moe_router_pre_softmax and e.moe_layer_freq == 1
    assert e.moe_router_topk == cfg["num_experts_per_tok"] and e.moe_aux_loss_coeff == 0.001
    assert m.megatron == {"add_qkv_bias": True, "layernorm_epsilon": 1e-6} and not m.add_bias_linear
    assert m.window_size is None                        # use_sliding_window false
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    by_hand = layers * (_attention(h, heads, groups, h // heads) + _moe(h, experts, f, shared)) + 2 * vocab * h + h
    c = counts(m)
    assert c.total == by_hand
    assert c.total / 1e9 == pytest.approx(total, rel=0.005)
    assert c.active / 1e9 == pytest.approx(active, rel=0.02)


def test_dense_layers_follow_transformers_rule():
    """decoder_sparse_step 2 and mlp_only_layers [1]: layer i is MoE when i is not listed and (i + 1) % 2 == 0 (HF
    Qwen2MoeDecoderLayer); the dense layers are MLPs of intermediate_size."""
    cfg = config("qwen1.5-moe-a2.7b", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[1])
    m = hf_to_spec(cfg)
    assert m.moe.moe_layer_freq == [0, 0, 0, 1, 0, 1]
    h = 2048
    dense = 3 * h * 5632 + h
    assert counts(m).total == 6 * _attention(h, 16, 16, 128) + 4 * dense + 2 * _moe(h, 60, 1408, 5632) + \
        2 * 151936 * h + h


def test_config_switches():
    assert "add_qkv_bias" not in (spec("qwen2-57b-a14b", qkv_bias=False).megatron or {})
    assert not spec("qwen2-57b-a14b", norm_topk_prob=True).moe.moe_router_pre_softmax     # renormalized top-k
    assert spec("qwen2-57b-a14b", router_aux_loss_coef=None).moe.moe_aux_loss_coeff == 0.001   # HF's default
    with pytest.raises(AcesoError, match="use_sliding_window true: transformers' releases slide different") as e:
        spec("qwen2-57b-a14b", use_sliding_window=True)
    assert "\n" not in str(e.value)
    with pytest.raises(AcesoError, match="num_experts"):
        spec("qwen2-57b-a14b", num_experts=None)           # Qwen2MoeConfig's default is 60 experts, not dense


def test_the_gate_is_exported_read_back_and_built():
    """Megatron-LM: ``--moe-shared-expert-gate`` (every release's own flag table), read back to the same model; the
    Bridge YAML states ``model.moe_shared_expert_gate`` (a v0.3.1 provider field); the runtime's TransformerConfig
    fields carry it."""
    m = spec("qwen1.5-moe-a2.7b").model_copy(update={"num_layers": 4, "name": "q"})
    c = megatron_config(uniform_plan(m, 1, 1, 8, 8, 64))
    line = args_line(c, release())
    flags = shlex.split(line)
    assert {"--moe-shared-expert-gate", "--add-qkv-bias", "--moe-router-pre-softmax"} <= set(flags)
    for tag in tags():
        assert release(tag).flags["--moe-shared-expert-gate"].dest == "moe_shared_expert_gate"
    back = read_megatron(line, "run.sh", world_size=8)
    assert back.plan.model.moe == m.moe
    assert not any("shared-expert-gate" in n for n in back.notes)
    model = overrides(c)[1]["model"]
    assert model["moe_shared_expert_gate"] is True and "moe_shared_expert_gate" in BRIDGE_FIELDS["model"]
    assert model_rules.moe_config(m)["moe_shared_expert_gate"] is True


def test_a_gate_without_a_shared_expert():
    """megatron-core builds the gate inside the shared expert only: a spec is refused in one line, an imported
    flag without --moe-shared-expert-intermediate-size is read as no gate, with a note."""
    m = spec("qwen1.5-moe-a2.7b")
    with pytest.raises(ValueError, match="moe_shared_expert_gate gates the shared expert"):
        m.moe.model_validate({**m.moe.model_dump(), "moe_shared_expert_intermediate_size": None})
    plain = m.model_copy(update={"num_layers": 4, "moe": m.moe.model_copy(update={
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False})})
    line = args_line(megatron_config(uniform_plan(plain, 1, 1, 8, 8, 64)), release()) + " --moe-shared-expert-gate"
    back = read_megatron(line, "run.sh", world_size=8)
    assert back.plan.model.moe.moe_shared_expert_gate is False
    assert any("--moe-shared-expert-gate without --moe-shared-expert-intermediate-size" in n for n in back.notes)


def test_a_model_without_the_gate_dumps_as_before():
    from search.spec.presets import load_model
    m = load_model("qwen2-57b-a14b")                  # gated, as its config.json
    assert m.model_dump()["moe"]["moe_shared_expert_gate"] is True
    plain = m.moe.model_copy(update={"moe_shared_expert_gate": False})
    assert "moe_shared_expert_gate" not in plain.model_dump()
    assert counts(m).total - counts(m.model_copy(update={"moe": plain})).total == m.num_layers * m.hidden_size

