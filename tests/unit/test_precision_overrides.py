"""Per-module precision overrides (megatron-core --te-precision-config-file): the matcher semantics of
``quantization/quant_config.py`` and ``extensions/transformer_engine.py`` (core_v0.16.1 - core_v0.19.0), the YAML,
the pricing of each linear at its own recipe, the import and the exports."""

import json
import shlex

import pytest
import yaml

from search.io.errors import AcesoError
from search.megatron.importer import read_megatron
from search.pricing import make_cost_model
from search.settings.precision_overrides import (PrecisionOverride, from_config, read_yaml, recipe_of,
                                                 unit_recipes, write_yaml)
from search.spec.cluster import parse_cluster
from search.spec.presets import load_model
from search.spec.training import TrainingSpec

# megatron-core's own example (core/extensions/TransformerEngineMixedPrecision.md), a disabled matcher added
DOC = """
configs:
  mxfp8:
    transformer_engine_config_type: "TEQuantizationParams"
    training_recipe:
      fp8_quantization_recipe: "mxfp8"
  bf16:
    transformer_engine_config_type: "TEQuantizationParams"
    training_recipe: {}
  nvfp4_evaluate_bf16:
    transformer_engine_config_type: "TEQuantizationParams"
    training_recipe:
      fp4_quantization_recipe: "nvfp4"
    evaluation_recipe: {}
matchers:
  off:
    config: "mxfp8"
    type: "glob"
    pattern: "*"
    enabled: false
  attn_qkv_bf16:
    config: "bf16"
    type: "glob"
    pattern: "*.linear_qkv"
    enabled: true
  mamba_outproj_mxfp8:
    config: "mxfp8"
    type: "glob"
    pattern: "*mixer.out_proj"
    enabled: true
  every_proj_nvfp4:
    config: "nvfp4_evaluate_bf16"
    type: "glob"
    pattern: "*proj"
    enabled: true
  no_enabled_key:
    config: "bf16"
    type: "glob"
    pattern: "*"
"""


def test_matchers_in_order_first_enabled_match_wins():
    ov = read_yaml(DOC)
    # 'off' is disabled and 'no_enabled_key' defaults to disabled (RecipeConfig._build_matchers)
    assert [(o.pattern, o.recipe) for o in ov] == [("*.linear_qkv", "bf16"), ("*mixer.out_proj", "mxfp8"),
                                                   ("*proj", "nvfp4")]
    assert recipe_of("decoder.layers.3.self_attention.linear_qkv", "mxfp8", ov) is None
    assert recipe_of("decoder.layers.0.mixer.out_proj", "nvfp4", ov) == "mxfp8"      # before '*proj'
    assert recipe_of("decoder.layers.3.self_attention.linear_proj", "mxfp8", ov) == "nvfp4"
    assert recipe_of("decoder.layers.1.mlp.linear_fc1", "mxfp8", ov) == "mxfp8"      # no match: its own


def test_an_unquantized_layer_stays_unquantized():
    """override_nonquantized_autocast False (the default): a layer kept in bf16 is not quantized by a match."""
    ov = read_yaml(DOC)
    assert recipe_of("decoder.layers.0.mixer.out_proj", None, ov) is None
    assert recipe_of("decoder.layers.0.mixer.out_proj", "bf16", ov) is None


def test_unit_recipes_keep_only_what_differs():
    ov = read_yaml(DOC)
    r = unit_recipes(("mixer.in_proj", "mixer.out_proj"), "decoder.layers.0.", "nvfp4", ov)
    assert r.of("mixer.in_proj") == "nvfp4" and r.of("mixer.out_proj") == "mxfp8" and r
    assert not unit_recipes(("self_attention.linear_qkv",), "decoder.layers.0.", "nvfp4",
                            (PrecisionOverride(pattern="*", recipe="bf16"),))


def test_yaml_round_trip():
    ov = read_yaml(DOC)
    text = write_yaml(ov)
    assert read_yaml(text) == ov
    data = yaml.safe_load(text)
    assert all(m["type"] == "glob" and m["enabled"] for m in data["matchers"].values())
    assert data["configs"]["mxfp8"]["training_recipe"] == {"fp8_quantization_recipe": "mxfp8"}


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["matchers"]["attn_qkv_bf16"].update(type="regex"), "type: regex; megatron-core implements glob"),
    (lambda d: d["configs"]["mxfp8"]["training_recipe"].update(fp8_quantization_recipe="delayed"),
     "refuses delayed"),
    (lambda d: d["configs"]["mxfp8"]["training_recipe"].update(fp8_param=True), "fp8_param: True is not priced"),
    (lambda d: d["configs"]["bf16"]["training_recipe"].update(override_nonquantized_autocast=True),
     "override_nonquantized_autocast: True is not priced"),
    (lambda d: d["configs"]["bf16"].update(transformer_engine_config_type="Kitchen"), "TEQuantizationParams"),
    (lambda d: d["matchers"]["attn_qkv_bf16"].update(config="fp16"), "'fp16' is not one of configs"),
    (lambda d: d["matchers"]["attn_qkv_bf16"].update(pattern="*layers.3.*"), "names a layer index"),
])
def test_refusals_are_one_line(mutate, needle):
    d = yaml.safe_load(DOC)
    mutate(d)
    with pytest.raises(ValueError, match=needle) as e:
        from_config(d)
    assert "\n" not in str(e.value).strip()


# ----- pricing --------------------------------------------------------------------------------------------------------
def _cm(precision, per=(), model="nemotron-h-8b"):
    m = load_model(model)
    tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[2], precision=precision, attention="flash",
                      per_module=per)
    return m, make_cost_model(m, parse_cluster("1x8-b200"), tr)


def test_mamba_out_proj_in_mxfp8_is_priced_as_an_mxfp8_plan_prices_it():
    """Nemotron-H 8B on a B200, tp 1, b 2: the Mamba out_proj GEMM (s b, h, d_inner) moves from the NVFP4 price to
    the MXFP8 plan's price of the same GEMM (its casts included); in_proj and the attention units do not move."""
    m, nv = _cm("nvfp4")
    _, ov = _cm("nvfp4", (PrecisionOverride(pattern="*mixer.out_proj", recipe="mxfp8"),))
    _, mx = _cm("mxfp8")
    from search.layers.mamba import _spec, shape
    sh = shape(_spec(m), m.hidden_size)
    g = [(m.seq_length * 2, m.hidden_size, sh.d_inner)]
    f_nv, b_nv = nv.source._linears(g, True)
    f_mx, b_mx = mx.source._linears(g, True)
    assert f_mx > f_nv
    t_nv, t_ov = nv.unit_table(2, 1), ov.unit_table(2, 1)
    i = next(i for i, u in enumerate(m.units) if u.kind == "mamba")
    j = next(i for i, u in enumerate(m.units) if u.kind == "attention")
    assert t_ov.fwd_ms[i] == pytest.approx(t_nv.fwd_ms[i] - f_nv + f_mx, rel=1e-12)
    assert t_ov.bwd_ms[i] == pytest.approx(t_nv.bwd_ms[i] - b_nv + b_mx, rel=1e-12)
    assert t_ov.fwd_ms[j] == t_nv.fwd_ms[j]


def test_attention_qkv_in_bf16_keeps_a_bf16_input():
    """linear_qkv in bf16 under NVFP4: its input is kept in bf16 (act_saving_bytes of the proj input only), and
    the QKV GEMM is priced at the bf16 kernel model."""
    m, nv = _cm("nvfp4")
    _, ov = _cm("nvfp4", (PrecisionOverride(pattern="*.linear_qkv", recipe="bf16"),))
    t_nv, t_ov = nv.unit_table(2, 1), ov.unit_table(2, 1)
    j = next(i for i, u in enumerate(m.units) if u.kind == "attention")
    q = m.num_attention_heads * m.head_dim
    # the QKV input (s b h) is kept in bf16: (2 - per_elem(nvfp4)) bytes more per element
    from search.settings.precision import per_elem
    extra = (2 - per_elem("nvfp4")) * m.seq_length * 2 * m.hidden_size / 2**20
    assert t_ov.act_mb[j, 0] - t_nv.act_mb[j, 0] == pytest.approx(extra)
    assert t_ov.fwd_ms[j] > t_nv.fwd_ms[j]
    assert q > 0


def test_no_overrides_prices_exactly_as_before():
    m, a = _cm("nvfp4")
    _, b = _cm("nvfp4", (PrecisionOverride(pattern="*nothing*", recipe="bf16"),))
    ta, tb = a.unit_table(2, 1), b.unit_table(2, 1)
    assert (ta.fwd_ms == tb.fwd_ms).all() and (ta.bwd_ms == tb.bwd_ms).all() and (ta.act_mb == tb.act_mb).all()


def test_an_override_recipe_the_gpu_lacks_is_refused():
    m = load_model("nemotron-h-8b")
    tr = TrainingSpec(global_batch_size=16, micro_batch_sizes=[2], precision="fp8-blockwise", attention="flash",
                      per_module=(PrecisionOverride(pattern="*out_proj", recipe="nvfp4"),))
    with pytest.raises(AcesoError, match="precision nvfp4: the h100 has no FP4"):
        make_cost_model(m, parse_cluster("1x8-h100"), tr)


# ----- import and export ---------------------------------------------------------------------------------------------
ARGS = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
        "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000 --bf16 "
        "--use-distributed-optimizer --swiglu --normalization RMSNorm --position-embedding-type rope "
        "--fp8-format e4m3 --fp8-recipe mxfp8 ")


def _script(tmp_path, cfg="te_quant.yaml", text=DOC):
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "te_quant.yaml").write_text(text)
    sh = tmp_path / "cfg" / "run.sh"
    sh.write_text(f"torchrun --nproc-per-node 8 pretrain_gpt.py {ARGS} --te-precision-config-file {cfg}\n")
    return sh


def test_import_reads_the_file_next_to_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sh = _script(tmp_path)
    plan = read_megatron(sh.read_text(), source=str(sh)).plan
    assert plan.settings.low_precision.per_module == read_yaml(DOC)
    # then the working directory
    plan2 = read_megatron(sh.read_text().replace("te_quant.yaml", "cfg/te_quant.yaml"), world_size=8).plan
    assert plan2.settings.low_precision.per_module == read_yaml(DOC)


def test_import_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AcesoError, match="missing.yaml: no such file"):
        read_megatron(ARGS + "--te-precision-config-file missing.yaml", world_size=8)
    sh = _script(tmp_path, text=DOC.replace('"glob"\n    pattern: "*.linear_qkv"', '"regex"\n    pattern: "x"'))
    with pytest.raises(AcesoError, match="matchers.attn_qkv_bf16.type: regex"):
        read_megatron(sh.read_text(), source=str(sh))
    sh = _script(tmp_path)
    with pytest.raises(AcesoError, match="without --fp8-format / --fp4-format"):
        read_megatron(sh.read_text().replace("--fp8-format e4m3 --fp8-recipe mxfp8", ""), source=str(sh))


def test_cli_import_bad_file_exits_2(tmp_path, monkeypatch, capsys):
    from search.cli import main
    monkeypatch.chdir(tmp_path)
    sh = _script(tmp_path, text="configs: [1, 2]\n")
    out = tmp_path / "plan.json"
    assert main(["import", str(sh), "--from", "megatron-lm", "-o", str(out)]) == 2
    assert not out.exists()
    assert "--te-precision-config-file" in capsys.readouterr().err


def test_export_writes_the_yaml_and_the_flag_and_imports_back(tmp_path, monkeypatch):
    from search.megatron.expressible import megatron_config
    from search.megatron.script import write_script
    monkeypatch.chdir(tmp_path)
    sh = _script(tmp_path)
    plan = read_megatron(sh.read_text(), source=str(sh)).plan
    text = write_script(plan, megatron_config(plan), "test")
    assert "cat > te_precision_config.yaml <<'EOF'" in text
    assert "--te-precision-config-file te_precision_config.yaml" in text
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)           # no file on disk: the import reads the script's here-document
    (out / "run.sh").write_text(text)
    back = read_megatron(text, source=str(out / "run.sh"), world_size=8).plan
    assert back.settings.low_precision == plan.settings.low_precision


def test_bridge_export_refuses_in_one_line(tmp_path, monkeypatch):
    from search.megatron.bridge import overrides
    from search.megatron.expressible import megatron_config
    monkeypatch.chdir(tmp_path)
    sh = _script(tmp_path)
    plan = read_megatron(sh.read_text(), source=str(sh)).plan
    with pytest.raises(AcesoError, match="per_module is not written"):
        overrides(megatron_config(plan))


def test_plans_without_overrides_are_written_as_before():
    plan = read_megatron(ARGS, world_size=8).plan
    assert "per_module" not in plan.to_json() and "per_module" not in plan.model_dump_json()


def test_args_only_export_says_the_file_it_needs(tmp_path, monkeypatch, capsys):
    """``aceso export --args-only`` (the drop-in arguments) names the YAML the line reads but does not carry: a note
    on stderr says the script export writes it; the script export has no such note."""
    from search.cli import main
    monkeypatch.chdir(tmp_path)
    sh = _script(tmp_path)
    plan_file = tmp_path / "plan.json"
    assert main(["import", str(sh), "--from", "megatron-lm", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["export", str(plan_file), "--to", "megatron-lm", "--args-only", "-o", str(tmp_path / "a.txt")]) == 0
    err = capsys.readouterr().err
    assert "--te-precision-config-file te_precision_config.yaml" in (tmp_path / "a.txt").read_text()
    assert "the arguments read te_precision_config.yaml" in err and "without --args-only" in err, err
    assert main(["export", str(plan_file), "--to", "megatron-lm", "-o", str(tmp_path / "run.sh")]) == 0
    assert "te_precision_config.yaml" not in capsys.readouterr().err


def test_search_reads_the_overrides_and_explain_promises_what_search_returns(tmp_path, monkeypatch, capsys):
    """``aceso search --te-precision-config-file FILE`` prices and writes the overrides; ``explain --megatron-args-file``
    of a script with them runs its drop-in search under them (before: without, so it compared a plan priced with the
    overrides against plans priced without), prints a command naming the file and, with --save-best, writes the file:
    that command returns exactly the saved plan."""
    from search.cli import main
    monkeypatch.chdir(tmp_path)
    sh = _script(tmp_path)
    best = tmp_path / "best.json"
    assert main(["explain", "--megatron-args-file", str(sh), "--cluster", "1x8-b200", "--search-budget-evals", "40",
                 "--save-best", str(best)]) == 0
    out = capsys.readouterr().out
    cmd = next(line.strip() for line in out.splitlines() if line.strip().startswith("aceso search ")
               and "--target megatron-lm" in line)
    yaml_file = tmp_path / "best.te_quant.yaml"
    assert f"--te-precision-config-file {yaml_file}" in cmd and yaml_file.exists()
    saved = json.loads(best.read_text())
    assert saved["settings"]["low_precision"]["per_module"] == [o.model_dump() for o in read_yaml(DOC)]
    argv = shlex.split(cmd)[2:]
    argv[argv.index("-o") + 1] = str(tmp_path / "again.json")
    assert main(["search", *argv]) == 0
    assert json.loads((tmp_path / "again.json").read_text()) == saved
    (tmp_path / "bad.yaml").write_text("configs: [1]\n")
    argv[argv.index("--te-precision-config-file") + 1] = str(tmp_path / "bad.yaml")
    capsys.readouterr()
    assert main(["search", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--te-precision-config-file" in err, err


# ----- memory: each linear's cached quantized weight at the recipe it runs ----------------------------------------
def _ceil(x, k):
    return -(-x // k) * k


def _te_weight_cache_bytes(recipe, rows, cols):
    """Bytes of the weight workspace transformer-engine caches for a linear of weight (rows, cols) in training
    (``module/linear.py``: ``weight_quantizer.set_usage(rowwise=True, columnwise=True)`` under grad, cached by
    ``base.py`` ``quantize_weight(..., cache=True)`` in ``_fp8_workspaces``), from each quantizer's
    ``inner_tensor_specs`` (NVIDIA/TransformerEngine, ``tensor/mxfp8_tensor.py`` / ``tensor/nvfp4_tensor.py``):
    MXFP8 rowwise and columnwise uint8 data (rows x cols each), E8M0 scale_inv (ceil(rows, 128) x
    ceil(cols / 32, 4)) and (ceil(rows / 32, 4) x ceil(cols, 128)); NVFP4 two packed FP4 copies (rows x cols / 2
    each), E4M3 scale_inv (ceil(rows, 128) x ceil(cols / 16, 4)) and (ceil(cols, 128) x ceil(rows / 16, 4)), and
    one fp32 amax per direction. bf16: nothing cached."""
    if recipe == "mxfp8":
        return (2 * rows * cols + _ceil(rows, 128) * _ceil(cols // 32, 4) + _ceil(rows // 32, 4) * _ceil(cols, 128))
    if recipe == "nvfp4":
        return (rows * cols + _ceil(rows, 128) * _ceil(-(-cols // 16), 4) + _ceil(cols, 128) * _ceil(-(-rows // 16), 4)
                + 2 * 4)
    assert recipe == "bf16"
    return 0


def _params_mb(cm, m, tp=1):
    st = cm.stage_cost(0, 1, 0, 0, m.num_units, tp=tp, dp=1, recompute=[0] * m.num_units, micro_batch_size=2)
    return st.memory_breakdown["params"]


def test_bf16_override_drops_the_cached_quantized_weights():
    """NVFP4 on a B200, linear_qkv and linear_proj in bf16 (Super's te_quant.cfg): each attention unit's two weights
    no longer hold transformer-engine's NVFP4 weight cache (hand-computed from TE's storage); nothing else moves."""
    m, nv = _cm("nvfp4")
    _, ov = _cm("nvfp4", (PrecisionOverride(pattern="*.linear_qkv", recipe="bf16"),
                          PrecisionOverride(pattern="*.linear_proj", recipe="bf16")))
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.groups * m.head_dim
    n_att = sum(u.kind == "attention" for u in m.units)
    # megatron-core TELayerNormColumnParallelLinear linear_qkv weight (q + 2 kv, h), TERowParallelLinear (h, q)
    te = n_att * (_te_weight_cache_bytes("nvfp4", q + 2 * kv, h) + _te_weight_cache_bytes("nvfp4", h, q))
    assert n_att == 4 and te > 0
    assert _params_mb(nv, m) - _params_mb(ov, m) == pytest.approx(te / 2**20, rel=1e-3)


def test_mxfp8_override_under_nvfp4_charges_the_larger_cache():
    """NVFP4 with Mamba out_proj in MXFP8 (Super's te_quant.cfg): each out_proj weight (h, d_inner) caches MXFP8
    data and scales (about 2.06 bytes per weight) instead of NVFP4's (about 1.13): the stage needs more."""
    m, nv = _cm("nvfp4")
    _, ov = _cm("nvfp4", (PrecisionOverride(pattern="*mixer.out_proj", recipe="mxfp8"),))
    from search.layers.mamba import _spec, shape
    d_inner, h = shape(_spec(m), m.hidden_size).d_inner, m.hidden_size
    n_mamba = sum(u.kind == "mamba" for u in m.units)
    te = n_mamba * (_te_weight_cache_bytes("mxfp8", h, d_inner) - _te_weight_cache_bytes("nvfp4", h, d_inner))
    assert n_mamba == 24 and te > 0.9 * n_mamba * h * d_inner
    assert _params_mb(ov, m) - _params_mb(nv, m) == pytest.approx(te / 2**20, rel=1e-3)


def test_an_overridden_linear_keeps_a_bf16_weight_under_param_gather():
    """--fp8-param-gather with an override of the plan's own recipe: megatron-core builds the matched linear under
    its config's ``fp8_param`` (False: core_v0.19.0 extensions/transformer_engine.py
    ``_get_fp8_model_init_for_quant_recipe`` ``enabled = qrecipe.fp8_param``), so its weight is a bf16 parameter
    beside the cached copies (2 bytes per weight more), and the distributed optimizer gathers it in bf16."""
    m = load_model("llama3-8b")
    tr = dict(global_batch_size=16, micro_batch_sizes=[2], precision="fp8-blockwise", attention="flash",
              fp8_param_gather=True, distributed_optimizer=True)
    a = make_cost_model(m, parse_cluster("1x8-h100"), TrainingSpec(**tr))
    b = make_cost_model(m, parse_cluster("1x8-h100"), TrainingSpec(
        **tr, per_module=(PrecisionOverride(pattern="*.linear_fc2", recipe="fp8-blockwise"),)))
    n_mlp = sum(u.kind == "mlp" for u in m.units)
    fc2 = m.hidden_size * m.ffn_hidden_size           # TERowParallelLinear linear_fc2 weight (h, f), tp 1
    assert _params_mb(b, m) - _params_mb(a, m) == pytest.approx(2 * n_mlp * fc2 / 2**20, rel=1e-9)


def test_each_kind_names_the_weights_of_its_linears():
    """``LayerKind.linear_params`` gives one count per named linear, and the dense kinds' counts are their weights
    (the unit's parameters less its norm, Q/K norms and biases)."""
    from search import layers
    from search.costmodel.memory import unit_params_per_rank
    m = load_model("llama3-8b")
    for kind in layers.kind.kinds():
        if kind.linears:
            assert kind.linear_params is not None, kind.name
    att, mlp = layers.resolve(m, "attention"), layers.resolve(m, "mlp")
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.head_dim, m.groups * m.head_dim, m.ffn_hidden_size
    assert att.linear_params(m, 2) == (h * (q + 2 * kv) / 2, h * q / 2)
    assert mlp.linear_params(m, 2) == (2 * f * h / 2, h * f / 2)
    assert sum(mlp.linear_params(m, 2)) == unit_params_per_rank(m, "mlp", 2) - m.hidden_size   # its RMSNorm
    # LatentMoE (Nemotron-3 Super: 512 experts of 2688 at the 1024 latent, a 5376 shared expert, squared ReLU), tp 2,
    # ep 64, etp 1: 8 local experts' fc1 / fc2, the shared expert split over tp, the latent projections whole
    s = load_model("nemotron-3-super")
    assert layers.resolve(s, "moe").linear_params(s, 2, 64, 1) == (8 * 2688 * 1024, 8 * 1024 * 2688, 5376 * 4096 / 2,
                                                                   4096 * 5376 / 2, 1024 * 4096, 4096 * 1024)
