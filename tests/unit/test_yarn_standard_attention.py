"""YaRN on standard attention (GPT-OSS's ``rope_scaling``): the Hugging Face import keeps it as the config describes
it, Megatron-LM core_v0.19.0 gets it as ``--position-embedding-type yarn`` with its yarn flags and its script reads
them back, the releases that cannot build it (core_v0.16.1 to core_v0.18.2) and Megatron-Bridge v0.3.1's recipes refuse
it in one line, the aceso runtime runs it, and it costs what plain RoPE costs.

References: openai/gpt-oss-20b's published config.json (tests/unit/data/hf/gpt-oss-20b, SOURCES.md there);
transformers' ``_compute_yarn_parameters`` (what each config key means: ``truncate``, ``mscale`` without
``mscale_all_dim``, ``original_max_position_embeddings`` defaulting to ``max_position_embeddings``); Megatron-LM's
``arguments.py`` / ``argument_utils.py`` at each tag (the flags and defaults, ``versions.py``'s per-release data).
The numbers megatron-core computes from them are compared with transformers' formula in
tests/runtime/test_yarn_oracle.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.cli import main
from search.cli.import_hf import hf_to_spec
from search.io.errors import AcesoError
from search.megatron import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.script import args_line
from search.megatron.versions import release, releases
from search.spec.cluster import parse_cluster
from search.spec.plan import uniform_plan
from search.spec.presets import load_model
from search.targets.capabilities import model_refusal

CONFIG = json.loads((Path(__file__).parent / "data" / "hf" / "gpt-oss-20b" / "config.json").read_text())


def gpt_oss(cfg: dict | None = None, **kw):
    return hf_to_spec(cfg if cfg is not None else CONFIG, source="gpt-oss-20b", **kw)


def small_plan(model, layers: int = 4):
    return uniform_plan(model.model_copy(update={"num_layers": layers}), 2, 1, 4, 4, 16,
                        cluster=parse_cluster("1x8-h100"))


def flags_of(line: str) -> dict[str, str | None]:
    words = line.split()
    return {w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None)
            for i, w in enumerate(words) if w.startswith("--")}


# ----- the import: the model the config describes --------------------------------------------------------------------
def test_gpt_oss_20b_imports_with_its_yarn():
    """The published config imports (it was refused: "YaRN on standard attention"); its rope_scaling is factor 32,
    original 4096, beta 32 / 1 (megatron-core's defaults, left out), truncate false (no rounding), attention factor
    get_mscale(32) (transformers: no mscale / mscale_all_dim -> megatron-core's mscale 1, mscale_all_dim 0)."""
    m = gpt_oss()
    assert m.rope_scaling.model_dump(exclude_none=True) == {"type": "yarn", "factor": 32.0,
                                                           "correction_range_round_to_int": False}
    assert [m.rope_scaling.yarn(k) for k in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                             "mscale_all_dim")] == [4096, 32.0, 1.0, 1.0, 0.0]
    assert m.mla is None and m.rotary_base == 150000 and m.rotary_percent == 1.0


def test_every_other_field_is_the_presets():
    """Field by field, the import is the gpt-oss-20b preset (sinks, sliding window on alternate layers [127, 0],
    quick-GEGLU clamped at 7, biases, 32 experts top-4, vocabulary) plus the YaRN the preset leaves out (it stands
    for the published Megatron-LM runs, which train plain RoPE)."""
    m, p = gpt_oss(seq_length=4096).model_dump(), load_model("gpt-oss-20b").model_dump()
    diff = {k for k in set(m) | set(p) if m.get(k) != p.get(k)}
    assert diff == {"name", "nominal_params_b", "rope_scaling"}, diff
    assert (m["window_size"], m["window_attn_skip_freq"], m["softmax_type"]) == ([127, 0], 2, "learnable")


def test_hf_yarn_keys_mean_what_transformers_computes():
    """transformers' _compute_yarn_parameters: original_max_position_embeddings defaults to the config's
    max_position_embeddings (not 4096); mscale without mscale_all_dim is ignored (attention factor get_mscale(factor)
    = megatron-core's mscale 1 / mscale_all_dim 0); both set: their ratio; beta 0 means the default; truncate true
    (the default) rounds, as megatron-core does by default."""
    scaling = {"rope_type": "yarn", "factor": 4.0}
    base = {**CONFIG, "max_position_embeddings": 40960, "rope_scaling": scaling}
    assert gpt_oss(base).rope_scaling.yarn("original_max_position_embeddings") == 40960
    m = gpt_oss({**base, "rope_scaling": {**scaling, "mscale": 0.707}}).rope_scaling
    assert (m.yarn("mscale"), m.yarn("mscale_all_dim")) == (1.0, 0.0)
    m = gpt_oss({**base, "rope_scaling": {**scaling, "mscale": 0.707, "mscale_all_dim": 0.5}}).rope_scaling
    assert (m.yarn("mscale"), m.yarn("mscale_all_dim")) == (0.707, 0.5)
    m = gpt_oss({**base, "rope_scaling": {**scaling, "beta_fast": 0, "truncate": True}}).rope_scaling
    assert (m.yarn("beta_fast"), m.correction_range_round_to_int) == (32.0, None)


@pytest.mark.parametrize("change, words", [
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor 0.5", "ignores rotary_percent"]),
    ({"rope_scaling": {**CONFIG["rope_scaling"], "attention_factor": 1.2}}, ["attention_factor"]),
])
def test_what_megatron_core_computes_otherwise_is_refused(change, words):
    with pytest.raises(AcesoError) as e:
        gpt_oss({**CONFIG, **change})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_mla_yarn_that_megatron_core_rounds_or_scales_otherwise_is_refused():
    ds = json.loads((Path(__file__).parent / "data" / "hf" / "deepseek-v3" / "config.json").read_text())
    with pytest.raises(AcesoError, match=r"rope_scaling\.truncate false: multi-latent attention's"):
        hf_to_spec({**ds, "rope_scaling": {**ds["rope_scaling"], "truncate": False}}, source="ds")
    no_mscale = {k: v for k, v in ds["rope_scaling"].items() if k != "mscale"}
    with pytest.raises(AcesoError, match=r"rope_scaling\.mscale_all_dim \(1, no mscale\)"):
        hf_to_spec({**ds, "rope_scaling": no_mscale}, source="ds")
    spec = load_model("deepseek-v3").model_dump()
    spec["rope_scaling"]["correction_range_round_to_int"] = False
    with pytest.raises(ValueError, match="always rounds the correction range"):
        type(load_model("deepseek-v3")).model_validate({**spec, "name": "custom", "aceso_db_key": None})


# ----- Megatron-LM: core_v0.19.0 writes and reads it; older releases refuse -----------------------------------------
def test_core_v0_19_writes_the_yarn_flags_and_reads_them_back():
    plan = small_plan(gpt_oss())
    rel = release("0.19")
    line = args_line(megatron_config(plan), rel)
    f = flags_of(line)
    assert f["--position-embedding-type"] == "yarn" and "--rope-type" not in f and "--use-rope-scaling" not in f
    assert {k: f[k] for k in ("--rotary-scaling-factor", "--yarn-original-max-position-embeddings",
                              "--yarn-beta-fast", "--yarn-beta-slow", "--mscale", "--mscale-all-dim")} == {
        "--rotary-scaling-factor": "32.0", "--yarn-original-max-position-embeddings": "4096",
        "--yarn-beta-fast": "32.0", "--yarn-beta-slow": "1.0", "--mscale": "1.0", "--mscale-all-dim": "0.0"}
    assert "--no-yarn-correction-range-round-to-int" in f and "--yarn-correction-range-round-to-int" not in f
    assert all(rel.has(k) for k in f)
    back = read_megatron(line, world_size=8, version="0.19").plan.model
    assert back.rope_scaling == plan.model.rope_scaling and back.position_embedding == "rope"
    rounded = plan.model.model_copy(update={"rope_scaling": plan.model.rope_scaling.model_copy(
        update={"correction_range_round_to_int": None, "beta_slow": 2.0})})
    line = args_line(megatron_config(small_plan(rounded)), rel)
    assert "--yarn-correction-range-round-to-int" in flags_of(line)
    assert read_megatron(line, world_size=8, version="0.19").plan.model.rope_scaling == rounded.rope_scaling


def test_the_releases_before_core_v0_19_refuse_it_in_one_line(tmp_path, capsys):
    """core_v0.16.1 / core_v0.17.1 reject --position-embedding-type yarn (argparse choices; their data has no
    yarn flags), core_v0.18.2 takes the type but sets no yarn_* attribute (tests/runtime/test_yarn_oracle.py runs
    each parser): the export names the field and the release to give, exits 2 and writes nothing."""
    plan = small_plan(gpt_oss())
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    for rel in releases():
        has = rel.has("--yarn-beta-fast")
        assert has is (rel.version >= (0, 19)), rel.tag
        out = tmp_path / f"{rel.series}.sh"
        code = main(["export", str(path), "--to", "megatron-lm", "--megatron-version", rel.series, "-o", str(out)])
        err = capsys.readouterr().err
        if has:
            assert code == 0 and "--position-embedding-type yarn" in out.read_text().replace('\n', ' ')
            continue
        assert code == 2 and not out.exists() and err.count("\n") == 1 and "Traceback" not in err, err
        assert "model.rope_scaling (type yarn, standard attention)" in err and "--megatron-version 0.19" in err
        assert rel.tag in err
    line = args_line(megatron_config(plan), release("0.19"))
    with pytest.raises(AcesoError, match="--megatron-version 0.19"):
        read_megatron(line.replace(" --yarn-original-max-position-embeddings 4096", "").replace(
            " --yarn-beta-fast 32.0 --yarn-beta-slow 1.0", "").replace(
            " --no-yarn-correction-range-round-to-int", ""), world_size=8, version="0.18")


def test_mtp_with_yarn_is_refused_as_validate_args_asserts():
    m = gpt_oss().model_copy(update={"num_layers": 4, "mtp_num_layers": 1})
    with pytest.raises(AcesoError, match=r"mtp_num_layers \(1\).*position embedding rope or none"):
        args_line(megatron_config(small_plan(m)), release("0.19"))


# ----- Bridge, the runtime, the price --------------------------------------------------------------------------------
def test_bridge_runs_gpt_oss_yarn_and_refuses_the_others_before_any_search(tmp_path, capsys):
    """GPT-OSS's YaRN is exported for Bridge's GPT-OSS recipe, whose provider holds the yarn_* fields
    (tests/unit/test_bridge_gpt_oss_yarn.py); a Llama with YaRN (the Llama recipe's provider has none) is refused for
    Bridge; the aceso runtime builds it (tests/runtime/test_yarn_runtime.py)."""
    m = gpt_oss()
    assert model_refusal("megatron-bridge", m) is None and model_refusal("megatron-lm", m) is None
    llama = load_model("llama3-8b").model_dump()      # a Llama with YaRN: another recipe's provider
    llama = type(m).model_validate({**llama, "name": "custom", "aceso_db_key": None,
                                    "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert model_refusal("aceso", llama) is None       # the runtime builds it (tests/runtime/test_yarn_runtime.py)
    assert model_refusal("aceso", m) is None           # GPT-OSS with its YaRN and biased experts too
    assert "only the GPT-OSS recipes' provider holds the yarn_* fields" in model_refusal("megatron-bridge", llama)
    assert model_refusal("megatron-bridge", llama.model_copy(update={"rope_scaling": None})) is None
    for model, code in ((m, 0), (llama.model_copy(update={"num_layers": 4}), 2)):
        path, out = tmp_path / f"plan{code}.json", tmp_path / f"b{code}.yaml"
        path.write_text(small_plan(model).to_json())
        assert main(["export", str(path), "--to", "megatron-bridge", "-o", str(out)]) == code
        err = capsys.readouterr().err
        if code == 0:
            assert "position_embedding_type: yarn" in out.read_text()
        else:
            assert err.count("\n") == 1 and not out.exists() and "yarn_* fields" in err


def test_yarn_costs_what_rope_costs():
    """The rotary tables are built once per length and the attention factor scales cos / sin: time and memory of
    every stage are plain RoPE's."""
    from search.pricing.plan_price import price
    yarn = small_plan(gpt_oss(), layers=8)
    rope = small_plan(gpt_oss().model_copy(update={"rope_scaling": None}), layers=8)
    a, b = price(yarn, "megatron-lm"), price(rope, "megatron-lm")
    assert a.iteration_ms == b.iteration_ms and a.max_memory_mb == b.max_memory_mb
    assert [s.memory_mb for s in a.stages] == [s.memory_mb for s in b.stages]
