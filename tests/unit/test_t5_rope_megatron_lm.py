"""A T5 with a RoPE base other than 10000 or with RoPE scaling is refused for Megatron-LM in one line naming the
field: before, ``aceso export --to megatron-lm`` wrote ``--rotary-base 500000`` (or ``--use-rope-scaling``) into a
pretrain_t5.py script that trains another model. Reference: Megatron-LM ``pretrain_t5.py`` (core_v0.16.1, 0.17.1;
``examples/t5/pretrain_t5.py`` from 0.18) calls ``T5Model(..., position_embedding_type=args.position_embedding_type,
rotary_percent=args.rotary_percent, ...)``, and ``T5Model.__init__`` (megatron-core 0.16.1 to 0.19.2) has no rotary
base or RoPE-scaling parameter: its ``RotaryEmbedding`` runs the default ``rotary_base=10000``, unscaled. The
checkouts' own files are read too when ``ACESO_MEGATRON_LM`` names them."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from search.cli import main
from search.io.errors import AcesoError
from search.megatron.importer import read_megatron
from search.megatron.expressible import check_expressible
from search.spec.model import ModelSpec
from search.spec.plan import uniform_plan
from search.targets.capabilities import model_refusal
from tests.tiny_models import T5

ROPE = ModelSpec.model_validate({**T5.model_dump(), "position_embedding": "rope"})
BASE = ROPE.model_copy(update={"rotary_base": 500000.0})
SCALED = ModelSpec.model_validate({**ROPE.model_dump(), "rope_scaling": {"type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("model,start", [(BASE, "model.rotary_base (500000) with T5"),
                                         (SCALED, "model.rope_scaling (llama3) with T5")])
def test_search_and_export_refuse_it_in_one_line(model, start, tmp_path, capsys):
    why = model_refusal("megatron-lm", model)
    assert why == f"--target megatron-lm: {check_expressible(uniform_plan(model, 1, 1, 1, 2, 4))}", why
    assert why.startswith(f"--target megatron-lm: {start}") and "\n" not in why
    path, out = tmp_path / "plan.json", tmp_path / "run.sh"
    path.write_text(uniform_plan(model, 1, 1, 1, 2, 4).to_json())
    assert main(["export", str(path), "--to", "megatron-lm", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert start in err and "\n" not in err and not out.exists()


def test_default_base_and_percent_still_export(tmp_path, capsys):
    """rotary_percent is T5Model's own argument (pretrain_t5.py passes --rotary-percent): no refusal."""
    model = ROPE.model_copy(update={"rotary_percent": 0.5})
    assert check_expressible(uniform_plan(model, 1, 1, 1, 2, 4)) is None
    assert model_refusal("megatron-lm", model) is None and model_refusal("megatron-lm", T5) is None
    assert model_refusal("megatron-lm", T5.model_copy(update={"rotary_base": 500000.0})) is None  # learned: unused


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0"])
def test_the_checkouts_t5_model_takes_no_base_or_scaling(tag):
    root = Path(os.environ.get("ACESO_MEGATRON_LM", "").replace("{tag}", tag))
    source = root / "megatron/core/models/T5/t5_model.py"
    if not os.environ.get("ACESO_MEGATRON_LM") or not source.is_file():
        pytest.skip("set ACESO_MEGATRON_LM to a Megatron-LM checkout ({tag} for each release)")
    init = next(f for c in ast.walk(ast.parse(source.read_text())) if isinstance(c, ast.ClassDef)
                and c.name == "T5Model" for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    params = {a.arg for a in init.args.args}
    assert "rotary_percent" in params and not params & {"rotary_base", "rope_scaling", "rope_scaling_factor"}
    script = next(p for p in (root / "pretrain_t5.py", root / "examples/t5/pretrain_t5.py") if p.is_file())
    call = next(n for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "T5Model")
    assert "rotary_percent" in {k.arg for k in call.keywords}


T5_LINE = ("pretrain_t5.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --encoder-seq-length 32 "
           "--decoder-seq-length 16 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
           "--vocab-size 256 --bf16 --position-embedding-type ")


@pytest.mark.parametrize("extra,note", [("rope --rotary-base 500000", "--rotary-base 500000 is not used"),
                                        ("rope --use-rope-scaling", "--use-rope-scaling is not used")])
def test_import_of_a_t5_line_models_what_pretrain_t5_trains(extra, note):
    imp = read_megatron(T5_LINE + extra, world_size=1)
    m = imp.plan.model
    assert (m.position_embedding, m.rotary_base, m.rope_scaling) == ("rope", 10000.0, None)
    assert any(n.startswith(note) for n in imp.notes), imp.notes


def test_import_of_t5_with_yarn_is_refused_in_one_line():
    """T5Model builds rotary embeddings for 'rope' only: with yarn it would train with no position information."""
    with pytest.raises(AcesoError, match=r"--position-embedding-type yarn with pretrain_t5.py: .*use rope$"):
        read_megatron(T5_LINE + "yarn", world_size=1)
