"""Every example launch script of each Megatron-LM release (core_v0.16.1 to core_v0.19.0, read from a checkout:
tests/unit/megatron_examples.py) is read as bash reads it, under the release it was written for, and imports right or
is refused with its true reason in one line (issues 21, 33)."""

from __future__ import annotations

import os
import re

import pytest

from search.cli import main
from search.io.errors import AcesoError
from search.megatron.importer import read_megatron
from search.megatron.shell import read_command
from search.megatron.versions import tags
from tests.unit.megatron_examples import BASE, EXPECTED, example_text, examples_root, expected

SCRIPTS = sorted(EXPECTED)
CASES = [(tag, rel) for tag in tags() for rel in sorted(expected(tag))]


def _text(rel: str, tag: str = BASE) -> str:
    return example_text(rel, tag)


@pytest.mark.parametrize("tag", tags())
def test_every_example_script_has_an_expected_outcome(tag):
    root = examples_root(tag)
    if root is None:
        example_text("", tag)                       # skips, saying where the scripts are read from
    found = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith(".sh"))
    want = expected(tag)
    assert set(found) <= set(want), sorted(set(found) - set(want))
    own = set(want) - set(EXPECTED)                 # a release's own entries name scripts it has
    assert own <= set(found), sorted(own - set(found))
    if tag == BASE:
        assert len(SCRIPTS) == 111 and found == SCRIPTS
    else:
        assert len(found) == {"core_v0.17.1": 114, "core_v0.18.2": 111, "core_v0.19.0": 113}[tag]


@pytest.mark.parametrize("tag,rel", CASES)
def test_example_script(tag, rel):
    root = examples_root(tag)
    if root is not None and not os.path.exists(os.path.join(root, rel)):
        pytest.skip(f"{rel} is not in {tag}")
    text = _text(rel, tag)
    try:
        read_megatron(text, source=rel, version=tag)
        got = "ok"
    except AcesoError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(rel + ": ")
        got = msg[len(rel) + 2:]
    assert got.startswith(expected(tag)[rel])


def test_llama3_fp8_script_keeps_its_appends():
    """The FP8 example imports its recipe (appended by DTYPE_ARGS+=(...): hybrid, Megatron-LM's default delayed
    recipe, --fp8-param-gather); as a bf16 run (its DTYPE changed) nothing appended is lost."""
    text = _text("llama/train_llama3_8b_h100_fp8.sh")
    low = read_megatron(text, source="fp8.sh", version=BASE).plan.settings.low_precision
    assert (low.recipe, low.param_gather) == ("fp8-delayed", True)
    cmd = read_command(text.replace('DTYPE="fp8"', 'DTYPE="bf16"'))
    assert cmd.script == "pretrain_gpt.py" and cmd.world_size == 8
    assert not any(a.startswith("--fp8") for a in cmd.argv)
    for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--mock-data"):
        assert flag in cmd.argv                     # TRAINING_ARGS+=("${DDP_ARGS[@]}") and DATA_ARGS_LIST+=(...)
    assert cmd.argv[cmd.argv.index("--vocab-size") + 1] == "128256"
    assert cmd.argv[cmd.argv.index("--split") + 1] == "'99,1,0'"     # bash keeps the inner quotes literal
    imp = read_megatron(text.replace('DTYPE="fp8"', 'DTYPE="bf16"'), source="bf16.sh", version=BASE)
    c = imp.config.settings
    assert (c.distributed_optimizer, c.overlap_grad_reduce, c.overlap_param_gather) == (True, True, True)
    assert imp.plan.model.vocab_size == 128256 + 1                   # NullTokenizer adds EOD
    assert imp.plan.model.position_embedding == "rope" and imp.plan.model.num_query_groups == 8


def test_t5_example_multi_line_strings():
    """DISTRIBUTED_ARGS="...newlines..." is one string split into words when expanded unquoted."""
    text = _text("t5/train_t5_220m_distributed.sh")
    cmd = read_command(text)
    assert cmd.script == "pretrain_t5.py" and cmd.world_size == 8
    imp = read_megatron(text, source="t5.sh", vocab_size=28996 + 100, version=BASE)
    m = imp.plan.model
    assert m.is_t5 and (m.num_layers, m.hidden_size, m.num_attention_heads) == (12, 768, 12)


def test_mixtral_reads_on_four_nodes_and_is_refused_on_one():
    """Its default one node (8 GPUs) with pp 4 leaves 2 GPUs per stage for ep 8 (megatron-core's folding refuses
    it too); with SLURM_NNODES 4 it is the mixtral-8x7b preset with ep 8, the alltoall dispatcher, grouped GEMM."""
    text = _text("mixtral/train_mixtral_8x7b_distributed.sh")
    with pytest.raises(AcesoError, match=re.escape("etp (1) x ep (8) must divide the stage's num_gpus (2)")):
        read_megatron(text, source="mixtral.sh", version=BASE)
    imp = read_megatron(text.replace('NNODES=${SLURM_NNODES:-"1"}', 'NNODES=${SLURM_NNODES:-"4"}'), source="m.sh",
                        version=BASE)
    p = imp.plan
    assert (p.model.name, p.world_size, p.num_stages, p.stages[0].ep, p.moe.token_dispatcher, p.moe.grouped_gemm) \
        == ("mixtral-8x7b", 32, 4, 8, "alltoall", True)
    assert p.model.moe.moe_aux_loss_coeff == 0.01 and not p.model.moe.moe_router_force_load_balancing
    dense = re.sub(r"MOE_ARGS=\(.*?\)", "MOE_ARGS=()", text, flags=re.S).replace("--expert-model-parallel-size 8",
                                                                             "")
    imp = read_megatron(dense, source="dense.sh", vocab_size=32000, version=BASE)     # --no-position-embedding + rope: RoPE
    assert imp.plan.model.position_embedding == "rope"


# ----- the pretraining examples of every release, read under that release (issue 33) ---------------------------
@pytest.mark.parametrize("tag", tags())
def test_each_release_reads_its_own_pretraining_examples(tag):
    """Llama-3 8B FP8 (the recipe appended by DTYPE_ARGS+=), T5 220M (its vocabulary given: a WordPiece file),
    Mixtral 8x7B on four nodes: each release's own script imports under that release, as its flags say."""
    llama = read_megatron(_text("llama/train_llama3_8b_h100_fp8.sh", tag), source="llama.sh", version=tag)
    text = _text("llama/train_llama3_8b_h100_fp8.sh", tag)
    m = llama.plan.model
    eod = 1 if tag in ("core_v0.16.1", "core_v0.17.1") else 0      # NullTokenizer adds the EOD token before 0.18
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.groups, m.vocab_size) == (32, 4096, 14336, 8,
                                                                                         128256 + eod)
    assert m.normalization == ("rmsnorm" if "--normalization RMSNorm" in text else "layernorm")
    low = llama.plan.settings.low_precision
    assert (low.recipe, low.param_gather) == ("fp8-delayed", True) and llama.release.tag == tag
    t5 = read_megatron(_text("t5/train_t5_220m_distributed.sh", tag), source="t5.sh", vocab_size=28996 + 100,
                       version=tag).plan
    assert t5.model.is_t5 and (t5.model.num_layers, t5.model.hidden_size, t5.world_size) == (12, 768, 8)
    mixtral = _text("mixtral/train_mixtral_8x7b_distributed.sh", tag)
    p = read_megatron(mixtral.replace('NNODES=${SLURM_NNODES:-"1"}', 'NNODES=${SLURM_NNODES:-"4"}'), source="m.sh",
                      version=tag).plan
    assert (p.model.name, p.world_size, p.num_stages, p.stages[0].ep) == ("mixtral-8x7b", 32, 4, 8)


@pytest.mark.parametrize("tag", ["core_v0.18.2", "core_v0.19.0"])
def test_gpt3_example_without_its_batch_size_schedule_on_sixteen_nodes(tag):
    """From 0.18 the GPT-3 175B example ramps its batch up with --step-batch-size-schedule (refused like
    --rampup-batch-size: plan the final size); without it, on its 16 nodes, it is tp 8 x pp 16."""
    text = _text("gpt3/train_gpt3_175b_distributed.sh", tag)
    with pytest.raises(AcesoError, match="--step-batch-size-schedule .*: a batch-size schedule changes the plan"):
        read_megatron(text, source="gpt3.sh", version=tag)
    text = re.sub(r"--step-batch-size-schedule \"[^\"]*\"", "", text).replace("NUM_NODES=1", "NUM_NODES=16")
    p = read_megatron(text, source="gpt3.sh", version=tag, vocab_size=50257).plan
    assert (p.num_stages, p.stages[0].tp, p.global_batch_size, p.model.num_layers) == (16, 8, 1536, 96)


def _explain(tmp_path, capsys, text: str, *extra) -> dict:
    import json
    f = tmp_path / "run.sh"
    f.write_text(text)
    assert main(["explain", "--megatron-args-file", str(f), "--cluster", "1x8-h100", "--search-budget-evals", "0",
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tag", ["core_v0.18.2", "core_v0.19.0"])
def test_explain_prices_the_fsdp_example_with_its_releases_defaults(tag, tmp_path, capsys):
    """The Megatron FSDP example of 0.18 / 0.19 without its --data-parallel-sharding-strategy: `aceso explain`
    (default: the newest release; --megatron-version names the script's) prices what the release runs, its default
    strategy optim_grads_params with the distributed optimizer, exactly as the line that gives both; read as a 0.17
    script the same flags are no_shard without the distributed optimizer (0.17's defaults)."""
    text = _text("megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh", tag).replace('DTYPE="fp8"', 'DTYPE="bf16"')
    bare = text.replace("--data-parallel-sharding-strategy ${SHARDING_STRATEGY}", "").replace(
        "    --use-distributed-optimizer\n", "")
    assert "--data-parallel-sharding-strategy" not in bare and "--use-distributed-optimizer" not in bare
    new = _explain(tmp_path, capsys, bare, *(["--megatron-version", tag] if tag != "core_v0.19.0" else []))
    given = _explain(tmp_path, capsys, text.replace("${SHARDING_STRATEGY}", "optim_grads_params"),
                     "--megatron-version", tag)
    old = _explain(tmp_path, capsys, bare, "--megatron-version", "0.17")
    assert (new["iteration_time_ms"], new["max_memory_mib"]) == (given["iteration_time_ms"], given["max_memory_mib"])
    f_new, f_old = new["features"], old["features"]
    assert f_new["fsdp_offload"].startswith("megatron-fsdp optim_grads_params") and f_new["distributed_optimizer"]
    assert f_old["fsdp_offload"].startswith("megatron-fsdp no_shard") and not f_old["distributed_optimizer"]
    assert old["max_memory_mib"] > new["max_memory_mib"] and new["fits"]
