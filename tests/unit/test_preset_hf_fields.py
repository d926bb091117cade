"""Every preset with a published Hugging Face config.json is what `aceso import-hf` makes of that config, field by
field: a preset that differs trains another model than the one its name promises (DeepSeek-V3, Qwen3 and Kimi-K2
ran megatron-core's RMSNorm epsilon 1e-5 where their configs say 1e-6; DeepSeek-V3 and Kimi-K2 ran plain RoPE where
their configs and NVIDIA's published runs use YaRN; Mixtral-8x7B's router aux-loss coefficient was 0.01 where its
config says 0.02).

The references are the configs themselves: the whole config.json files in tests/unit/data/hf (SOURCES.md there) and
the architecture fields of tests/unit/data/hf_moe_configs.json (its ``_source`` names each origin)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.cli.import_hf import hf_to_spec
from search.spec.presets import load_model

DATA = Path(__file__).parent / "data"
# whole config.json (tests/unit/data/hf/NAME/config.json) -> the presets of that model (and what a preset changes:
# deepseek-v3-no-mtp is the same model without its MTP layer)
WHOLE = {"deepseek-v3": {"deepseek-v3": {}, "deepseek-v3-no-mtp": {"num_nextn_predict_layers": 0}},
         "qwen3-30b-a3b": {"qwen3-30b-a3b": {}}, "mixtral-8x7b": {"mixtral-8x7b": {}},
         "qwen2-57b-a14b": {"qwen2-57b-a14b": {}},
         # meta-llama/Meta-Llama-3-8B's config.json is Llama-3.1-8B's without 3.1's llama3 RoPE scaling and with an
         # 8192-token context (the same rope_theta 500000 and rms_norm_eps 1e-5)
         "llama-3.1-8b": {"llama3-8b": {"rope_scaling": None, "max_position_embeddings": 8192}}}
TRANSCRIBED = json.loads((DATA / "hf_moe_configs.json").read_text())
# what a preset holds on purpose that its config does not say (documented in model_specs/presets/SOURCES-moe.md)
NOT_THE_CONFIGS = {
    # GPT-OSS: plain RoPE as the published Megatron-LM rows run it (the import keeps the config's YaRN, which
    # Megatron-LM builds from core_v0.19.0 on: tests/unit/test_yarn_standard_attention.py)
    "gpt-oss-120b": {"drop": ("rope_scaling",)}, "gpt-oss-20b": {"drop": ("rope_scaling",)},
    # Kimi-K2's YaRN beta_fast 1.0: no Megatron-LM release has a flag for it (--beta-fast), so the preset keeps
    # megatron-core's 32.0, which every Megatron-LM run of it uses
    "kimi-k2": {"yarn": {"beta_fast": None}},
}
# the preset's own name and published size are not the config's
NAMES = ("name", "nominal_params_b")


def _compare(imported, preset) -> list[tuple[str, object, object]]:
    a, b = imported.model_dump(), preset.model_dump()
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k not in NAMES and a.get(k) != b.get(k)]


def _imported(cfg: dict, preset_name: str):
    fix = NOT_THE_CONFIGS.get(preset_name, {})
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in fix.get("drop", ())}
    m = hf_to_spec(cfg, source=preset_name, seq_length=load_model(preset_name).seq_length)
    if "yarn" in fix:
        m = m.model_copy(update={"rope_scaling": m.rope_scaling.model_copy(update=fix["yarn"])})
    return m


@pytest.mark.parametrize("hf, preset", [(h, p) for h, ps in WHOLE.items() for p in ps])
def test_preset_is_its_whole_config(hf, preset):
    cfg = {**json.loads((DATA / "hf" / hf / "config.json").read_text()), **WHOLE[hf][preset]}
    assert _compare(_imported(cfg, preset), load_model(preset)) == []


@pytest.mark.parametrize("preset", sorted(k for k in TRANSCRIBED if not k.startswith("_")))
def test_preset_is_its_transcribed_config(preset):
    assert _compare(_imported(TRANSCRIBED[preset], preset), load_model(preset)) == []


@pytest.mark.parametrize("preset, eps", [("deepseek-v3", 1e-6), ("deepseek-v3-no-mtp", 1e-6), ("kimi-k2", 1e-6),
                                         ("qwen3-30b-a3b", 1e-6), ("qwen3-235b-a22b", 1e-6),
                                         ("qwen2-57b-a14b", 1e-6), ("mixtral-8x7b", None), ("llama3-8b", None)])
def test_norm_epsilon_reaches_megatron_lm(preset, eps):
    """The config's rms_norm_eps (None: megatron-core's 1e-5) is what the exported command line states, read by
    Megatron-LM core_v0.16.1's own flag table (``--norm-epsilon``, default 1e-5)."""
    from search.megatron import megatron_config
    from search.megatron.script import args_line
    from search.spec.cluster import parse_cluster
    from search.spec.plan import uniform_plan
    m = load_model(preset).model_copy(update={"num_layers": 8, "mtp_num_layers": None})
    plan = uniform_plan(m, 2, 2, 1, 1, 8, cluster=parse_cluster("1x4-h100"), sequence_parallel=True)
    flags = args_line(megatron_config(plan)).split()
    stated = float(flags[flags.index("--norm-epsilon") + 1]) if "--norm-epsilon" in flags else 1e-5
    assert stated == (eps or 1e-5)


@pytest.mark.parametrize("preset, factor", [("deepseek-v3", 40.0), ("kimi-k2", 32.0)])
def test_yarn_of_the_published_runs(preset, factor):
    """NVIDIA's published DeepSeek-V3 and Kimi-K2 runs pass --rotary-scaling-factor 40 / 32 with --mscale 1.0
    --mscale-all-dim 1.0 (../shared/published/megatron-bridge-26.02-26.04.json's args); the preset runs the same."""
    import os
    rows = "/work/shared/published/megatron-bridge-26.02-26.04.json"
    if not os.path.exists(rows):
        pytest.skip(f"{rows} is not here")
    args = next(r["args"] for r in json.load(open(rows))["rows"] if r["model"] == preset and r.get("args"))
    flags = args.split()
    assert float(flags[flags.index("--rotary-scaling-factor") + 1]) == factor
    rs = load_model(preset).rope_scaling
    assert (rs.type, rs.factor, rs.yarn("mscale"), rs.yarn("mscale_all_dim")) == ("yarn", factor, 1.0, 1.0)
