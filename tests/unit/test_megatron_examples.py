"""Every example launch script of Megatron-LM core_v0.16.1 (read from a checkout: tests/unit/megatron_examples.py) is read as bash
reads it and imports right or is refused with its true reason in one line (issue 21)."""

from __future__ import annotations

import os
import re

import pytest

from search.errors import AcesoError
from search.megatron.importer import read_megatron
from search.megatron.shell import read_command
from tests.unit.megatron_examples import EXPECTED, example_text, examples_root

SCRIPTS = sorted(EXPECTED)


def _text(rel: str) -> str:
    return example_text(rel)


def test_every_example_script_has_an_expected_outcome():
    root = examples_root()
    if root is None:
        example_text("")                            # skips, saying where the scripts are read from
    found = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".sh"))
    assert len(SCRIPTS) == 111 and found == SCRIPTS


@pytest.mark.parametrize("rel", SCRIPTS)
def test_example_script(rel):
    try:
        read_megatron(_text(rel), source=rel)
        got = "ok"
    except AcesoError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(rel + ": ")
        got = msg[len(rel) + 2:]
    assert got.startswith(EXPECTED[rel])


def test_llama3_fp8_script_keeps_its_appends():
    """The FP8 example imports its recipe (appended by DTYPE_ARGS+=(...): hybrid, Megatron-LM's default delayed
    recipe, --fp8-param-gather); as a bf16 run (its DTYPE changed) nothing appended is lost."""
    text = _text("llama/train_llama3_8b_h100_fp8.sh")
    low = read_megatron(text, source="fp8.sh").plan.settings.low_precision
    assert (low.recipe, low.param_gather) == ("fp8-delayed", True)
    cmd = read_command(text.replace('DTYPE="fp8"', 'DTYPE="bf16"'))
    assert cmd.script == "pretrain_gpt.py" and cmd.world_size == 8
    assert not any(a.startswith("--fp8") for a in cmd.argv)
    for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--mock-data"):
        assert flag in cmd.argv                     # TRAINING_ARGS+=("${DDP_ARGS[@]}") and DATA_ARGS_LIST+=(...)
    assert cmd.argv[cmd.argv.index("--vocab-size") + 1] == "128256"
    assert cmd.argv[cmd.argv.index("--split") + 1] == "'99,1,0'"     # bash keeps the inner quotes literal
    imp = read_megatron(text.replace('DTYPE="fp8"', 'DTYPE="bf16"'), source="bf16.sh")
    c = imp.config
    assert (c.distributed_optimizer, c.overlap_grad_reduce, c.overlap_param_gather) == (True, True, True)
    assert imp.plan.model.vocab_size == 128256 + 1                   # NullTokenizer adds EOD
    assert imp.plan.model.position_embedding == "rope" and imp.plan.model.num_query_groups == 8


def test_t5_example_multi_line_strings():
    """DISTRIBUTED_ARGS="...newlines..." is one string split into words when expanded unquoted."""
    text = _text("t5/train_t5_220m_distributed.sh")
    cmd = read_command(text)
    assert cmd.script == "pretrain_t5.py" and cmd.world_size == 8
    imp = read_megatron(text, source="t5.sh", vocab_size=28996 + 100)
    m = imp.plan.model
    assert m.is_t5 and (m.num_layers, m.hidden_size, m.num_attention_heads) == (12, 768, 12)


def test_mixtral_reads_on_four_nodes_and_is_refused_on_one():
    """Its default one node (8 GPUs) with pp 4 leaves 2 GPUs per stage for ep 8 (megatron-core's folding refuses
    it too); with SLURM_NNODES 4 it is the mixtral-8x7b preset with ep 8, the alltoall dispatcher, grouped GEMM."""
    text = _text("mixtral/train_mixtral_8x7b_distributed.sh")
    with pytest.raises(AcesoError, match=re.escape("etp (1) x ep (8) must divide the stage's num_gpus (2)")):
        read_megatron(text, source="mixtral.sh")
    imp = read_megatron(text.replace('NNODES=${SLURM_NNODES:-"1"}', 'NNODES=${SLURM_NNODES:-"4"}'), source="m.sh")
    p = imp.plan
    assert (p.model.name, p.world_size, p.num_stages, p.stages[0].ep, p.moe.token_dispatcher, p.moe.grouped_gemm) \
        == ("mixtral-8x7b", 32, 4, 8, "alltoall", True)
    assert p.model.moe.moe_aux_loss_coeff == 0.01 and not p.model.moe.moe_router_force_load_balancing
    dense = re.sub(r"MOE_ARGS=\(.*?\)", "MOE_ARGS=()", text, flags=re.S).replace("--expert-model-parallel-size 8",
                                                                             "")
    imp = read_megatron(dense, source="dense.sh", vocab_size=32000)     # --no-position-embedding + rope: RoPE
    assert imp.plan.model.position_embedding == "rope"
