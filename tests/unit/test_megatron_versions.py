"""Megatron-LM releases as data (search/megatron/versions.py, issue 33): each release's parser as generated from its
source, a script read under the release it names, an export written for a chosen release, and the round trip
search -> export -> import for dense, MoE, FSDP and T5 plans under every release."""

from __future__ import annotations

import json
import shlex

import pytest

from search.cli import main
from search.io.errors import AcesoError
from search.megatron import megatron_config
from search.megatron.importer import read_megatron
from search.megatron.script import argv
from search.settings.moe_plan import MoEPlanSettings
from search.megatron.versions import RENAMED, RULES, having, newest, release, releases, tags
from search.spec.plan import load_plan
from tests.megatron_moe_plans import MOE_CASES, moe_case_plan
from tests.megatron_plans import CASES, case_plan

# NVIDIA/Megatron-LM tags and commits (git rev-list -n1 TAG) and the flag counts of their parsers as issue 33
# measured them (core_v0.16.1: 680 flags, core_v0.19.0: 845)
TAGS = {"core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
        "core_v0.17.1": "266f1c97dca477ca8b92c16087506da2000b0b84",
        "core_v0.18.2": "571370c829ca768fe37244f4e2e7f28d8accc4ab",
        "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3"}
_MLM = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 ")


def test_each_release_is_its_tag_and_commit_and_the_newest_is_the_default():
    assert tags() == list(TAGS) and [r.tag for r in releases()] == list(TAGS)
    assert {r.tag: r.commit for r in releases()} == TAGS
    assert release().tag == newest().tag == "core_v0.19.0"
    assert len(release("0.16").flags) == 680 and len(release("0.19").flags) == 845
    for name in ("0.19", "0.19.2", "v0.19", "core_v0.19.0", "core_v0.19.1"):
        assert release(name).tag == "core_v0.19.0"
    with pytest.raises(AcesoError, match=r"--megatron-version 0\.20: aceso knows Megatron-LM 0\.16 \(core_v0\.16\.1\)"):
        release("0.20")


def test_the_importers_defaults_are_each_releases_parser_defaults():
    """The defaults the importer applied before releases were data (literals in cmdline / model_args / moe_flags)
    are core_v0.16.1's parser defaults; the one aceso reads that changed since is Megatron FSDP's strategy
    (megatron/training/arguments.py: default 'no_shard' to 0.17, 'optim_grads_params' from 0.18)."""
    before = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--context-parallel-size": 1,
              "--cpu-offloading-num-layers": 0, "--num-layers-at-start-in-bf16": 1, "--num-layers-at-end-in-bf16": 1,
              "--data-parallel-sharding-strategy": "no_shard", "--ckpt-format": "torch_dist",
              "--position-embedding-type": "learned_absolute", "--normalization": "LayerNorm",
              "--transformer-impl": "transformer_engine", "--rotary-base": 10000, "--attention-dropout": 0.1,
              "--hidden-dropout": 0.1, "--attention-backend": "auto", "--make-vocab-size-divisible-by": 128,
              "--softmax-type": "vanilla", "--glu-linear-offset": 0.0, "--moe-router-topk": 2,
              "--expert-model-parallel-size": 1, "--moe-token-dispatcher-type": "allgather",
              "--moe-flex-dispatcher-backend": "deepep", "--q-lora-rank": None, "--kv-lora-rank": 32,
              "--qk-head-dim": 128, "--qk-pos-emb-head-dim": 64, "--v-head-dim": 128}
    for r in releases():
        got = {f: r.default(f) for f in before}
        want = dict(before, **({"--data-parallel-sharding-strategy": "optim_grads_params"} if r.version >= (0, 18)
                               else {}))
        assert got == want, r.tag


def test_rules_and_renames_agree_with_the_data():
    # validate_args / null_tokenizer.py of each tag (tests/runtime/test_megatron_lm_oracle.py runs them)
    rules = ("fsdp_forces_distributed_optimizer", "null_tokenizer_counts_eod", "te_cross_entropy_refused",
             "local_graphs_ep_need_no_inference_pad")
    for rule in rules:
        assert [r.rule(rule) for r in releases()] == [False, False, True, True]
    assert set(RULES) == set(rules)
    assert [r.null_vocab(1000) for r in releases()] == [1001, 1001, 1000, 1000]
    for old, new in RENAMED.items():
        assert having(old) and newest().has(new), old
        for r in releases():                # a release reads the replacement where it has it, else the old name
            assert r.flag_name(old) == (new if r.has(new) else old)
            one = sum(n == new for n in RENAMED.values()) == 1     # two flags replaced by one: no way back
            assert r.flag_name(new) == (new if r.has(new) else old if r.has(old) and one else new)
    assert release("0.17").flag_name("--cuda-graph-modules") == "--cuda-graph-scope"
    assert release("0.19").flag_name("--cuda-graph-scope") == "--cuda-graph-modules"
    t5 = {r.tag: r.entry_path("pretrain_t5.py") for r in releases()}
    assert t5 == {"core_v0.16.1": "pretrain_t5.py", "core_v0.17.1": "pretrain_t5.py",
                  "core_v0.18.2": "examples/t5/pretrain_t5.py", "core_v0.19.0": "examples/t5/pretrain_t5.py"}


@pytest.mark.parametrize("version,fsdp", [("0.16", "no_shard"), ("0.17", "no_shard"), ("0.18", "optim_grads_params"),
                                          ("0.19", "optim_grads_params"), (None, "optim_grads_params")])
def test_fsdp_without_a_strategy_is_what_the_release_runs(version, fsdp):
    """--use-megatron-fsdp without --data-parallel-sharding-strategy: the release's default, and from 0.18 the
    distributed optimizer; priced exactly as the command line that says both."""
    from search.spec.cluster import parse_cluster
    from search.cli.import_cmd import predict
    line = _MLM + "--use-megatron-fsdp --ckpt-format fsdp_dtensor --bf16"
    cluster = parse_cluster("1x8-h100")
    imp = read_megatron(line, world_size=8, cluster=cluster, version=version)
    forced = imp.release.version >= (0, 18)
    assert imp.plan.megatron_fsdp.data_parallel_sharding_strategy == fsdp
    assert imp.plan.distributed_optimizer == forced
    explicit = read_megatron(line + f" --data-parallel-sharding-strategy {fsdp}"
                             + (" --use-distributed-optimizer" if forced else ""), world_size=8, cluster=cluster,
                             version=version)
    assert explicit.plan == imp.plan
    a, b = predict(imp.plan, None), predict(explicit.plan, None)
    assert (a.iteration_time_ms, a.stage_memory_mb) == (b.iteration_time_ms, b.stage_memory_mb)


def test_a_flag_of_another_release_is_refused_naming_the_releases_that_have_it():
    with pytest.raises(AcesoError) as e:
        read_megatron(_MLM + "--megatron-fsdp-main-params-dtype fp32", world_size=8, version="0.16")
    assert str(e.value) == ("megatron-lm arguments: --megatron-fsdp-main-params-dtype: not a flag of Megatron-LM core_v0.16.1 "
                            "(its parser exits on it: unrecognized arguments) (--megatron-fsdp-main-params-dtype is a "
                            "flag of core_v0.17.1, core_v0.18.2, core_v0.19.0: give --megatron-version 0.19 for a "
                            "script written for it)")
    with pytest.raises(AcesoError, match="--inference-max-batch-size: not a flag of Megatron-LM core_v0.19.0 .*; it "
                                         "is --inference-max-requests there"):
        read_megatron(_MLM + "--inference-max-batch-size 4", world_size=8)
    read_megatron(_MLM + "--use-megatron-fsdp --ckpt-format fsdp_dtensor --megatron-fsdp-main-params-dtype fp32",
                  world_size=8)                                                # a 0.19 flag: read


def test_valid_flags_aceso_does_not_price_are_kept_for_a_later_pricing():
    """2026 flags (CUDA graphs, overlaps, delayed wgrad): accepted, listed in the one warning, and readable from the
    import typed as the release's parser types them."""
    imp = read_megatron(_MLM + "--cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp "
                               "--delay-wgrad-compute --moe-deepep-num-sms 24", world_size=8)
    f = imp.flags
    assert f.get("--cuda-graph-impl") == "transformer_engine" and f.get("--cuda-graph-modules") == ["attn", "mlp"]
    assert f.get("--delay-wgrad-compute") is True and f.get("--moe-deepep-num-sms") == 24
    assert f.value("--cuda-graph-impl") == "transformer_engine" and f.value("--cuda-graph-warmup-steps") == 3
    assert f.value("--no-rope-fusion") is True and f.value("--tp-comm-overlap") is False      # store_false / _true
    assert read_megatron(_MLM + "--no-rope-fusion", world_size=8).flags.value("--no-rope-fusion") is False
    # the stack flags are priced now (issue 34: plan.stack); a flag nothing prices is still listed in the warning
    assert imp.plan.stack.cuda_graphs.impl == "transformer_engine" and imp.plan.stack.cuda_graphs.scope == ("attn", "mlp")
    # (--moe-flex-dispatcher-num-sms is read now: settings.moe.hybridep_num_sms)
    assert "--moe-deepep-num-sms" in imp.ignored and "--cuda-graph-impl" not in imp.ignored
    old = read_megatron(_MLM + "--cuda-graph-impl local --cuda-graph-scope attn", world_size=8, version="0.17")
    assert old.flags.get("--cuda-graph-scope") == ["attn"] and old.release.tag == "core_v0.17.1"


@pytest.mark.parametrize("tag", list(TAGS))
def test_every_exported_flag_is_a_flag_of_every_release(tag):
    """What the export writes, for every dense / GPT-OSS / T5 / precision case and every MoE / MLA / MTP case, is in
    the release's parser (argv refuses a flag the release lacks)."""
    rel = release(tag)
    plans = [case_plan(n) for n in sorted(CASES)] + [moe_case_plan(n) for n in sorted(MOE_CASES)]
    for plan in plans:
        words = argv(megatron_config(plan), rel)
        assert {w for w in words if w.startswith("--")} <= set(rel.flags)


# ----- search -> export -> import, under every release ---------------------------------------------------------
SEARCHES = {
    "dense": "--model gpt-1.3b --num-layers 4 --cluster 1x8-h100 --global-batch-size 64 --memory-limit-mib 3000",
    "moe": "--model qwen3-30b-a3b --num-layers 2 --cluster 1x8-h100 --global-batch-size 32",
    "fsdp": "--model llama3-8b --cluster 1x8-h100 --global-batch-size 128",
    "t5": "--model t5-770m --num-layers 2 --cluster 1x8-h100 --global-batch-size 32",
}


def _searched(d, tag: str) -> dict:
    """The SEARCHES, each priced for the software release of Megatron-LM ``tag`` (``--release``: what the import
    of a script read under ``--megatron-version tag`` prices it as, search/settings/releases.py)."""
    out = {}
    for kind, args in SEARCHES.items():
        path = d / f"{kind}.json"
        assert main(["search", *args.split(), "--target", "megatron-lm", "--budget-evals", "40", "--workers", "1",
                     "--release", tag, "-o", str(path)]) == 0
        out[kind] = path
    return out


@pytest.mark.parametrize("tag", list(TAGS))
def test_search_export_import_gives_the_same_model_and_price_under_every_release(tag, tmp_path, capsys):
    rel = release(tag)
    for kind, path in _searched(tmp_path, tag).items():
        plan = load_plan(path)
        assert (kind == "moe") == (plan.model.moe is not None) and (kind == "t5") == plan.model.is_t5
        assert (kind == "fsdp") <= (plan.megatron_fsdp is not None), kind
        script, back = tmp_path / f"{kind}.sh", tmp_path / f"{kind}.back.json"
        assert main(["export", str(path), "--megatron-version", tag, "-o", str(script)]) == 0
        text = script.read_text()
        assert f"# Arguments of Megatron-LM {tag} " in text
        cl = plan.cluster
        limit = ["--memory-limit-mib", str(cl.memory_limit_mb)] if cl.memory_limit_mb else []
        assert main(["import", str(script), "--from", "megatron-lm", "--megatron-version", tag, "--cluster",
                     cl.label, *limit, "-o", str(back)]) == 0
        err = capsys.readouterr().err
        assert "vocabulary" not in err, err               # the script's own tokenizer gives it (not a preset's)
        got = load_plan(back)
        assert got.model == plan.model, kind
        want = plan.model_dump(exclude={"predicted"})
        if plan.model.moe is not None and want["settings"]["moe"] is None:     # None: the defaults (moe_plan.py)
            want["settings"]["moe"] = MoEPlanSettings().model_dump()
        if plan.megatron_fsdp and rel.rule("fsdp_forces_distributed_optimizer"):
            want["settings"]["distributed_optimizer"] = True            # what 0.18+ runs; no price of its own under FSDP
        assert got.model_dump(exclude={"predicted"}) == want, kind
        p, q = plan.predicted, got.predicted
        assert q.iteration_time_ms == pytest.approx(p.iteration_time_ms, rel=1e-9, abs=1e-6), kind
        assert q.stage_memory_mb == pytest.approx(p.stage_memory_mb, rel=1e-9, abs=1e-6), kind


def test_exported_script_reads_back_without_extra_flags_for_a_model_no_preset_has(tmp_path, capsys):
    """A custom Llama-3-shaped model (no preset to fall back on for its vocabulary): the exported script's
    NullTokenizer gives the vocabulary back (before, bash's ${TOKENIZER_ARGS:-...} was read as one word and the
    import exited 2 asking for --vocab-size)."""
    from search.spec.plan import uniform_plan
    from search.spec.presets import load_model
    model = load_model("llama3-8b", num_layers=4).model_copy(update={"name": "custom", "aceso_db_key": None,
                                                                     "vocab_size": 100000})
    plan = uniform_plan(model, 1, 2, 4, 4, 64, cluster=__import__("search.spec.cluster").spec.cluster.parse_cluster("1x8-h100"))
    src, script, back = tmp_path / "p.json", tmp_path / "run.sh", tmp_path / "back.json"
    src.write_text(plan.to_json())
    assert main(["export", str(src), "-o", str(script)]) == 0
    assert main(["import", str(script), "--from", "megatron-lm", "-o", str(back)]) == 0, capsys.readouterr().err
    assert load_plan(back).model.vocab_size == 100000


def test_args_only_and_the_script_say_the_same_for_every_release(tmp_path, capsys):
    plan = case_plan("t5-tp2")
    src = tmp_path / "p.json"
    src.write_text(plan.to_json())
    for tag in TAGS:
        assert main(["export", str(src), "--megatron-version", tag, "--args-only"]) == 0
        words = shlex.split(capsys.readouterr().out)
        assert words == argv(megatron_config(plan), release(tag))
    assert json.loads(src.read_text())["model"]["name"] == plan.model.name
