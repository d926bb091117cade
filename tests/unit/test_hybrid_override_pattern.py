"""A Nemotron script's deprecated spellings read as Megatron-LM reads them. From core_v0.17 ``validate_args`` copies
``--hybrid-override-pattern`` into ``--hybrid-layer-pattern`` (asserting the two are not both given; core_v0.19.0
``megatron/training/arguments.py`` 719-731), and ``--is-hybrid-model`` is parsed and read by nothing
(``is_hybrid_model(args)`` is ``args.hybrid_layer_pattern is not None``); NVIDIA's own core_v0.19.0
``examples/post_training/modelopt/conf/nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16.sh`` gives both. Before,
``aceso import`` / ``explain --megatron-args`` refused either flag with "hybrid (Mamba) models are not modelled by
aceso; remove it to price the rest"."""

import json

import pytest

from search.cli import main
from search.megatron.hybrid_pattern import args_line, hybrid_form
from search.megatron.versions import release
from search.spec.plan import uniform_plan
from search.spec.presets import load_model

LINE = args_line(hybrid_form(uniform_plan(load_model("nemotron-3-nano"), 2, 2, 2, 8, 64,
                                    sequence_parallel=True), release("0.19")))


def _import(tmp_path, line: str, *extra: str) -> tuple[int, dict | None]:
    out = tmp_path / "plan.json"
    out.unlink(missing_ok=True)
    rc = main(["import", "--from", "megatron-lm", "--args", line, "--world-size", "8", "-o", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.parametrize("old", ["--hybrid-override-pattern {}", "--hybrid-override-pattern={} --is-hybrid-model"])
def test_the_deprecated_spelling_is_the_same_run(tmp_path, capsys, old):
    assert "--hybrid-layer-pattern '" in LINE and "|" in LINE      # a pp 2 pattern cut at the plan's stages
    rc, want = _import(tmp_path, LINE)
    assert rc == 0
    head, pattern, tail = LINE.partition("--hybrid-layer-pattern ")
    value, _, rest = tail.partition(" ")
    rc, got = _import(tmp_path, head + old.format(value) + " " + rest)
    assert rc == 0, capsys.readouterr().err
    assert got == want


def test_both_spellings_are_refused_as_megatron_lm_asserts(tmp_path, capsys):
    value = LINE.partition("--hybrid-layer-pattern ")[2].split(" ")[0]
    rc, got = _import(tmp_path, f"{LINE} --hybrid-override-pattern {value}")
    err = capsys.readouterr().err
    assert rc == 2 and got is None and err.count("\n") == 1
    assert "cannot both be specified" in err, err


def test_core_v0_16_names_the_release_not_a_missing_model(tmp_path, capsys):
    line = LINE.replace("--hybrid-layer-pattern", "--hybrid-override-pattern")
    rc, got = _import(tmp_path, line, "--megatron-version", "0.16")
    err = capsys.readouterr().err
    assert rc == 2 and got is None and err.count("\n") == 1
    assert "not modelled" not in err and "--megatron-version 0.17" in err, err


def test_the_legacy_mtp_pattern_is_the_same_run(tmp_path, capsys):
    """``--mtp-hybrid-override-pattern P`` with ``--mtp-num-layers N`` (core_v0.17.1 arguments.py:621-632, core_v0.19.0
    :748-759): ``validate_args`` appends ``/P`` N times to a pattern without ``/``; with a ``/`` in the pattern the
    legacy flag is read by nothing. Before, it was listed as unpriced and the MTP layers were dropped."""
    super_line = args_line(hybrid_form(uniform_plan(load_model("nemotron-3-super"), 1, 1, 8, 8, 64),
                                       release("0.19")))
    head, _, tail = super_line.partition("--hybrid-layer-pattern ")
    value, _, rest = tail.partition(" ")
    main_part, *mtp = value.strip("'").split("/")
    assert mtp == ["*E", "*E"] and "--mtp-num-layers 2" in super_line
    rc, want = _import(tmp_path, super_line)
    assert rc == 0, capsys.readouterr().err
    legacy = f"{head}--hybrid-layer-pattern '{main_part}' --mtp-hybrid-override-pattern '*E' {rest}"
    rc, got = _import(tmp_path, legacy)
    assert rc == 0, capsys.readouterr().err
    assert got == want
    ignored = f"{super_line} --mtp-hybrid-override-pattern 'M'"     # the pattern has '/': the legacy one is not read
    rc, got = _import(tmp_path, ignored)
    assert rc == 0 and got == want, capsys.readouterr().err
