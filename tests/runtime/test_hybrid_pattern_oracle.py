"""Each Megatron-LM release with hybrid-pattern cuts (core_v0.17.1 to core_v0.19.0) parses and validates every
exported ``--hybrid-layer-pattern`` command line as its ``pretrain_hybrid.py`` / ``pretrain_mamba.py`` would, and
its own megatron-core builds on each (virtual stage, pipeline rank) exactly the plan's chunk: the layer offset and
the hybrid layers (``select_pipeline_segment``), the MTP depths, the recompute setting, dp, the vocabulary, and a
``--spec`` that the checkout defines; core_v0.16.1's parser has no such flag (the export refuses it).

Checkouts as for test_megatron_lm_oracle.py (``ACESO_MEGATRON_LM`` with ``{tag}``); Python 3.12 for 0.17 on.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from search.layers.mamba import shape as mamba_shape
from search.megatron.hybrid_pattern import args_line, hybrid_form, mtp_pattern, unit_pattern
from search.megatron.versions import release
from search.spec.presets import load_model
from tests.hybrid_plans import CASES, cut_plan
from tests.runtime.test_megatron_lm_oracle import _checkout


def _oracle(tag: str, lines: list[str], worlds: list[int]) -> list[dict]:
    root = _checkout(tag)
    cases = [{"line": line, "world": w} for line, w in zip(lines, worlds)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_lm_hybrid_oracle.py"))],
                       input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tag", ["core_v0.17.1", "core_v0.18.2", "core_v0.19.0"])
def test_megatron_lm_builds_the_plans_chunks_from_the_pattern(tag):
    rel = release(tag)
    names = [n for n, (_, _, since) in CASES.items() if rel.version >= release(since).version]
    plans = [CASES[n][0] for n in names]
    forms = [hybrid_form(p, rel) for p in plans]
    got = _oracle(tag, [args_line(f) for f in forms], [p.world_size for p in plans])
    for name, plan, form, g in zip(names, plans, forms, got):
        assert "error" not in g, (name, g)
        m = plan.model
        want = [[ch.start_unit, unit_pattern(m, ch.start_unit, ch.end_unit)] for _, _, ch in plan.chunks_in_order()]
        assert g["chunks"] == want, name
        assert g["num_layers"] == sum(len(p) for _, p in want)
        assert g["vpp"] == (plan.num_virtual_stages if plan.num_virtual_stages > 1 else None)
        assert g["dp"] == plan.stages[0].dp and g["tp"] == plan.stages[0].tp
        assert g["micro_batch_size"] == plan.micro_batch_per_rank(0)
        depths = m.mtp_num_layers or 0
        assert g["mtp"] == [mtp_pattern(m), depths, depths or None]
        rc = form.config.recompute
        assert g["recompute"][:3] == [rc.granularity, rc.method, rc.num_layers], name
        if rc.granularity == "selective":
            assert g["recompute"][3] == list(rc.modules)
        assert g["vocab"][1] == m.padded_vocab_size
        assert g["spec_defined"], name
        assert g["gated"] == (m.activation == "swiglu") and g["num_query_groups"] == m.groups
        if m.gdn is not None:         # the GDN mixer's TransformerConfig fields (search.layers.gdn.GDNSpec)
            assert g["gdn"] == [getattr(m.gdn, f) for f in type(m.gdn).model_fields], name
        if m.mamba is not None:       # a hybrid model: the Mamba-2 shape, squared ReLU, no position embedding
            sh = mamba_shape(m.mamba, m.hidden_size)
            assert g["mamba"] == [sh.state, sh.head_dim, sh.groups, sh.heads, m.mamba.use_mamba_mem_eff_path]
            assert g["activation"] == "squared_relu" and g["position_embedding_type"] == "none"
        if m.moe is not None:
            assert g["moe"][:2] == [m.moe.num_experts, m.moe.moe_router_topk]
        low = plan.settings.low_precision if plan.settings else None
        if low is not None:           # the units of the plan's first / last GPT layers kept in bf16
            n = g["num_layers"]
            assert g["bf16_layers"] == list(range(2 * low.bf16_layers_start)) + \
                list(range(n - 2 * low.bf16_layers_end, n))


def test_megatron_lm_0_16_has_no_pattern_flag():
    """What the export refuses: core_v0.16.1's parser exits on --hybrid-layer-pattern."""
    plan = CASES["llama-pp3-mid-layer"][0]
    (got,) = _oracle("core_v0.16.1", [args_line(hybrid_form(plan, release("0.17")))], [plan.world_size])
    assert got == {"error": "SystemExit: 2"}            # argparse: unrecognized arguments
    assert not release("0.16").has("--hybrid-layer-pattern")


@pytest.mark.parametrize("tag", ["core_v0.17.1", "core_v0.18.2", "core_v0.19.0"])
def test_latent_moe_and_the_shared_mtp_layer_reach_the_config(tag):
    """Nemotron-3 Super's LatentMoE and its one MTP layer run at 2 depths (8 of its layers, cut mid-pattern):
    --moe-latent-size, --mtp-use-repeated-layer and its --moe-router-topk-scaling-factor as each release's parser
    and TransformerConfig read them."""
    rel = release(tag)
    m = load_model("nemotron-3-super").model_copy(update={"hybrid_layer_pattern": "MEM*EMEM/*E/*E", "num_layers": 8})
    plan = cut_plan(m, [0, 3, m.num_units], 2, tp=2, sp=True, gbs=16)
    (g,) = _oracle(tag, [args_line(hybrid_form(plan, rel))], [plan.world_size])
    assert "error" not in g, g
    assert g["latent"] == 1024 and g["mtp_repeated"] is True
    assert g["topk_scaling"] == 5.0          # Super's HF routed_scaling_factor (tests/unit/test_topk_scaling.py)
    # Megatron-LM's Super release test: --init-method-std 0.014 --mtp-loss-scaling-factor 0.3
    # (tests/unit/test_bridge_nano_recipe_leaks.py)
    assert (g["init_std"], g["mtp_loss"]) == (0.014, 0.3)
    assert g["mtp"] == ["*E", 2, 2] and g["moe"][:2] == [512, 22]


@pytest.mark.parametrize("tag", ["core_v0.17.1", "core_v0.19.0"])
def test_the_nemotron_presets_init_std_reaches_the_config(tag):
    """Nano 0.0173, Ultra 0.0099, Nemotron-H 56B 0.0099 (Megatron-LM's ModelOpt example scripts;
    tests/unit/test_nemotron_init_std.py) as each release's parser and TransformerConfig read the exported line."""
    rel = release(tag)
    lines, worlds, want = [], [], []
    for name, std, pattern in (("nemotron-3-nano", 0.0173, "MEM*EM"), ("nemotron-3-ultra", 0.0099, "MEM*EM/*E/*E"),
                               ("nemotron-h-56b", 0.0099, "M-M*-M")):
        m = load_model(name).model_copy(update={"hybrid_layer_pattern": pattern, "num_layers": 6})
        plan = cut_plan(m, [0, 3, m.num_units], 2, gbs=16)
        lines.append(args_line(hybrid_form(plan, rel)))
        worlds.append(plan.world_size)
        want.append(std)
    for g, std in zip(_oracle(tag, lines, worlds), want):
        assert "error" not in g, g
        assert g["init_std"] == std


@pytest.mark.parametrize("tag", ["core_v0.17.1", "core_v0.18.2", "core_v0.19.0"])
def test_the_legacy_mtp_pattern_is_built_as_the_import_reads_it(tag):
    """``--mtp-hybrid-override-pattern P`` on a pattern without '/': the release's validate_args appends '/P' per
    MTP depth (core_v0.17.1 arguments.py:621-632); its megatron-core builds the same chunks and MTP as from the
    unified pattern, which is what aceso's import reads (hybrid_pattern.current_spelling)."""
    from search.megatron.importer import read_megatron
    rel = release(tag)
    plan = CASES["moe-mtp-pp2"][0]
    line = args_line(hybrid_form(plan, rel))
    head, _, tail = line.partition("--hybrid-layer-pattern ")
    value, _, rest = tail.partition(" ")
    main_part, *mtp = value.strip("'").split("/")
    assert len(mtp) == plan.model.mtp_num_layers and len(set(mtp)) == 1
    legacy = f"{head}--hybrid-layer-pattern '{main_part}' --mtp-hybrid-override-pattern '{mtp[0]}' {rest}"
    unified, old = _oracle(tag, [line, legacy], [plan.world_size] * 2)
    assert "error" not in unified and "error" not in old, (unified, old)
    assert old == unified
    ours = [read_megatron(x, world_size=plan.world_size, version=tag).plan for x in (line, legacy)]
    assert ours[0] == ours[1]
