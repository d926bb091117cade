"""A Nemotron-H / Nemotron-3 user's CUDA-graph flags (``--cuda-graph-modules attn mamba moe_router ...``, what
Megatron-LM core_v0.19's own parser accepts) are refused in one line that says the truth: aceso does not price the
``mamba`` scope yet. Before, the line named ``--cuda-graph-scope`` (not the flag given) and said ``mamba`` was "not a
scope of megatron-core 0.16.1", which has it (``CudaGraphScope.mamba``, megatron/core/transformer/enums.py)."""

import importlib.util
import re
from pathlib import Path

import pytest

from search.cli import main

LINE = ("--num-layers 4 --hybrid-layer-pattern 'M*M-' --spec megatron.core.models.hybrid.hybrid_layer_specs "
        "hybrid_stack_spec --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 --seq-length 2048 "
        "--max-position-embeddings 2048 --position-embedding-type none --normalization RMSNorm --squared-relu "
        "--untie-embeddings-and-output-weights --disable-bias-linear --mamba-num-heads 32 --mamba-head-dim 64 "
        "--mamba-num-groups 8 --mamba-state-dim 128 --tensor-model-parallel-size 1 --micro-batch-size 1 "
        "--global-batch-size 8 --bf16 --tokenizer-type NullTokenizer --vocab-size 32000 "
        "--cuda-graph-impl transformer_engine {flag} attn mamba")


def _megatron_core_scopes() -> set[str]:
    """The scope names of the installed megatron-core (CudaGraphScope, 0.19: CudaGraphModule), read as text."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    enums = Path(list(spec.submodule_search_locations)[0]) / "core" / "transformer" / "enums.py"
    if not enums.is_file():
        pytest.skip("megatron-core has no transformer/enums.py")
    body = re.search(r"class CudaGraph(?:Scope|Module)\(enum\.Enum\):(.*?)(?:\nclass |\Z)", enums.read_text(),
                     re.S).group(1)
    return set(re.findall(r"^\s+(\w+) = \d+", body, re.M))


@pytest.mark.parametrize("flag", ["--cuda-graph-modules", "--cuda-graph-scope"])
def test_mamba_scope_is_refused_as_unpriced_not_as_unknown(flag, capsys):
    assert "mamba" in _megatron_core_scopes()
    rc = main(["explain", "--megatron-args", LINE.format(flag=flag), "--cluster", "1x8-h100"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{flag} mamba:" in err and "not price" in err and "not a scope" not in err, err
