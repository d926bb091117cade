"""`aceso import --from megatron-lm`: the round trip export -> import gives back the same plan, and a Megatron-LM
command line is read with Megatron-LM's defaults (the newest release's), refusals and checks."""

import pytest

from search.cli import main
from search.megatron.importer import read_megatron
from search.megatron.versions import release
from search.spec.plan import load_plan
from tests.megatron_plans import CASES, case_plan

PRESET_NAMED = {"tiny-gpt-pp2", "tiny-llama-gqa-selective"}    # custom models: Megatron-LM has no model name


def _same(a, b, name):
    """``b`` (imported) is ``a`` as the newest Megatron-LM runs it: with Megatron FSDP the distributed optimizer."""
    da, db = a.model_dump(exclude={"predicted"}), b.model_dump(exclude={"predicted"})
    if a.megatron_fsdp and release().rule("fsdp_forces_distributed_optimizer"):
        da["settings"]["distributed_optimizer"] = True
    if name in PRESET_NAMED:                      # the name is not part of a command line
        assert db["model"].pop("name") == "custom"
        da["model"].pop("name")
    assert da == db
    if a.predicted and a.predicted.attention:
        assert b.predicted is not None and b.predicted.attention == a.predicted.attention


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_args_only(name, tmp_path, capsys):
    plan = case_plan(name)
    src, args, back = tmp_path / "plan.json", tmp_path / "args.txt", tmp_path / "back.json"
    src.write_text(plan.to_json())
    assert main(["export", str(src), "--to", "megatron-lm", "--args-only", "-o", str(args)]) == 0
    assert len(args.read_text().splitlines()) == 1
    assert main(["import", str(args), "--from", "megatron-lm", "--cluster", plan.cluster.label,
                 "-o", str(back)]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err                   # our own arguments: nothing unknown
    _same(plan, load_plan(back), name)


@pytest.mark.parametrize("name", ["gpt-pp3-first-last", "llama-pp4-vpp2-first-last", "t5-block1"])
def test_round_trip_through_the_script_reads_the_world_size_from_torchrun(name, tmp_path):
    plan = case_plan(name, with_cluster=False)
    src, script, back = tmp_path / "plan.json", tmp_path / "run.sh", tmp_path / "back.json"
    src.write_text(plan.to_json())
    assert main(["export", str(src), "--to", "megatron-lm", "-o", str(script)]) == 0
    assert main(["import", str(script), "--from", "megatron-lm", "-o", str(back)]) == 0
    _same(plan, load_plan(back), name)


MEGATRON_STYLE = """#!/bin/bash
# in the style of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NUM_NODES=4
CHECKPOINT_PATH=$1 #<Specify path>
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr ${MASTER_ADDR:-localhost}
)
GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 32
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # Can use (flash/fused/unfused/local)
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 512
    --train-iters 500000
    --weight-decay 0.1
    --bf16
    --lr 6.0e-5
    --recompute-activations
    --empty-unused-memory-level 1
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 4
    --num-layers-per-virtual-pipeline-stage 3
)
DATA_ARGS=(--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \\
    ${GPT_MODEL_ARGS[@]} \\
    ${TRAINING_ARGS[@]} \\
    ${MODEL_PARALLEL_ARGS[@]} \\
    ${DATA_ARGS[@]} --tokenizer-type GPT2BPETokenizer --cross-entropy-loss-fusion
"""


def test_megatron_style_script_with_megatron_defaults():
    imp = read_megatron(MEGATRON_STYLE, source="train.sh")
    plan, c = imp.plan, imp.config
    # world 8 x 4 = 32 = tp 2 x pp 4 x dp 4; 24 layers / pp 4 = 6 per rank, 3 per virtual stage -> vpp 2
    assert (c.tp, c.pp, c.dp, c.vpp, c.cp) == (2, 4, 4, 2, 1)
    assert c.chunk_layers == (3,) * 8
    assert plan.model.ffn_hidden_size == 4 * 2048                     # Megatron-LM's default
    assert (plan.model.attention_dropout, plan.model.hidden_dropout) == (0.1, 0.1)
    assert plan.model.params_dtype == "bf16" and plan.model.tied_embeddings and plan.model.add_bias_linear
    assert plan.micro_batch_size == 2 * 4 and plan.global_batch_size == 512     # per-rank 2 x dp 4
    kinds = [u.kind for u in plan.model.units[:4]]
    assert plan.stages[0].chunks[0].recompute == ["selective" if k == "attention" else "none" for k in kinds * 3][:6]
    # Megatron-LM flags aceso does not price are listed (data/lr/logging flags are not)
    # (--cross-entropy-loss-fusion is priced: the plan's stack, megatron-core's default impl "native")
    assert plan.stack is not None and plan.stack.cross_entropy_fusion == "native"
    assert imp.ignored == ["--empty-unused-memory-level"]
    assert imp.warning == "ignored 1 flag aceso does not price (the prediction is the run without it): --empty-unused-memory-level"
    # the preset with this architecture names it and supplies the vocabulary GPT2BPETokenizer would set
    assert plan.model.name == "gpt-1.3b" and plan.model.vocab_size == 51200
    assert plan.model.make_vocab_size_divisible_by == 128 * 2         # Megatron-LM pads to 128 x tp
    assert any("vocabulary: 51200 tokens, the preset gpt-1.3b's" in n for n in imp.notes)


BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 999 ")


def _read(extra: str, world=4):
    return read_megatron(BASE + extra, world_size=world)


def test_defaults_swiglu_ffn_vocab_and_global_batch():
    imp = _read("--swiglu --normalization RMSNorm --tensor-model-parallel-size 2")
    m = imp.plan.model
    assert m.ffn_hidden_size == int((4 * 256 * 2 / 3) / 64) * 64 == 640     # arguments.py's SwiGLU rule
    assert m.family == "llama" and m.vocab_size == 999                        # NullTokenizer (0.18+): EOD included
    old = read_megatron(BASE + "--swiglu --normalization RMSNorm", world_size=4, version="0.17")
    assert old.plan.model.vocab_size == 1000                                   # before 0.18 it adds the EOD token
    assert imp.plan.global_batch_size == 1 * 2                                # micro-batch x dp
    assert _read("--padded-vocab-size 1024").plan.model.padded_vocab_size == 1024


@pytest.mark.parametrize("extra,expect", [
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 1", ["full", "full"] + ["none"] * 6),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", ["full"] * 8),
    ("--recompute-granularity selective", ["selective", "none"] * 4),
    ("--recompute-granularity selective --recompute-modules core_attn", ["selective", "none"] * 4),
    ("", ["none"] * 8),
])
def test_recompute_flags(extra, expect):
    assert _read(extra, world=1).plan.stages[0].recompute == expect


def test_uniform_groups_of_several_layers_are_priced_as_every_layer_with_a_note():
    imp = _read("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", world=1)
    assert imp.plan.stages[0].recompute == ["full"] * 8
    assert any("groups of 2 layers" in n for n in imp.notes)


@pytest.mark.parametrize("version, ok", [("core_v0.16.1", False), ("core_v0.17.1", False), ("core_v0.18.2", True),
                                         ("core_v0.19.0", True)])
def test_shared_expert_overlap_with_flex_is_read_per_release(version, ok):
    """megatron-core's TransformerConfig runs --moe-shared-expert-overlap with alltoall through 0.17 and with
    alltoall or flex from 0.18 (each checkout's transformer_config.py): a flex line reads under the releases that
    run it, into a plan priced for that release, and is refused in one line under the others."""
    from search.io.errors import AcesoError
    line = BASE + ("--num-experts 8 --moe-shared-expert-intermediate-size 256 --moe-token-dispatcher-type flex "
                   "--moe-shared-expert-overlap")
    if not ok:
        with pytest.raises(AcesoError, match=f"megatron-core {release(version).series} supports it with alltoall "
                                             "only"):
            read_megatron(line, world_size=4, version=version)
        return
    plan = read_megatron(line, world_size=4, version=version).plan
    assert (plan.moe.token_dispatcher, plan.moe.shared_expert_overlap, plan.settings.release) == ("flex", True,
                                                                                                   version)


def test_account_for_embedding_and_loss_split():
    # (4 layers + embedding + loss) / pp 3 = 2 per rank; the first rank's embedding and the last's loss count as one
    imp = _read("--pipeline-model-parallel-size 3 --account-for-embedding-in-pipeline-split "
                "--account-for-loss-in-pipeline-split", world=3)
    assert imp.config.chunk_layers == (1, 2, 1)


@pytest.mark.parametrize("extra,needle", [
    ("--fp8-format hybrid --fp8-dot-product-attention", "FP8 attention is not modelled"),
    ("--fp8-format e4m3 --fp8-recipe mxfp8 --te-precision-config-file te_quant.yaml",
     "--te-precision-config-file te_quant.yaml: no such file next to the script or in the working directory"),
    # flags that change the model, the schedule or the kernels (Megatron-LM core_v0.19.0; docs/megatron.md)
    ("--attention-output-gate", "--attention-output-gate: gated attention"),
    ("--experimental-attention-variant dsa", "--experimental-attention-variant dsa: gated delta-net / DeepSeek sparse"),
    ("--fp32-residual-connection", "an fp32 residual stream is not modelled"),
    ("--deterministic-mode", "deterministic kernels and ring-only NCCL are not modelled"),
    ("--defer-embedding-wgrad-compute", "deferred output-layer weight gradients"),
    ("--tensor-parallel-num-weight-shards 4", "weight sharding beyond TP (GTP) is not modelled"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
     "--microbatch-group-size-per-virtual-pipeline-stage 4", "the interleaved schedule's default group"),
    ("--enable-cuda-graph --external-cuda-graph", "cannot be enabled at the same time"),
    ("--enable-cuda-graph --cuda-graph-impl local", "--enable-cuda-graph with --cuda-graph-impl"),
    ("--use-megatron-fsdp", "only supports the fsdp_dtensor checkpoint format; add --ckpt-format fsdp_dtensor"),
    ("--use-torch-fsdp2", "torch FSDP2 is not modelled"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy zero3",
     "--data-parallel-sharding-strategy 'zero3': choose one of no_shard"),
    ("--pipeline-model-parallel-size 2 --cpu-offloading-num-layers 1", "activation_offload needs one pipeline stage"),
    ("--cpu-offloading-num-layers 1 --recompute-activations", "does not work with activation recompute"),
    ("--cpu-offloading-num-layers 4", "must be below the model's 4 layers"),
    ("--num-experts 6 --expert-model-parallel-size 4", "stages[0].ep (4) must divide num_experts (6)"),
    ("--expert-model-parallel-size 2", "--expert-model-parallel-size 2 without --num-experts"),
    ("--num-experts 8 --moe-layer-freq '[1]*3'", "the pattern has 3 entries but --num-layers is 4"),
    ("--num-experts 8 --moe-shared-expert-intermediate-size 256 --moe-token-dispatcher-type allgather "
     "--moe-shared-expert-overlap", "supports it with alltoall or flex only"),
    ("--multi-latent-attention --group-query-attention", "mutually exclusive"),
    ("--mtp-num-layers 1 --position-embedding-type rope --pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout 'Et*2|t*2L'",
     "0 MTP layers (m) but --mtp-num-layers is 1"),
    ("--cp-comm-type a2a", "ring (p2p) context parallelism"),
    ("--recompute-granularity selective --recompute-modules core_attn mlps", "not a module of megatron-core"),
    ("--recompute-granularity selective --recompute-modules mla_up_proj", "mla_up_proj needs --multi-latent-attention"),
    ("--recompute-granularity full", "needs --recompute-method uniform|block"),
    ("--tensor-model-parallel-size 3", "not a multiple of tp x pp x cp"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*2||t*2|L'", "model chunk 1 holds nothing"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*2|t*2' ", "end with the loss L"),
    ("--num-layers 3 --pipeline-model-parallel-size 2", "must be a multiple of --pipeline-model-parallel-size (2)"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1",
     "must split evenly over the other 0 pipeline ranks"),
    ("--overlap-param-gather", "needs --use-distributed-optimizer (or --use-megatron-fsdp) and --overlap-grad-reduce"),
    ("--tp-comm-overlap --tensor-model-parallel-size 2", "needs --sequence-parallel"),
    ("--bf16 --fp16", "--bf16 and --fp16 together"),
    ("--position-embedding-type relative", "learned_absolute, rope and yarn only"),
    ("--num-layers $LAYERS", "$LAYERS, which the file does not set"),
])
def test_command_lines_aceso_cannot_honour_exit_2_with_one_line(extra, needle, tmp_path, capsys):
    assert_refused(BASE + extra, needle, tmp_path, capsys)


def assert_refused(text: str, needle: str, tmp_path, capsys, world: int = 4) -> None:
    """``aceso import`` of ``text`` exits 2 with one line holding ``needle`` and writes nothing."""
    f = tmp_path / "args.txt"
    f.write_text(text)
    assert main(["import", str(f), "--from", "megatron-lm", "--world-size", str(world),
                 "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "p.json").exists()


def test_world_size_needed_and_checked(tmp_path, capsys):
    f = tmp_path / "args.txt"
    f.write_text(BASE)
    assert main(["import", str(f), "--from", "megatron-lm"]) == 2
    assert "give --world-size N or --cluster" in capsys.readouterr().err
    assert main(["import", str(f), "--from", "megatron-lm", "--world-size", "4", "--cluster", "1x8-h100"]) == 2
    assert "world sizes disagree: --world-size 4, the cluster's 8" in capsys.readouterr().err


def test_unknown_vocabulary_asks_for_it():
    with pytest.raises(Exception, match="give aceso's --vocab-size N"):
        read_megatron(BASE.replace("--tokenizer-type NullTokenizer --vocab-size 999", ""), world_size=1)
    assert read_megatron(BASE.replace("--vocab-size 999", ""), world_size=1, vocab_size=777).plan.model.vocab_size == 777


def test_t5_command_line():
    line = ("--encoder-num-layers 4 --decoder-num-layers 4 --hidden-size 1024 --num-attention-heads 16 "
            "--kv-channels 64 --ffn-hidden-size 4096 --encoder-seq-length 2048 --decoder-seq-length 512 "
            "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 64 --fp16 "
            "--tensor-model-parallel-size 2")
    imp = read_megatron(line, world_size=8)
    m = imp.plan.model
    assert m.is_t5 and (m.num_layers, m.num_decoder_layers, m.decoder_seq_length) == (4, 4, 512)
    assert m.name == "t5-770m" and m.vocab_size == 30592        # the preset of this architecture
    with pytest.raises(Exception, match="does not support pipeline parallelism for T5"):
        read_megatron(line + " --pipeline-model-parallel-size 2", world_size=8)
    noted = read_megatron(line.replace("--decoder-num-layers 4", "--decoder-num-layers 2"), world_size=8)
    assert noted.plan.model.num_decoder_layers == 4 and any("builds 4 decoder layers" in n for n in noted.notes)


# --target megatron-lm searches (small models, small budgets) whose top plans cover pp 1-4, VPP, SP, CP, uneven
# first-stage and layout splits, selective / block recompute, GPT, Llama and T5, flash and unfused attention (uniform
# full recompute, which no search here picks since block recompute of fewer layers wins, round-trips in CASES)
SEARCHES = [
    "--model llama3-8b --num-layers 8 --cluster 1x8-h100 --global-batch-size 64 --memory-limit-mb 24000",
    "--model gpt-1.3b --num-layers 12 --cluster 1x8-h100 --global-batch-size 64 --memory-limit-mb 6000",
    "--model t5-770m --num-layers 8 --cluster 1x4-v100 --global-batch-size 64 --memory-limit-mb 5000",
    "--model t5-770m --num-layers 4 --cluster 1x8-h100 --global-batch-size 64 --memory-limit-mb 6000",
    "--model gpt-2.6b --num-layers 8 --cluster 1x8-a100 --global-batch-size 64 --memory-limit-mb 4000 "
    "--attention unfused",
    "--model llama3-70b --num-layers 8 --cluster 1x8-h100 --global-batch-size 32 --memory-limit-mb 30000",
    "--model llama3-8b --num-layers 16 --cluster 4x8-v100 --global-batch-size 64 --memory-limit-mb 12000 "
    "--micro-batch-sizes 1",
    # pp 4 asked for: the top five of the search above are faster plans on fewer stages since its final step polishes
    # every plan a smaller budget would have (issue 32); pp 4 with a layout split stays covered this way
    "--model llama3-8b --num-layers 16 --cluster 4x8-v100 --global-batch-size 64 --memory-limit-mb 12000 "
    "--micro-batch-sizes 1 --pp 4",
]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """Plans of ``aceso search --target megatron-lm --top-k 5`` on the problems above."""
    d = tmp_path_factory.mktemp("searched")
    out = []
    for i, args in enumerate(SEARCHES):
        first = d / f"s{i}.json"
        assert main(["search", *args.split(), "--target", "megatron-lm", "--budget-evals", "150", "--top-k", "5",
                     "--workers", "1", "--json", "-o", str(first)]) == 0
        out += [(args, p) for p in sorted(d.glob(f"s{i}.*json"))]
    return out


def _plans(searched, pattern: bool):
    """The target's plans, or the |-pattern line's (``PLAN.pattern.json``, written beside them)."""
    return [(a, p) for a, p in searched if (".pattern." in p.name) == pattern]


def test_round_trip_of_the_searches_pattern_plans(searched, tmp_path, capsys):
    """The |-pattern line's plans as hybrid-pattern arguments and back: the same plan, priced the same (the
    import re-prices what the line predicted)."""
    pats = _plans(searched, True)
    assert pats
    for args, path in pats:
        _through_megatron_lm(args, path, tmp_path, "--hybrid-pattern")


def _through_megatron_lm(args, path, tmp_path, *export: str):
    """The plan at ``path`` exported as arguments and imported back: the same plan, priced the same."""
    plan = load_plan(path)
    args_txt, back = tmp_path / "args.txt", tmp_path / "back.json"
    assert main(["export", str(path), *export, "--args-only", "-o", str(args_txt)]) == 0
    cl = plan.cluster
    assert main(["import", str(args_txt), "--from", "megatron-lm", "--cluster", cl.label, "--memory-limit-mb",
                 str(cl.memory_limit_mb), "-o", str(back)]) == 0
    got = load_plan(back)
    _same(plan, got, "search")
    assert got.predicted.iteration_time_ms == pytest.approx(plan.predicted.iteration_time_ms, abs=1e-5), args
    return plan


def test_round_trip_of_plans_from_target_megatron_lm_searches(searched, tmp_path, capsys):
    from search.megatron import megatron_config
    from search.megatron.layout import split_for
    seen = set()
    for args, path in _plans(searched, False):
        plan = _through_megatron_lm(args, path, tmp_path, "--to", "megatron-lm")
        c = megatron_config(plan)
        split = split_for(c.chunk_layers, c.pp, c.vpp)
        seen |= {f"pp{c.pp}", plan.model.family, c.recompute.granularity or "none", c.recompute.method or "",
                 "vpp" if c.vpp > 1 else "", "sp" if c.sequence_parallel else "", "cp" if c.cp > 1 else "",
                 "layout" if split.layout else "", "first" if split.first else "", plan.predicted.attention}
    capsys.readouterr()
    assert len(searched) >= 20
    assert {"pp1", "pp2", "pp4", "gpt", "llama", "t5", "none", "selective", "full", "block", "vpp", "sp",
            "cp", "layout", "first", "flash", "unfused"} <= seen, seen


def test_import_help_names_as_refused_only_what_the_importer_refuses():
    """`aceso import --help` once said MoE, FP8, MLA and FSDP flags were refused; the importer reads and prices
    each of them. The help's refused list must name none of those, and what it names is refused."""
    import re
    from search.cli.import_cmd import __doc__ as doc
    from search.io.errors import AcesoError
    base = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 --vocab-size 32000 --bf16 ")
    read = {"MoE": "--num-experts 8 --moe-router-topk 2", "FP8": "--fp8-format hybrid --fp8-recipe tensorwise",
            "MLA": "--multi-latent-attention --kv-lora-rank 64 --qk-head-dim 64 --qk-pos-emb-head-dim 32 --v-head-dim 64",
            "FSDP": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor"}
    for flags in read.values():
        read_megatron(base + flags, world_size=8)
    refused = " ".join(doc.split()).split("refused with one line")[0].rsplit("flags aceso does not model", 1)[1]
    items = [x.strip() for x in re.search(r"\(([^)]*)\)", refused).group(1).split(",")]
    assert not set(items) & set(read), items
    for flags in ("--use-torch-fsdp2", "--fp8-format hybrid --fp8-dot-product-attention", "--rampup-batch-size 16 16 100"):
        with pytest.raises(AcesoError):
            read_megatron(base + flags, world_size=8)


_MOE_LINE = ("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 4 --hidden-size 1024 --num-attention-heads 16 "
             "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 --bf16 "
             "--vocab-size 32000 --tokenizer-type NullTokenizer --num-experts 8 --expert-model-parallel-size 8 "
             "--moe-token-dispatcher-type alltoall --moe-grouped-gemm ")


def test_moe_layer_recompute_is_read_as_megatron_core_sets_it():
    """``--moe-layer-recompute`` (deprecated, every supported release) is megatron-core's selective recompute with
    'moe' appended to the modules, which default to core_attn (TransformerConfig.__post_init__): the attention units
    recompute their core, the whole-MoE recompute is said in a note (not priced), and the flag is not listed as
    ignored (before: "does not change the plan", priced with no recompute at all)."""
    imp = read_megatron(_MOE_LINE + "--moe-layer-recompute")
    assert imp.warning is None and "--moe-layer-recompute" not in imp.ignored
    kinds = {u.kind: rc for u, rc in zip(imp.plan.model.units, imp.plan.stages[0].chunks[0].recompute)}
    assert kinds == {"attention": "selective", "moe": "none"}
    assert any(n.startswith("--recompute-modules moe:") for n in imp.notes)
    given = read_megatron(_MOE_LINE + "--moe-layer-recompute --recompute-granularity selective --recompute-modules "
                                      "moe_act")      # explicit modules replace the core_attn default
    assert {u.kind: rc for u, rc in zip(given.plan.model.units, given.plan.stages[0].chunks[0].recompute)} == \
        {"attention": "none", "moe": "selective"}
    with pytest.raises(Exception, match="--moe-layer-recompute with --recompute-granularity full"):
        read_megatron(_MOE_LINE + "--moe-layer-recompute --recompute-granularity full --recompute-method uniform "
                                  "--recompute-num-layers 1")


def test_other_spellings_are_read_as_the_flags_they_stand_for():
    """Megatron-LM's own equivalences, priced instead of listed as unpriced: ``--disable-align-grad-reduce`` is the
    same parser field as ``--no-align-grad-reduce`` (core_v0.17.1 on: dest ``align_grad_reduce``, store_false);
    ``validate_args`` sets ``cuda_graph_impl`` local / transformer_engine for ``--enable-cuda-graph`` /
    ``--external-cuda-graph`` (core_v0.16.1 arguments.py:434-454, core_v0.19.0 :593-613)."""
    base = BASE + " --use-distributed-optimizer --overlap-grad-reduce --pipeline-model-parallel-size 2 "
    one, two = (read_megatron(base + x, world_size=4) for x in ("--disable-align-grad-reduce", "--no-align-grad-reduce"))
    assert one.warning is None and one.plan.settings == two.plan.settings
    assert one.plan.settings.data_parallel.align_grad_reduce is False
    for switch, impl in (("--enable-cuda-graph", "local"), ("--external-cuda-graph", "transformer_engine")):
        old = read_megatron(BASE + switch, world_size=4)
        new = read_megatron(BASE + f"--cuda-graph-impl {impl}", world_size=4)
        assert old.warning is None and old.plan.settings.stack == new.plan.settings.stack
        assert old.plan.settings.stack.cuda_graphs.impl == impl


def test_consistent_and_harmless_flags_are_not_listed():
    """Weight shards equal to tp and a micro-batch group equal to pp are megatron-core's defaults (no GTP, the
    default interleaved group): accepted without a warning; warm-up-only and bookkeeping switches are quiet."""
    imp = read_megatron(BASE + "--tensor-model-parallel-size 2 --tensor-parallel-num-weight-shards 2 "
                               "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
                               "--microbatch-group-size-per-virtual-pipeline-stage 2 --cuda-graph-warmup-steps 3 "
                               "--te-rng-tracker --calculate-per-token-loss --inference-max-requests 8 "
                               "--global-batch-size 8", world_size=4)
    assert imp.warning is None, imp.warning


@pytest.mark.parametrize("extra,needle", [
    ("--hybrid-layer-pattern M*M*", "--hybrid-layer-pattern with pretrain_gpt.py: Megatron-LM takes --num-layers"),
    ("--spec megatron.core.models.gpt.gpt_layer_specs my_spec", "--spec with pretrain_gpt.py: a custom layer spec"),
])
def test_hybrid_flags_on_a_gpt_script_exit_2_with_one_line(extra, needle, tmp_path, capsys):
    """A hybrid line's pattern or layer spec on pretrain_gpt.py: validate_args takes --num-layers from the pattern
    (core_v0.19.0 arguments.py:761-771) but the script builds GPT layers; --spec replaces the GPT spec. Read from
    pretrain_hybrid.py both are the hybrid model's (tests/unit/test_hybrid_*)."""
    f = tmp_path / "run.sh"
    f.write_text("torchrun --nproc-per-node 4 pretrain_gpt.py " + BASE + extra)
    assert main(["import", str(f), "--from", "megatron-lm", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "p.json").exists()
