"""One price per Bridge plan: the release a ``--target megatron-bridge`` search prices is the one the exported YAML
runs, so the search, the YAML's header, ``explain`` and the YAML's import agree.

Which release that is: ``aceso export --to megatron-bridge`` writes Megatron-Bridge v0.3.1 overrides, and v0.3.1
runs megatron-core 0.16 (its 3rdparty/Megatron-LM is core_v0.16.1; NeMo container 26.02.01 ships Bridge 0.3.1 with
megatron-core 0.16.0, Megatron-Bridge docs/releases/software-versions.md). Before, the search priced the newest
container (26.04.01) and the import the YAML's 0.16: Nemotron-3 Nano on 1x8-gb200 with FSDP, 15573.7 ms in the
search and the header, 15658.9 ms on import. A runtime plan's YAML: Bridge v0.3.1 aligns the gradient reduction
always (no field turns it off), so its header prices that alignment, not the runtime's."""

from __future__ import annotations

import json
import re

import pytest

from search.cli import main
from search.settings.releases import BY_NAME, resolve
from search.spec.presets import load_model
from tests.hybrid_plans import cut_plan


def _run(capsys, *argv) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 0, err
    return err


def _header_ms(text: str) -> str:
    return re.search(r"^# predicted .*?: ([\d.]+) ms per iteration", text, re.M).group(1)


@pytest.mark.parametrize("model, cluster", [("nemotron-h-8b", "1x8-h100"),          # dense hybrid
                                            ("nemotron-3-nano", "1x8-gb200")])      # hybrid MoE
def test_search_export_import_price_one_release(tmp_path, capsys, model, cluster):
    plan, yaml, back = tmp_path / "p.json", tmp_path / "b.yaml", tmp_path / "back.json"
    _run(capsys, "search", "--model", model, "--cluster", cluster, "--global-batch-size", "64", "--target",
         "megatron-bridge", "--budget-evals", "40", "--workers", "1", "-o", str(plan))
    searched = json.loads(plan.read_text())
    _run(capsys, "export", str(plan), "--to", "megatron-bridge", "-o", str(yaml))
    text = yaml.read_text()
    if "Megatron-Bridge v0.3.1 overrides" in text:    # the container that ships Bridge v0.3.1 is the one priced
        assert BY_NAME[resolve(searched["settings"]["release"])[0]].bridge == "0.3.1"
        assert "release 26.02.01" in text
    else:     # a plan only v0.6.0 runs (Nano's search: full recompute of hybrid layers) states its megatron-core
        assert "Megatron-Bridge v0.6.0 overrides" in text and searched["settings"]["release"] == "0.19"
    _run(capsys, "import", str(yaml), "--from", "megatron-bridge", "--cluster", cluster, "-o", str(back))
    imported = json.loads(back.read_text())
    assert resolve(imported["settings"]["release"]) == resolve(searched["settings"]["release"])
    ms = "%.1f" % searched["predicted"]["iteration_time_ms"]
    assert _header_ms(text) == ms == "%.1f" % imported["predicted"]["iteration_time_ms"]
    main(["explain", str(plan)])
    out = capsys.readouterr().out
    assert f"iteration {ms} ms" in out, out


def test_a_release_the_yaml_does_not_run_is_refused(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["search", "--model", "nemotron-h-8b", "--cluster", "1x8-h100", "--global-batch-size", "64",
               "--target", "megatron-bridge", "--release", "26.04.01", "--budget-evals", "40", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists() and err.count("\n") == 1, err
    assert "--release 26.04.01 with --target megatron-bridge" in err and "megatron-core 0.16" in err, err


def test_a_model_only_bridge_v060_builds_prices_its_release():
    """Super and Ultra have MTP, which v0.3.1's MambaModelProvider has not: their only Bridge form is v0.6.0's
    (megatron-core 0.19), so their Bridge search prices 0.19, the release that YAML's import states."""
    from search.megatron.bridge_hybrid import BRIDGE_CORE, PIPES_CORE, model_core
    assert model_core(load_model("nemotron-3-super")) == PIPES_CORE == "0.19"
    assert model_core(load_model("nemotron-3-ultra")) == PIPES_CORE     # its MTP (v0.6.0's Ultra recipe: 2 depths)
    assert model_core(load_model("nemotron-3-nano")) == BRIDGE_CORE == "0.16"
    assert model_core(load_model("llama3-8b")) == BRIDGE_CORE


def _runtime_plan(model, bounds, pp, dp, gbs, cluster):
    """A runtime plan (overlapped gradient reduction, unaligned: the runtime's bucket hooks) with its prediction."""
    from search.cli.import_cmd import predict
    from search.settings.plan_settings import PlanSettings
    from search.spec.cluster import parse_cluster
    plan = cut_plan(load_model(model), bounds, pp, dp=dp, gbs=gbs, cluster=parse_cluster(cluster),
                    settings=PlanSettings(overlap_grad_reduce=True, distributed_optimizer=True))
    return plan.model_copy(update={"predicted": predict(plan, None)})


def test_a_runtime_plans_yaml_runs_the_alignment_it_was_priced_with(tmp_path, capsys):
    """Bridge v0.3.1 aligns the gradient reduction by default (``DistributedInitConfig.align_grad_reduce = True``;
    ``setup.py`` sets ``grad_sync_func`` only when it is on), and that field turns it off. A runtime plan's YAML
    (pp 2 x VPP 2, where the alignment changes the exposed reduction: dp_timeline.py) writes
    ``dist.align_grad_reduce: false``, so Bridge runs the plan's unaligned reduction and the header is the plan's
    own price; before, the YAML left Bridge's aligned one, which prices differently."""
    from search.megatron import megatron_config
    from search.megatron.names import bridge_fields
    from search.pricing import price
    plan = _runtime_plan("llama3-8b", [0, 16, 32, 48, 64], 2, 4, 64, "1x8-h100")
    assert bridge_fields(megatron_config(plan))["dist"] == {"align_grad_reduce": False}
    from search.settings.data_parallel import DataParallelSettings
    aligned = plan.model_copy(update={"settings": plan.settings.model_copy(
        update={"framework": "megatron-bridge", "release": "0.16"})})    # what the YAML ran before
    # Bridge with the field: the runtime's unaligned reduction (and Bridge's own overlapped interleaved p2p, which
    # the runtime runs synchronously: runtime_rules.overlap_p2p)
    ms = "%.1f" % price(aligned.model_copy(update={"settings": aligned.settings.model_copy(
        update={"data_parallel": DataParallelSettings(align_grad_reduce=False)})})).iteration_ms
    assert "%.1f" % price(aligned).iteration_ms != ms                   # the alignment matters for this plan
    path, yaml = tmp_path / "rt.json", tmp_path / "rt.yaml"
    path.write_text(plan.to_json())
    _run(capsys, "export", str(path), "--to", "megatron-bridge", "-o", str(yaml))
    assert "dist:\n  align_grad_reduce: false" in yaml.read_text()
    assert _header_ms(yaml.read_text()) == ms


def test_a_runtime_hybrid_plans_yaml_imports_at_its_header_price(tmp_path, capsys):
    """A runtime Nemotron-H plan at pp 2 exported as a Bridge YAML and imported: the import reads
    ``dist.align_grad_reduce: false`` back (Megatron-LM's --no-align-grad-reduce) and prices the header's number."""
    plan = _runtime_plan("nemotron-h-8b", [0, 26, 52], 2, 4, 64, "1x8-h100")
    path, yaml, back = tmp_path / "rt.json", tmp_path / "rt.yaml", tmp_path / "back.json"
    path.write_text(plan.to_json())
    _run(capsys, "export", str(path), "--to", "megatron-bridge", "-o", str(yaml))
    assert "align_grad_reduce: false" in yaml.read_text()
    _run(capsys, "import", str(yaml), "--from", "megatron-bridge", "--cluster", "1x8-h100", "-o", str(back))
    imported = json.loads(back.read_text())
    assert imported["settings"]["data_parallel"]["align_grad_reduce"] is False
    assert _header_ms(yaml.read_text()) == "%.1f" % imported["predicted"]["iteration_time_ms"]


def test_explain_as_bridge_prices_the_release_bridge_runs(tmp_path, capsys):
    """``explain PLAN --framework megatron-bridge`` of a runtime plan prices Bridge at the release its YAML runs
    (26.02.01 for Nemotron-H 8B), as ``search --target megatron-bridge`` does; ``--release`` still names another."""
    plan = _runtime_plan("nemotron-h-8b", [0, 26, 52], 2, 4, 64, "1x8-h100")
    path = tmp_path / "rt.json"
    path.write_text(plan.to_json())
    for extra, want in (([], "release 26.02.01"), (["--release", "26.04.01"], "release 26.04.01")):
        assert main(["explain", str(path), "--framework", "megatron-bridge", *extra]) == 0
        out = capsys.readouterr().out
        assert re.search(r"priced as megatron-bridge, .*" + re.escape(want), out), out


def test_a_bridge_plans_megatron_lm_script_prices_the_release_it_is_written_for(tmp_path, capsys):
    """The Bridge plan (release 0.16) exported as a Megatron-LM script for the newest release: its header prices
    that release, as ``explain`` of the script does; for ``--megatron-version 0.16`` the header is the plan's price."""
    plan, script = tmp_path / "p.json", tmp_path / "run.sh"
    _run(capsys, "search", "--model", "qwen3-30b-a3b", "--num-layers", "4", "--cluster", "1x8-gb200",
         "--global-batch-size", "64", "--target", "megatron-bridge", "--budget-evals", "40", "--workers", "1",
         "-o", str(plan))
    searched = "%.1f" % json.loads(plan.read_text())["predicted"]["iteration_time_ms"]
    for version in ([], ["--megatron-version", "0.16"]):
        _run(capsys, "export", str(plan), "--to", "megatron-lm", *version, "-o", str(script))
        assert main(["explain", "--megatron-args-file", str(script), "--cluster", "1x8-gb200", *version,
                     "--search-budget-evals", "0", "--json"]) == 0
        explained = "%.1f" % json.loads(capsys.readouterr().out)["iteration_time_ms"]
        assert _header_ms(script.read_text()) == explained
        if version:
            assert explained == searched


def test_a_plan_only_bridge_v060s_form_runs_is_searched_at_its_release(tmp_path, capsys):
    """Nemotron-H 8B (Bridge v0.3.1 builds it) on 2 H100s, global batch 32: the best plan recomputes layers fully
    (--recompute-method block), which v0.3.1's MambaStack does not (it checkpoints no layer), so the export writes v0.6.0's form, which
    runs megatron-core 0.19. The search prices that candidate at 0.19 (before: at 26.02.01, while the header, the
    import and explain priced 0.19), and the plan states that release."""
    from search.megatron.bridge_hybrid import PIPES_CORE
    plan, yaml, back, mlm = (tmp_path / n for n in ("p.json", "b.yaml", "back.json", "mlm.json"))
    common = ["--model", "nemotron-h-8b", "--cluster", "1x2-h100", "--global-batch-size", "32", "--budget-evals", "60",
              "--workers", "1"]
    _run(capsys, "search", *common, "--target", "megatron-bridge", "-o", str(plan))
    searched = json.loads(plan.read_text())
    assert "full" in {r for st in searched["stages"] for c in st["chunks"] for r in c["recompute"]}
    assert searched["settings"]["release"] == PIPES_CORE
    ms = "%.1f" % searched["predicted"]["iteration_time_ms"]
    err = _run(capsys, "export", str(plan), "--to", "megatron-bridge", "-o", str(yaml))
    text = yaml.read_text()
    assert "Megatron-Bridge v0.6.0 overrides" in text and "the header prices" not in err, err
    assert _header_ms(text) == ms
    _run(capsys, "import", str(yaml), "--from", "megatron-bridge", "--cluster", "1x2-h100", "-o", str(back))
    imported = json.loads(back.read_text())
    assert imported["settings"]["release"] == PIPES_CORE and "%.1f" % imported["predicted"]["iteration_time_ms"] == ms
    main(["explain", str(plan)])
    assert f"iteration {ms} ms" in capsys.readouterr().out
    # the Megatron-LM search's plan of the same model, explained as Bridge runs it: the release of its Bridge form
    _run(capsys, "search", *common, "--target", "megatron-lm", "-o", str(mlm))
    assert json.loads(mlm.read_text())["stages"] == searched["stages"]
    main(["explain", str(mlm), "--framework", "megatron-bridge"])
    assert f"iteration {ms} ms" in capsys.readouterr().out


def test_a_runtime_plans_megatron_lm_script_prices_as_its_import(tmp_path, capsys):
    """A runtime plan with virtual stages (the runtime's interleaved p2p is synchronous: priced so) exported for
    Megatron-LM: the script runs Megatron-LM's overlapped p2p, so its header is the plan re-priced as the script runs
    (a note says so), and the script read back prices to the header."""
    from search.pricing import price
    from search.spec.plan import ParallelPlan
    plan = _runtime_plan("llama3-8b", [0, 16, 32, 48, 64], 2, 4, 64, "1x8-h100")
    path, script = tmp_path / "rt.json", tmp_path / "rt.sh"
    path.write_text(plan.to_json())
    err = _run(capsys, "export", str(path), "--to", "megatron-lm", "-o", str(script))
    text = script.read_text()
    assert "--no-overlap-p2p-communication" not in text and "the header prices the plan as this file runs" in err
    _run(capsys, "import", str(script), "--from", "megatron-lm", "--cluster", "1x8-h100", "-o",
         str(tmp_path / "back.json"))
    back = ParallelPlan.model_validate_json((tmp_path / "back.json").read_text())
    assert back.settings.framework == "megatron-lm"
    assert _header_ms(text) == "%.1f" % back.predicted.iteration_time_ms == "%.1f" % price(back).iteration_ms
    assert _header_ms(text) != "%.1f" % price(plan).iteration_ms       # the runtime's synchronous p2p is slower
