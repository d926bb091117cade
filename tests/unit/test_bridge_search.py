"""``aceso search --target megatron-bridge`` on a hybrid model searches what Megatron-Bridge runs (the capability
table's Bridge rules, search/targets/capabilities.py ``bridge_hybrid_layout``: the Bridge export's own check), so it
never returns a plan ``aceso export --to megatron-bridge`` refuses. Before, it searched the Megatron-LM space and
returned, e.g., a full-recompute Nemotron-H 56B plan that Bridge v0.3.1's MambaStack cannot run."""

from __future__ import annotations

from search.cli import main
from search.megatron.bridge_hybrid import hybrid_config
from search.megatron import NotExpressible
from search.spec.plan import ParallelPlan
from search.spec.presets import load_model
from search.targets.capabilities import plan_refusal
from tests.hybrid_plans import cut_plan


def test_the_capability_table_says_what_the_bridge_export_refuses():
    """The table's Bridge rule is the export's own check: Bridge v0.3.1's MambaStack split, else v0.6.0's '|' cuts
    (the export writes those when v0.3.1 cannot split the plan); what neither runs is refused with v0.6.0's words."""
    h8 = load_model("nemotron-h-8b")
    for plan, words in ((cut_plan(h8, [0, 13, 26, 39, 52], 2), "virtual pipeline"),):
        why = plan_refusal(plan, "megatron-bridge")
        assert why is not None and words in why, why
        for pipes in (False, True):
            try:
                hybrid_config(plan, pipes=pipes)
                raise AssertionError("the export writes a plan the table refuses")
            except NotExpressible as e:
                if pipes:
                    assert str(e) == why
        assert plan_refusal(plan, "megatron-lm") is None     # Megatron-LM runs each ('|' cuts, VPP, full)
    # v0.3.1 splits evenly and checkpoints no Mamba layer; v0.6.0 (megatron-core 0.19) cuts with '|' and recomputes
    for plan in (cut_plan(h8, [0, 10, 30, 40, 52], 4), cut_plan(h8, [0, 26, 52], 2, rc="full")):
        assert plan_refusal(plan, "megatron-bridge") is None and hybrid_config(plan, pipes=True) is not None
    assert plan_refusal(cut_plan(h8, [0, 26, 52], 2, tp=2, dp=2, sp=True, gbs=32), "megatron-bridge") is None


def _search(tmp_path, capsys, *argv):
    out = tmp_path / "p.json"
    rc = main(["search", *argv, "--target", "megatron-bridge", "--workers", "1", "-o", str(out)])
    _, err = capsys.readouterr()
    return rc, err, out


def test_a_bridge_search_returns_only_plans_the_bridge_export_writes(tmp_path, capsys):
    """Nemotron-H 56B on 16 H100s, global batch 32: the Megatron-LM space's best is pp 2 with full recompute (the
    old Bridge search returned it and the export refused it: Bridge v0.3.1's MambaStack checkpoints no layer). Now
    every plan it writes exports (v0.6.0's form where v0.3.1 cannot run it), or it says in one line that Bridge
    runs none that fits."""
    rc, err, out = _search(tmp_path, capsys, "--model", "nemotron-h-56b", "--cluster", "2x8-h100",
                           "--global-batch-size", "32", "--budget-evals", "200")
    if rc == 0:
        plan = ParallelPlan.model_validate_json(out.read_text())
        assert plan_refusal(plan, "megatron-bridge") is None
        y = tmp_path / "b.yaml"
        assert main(["export", str(out), "--to", "megatron-bridge", "-o", str(y)]) == 0, capsys.readouterr().err
        assert "pattern" in y.read_text()
    else:
        assert rc == 2 and err.count("\n") == 1 and not out.exists(), err
        assert "no plan megatron-bridge runs fits" in err, err


def test_a_bridge_search_plan_exports(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["search", "--model", "nemotron-h-8b", "--cluster", "1x8-h100", "--global-batch-size", "16",
               "--budget-evals", "60", "--target", "megatron-bridge", "--workers", "1", "-o", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "(analytic, target megatron-bridge)" in stdout      # the table names the target asked for
    y = tmp_path / "b.yaml"
    assert main(["export", str(out), "--to", "megatron-bridge", "-o", str(y)]) == 0
    assert "hybrid_override_pattern" in y.read_text()


def test_the_published_nemotron_3_super_bridge_run_is_searched_and_exported(tmp_path, capsys):
    """Issue 36: NVIDIA ran Nemotron-3 Super (MTP: 2 depths of one shared '*E' layer) with Megatron-Bridge 26.04.01
    on 64 GB300s, GBS 512, MXFP8, tp 1 pp 1 ep 64 mbs 1 (../shared/published/megatron-bridge-26.02-26.04.json,
    9344 tokens/s/GPU). The Bridge search refused every plan (aceso wrote no MTP for Bridge); now it returns one
    that fits, the capability table's Bridge row runs it, and it exports as v0.6.0 overrides with the MTP fields."""
    from search.spec.plan import load_plan
    rc, err, out = _search(tmp_path, capsys, "--model", "nemotron-3-super", "--cluster", "1x64-gb300",
                           "--global-batch-size", "512", "--precision", "mxfp8", "--budget-evals", "40")
    assert rc == 0, err
    plan = load_plan(str(out))
    assert max(plan.predicted.stage_memory_mb) <= plan.cluster.gpu.memory_gib * 1024
    assert plan_refusal(plan, "megatron-bridge") is None
    y = tmp_path / "b.yaml"
    assert main(["export", str(out), "--to", "megatron-bridge", "-o", str(y)]) == 0
    text = y.read_text()
    assert "Megatron-Bridge v0.6.0 overrides" in text and "  mtp_num_layers: 2\n" in text
    assert "  mtp_use_repeated_layer: true\n" in text and "  fp8_recipe: mxfp8\n" in text


def test_a_hybrid_model_no_bridge_form_runs_is_refused_before_searching(tmp_path, capsys, monkeypatch):
    """A GDN hybrid (Nemotron-H widths, 'G' layers): no Bridge form aceso writes runs it, so the Bridge search is
    refused in one line before any cost model is built (the capability table's model row), not after a search."""
    import search.pricing
    from search.targets.capabilities import model_refusal
    from tests.hybrid_plans import GDN8

    def searched(*a, **k):
        raise AssertionError("the search started")
    monkeypatch.setattr(search.pricing, "cost_model", searched)
    spec = tmp_path / "gdn.json"
    spec.write_text(GDN8.model_dump_json())
    rc, err, out = _search(tmp_path, capsys, "--model", str(spec), "--cluster", "1x8-h100",
                           "--global-batch-size", "16")
    assert rc == 2 and err.count("\n") == 1 and not out.exists(), err
    assert "--target megatron-bridge" in err and "GDN" in err and "--target megatron-lm" in err
    assert model_refusal("megatron-bridge", GDN8) in err
    assert model_refusal("megatron-lm", GDN8) is None


def test_the_bridge_space_offers_no_virtual_stages_on_a_hybrid_model(tmp_path, capsys):
    """Both Bridge hybrid providers assert no virtual pipeline (the capability table refuses every v > 1 plan), so
    the Bridge space offers v 1 only instead of pricing interleaved states its final check drops; the Megatron-LM
    space keeps them ('|' cuts run VPP there). An explicit --virtual-stages 2 is one line, exit 2."""
    from search.planner.space import Space
    from search.spec.cluster import parse_cluster
    from search.spec.training import TrainingSpec
    from search.costmodel.types import ALL_FEATURES
    h56 = load_model("nemotron-h-56b")
    tr = TrainingSpec(global_batch_size=32)
    bridge = Space.of(h56, parse_cluster("2x8-h100"), tr, priced=ALL_FEATURES, target="megatron-bridge")
    mlm = Space.of(h56, parse_cluster("2x8-h100"), tr, priced=ALL_FEATURES, target="megatron-lm")
    assert bridge.vs == (1,) and max(mlm.vs) > 1
    v2 = cut_plan(load_model("nemotron-h-8b"), [0, 13, 26, 39, 52], 2)     # the table's own refusal of v 2
    assert "virtual pipeline" in plan_refusal(v2, "megatron-bridge")
    gpt = Space.of(load_model("gpt-1.3b"), parse_cluster("1x8-h100"), tr, priced=ALL_FEATURES,
                   target="megatron-bridge")
    assert max(gpt.vs) > 1                                                  # a GPT model keeps its VPP degrees
    rc, err, out = _search(tmp_path, capsys, "--model", "nemotron-h-8b", "--cluster", "1x8-h100",
                           "--global-batch-size", "16", "--virtual-stages", "2")
    assert rc == 2 and err.count("\n") == 1 and "--virtual-stages 2" in err and not out.exists(), err
