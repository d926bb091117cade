"""A plan with transformer-engine's cross-entropy fusion (a Bridge recipe's: ``--target megatron-bridge`` prices
llama3's ``te``) exported as a Megatron-LM script: core_v0.18.2 and core_v0.19.0 refuse ``--cross-entropy-fusion-impl
te`` in validate_args ("Transformer Engine cross entropy loss fusion is disabled due to stability issues. Use
--cross-entropy-fusion-impl native, or omit --cross-entropy-loss-fusion": core_v0.18.2
megatron/training/arguments.py:1529, core_v0.19.0 arguments.py:1643), core_v0.16.1 and core_v0.17.1 run it. So the
script for 0.18+ writes ``native`` and its header prices ``native`` (what ``aceso explain`` of the same plan with
``native`` gives); for 0.17 it writes ``te`` at the plan's own price."""

from __future__ import annotations

import json
import re

from search.cli import main


def _run(capsys, *argv) -> tuple[str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out, cap.err


def _header_ms(text: str) -> str:
    return re.search(r"^# predicted .*?: ([\d.]+) ms per iteration", text, re.M).group(1)


def test_te_fusion_is_written_native_from_megatron_lm_0_18(tmp_path, capsys):
    plan_path = tmp_path / "p.json"
    _run(capsys, "search", "--model", "llama3-8b", "--cluster", "1x8-h100", "--global-batch-size", "64", "--target",
         "megatron-bridge", "--budget-evals", "40", "--workers", "1", "-o", str(plan_path))
    plan = json.loads(plan_path.read_text())
    assert plan["settings"]["stack"] == {"cross_entropy_fusion": "te"}
    native = dict(plan, settings={**plan["settings"], "stack": {"cross_entropy_fusion": "native"}})
    native_path = tmp_path / "native.json"
    native_path.write_text(json.dumps(native))
    for version, impl in (("0.17", "te"), ("0.18", "native"), ("0.19", "native")):
        script = tmp_path / f"train-{version}.sh"
        _, err = _run(capsys, "export", str(plan_path), "--to", "megatron-lm", "--megatron-version", version, "-o",
                      str(script))
        text = script.read_text()
        assert f"--cross-entropy-fusion-impl {impl}" in text, version
        assert "--cross-entropy-fusion-impl te" not in text or impl == "te", version
        ref = tmp_path / f"ref-{version}.sh"       # the same plan stating the impl the script runs
        _run(capsys, "export", str(plan_path if impl == "te" else native_path), "--to", "megatron-lm",
             "--megatron-version", version, "-o", str(ref))
        assert _header_ms(text) == _header_ms(ref.read_text()), version
        if impl == "native":
            assert "header prices the plan as this file runs" in err, version
    # the te price is not the native one: the header moved
    assert _header_ms((tmp_path / "train-0.17.sh").read_text()) != _header_ms((tmp_path / "train-0.19.sh").read_text())
