"""A Nemotron-H / Nemotron-3 user's CUDA-graph flags (``--cuda-graph-modules attn mamba moe_router ...``, what
Megatron-LM core_v0.19's own parser accepts; ``--cuda-graph-scope`` before 0.18) read into the plan's scope
``mamba`` (megatron-core 0.16.1 ``CudaGraphScope.mamba``, 0.18+ ``CudaGraphModule.mamba``,
megatron/core/transformer/enums.py) and are priced. Before, the import refused ``mamba`` as a scope aceso did not
price; a name megatron-core does not have is still one line."""

import importlib.util
import re
from pathlib import Path

import pytest

from search.cli import main
from search.io.errors import AcesoError
from search.megatron.importer import read_megatron

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


def test_the_plan_scopes_are_megatron_cores():
    from search.settings.stack import GRAPH_SCOPES
    assert set(GRAPH_SCOPES) <= _megatron_core_scopes() | {"full_iteration"}     # 0.18+: an impl, not a module
    assert "mamba" in GRAPH_SCOPES


@pytest.mark.parametrize("flag,version", [("--cuda-graph-modules", "0.19"), ("--cuda-graph-scope", "0.17")])
def test_the_mamba_scope_is_read_and_priced(flag, version, capsys):
    """(aceso reads hybrid runs of core_v0.17 on: 0.16.1 has no --hybrid-layer-pattern.)"""
    line = LINE.format(flag=flag)
    imp = read_megatron(line, world_size=8, version=version)
    g = imp.plan.settings.stack.cuda_graphs
    assert (g.impl, g.scope) == ("transformer_engine", ("attn", "mamba"))
    assert not any("mamba" in n for n in imp.notes + imp.ignored)
    if version != "0.19":
        return
    rc = main(["explain", "--megatron-args", line, "--megatron-version", version, "--cluster", "1x8-h100"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "cuda_graphs +" in out            # the graphs' static buffers, the Mamba layers' among them


@pytest.mark.parametrize("flag", ["--cuda-graph-modules", "--cuda-graph-scope"])
def test_a_scope_megatron_core_lacks_is_one_line(flag):
    with pytest.raises(AcesoError) as e:
        read_megatron(LINE.format(flag=flag).replace("attn mamba", "attn ssm"), world_size=8, version="0.19")
    msg = str(e.value)
    assert f"{flag} ssm: not a scope of megatron-core (" in msg and "mamba" in msg and "\n" not in msg
